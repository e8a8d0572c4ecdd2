"""A worker's membership of its run: fencing by run and epoch, and its lease on the controller.

:class:`Fencing` is a base class of :class:`runtime.worker.worker.WorkerService`
that holds no state of its own: it works on the service's run, epoch, lease
and lock (the attributes it declares). Every request of the run passes
:meth:`Fencing.check_fence` before it touches the state:

- a message of another run, or of an older epoch, is refused
  (:class:`~runtime.core.errors.StaleEpochError`);
- a message of a newer epoch is adopted: the worker moves to that epoch and
  the step in flight gives up (it wakes if it waits on peers or on a push,
  and never applies);
- a message of an older client generation (a client that another took the
  run over from) is refused with :class:`~runtime.core.errors.ClientSupersededError`;
  one of a newer generation is refused until that client attached this
  worker (:meth:`Fencing.attach`);
- a worker the controller has been silent to for longer than its lease
  fences itself (:meth:`Fencing.lease_lapsed`): it refuses all work of its
  client from then on. Only authenticated calls from the controller renew the
  lease (:meth:`Fencing.heard`), never a peer's.

**The client's grace.** A worker whose client is gone (its owner process
died, or its lease lapsed) and that holds a state keeps it and its programs
for ``client_grace_seconds`` (:meth:`Fencing.lose_client`), fenced: no step
of the old client applies. A restarted client of the same run takes it back
with a newer generation (:meth:`Fencing.attach`); when the grace runs out
first (:meth:`Fencing.grace_over`), the worker exits as it would have at
once without a grace.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from runtime._proto import elastic_pb2 as pb
from runtime.core.errors import ClientSupersededError, StaleEpochError, WorkerFencedError

if TYPE_CHECKING:
    from runtime.wire.dataplane_client import DataClient
    from runtime.worker.mailbox import Mailbox
    from runtime.wire.peers import PeerChannels

__all__ = ["Fencing"]

log = logging.getLogger("jax_elastic.worker")


class Fencing:
    """The fencing and the lease of :class:`runtime.worker.worker.WorkerService`, on the service's attributes below."""

    run_id: str
    worker_id: str
    epoch: int
    lease: float          # seconds without the controller before fencing; 0: off
    last_contact: float   # time.monotonic() of the controller's last authenticated call
    fenced: str           # why this worker fenced itself ("" while a member)
    generation: int       # the client generation this worker serves
    client_grace: float   # seconds to wait for a new client once this one is gone; 0: exit at once
    client_lost_at: float | None   # time.monotonic() when the client was lost (None: it is not)
    serving: Callable[[bool], None]   # tells the health service whether this worker serves (fenced: not)
    _cond: threading.Condition
    _running: bool
    step_timeout: float
    mailbox: Mailbox
    _peers: PeerChannels
    data: DataClient

    # -- fencing -------------------------------------------------------------

    def check_fence(self, fence: pb.Fence) -> None:
        """Refuses other runs and older epochs; adopts a newer epoch."""
        self._same_run(fence)
        if fence.generation != self.generation:
            if fence.generation < self.generation:
                raise ClientSupersededError(self.superseded(fence.generation))
            raise StaleEpochError(f"message of client generation {fence.generation}, which has not attached this "
                                  f"worker (it serves generation {self.generation})")
        if self.fenced:
            raise WorkerFencedError(f"worker {self.worker_id} fenced itself: {self.fenced}")
        with self._cond:
            if fence.epoch < self.epoch:
                raise StaleEpochError(f"message from epoch {fence.epoch}, worker is at epoch {self.epoch}")
            if fence.epoch > self.epoch:
                self.epoch = fence.epoch
                self._abort_step(fence.epoch)

    def _same_run(self, fence: pb.Fence) -> None:
        if fence.run_id != self.run_id:
            raise StaleEpochError(f"message for run {fence.run_id!r}, this worker serves {self.run_id!r}")

    def superseded(self, generation: int) -> str:
        return (f"client generation {generation} of run {self.run_id} was taken over by generation "
                f"{self.generation}: another client drives this run now")

    def attach(self, fence: pb.Fence) -> None:
        """A restarted client (a newer generation) takes this worker over, fenced or not: from now on only its
        calls are served. The old client's step in flight gives up; the state stays as it is."""
        self._same_run(fence)
        if fence.generation <= self.generation:
            raise ClientSupersededError(self.superseded(fence.generation) if fence.generation < self.generation
                                        else f"client generation {fence.generation} already attached this worker")
        deadline = time.monotonic() + self.step_timeout
        with self._cond:
            self.generation = fence.generation   # from here on the old client's calls are refused
            self._abort_step(max(self.epoch, self.mailbox.epoch) + 1)   # its step in flight gives up
            while self._running:
                if not self._cond.wait(max(deadline - time.monotonic(), 0)):
                    raise StaleEpochError("the old client's step did not stop")
            self.epoch = fence.epoch
            self.mailbox.restart(fence.epoch)
            self.fenced, self.client_lost_at = "", None
        self.last_contact = time.monotonic()
        self.serving(True)

    # -- the client's grace ------------------------------------------------------

    def lose_client(self, why: str) -> bool:
        """The client is gone (``why``): with a grace and a state to keep, fences this worker and starts the
        grace (True); else False (the worker exits now, as without a grace: a worker without a state, a spare
        that only loaded the programs, is relaunched by the next client if it needs one)."""
        executor = getattr(self, "executor", None)
        if not self.client_grace or executor is None or executor.state is None:
            return False
        if self.client_lost_at is None:
            self.client_lost_at = time.monotonic()
            self.fenced = self.fenced or why
            self.serving(False)
            log.warning("%s: keeping the state for a client of run %s for %.0f s", why, self.run_id, self.client_grace)
            with self._cond:
                self._abort_step(self.epoch + 1)
        return True

    def grace_over(self) -> bool:
        """The client was lost longer than the grace ago (and none attached since)."""
        return self.client_lost_at is not None and time.monotonic() - self.client_lost_at > self.client_grace

    # -- the worker's lease on its controller ---------------------------------

    CONTROLLER_METHODS = ("Load", "Init", "Step", "Steps", "StateHash", "Shutdown", "Abort", "Rollback", "PullState", "Attach",
                          "LoadCheckpoint", "Checkpoints",
                          "Chaos", "Progress", "Refusals", "/grpc.health.v1.Health/Check")

    def heard(self, method: str) -> None:
        """An authenticated call from the controller (not from a peer) renews the lease.

        The server calls it only for calls that reach their handler
        (``rpc.make_server``'s ``on_authenticated``): a caller without the
        run secret (or mTLS certificate) never renews it, nor does a call
        dropped by a chaos partition.
        """
        if method.endswith(self.CONTROLLER_METHODS):
            self.last_contact = time.monotonic()

    def lease_lapsed(self) -> bool:
        """Fences this worker when the controller has been silent longer than the lease.

        Called periodically by :func:`runtime.worker.worker_process.serve`. A fenced
        worker refuses all work and wakes a step waiting on peers; it never
        serves this run again.
        """
        if not self.lease or self.fenced:
            return bool(self.fenced)
        silent = time.monotonic() - self.last_contact
        if silent <= self.lease:
            return False
        self.fenced = f"no word from the controller for {silent:.1f} s (lease {self.lease:.1f} s)"
        log.warning("fencing myself: %s", self.fenced)
        with self._cond:
            self._abort_step(self.epoch + 1)
        return True

    def _abort_step(self, epoch: int) -> None:
        """With ``_cond`` held: a step waiting on peers or on a push gives up now."""
        self.mailbox.set_epoch(epoch)
        # Pushes are blocking calls, not futures (futures cost ~5 ms a step):
        # to stop one, close its channel or its socket.
        self._peers.close_pushing()
        self.data.abort_pushes()
        self._cond.notify_all()
