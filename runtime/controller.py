"""The controller: the client side of a run.

It owns the run (run id, membership epoch, placement), launches and registers
workers, ships the programs, dispatches steps ahead of completion, commits
them, and records everything in the event log. It never holds the training
state: only programs (bytes), per-step losses and timings pass through it.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import resource
import threading
import time
import uuid

import grpc
import numpy as np

from runtime import rpc
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.errors import ElasticTrainingFailedError, RegistrationTimeoutError
from runtime.events import EventLog
from runtime.executor import add_f32
from runtime.launcher import LocalLauncher
from runtime.microbatch import Node, root, tree_reduce
from runtime.programs import ProgramSet
from runtime.resource_manager import Placement, StepPlan, WorkerInfo, place, plan_step

__all__ = ["ControllerOptions", "Controller", "RunResult", "gather", "peak_rss_bytes"]


def peak_rss_bytes() -> int:
    """Peak resident set of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gather(futures: dict[str, grpc.Future]) -> dict[str, object]:
    """Waits for every RPC future; raises the typed error of the first to *fail*.

    Completion order matters: when one worker fails, its peers typically fail
    later with a timeout; the first failure is the cause.
    """
    done: queue.Queue = queue.Queue()
    for w, f in futures.items():
        f.add_done_callback(lambda f, w=w: done.put((w, f)))
    out = {}
    for _ in futures:
        w, f = done.get()
        try:
            out[w] = f.result()
        except grpc.RpcError as e:
            raise rpc.to_error(w, e) from None
    return out


@dataclasses.dataclass(frozen=True)
class ControllerOptions:
    slices: int
    devices_per_slice: int
    run_dir: str
    run_id: str = ""
    host: str = "127.0.0.1"
    rpc_timeout_seconds: float = 120.0
    register_timeout_seconds: float = 120.0
    dispatch_depth: int = 2


@dataclasses.dataclass(frozen=True)
class RunResult:
    steps_completed: int
    losses: list[float]
    final_state_sha256: str
    replica_hashes: dict[str, str]
    wall_seconds: float
    client_peak_rss_bytes: int
    state_bytes: int


class _Registry(pb_grpc.ControllerServicer):
    """Receives worker registrations (the controller's gRPC service)."""

    def __init__(self, run_id: str, events: EventLog):
        self.run_id = run_id
        self.events = events
        self.workers: dict[str, WorkerInfo] = {}
        self.cond = threading.Condition()

    def Register(self, request, context):
        if request.run_id != self.run_id:
            self.events.emit("register_refused", worker=request.worker_id, reason="wrong run id")
            return pb.RegisterReply(accepted=False, reason=f"this controller runs {self.run_id!r}")
        info = WorkerInfo(request.worker_id, request.address, request.num_devices, request.platform, request.pid)
        with self.cond:
            self.workers[info.worker_id] = info
            self.cond.notify_all()
        self.events.emit("worker_registered", worker=info.worker_id, address=info.address,
                         devices=info.num_devices, platform=info.platform, pid=info.pid)
        return pb.RegisterReply(accepted=True)

    def wait_for(self, n: int, timeout: float) -> list[WorkerInfo]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while len(self.workers) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RegistrationTimeoutError(f"{len(self.workers)} of {n} workers registered within "
                                                   f"{timeout:.0f} s; see the worker logs")
                self.cond.wait(left)
            return list(self.workers.values())


