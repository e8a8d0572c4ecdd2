"""The worker's step: a ``Step`` request run in its turn, through its phases, to the state it applies.

:class:`Stepping` is a base class of :class:`runtime.worker.worker.WorkerService`
that holds no state of its own: it works on the service's executor, lock and
step counters (the attributes it declares). A step computes the local
gradients over its subtrees of microbatches (``grad``), reduces them with its
peers (``reduce``: :class:`runtime.worker.collective.AllReduce`, its pieces pushed by
:meth:`Stepping._push` over the data plane, :mod:`runtime.wire.dataplane_client`,
or ``Push`` streams to a peer without one), then applies the optimizer
update (``apply``) and hands the state to the background writer when the
controller asked for a checkpoint or snapshot
(:func:`runtime.worker.worker_state.save_step`). A shadow spare skips ``grad``: it
receives the ranks' reduced vector and applies it as they do.

Contract: steps run strictly in order; a ``Step`` request for step ``s+1``
that arrives early waits (bounded) for step ``s`` to finish, so the controller
may dispatch ahead (at most :data:`runtime.wire.parts.MAX_STEPS_AHEAD` steps). One
step runs at a time (``_running``). A step of an older epoch never applies
after an abort was received; a push for a step this worker is past, or too
far ahead, is refused (:meth:`Stepping._admit_push`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from runtime._proto import elastic_pb2 as pb
from runtime.wire.dataplane_client import DataClient, RemoteError
from runtime.core.errors import ProtocolError, StaleEpochError, StepAbortedError
from runtime.worker.fault_injection import WorkerFaults, corrupt_first
from runtime.core.microbatch import root
from runtime.wire.parts import MAX_STEPS_AHEAD, Part, inline
from runtime.wire.peers import PeerChannels
from runtime.wire.requests import check_step_request, node_of
from runtime.core.timing import Clock
from runtime.worker.stage_step import StageTimes, run_stage_step
from runtime.worker.worker_state import drain_saves, save_step

if TYPE_CHECKING:
    from runtime.worker.collective import AllReduce
    from runtime.worker.executor import SliceExecutor
    from runtime.worker.mailbox import Mailbox
    from runtime.worker.saver import CheckpointWriter
    from runtime.state.snapshot import SnapshotStore

__all__ = ["Stepping"]


class Stepping:
    """The step of :class:`runtime.worker.worker.WorkerService`, on the service's attributes below; it calls the
    service's ``check_fence`` (:class:`runtime.worker.worker_fence.Fencing`), ``_need_state`` and ``_checkpoints``."""

    worker_id: str
    epoch: int
    fenced: str
    step_timeout: float
    executor: SliceExecutor | None
    mailbox: Mailbox
    collective: AllReduce
    chunk_bytes: int
    next_step: int                     # (a property of the service: its executor's applied steps)
    progress: tuple[int, str, float]   # (step, phase, since): what the worker does now, for ``Progress``
    fingerprint: str
    snapshots: SnapshotStore | None
    faults: WorkerFaults
    stage_delay: float                 # a benchmark's simulated compute per forward and backward (0: none)
    data: DataClient
    _running: bool
    _recent: dict[int, float]
    _cond: threading.Condition
    _peers: PeerChannels
    _writer: CheckpointWriter | None

    # -- the step ------------------------------------------------------------

    def _step(self, req: pb.StepRequest, context=None) -> pb.StepReply:
        self.check_fence(req.fence)
        self._need_state()
        check_step_request(req, self.executor.programs.num_microbatches)
        if req.snapshot and self.snapshots is None:
            raise ProtocolError(f"step {req.step} asks for a snapshot, but Load named no snapshot directory")
        deadline = time.monotonic() + self.step_timeout
        epoch = req.fence.epoch
        with self._cond:
            while self.next_step != req.step or self._running:
                if self.fenced:
                    raise StaleEpochError(f"worker {self.worker_id} fenced itself: {self.fenced}")
                if self.epoch != epoch:
                    raise StaleEpochError(f"step {req.step} of epoch {epoch} superseded by epoch {self.epoch}")
                if self.next_step > req.step:
                    raise StaleEpochError(f"step {req.step} already applied (worker at {self.next_step})")
                if req.step > self.next_step + MAX_STEPS_AHEAD:
                    raise ProtocolError(f"step {req.step} is more than {MAX_STEPS_AHEAD} steps ahead of this worker "
                                        f"(at step {self.next_step}); dispatch fewer steps ahead")
                if context is not None and not context.is_active():
                    raise StepAbortedError(req.step, "the caller gave up while the step waited for its turn")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StepAbortedError(req.step, f"still waiting for step {self.next_step}")
                self._cond.wait(min(left, 1.0))   # wakes on every step's end, or to look at the caller
            self._running = True
        try:
            return self._run_step(req, epoch, deadline)
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()

    def _phase(self, step: int, phase: str) -> None:
        self.progress = (step, phase, time.monotonic())   # one tuple: read without a lock

    def _run_step(self, req: pb.StepRequest, epoch: int, deadline: float) -> pb.StepReply:
        try:
            return self._run_phases(req, epoch, deadline)
        finally:
            self._phase(req.step, "idle")

    def _run_phases(self, req: pb.StepRequest, epoch: int, deadline: float) -> pb.StepReply:
        ex = self.executor
        clock = Clock()
        stage = StageTimes(0.0, 0.0)
        t0 = time.perf_counter()
        if req.shadow:   # a shadow spare: the ranks' reduced vector, applied as they apply it
            t1 = t0
            self._phase(req.step, "reduce")
            total, sent = self.collective.receive(fence=req.fence, step=req.step, ranks=len(req.peers),
                                                  size=ex.programs.grad_size + 1, deadline=deadline, clock=clock), 0
        else:
            self._phase(req.step, "grad")
            # Each vector is the gradient sum, then the loss sum: reduced together, in the same tree order.
            if req.HasField("pipeline"):   # one stage of a pipeline replica: its stream, activations to neighbours
                vecs, stage = run_stage_step(req, ex, self._push, self.mailbox, self.chunk_bytes, deadline, clock,
                                             self.stage_delay)
            else:
                vecs = ex.partials(req.step, [node_of(n) for n in req.nodes], clock)
            self.faults.straggle(time.perf_counter() - t0)
            self.faults.in_phase("grad")
            t1 = time.perf_counter()
            self._phase(req.step, "reduce")
            total, sent = self.collective.run(
                vecs, fence=req.fence, step=req.step, rank=req.rank, peers={p.rank: p for p in req.peers},
                owners={node_of(nd): o for nd, o in zip(req.all_nodes, req.node_owner)},
                top=root(ex.programs.num_microbatches), chunk_bytes=self.chunk_bytes, deadline=deadline,
                between_phases=lambda: self.faults.in_phase("reduce"), clock=clock, shadows=list(req.shadows))
        t2 = time.perf_counter()
        self._phase(req.step, "apply")
        with self._cond:
            if self.epoch != epoch:
                raise StepAbortedError(req.step, f"aborted by epoch {self.epoch} before apply")
            ex.apply(total[:-1], clock)
            self.faults.in_phase("apply")
            self._recent[req.step] = float(total[-1])
            if req.checkpoint_directory or req.snapshot:   # written in the background from the immutable state
                save_step(self._checkpoints(), req, ex, fingerprint=self.fingerprint, recent=self._recent,
                          snapshots=self.snapshots, peers=self._peers, timeout=self.step_timeout)
            for old in [k for k in self._recent if k < req.step - 4]:
                del self._recent[old]
        self.mailbox.discard_before(req.step + 1)   # pieces a faulty peer left for steps now past
        t3 = time.perf_counter()
        clock.lap("bookkeeping")
        ck, snap = drain_saves(self._writer)
        return pb.StepReply(step=req.step, loss_sum=float(total[-1]), grad_seconds=t1 - t0, reduce_seconds=t2 - t1,
                            apply_seconds=t3 - t2, bytes_sent=sent, phases=clock.seconds,
                            checkpoints_saved=ck.saved, checkpoint_error=ck.error, snapshots_saved=snap.saved,
                            snapshots_copied=snap.followed, snapshot_error=snap.error,
                            stage_busy_seconds=stage.busy, stage_stream_seconds=stage.stream)


    # -- pushes --------------------------------------------------------------

    def _admit_push(self, step: int, phase: int, src_rank: int) -> None:
        """Refuses a stream for a step this worker is past, or for one too far ahead to be real."""
        num_microbatches = self.executor.programs.num_microbatches
        if src_rank >= num_microbatches:
            raise ProtocolError(f"push from rank {src_rank}: a step has at most {num_microbatches} ranks")
        with self._cond:
            next_step = self.next_step
        if step < next_step:
            raise StaleEpochError(f"push for step {step}: this worker is at step {next_step}")
        if step > next_step + MAX_STEPS_AHEAD:
            raise ProtocolError(f"push for step {step}: more than {MAX_STEPS_AHEAD} steps ahead of {next_step}")


    def _push(self, peer: pb.Peer, parts: Iterator[Part], deadline: float) -> None:
        """The collective's transport: one blocking push to a peer, over its data plane when it has one,
        else a gRPC ``Push`` stream (with the chaos faults)."""
        address = peer.address
        if self.faults.partitioned():
            raise StepAbortedError(-1, f"push to {address} failed: partitioned (chaos)")
        if self.faults.take_corruption():
            parts = corrupt_first(parts)
        if peer.data_address:
            try:
                self.data.push(peer.data_address, parts, deadline)
            except RemoteError as e:
                raise StepAbortedError(-1, f"push to {address} refused: {e}") from e
            except (OSError, ProtocolError) as e:   # reset, timed out, or closed by an abort
                raise StepAbortedError(-1, f"push to {address} failed: {type(e).__name__}: {e}") from e
            return
        with self._peers.pushing(address) as stub:
            try:
                stub.Push(inline(parts), timeout=max(deadline - time.monotonic(), 0.001))
            except grpc.RpcError as e:
                raise StepAbortedError(-1, f"push to {address} failed: {e.code().name}: {e.details()}") from e
            except ValueError as e:   # the channel was closed by an abort
                raise StepAbortedError(-1, f"push to {address} cancelled: the step was aborted ({e})") from None
