"""Persistent checkpoints of one replica's state, with orbax, on a local disk or GCS.

Contract:

* A checkpoint is the state of one replica after ``step`` applied steps
  (``step`` is also the data position): its leaves as full, unsharded host
  arrays (any mesh can load them; resharding is the caller's concern), the
  :func:`runtime.state.state_copy.state_digest` digest of those leaves, and the
  caller's JSON metadata (by convention ``"fingerprint"``: which programs
  wrote it). Dtypes, shapes and bits come back exactly, bfloat16 included.
  The record of them (step, digest, leaf layout, metadata) and its checks
  are :mod:`runtime.state.checkpoint_record`'s; orbax writes the record and the
  leaves and reads them back (:mod:`runtime.state.checkpoint_orbax`); which entries
  of the directory are checkpoints, and removing them, is
  :mod:`runtime.state.checkpoint_storage`'s. This module is the store: one save in
  flight, its errors, pruning, listing and choosing what to restore.
* :meth:`CheckpointStore.save` returns at once: it does no I/O and copies
  nothing (the leaves must not change until the save is finished; the
  runtime never changes a state in place, and :meth:`restore` would catch
  it: the digest is checked on every read). A background thread writes the
  checkpoint with orbax and commits it. At most one save is in flight: the
  next :meth:`save` first waits for the previous one.
* A failed background save is never swallowed: :meth:`wait` or the next
  :meth:`save` raises it (once) as :class:`CheckpointSaveError`, or as
  :class:`CheckpointPruneError` when the checkpoint was committed but an old
  one could not be removed.
* Only complete checkpoints exist for readers. Orbax's commit protocol: the
  step is written under a temporary name (``<step>.orbax-checkpoint-tmp`` on
  a local disk) or in place on GCS, and ``commit_success.txt`` is written
  last inside it, then (local disk) the directory is renamed to ``<step>``.
  :meth:`steps` lists a step only when its directory is named ``<step>``
  and holds that file, so a save interrupted at any point (an error, a
  crash, ``kill -9``) is never listed nor restored. Removing a checkpoint
  (``max_to_keep``, or saving the same step again) first takes it out of
  that listing (local: a rename to a temporary name; GCS: its commit file
  goes first), so an interrupted removal leaves a leftover, never a listed
  checkpoint with missing files. :meth:`cleanup` removes leftovers.
* :meth:`restore` verifies what it read (every leaf's dtype and shape
  against the record, the digest against the recorded one) and raises
  :class:`CheckpointCorruptError` naming the checkpoint's path when it
  cannot read it or the check fails; :meth:`restore_newest_valid` then
  falls back to the next older complete checkpoint and says which it
  skipped and why.
* ``gs://bucket/path`` directories go through orbax's own GCS access:
  tensorstore for the arrays, gcsfs (through etils.epath) for directories
  and small files, google-cloud-storage for orbax's bucket checks. With a
  GCS endpoint (``gcs_endpoint``, else ``$STORAGE_EMULATOR_HOST``, else the
  real GCS) all three are pointed at it, for this process and the processes
  it starts: see :func:`runtime.state.checkpoint_storage.use_gcs_endpoint`.

One process writes a given step at a time (the controller picks the
writer); readers may be other processes. Saving and restoring import orbax
(and so JAX); listing (:meth:`~CheckpointStore.steps`,
:meth:`~CheckpointStore.leftovers`, :meth:`~CheckpointStore.cleanup`) does
not, so a controller can list without them.
"""

from __future__ import annotations

import threading

import numpy as np

from runtime.state import checkpoint_orbax
from runtime.state.checkpoint_record import (CheckpointError, CheckpointNotFoundError, Restored, Skipped, _describe,
                                       make_record, newest_valid)
from runtime.state.checkpoint_storage import (COMMIT_FILE, checked_directory, discard, entries, foreign,
                                             forget_listings, rmtree, step_of)
from runtime.state.checkpoint_tree import CheckpointTree

__all__ = ["CheckpointPruneError", "CheckpointSaveError", "CheckpointStore", "CheckpointTimeoutError"]


# -- errors --------------------------------------------------------------------


class CheckpointSaveError(CheckpointError):
    """A save failed (in the background, reported by the next ``wait``/``save``); nothing was committed."""

    def __init__(self, path: str, step: int, reason: str):
        super().__init__(path, step, reason)
        self.path, self.step, self.reason = path, step, reason

    def __str__(self) -> str:
        return f"checkpoint of step {self.step} to {self.path} failed: {self.reason}"


