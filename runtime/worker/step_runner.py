"""The worker's step: a ``Step`` request run in its turn, through its phases, to the state it applies; and the pushes
of its pieces, out to peers and in from them.

:class:`StepRunner` computes the local gradients over its subtrees of
microbatches (``grad``), reduces them with its peers (``reduce``:
:class:`runtime.worker.collective.AllReduce`, its pieces pushed by
:meth:`StepRunner.push` over the data plane,
:mod:`runtime.wire.dataplane_client`, or ``Push`` streams to a peer without
one), then applies the optimizer update (``apply``) and hands the state to
the background writer when the controller asked for a checkpoint or snapshot
(:meth:`runtime.worker.worker_state.StateMover.save`), and, when the request
names eval microbatches, computes their held-out loss on the new state
(``eval``; the state is only read) before it answers. A shadow spare skips
``grad``: it receives the ranks' reduced vector and applies it as they do.

Contract: steps run strictly in order; a ``Step`` request for step ``s+1``
that arrives early waits (bounded) for step ``s`` to finish, so the controller
may dispatch ahead (at most :data:`runtime.wire.parts.MAX_STEPS_AHEAD` steps). One
step runs at a time (:meth:`runtime.worker.replica.Replica.take_turn`). A step
of an older epoch never applies after an abort was received; a push for a step
this worker is past, or too far ahead, is refused (:meth:`StepRunner.admit_push`).
The hosts of a slice of several start and apply a step only together
(:mod:`runtime.worker.agreement`): their programs' collectives wait for all.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc

from runtime._proto import elastic_pb2 as pb
from runtime.core.errors import ProtocolError, StaleEpochError, StepAbortedError
from runtime.core.microbatch import root
from runtime.core.timing import Clock
from runtime.wire.batches import decode_batch
from runtime.wire.dataplane_client import DataClient, RemoteError
from runtime.wire.parts import MAX_STEPS_AHEAD, Part, inline
from runtime.wire.peers import PeerChannels
from runtime.wire.requests import check_step_request, for_host, node_of
from runtime.worker.agreement import SliceAgreement
from runtime.worker.collective import AllReduce
from runtime.worker.executor import add_f32
from runtime.worker.fault_injection import WorkerFaults, corrupt_first
from runtime.worker.lease import Lease
from runtime.worker.mailbox import Mailbox
from runtime.worker.replica import Replica
from runtime.worker.stage_step import StageTimes, run_stage_step
from runtime.worker.weights import WeightOutbox, cast_weights
from runtime.worker.worker_state import StateMover

__all__ = ["StepRunner"]


def _check_evals(req: pb.StepRequest, ex) -> None:
    """A step's eval microbatches need the eval program and eval data, and name microbatches of a step."""
    items = [*req.eval_items, *req.eval_before_items]
    if not items:
        return
    if req.shadow or not ex.programs.evaluates or not callable(getattr(ex.data, "eval_batch", None)):
        raise ProtocolError(f"step {req.step} asks for {len(items)} eval microbatches, but this worker "
                            + ("is its shadow" if req.shadow else "loaded no eval program and eval data"))
    m = ex.programs.num_microbatches
    if any(i.step < 0 or not 0 <= i.microbatch < m for i in items):
        raise ProtocolError(f"step {req.step} names an eval microbatch outside eval steps >= 0 and microbatches "
                            f"0..{m - 1}")


