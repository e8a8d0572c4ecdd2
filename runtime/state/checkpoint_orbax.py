"""orbax as :class:`runtime.state.checkpoint.CheckpointStore` uses it: one checkpoint's contents written and read back.

A checkpoint is orbax's composite of two items: ``meta``, the record
(:mod:`runtime.state.checkpoint_record`: step, digest, leaf layout, metadata), and
``state``, the leaves that are not empty (orbax refuses empty arrays; the
record rebuilds them), as numpy arrays written without orbax's defensive copy.

- :func:`write` saves both synchronously at a step's path; orbax commits it
  (a temporary name, the commit file last, then the rename; see
  :mod:`runtime.state.checkpoint_storage`).
- :func:`read` reads the record, checks it, reads the arrays and verifies
  them against the record and its digest, raising
  :class:`~runtime.state.checkpoint_record.CheckpointCorruptError` naming the path
  when anything cannot be read or does not match.

orbax keeps process-wide state for a save in flight, so every use of a
checkpointer holds one lock (:data:`_ORBAX_LOCK`): a process reads or writes
one checkpoint at a time. orbax (and JAX) are imported on first use, not when
this module is.
"""

from __future__ import annotations

import contextlib
import math
import threading

import numpy as np

from runtime.state.checkpoint_record import CheckpointCorruptError, Restored, _describe, check_record, verified

__all__ = ["read", "write"]

_STATE, _META = "state", "meta"


def write(path, leaves: list[np.ndarray], record: dict) -> None:
    """Writes ``leaves`` and their ``record`` as the checkpoint at ``path`` (an ``etils.epath`` path); returns
    once orbax has committed it, raises what orbax raised otherwise."""
    stored = [x for x in leaves if x.size]   # orbax refuses empty arrays; the record rebuilds them
    items = {_META: _ocp().args.JsonSave(record)}
    if stored:
        items[_STATE] = _ocp().args.PyTreeSave(stored)
    with _checkpointer() as checkpointer:
        checkpointer.save(path, args=_ocp().args.Composite(**items))


def read(path, step: int) -> Restored:
    """Reads and verifies the checkpoint of ``step`` at ``path`` (an ``etils.epath`` path); raises
    :class:`CheckpointCorruptError` naming ``path`` when it cannot be read or fails verification."""
    with _checkpointer() as checkpointer:
        return _read_with(checkpointer, path, step)


def _read_with(checkpointer, location, step: int) -> Restored:
    ocp, path = _ocp(), str(location)
    try:
        record = checkpointer.restore(location, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
    except Exception as e:  # noqa: BLE001 - any failure to read makes it unusable; the error says why
        raise CheckpointCorruptError(path, f"its record cannot be read ({_describe(e)})") from e
    layout = check_record(record, step, path)
    stored = [i for i, (shape, _) in enumerate(layout) if math.prod(shape)]
    arrays: list = []
    if stored:
        restore_args = [ocp.RestoreArgs(restore_type=np.ndarray)] * len(stored)
        try:
            arrays = checkpointer.restore(
                location,
                args=ocp.args.Composite(**{_STATE: ocp.args.PyTreeRestore(restore_args=restore_args)}))[_STATE]
        except Exception as e:  # noqa: BLE001 - any failure to read makes it unusable; the error says why
            raise CheckpointCorruptError(path, f"its arrays cannot be read ({_describe(e)})") from e
        if not isinstance(arrays, (list, tuple)) or len(arrays) != len(stored):
            raise CheckpointCorruptError(path, f"it holds {_count(arrays)} arrays, its record {len(stored)}")
    leaves = [np.empty(shape, dtype) for shape, dtype in layout]
    for i, x in zip(stored, arrays):
        leaves[i] = np.asarray(x)
    return verified(step, leaves, layout, record, path)


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


def _count(x) -> str:
    return str(len(x)) if isinstance(x, (list, tuple, dict)) else type(x).__name__
