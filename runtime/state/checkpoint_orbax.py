"""orbax as :class:`runtime.state.checkpoint.CheckpointStore` uses it: one checkpoint's contents written and read back.

A checkpoint is orbax's composite of two items: ``meta``, the record
(:mod:`runtime.state.checkpoint_record`: step, digest, leaf layout, metadata), and
``state``, the leaves that are not empty (orbax refuses empty arrays; the
record rebuilds them), as numpy arrays written without orbax's defensive copy.

- :func:`write` saves both synchronously at a step's path; orbax commits it
  (a temporary name, the commit file last, then the rename; see
  :mod:`runtime.state.checkpoint_storage`). With a
  :class:`~runtime.state.checkpoint_tree.CheckpointTree` the leaves are the
  named tree ``items`` instead of ``state`` (MaxText's layout, for a MaxText
  model), and the record holds the tree, so any reader of the record can
  take them back out.
- :func:`read` reads the record, checks it, reads the arrays and verifies
  them against the record and its digest, raising
  :class:`~runtime.state.checkpoint_record.CheckpointCorruptError` naming the path
  when anything cannot be read or does not match. A checkpoint with no
  record but an ``items`` tree (one MaxText's trainer wrote) is read with the
  tree and layout the reader's programs give, checked against the step its
  directory stands for, and given the digest of what was read.

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
from runtime.state.checkpoint_tree import CheckpointTree, from_items, map_skeleton, step_in, take, to_items
from runtime.state.checkpoint_storage import RECORD_ITEM, TREE_ITEM
from runtime.state.state_copy import state_digest

__all__ = ["ITEMS", "RECORD", "read", "read_parameters", "write"]

_STATE = "state"
RECORD, ITEMS = RECORD_ITEM, TREE_ITEM   # the record's item, and the named tree's
_META = RECORD


def write(path, leaves: list[np.ndarray], record: dict, tree: CheckpointTree | None = None) -> None:
    """Writes ``leaves`` and their ``record`` as the checkpoint at ``path`` (an ``etils.epath`` path), as the
    named ``tree`` when given; returns once orbax has committed it, raises what orbax raised otherwise."""
    items = {}
    if tree is not None:
        record = {**record, "tree": tree.to_json()}
        items[ITEMS] = _ocp().args.PyTreeSave(to_items(leaves, tree))
    else:
        stored = [x for x in leaves if x.size]   # orbax refuses empty arrays; the record rebuilds them
        if stored:
            items[_STATE] = _ocp().args.PyTreeSave(stored)
    items[_META] = _ocp().args.JsonSave(record)
    with _checkpointer() as checkpointer:
        checkpointer.save(path, args=_ocp().args.Composite(**items))


def read(path, step: int, tree: CheckpointTree | None = None, layout=None) -> Restored:
    """Reads and verifies the checkpoint of ``step`` at ``path`` (an ``etils.epath`` path); raises
    :class:`CheckpointCorruptError` naming ``path`` when it cannot be read or fails verification. ``tree`` and
    ``layout`` (the state's ``[(shape, dtype)]``) read a checkpoint that has no record (MaxText's)."""
    with _checkpointer() as checkpointer:
        if not (path / _META).exists() and (path / ITEMS).exists():
            return _read_foreign(checkpointer, path, step, tree, layout)
        return _read_with(checkpointer, path, step)


def read_parameters(path, tree: CheckpointTree, layout, subtree: str = "params") -> dict[int, np.ndarray]:
    """``{leaf index: array}`` of the leaves ``tree`` places under ``subtree``, read from the ``items`` of the
    checkpoint at ``path`` (one step's directory, or a parameter-only checkpoint such as MaxText's; other
    entries of its tree are not read); :class:`CheckpointCorruptError` naming ``path`` when they cannot be."""
    where = str(path)
    part = tree.skeleton.get(subtree) if isinstance(tree.skeleton, dict) else None
    if part is None:
        raise CheckpointCorruptError(where, f"this model's checkpoint tree has no {subtree!r} subtree to read")
    if not (path / ITEMS).exists():
        raise CheckpointCorruptError(where, f"it holds no {ITEMS!r} tree")
    with _checkpointer() as checkpointer:
        items = _restore_items(checkpointer, path, {subtree: part}, where, partial=True)
    try:
        return take(items[subtree], part, tree, [(tuple(s), np.dtype(d)) for s, d in layout], (subtree,))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointCorruptError(where, str(e)) from None


def _read_foreign(checkpointer, location, step: int, tree: CheckpointTree | None, layout) -> Restored:
    """A checkpoint another program wrote in the ``items`` layout: read with this state's tree and layout."""
    path = str(location)
    if tree is None or layout is None:
        raise CheckpointCorruptError(path, "it has no jax-elastic record, and this model's programs name no "
                                           "checkpoint tree to read its 'items' with")
    items = _restore_items(checkpointer, location, tree.skeleton, path)
    try:
        held = step_in(items, tree)
        leaves = from_items(items, tree, [(tuple(s), np.dtype(d)) for s, d in layout])
    except ValueError as e:
        raise CheckpointCorruptError(path, str(e)) from None
    if held is not None and held != step:
        raise CheckpointCorruptError(path, f"it holds step {held}; its directory stands for step {step}")
    digest = state_digest(leaves)
    return Restored(step, leaves, digest, {"step": step, "created": None, "written_by": "another program"})