class StepRunner:
    """Runs this worker's steps and carries their pieces. Owns the all-reduce (:attr:`collective`) and what the
    worker does now (:attr:`progress`, for ``Progress``); the state, the turn and the epoch are the replica's,
    the pieces received the mailbox's."""

    def __init__(self, replica: Replica, lease: Lease, states: StateMover, *, mailbox: Mailbox, peers: PeerChannels,
                 data: DataClient, faults: WorkerFaults, step_timeout: float, stage_delay: float = 0.0,
                 agreement: SliceAgreement | None = None, weights: WeightOutbox | None = None):
        self._weights = weights if weights is not None else WeightOutbox()   # the versions published (RL)
        self._replica, self._lease, self._states = replica, lease, states
        self._agreement = agreement if agreement is not None else SliceAgreement()   # the slice's hosts' votes
        self._mailbox, self._peers, self._data, self._faults = mailbox, peers, data, faults
        self._step_timeout = step_timeout
        self._stage_delay = stage_delay   # benchmarks only: seconds slept per forward and per backward of a stage, or per step
        self.collective = AllReduce(self.push, mailbox, add_f32)
        self.progress = (-1, "idle", time.monotonic())   # (step, phase, since): one tuple, read without a lock

    # -- the step ------------------------------------------------------------

    def run(self, req: pb.StepRequest, context=None) -> pb.StepReply:
        """Controller (``Step``, or one request of a step stream): runs step ``req.step`` in its turn and
        answers what it took. Raises, with the state as it was, when the request is fenced off or malformed,
        not this worker's turn within the step timeout, or aborted by a newer epoch before it applied."""
        replica = self._replica
        deadline = time.monotonic() + self._step_timeout
        epoch, agreement = req.fence.epoch, self._agreement
        try:
            self._lease.check_fence(req.fence)
            replica.need_state()
            req = for_host(req, replica.executor.host)   # a slice of several hosts: each pairs with its peers' host
            check_step_request(req, replica.executor.programs.num_microbatches)
            if req.snapshot and self._states.snapshots is None:
                raise ProtocolError(f"step {req.step} asks for a snapshot, but Load named no snapshot directory")
            _check_evals(req, replica.executor)
            replica.take_turn(req.step, epoch, deadline, self._lease.fenced_because, context)
        except BaseException:
            agreement.refuse("start", epoch, req.step)   # the slice's other hosts do not start it either
            raise
        try:
            if not agreement.agree("start", epoch, req.step, True, deadline):
                raise StepAbortedError(req.step, "another host of this slice gave the step up before it started")
            return self._run_step(req, epoch, deadline)
        except BaseException:
            agreement.refuse("apply", epoch, req.step)   # given up before its apply vote: nor do the others apply
            raise
        finally:
            replica.end_turn()

    def _phase(self, step: int, phase: str) -> None:
        self.progress = (step, phase, time.monotonic())

    def _evaluate(self, step: int, ex, items, clock: Clock) -> list[tuple[float, float]]:
        """The ``eval`` phase of step ``step``: ``items``' held-out losses on the state as it is (the state is only
        read); the chaos kill of that phase strikes after it."""
        self._phase(step, "eval")
        losses = ex.evaluate(items, clock)
        self._faults.in_phase("eval")
        return losses

    def _run_step(self, req: pb.StepRequest, epoch: int, deadline: float) -> pb.StepReply:
        try:
            return self._run_phases(req, epoch, deadline)
        finally:
            self._phase(req.step, "idle")

    def _run_phases(self, req: pb.StepRequest, epoch: int, deadline: float) -> pb.StepReply:
        replica = self._replica
        ex = replica.executor
        chunk_bytes = replica.chunk_bytes
        clock = Clock()
        stage = StageTimes(0.0, 0.0)
        t0 = time.perf_counter()
        items = [(i.step, i.microbatch) for i in req.eval_items]
        before = [(i.step, i.microbatch) for i in req.eval_before_items]
        evals, evals_before = [], []
        if req.batches:   # an RL run's: its samplers' rollouts of this worker's microbatches
            ex.feed({(b.step, b.microbatch): decode_batch(b, ex.programs.batch_spec) for b in req.batches})
        if before:   # owed by the previous step: on the state it left, before this step's gradient
            evals_before = self._evaluate(req.step, ex, before, clock)
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
                vecs, stage = run_stage_step(req, ex, self.push, self._mailbox, chunk_bytes, deadline, clock,
                                             self._stage_delay)
            else:
                vecs = ex.partials(req.step, [node_of(n) for n in req.nodes], clock)
                if self._stage_delay:   # simulated compute, as a stage's (benchmarks and tests: long runs, idle CPU)
                    time.sleep(self._stage_delay)
            ex.feed({})
            self._faults.straggle(time.perf_counter() - t0)
            self._faults.in_phase("grad")
            t1 = time.perf_counter()
            self._phase(req.step, "reduce")
            total, sent = self.collective.run(
                vecs, fence=req.fence, step=req.step, rank=req.rank, peers={p.rank: p for p in req.peers},
                owners={node_of(nd): o for nd, o in zip(req.all_nodes, req.node_owner)},
                top=root(ex.programs.num_microbatches), chunk_bytes=chunk_bytes, deadline=deadline,
                between_phases=lambda: self._faults.in_phase("reduce"), clock=clock, shadows=list(req.shadows))
        t2 = time.perf_counter()
        self._phase(req.step, "apply")
        agree = (lambda ok: self._agreement.agree("apply", epoch, req.step, ok, deadline))
        with replica.applying(req.step, epoch, agree):
            ex.apply(total[:-1], clock)
            self._faults.in_phase("apply")
            recent = replica.recent
            recent[req.step] = float(total[-1])
            if req.checkpoint_directory or req.snapshot:   # written in the background from the immutable state
                self._states.save(req)
            for old in [k for k in recent if k < req.step - 4]:
                del recent[old]
            if req.publish_leaves:   # an RL run's policy: weights version step + 1, for the samplers to pull
                # (only its leaves come to the host; their digest is taken when a sampler first asks, off the step)
                self._weights.put(req.step + 1, cast_weights(ex.state, req.publish_leaves, req.publish_dtype))
        self._mailbox.discard_before(req.step + 1)   # pieces a faulty peer left for steps now past
        t3 = time.perf_counter()
        clock.lap("bookkeeping")
        if items:   # held-out loss on the state this step applied
            evals = self._evaluate(req.step, ex, items, clock)
        ck, snap = self._states.drain_saves()
        return pb.StepReply(step=req.step, loss_sum=float(total[-1]), grad_seconds=t1 - t0, reduce_seconds=t2 - t1,
                            apply_seconds=t3 - t2, bytes_sent=sent, phases=clock.seconds,
                            checkpoints_saved=ck.saved, checkpoint_error=ck.error, snapshots_saved=snap.saved,
                            snapshots_copied=snap.followed, snapshot_error=snap.error,
                            stage_busy_seconds=stage.busy, stage_stream_seconds=stage.stream,
                            eval_losses=[pb.EvalLoss(total=t, weight=w) for t, w in evals],
                            eval_before_losses=[pb.EvalLoss(total=t, weight=w) for t, w in evals_before])

    # -- pushes --------------------------------------------------------------

    def receive_push(self, chunks) -> None:
        """Peer: one push stream (``Push``, or the data plane's ``Incoming`` chunks) into the mailbox; every
        chunk is fenced, the stream admitted by its first (:meth:`admit_push`). Raises to refuse the stream."""
        self._replica.need_executor()
        self._mailbox.receive(chunks, self._lease.check_fence, admit=self.admit_push)

    def admit_push(self, step: int, phase: int, src_rank: int) -> None:
        """Refuses a stream for a step this worker is past, or for one too far ahead to be real."""
        replica = self._replica
        num_microbatches = replica.executor.programs.num_microbatches
        if src_rank >= num_microbatches:
            raise ProtocolError(f"push from rank {src_rank}: a step has at most {num_microbatches} ranks")
        with replica.locked():
            next_step = replica.next_step
        if step < next_step:
            raise StaleEpochError(f"push for step {step}: this worker is at step {next_step}")
        if step > next_step + MAX_STEPS_AHEAD:
            raise ProtocolError(f"push for step {step}: more than {MAX_STEPS_AHEAD} steps ahead of {next_step}")

    def push(self, peer: pb.Peer, parts: Iterator[Part], deadline: float) -> None:
        """The collective's transport: one blocking push to a peer, over its data plane when it has one,
        else a gRPC ``Push`` stream (with the chaos faults). Raises :class:`StepAbortedError` when it fails or
        an abort closed it."""
        address = peer.address
        if self._faults.partitioned():
            raise StepAbortedError(-1, f"push to {address} failed: partitioned (chaos)")
        if self._faults.take_corruption():
            parts = corrupt_first(parts)
        if peer.data_address:
            try:
                self._data.push(peer.data_address, parts, deadline)
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
