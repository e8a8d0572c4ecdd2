"""Command-line value types shared by the worker's command line (``runtime.worker.worker_process``) and
``elastic worker``, which parses its flags before JAX may start (this module imports no JAX)."""

from __future__ import annotations

import argparse

__all__ = ["positive_seconds", "slice_flags_problem"]


def positive_seconds(text: str) -> float:
    """An ``argparse`` type: a wait in seconds, finite and > 0 (else the one-line usage error names the value)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return seconds


def slice_flags_problem(hosts: int, host: int, coordinator: str) -> str:
    """Why a worker's ``--slice-hosts``, ``--slice-host`` and ``--slice-coordinator`` do not make it one host of a
    slice ("" when they do, or name no slice of several), in one line naming the flag. Pure."""
    if hosts < 1:
        return f"--slice-hosts must be >= 1, got {hosts}"
    if not 0 <= host < hosts:
        return f"--slice-host {host} is not a host of a slice of --slice-hosts {hosts} (0..{hosts - 1})"
    if hosts == 1:
        return "--slice-coordinator needs --slice-hosts > 1" if coordinator else ""
    name, colon, port = coordinator.rpartition(":")
    if not coordinator:
        return (f"--slice-hosts {hosts} needs --slice-coordinator HOST0:PORT: where host 0 of the slice serves its "
                "JAX coordinator, the same on every host of the slice")
    if not colon or not name or not port.isdigit() or not 0 < int(port) < 65536:
        return f"--slice-coordinator must be HOST0:PORT with a port 1..65535, got {coordinator!r}"
    return ""
