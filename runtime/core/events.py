"""The run's append-only event log (``events.jsonl``).

One JSON object per line: ``{"t": wall seconds, "kind": ..., **fields}``.
Written by the controller (client side) only. Readers tolerate a torn last
line.

Contract of :class:`EventLog`:

* Each line is one ``os.write`` of the whole line on an ``O_APPEND`` file
  descriptor, so a crash loses nothing already recorded and lines of two
  writers never interleave.
* ``emit`` never raises on a write failure (``OSError``: a full disk, an I/O
  error). The first failure prints one warning on stderr naming the file and
  the error; from then on the log stops (later events are counted in
  :attr:`EventLog.dropped`, not written) so the log stays a faithful prefix
  of the run, never a log with a hole in the middle. Training goes on.
* A partial write is never continued: the torn tail is truncated back to the
  last complete line; where even that fails the log has stopped, so the torn
  line stays the last one (which readers skip).
* An event that does not match its kind's schema in :mod:`runtime.core.event_kinds`
  makes ``emit`` raise ``ValueError`` (and write nothing) in the test suite
  (``$ELASTIC_STRICT_EVENTS=1``); in a run it is written after one warning.
* Opening a log whose last line is torn (a writer crashed mid-line) cuts that
  line off first, so later lines never follow a torn one.
* :meth:`EventLog.close` of a log that dropped events tries to append one
  last ``events_dropped`` event (``count``, ``error``), for the case where the
  disk recovered; whoever renders the report at the end of the run should
  pass :attr:`EventLog.dropped` too, since that line may not make it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

from runtime.core.event_kinds import check_event

log = logging.getLogger("jax_elastic.events")

__all__ = ["EventLog", "read_events"]

_TAIL_CHUNK = 1 << 16


class EventLog:
    """The event log of one run; thread-safe. ``path=None`` records nothing (tests, dry runs)."""

    def __init__(self, path: str | os.PathLike | None, *, checked: bool | str | None = None):
        self.path = path
        #: How every event is checked against :data:`runtime.core.event_kinds.EVENT_KINDS` before it is written:
        #: ``"strict"`` (a bad event raises ``ValueError`` and is not written: the test suite, which sets
        #: ``$ELASTIC_STRICT_EVENTS=1`` for its processes), ``"warn"`` (one warning per kind, the event is
        #: written anyway: a bookkeeping bug must never end a training run), ``False`` (not checked: only the
        #: log's own I/O is under test, with made-up kinds). None: strict under that variable, else warn.
        if checked is None:
            checked = "strict" if os.environ.get("ELASTIC_STRICT_EVENTS") == "1" else "warn"
        self.checked = "strict" if checked is True else checked
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._fd: int | None = None
        #: Events not written because the log stopped after a write failure.
        self.dropped = 0
        #: The write failure that stopped the log, or None.
        self.error: OSError | None = None
        self._torn = False    # a torn tail could not be cut off: write nothing more
        self._listeners: list = []
        if path is not None:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._cut_torn_tail()
        self.t0 = time.time()

    def emit(self, kind: str, **fields) -> dict:
        """Appends one event (unless the log stopped); returns it. Never raises ``OSError``.

        ``t`` may be given among ``fields`` for an event recorded after the fact (the client records its
        ``job_started`` once it knows the attempt may start); by default it is now.

        An event its kind's schema (:data:`runtime.core.event_kinds.EVENT_KINDS`) does not allow (an unknown
        kind, a required field missing, a field not declared or of the wrong type, judged as written, after
        JSON encoding) is a bug in the caller: under ``checked="strict"`` it raises ``ValueError`` and
        nothing is written (the tests catch it; checked even when the log records nothing, ``path=None``);
        under ``"warn"`` it is written all the same after one warning for its kind.
        """
        event = {"t": time.time(), "kind": kind, **fields}
        text = json.dumps(event, sort_keys=False, default=_jsonable)
        written = json.loads(text) if self.checked or self._listeners else None
        if self.checked:
            try:
                check_event(written)
            except ValueError as e:
                if self.checked == "strict":
                    raise
                if kind not in self._warned:
                    self._warned.add(kind)
                    log.warning("event %r does not match its schema (written anyway): %s", kind, e)
        line = (text + "\n").encode("utf-8")
        with self._lock:
            if self._fd is not None:
                if self.error is not None:
                    self.dropped += 1
                else:
                    self._write(line)
            if written is not None:
                for listener in self._listeners:
                    listener(written)
        return event

    def fileno(self) -> int | None:
        """The descriptor the log writes to (None once closed): whose file it is, for a client checking that
        the run's log is still the one it writes."""
        return self._fd

    def subscribe(self, listener) -> None:
        """Calls ``listener(event)`` with every later event as written (JSON-decoded), in the order of the log,
        under the log's lock (so a listener sees the events in the file's order; it must be quick and must not
        emit). Called even when the log records nothing or stopped after a write failure."""
        with self._lock:
            self._listeners.append(listener)

    def unsubscribe(self, listener) -> None:
        """Stops calling ``listener`` (no error when it was not subscribed)."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def close(self) -> None:
        """Closes the file; a log that dropped events first tries to say so in a last line."""
        with self._lock:
            if self._fd is None:
                return
            if self.dropped and not self._torn:
                line = json.dumps({"t": time.time(), "kind": "events_dropped", "count": self.dropped,
                                   "error": _describe(self.error)}) + "\n"
                try:
                    data = line.encode("utf-8")
                    n = os.write(self._fd, data)
                    if n != len(data):
                        self._cut(n)   # only the bytes this write added: the lines before stay whole
                except OSError:
                    pass   # the disk is still full: the run's report gets the count from ``dropped``
            os.close(self._fd)
            self._fd = None

    # -- private ---------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        try:
            n = os.write(self._fd, data)
        except OSError as e:   # nothing was written
            self._stop(e)
            return
        if n != len(data):
            self._stop(OSError(f"short write ({n} of {len(data)} bytes)"))
            self._cut(n)

    def _stop(self, error: OSError, lost: int = 1) -> None:
        self.error = error
        self.dropped += lost
        try:
            print(f"jax-elastic: warning: cannot write the event log {os.fspath(self.path)}: {_describe(error)}; "
                  "training continues, later events are not recorded", file=sys.stderr)
        except (OSError, ValueError):
            pass   # stderr itself is gone; the count in ``dropped`` still reaches the report

    def _cut(self, n: int) -> None:
        """Truncates the ``n`` bytes a partial last write added (never more: what was there before stays
        whole); if that fails, nothing is written again."""
        if n <= 0:
            return
        try:
            os.ftruncate(self._fd, os.fstat(self._fd).st_size - n)
        except OSError:
            self._torn = True

    def _cut_torn_tail(self) -> None:
        """Cuts an incomplete last line (a writer died mid-line) so new lines do not follow it."""
        size = os.fstat(self._fd).st_size
        if size == 0:
            return
        with open(os.fspath(self.path), "rb") as f:
            end = size
            while end > 0:
                start = max(0, end - _TAIL_CHUNK)
                f.seek(start)
                chunk = f.read(end - start)
                if end == size and chunk.endswith(b"\n"):
                    return
                newline = chunk.rfind(b"\n")
                if newline >= 0:
                    end = start + newline + 1
                    break
                end = start
        try:
            os.ftruncate(self._fd, end)
        except OSError as e:
            self._torn = True
            self._stop(e, lost=0)


def _describe(error: OSError | None) -> str:
    if error is None:
        return ""
    return f"{error.strerror} (errno {error.errno})" if error.strerror else str(error)


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def read_events(path: str | os.PathLike) -> list[dict]:
    """All complete events of a log; a torn final line (crash mid-write) is skipped.

    Every event is written with its newline in one write, so a torn line is
    the last one, cut short before its newline; it is skipped when it is not
    UTF-8 (cut inside a character) or not JSON. Any other line that is not one
    JSON object in UTF-8 raises ``ValueError`` naming the file and the line
    (1-based); blank lines are skipped.
    """
    out = []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    for i, raw in enumerate(lines):
        torn = i == len(lines) - 1   # no newline after it (a complete log ends with one, then b"")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if torn:
                break
            raise ValueError(f"{path}: line {i + 1} is not UTF-8 ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            if torn:
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON") from None
        if not isinstance(event, dict):
            raise ValueError(f"{path}: line {i + 1} is not a JSON object (a {type(event).__name__})")
        out.append(event)
    return out
