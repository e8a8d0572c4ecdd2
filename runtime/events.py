"""The run's append-only event log (``events.jsonl``).

One JSON object per line: ``{"t": wall seconds, "kind": ..., **fields}``.
Written by the controller only; flushed per line so a crash loses nothing
already recorded. Readers tolerate a torn last line.
"""

from __future__ import annotations

import json
import os
import threading
import time

__all__ = ["EventLog", "read_events"]


class EventLog:
    def __init__(self, path: str | os.PathLike | None):
        self.path = path
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8") if path is not None else None
        self.t0 = time.time()

    def emit(self, kind: str, **fields) -> dict:
        event = {"t": time.time(), "kind": kind, **fields}
        line = json.dumps(event, sort_keys=False, default=_jsonable)
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()
        return event

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def read_events(path: str | os.PathLike) -> list[dict]:
    """All complete events of a log; a torn final line (crash mid-write) is skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i >= len(lines) - 2:
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    return out
