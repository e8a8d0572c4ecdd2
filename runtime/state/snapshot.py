"""In-memory snapshots: a worker's state kept in its host's RAM, outside the worker process.

A snapshot is one file, ``<step>.snap``, in a directory on the host's
memory-backed file system (``/dev/shm`` where it exists, see
:func:`default_root`), so it survives the death of the process that wrote
it: a worker relaunched on the same host reads it back. One copy also goes
to another host (the writer streams the file to a peer worker, which stores
it in its own host's directory: :meth:`SnapshotStore.receive`), so a
snapshot also survives the loss of the host that made it.

The file holds the same record as a persistent checkpoint
(:func:`runtime.state.checkpoint_record.make_record`: step, digest, leaf layout,
metadata) followed by the raw bytes of every leaf::

    MAGIC | header length (8 bytes, little endian) | header (JSON record) | leaf bytes, in order

A file is written under a temporary name and renamed once complete, so a
snapshot cut off by a crash is never listed as complete; reading checks the
record, the length and the digest
(:func:`runtime.state.checkpoint_record.verified`), and
:meth:`SnapshotStore.restore_newest_valid` passes over a corrupt one for the
next older, as the checkpoint store does. Only the newest ``keep`` snapshots
stay (RAM is the scarce resource here).

The interface is :class:`runtime.state.checkpoint.CheckpointStore`'s (``save``,
``wait``, ``steps``, ``leftovers``, ``cleanup``, ``restore``,
``restore_newest_valid``), so the worker's background writer
(:class:`runtime.worker.saver.CheckpointWriter`) writes both.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator

import numpy as np

from runtime.state.checkpoint_record import (CheckpointCorruptError, CheckpointNotFoundError, Restored, Skipped,
                                       check_record, make_record, newest_valid, verified)

__all__ = ["MAGIC", "SnapshotStore", "default_root", "host_directory"]

MAGIC = b"JAX-ELASTIC-SNAPSHOT\n"
_HEAD = len(MAGIC) + 8
_NAME = re.compile(r"(0|[1-9][0-9]*)\.snap")
_PARTIAL = re.compile(r"\.(0|[1-9][0-9]*)\.snap\.[0-9a-f]+\.part")
#: Snapshots kept per directory: the newest and the one before (a recovery may want the older one when the
#: newest is past the committed step).
KEEP = 2
_MAX_HEADER = 64 << 20


def default_root() -> str:
    """Where snapshots live when ``elastic_snapshot_directory`` is not set: ``/dev/shm`` (memory) when this
    host has it, else the temporary directory."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, "jax-elastic-snapshots")


def host_directory(run_root: str, host: str) -> str:
    """The directory of one host's snapshots under a run's snapshot root (one directory per host, so that
    simulated hosts sharing a machine keep apart)."""
    if not host or "/" in host or host in (".", ".."):
        raise ValueError(f"a host name must be a non-empty name without '/', got {host!r}")
    return os.path.join(run_root, host)


