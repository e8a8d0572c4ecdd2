"""Persistent checkpoints of one replica's state, with orbax, on a local disk or GCS.

Contract:

* A checkpoint is the state of one replica after ``step`` applied steps
  (``step`` is also the data position): its leaves as full, unsharded host
  arrays (any mesh can load them; resharding is the caller's concern), the
  :func:`runtime.state_copy.state_sha256` digest of those leaves, and the
  caller's JSON metadata (by convention ``"fingerprint"``: which programs
  wrote it). Dtypes, shapes and bits come back exactly, bfloat16 included.
  The record of them (step, digest, leaf layout, metadata) and its checks
  are :mod:`runtime.checkpoint_record`'s; this module writes the record and
  the leaves with orbax and reads them back.
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
  it starts: see :func:`use_gcs_endpoint`.

One process writes a given step at a time (the controller picks the
writer); readers may be other processes. Saving and restoring import orbax
(and so JAX); listing (:meth:`~CheckpointStore.steps`,
:meth:`~CheckpointStore.leftovers`, :meth:`~CheckpointStore.cleanup`) does
not, so a controller can list without them.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
import time

import numpy as np

from runtime.checkpoint_record import (CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, Restored,
                                       Skipped, _describe, check_record, make_record, newest_valid, verified)

__all__ = [
    "CheckpointPruneError",
    "CheckpointSaveError",
    "CheckpointStore",
    "CheckpointTimeoutError",
    "GCS_ENDPOINT_ENV",
    "directory_problem",
    "use_gcs_endpoint",
]

#: The environment variable naming a GCS endpoint (an emulator) when ``gcs_endpoint`` is not given;
#: google-cloud-storage and gcsfs read it too.
GCS_ENDPOINT_ENV = "STORAGE_EMULATOR_HOST"

_STATE, _META = "state", "meta"
_COMMIT_FILE = "commit_success.txt"          # the commit marker (orbax.checkpoint.path.atomicity.COMMIT_SUCCESS_FILE)
_TMP_SUFFIX = ".orbax-checkpoint-tmp"        # orbax's temporary-name suffix (atomicity.TMP_DIR_SUFFIX)
_STEP_NAME = re.compile(r"0|[1-9][0-9]*")


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


# -- GCS endpoint --------------------------------------------------------------


def use_gcs_endpoint(url: str) -> None:
    """Points every GCS client orbax uses at ``url`` (``http://host:port``, e.g. an emulator), process-wide.

    GCS access in orbax has no per-call endpoint: tensorstore reads
    ``TENSORSTORE_GCS_HTTP_URL`` when it opens a store, gcsfs and
    google-cloud-storage read ``STORAGE_EMULATOR_HOST`` on each request. Both
    are set here (children inherit them); tensorstore gets a fixed test
    token and gcsfs anonymous access, so neither looks for credentials (an
    emulator checks none), and gcsfs skips its zonal-bucket probe through
    the Storage Control API, which emulators do not serve.
    """
    if not re.fullmatch(r"https?://[^/\s]+/?", url):
        raise ValueError(f"gcs_endpoint must look like http://host:port, got {url!r}")
    url = url.rstrip("/")
    os.environ[GCS_ENDPOINT_ENV] = url
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = url
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import fsspec

    fsspec.config.conf.setdefault("gcs", {})["token"] = "anon"
    # The zonal/HNS subclass is chosen when gcsfs is imported; whatever was imported, use the plain one.
    fsspec.register_implementation("gs", "gcsfs.core.GCSFileSystem", clobber=True)
    fsspec.register_implementation("gcs", "gcsfs.core.GCSFileSystem", clobber=True)


# -- the store -----------------------------------------------------------------


class CheckpointStore:
    """Checkpoints of one run's replica state in ``directory`` (a local path or ``gs://bucket/path``).

    ``max_to_keep``: after each save commits, only the newest this many
    complete checkpoints (by step) are kept, the one just saved always among
    them; None keeps every one. ``async_save=False`` makes :meth:`save`
    block until the checkpoint is committed (and raise its error itself).
    ``timeout_s`` bounds every wait for a save (:meth:`save` waiting for the
    previous one, :meth:`cleanup`, :meth:`close`). ``gcs_endpoint``: see
    :func:`use_gcs_endpoint` (default ``$STORAGE_EMULATOR_HOST``, else GCS).

    The constructor does no I/O (the directory is created by the first
    save), so a reader is cheap to make. One thread saves; :meth:`steps` and
    :meth:`restore` may be called from any thread.
    """

    def __init__(self, directory: str, *, max_to_keep: int | None = None, async_save: bool = True,
                 timeout_s: float = 600.0, gcs_endpoint: str | None = None):
        from etils import epath

        directory = str(directory)
        if problem := directory_problem(directory):
            raise ValueError(f"checkpoint directory {directory!r} {problem}")
        self._gcs = directory.startswith("gs://")
        if self._gcs:
            endpoint = gcs_endpoint or os.environ.get(GCS_ENDPOINT_ENV, "")
            if endpoint and endpoint != "default":   # "default": the real GCS, as google-cloud-storage reads it
                use_gcs_endpoint(endpoint if "://" in endpoint else f"http://{endpoint}")
        else:
            if gcs_endpoint:
                raise ValueError(f"gcs_endpoint is set but {directory!r} is not a gs:// directory")
            directory = os.path.abspath(os.path.expanduser(directory))
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

    @property
    def directory(self) -> str:
        return str(self._dir)

    def path(self, step: int) -> str:
        """Where the checkpoint of ``step`` is (or would be)."""
        return str(self._dir / str(step))

    @property
    def saving(self) -> int | None:
        """The step whose save is still running in the background (None when none is)."""
        thread, saving = self._thread, self._saving
        return saving[0] if saving is not None and thread is not None and thread.is_alive() else None

    # -- writing ---------------------------------------------------------------

    def save(self, step: int, leaves, *, sha256: str, metadata: dict | None = None) -> None:
        """Starts writing ``leaves`` (the state after ``step`` applied steps) as the checkpoint of ``step``.

        ``sha256``: :func:`runtime.state_copy.state_sha256` of ``leaves``
        (recorded, and checked by every restore). ``metadata``: JSON-able
        (``"fingerprint"``: the programs; ``"step"`` and ``"created"`` are
        the store's). Waits for the previous save first and raises its error
        (:class:`CheckpointSaveError`), if it failed. A checkpoint of the
        same step already there is replaced (a run is deterministic: the
        same step is the same state).
        """
        step, leaves, record = make_record(step, leaves, sha256=sha256, metadata=metadata)
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
            _forget_listings(self._dir)
            self._dir.mkdir(parents=True, exist_ok=True)
            self._discard(step)                      # an earlier save of this step, complete or not
            stored = [x for x in leaves if x.size]   # orbax refuses empty arrays; the record rebuilds them
            items = {_META: _ocp().args.JsonSave(record)}
            if stored:
                items[_STATE] = _ocp().args.PyTreeSave(stored)
            with _checkpointer() as checkpointer:
                checkpointer.save(self._dir / str(step), args=_ocp().args.Composite(**items))
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
        steps = self.steps()
        newest = set(steps[-self.max_to_keep:]) | {keep}
        for s in steps:
            if s not in newest:
                self._discard(s)

    def _discard(self, step: int) -> None:
        """Removes the checkpoint of ``step`` (complete or not), taking it out of :meth:`steps` first."""
        path = self._dir / str(step)
        if not path.exists():
            return
        if self._gcs:
            marker = path / _COMMIT_FILE
            if marker.exists():
                marker.unlink()
            _rmtree(path)
        else:
            doomed = self._dir / f"{step}{_TMP_SUFFIX}-removed-{os.getpid()}-{time.time_ns()}"
            os.rename(path, doomed)
            _rmtree(doomed)

    # -- listing ---------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps of every complete (committed) checkpoint, ascending; reads the storage each call."""
        return sorted(int(p.name) for p, complete in self._entries() if complete)

    def leftovers(self) -> list[str]:
        """Paths of interrupted saves and removals (what :meth:`cleanup` would remove)."""
        return sorted(str(p) for p, complete in self._entries() if not complete)

    def cleanup(self) -> list[str]:
        """Removes the leftovers of interrupted saves and removals; returns their paths.

        Waits for this store's own save first (raising its error). Call it
        only while no other process saves into this directory: a save in
        flight looks like a leftover.
        """
        with self._lock:
            self._join(self.timeout_s)
            removed = [p for p, complete in self._entries() if not complete]
            for p in removed:
                _rmtree(p)
            return sorted(str(p) for p in removed)

    def _entries(self):
        """``(path, complete)`` for each entry of the directory that is a step (``<step>``: complete when it
        holds the commit file) or a temporary one (``<step>.orbax-checkpoint-tmp...``: never complete)."""
        _forget_listings(self._dir)
        if not self._dir.exists():
            return []
        out = []
        for p in self._dir.iterdir():
            if _STEP_NAME.fullmatch(p.name):
                out.append((p, (p / _COMMIT_FILE).exists()))
            elif _TMP_SUFFIX in p.name and _STEP_NAME.fullmatch(p.name.split(".", 1)[0]):
                out.append((p, False))
        return out

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
            _forget_listings(self._dir)
            if not (self._dir / str(step) / _COMMIT_FILE).exists():
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
        with _checkpointer() as checkpointer:
            return self._read_with(checkpointer, step, self.path(step))

    def _read_with(self, checkpointer, step: int, path: str) -> Restored:
        ocp = _ocp()
        try:
            record = checkpointer.restore(self._dir / str(step),
                                          args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
        except Exception as e:  # noqa: BLE001 - any failure to read makes it unusable; the error says why
            raise CheckpointCorruptError(path, f"its record cannot be read ({_describe(e)})") from e
        layout = check_record(record, step, path)
        stored = [i for i, (shape, _) in enumerate(layout) if math.prod(shape)]
        arrays: list = []
        if stored:
            restore_args = [ocp.RestoreArgs(restore_type=np.ndarray)] * len(stored)
            try:
                arrays = checkpointer.restore(
                    self._dir / str(step),
                    args=ocp.args.Composite(**{_STATE: ocp.args.PyTreeRestore(restore_args=restore_args)}))[_STATE]
            except Exception as e:  # noqa: BLE001 - any failure to read makes it unusable; the error says why
                raise CheckpointCorruptError(path, f"its arrays cannot be read ({_describe(e)})") from e
            if not isinstance(arrays, (list, tuple)) or len(arrays) != len(stored):
                raise CheckpointCorruptError(path, f"it holds {_count(arrays)} arrays, its record {len(stored)}")
        leaves = [np.empty(shape, dtype) for shape, dtype in layout]
        for i, x in zip(stored, arrays):
            leaves[i] = np.asarray(x)
        return verified(step, leaves, layout, record, path)


# -- helpers -------------------------------------------------------------------


def directory_problem(directory: str) -> str:
    """Why ``directory`` cannot hold checkpoints ("" if it can): it is empty, or a gs:// URL without a valid
    bucket name. A pure check of the text (nothing is reached)."""
    if not directory:
        return "is empty"
    if directory.startswith("gs://") and not re.fullmatch(r"gs://[a-z0-9][a-z0-9._-]{1,61}[a-z0-9](/.*)?", directory):
        return "is not gs://bucket/path with a valid bucket name (3-63 of a-z 0-9 . _ -)"
    return ""


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


# orbax keeps process-wide state for a save in flight (its signaling client and operation ids): two saves in one
# process at once (a warm-up beside the first real save, two stores) fail each other with missing files. Every
# use of a checkpointer holds this lock, so a process reads or writes one checkpoint at a time.
_ORBAX_LOCK = threading.RLock()


@contextlib.contextmanager
def _checkpointer():
    """A synchronous orbax checkpointer of the two items (``state``: the leaves, ``meta``: the record), used by
    one thread of the process at a time (:data:`_ORBAX_LOCK`).

    Numpy leaves are written without orbax's defensive copy: the store's
    contract is that they do not change until the save is done. Handlers
    keep state between calls, so each use gets its own.
    """
    with _ORBAX_LOCK:
        yield from _new_checkpointer()


def _new_checkpointer():
    ocp = _ocp()
    import jax

    try:
        numpy_handler = ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)
    except TypeError:   # orbax before 0.11.x copies host arrays always (slower, as safe)
        numpy_handler = ocp.type_handlers.NumpyHandler()
    arrays = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, numpy_handler),
        (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)))   # unused; orbax warns without it
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    pytree = ocp.PyTreeCheckpointHandler(type_handler_registry=arrays)
    meta = ocp.JsonCheckpointHandler()
    registry.add(_STATE, ocp.args.PyTreeSave, pytree)
    registry.add(_STATE, ocp.args.PyTreeRestore, pytree)
    registry.add(_META, ocp.args.JsonSave, meta)
    registry.add(_META, ocp.args.JsonRestore, meta)
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(handler_registry=registry))
    try:
        yield checkpointer
    finally:
        checkpointer.close()


def _rmtree(path) -> None:
    path.rmtree(missing_ok=True)
    if path.exists():   # gcsfs can leave a directory placeholder behind the first time (as orbax notes)
        path.rmtree(missing_ok=True)


def _forget_listings(path) -> None:
    """gcsfs caches directory listings with no expiry; other processes write here, so list afresh."""
    fs = getattr(getattr(path, "_backend", None), "fs", None)   # etils.epath's fsspec backend (local paths: none)
    if fs is not None:
        fs(str(path)).invalidate_cache()


def _count(x) -> str:
    return str(len(x)) if isinstance(x, (list, tuple, dict)) else type(x).__name__