class Controller:
    """Drives one run. Use as a context manager; ``train`` does the work."""

    def __init__(self, programs: ProgramSet, data_source: bytes, options: ControllerOptions, events: EventLog):
        self.programs = programs
        self.data_source = data_source
        self.opts = options
        self.run_id = options.run_id or uuid.uuid4().hex[:12]
        self.events = events
        self.registry = _Registry(self.run_id, events)
        self.server, port = rpc.make_server(options.host, 0, max_workers=8)
        pb_grpc.add_ControllerServicer_to_server(self.registry, self.server)
        self.address = f"{options.host}:{port}"
        self.launcher = LocalLauncher(self.run_id, self.address, options.devices_per_slice,
                                      f"{options.run_dir}/logs")
        self.placement: Placement | None = None
        self.stubs: dict[str, pb_grpc.WorkerStub] = {}

    # -- lifecycle -----------------------------------------------------------

    def __enter__(self) -> Controller:
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for wid, stub in self.stubs.items():
            try:
                stub.Shutdown(pb.ShutdownRequest(fence=self._fence()), timeout=2.0)
            except grpc.RpcError:
                pass
        self.launcher.stop_all()
        self.server.stop(0)

    def _fence(self) -> pb.Fence:
        return pb.Fence(run_id=self.run_id, epoch=self.placement.epoch if self.placement else 0)

    def _call(self, worker_id: str, method: str, request, timeout: float | None = None):
        try:
            return getattr(self.stubs[worker_id], method)(request, timeout=timeout or self.opts.rpc_timeout_seconds)
        except grpc.RpcError as e:
            raise rpc.to_error(worker_id, e) from None

    def _all(self, method: str, make_request, workers=None) -> dict[str, object]:
        """Calls ``method`` on every active worker concurrently; see :func:`gather`."""
        workers = workers or self.placement.active
        return gather({w: getattr(self.stubs[w], method).future(make_request(w), timeout=self.opts.rpc_timeout_seconds)
                       for w in workers})

    # -- setup ---------------------------------------------------------------

    def start_workers(self) -> None:
        """Launches, registers, places, loads programs and initializes state."""
        t0 = time.time()
        for v in range(self.opts.slices):
            self.launcher.launch(f"w{v}")
        workers = self.registry.wait_for(self.opts.slices, self.opts.register_timeout_seconds)
        for w in workers:
            self.stubs[w.worker_id] = pb_grpc.WorkerStub(rpc.channel(w.address))
        try:
            self.placement = place(self.opts.slices, self.opts.devices_per_slice, workers)
        except ValueError as e:
            raise ElasticTrainingFailedError("cannot place the virtual slices", cause=str(e)) from None
        self.events.emit("placement", epoch=self.placement.epoch, active=list(self.placement.active),
                         spares=list(self.placement.spares), seconds=time.time() - t0)
        progs = [pb.Program(name=k, serialized=v) for k, v in self.programs.programs().items()]
        layout = self.programs.layout_json()
        replies = self._all("Load", lambda w: pb.LoadRequest(fence=self._fence(), programs=progs,
                                                              data_source=self.data_source, layout=layout))
        self.events.emit("programs_loaded", compile_seconds={w: r.compile_seconds for w, r in replies.items()},
                         program_bytes=sum(len(p.serialized) for p in progs))

    def init_state(self, seed: int) -> int:
        replies = self._all("Init", lambda w: pb.InitRequest(fence=self._fence(), seed=seed))
        sizes = {r.state_bytes for r in replies.values()}
        self.events.emit("state_initialized", seed=seed, state_bytes=max(sizes))
        return max(sizes)

    # -- training ------------------------------------------------------------

    def _step_requests(self, plan: StepPlan) -> dict[str, pb.StepRequest]:
        peers = [pb.Peer(rank=r, address=self.registry.workers[w].address) for r, w in enumerate(plan.workers)]
        all_nodes, owners = [], []
        for r, nodes in enumerate(plan.nodes):
            all_nodes += [pb.Node(level=n.level, index=n.index) for n in nodes]
            owners += [r] * len(nodes)
        return {w: pb.StepRequest(fence=self._fence(), step=plan.step, rank=r, peers=peers,
                                  nodes=[pb.Node(level=n.level, index=n.index) for n in plan.nodes[r]],
                                  all_nodes=all_nodes, node_owner=owners)
                for r, w in enumerate(plan.workers)}

    def _dispatch(self, plan: StepPlan):
        reqs = self._step_requests(plan)
        futs = {w: self.stubs[w].Step.future(req, timeout=self.opts.rpc_timeout_seconds) for w, req in reqs.items()}
        self.events.emit("step_dispatched", step=plan.step, epoch=plan.epoch, workers=list(plan.workers))
        return plan, futs, time.time()

    def _commit(self, plan: StepPlan, futs, t_dispatch: float) -> float:
        replies = gather(futs)
        partials = {Node(nl.node.level, nl.node.index): np.float32(nl.loss_sum)
                    for r in replies.values() for nl in r.losses}
        m = self.programs.num_microbatches
        loss = float(tree_reduce(partials, root(m), add_f32) / np.float32(m))
        self.events.emit(
            "step_committed", step=plan.step, epoch=plan.epoch, loss=loss,
            microbatches={w: [i for n in nodes for i in n.ids] for w, nodes in zip(plan.workers, plan.nodes)},
            grad_seconds=max(r.grad_seconds for r in replies.values()),
            reduce_seconds=max(r.reduce_seconds for r in replies.values()),
            apply_seconds=max(r.apply_seconds for r in replies.values()),
            bytes_sent=sum(r.bytes_sent for r in replies.values()),
            seconds=time.time() - t_dispatch)
        return loss

    def train(self, steps: int, seed: int, on_step=None) -> RunResult:
        """Runs ``steps`` steps from a fresh state; returns the run's summary."""
        t0 = time.time()
        self.events.emit("run_started", run_id=self.run_id, slices=self.opts.slices,
                         devices_per_slice=self.opts.devices_per_slice,
                         microbatches=self.programs.num_microbatches, steps=steps, controller=self.address)
        self.start_workers()
        state_bytes = self.init_state(seed)
        losses: list[float] = []
        pending: collections.deque = collections.deque()
        for step in range(steps):
            pending.append(self._dispatch(plan_step(self.placement, step, self.programs.num_microbatches)))
            while pending and (len(pending) >= self.opts.dispatch_depth or step == steps - 1):
                plan, futs, td = pending.popleft()
                losses.append(self._commit(plan, futs, td))
                if on_step is not None:
                    on_step(plan.step, losses[-1])
        hashes = {w: r.sha256 for w, r in self._all("StateHash", lambda w: pb.HashRequest(fence=self._fence())).items()}
        if len(set(hashes.values())) != 1:
            raise ElasticTrainingFailedError("replicas diverged", step=steps, cause=f"state hashes {hashes}")
        result = RunResult(steps_completed=len(losses), losses=losses, final_state_sha256=next(iter(hashes.values())),
                           replica_hashes=hashes, wall_seconds=time.time() - t0,
                           client_peak_rss_bytes=peak_rss_bytes(), state_bytes=state_bytes)
        self.events.emit("run_finished", steps_completed=result.steps_completed,
                         final_state_sha256=result.final_state_sha256, replica_hashes=hashes,
                         wall_seconds=result.wall_seconds, client_peak_rss_bytes=result.client_peak_rss_bytes)
        return result

