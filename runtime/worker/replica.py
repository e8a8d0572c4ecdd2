"""This worker's replica of the state, the membership epoch it serves, and the one lock every change to them takes.

:class:`Replica` owns what the worker holds: the executor of the loaded
programs (and with it the state and its applied steps), the state's layout,
the chunk size the run moves it in, the last few steps' loss sums, a spare's
landing memory, and the epoch. It also owns whose turn it is: one step runs
at a time (:meth:`Replica.take_turn`), and an operation that replaces or
reads a whole state runs only between steps (:meth:`Replica.exclusive`,
:meth:`Replica.idle`).

The epoch lives here, under the same lock as the step's apply, because the
two must not interleave: a step checks its epoch and applies in one critical
section (:meth:`Replica.applying`), and a newer epoch adopted by the fence
(:meth:`Replica.enter_epoch`, called by :class:`runtime.worker.lease.Lease`)
aborts the step in flight under that lock. So a step of an older epoch never
applies after an abort was received.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from runtime._proto import elastic_pb2 as pb
from runtime.core.errors import ProtocolError, StaleEpochError, StepAbortedError
from runtime.wire.parts import DEFAULT_CHUNK_BYTES, MAX_STEPS_AHEAD

if TYPE_CHECKING:
    from runtime.wire.dataplane_client import DataClient
    from runtime.wire.peers import PeerChannels
    from runtime.worker.executor import SliceExecutor
    from runtime.worker.mailbox import Mailbox

__all__ = ["Replica"]


class Replica:
    """The state one worker holds and the lock that orders every change to it. Thread-safe.

    Called by the service's handlers (``Load``, ``Init``, ``StateHash``,
    ``Abort``), the fence (:class:`runtime.worker.lease.Lease`), the step
    (:class:`runtime.worker.step_runner.StepRunner`) and the state's moves
    (:class:`runtime.worker.worker_state.StateMover`). Every refusal is a
    :class:`StaleEpochError` (the request does not apply now) and changes
    nothing.
    """

    def __init__(self, mailbox: Mailbox, peers: PeerChannels, data: DataClient):
        self.executor: SliceExecutor | None = None
        self.layout: list | None = None          # [(shape, dtype)] of the state leaves, from the programs
        self.chunk_bytes = DEFAULT_CHUNK_BYTES   # set by Load
        self.epoch = 0
        self.recent: dict[int, float] = {}       # step -> loss sum, last few applied
        self.landing = None   # a spare's memory for the state it will be copied (runtime.worker.worker_state.Landing)
        self._running = False
        self._cond = threading.Condition()       # reentrant: an apply saves under it, a load swaps under it
        self._mailbox, self._peers, self._data = mailbox, peers, data

    @property
    def next_step(self) -> int:
        """The step this worker runs next: its executor's applied steps (one count of them, kept there)."""
        return self.executor.steps_applied if self.executor is not None else 0

    def need_executor(self) -> None:
        if self.executor is None:
            raise StaleEpochError("no programs loaded on this worker yet")

    def need_state(self) -> None:
        self.need_executor()
        if self.executor.state is None:
            raise StaleEpochError("this worker holds no state yet")

    # -- between steps ---------------------------------------------------------

    @contextmanager
    def locked(self) -> Iterator[None]:
        """The lock, whether a step runs or not (a read of the state that a running step's apply must not cut)."""
        with self._cond:
            yield

    @contextmanager
    def exclusive(self, refusal: str) -> Iterator[None]:
        """The lock, with no step running; refused at once with ``refusal`` while one runs."""
        with self._cond:
            if self._running:
                raise StaleEpochError(refusal)
            yield

    @contextmanager
    def idle(self, deadline: float, timeout: Callable[[], Exception]) -> Iterator[None]:
        """The lock, once the running step (if any) stopped; raises ``timeout()`` if it did not by ``deadline``."""
        with self._cond:
            while self._running:
                if not self._cond.wait(max(deadline - time.monotonic(), 0)):
                    raise timeout()
            yield

    def load(self, executor: SliceExecutor, layout: list, chunk_bytes: int,
             landing: Callable[[list], Any] | None) -> None:
        """``Load``, within :meth:`exclusive`: new programs, their state's layout and the run's chunk size; a
        spare starts making the memory a state copied to it will land in (``landing(layout)``, a
        :class:`runtime.worker.worker_state.Landing`)."""
        self.executor, self.layout, self.chunk_bytes = executor, layout, chunk_bytes
        self._drop_landing()   # one of earlier programs
        self.landing = landing(layout) if landing is not None else None

    def init(self, seed: int) -> int:
        """``Init``: a fresh state from ``seed``; its size in bytes. Refused while a step runs."""
        with self.exclusive("a step is running; abort it before initializing"):
            nbytes = self.executor.init(seed)
            self.recent.clear()
            self._drop_landing()
            return nbytes

    def adopt(self, leaves, applied: int, digest: str) -> None:
        """Replaces the state (a copy from a peer or a checkpoint); refused while a step runs."""
        with self.exclusive("a step is running; cannot replace the state"):
            self.executor.set_state(leaves, applied, digest=digest)
            self.recent.clear()
            self._drop_landing()

    def rollback(self, to_applied_steps: int) -> None:
        """``Rollback``, within :meth:`exclusive`: back one step, or nowhere when already there; refused
        (:class:`ProtocolError`) further back than the one step of history kept."""
        ex = self.executor
        if ex.steps_applied == to_applied_steps + 1:
            if ex.prev_state is None:
                raise ProtocolError(f"cannot roll back from {ex.steps_applied} applied steps: no step of "
                                    "history (the state was just initialized or copied)")
            ex.rollback()
            self.recent.pop(ex.steps_applied, None)
        elif ex.steps_applied != to_applied_steps:
            raise ProtocolError(f"cannot roll back from {ex.steps_applied} to {to_applied_steps} "
                                "applied steps (one step of history is kept)")

    def state_at(self, applied_steps: int) -> tuple[list, int, str]:
        """``(host leaves, applied steps, digest)`` of the state, if it is at ``applied_steps`` and no step runs."""
        self.need_state()
        with self._cond:
            if self.executor.steps_applied != applied_steps or self._running:
                raise StaleEpochError(f"state is at {self.executor.steps_applied} applied steps, "
                                      f"asked for {applied_steps}")
            leaves = self.executor.host_state()
            applied = self.executor.steps_applied
            digest = self.executor.state_digest()   # cached: the controller's Abort usually computed it
        return leaves, applied, digest

    def status(self, snapshots: list[int]) -> pb.StatusReply:
        """What this worker holds (applied steps and digest, -1 and "" without a state; the recent loss sums),
        with the steps of the ``snapshots`` its host keeps."""
        with self._cond:
            ex = self.executor
            has = ex is not None and ex.state is not None
            return pb.StatusReply(applied_steps=ex.steps_applied if has else -1,
                                  digest=ex.state_digest() if has else "",
                                  recent=[pb.StepLoss(step=k, loss_sum=v) for k, v in sorted(self.recent.items())],
                                  snapshots=snapshots)

    def _drop_landing(self) -> None:
        """This replica holds a state now: a spare's landing memory, unused, is freed."""
        if self.landing is not None:
            self.landing.drop()
            self.landing = None

    # -- the step's turn ---------------------------------------------------------

    def take_turn(self, step: int, epoch: int, deadline: float, fenced: Callable[[], str], context=None) -> None:
        """Waits (bounded by ``deadline``) until ``step`` is the next and no step runs, then marks it running;
        the caller must :meth:`end_turn`. Raises when ``fenced()`` names why this worker fenced itself, the
        epoch moved past ``epoch``, the step already applied or is too far ahead, or the caller (``context``)
        went away."""
        with self._cond:
            while self.next_step != step or self._running:
                why = fenced()
                if why:
                    raise StaleEpochError(why)
                if self.epoch != epoch:
                    raise StaleEpochError(f"step {step} of epoch {epoch} superseded by epoch {self.epoch}")
                if self.next_step > step:
                    raise StaleEpochError(f"step {step} already applied (worker at {self.next_step})")
                if step > self.next_step + MAX_STEPS_AHEAD:
                    raise ProtocolError(f"step {step} is more than {MAX_STEPS_AHEAD} steps ahead of this worker "
                                        f"(at step {self.next_step}); dispatch fewer steps ahead")
                if context is not None and not context.is_active():
                    raise StepAbortedError(step, "the caller gave up while the step waited for its turn")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StepAbortedError(step, f"still waiting for step {self.next_step}")
                self._cond.wait(min(left, 1.0))   # wakes on every step's end, or to look at the caller
            self._running = True

    def end_turn(self) -> None:
        with self._cond:
            self._running = False
            self._cond.notify_all()

    @contextmanager
    def applying(self, step: int, epoch: int, agree: Callable[[bool], bool] | None = None) -> Iterator[None]:
        """The lock for applying ``step`` of ``epoch``; raises :class:`StepAbortedError` if the epoch moved.
        ``agree(ok)``: a slice of several hosts' vote (:mod:`runtime.worker.agreement`), under the lock: they
        apply only if every host may (an abort waits for the vote)."""
        with self._cond:
            ok = self.epoch == epoch
            if not (agree(ok) if agree is not None else ok):
                raise StepAbortedError(step, f"a host of this slice was aborted before apply (epoch {self.epoch})"
                                       if ok else f"aborted by epoch {self.epoch} before apply")
            yield

    # -- the epoch ---------------------------------------------------------------

    def enter_epoch(self, epoch: int) -> None:
        """The fence's epoch check: refuses an older epoch; adopts a newer one, aborting the step in flight."""
        with self._cond:
            if epoch < self.epoch:
                raise StaleEpochError(f"message from epoch {epoch}, worker is at epoch {self.epoch}")
            if epoch > self.epoch:
                self.epoch = epoch
                self._abort_step(epoch)

    def abort_step(self) -> None:
        """The worker fenced itself or lost its client: the step in flight gives up, the epoch stays."""
        with self._cond:
            self._abort_step(self.epoch + 1)

    def hand_over(self, epoch: int, deadline: float) -> None:
        """A new client generation took over: the old client's step gives up, and once it stopped (by
        ``deadline``, else :class:`StaleEpochError`) epochs count from the new client's ``epoch``."""
        with self._cond:
            self._abort_step(max(self.epoch, self._mailbox.epoch) + 1)
            while self._running:
                if not self._cond.wait(max(deadline - time.monotonic(), 0)):
                    raise StaleEpochError("the old client's step did not stop")
            self.epoch = epoch
            self._mailbox.restart(epoch)

    def _abort_step(self, epoch: int) -> None:
        """With the lock held: a step waiting for its turn, on peers or on a push gives up now."""
        self._mailbox.set_epoch(epoch)
        # Pushes are blocking calls, not futures (futures cost ~5 ms a step):
        # to stop one, close its channel or its socket.
        self._peers.close_pushing()
        self._data.abort_pushes()
        self._cond.notify_all()
