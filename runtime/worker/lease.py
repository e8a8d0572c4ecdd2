"""A worker's membership of its run: the fence every request passes, the client it serves, and its lease on it.

:class:`Lease` owns who this worker serves: the run, the client generation,
the client's controller address and process, whether it fenced itself and
why, the lease on the controller and the grace after losing its client.
Every request of the run passes :meth:`Lease.check_fence` before it touches
the state:

- a message of another run, or of an older epoch, is refused
  (:class:`~runtime.core.errors.StaleEpochError`);
- a message of a newer epoch is adopted: the worker moves to that epoch and
  the step in flight gives up (it wakes if it waits on peers or on a push,
  and never applies; the epoch itself is the replica's,
  :meth:`runtime.worker.replica.Replica.enter_epoch`, kept under the lock the
  step applies under);
- a message of an older client generation (a client that another took the
  run over from) is refused with :class:`~runtime.core.errors.ClientSupersededError`;
  one of a newer generation is refused until that client attached this
  worker (:meth:`Lease.attach`);
- a worker the controller has been silent to for longer than its lease
  fences itself (:meth:`Lease.lease_lapsed`): it refuses all work of its
  client from then on. Only authenticated calls from the controller renew the
  lease (:meth:`Lease.heard`), never a peer's.

**The client's grace.** A worker whose client is gone (its owner process
died, or its lease lapsed) waits for ``client_grace_seconds``
(:meth:`Lease.lose_client`), fenced, keeping whatever it holds (a state, its
programs, or nothing yet: a worker relaunched, a spare, a newcomer not yet
loaded): no step of the old client applies. Every worker of the run learns
the grace as it joins (its registration's answer, :meth:`Lease.joined`),
whatever started it and whenever, so none dies with its client for having
joined late. A restarted client of the same run takes it back with a newer
generation (:meth:`Lease.attach`, bringing its own grace); when the grace
runs out first (:meth:`Lease.grace_over`), the worker exits as it would have
at once without a grace.

**Joining.** A worker learns the client generation it serves from its
registration's answer; the controller may call it as soon as it registered,
before that answer is read here. Calls that come meanwhile wait for it
(:meth:`Lease.joining`, :meth:`Lease.joined`) rather than be refused as of
a generation that has not attached this worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from runtime._proto import elastic_pb2 as pb
from runtime.core.errors import ClientSupersededError, StaleEpochError, WorkerFencedError
from runtime.core.owner import Owner
from runtime.worker.replica import Replica

__all__ = ["Lease"]

log = logging.getLogger("jax_elastic.worker")

#: How long a call waits for this worker's registration to be answered (the controller called it at once).
JOIN_WAIT_SECONDS = 10.0


class Lease:
    """The fence and the lease of one worker. Its fields are written by the gRPC handlers' threads and read by
    :func:`runtime.worker.worker_process.serve`'s watch loop; each is one plain value, so they need no lock of
    their own (the epoch, which must not interleave with a step's apply, is the replica's)."""

    CONTROLLER_METHODS = ("Load", "Init", "Step", "Steps", "StateHash", "Shutdown", "Abort", "Rollback", "PullState",
                          "Attach", "LoadCheckpoint", "Checkpoints",
                          "Chaos", "Progress", "Refusals", "Stacks", "PublishWeights", "SyncWeights", "Rollout",
                          "/grpc.health.v1.Health/Check")

    def __init__(self, run_id: str, worker_id: str, replica: Replica, step_timeout: float):
        self.run_id = run_id
        self.worker_id = worker_id
        self.generation = 0                   # the client generation served (a restarted client attaches a newer)
        self.seconds = 0.0                    # seconds without the controller before fencing; 0: off
        self.last_contact = time.monotonic()  # of the controller's last authenticated call
        self.fenced = ""                      # why this worker fenced itself ("" while a member)
        self.client_grace = 0.0               # seconds it waits for a new client once its client is gone
        self.client_lost_at: float | None = None   # time.monotonic() when the client was lost (None: it is not)
        self.owner: Owner | None = None       # the client process watched (runtime.core.owner.Owner), if any
        self.controller = ""                  # host:port the worker registers with (a new client may move it)
        self.serving: Callable[[bool], None] = lambda ok: None   # the health service's status (set by serve)
        self._replica = replica
        self._step_timeout = step_timeout
        self._joined = threading.Event()      # cleared while its registration's answer is on its way
        self._joined.set()

    # -- fencing -------------------------------------------------------------

    def joining(self) -> None:
        """This worker registers now: calls wait for :meth:`joined` (its generation) before their fence is
        checked."""
        self._joined.clear()

    def joined(self, generation: int, client_grace: float = 0.0) -> None:
        """The registration was answered: this worker serves client ``generation`` (a fresh worker serves the
        generation it joined) and outlives it for ``client_grace`` seconds."""
        self.generation, self.client_grace = generation, client_grace
        self._joined.set()

    def check_fence(self, fence: pb.Fence) -> None:
        """Refuses other runs, other client generations and older epochs, and everything once fenced; adopts a
        newer epoch. A call that came while this worker's registration was being answered waits for that
        (at most :data:`JOIN_WAIT_SECONDS`)."""
        self._same_run(fence)
        if not self._joined.is_set():
            self._joined.wait(JOIN_WAIT_SECONDS)
        if fence.generation != self.generation:
            if fence.generation < self.generation:
                raise ClientSupersededError(self.superseded(fence.generation))
            raise StaleEpochError(f"message of client generation {fence.generation}, which has not attached this "
                                  f"worker (it serves generation {self.generation})")
        if self.fenced:
            raise WorkerFencedError(f"worker {self.worker_id} fenced itself: {self.fenced}")
        self._replica.enter_epoch(fence.epoch)

    def fenced_because(self) -> str:
        """Why this worker refuses all work, in a refusal's words ("" while a member)."""
        return f"worker {self.worker_id} fenced itself: {self.fenced}" if self.fenced else ""

    def _same_run(self, fence: pb.Fence) -> None:
        if fence.run_id != self.run_id:
            raise StaleEpochError(f"message for run {fence.run_id!r}, this worker serves {self.run_id!r}")

    def superseded(self, generation: int) -> str:
        return (f"client generation {generation} of run {self.run_id} was taken over by generation "
                f"{self.generation}: another client drives this run now")

    def attach(self, fence: pb.Fence) -> None:
        """A restarted client (a newer generation) takes this worker over, fenced or not: from now on only its
        calls are served. The old client's step in flight gives up; the state stays as it is. Refused
        (:class:`ClientSupersededError`) for a generation not newer; :class:`StaleEpochError` when the old
        client's step did not stop within the step timeout."""
        self._same_run(fence)
        if fence.generation <= self.generation:
            raise ClientSupersededError(self.superseded(fence.generation) if fence.generation < self.generation
                                        else f"client generation {fence.generation} already attached this worker")
        deadline = time.monotonic() + self._step_timeout
        self.generation = fence.generation   # from here on the old client's calls are refused
        self._replica.hand_over(fence.epoch, deadline)
        self.fenced, self.client_lost_at = "", None
        self.last_contact = time.monotonic()
        self.serving(True)

    # -- the client's grace ------------------------------------------------------

    def lose_client(self, why: str) -> bool:
        """The client is gone (``why``): with a grace, fences this worker and starts the grace (True), whatever it
        holds (a worker not loaded yet waits too: the restarted client attaches it and loads it); else False (the
        worker exits now)."""
        if not self.client_grace:
            return False
        if self.client_lost_at is None:
            self.client_lost_at = time.monotonic()
            self.fenced = self.fenced or why
            self.serving(False)
            log.warning("%s: keeping %s for a client of run %s for %.0f s", why, self._held(), self.run_id,
                        self.client_grace)
            self._replica.abort_step()
        return True

    def _held(self) -> str:
        """What this worker keeps through the grace, in a log line's words."""
        executor = self._replica.executor
        if executor is not None and executor.state is not None:
            return "the state"
        return "its programs" if executor is not None else "what it holds"

    def grace_over(self) -> bool:
        """The client was lost longer than the grace ago (and none attached since)."""
        return self.client_lost_at is not None and time.monotonic() - self.client_lost_at > self.client_grace

    # -- the worker's lease on its controller ---------------------------------

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
        if not self.seconds or self.fenced:
            return bool(self.fenced)
        silent = time.monotonic() - self.last_contact
        if silent <= self.seconds:
            return False
        self.fenced = f"no word from the controller for {silent:.1f} s (lease {self.seconds:.1f} s)"
        log.warning("fencing myself: %s", self.fenced)
        self._replica.abort_step()
        return True