def _restore_items(checkpointer, location, skeleton, path: str, partial: bool = False):
    """The part of the ``items`` tree at ``location`` that ``skeleton`` places (``partial``: the checkpoint's tree
    may hold more, which is not read), leaves as numpy arrays."""
    ocp = _ocp()
    args = map_skeleton(skeleton, lambda _: ocp.RestoreArgs(restore_type=np.ndarray))
    restore = (ocp.args.PyTreeRestore(item=map_skeleton(skeleton, lambda _: 0), restore_args=args, partial_restore=True)
               if partial else ocp.args.PyTreeRestore(restore_args=args))
    try:
        return checkpointer.restore(location, args=ocp.args.Composite(**{ITEMS: restore}))[ITEMS]
    except Exception as e:  # noqa: BLE001 - any failure to read makes it unusable; the error says why
        raise CheckpointCorruptError(path, f"its 'items' cannot be read ({_describe(e)})") from e


def _read_with(checkpointer, location, step: int) -> Restored:
    ocp, path = _ocp(), str(location)
    try:
        record = checkpointer.restore(location, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
    except Exception as e:  # noqa: BLE001 - any failure to read makes it unusable; the error says why
        raise CheckpointCorruptError(path, f"its record cannot be read ({_describe(e)})") from e
    layout = check_record(record, step, path)
    if isinstance(record, dict) and record.get("tree") is not None:
        try:
            tree = CheckpointTree.from_json(record["tree"])
        except ValueError as e:
            raise CheckpointCorruptError(path, f"its record's tree is malformed ({e})") from None
        items = _restore_items(checkpointer, location, tree.skeleton, path)
        try:
            leaves = from_items(items, tree, layout)
        except ValueError as e:
            raise CheckpointCorruptError(path, str(e)) from None
        return verified(step, leaves, layout, record, path)
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

    _one_process_each()
    return ocp


_ALONE = False


def _one_process_each() -> None:
    """Makes orbax act, in a host of a slice of several (a process of a JAX distributed system of several), as the
    one process of its own checkpoints.

    Such a host writes and reads its own blocks as numpy arrays, a checkpoint
    of its own (:mod:`runtime.state.checkpoint_hosts`), from its background
    writer thread. orbax would otherwise treat the slice's processes as one
    checkpoint's writers: only process 0 writes the record and commits, and
    its barriers and broadcasts run collectives on the slice's devices from
    that thread, which interleave with the step's programs differently on
    each host and break them ("passed to device_put is not the same on each
    process"). orbax asks its ``multihost`` module who and how many the
    processes are, and whether to synchronise them; each host answers for
    itself alone: process 0 of 1, nothing to synchronise or broadcast, its
    signals kept in its own process. A one-process worker (and the controller)
    is left as it is.
    """
    global _ALONE
    if _ALONE:
        return
    from jax._src import distributed   # (asked without starting a backend: a controller has none)

    if distributed.global_state.client is None or distributed.global_state.num_processes in (None, 1):
        return
    from orbax.checkpoint._src.multihost import multihost

    multihost.process_index = lambda: 0
    multihost.process_count = lambda: 1
    multihost.should_skip_process_sync = lambda processes=None: True
    multihost.broadcast_one_to_all = lambda in_tree, is_source=None: in_tree
    # Its signals between a save's threads go through a key-value store, by default the distributed system's, under
    # keys of per-process operation ids: the hosts' saves would read each other's ("directory made") and write
    # into directories not made yet. Each keeps its signals in its own process.
    from orbax.checkpoint._src.futures import signaling_client

    own = signaling_client.ThreadSafeKeyValueSignalingClient()
    signaling_client.get_signaling_client = lambda: own
    _ALONE = True


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
