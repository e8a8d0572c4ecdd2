"""The controller: the client side of a run.

It owns the run (run id, membership epoch, placement), launches and registers
workers, ships the programs, dispatches steps ahead of completion, commits
them, and records everything in the event log. It never holds the training
state: only programs (bytes), per-step losses and timings pass through it.
"""

from __future__ import annotations

import collections
from concurrent import futures
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
from runtime import auth
from runtime.errors import (ElasticTrainingFailedError, RegistrationTimeoutError, StaleEpochError, StepAbortedError,
                            WorkerLostError)
from runtime.health import HealthMonitor
from runtime.events import EventLog
from runtime.launcher import LocalLauncher
from runtime.programs import ProgramSet
from runtime.resource_manager import (Placement, StepPlan, WorkerInfo, decide_grow, decide_recovery, decide_swap, place,
                                     plan_step)
from runtime.stragglers import StragglerDetector, StragglerPolicy, holding_up

__all__ = ["ControllerOptions", "Controller", "ControllerObserver", "RunResult", "gather", "peak_rss_bytes"]


def peak_rss_bytes() -> int:
    """Peak resident set of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gather(futures: dict[str, grpc.Future], watchdog=None) -> dict[str, object]:
    """Waits for every RPC future; raises the typed error of the first to *fail*.

    Completion order matters: when one worker fails, its peers typically fail
    later with a timeout; the first failure is the cause. ``watchdog``:
    ``(monotonic deadline, callback(pending worker ids))``, called once if
    the futures are not all done by then (the wait goes on; every future has
    its own RPC deadline).
    """
    done: queue.Queue = queue.Queue()
    for w, f in futures.items():
        f.add_done_callback(lambda f, w=w: done.put((w, f)))
    out = {}
    for _ in futures:
        try:
            w, f = done.get(timeout=max(watchdog[0] - time.monotonic(), 0.0) if watchdog else None)
        except queue.Empty:
            watchdog[1]([w for w, f in futures.items() if not f.done()])
            watchdog = None
            w, f = done.get()
        try:
            out[w] = f.result()
        except grpc.FutureCancelledError:
            raise WorkerLostError(w, "declared dead; its call was cancelled") from None
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
    spares: int = 0
    min_slices: int = 1
    max_retries: int = 10
    heartbeat_seconds: float = 0.25
    lease_seconds: float = 1.5
    probe_retries: int = 2
    relaunch: bool = True
    secret: str = ""
    worker_lease_seconds: float = 5.0      # a worker fences itself after this long without the controller
    capacity_timeout_seconds: float = 0.0  # below min_slices: wait this long for a worker to join
    straggler_factor: float = 3.0
    straggler_patience: int = 3
    replace_stragglers: bool = False
    watchdog_factor: float = 10.0          # a step this many times slower than the median...
    watchdog_min_seconds: float = 10.0     # ...and at least this long triggers the step watchdog
    chaos: bool = False                    # workers serve fault-injection calls
    tls: auth.TlsFiles | None = None       # mutual TLS on every link


class ControllerObserver:
    """Hooks for the chaos harness (and anything else that watches a run). Default: no-ops.

    Called on the controller's thread; a hook must return quickly.
    """

    def attach(self, controller: "Controller") -> None:
        """The controller started; workers are registered and placed."""

    def step_committed(self, step: int) -> None:
        """Step ``step`` was committed."""

    def before_transfer(self, source: str, dest: str) -> None:
        """A peer-to-peer state transfer from ``source`` to ``dest`` is about to start."""

    def close(self) -> None:
        """The run ended (in any way)."""


@dataclasses.dataclass(frozen=True)
class RunResult:
    steps_completed: int
    losses: list[float]
    final_state_sha256: str
    replica_hashes: dict[str, str]
    wall_seconds: float
    client_peak_rss_bytes: int
    state_bytes: int
    recoveries: int = 0


class _Registry(pb_grpc.ControllerServicer):
    """Receives worker registrations (the controller's gRPC service)."""

    def __init__(self, run_id: str, events: EventLog, refuse=lambda worker_id: ""):
        self.run_id = run_id
        self.events = events
        self.refuse = refuse   # worker id -> why it may not (re)join, "" if it may
        self.workers: dict[str, WorkerInfo] = {}
        self.cond = threading.Condition()

    def Register(self, request, context):
        reason = ""
        if request.run_id != self.run_id:
            reason = f"this controller runs {self.run_id!r}, not {request.run_id!r}"
        elif request.worker_id in self.workers:
            reason = self.refuse(request.worker_id) or f"worker id {request.worker_id!r} is already a member"
        if reason:
            self.events.emit("register_refused", worker=request.worker_id, rejoin=request.rejoin, reason=reason)
            return pb.RegisterReply(accepted=False, reason=reason)
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
        self.secret = options.secret or auth.new_secret()
        self.registry = _Registry(self.run_id, events, refuse=self._why_fenced)
        self.server, port = rpc.make_server(options.host, 0, max_workers=8, secret=self.secret, tls=options.tls)
        pb_grpc.add_ControllerServicer_to_server(self.registry, self.server)
        self.address = f"{options.host}:{port}"
        self.launcher = LocalLauncher(self.run_id, self.address, options.devices_per_slice,
                                      f"{options.run_dir}/logs", secret=self.secret, chaos=options.chaos,
                                      tls=options.tls)
        self.placement: Placement | None = None
        self.stubs: dict[str, pb_grpc.WorkerStub] = {}
        self.channels: dict[str, grpc.Channel] = {}
        self.inflight: dict[str, list[grpc.Future]] = {}
        self.dead: dict[str, str] = {}          # worker -> why (declared by the monitor or a probe)
        self.warming: dict[str, grpc.Future] = {}
        self.replicas: set[str] = set()          # workers known to hold the state at the committed frontier
        self.plans: dict[int, StepPlan] = {}     # dispatched, not yet committed
        self.swap_pending: list[str] = []
        self.relaunched: set[str] = set()         # stragglers to move onto spares at the next boundary
        self.stragglers = StragglerDetector(StragglerPolicy(options.straggler_factor, options.straggler_patience))
        self.observer = ControllerObserver()
        self.step_seconds: collections.deque = collections.deque(maxlen=20)
        self.last_commit = time.monotonic()
        self.recoveries = 0
        self.monitor = HealthMonitor(self._channel, self._declare_dead, interval=options.heartbeat_seconds,
                                     lease=options.lease_seconds, retries=options.probe_retries, events=events)
        self._launched = 0
        self._lock = threading.Lock()

    # -- lifecycle -----------------------------------------------------------

    def __enter__(self) -> Controller:
        self.server.start()
        self.monitor.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.observer.close()
        self.monitor.stop()
        for wid, stub in self.stubs.items():
            if wid in self.dead:
                continue
            try:
                stub.Shutdown(pb.ShutdownRequest(fence=self._fence()), timeout=2.0)
            except grpc.RpcError:
                pass
        for wid in self.dead:
            self.launcher.kill(wid)   # a declared-dead process may be stopped (hang) or cut off
        self.launcher.stop_all()
        self.server.stop(0)

    def _channel(self, address: str) -> grpc.Channel:
        ch = self.channels.get(address)
        if ch is None:
            ch = self.channels[address] = rpc.channel(address, self.secret, self.opts.tls)
        return ch

    def _declare_dead(self, worker_id: str, reason: str, cause: str = "unresponsive") -> None:
        """Called by the health monitor (or a probe): fence the worker, fail its RPCs."""
        with self._lock:
            if worker_id in self.dead:
                return
            self.dead[worker_id] = reason
            futs = self.inflight.pop(worker_id, [])
        self.events.emit("worker_dead", worker=worker_id, reason=reason, cause=cause)
        # Not killed: on a real cluster a partitioned host cannot be reached
        # either. Fencing keeps it harmless (older epoch; refused on rejoin)
        # and it fences itself when its lease on this controller lapses.
        for f in futs:
            f.cancel()

    def _dead_members(self) -> list[str]:
        """Members of the current placement (active or spare) declared dead, sorted."""
        return sorted(w for w in self.placement.active + self.placement.spares if w in self.dead)

    def _live_spare(self) -> bool:
        return any(s not in self.dead for s in self.placement.spares)

    def _why_fenced(self, worker_id: str) -> str:
        if worker_id in self.dead:
            return (f"worker {worker_id} was declared dead ({self.dead[worker_id]}) and is fenced; the run is at "
                    f"epoch {self.placement.epoch if self.placement else 0}: a fresh process joins as a new worker")
        return ""

    def _launch(self) -> str:
        wid = f"w{self._launched}"
        self._launched += 1
        self.launcher.launch(wid)
        return wid

    def _fence(self) -> pb.Fence:
        return pb.Fence(run_id=self.run_id, epoch=self.placement.epoch if self.placement else 0)

    def _call(self, worker_id: str, method: str, request, timeout: float | None = None):
        try:
            return getattr(self.stubs[worker_id], method)(request, timeout=timeout or self.opts.rpc_timeout_seconds)
        except grpc.RpcError as e:
            raise rpc.to_error(worker_id, e) from None

    def _all(self, method: str, make_request, workers=None) -> dict[str, object]:
        """Calls ``method`` on every active worker concurrently; see :func:`gather`."""
        workers = self.placement.active if workers is None else workers
        return gather({w: getattr(self.stubs[w], method).future(make_request(w), timeout=self.opts.rpc_timeout_seconds)
                       for w in workers})

    # -- setup ---------------------------------------------------------------

    def start_workers(self) -> None:
        """Launches, registers, places, loads programs and initializes state."""
        t0 = time.time()
        for _ in range(self.opts.slices + self.opts.spares):
            self._launch()
        workers = self.registry.wait_for(self.opts.slices + self.opts.spares, self.opts.register_timeout_seconds)
        for w in workers:
            self._adopt(w)
        try:
            self.placement = place(self.opts.slices, self.opts.devices_per_slice, workers)
        except ValueError as e:
            raise ElasticTrainingFailedError("cannot place the virtual slices", cause=str(e)) from None
        self.events.emit("placement", epoch=self.placement.epoch, active=list(self.placement.active),
                         spares=list(self.placement.spares), seconds=time.time() - t0)
        progs = self._load_request("").programs
        everyone = list(self.placement.active + self.placement.spares)
        replies = self._all("Load", self._load_request, workers=everyone)
        for w, r in replies.items():
            self.events.emit("device_probe", worker=w, ok=True, devices=r.devices_probed, seconds=r.probe_seconds)
        self.events.emit("programs_loaded", compile_seconds={w: r.compile_seconds for w, r in replies.items()},
                         program_bytes=sum(len(p.serialized) for p in progs))
        self.observer.attach(self)

    def _adopt(self, w: WorkerInfo) -> None:
        self.stubs[w.worker_id] = pb_grpc.WorkerStub(self._channel(w.address))
        self.monitor.watch(w.worker_id, w.address)

    def _load_request(self, worker_id: str) -> pb.LoadRequest:
        progs = [pb.Program(name=k, serialized=v) for k, v in self.programs.programs().items()]
        return pb.LoadRequest(fence=self._fence(), programs=progs, data_source=self.data_source,
                              layout=self.programs.layout_json(), lease_seconds=self.opts.worker_lease_seconds)

    def init_state(self, seed: int) -> int:
        replies = self._all("Init", lambda w: pb.InitRequest(fence=self._fence(), seed=seed))
        sizes = {r.state_bytes for r in replies.values()}
        self.replicas = set(self.placement.active)
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
        futs = {}
        with self._lock:
            for w, req in reqs.items():
                futs[w] = self.stubs[w].Step.future(req, timeout=self.opts.rpc_timeout_seconds)
                self.inflight.setdefault(w, []).append(futs[w])
                if w in self.dead:
                    futs[w].cancel()
        self.plans[plan.step] = plan
        self.events.emit("step_dispatched", step=plan.step, epoch=plan.epoch, workers=list(plan.workers))
        return plan, futs, time.time()

    def _commit(self, plan: StepPlan, futs, t_dispatch: float, on_step) -> None:
        watchdog = None
        if len(self.step_seconds) >= 3:
            median = sorted(self.step_seconds)[len(self.step_seconds) // 2]
            limit = max(self.opts.watchdog_factor * median, self.opts.watchdog_min_seconds)
            watchdog = (self.last_commit + limit, lambda pending: self._step_watchdog(plan, pending, median))
        try:
            replies = gather(futs, watchdog)
        finally:
            with self._lock:
                for w, f in futs.items():
                    if f in self.inflight.get(w, []):
                        self.inflight[w].remove(f)
        sums = {r.loss_sum for r in replies.values()}
        if len(sums) != 1:
            raise ElasticTrainingFailedError("replicas disagree on the step loss", step=plan.step, cause=str(sums))
        self._watch_stragglers(plan, replies)
        self._record(plan.step, plan.epoch, sums.pop(), on_step, t_dispatch=t_dispatch, plan=plan,
                     grad_seconds=max(r.grad_seconds for r in replies.values()),
                     reduce_seconds=max(r.reduce_seconds for r in replies.values()),
                     apply_seconds=max(r.apply_seconds for r in replies.values()),
                     bytes_sent=sum(r.bytes_sent for r in replies.values()))

    def _record(self, step: int, epoch: int, loss_sum: float, on_step, *, t_dispatch=None, plan=None, **fields):
        loss = float(np.float32(loss_sum) / np.float32(self.programs.num_microbatches))
        if plan is not None:
            fields["microbatches"] = {w: [i for n in nodes for i in n.ids] for w, nodes in zip(plan.workers, plan.nodes)}
        if t_dispatch is not None:
            fields["seconds"] = time.time() - t_dispatch
        now = time.monotonic()
        if not fields.get("recovered"):
            self.step_seconds.append(now - self.last_commit)
        self.last_commit = now
        self.events.emit("step_committed", step=step, epoch=epoch, loss=loss, **fields)
        self.plans.pop(step, None)
        self.losses.append(loss)
        if on_step is not None:
            on_step(step, loss)
        self.observer.step_committed(step)

    def _step_watchdog(self, plan: StepPlan, pending: list[str], median: float) -> None:
        """A step is far slower than the median: find who holds it up; fence it out or report it.

        Asks every worker of the step where it is (``Progress``). A worker
        that does not answer, or fails its health probe, is declared dead. A
        live worker stuck computing while its peers wait is a straggler: with
        ``replace_stragglers`` and a spare it is declared dead (fenced out and
        replaced by the normal recovery), else it is reported.
        """
        progress, silent = {}, []
        for w in plan.workers:
            try:
                r = self._call(w, "Progress", pb.ProgressRequest(fence=self._fence()), timeout=2.0)
                progress[w] = (r.step, r.phase, r.seconds)
            except (WorkerLostError, StaleEpochError, StepAbortedError):
                silent.append(w)
        suspects = sorted(set(silent) | set(holding_up(progress, plan.step)))
        self.events.emit("step_watchdog", step=plan.step, seconds=time.monotonic() - self.last_commit,
                         median_seconds=median, pending=pending, suspects=suspects,
                         progress={w: list(p) for w, p in progress.items()})
        for w in suspects:
            if w in silent or not self.monitor.is_alive(w):
                self._declare_dead(w, "no answer to the step watchdog", cause="hang")
                continue
            _, phase, seconds = progress[w]
            action = "replaced" if self.opts.replace_stragglers and self._live_spare() else "reported"
            self.events.emit("straggler", worker=w, step=plan.step, seconds=seconds, median_seconds=median,
                             action=action)
            if action == "replaced":
                self._declare_dead(w, f"stuck in {phase} for {seconds:.1f} s (step watchdog)", cause="stuck")

    def _watch_stragglers(self, plan: StepPlan, replies) -> None:
        per_mb = {w: replies[w].grad_seconds / max(sum(len(n.ids) for n in nodes), 1)
                  for w, nodes in zip(plan.workers, plan.nodes)}
        for w, seconds, median in self.stragglers.observe(per_mb):
            replace = (self.opts.replace_stragglers and self._live_spare()
                       and w not in self.swap_pending)
            self.events.emit("straggler", worker=w, step=plan.step, seconds=seconds, median_seconds=median,
                             action="replaced" if replace else "reported")
            if replace:
                self.swap_pending.append(w)

    def train(self, steps: int, seed: int, on_step=None, max_seconds: float | None = None) -> RunResult:
        """Runs ``steps`` steps from a fresh state; returns the run's summary.

        Step ``s`` is committed when every active slice applied it. When a
        worker is lost, in-flight steps are abandoned, the resource manager
        decides (replace / shrink / fail), and training resumes at the first
        step not applied by every survivor: no committed step is lost or
        applied twice. With ``max_seconds``, dispatching stops that long after
        training started and the run ends at the last dispatched step
        (``run_truncated``).
        """
        t0 = time.time()
        self.events.emit("run_started", run_id=self.run_id, slices=self.opts.slices,
                         devices_per_slice=self.opts.devices_per_slice, spares=self.opts.spares,
                         microbatches=self.programs.num_microbatches, steps=steps, controller=self.address)
        self.start_workers()
        state_bytes = self.init_state(seed)
        self.last_commit = time.monotonic()
        self.losses: list[float] = []
        pending: collections.deque = collections.deque()
        next_step = 0
        deadline = time.monotonic() + max_seconds if max_seconds else None
        while len(self.losses) < steps:
            if deadline is not None and time.monotonic() > deadline and steps > max(next_step, 1):
                steps = max(next_step, 1)
                self.events.emit("run_truncated", steps=steps, reason=f"max_seconds={max_seconds:g} reached")
            try:
                if self._membership_pending():
                    while pending:  # drain, so the change happens at a step boundary
                        self._commit(*pending.popleft(), on_step)
                    self._step_boundary()
                while len(pending) < self.opts.dispatch_depth and next_step < steps:
                    pending.append(self._dispatch(plan_step(self.placement, next_step,
                                                            self.programs.num_microbatches)))
                    next_step += 1
                if not pending:
                    continue   # the boundary drained the last steps
                plan, futs, td = pending.popleft()
                self._commit(plan, futs, td, on_step)
            except (WorkerLostError, StepAbortedError, StaleEpochError) as err:
                pending.clear()
                next_step = self._recover(err, on_step)
        hashes = {w: r.sha256 for w, r in self._all("StateHash", lambda w: pb.HashRequest(fence=self._fence())).items()}
        if len(set(hashes.values())) != 1:
            raise ElasticTrainingFailedError("replicas diverged", step=steps, cause=f"state hashes {hashes}")
        losses = self.losses
        result = RunResult(steps_completed=len(losses), losses=losses, recoveries=self.recoveries, final_state_sha256=next(iter(hashes.values())),
                           replica_hashes=hashes, wall_seconds=time.time() - t0,
                           client_peak_rss_bytes=peak_rss_bytes(), state_bytes=state_bytes)
        self.events.emit("run_finished", steps_completed=result.steps_completed,
                         final_state_sha256=result.final_state_sha256, replica_hashes=hashes,
                         wall_seconds=result.wall_seconds, client_peak_rss_bytes=result.client_peak_rss_bytes)
        return result


    # -- recovery ------------------------------------------------------------

    def _recover(self, err: Exception, on_step) -> int:
        """Handles a failed step; returns the step to dispatch next. Retries while recovery itself fails."""
        while True:
            try:
                return self._recover_once(err, on_step)
            except (WorkerLostError, StepAbortedError, StaleEpochError) as again:
                err = again

    def _recover_once(self, err: Exception, on_step) -> int:
        """One recovery attempt: probe, decide, fence, realign, copy state to new members, check.

        Only workers in ``self.replicas`` count as holding the state: a spare
        that was promoted but died (or whose source died) before its copy
        finished is not a replica, so a retry copies to it again or replaces it.
        """
        t_detect = time.time()
        self.recoveries += 1
        with self._lock:
            for futs in self.inflight.values():
                for f in futs:
                    f.cancel()
            self.inflight.clear()
        self.events.emit("failure_detected", error=type(err).__name__, detail=str(err)[:500],
                         worker=getattr(err, "worker_id", None), committed=len(self.losses))
        members = [w for w in self.placement.active + self.placement.spares if w not in self.dead]
        with futures.ThreadPoolExecutor(max_workers=max(len(members), 1)) as pool:   # probe all at once
            alive = dict(zip(members, pool.map(self.monitor.is_alive, members)))
        for w in members:
            if not alive[w]:
                self._declare_dead(w, f"no answer after {type(err).__name__}")
        decision = self._decide()
        if decision.action == "wait":
            decision = self._wait_for_capacity(decision)
        if decision.action == "fail":
            raise ElasticTrainingFailedError("cannot recover", step=len(self.losses), cause=decision.reason)
        dead = self._dead_members()
        self.placement = decision.placement
        for w in dead:
            self.monitor.unwatch(w)
            self._relaunch(w)
        holders = [w for w in self.placement.active if w in self.replicas]
        target = self._realign(holders, on_step)
        moved = self._copy_to_newcomers(holders[0], target)
        self.events.emit("recovered", path=decision.action, epoch=self.placement.epoch, resume_step=target,
                         dead=dead, bytes_moved=moved, seconds=time.time() - t_detect)
        return target

    def _decide(self, may_wait: bool | None = None):
        dead = frozenset(self._dead_members())
        placement = self.placement
        if may_wait is None:
            may_wait = self.opts.capacity_timeout_seconds > 0
        decision = decide_recovery(placement, dead, min_slices=self.opts.min_slices, recoveries=self.recoveries,
                                   max_retries=self.opts.max_retries, may_wait=may_wait)
        # A promoted spare whose copy never finished is alive but holds no state: it is not a survivor.
        if decision.action != "fail" and not any(w in self.replicas and w not in dead for w in placement.active):
            decision = dataclasses.replace(decision, action="fail", reason="no live replica of the state is left "
                                           "(restore from a snapshot or checkpoint is not built yet)")
        self.events.emit("recovery_decision", action=decision.action, reason=decision.reason, dead=sorted(dead),
                         epoch=decision.placement.epoch, active=list(decision.placement.active),
                         spares=list(decision.placement.spares))
        return decision

    def _relaunch(self, dead_worker: str) -> None:
        """The local launcher starts a fresh process (a new worker id) for each dead one, once."""
        if dead_worker in self.relaunched:
            return
        self.relaunched.add(dead_worker)
        if self.opts.relaunch and self._launched < self.opts.slices + self.opts.spares + self.opts.max_retries:
            self.events.emit("worker_relaunched", replaces=dead_worker, worker=self._launch())

    def _wait_for_capacity(self, decision):
        """Below ``min_slices``: wait up to ``capacity_timeout_seconds`` for workers to join, warm them as spares."""
        t0 = time.time()
        deadline = time.monotonic() + self.opts.capacity_timeout_seconds
        for w in self._dead_members():
            self._relaunch(w)
        self.events.emit("capacity_wait", needed=self.opts.min_slices, timeout_seconds=self.opts.capacity_timeout_seconds)
        found: list[str] = []
        while decision.action == "wait":
            left = deadline - time.monotonic()
            if left <= 0:
                self.events.emit("capacity_wait_ended", seconds=time.time() - t0, found=found)
                return dataclasses.replace(decision, action="fail", reason=decision.reason.replace(
                    "waiting for capacity", f"no capacity arrived within elastic_timeout_seconds="
                                            f"{self.opts.capacity_timeout_seconds:g}"))
            with self.registry.cond:
                if all(w in self.stubs for w in self.registry.workers):
                    self.registry.cond.wait(min(left, 0.5))
            before = set(self.placement.spares)
            self._warm_new_workers(block_until=deadline)
            found += [w for w in self.placement.spares if w not in before]
            decision = self._decide(may_wait=True)
        self.events.emit("capacity_wait_ended", seconds=time.time() - t0, found=found)
        return decision

    def _abort_members(self) -> dict[str, pb.StatusReply]:
        """Fences every member of the current placement into its epoch; returns their status."""
        return self._all("Abort", lambda w: pb.AbortRequest(fence=self._fence()),
                         workers=list(self.placement.active + self.placement.spares))

    def _realign(self, survivors: list[str], on_step) -> int:
        """Fences every member into the new epoch and brings survivors to one step.

        Survivors differ by at most one applied step (a step applies only once
        every rank finished its reduce-scatter). Steps all of them applied are
        committed from their recorded losses; those ahead roll back one step.
        """
        statuses = self._abort_members()
        applied = {w: statuses[w].applied_steps for w in survivors}
        target, committed = min(applied.values()), len(self.losses)
        if target < committed or max(applied.values()) > target + 1:
            raise ElasticTrainingFailedError("replicas are out of step", step=committed, cause=str(applied))
        for step in range(committed, target):
            sums = {l.loss_sum for w in survivors for l in statuses[w].recent if l.step == step}
            if len(sums) != 1:
                raise ElasticTrainingFailedError("no agreed loss for an applied step", step=step, cause=str(sums))
            self._record(step, self.placement.epoch, sums.pop(), on_step, plan=self.plans.get(step), recovered=True)
        for w, a in applied.items():
            if a == target + 1:
                self._call(w, "Rollback", pb.RollbackRequest(fence=self._fence(), to_applied_steps=target))
                self.events.emit("rolled_back", worker=w, to_step=target)
        self.plans.clear()
        return target

    def _transfer(self, source: str, dest: str, applied: int) -> int:
        """Copies the state of live replica ``source`` to ``dest``, peer to peer."""
        t0 = time.time()
        self.observer.before_transfer(source, dest)
        self.events.emit("transfer_started", source=source, dest=dest, step=applied)
        reply = self._call(dest, "PullState", pb.PullStateRequest(
            fence=self._fence(), source_address=self.registry.workers[source].address, applied_steps=applied))
        self.events.emit("state_transferred", source=source, dest=dest, step=applied, bytes=reply.bytes,
                         seconds=time.time() - t0, sha256=reply.sha256)
        return reply.bytes

    def _copy_to_newcomers(self, source: str, step: int) -> int:
        """Copies replica ``source``'s state to every active member that holds none; checks every hash.

        Afterwards every active member is a replica. Returns the bytes moved.
        """
        moved = sum(self._transfer(source, w, step) for w in self.placement.active if w not in self.replicas)
        self._check_replicas(step)
        self.replicas = set(self.placement.active)
        self.last_commit = time.monotonic()   # the watchdog times the next step from here
        return moved

    def _check_replicas(self, applied: int) -> None:
        replies = self._all("StateHash", lambda w: pb.HashRequest(fence=self._fence()))
        if {r.step for r in replies.values()} != {applied} or len({r.sha256 for r in replies.values()}) != 1:
            raise ElasticTrainingFailedError("replicas disagree after recovery", step=applied,
                                             cause=str({w: (r.step, r.sha256[:12]) for w, r in replies.items()}))

    # -- membership changes at step boundaries -------------------------------

    def _membership_pending(self) -> bool:
        """Cheap check: is there a new, warmed or promotable worker, or a straggler to swap out?"""
        return (any(w not in self.stubs for w in list(self.registry.workers))
                or any(f.done() for f in self.warming.values())
                or any(s in self.dead for s in self.placement.spares)
                or bool(self.swap_pending)
                or (len(self.placement.active) < self.opts.slices and bool(self.placement.spares)))

    def _warm_new_workers(self, block_until: float | None = None) -> None:
        """Adopts newly registered workers and loads programs on them; warmed ones become spares.

        With ``block_until``, waits (until that monotonic time) for the loads
        it started, so a recovery waiting for capacity can use them.
        """
        for w in list(self.registry.workers.values()):
            if w.worker_id not in self.stubs:
                self._adopt(w)
                self.warming[w.worker_id] = self.stubs[w.worker_id].Load.future(
                    self._load_request(w.worker_id), timeout=self.opts.rpc_timeout_seconds)
        spares = [s for s in self.placement.spares if s not in self.dead]
        for wid, fut in list(self.warming.items()):
            if block_until is not None:
                try:
                    fut.result(timeout=max(block_until - time.monotonic(), 0.001))
                except (grpc.RpcError, grpc.FutureCancelledError, grpc.FutureTimeoutError):
                    pass
            if not fut.done():
                continue
            del self.warming[wid]
            try:
                reply = fut.result()
            except (grpc.RpcError, grpc.FutureCancelledError) as e:
                self.events.emit("device_probe", worker=wid, ok=False, devices=0, seconds=0.0,
                                 error=str(getattr(e, "details", lambda: e)())[:300])
                self._declare_dead(wid, "failed to load programs or probe its devices")
                continue
            spares.append(wid)
            self.events.emit("device_probe", worker=wid, ok=True, devices=reply.devices_probed,
                             seconds=reply.probe_seconds)
            self.events.emit("worker_warmed", worker=wid, compile_seconds=reply.compile_seconds)
        if tuple(spares) != self.placement.spares:
            self.placement = dataclasses.replace(self.placement, spares=tuple(spares))

    def _step_boundary(self) -> None:
        """No step in flight: warm new workers into spares, drop dead spares, swap stragglers out, grow."""
        self._warm_new_workers()
        while self.swap_pending:
            slow = self.swap_pending.pop(0)
            swapped = decide_swap(self.placement, slow)
            if swapped is not None:
                self._remap(swapped, "straggler_replaced", slow=slow)
                self._shutdown(slow)
        grown = decide_grow(self.placement, self.opts.slices)
        if grown is not None:
            self._remap(grown, "grown")

    def _remap(self, placement: Placement, kind: str, **fields) -> None:
        """A planned membership change at a step boundary: fence, copy state to the newcomers, check."""
        committed = len(self.losses)
        promoted = [w for w in placement.active if w not in self.placement.active]
        source = next(w for w in self.placement.active if w in self.replicas and w in placement.active)
        self.placement = placement
        self._abort_members()
        moved = self._copy_to_newcomers(source, committed)
        self.events.emit(kind, epoch=placement.epoch, promoted=promoted, active=list(placement.active),
                         bytes_moved=moved, step=committed, **fields)

    def _shutdown(self, worker_id: str) -> None:
        """Sends a worker that left the placement home (best effort; it is fenced either way)."""
        self.monitor.unwatch(worker_id)
        try:
            self.stubs[worker_id].Shutdown(pb.ShutdownRequest(fence=self._fence()), timeout=2.0)
        except grpc.RpcError:
            pass
        self.launcher.kill(worker_id)