class SnapshotStore:
    """The snapshots in one directory of this host (see the module docstring). Thread-safe."""

    def __init__(self, directory: str, *, keep: int = KEEP):
        if not directory:
            raise ValueError("a snapshot directory must be named")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._dir = directory
        self.keep = keep
        self._lock = threading.Lock()

    @property
    def directory(self) -> str:
        return self._dir

    def path(self, step: int) -> str:
        return os.path.join(self._dir, f"{int(step)}.snap")

    # -- writing ---------------------------------------------------------------

    def save(self, step: int, leaves, *, digest: str, metadata: dict | None = None) -> None:
        """Writes the snapshot of ``step`` (complete when this returns), then drops all but the newest ``keep``.
        ``digest``: :func:`runtime.state.state_copy.state_digest` of ``leaves`` (recorded, checked by every read)."""
        step, leaves, record = make_record(step, leaves, digest=digest, metadata=metadata)
        header = json.dumps(record, allow_nan=False).encode()
        with self._writing(step) as w:
            f = w.file
            f.write(MAGIC + len(header).to_bytes(8, "little") + header)
            for x in leaves:
                f.write(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
        self._prune()

    def wait(self, timeout: float | None = None) -> None:
        """Nothing to wait for: :meth:`save` is synchronous (the caller's thread is the background)."""

    def receive(self, pieces: Iterable[tuple[int, int, bytes]]) -> int:
        """Stores a copy streamed from another host: ``(step, total bytes, data)`` pieces in order; returns the
        step. The copy is listed only once every byte arrived and its header reads as a snapshot of that
        step; an interrupted or malformed stream leaves nothing behind and raises ValueError."""
        step = total = None
        got = 0
        with self._writing(None) as w:
            f = w.file
            for s, n, data in pieces:
                if step is None:
                    if isinstance(s, bool) or not isinstance(s, int) or s < 0 or n < _HEAD:
                        raise ValueError(f"a snapshot copy must start with a step >= 0 and a size, got {s!r}, {n!r}")
                    step, total = s, n
                elif (s, n) != (step, total):
                    raise ValueError(f"a snapshot copy changed its step or size mid-stream ({s}, {n})")
                got += len(data)
                if got > total:
                    raise ValueError(f"the copy of snapshot {step} is longer than the {total} bytes announced")
                f.write(data)
            if step is None or got != total:
                raise ValueError(f"the copy of snapshot {step} ended after {got} of {total} bytes")
            f.flush()
            f.seek(0)
            check_record(_read_header(f, f.name), step, f.name)
            w.rename_to = self.path(step)
        self._prune()
        return step

    def pieces(self, step: int, piece_bytes: int = 1 << 20) -> Iterator[tuple[int, int, bytes]]:
        """The snapshot of ``step`` as ``(step, total bytes, data)`` pieces, for :meth:`receive` on another
        host. Raises :class:`CheckpointNotFoundError` when it is not here."""
        try:
            f = open(self.path(step), "rb")
        except FileNotFoundError:
            raise CheckpointNotFoundError(self._dir, step, f"snapshots here: {self.steps() or 'none'}") from None
        with f:
            total = os.fstat(f.fileno()).st_size
            while data := f.read(piece_bytes):
                yield step, total, data

    # -- listing ---------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps of every complete snapshot here, ascending."""
        return sorted(int(m.group(1)) for name in self._names() if (m := _NAME.fullmatch(name)))

    def leftovers(self) -> list[str]:
        """Paths of writes cut off before they completed (what :meth:`cleanup` removes)."""
        return sorted(os.path.join(self._dir, n) for n in self._names() if _PARTIAL.fullmatch(n))

    def cleanup(self) -> list[str]:
        """Removes the leftovers of cut-off writes; returns their paths. Call it only while nobody writes here."""
        removed = self.leftovers()
        for p in removed:
            _remove(p)
        return removed

    def remove_all(self) -> None:
        """Removes this directory and every snapshot in it (the run is over: the RAM is given back), and the
        run's directory above it once no other host's is left there."""
        shutil.rmtree(self._dir, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(os.path.abspath(self._dir)))
        except OSError:
            pass   # another host's snapshots are still there (or it is gone already)

    # -- reading ---------------------------------------------------------------

    def restore(self, step: int | None = None) -> Restored:
        """Reads and verifies the snapshot of ``step`` (default: the newest); errors as the checkpoint store's."""
        steps = self.steps()
        if step is None:
            if not steps:
                raise CheckpointNotFoundError(self._dir, None, "no snapshot was written here")
            step = steps[-1]
        elif step not in steps:
            raise CheckpointNotFoundError(self._dir, step, f"snapshots here: {steps or 'none'}")
        return self._read(int(step))

    def restore_newest_valid(self, at_most: int | None = None) -> tuple[Restored, list[Skipped]]:
        """The newest snapshot (at ``at_most`` or before) that reads and verifies, and the newer ones passed
        over (newest first, with the reason). Raises :class:`CheckpointNotFoundError` when none is usable."""
        return newest_valid(self._dir, self.steps(), self._read, at_most, "no snapshot was written here")

    def _read(self, step: int) -> Restored:
        path = self.path(step)
        try:
            with open(path, "rb") as f:
                record = _read_header(f, path)
                layout = check_record(record, step, path)
                sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in layout]
                body = bytearray(sum(sizes))
                got = f.readinto(body)
                extra = len(f.read(1))
        except OSError as e:
            raise CheckpointCorruptError(path, f"it cannot be read ({type(e).__name__}: {e})") from e
        if got != len(body) or extra:
            raise CheckpointCorruptError(path, f"it holds {got + extra}{'+' * extra} bytes of leaves, "
                                               f"its record {len(body)}")
        leaves, at = [], 0
        for (shape, dtype), n in zip(layout, sizes):
            leaves.append(np.frombuffer(body, dtype, count=math.prod(shape), offset=at).reshape(shape))
            at += n
        return verified(step, leaves, layout, record, path)

    # -- helpers ---------------------------------------------------------------

    def _names(self) -> list[str]:
        try:
            return os.listdir(self._dir)
        except FileNotFoundError:
            return []

    def _writing(self, step: int | None) -> "_Writing":
        return _Writing(self._dir, self.path(step) if step is not None else None)

    def _prune(self) -> None:
        with self._lock:
            for s in self.steps()[:-self.keep]:
                _remove(self.path(s))


class _Writing:
    """A file written under a temporary name in ``directory`` and renamed to ``rename_to`` when the block ends
    without an error (set ``rename_to`` inside the block when the final name is known late); removed otherwise."""

    def __init__(self, directory: str, rename_to: str | None):
        self.directory, self.rename_to = directory, rename_to

    def __enter__(self):
        os.makedirs(self.directory, exist_ok=True)
        stem = os.path.basename(self.rename_to) if self.rename_to else "0.snap"
        self.tmp = os.path.join(self.directory, f".{stem}.{uuid.uuid4().hex}.part")
        self.file = open(self.tmp, "w+b")
        return self

    def __exit__(self, exc_type, exc, tb):
        self.file.close()
        if exc_type is None and self.rename_to:
            os.replace(self.tmp, self.rename_to)
        else:
            _remove(self.tmp)
        return False


def _read_header(f, path: str) -> dict:
    head = f.read(_HEAD)
    if len(head) < _HEAD or not head.startswith(MAGIC):
        raise CheckpointCorruptError(path, "it is not a jax-elastic snapshot (no header)")
    n = int.from_bytes(head[len(MAGIC):], "little")
    if n > _MAX_HEADER:
        raise CheckpointCorruptError(path, f"its header claims {n} bytes")
    raw = f.read(n)
    try:
        return json.loads(raw)
    except ValueError as e:
        raise CheckpointCorruptError(path, f"its header is not JSON ({e})") from e


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
