"""The controller's calls to workers as plain values: what each call says and what its answer becomes.

The worker group holds the stubs, knows the workers and decides whom to call;
this module is the rest of a call, and keeps no state. It builds requests
from plain values (a step plan, the programs, the run's options), turns
replies into plain values (:class:`StepResult`, :class:`WorkerStatus`,
:class:`LoadResult`), and waits on the futures of many calls at once, turning
gRPC failures into the typed errors of :mod:`runtime.core.errors`. A death
(:class:`Death`) and a step past its deadline (:class:`Stalled`) are values
of the same kind: the controller gets them back from the group instead of
callbacks, so nothing above the group knows about protocol buffers.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import queue
import threading
import time
from collections.abc import Callable, Mapping

import grpc

from runtime.wire import rpc
from runtime._proto import elastic_pb2 as pb
from runtime.core.errors import WorkerLostError
from runtime.control.placement import StepPlan
from runtime.core.programs import ProgramSet
from runtime.pipeline.schedule import compile_schedule

__all__ = ["Death", "LoadResult", "Stalled", "StepResult", "WorkerStatus", "collect", "gather", "load_request",
           "load_result", "settled", "step_outcomes", "step_requests", "step_result", "wait_until", "worker_status"]


@dataclasses.dataclass(frozen=True)
class Death:
    """A worker declared dead: who, why, and the cause (crash, hang, fenced, stuck, load_failed, unresponsive)."""

    worker: str
    reason: str
    cause: str


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One worker's reply to one step."""

    loss_sum: float
    grad_seconds: float = 0.0
    reduce_seconds: float = 0.0
    apply_seconds: float = 0.0
    bytes_sent: int = 0
    phases: Mapping[str, float] = dataclasses.field(default_factory=dict)   # finer: runtime.core.timing.Clock
    checkpoints_saved: tuple[int, ...] = ()   # steps whose checkpoints this worker finished since its last reply
    checkpoint_error: str = ""
    snapshots_saved: tuple[int, ...] = ()
    snapshots_copied: tuple[int, ...] = ()
    snapshot_error: str = ""
    stage_busy_seconds: float = 0.0     # a pipeline stage worker's compute seconds (forward, backward, last)
    stage_stream_seconds: float = 0.0   # and its instruction stream's, first instruction to last
    eval_losses: tuple[tuple[float, float], ...] = ()          # (total, weight) of its request's eval_items
    eval_before_losses: tuple[tuple[float, float], ...] = ()   # and of its eval_before_items


@dataclasses.dataclass(frozen=True)
class WorkerStatus:
    """Where a replica stands after an abort: steps applied, the loss sums of the last ones and the steps of
    the in-memory snapshots on its host."""

    applied_steps: int
    losses: dict[int, float]
    snapshots: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class LoadResult:
    compile_seconds: float
    devices_probed: int
    probe_seconds: float


@dataclasses.dataclass(frozen=True)
class Stalled:
    """:meth:`runtime.control.worker_group.WorkerGroup.wait` reached its deadline; ``pending`` workers have not
    answered yet."""

    pending: tuple[str, ...]


# -- requests --------------------------------------------------------------------


def load_request(fence: pb.Fence, programs: ProgramSet, data_source: bytes, opts, snapshot_root: str) -> pb.LoadRequest:
    """The Load call of the run: its programs (each with its sha256), the data source and the worker's settings
    from ``opts`` (the run's ``ControllerOptions``)."""
    progs = [pb.Program(name=k, serialized=v, sha256=hashlib.sha256(v).hexdigest())
             for k, v in programs.programs().items()]
    return pb.LoadRequest(fence=fence, programs=progs, data_source=data_source,
                          layout=programs.layout_json(), lease_seconds=opts.worker_lease_seconds,
                          chunk_bytes=opts.chunk_bytes,
                          checkpointing=bool(opts.checkpoint_directory and opts.checkpoint_period),
                          snapshot_directory=snapshot_root)


