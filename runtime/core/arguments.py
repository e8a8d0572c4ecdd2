"""Command-line value types shared by the worker's command line (``runtime.worker.worker_process``) and
``elastic worker``, which parses its flags before JAX may start (this module imports no JAX)."""

from __future__ import annotations

import argparse

__all__ = ["positive_seconds"]


def positive_seconds(text: str) -> float:
    """An ``argparse`` type: a wait in seconds, finite and > 0 (else the one-line usage error names the value)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return seconds
