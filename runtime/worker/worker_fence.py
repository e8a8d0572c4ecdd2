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
- a worker the controller has been silent to for longer than its lease
  fences itself (:meth:`Fencing.lease_lapsed`): it refuses all work from then
  on and never serves this run again. Only authenticated calls from the
  controller renew the lease (:meth:`Fencing.heard`), never a peer's.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from runtime._proto import elastic_pb2 as pb
from runtime.core.errors import StaleEpochError

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
    _cond: threading.Condition
    mailbox: Mailbox
    _peers: PeerChannels
    data: DataClient

    # -- fencing -------------------------------------------------------------

    def check_fence(self, fence: pb.Fence) -> None:
        """Refuses other runs and older epochs; adopts a newer epoch."""
        if fence.run_id != self.run_id:
            raise StaleEpochError(f"message for run {fence.run_id!r}, this worker serves {self.run_id!r}")
        if self.fenced:
            raise StaleEpochError(f"worker {self.worker_id} fenced itself: {self.fenced}")
        with self._cond:
            if fence.epoch < self.epoch:
                raise StaleEpochError(f"message from epoch {fence.epoch}, worker is at epoch {self.epoch}")
            if fence.epoch > self.epoch:
                self.epoch = fence.epoch
                self._abort_step(fence.epoch)

    # -- the worker's lease on its controller ---------------------------------

    CONTROLLER_METHODS = ("Load", "Init", "Step", "StateHash", "Shutdown", "Abort", "Rollback", "PullState",
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