def step_requests(fence: pb.Fence, plan: StepPlan, where: Callable[[str], tuple[str, str]],
                  checkpoints: Mapping[str, tuple[str, list[float]]] | None = None, shadows=(),
                  snapshots: Mapping[str, str | None] | None = None,
                  schedule: str = "1f1b", evals=None, feed=None) -> list[tuple[str, pb.StepRequest]]:
    """The Step calls of step ``plan.step`` in sending order, ``(worker, request)``: each rank's, then each
    shadow's. ``where(worker)``: its ``(address, data address)``; the other arguments as
    :meth:`runtime.control.worker_group.WorkerGroup.dispatch` takes them. A pipelined plan: each stage
    worker's call, with its stream of the pipeline ``schedule`` (:func:`_pipeline_requests`); ``shadows``
    is then ``{spare: the stage it shadows}``. ``evals``: a :class:`runtime.control.evaluation.EvalOrder`
    (the eval microbatches each rank computes after the step, and before it), or None. ``feed``: an RL run's
    :class:`runtime.control.sampling.Feed` (each microbatch's batch, made by the samplers, and the weights to
    publish), or None."""
    snapshots = {w: pb.Peer(address=where(p)[0]) if p else None for w, p in (snapshots or {}).items()}
    saves = {w: {"checkpoint_directory": d, "committed_loss_sums": sums} for w, (d, sums) in (checkpoints or {}).items()}
    if plan.stages > 1:
        return _pipeline_requests(fence, plan, where, schedule, snapshots, shadows or {}, saves)
    peers = [pb.Peer(rank=r, address=a, data_address=d) for r, (a, d) in enumerate(map(where, plan.workers))]
    shadow_peers = [pb.Peer(address=a, data_address=d) for a, d in map(where, shadows)]
    all_nodes, owners = _nodes_and_owners(plan.nodes)
    out = []
    for r, w in enumerate(plan.workers):
        out.append((w, pb.StepRequest(fence=fence, step=plan.step, rank=r, peers=peers,
                                      nodes=[pb.Node(level=n.level, index=n.index) for n in plan.nodes[r]],
                                      all_nodes=all_nodes, node_owner=owners,
                                      **saves.get(w, {}), shadows=shadow_peers,
                                      snapshot=w in snapshots, snapshot_peer=snapshots.get(w),
                                      **_eval_fields(evals, w), **_feed_fields(feed, plan.nodes[r]))))
    for w in shadows:
        out.append((w, pb.StepRequest(fence=fence, step=plan.step, peers=peers, all_nodes=all_nodes,
                                      node_owner=owners, shadow=True)))
    return out


def _feed_fields(feed, nodes) -> dict:
    """An RL trainer's request: the batches of its microbatches, and the weights it publishes after the step."""
    if feed is None:
        return {}
    return {"batches": [feed.batches[m] for n in nodes for m in n.ids],
            "publish_leaves": list(feed.publish_leaves), "publish_dtype": feed.publish_dtype}


def _eval_fields(evals, w: str) -> dict:
    """The eval microbatches of worker ``w``'s request (none without an eval order)."""
    if evals is None:
        return {}
    return {"eval_items": [pb.EvalItem(step=e, microbatch=m) for e, m in evals.after.get(w, ())],
            "eval_before_items": [pb.EvalItem(step=e, microbatch=m) for e, m in evals.before.get(w, ())]}


def _nodes_and_owners(nodes_per_rank) -> tuple[list[pb.Node], list[int]]:
    """Every rank's subtrees in rank order, and the rank owning each (``StepRequest.all_nodes``, ``node_owner``)."""
    all_nodes, owners = [], []
    for r, nodes in enumerate(nodes_per_rank):
        all_nodes += [pb.Node(level=n.level, index=n.index) for n in nodes]
        owners += [r] * len(nodes)
    return all_nodes, owners


@functools.lru_cache(maxsize=64)
def _streams(schedule: str, stages: int, microbatches: tuple[int, ...]):
    """Each stage's stream of one replica's central schedule (the same for every step of a placement)."""
    return compile_schedule(schedule, stages, microbatches).streams


def _pipeline_requests(fence: pb.Fence, plan: StepPlan, where, schedule: str, snapshots: Mapping[str, pb.Peer | None],
                       shadows: Mapping[str, int], saves: Mapping[str, dict]) -> list[tuple[str, pb.StepRequest]]:
    """Each stage worker's Step call: its stage's replicas are its ranks (they reduce that stage's gradients),
    its replica's microbatches its nodes, its stream the replica's central schedule projected on its stage,
    and its neighbours the previous and next stages of its replica. ``snapshots``: the workers that snapshot
    their stage's state after the step, with the peer keeping each copy. ``shadows``: ``{spare: stage}``: the
    stage's ranks push it their reduced chunks, and it gets the step as a shadow of that stage. ``saves``: the
    checkpoint writers (one per stage), with the fields of their requests."""
    replicas, stages = plan.replica_count, plan.stages
    streams = [_streams(schedule, stages, tuple(i for n in plan.nodes[r] for i in n.ids)) for r in range(replicas)]
    all_nodes, owners = _nodes_and_owners(plan.nodes[:replicas])   # replica r's subtrees are slice r's
    addresses = [where(w) for w in plan.workers]

    def peer(v: int, rank: int = 0) -> pb.Peer:
        a, d = addresses[v]
        return pb.Peer(rank=rank, address=a, data_address=d)

    shadow_peers = [[pb.Peer(address=a, data_address=d) for w, (a, d) in ((w, where(w)) for w in shadows)
                     if shadows[w] == k] for k in range(stages)]
    out = []
    for v, w in enumerate(plan.workers):
        k, r = divmod(v, replicas)
        step = pb.PipelineStep(stage=k, stages=stages, instructions=[
            pb.PipelineInstr(op=i.op, microbatch=i.microbatch, what=i.what, peer=i.peer) for i in streams[r][k]])
        if k > 0:
            step.prev.CopyFrom(peer(v - replicas))
        if k < stages - 1:
            step.next.CopyFrom(peer(v + replicas))
        out.append((w, pb.StepRequest(fence=fence, step=plan.step, rank=r,
                                      peers=[peer(k * replicas + q, q) for q in range(replicas)],
                                      nodes=[pb.Node(level=n.level, index=n.index) for n in plan.nodes[v]],
                                      all_nodes=all_nodes, node_owner=owners, pipeline=step,
                                      snapshot=w in snapshots, snapshot_peer=snapshots.get(w),
                                      shadows=shadow_peers[k], **saves.get(w, {}))))
    for w, k in shadows.items():
        out.append((w, pb.StepRequest(fence=fence, step=plan.step, peers=[peer(k * replicas + q, q)
                                                                          for q in range(replicas)],
                                      all_nodes=all_nodes, node_owner=owners, shadow=True)))
    return out


