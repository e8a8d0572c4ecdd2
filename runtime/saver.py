"""A worker's persistent checkpoints, written off the step's critical path.

The controller marks one step of one replica with a checkpoint directory
(``StepRequest.checkpoint_directory``). Right after applying that step the
worker hands its new state (device arrays: immutable, never donated) to a
:class:`CheckpointWriter`; the writer's thread copies it to the host, hashes
it (:func:`runtime.executor.state_sha256`, the digest every replica
compares) and saves it with :class:`runtime.checkpoint.CheckpointStore`,
which commits a checkpoint only once it is complete. The step's reply does
not wait: the next replies carry the steps whose checkpoints finished
(``StepReply.checkpoints_saved``) and the first error since the last reply.

At most one checkpoint is written at a time and one waits: a newer request
replaces a waiting one (the newest state is the useful one), so a slow disk
never queues states in memory.
"""

from __future__ import annotations

import os
import tempfile
import threading

import numpy as np

from runtime.executor import state_sha256

__all__ = ["CheckpointWriter"]


def _store(directory: str):
    from runtime.checkpoint import CheckpointStore   # orbax loads only in a worker that writes checkpoints

    return CheckpointStore(directory)


class CheckpointWriter:
    """Writes checkpoints of one worker's states in a background thread. Thread-safe."""

    def __init__(self, store_for=None, while_saving=None):
        self._store_for = store_for or _store
        self._while_saving = while_saving   # called as while_saving(store, step) once a save started (chaos)
        self._stores: dict[str, object] = {}
        self._cond = threading.Condition()
        self._waiting: tuple | None = None
        self._busy = False
        self._saved: list[int] = []
        self._error = ""
        self._thread: threading.Thread | None = None

    def submit(self, directory: str, step: int, device_leaves: list, metadata: dict) -> None:
        """Queues a checkpoint of ``device_leaves`` (the state after ``step`` applied steps) into ``directory``,
        with ``metadata`` (the programs' fingerprint) recorded beside it."""
        with self._cond:
            self._waiting = (directory, step, list(device_leaves), dict(metadata))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def warm(self) -> None:
        """Pays the checkpoint library's one-time start-up now, in the background (a tiny save to a temp dir).

        The first real save then takes about as long as the next ones
        (orbax's first save in a process costs seconds; later ones, the write).
        """
        def run():
            with tempfile.TemporaryDirectory(prefix="elastic-warm-") as d:
                try:
                    store = self._store_for(os.path.join(d, "warm"))
                    leaf = np.zeros(1, np.float32)
                    store.save(0, [leaf], sha256=state_sha256([leaf]), metadata={})
                    store.wait()
                except Exception:  # noqa: BLE001 - only a warm-up: a real save reports its own errors
                    pass
        threading.Thread(target=run, name="checkpoint-warm-up", daemon=True).start()

    def drain(self) -> tuple[list[int], str]:
        """The steps saved since the last call and the first error since then ("" if none)."""
        with self._cond:
            saved, error = self._saved, self._error
            self._saved, self._error = [], ""
        return saved, error

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until nothing is waiting or being written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting is None and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._waiting is not None)
                directory, step, leaves, metadata = self._waiting
                self._waiting, self._busy = None, True
            try:
                host = [np.asarray(x) for x in leaves]
                store = self._stores.get(directory)
                if store is None:
                    store = self._stores[directory] = self._store_for(directory)
                store.save(step, host, sha256=state_sha256(host), metadata=metadata)
                if self._while_saving is not None:
                    self._while_saving(store, step)
                store.wait()
                with self._cond:
                    self._saved.append(step)
            except Exception as e:  # noqa: BLE001 - reported to the controller with the next step reply
                with self._cond:
                    self._error = self._error or f"checkpoint of step {step} in {directory}: {type(e).__name__}: {e}"
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
