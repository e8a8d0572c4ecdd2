"""Integrations of jax-elastic with other trainers (MaxText). Imports ``elastic``."""

__all__: list[str] = []
