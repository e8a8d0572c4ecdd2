"""The run directory's client record: which client drives the run, so a restarted one can take it back.

``client.json`` (world-readable: no secret in it) names the run id the
workers serve, the client generation, the controller's address and the
client's pid and host. Each client of the run writes it when it starts
(atomically: a temporary file renamed over it), with a generation one above
the record it found, so the generations of a run's clients only grow; a
restarted client reads it to find the run it re-attaches
(:mod:`runtime.control.attach`). The run secret of a run whose workers this
process launched is kept beside it in ``.secret``, readable by its owner only
(mode 0600); for workers started by someone else it stays where the user put
it (``$ELASTIC_RUN_SECRET``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import socket
import time

__all__ = ["ClientRecord", "RECORD_NAME", "SECRET_NAME", "read", "read_secret", "write"]

RECORD_NAME = "client.json"
SECRET_NAME = ".secret"


@dataclasses.dataclass(frozen=True)
class ClientRecord:
    run_id: str
    generation: int
    controller: str = ""
    pid: int = 0
    host: str = ""
    t: float = 0.0


def read(run_dir: pathlib.Path) -> ClientRecord | None:
    """The record the run directory holds; None when there is none (or it cannot be read: a restart then
    starts the run as without one, from its checkpoint)."""
    try:
        raw = json.loads((pathlib.Path(run_dir) / RECORD_NAME).read_text())
        return ClientRecord(run_id=str(raw["run_id"]), generation=int(raw["generation"]),
                            controller=str(raw.get("controller", "")), pid=int(raw.get("pid", 0)),
                            host=str(raw.get("host", "")), t=float(raw.get("t", 0.0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write(run_dir: pathlib.Path, record: ClientRecord, secret: str = "") -> None:
    """Replaces the record (and, with ``secret``, the secret file, mode 0600) atomically."""
    run_dir = pathlib.Path(run_dir)
    if secret:
        _replace(run_dir / SECRET_NAME, secret.encode(), 0o600)
    body = dataclasses.asdict(dataclasses.replace(record, host=record.host or socket.gethostname(),
                                                  t=record.t or time.time()))
    _replace(run_dir / RECORD_NAME, (json.dumps(body) + "\n").encode(), 0o644)


def read_secret(run_dir: pathlib.Path) -> str:
    """The run secret kept for a restarted client ("" when none is kept, or it is readable by others: a
    secret another user could read is not used)."""
    path = pathlib.Path(run_dir) / SECRET_NAME
    try:
        if path.stat().st_mode & 0o077:
            return ""
        return path.read_text().strip()
    except OSError:
        return ""


def _replace(path: pathlib.Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)   # whatever the umask
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