# -- replies ---------------------------------------------------------------------


def step_result(r: pb.StepReply) -> StepResult:
    return StepResult(r.loss_sum, r.grad_seconds, r.reduce_seconds, r.apply_seconds, r.bytes_sent, dict(r.phases),
                      tuple(r.checkpoints_saved), r.checkpoint_error, tuple(r.snapshots_saved),
                      tuple(r.snapshots_copied), r.snapshot_error, r.stage_busy_seconds, r.stage_stream_seconds,
                      tuple((x.total, x.weight) for x in r.eval_losses),
                      tuple((x.total, x.weight) for x in r.eval_before_losses))


def worker_status(r: pb.StatusReply) -> WorkerStatus:
    return WorkerStatus(r.applied_steps, {l.step: l.loss_sum for l in r.recent}, tuple(r.snapshots))


def load_result(r: pb.LoadReply) -> LoadResult:
    return LoadResult(r.compile_seconds, r.devices_probed, r.probe_seconds)


# -- waiting ---------------------------------------------------------------------


def gather(futs: dict[str, grpc.Future], deadline: float | None = None) -> dict[str, object] | Stalled:
    """Waits for every RPC future; raises the typed error of the first to *fail*.

    Completion order matters: when one worker fails, its peers typically fail
    later with a timeout; the first failure is the cause. With ``deadline``
    (monotonic), answers :class:`Stalled` if the futures are not all done by
    then; waiting again on the same futures picks up where this one left.
    """
    done: queue.Queue = queue.Queue()
    for w, f in futs.items():
        f.add_done_callback(lambda f, w=w: done.put((w, f)))
    out = {}
    for _ in futs:
        try:
            w, f = done.get(timeout=None if deadline is None else max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            return Stalled(tuple(w for w, f in futs.items() if not f.done()))
        try:
            out[w] = f.result()
        except grpc.FutureCancelledError:
            raise WorkerLostError(w, "declared dead; its call was cancelled") from None
        except grpc.RpcError as e:
            raise rpc.to_error(w, e) from None
    return out


def settled(futs: dict[str, grpc.Future]) -> bool:
    """Whether a step's futures need no more waiting: every one is done, or one failed (its error is the step's,
    which :func:`gather` raises at once; the others would only wait for the lost one)."""
    done = [f for f in futs.values() if f.done()]
    return len(done) == len(futs) or any(f.cancelled() or f.exception() is not None for f in done)


def wait_any(futs, timeout: float) -> None:
    """Waits until one of the futures ``futs`` (any iterable) is done, or ``timeout`` seconds passed; raises
    nothing, and returns at once when there is none. Woken by the futures' callbacks, not by polling."""
    futs = list(futs)
    if not futs:
        return
    woken = threading.Event()
    for f in futs:
        f.add_done_callback(lambda _: woken.set())
    woken.wait(timeout)


def wait_until(futs: dict[str, grpc.Future], deadline: float) -> None:
    """Waits until every future of ``futs`` is done or ``deadline`` (monotonic) passed; raises nothing."""
    for f in futs.values():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            f.result(timeout=left)
        except Exception:  # noqa: BLE001 - only waiting: the caller reads each outcome
            pass


def collect(futs: dict[str, grpc.Future],
            on_lost: Callable[[str, WorkerLostError], None]) -> tuple[dict[str, object], Exception | None]:
    """Waits for every future of ``futs`` in turn: ``(the replies of those that succeeded, the first other error)``.

    A cancelled call (its worker was declared dead meanwhile) is left out; so
    is a worker lost during its call (``WorkerLostError``), handed to
    ``on_lost`` as soon as it is found. Any other failure (the worker answered
    with an error) is not raised but answered, the first in ``futs`` order.
    """
    out, raised = {}, None
    for w, f in futs.items():
        try:
            out[w] = f.result()
        except grpc.FutureCancelledError:
            pass   # declared dead meanwhile
        except grpc.RpcError as e:
            error = rpc.to_error(w, e)
            if isinstance(error, WorkerLostError):
                on_lost(w, error)
            else:
                raised = raised or error
    return out, raised


def step_outcomes(ended: dict[str, grpc.Future]) -> dict[str, StepResult | Exception]:
    """Each step future of ``ended`` (all done) as a :class:`StepResult` or the typed error."""
    out: dict[str, StepResult | Exception] = {}
    for w, f in ended.items():
        try:
            out[w] = step_result(gather({w: f})[w])
        except Exception as e:  # noqa: BLE001 - handed back as a value (gather raised the typed error)
            out[w] = e
    return out
