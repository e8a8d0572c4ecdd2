"""A worker's checkpoints and snapshots, written off the step's critical path.

The controller marks one step of one replica with a checkpoint directory
(``StepRequest.checkpoint_directory``) or an in-memory snapshot
(``StepRequest.snapshot``). Right after applying that step the worker hands
its new state (device arrays: immutable, never donated) to a
:class:`CheckpointWriter`; the writer's thread copies it to the host, hashes
it (:func:`runtime.state.state_copy.state_digest`, the digest every replica
compares) and saves it into its store (:class:`runtime.state.checkpoint.CheckpointStore`
or :class:`runtime.state.snapshot.SnapshotStore`), which lists a save only once it
is complete; then it runs the save's follow-up, if any (a snapshot's copy to
another host). The step's reply does not wait: the next replies carry the
steps whose saves (and follow-ups) finished and the first error since the
last reply, per kind.

Per kind, at most one save is written at a time and one waits: a newer
request replaces a waiting one (the newest state is the useful one), so a
slow disk never queues states in memory, and a snapshot never displaces a
checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import threading

import numpy as np

from runtime.core.owner import pid_alive
from runtime.state.state_copy import state_digest

__all__ = ["KINDS", "WARM_PREFIX", "CheckpointWriter", "Drained", "remove_dead_warm_ups"]

log = logging.getLogger("jax_elastic.worker")


def _store(directory: str, tree=None):
    from runtime.state.checkpoint import CheckpointStore   # orbax loads only in a worker that writes checkpoints

    return CheckpointStore(directory, tree=tree)


#: The kinds of save a writer makes.
KINDS = ("checkpoint", "snapshot")

#: How a warm-up's temporary directory is named: ``<prefix><pid of the process warming up>-<random>``.
WARM_PREFIX = "elastic-warm-"


def remove_dead_warm_ups(root: str | None = None) -> list[str]:
    """Removes the warm-up directories under ``root`` (default: the system's temporary directory) whose process
    is gone; returns their paths. A directory of a live process, of another user's, or not named
    ``<WARM_PREFIX><pid>-...`` is left alone."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        pid = entry.name[len(WARM_PREFIX):].partition("-")[0]
        if not entry.name.startswith(WARM_PREFIX) or not pid.isdigit() or pid_alive(int(pid)):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.exists(entry.path):
            removed.append(entry.path)
    return removed


@dataclasses.dataclass
class Drained:
    """What one kind's saves did since the last :meth:`CheckpointWriter.drain`: the ``saved`` steps, the steps
    whose follow-up also ended well (``followed``), and the first ``error`` ("" if none)."""

    saved: list = dataclasses.field(default_factory=list)
    followed: list = dataclasses.field(default_factory=list)
    error: str = ""


@dataclasses.dataclass(frozen=True)
class _Save:
    """One save waiting its turn (see :meth:`CheckpointWriter.submit` for the fields)."""

    directory: str
    step: int
    leaves: list
    metadata: dict
    store: object
    then: object
    tree: object
    to_host: object
    failed: object


class CheckpointWriter:
    """Writes checkpoints and snapshots of one worker's states in a background thread. Thread-safe."""

    def __init__(self, store_for=None, while_saving=None):
        self._store_for = store_for or _store
        self._while_saving = while_saving   # called as while_saving(store, step) once a checkpoint started (chaos)
        self._stores: dict[tuple, object] = {}
        self._cond = threading.Condition()
        self._waiting: dict[str, _Save] = {}   # kind -> the save waiting its turn
        self._busy = False
        self._done = {k: Drained() for k in KINDS}
        self._thread: threading.Thread | None = None

    def submit(self, directory: str, step: int, device_leaves: list, metadata: dict, *, store=None,
               then=None, tree=None, to_host=None, failed=None) -> None:
        """Queues a save of ``device_leaves`` (the state after ``step`` applied steps) into ``directory``, with
        ``metadata`` (the programs' fingerprint) recorded beside it; ``tree``: the programs' checkpoint tree
        (``runtime.state.checkpoint_tree.CheckpointTree``; None: a flat list).

        ``store``: a snapshot store to save into (the kind is then
        "snapshot"); default a checkpoint store of ``directory``. ``then``:
        called as ``then(store, step)`` after the save completed (its error
        is reported like the save's). ``to_host``: the leaves as the host
        arrays saved (default each leaf whole; a host of a slice of several
        saves its blocks, :meth:`runtime.worker.executor.SliceExecutor.host_blocks`).
        ``failed``: called as ``failed(step)`` when this save failed, or
        was replaced before it began (a newer one of its kind came first).
        """
        kind = "snapshot" if store is not None else "checkpoint"
        with self._cond:
            replaced = self._waiting.get(kind)
            self._waiting[kind] = _Save(directory, step, list(device_leaves), dict(metadata), store, then, tree,
                                        to_host, failed)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        if replaced is not None:
            _given_up(replaced.failed, replaced.step)

    def warm(self) -> None:
        """Pays the checkpoint library's one-time start-up now, in the background (a tiny save to a temp dir).

        The first real save then takes about as long as the next ones
        (orbax's first save in a process costs seconds; later ones, the write).
        The temporary directory (``elastic-warm-<pid>-*`` in the system's
        temporary directory) is removed when the warm-up ends; one a worker
        left behind because it died meanwhile (SIGKILL skips every clean-up)
        is removed by the next warm-up on the host (:func:`remove_dead_warm_ups`).
        """
        def run():
            try:
                remove_dead_warm_ups()
                with tempfile.TemporaryDirectory(prefix=f"{WARM_PREFIX}{os.getpid()}-") as d:
                    store = self._store_for(os.path.join(d, "warm"))
                    leaf = np.zeros(1, np.float32)
                    store.save(0, [leaf], digest=state_digest([leaf]), metadata={})
                    store.wait()
            except Exception:  # noqa: BLE001 - only a warm-up: a real save reports its own errors
                pass
        threading.Thread(target=run, name="checkpoint-warm-up", daemon=True).start()

    def drain(self, kind: str = "checkpoint") -> Drained:
        """What saves of ``kind`` did since the last call."""
        with self._cond:
            done, self._done[kind] = self._done[kind], Drained()
        return done

    def writing(self):
        """``(store, step)`` of the checkpoint being written in the background right now, else None."""
        for store in list(self._stores.values()):
            step = getattr(store, "saving", None)
            if step is not None:
                return store, step
        return None

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until nothing is waiting or being written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._waiting and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._waiting))
                kind = next(iter(self._waiting))
                save = self._waiting.pop(kind)
                directory, step, store, tree = save.directory, save.step, save.store, save.tree
                self._busy = True
            stage = "save"
            try:
                host = save.to_host(save.leaves) if save.to_host is not None else [np.asarray(x) for x in save.leaves]
                if store is None:   # one store per directory and tree (a program set's tree is one object)
                    store = self._stores.get((directory, id(tree)))
                    if store is None:
                        store = self._stores[directory, id(tree)] = (
                            self._store_for(directory, tree) if tree is not None else self._store_for(directory))
                store.save(step, host, digest=state_digest(host), metadata=save.metadata)
                if self._while_saving is not None and kind == "checkpoint":
                    self._while_saving(store, step)
                store.wait()
                with self._cond:
                    self._done[kind].saved.append(step)
                if save.then is not None:
                    stage = "copy"
                    save.then(store, step)
                    with self._cond:
                        self._done[kind].followed.append(step)
            except Exception as e:  # noqa: BLE001 - reported to the controller with the next step reply
                what = f"{kind} of step {step} in {directory}" if stage == "save" else f"copy of {kind} {step}"
                with self._cond:
                    done = self._done[kind]
                    done.error = done.error or f"{what}: {type(e).__name__}: {e}"
                if stage == "save":
                    _given_up(save.failed, step)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def _given_up(failed, step: int) -> None:
    """Tells ``failed`` (a save's, or None) that the save of ``step`` will not be written."""
    if failed is not None:
        try:
            failed(step)
        except Exception as e:  # noqa: BLE001 - whoever waits for it then waits to its own deadline
            log.warning("could not say that the save of step %d was given up: %s", step, e)