class CheckpointPruneError(CheckpointError):
    """A checkpoint was committed, but removing an older one (``max_to_keep``) failed."""

    def __init__(self, path: str, step: int, reason: str):
        super().__init__(path, step, reason)
        self.path, self.step, self.reason = path, step, reason

    def __str__(self) -> str:
        return f"checkpoint of step {self.step} is committed, but removing {self.path} failed: {self.reason}"


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A save was still running at the deadline (it goes on in the background)."""

    def __init__(self, path: str, step: int, seconds: float):
        super().__init__(path, step, seconds)
        self.path, self.step, self.seconds = path, step, seconds

    def __str__(self) -> str:
        return f"checkpoint of step {self.step} to {self.path} still running after {self.seconds:g} s"


# -- the store -----------------------------------------------------------------


class CheckpointStore:
    """Checkpoints of one run's replica state in ``directory`` (a local path or ``gs://bucket/path``).

    ``max_to_keep``: after each save commits, only the newest this many
    complete checkpoints (by step) are kept, the one just saved always among
    them; None keeps every one. ``async_save=False`` makes :meth:`save`
    block until the checkpoint is committed (and raise its error itself).
    ``timeout_s`` bounds every wait for a save (:meth:`save` waiting for the
    previous one, :meth:`cleanup`, :meth:`close`). ``gcs_endpoint``: see
    :func:`runtime.state.checkpoint_storage.checked_directory` (default
    ``$STORAGE_EMULATOR_HOST``, else GCS).

    The constructor does no I/O (the directory is created by the first
    save), so a reader is cheap to make. One thread saves; :meth:`steps` and
    :meth:`restore` may be called from any thread.
    """

    def __init__(self, directory: str, *, max_to_keep: int | None = None, async_save: bool = True,
                 timeout_s: float = 600.0, gcs_endpoint: str | None = None, tree: CheckpointTree | None = None,
                 layout=None):
        from etils import epath

        directory, self._gcs = checked_directory(str(directory), gcs_endpoint)
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1 (or None: keep all), got {max_to_keep}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._dir = epath.Path(directory.rstrip("/"))
        self.max_to_keep = max_to_keep
        self.async_save = async_save
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()                # one save at a time
        self._thread: threading.Thread | None = None
        self._saving: tuple[int, str] | None = None  # (step, path) of the save in flight or not yet reported
        self._error: CheckpointError | None = None
        self.tree, self.layout = tree, layout   # how leaves are named (None: a flat list), the state's layout

    @property
    def directory(self) -> str:
        return str(self._dir)

    def path(self, step: int) -> str:
        """Where the checkpoint of ``step`` this store writes is (or would be)."""
        return str(self._dir / str(step))

    def _location(self, step: int):
        """Where the complete checkpoint of ``step`` is: this store's own ``<step>``, else one MaxText's
        trainer wrote (``<step - 1>``: see :func:`~runtime.state.checkpoint_storage.step_of`); None if neither."""
        own = self._dir / str(step)
        if (own / COMMIT_FILE).exists() and not foreign(own):
            return own
        theirs = self._dir / str(step - 1)
        if step >= 1 and (theirs / COMMIT_FILE).exists() and foreign(theirs):
            return theirs
        return None

    @property
    def saving(self) -> int | None:
        """The step whose save is still running in the background (None when none is)."""
        thread, saving = self._thread, self._saving
        return saving[0] if saving is not None and thread is not None and thread.is_alive() else None

    # -- writing ---------------------------------------------------------------

    def save(self, step: int, leaves, *, digest: str, metadata: dict | None = None) -> None:
        """Starts writing ``leaves`` (the state after ``step`` applied steps) as the checkpoint of ``step``.

        ``digest``: :func:`runtime.state.state_copy.state_digest` of ``leaves``
        (recorded, and checked by every restore). ``metadata``: JSON-able
        (``"fingerprint"``: the programs; ``"step"`` and ``"created"`` are
        the store's). Waits for the previous save first and raises its error
        (:class:`CheckpointSaveError`), if it failed. A checkpoint of the
        same step already there is replaced (a run is deterministic: the
        same step is the same state).
        """
        step, leaves, record = make_record(step, leaves, digest=digest, metadata=metadata)
        with self._lock:
            self._join(self.timeout_s)
            path = self.path(step)
            self._saving = (step, path)
            if self.async_save:
                self._thread = threading.Thread(target=self._write, args=(step, leaves, record),
                                                name=f"checkpoint-save-{step}")
                self._thread.start()
            else:
                self._write(step, leaves, record)
                self._join(self.timeout_s)

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the save in flight is committed (or failed: raises its error, once).

        ``timeout`` seconds (default: the store's ``timeout_s``), then
        :class:`CheckpointTimeoutError`; the save goes on.
        """
        with self._lock:
            self._join(self.timeout_s if timeout is None else timeout)

    def close(self) -> None:
        """Waits for the save in flight (raising its error)."""
        self.wait()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _join(self, timeout: float) -> None:
        """With the lock held: waits for the background save; raises its error once."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                step, path = self._saving
                raise CheckpointTimeoutError(path, step, timeout)
            self._thread = None
        self._saving = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _write(self, step: int, leaves: list[np.ndarray], record: dict) -> None:
        """The save itself (the background thread, or the caller with ``async_save=False``)."""
        path = self.path(step)
        try:
            forget_listings(self._dir)
            self._dir.mkdir(parents=True, exist_ok=True)
            discard(self._dir, step, self._gcs)   # an earlier save of this step, complete or not
            checkpoint_orbax.write(self._dir / str(step), leaves, record, self.tree)
        except Exception as e:  # noqa: BLE001 - handed to wait()/save(), which raise it
            self._error = CheckpointSaveError(path, step, _describe(e))
            self._error.__cause__ = e
            return
        try:
            self._prune(keep=step)
        except Exception as e:  # noqa: BLE001 - handed to wait()/save(), which raise it
            self._error = CheckpointPruneError(self.directory, step, _describe(e))
            self._error.__cause__ = e

    def _prune(self, keep: int) -> None:
        if self.max_to_keep is None:
            return
        steps = sorted(int(p.name) for p, complete in entries(self._dir) if complete and not foreign(p))   # own
        newest = set(steps[-self.max_to_keep:]) | {keep}
        for s in steps:
            if s not in newest:
                discard(self._dir, s, self._gcs)

    # -- listing ---------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps of every complete (committed) checkpoint, ascending, MaxText's own among them
        (:func:`~runtime.state.checkpoint_storage.step_of`); reads the storage each call."""
        return sorted({step_of(p) for p, complete in entries(self._dir) if complete})

    def step_held(self, name: str) -> int | None:
        """The step the entry ``name`` (``<d>``) holds when it is a complete checkpoint (:func:`step_of`), else
        None."""
        path = self._dir / name
        return step_of(path) if name.isdigit() and (path / COMMIT_FILE).exists() else None

    def leftovers(self) -> list[str]:
        """Paths of interrupted saves and removals (what :meth:`cleanup` would remove)."""
        return sorted(str(p) for p, complete in entries(self._dir) if not complete)

    def cleanup(self) -> list[str]:
        """Removes the leftovers of interrupted saves and removals; returns their paths.

        Waits for this store's own save first (raising its error). Call it
        only while no other process saves into this directory: a save in
        flight looks like a leftover.
        """
        with self._lock:
            self._join(self.timeout_s)
            removed = [p for p, complete in entries(self._dir) if not complete]
            for p in removed:
                rmtree(p)
            return sorted(str(p) for p in removed)

    # -- reading ---------------------------------------------------------------

    def restore(self, step: int | None = None) -> Restored:
        """Reads and verifies the checkpoint of ``step`` (default: the newest complete one).

        Raises :class:`CheckpointNotFoundError` when that step has no
        complete checkpoint, :class:`CheckpointCorruptError` (naming its
        path) when it cannot be read or fails verification.
        """
        if step is None:
            steps = self.steps()
            if not steps:
                raise CheckpointNotFoundError(self.directory, None, "none was ever committed here")
            step = steps[-1]
        else:
            forget_listings(self._dir)
            if self._location(int(step)) is None:
                raise CheckpointNotFoundError(self.directory, step, f"complete ones: {self.steps() or 'none'}")
        return self._read(int(step))

    def restore_newest_valid(self, at_most: int | None = None) -> tuple[Restored, list[Skipped]]:
        """The newest complete checkpoint (at step ``at_most`` or before) that reads and verifies.

        Returns it and the newer complete ones it skipped, newest first, each
        with the reason. Raises :class:`CheckpointNotFoundError` when none is
        usable (its reason lists every skipped one).
        """
        return newest_valid(self.directory, self.steps(), self._read, at_most, "none was ever committed here")

    def _read(self, step: int) -> Restored:
        location = self._location(step)
        if location is None:
            raise CheckpointNotFoundError(self.directory, step, f"complete ones: {self.steps() or 'none'}")
        return checkpoint_orbax.read(location, step, self.tree, self.layout)
