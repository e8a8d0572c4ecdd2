"""Fault injection and the chaos verdict. Imports ``runtime`` (and ``elastic`` to run jobs)."""

__all__: list[str] = []
