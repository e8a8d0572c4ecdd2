"""The controller: the client side of a run, as a small state machine.

Phases (:class:`Phase`)::

    STARTING --> RUNNING <--> BOUNDARY           (membership changes between steps)
                   |  ^
                   v  |
                RECOVERING                       (a worker was lost or a step aborted)
                   |
    RUNNING --> DONE                             (every step committed, replicas agree)

Each call of :meth:`Controller.advance` runs one transition: it asks
:mod:`runtime.policy` for a decision and carries it out through the worker
group (:class:`runtime.worker_group.WorkerGroup`, every RPC), the recovery
(:mod:`runtime.recovery`) and the watchdog (:mod:`runtime.watchdog`). A
failure is a value: deaths arrive on the group's queue, failed calls as typed
errors, a stalled step as ``Stalled``. The controller alone records steps,
calls ``on_step`` and notifies the observer.

It never holds the training state: only programs (bytes), per-step losses
and timings pass through it.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import resource
import time
import uuid

import numpy as np

from runtime import auth
from runtime.errors import ReplicaDivergenceError, StaleEpochError, StepAbortedError, WorkerLostError
from runtime.events import EventLog
from runtime.checkpointing import Checkpointing, Loaded
from runtime.snapshotting import Snapshotting
from runtime.policy import (Action, Placement, StepPlan, StragglerDetector, StragglerPolicy, decide_grow, decide_start,
                            decide_swap, membership_change_due, plan_step, straggler_action, watchdog_limit)
from runtime.parts import DEFAULT_CHUNK_BYTES
from runtime.programs import ProgramSet
from runtime.recovery import Recovery, failed
from runtime.shadows import Shadows
from runtime.timing import slowest_phases
from runtime.watchdog import investigate
from runtime.calls import Stalled
from runtime.worker_group import WorkerGroup

__all__ = ["Controller", "ControllerObserver", "ControllerOptions", "Phase", "RunResult", "peak_rss_bytes"]

# Errors that mean "a member was lost or the step cannot finish": the run recovers from them.
RECOVERABLE = (WorkerLostError, StepAbortedError, StaleEpochError)
# The event a restore from each tier records (literal kinds, so a search for the kind finds where it is emitted).
RESTORED_EVENT = {"checkpoint": "checkpoint_restored", "snapshot": "snapshot_restored"}


def peak_rss_bytes() -> int:
    """Peak resident set of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclasses.dataclass(frozen=True)
class ControllerOptions:
    """Everything the controller needs; built from the config by ``elastic`` (one mapping, tested).

    Each default is the default config's value (tests/unit/test_options.py checks it), except
    ``compilation_cache_dir``, ``platform`` and ``snapshot_directory``, which ``elastic`` derives from the
    environment and the host ("" here: no cache; the launcher's platform; no snapshot directory).
    """

    slices: int
    devices_per_slice: int
    run_dir: str
    run_id: str = ""
    host: str = "127.0.0.1"                # the controller listens here...
    port: int = 0                          # ...on this port (0: any free one)
    launcher: str = "local"                # "local": worker subprocesses; "ray": Ray actors; "none": they join
    ray_address: str = ""                  # the Ray cluster (elastic_launcher=ray); "": $RAY_ADDRESS, else a local one
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
    capacity_timeout_seconds: float = 60.0  # below min_slices: wait this long for a worker to join (0: don't)
    straggler_factor: float = 3.0
    straggler_patience: int = 3
    replace_stragglers: bool = False
    watchdog_factor: float = 10.0          # a step this many times slower than the median...
    watchdog_min_seconds: float = 10.0     # ...and at least this long triggers the step watchdog
    chaos: bool = False                    # workers serve fault-injection calls
    tls: auth.TlsFiles | None = None       # mutual TLS on every link
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # tensor chunk size of peer streams (0: the worker's default, 4 MiB)
    compilation_cache_dir: str = ""        # JAX's persistent compilation cache of the workers ("": none)
    standby_workers: int = 1               # processes started ahead of need, for relaunches (local launcher)
    worker_preload: tuple[str, ...] = ()   # modules the local launcher's zygote imports once for every worker
    data_plane: str = "tcp"                # tensors between workers: "tcp" (runtime.dataplane) or "grpc" (Push)
    checkpoint_directory: str = ""         # persistent checkpoints (runtime.checkpoint); "": none
    checkpoint_period: int = 0             # a checkpoint after every this many steps (and the last); 0: none
    shadow_spares: bool = False            # spares shadow the state (runtime.shadows)
    platform: str = ""                     # the workers' JAX platform ("": JAX_PLATFORMS, else cpu; launcher)
    load_full_state_path: str = ""         # start from this checkpoint (a store, or <store>/<step>) if none to resume
    snapshot_directory: str = ""           # in-memory snapshots: the directory on each host that keeps them
    snapshot_interval: int = 0             # a snapshot after every this many steps; 0: none (runtime.snapshotting)
    backup_kind: str = "snapshot"          # the backup while no spare shadows the state (runtime.tiers.backup_tier)


class ControllerObserver:
    """Hooks for the chaos harness (and anything else that watches a run). Default: no-ops.

    Called on the controller's thread, by the controller only; a hook must
    return quickly. ``attach`` is called once, ``close`` at most once.
    """

    def attach(self, controller: "Controller") -> None:
        """The controller started; workers are registered, placed and loaded."""

    def step_committed(self, step: int) -> None:
        """Step ``step`` was committed (once per commit, in step order)."""

    def before_transfer(self, source: str, dest: str) -> None:
        """A peer-to-peer state transfer from ``source`` to ``dest`` is about to start."""

    def checkpoint_saved(self, step: int) -> None:
        """A worker reported the checkpoint of ``step`` complete (in the order the reports arrive)."""

    def snapshot_saved(self, step: int) -> None:
        """A worker reported the in-memory snapshot of ``step`` complete on its host."""

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


class Phase(enum.Enum):
    STARTING = "starting"      # launch, register, place, load, initialize
    RUNNING = "running"        # dispatch ahead, commit in order
    BOUNDARY = "boundary"      # nothing in flight: warm newcomers, swap stragglers out, grow
    RECOVERING = "recovering"  # a step failed: decide, realign, copy state to newcomers
    DONE = "done"              # every step committed and the replicas agree


class Controller:
    """Drives one run. Use as a context manager; :meth:`train` does the work.

    ``group``: the worker group to drive (default: a :class:`WorkerGroup` of
    local worker processes); a test passes a fake one.
    """

    def __init__(self, programs: ProgramSet, data_source: bytes, options: ControllerOptions, events: EventLog,
                 group=None):
        self.programs = programs
        self.opts = options
        self.run_id = options.run_id or uuid.uuid4().hex[:12]
        self.events = events
        self.group = group or WorkerGroup(self.run_id, options.secret or auth.new_secret(), programs, data_source,
                                          options, events)
        self.observer = ControllerObserver()
        self.checkpoints = Checkpointing(self.group, options, events,
                                         notify=lambda step: self.observer.checkpoint_saved(step))
        self.snapshots = Snapshotting(self.group, options, events,
                                      notify=lambda step: self.observer.snapshot_saved(step))
        self.recovery = Recovery(self.group, options, events, self.checkpoints, self.snapshots)
        self.shadows = Shadows(self.group, events, options.shadow_spares)
        self.placement: Placement | None = None
        self.phase = Phase.STARTING
        self.replicas: set[str] = set()          # workers known to hold the state at the committed frontier
        self.losses: list[float] = []
        self.loss_sums: list[float] = []         # what the workers answered, per committed step (checkpoints keep them)
        self.plans: dict[int, StepPlan] = {}     # dispatched, not yet committed
        self.pending: collections.deque = collections.deque()   # (plan, futures, dispatch time), oldest first
        self.swap_pending: list[str] = []        # stragglers to move onto spares at the next boundary
        self.stragglers = StragglerDetector(StragglerPolicy(options.straggler_factor, options.straggler_patience))
        self.step_seconds: collections.deque = collections.deque(maxlen=20)
        self.last_commit = time.monotonic()
        self.recoveries = 0
        self.result: RunResult | None = None
        self._error: Exception | None = None
        self._run: dict = {}

    # -- lifecycle -----------------------------------------------------------

    @property
    def address(self) -> str:
        return self.group.address

    def __enter__(self) -> Controller:
        self.group.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.observer.close()
        self.group.close()

    # -- what observers may use (the chaos injector) -------------------------

    @property
    def dead(self) -> dict[str, str]:
        """Workers declared dead, with why."""
        return self.group.dead

    def live_spares(self) -> tuple[str, ...]:
        """Spares of the current placement not declared dead."""
        return tuple(s for s in self.placement.spares if s not in self.dead) if self.placement else ()

    def next_checkpoint_writer(self) -> str | None:
        """A worker with a checkpoint save still ahead of it: the writer of the next checkpoint not yet
        dispatched (if the placement stays), else of the newest one dispatched and not reported complete (its
        save waits or is being written); None when no save remains (see ``runtime.policy.checkpoint_writer``)."""
        if self.placement is None:
            return None
        live = [w for w in self.placement.active if w not in self.dead]
        return (self.checkpoints.next_writer(self._run["next_step"], self._run["steps"], self.placement.active)
                or self.checkpoints.unfinished_writer(live))

    def pid(self, worker_id: str) -> int:
        """The process id a worker registered with; ``KeyError`` for an unknown worker."""
        return self.group.pid(worker_id)

    def inject_fault(self, worker_id: str, action: str, *, factor: float = 0.0, seconds: float = 0.0,
                     phase: str = "") -> None:
        """Arms one worker-side fault (one of ``FAULT_ACTIONS``) on a worker started with chaos enabled.

        Raises the typed error of the call (``WorkerLostError``, ``WorkerError``, ...) when it fails.
        """
        self.group.inject_fault(worker_id, action, factor=factor, seconds=seconds, phase=phase)

    # -- the state machine -----------------------------------------------------

    def train(self, steps: int, seed: int, on_step=None, max_seconds: float | None = None) -> RunResult:
        """Runs ``steps`` steps from a fresh state; returns the run's summary.

        Step ``s`` is committed when every active slice applied it. When a
        worker is lost, in-flight steps are abandoned, the policy decides
        (replace / shrink / wait / fail), and training resumes at the first
        step not applied by every survivor: no committed step is lost or
        applied twice. With ``max_seconds``, dispatching stops that long after
        training started and the run ends at the last dispatched step
        (``run_truncated``). Raises ``CapacityExhaustedError`` when the
        policy gives up (``StateLostError``: no copy of the state left),
        ``ReplicaDivergenceError`` when replicas disagree and
        ``BadInputError`` for an unusable ``load_full_state_path`` (all
        ``ElasticTrainingFailedError``).
        """
        self.begin(steps, seed, on_step, max_seconds)
        while self.phase is not Phase.DONE:
            self.advance()
        return self.result

    def begin(self, steps: int, seed: int, on_step=None, max_seconds: float | None = None) -> None:
        """Sets up a run without starting it; :meth:`advance` then moves it one transition at a time."""
        self._run = dict(steps=steps, seed=seed, on_step=on_step, max_seconds=max_seconds, t0=time.time(),
                         deadline=None, next_step=0, state_bytes=0)
        self.phase = Phase.STARTING
        self.events.emit("run_started", run_id=self.run_id, slices=self.opts.slices,
                         devices_per_slice=self.opts.devices_per_slice, spares=self.opts.spares,
                         microbatches=self.programs.num_microbatches, steps=steps, controller=self.address,
                         controller_host=self.group.client_host)

    def advance(self) -> Phase:
        """Runs one transition of the current phase; returns the next phase.

        A lost worker or an aborted step in ``RUNNING``, ``BOUNDARY`` or
        ``RECOVERING`` leads to (another) ``RECOVERING``; any other error
        propagates and ends the run.
        """
        handler = {Phase.STARTING: self._starting, Phase.RUNNING: self._running, Phase.BOUNDARY: self._boundary,
                   Phase.RECOVERING: self._recovering}[self.phase]
        try:
            self.phase = handler()
        except RECOVERABLE as err:
            if self.phase is Phase.STARTING:
                raise
            self.pending.clear()
            self._error, self.phase = err, Phase.RECOVERING
        return self.phase

    def _adopt(self, placement: Placement) -> None:
        self.placement = placement
        self.group.fence_at(placement.epoch)

    # -- STARTING --------------------------------------------------------------

    def _starting(self) -> Phase:
        """Launches, registers, places, loads programs everywhere and initializes the state on active slices.

        A worker lost while it registers, compiles or initializes is handled
        as a death mid-step would be: replaced by a spare, or the run starts
        narrower (down to ``min_slices``) and grows back later, or waits, or
        fails. No state exists yet, so every replacement initializes from
        the seed (same bits) instead of receiving a copy.
        """
        self._run["resume"] = self._resume_from()   # before launching: a bad load_full_state_path fails fast
        t0 = time.time()
        o = self.opts
        for _ in range(o.slices + o.spares):
            self.group.launch()
        workers = self.group.wait_for_workers(o.slices + o.spares, o.register_timeout_seconds)
        lost = sorted(self.dead)      # died before registering
        decision = decide_start(o.slices, o.devices_per_slice, workers, lost=lost, min_slices=o.min_slices)
        if lost:
            self.recoveries += 1
            self.group.drain_deaths()
            self.events.emit("failure_detected", error="WorkerLostError", worker=lost[0], committed=0,
                             detail=f"{', '.join(lost)} died before registering: {self.dead[lost[0]]}")
            self.events.emit("recovery_decision", action=decision.action.value, reason=decision.reason, dead=lost,
                             epoch=decision.placement.epoch, active=list(decision.placement.active),
                             spares=list(decision.placement.spares))
        if decision.action is Action.FAIL:
            raise failed(decision, "cannot place the virtual slices")
        self._adopt(decision.placement)
        self.events.emit("placement", epoch=self.placement.epoch, active=list(self.placement.active),
                         spares=list(self.placement.spares), seconds=time.time() - t0)
        if lost:
            self.events.emit("recovered", path=decision.action.value, epoch=self.placement.epoch, resume_step=0,
                             dead=lost, bytes_moved=0, seconds=time.time() - t0)
        loaded = self.group.load(self.placement.members)
        for w, r in loaded.items():
            self.events.emit("device_probe", worker=w, ok=True, devices=r.devices_probed, seconds=r.probe_seconds)
        self.events.emit("programs_loaded", compile_seconds={w: r.compile_seconds for w, r in loaded.items()},
                         program_bytes=self.group.program_bytes())
        self._recover_before_state("loading programs")
        self.observer.attach(self)
        resume, sizes = self._run["resume"], {}
        while True:
            loaded = self._first_state([w for w in self.placement.active if w not in sizes], resume)
            sizes.update(loaded.bytes)
            sizes = {w: b for w, b in sizes.items() if w not in self.dead}
            if all(w in sizes for w in self.placement.active):
                break
            self._recover_before_state("restoring the checkpoint" if resume else "initializing the state")
        self._run["state_bytes"] = max(sizes.values())
        self.replicas = set(self.placement.active)
        if resume is None:
            self.events.emit("state_initialized", seed=self._run["seed"], state_bytes=self._run["state_bytes"])
        else:
            self._resumed(loaded, resume[0])
        if self.shadows.enabled:   # the spares start with the same state: from the seed, or the same checkpoint
            spares = [w for w in self.placement.spares if w not in self.dead]
            got = self._first_state(spares, resume and (resume[0], loaded.step))
            for w in (got.bytes if got.step == self._run["next_step"] else {}):
                self.shadows.synced(w, got.step)
        self.last_commit = time.monotonic()
        if self._run["max_seconds"]:   # counted from the first step, not from launch
            self._run["deadline"] = self.last_commit + self._run["max_seconds"]
        return Phase.RUNNING

    def _resume_from(self) -> tuple[str, int] | None:
        """``(directory, step)`` of the newest complete checkpoint this run resumes from (MaxText's auto-resume:
        the run's checkpoint directory already holds some), else of ``load_full_state_path``; None for a fresh
        start.

        Raises ``BadInputError`` when ``load_full_state_path`` cannot be read
        or holds no complete checkpoint (of that step)."""
        own = self.checkpoints.newest(self._run["steps"])
        if own is not None:
            return self.checkpoints.directory, own
        if self.opts.load_full_state_path:
            return self.checkpoints.locate(self.opts.load_full_state_path)
        return None

    def _first_state(self, workers, resume: tuple[str, int] | None) -> Loaded:
        """``workers`` initialize from the seed (``resume`` None: ``Loaded`` of step 0, no losses) or load the
        checkpoint ``(directory, step)``; those that did are in the answer's ``bytes``."""
        if resume is None:
            return Loaded(0, self.group.init(workers, self._run["seed"]), [])
        return self.checkpoints.load(workers, resume[1], resume[0])

    def _resumed(self, loaded: Loaded, directory: str) -> None:
        """The active slices loaded checkpoint ``loaded``: the run continues after its step, with its losses.

        Every replica must hold the same step and bits (checked); the losses
        of the steps before come from the checkpoint (NaN where it recorded
        none, and the event says so).
        """
        step = loaded.step
        self._copy_to_newcomers(self.placement.active[0], step)   # copies nothing: checks every replica's hash
        sums = loaded.loss_sums if len(loaded.loss_sums) == step else [float("nan")] * step
        before = loaded.written_on   # another mesh wrote it: its losses are means over its microbatches
        self.loss_sums = list(sums)
        self.losses = [self._loss(x, before[1] if before else None) for x in sums]
        self._run["next_step"] = step
        self.events.emit("run_resumed", step=step, directory=directory, tier="checkpoint",
                         bytes=sum(loaded.bytes.values()), state_bytes=self._run["state_bytes"],
                         resharded_from=dict(zip(("devices_per_slice", "microbatches"), before)) if before else None,
                         losses=[x if x == x else None for x in self.losses],
                         losses_recorded=len(loaded.loss_sums) == step)

    def _recover_before_state(self, during: str) -> None:
        """Startup lost members (or started narrower): the policy decides; every live member counts as a replica.

        Records the failure like any other (``failure_detected``,
        ``recovery_decision``, ``recovered`` with ``resume_step`` 0).
        """
        dead = [w for w in self.placement.members if w in self.dead]
        if not dead:
            return
        self.recoveries += 1
        self.group.drain_deaths()
        err = WorkerLostError(dead[0], f"lost while {during}: {self.dead[dead[0]]}")
        decision, started = self.recovery.decide(err, self.placement, frozenset(self.placement.members), 0,
                                                 self.recoveries)
        old = self.placement
        self._adopt(decision.placement)
        dead = self.recovery.retire_dead(old)
        self.events.emit("recovered", path=decision.action.value, epoch=self.placement.epoch, resume_step=0,
                         dead=dead, bytes_moved=0, seconds=time.time() - started)

    # -- RUNNING ---------------------------------------------------------------

    def _running(self) -> Phase:
        """Commits the oldest step in flight after filling the pipeline; drains it first when membership changes."""
        run = self._run
        for death in self.group.drain_deaths():
            if death.worker in self.placement.active:
                raise WorkerLostError(death.worker, death.reason)
        if len(self.losses) >= run["steps"]:
            return self._finish()
        if run["deadline"] is not None and time.monotonic() > run["deadline"] and run["steps"] > max(run["next_step"], 1):
            run["steps"] = max(run["next_step"], 1)
            self.events.emit("run_truncated", steps=run["steps"],
                             reason=f"max_seconds={run['max_seconds']:g} reached")
        if membership_change_due(self.placement, self.opts.slices, self.dead, unadopted=self.group.has_newcomers(),
                                 warmed=self.group.warmed(), swaps=bool(self.swap_pending)) or \
                self.shadows.behind(self.placement.spares, self.dead):
            if self.pending:      # drain, so the change happens at a step boundary
                self.group.start_warming()   # a newcomer loads its programs meanwhile
                self._commit(*self.pending.popleft())
                return Phase.RUNNING
            return Phase.BOUNDARY
        while len(self.pending) < self.opts.dispatch_depth and run["next_step"] < run["steps"]:
            self._dispatch(plan_step(self.placement, run["next_step"], self.programs.num_microbatches))
            run["next_step"] += 1
        if self.pending:
            self._commit(*self.pending.popleft())
        return Phase.RUNNING

    def _dispatch(self, plan: StepPlan) -> None:
        shadows = self.shadows.feeding(self.placement.spares, self.dead)
        steps = self._run["steps"]
        futs = self.group.dispatch(plan, self.checkpoints.order_for(plan.step, steps, plan.workers, self.loss_sums),
                                   shadows, self.snapshots.order_for(plan.step, steps, self.placement, len(shadows)))
        self.shadows.dispatched(plan.step, {w: futs.pop(w) for w in shadows})
        self.plans[plan.step] = plan
        self.events.emit("step_dispatched", step=plan.step, epoch=plan.epoch, workers=list(plan.workers))
        self.pending.append((plan, futs, time.time()))

    def _commit(self, plan: StepPlan, futs, t_dispatch: float) -> None:
        """Waits for a step (the watchdog looks once if it runs far past the median), checks and records it."""
        limit = watchdog_limit(self.step_seconds, self.opts.watchdog_factor, self.opts.watchdog_min_seconds)
        deadline = self.last_commit + limit[0] if limit else None
        results = self.group.wait(futs, deadline)
        if isinstance(results, Stalled):
            self._investigate(plan, results.pending, median=limit[1])
            results = self.group.wait(futs)
        sums = {r.loss_sum for r in results.values()}
        if len(sums) != 1:
            raise ReplicaDivergenceError("replicas disagree on the step loss", step=plan.step, cause=str(sums))
        self._watch_stragglers(plan, results)
        self.checkpoints.note({w: (r.checkpoints_saved, r.checkpoint_error) for w, r in results.items()})
        self.snapshots.note({w: (r.snapshots_saved, r.snapshots_copied, r.snapshot_error) for w, r in results.items()})
        self.shadows.poll()
        self._record(plan.step, plan.epoch, sums.pop(), t_dispatch=t_dispatch, plan=plan,
                     grad_seconds=max(r.grad_seconds for r in results.values()),
                     reduce_seconds=max(r.reduce_seconds for r in results.values()),
                     apply_seconds=max(r.apply_seconds for r in results.values()),
                     bytes_sent=sum(r.bytes_sent for r in results.values()),
                     phases=slowest_phases([r.phases for r in results.values()]))

    def _record(self, step: int, epoch: int, loss_sum: float, *, t_dispatch=None, plan=None, **fields) -> None:
        """Commits one step: the only place that emits ``step_committed``, calls ``on_step`` and the observer."""
        loss = self._loss(loss_sum)
        if plan is not None:
            fields["microbatches"] = plan.microbatches()
        if t_dispatch is not None:
            fields["seconds"] = time.time() - t_dispatch
        now = time.monotonic()
        if not fields.get("recovered"):
            self.step_seconds.append(now - self.last_commit)
        self.last_commit = now
        self.events.emit("step_committed", step=step, epoch=epoch, loss=loss, **fields)
        self.plans.pop(step, None)
        self.losses.append(loss)
        self.loss_sums.append(float(loss_sum))
        if self._run.get("on_step") is not None:
            self._run["on_step"](step, loss)
        self.observer.step_committed(step)
        if self.recovery.deferred and not fields.get("recovered"):
            self.recovery.relaunch_deferred()   # the recovery's first step is done: replacements may start now

    def _loss(self, loss_sum: float, microbatches: int | None = None) -> float:
        """The step's loss: the workers' canonical sum over microbatches, averaged in float32 as a plain loop would."""
        return float(np.float32(loss_sum) / np.float32(microbatches or self.programs.num_microbatches))

    def _investigate(self, plan: StepPlan, pending, median: float) -> None:
        """The step watchdog fired: record what it found and fence out whom it names."""
        f = investigate(self.group, plan, pending, replace_stragglers=self.opts.replace_stragglers,
                        live_spare=bool(self.live_spares()))
        self.events.emit("step_watchdog", step=plan.step, seconds=time.monotonic() - self.last_commit,
                         median_seconds=median, pending=list(f.pending), suspects=list(f.suspects),
                         progress={w: list(p) for w, p in f.progress.items()})
        for w, seconds, action in f.stragglers:
            self.events.emit("straggler", worker=w, step=plan.step, seconds=seconds, median_seconds=median,
                             action=action)
        for w, reason, cause in f.fence:
            self.group.declare_dead(w, reason, cause=cause)

    def _watch_stragglers(self, plan: StepPlan, results) -> None:
        per_mb = {w: results[w].grad_seconds / max(len(ids), 1) for w, ids in plan.microbatches().items()}
        for w, seconds, median in self.stragglers.observe(per_mb):
            action = straggler_action(self.opts.replace_stragglers, bool(self.live_spares()))
            if w in self.swap_pending:
                action = "reported"
            self.events.emit("straggler", worker=w, step=plan.step, seconds=seconds, median_seconds=median,
                             action=action)
            if action == "replaced":
                self.swap_pending.append(w)

    def _finish(self) -> Phase:
        """Every step committed: wait for the checkpoints in flight, check that the replicas agree, build the result."""
        self.checkpoints.finish(self.placement.active, self.loss_sums)
        hashes = {w: sha for w, (_, sha) in self.group.hashes(self.placement.active).items()}
        steps = self._run["steps"]
        if len(set(hashes.values())) != 1:
            raise ReplicaDivergenceError("replicas diverged", step=steps, cause=f"state hashes {hashes}")
        self.result = RunResult(steps_completed=len(self.losses), losses=list(self.losses),
                                recoveries=self.recoveries, final_state_sha256=next(iter(hashes.values())),
                                replica_hashes=hashes, wall_seconds=time.time() - self._run["t0"],
                                client_peak_rss_bytes=peak_rss_bytes(), state_bytes=self._run["state_bytes"])
        self.events.emit("run_finished", steps_completed=self.result.steps_completed,
                         final_state_sha256=self.result.final_state_sha256, replica_hashes=hashes,
                         wall_seconds=self.result.wall_seconds, client_peak_rss_bytes=self.result.client_peak_rss_bytes)
        return Phase.DONE

    # -- RECOVERING ------------------------------------------------------------

    def _recovering(self) -> Phase:
        """One recovery attempt: decide and adopt the new placement, realign, record, copy state to newcomers."""
        self.recoveries += 1
        self.group.drain_deaths()   # the group's ledger has them; the probe below finds the rest
        committed = len(self.losses)
        # Spares that shadow the committed state are replicas too (promoted first, no transfer).
        shadows = self.shadows.holding(committed, self.dead, min(2.0, self.opts.rpc_timeout_seconds))
        self.shadows.abandon()
        replicas = frozenset(self.replicas | shadows)
        decision, started = self.recovery.decide(self._error, self.placement, replicas, committed, self.recoveries)
        old, self.pending = self.placement, collections.deque()
        self._adopt(decision.placement)
        if decision.action is Action.RESTORE:
            return self._restore(old, started)
        plan = self.recovery.realign(old, decision.placement, replicas, committed)
        for step, loss_sum in plan.commits:
            self._record(step, self.placement.epoch, loss_sum, plan=self.plans.get(step), recovered=True)
        self.plans.clear()
        holders = [w for w in self.placement.active if w in replicas]
        survived = [w for w in holders if w in old.active]
        source = (survived or holders)[0]
        self.replicas = set(holders)
        moved = self._copy_to_newcomers(source, plan.target)
        self._recheck_shadows(source)
        self.events.emit("recovered", path=decision.action.value, epoch=self.placement.epoch,
                         resume_step=plan.target, dead=sorted(w for w in old.members if w in self.dead),
                         bytes_moved=moved, seconds=time.time() - started,
                         restore_tier="replica" if survived else "shadow")
        self._run["next_step"] = plan.target
        self._error = None
        return Phase.RUNNING

    def _restore(self, old: Placement, started: float) -> Phase:
        """No replica is left: the newest snapshot or checkpoint comes back (to every active slice: loaded, or
        copied from the one that loaded it); training resumes at its step."""
        committed = len(self.losses)
        got = self.recovery.restore(old, self.placement, committed)
        step = got.step
        self.replicas = set(got.holders)
        moved = got.bytes + self._copy_to_newcomers(got.holders[0], step)   # and checks every replica's hash
        del self.losses[step:], self.loss_sums[step:]
        self.shadows.forget(list(self.shadows.at))   # caught up by a copy at the next boundary
        self.plans.clear()
        where = dict(directory=got.directory) if got.tier == "checkpoint" else dict(
            worker=got.holders[0], host=self.group.host_of(got.holders[0]))
        self.events.emit(RESTORED_EVENT[got.tier], step=step, bytes=got.bytes, steps_lost=committed - step, **where)
        self.events.emit("recovered", path=Action.RESTORE.value, epoch=self.placement.epoch, resume_step=step,
                         dead=sorted(w for w in old.members if w in self.dead), bytes_moved=moved,
                         seconds=time.time() - started, restore_tier=got.tier)
        self._run["next_step"] = step
        self._error = None
        return Phase.RUNNING

    def _copy_to_newcomers(self, source: str, step: int) -> int:
        """Copies replica ``source``'s state to every active member that holds none; checks every hash.

        Afterwards every active member is a replica. Returns the bytes moved.
        """
        moved = 0
        for dest in self.placement.active:
            if dest in self.replicas:
                continue
            t0 = time.time()
            self.observer.before_transfer(source, dest)
            self.events.emit("transfer_started", source=source, dest=dest, step=step)
            nbytes, sha = self.group.transfer(source, dest, step)
            self.events.emit("state_transferred", source=source, dest=dest, step=step, bytes=nbytes,
                             seconds=time.time() - t0, sha256=sha)
            moved += nbytes
        hashes = self.group.hashes(self.placement.active)
        if {s for s, _ in hashes.values()} != {step} or len({sha for _, sha in hashes.values()}) != 1:
            raise ReplicaDivergenceError("replicas disagree after recovery", step=step,
                                             cause=str({w: (s, sha[:12]) for w, (s, sha) in hashes.items()}))
        self.replicas = set(self.placement.active)
        self.last_commit = time.monotonic()   # the watchdog times the next step from here
        return moved

    def _recheck_shadows(self, source: str) -> None:
        """After a recovery: the promoted shadows are active now; a spare that still shadows keeps doing so only
        when it holds the same step and bits as ``source`` (else a copy catches it up at the next boundary)."""
        self.shadows.forget(self.placement.active)
        spares = self.shadows.feeding(self.placement.spares, self.dead)
        if not spares:
            return
        hashes = self.group.hashes([source, *spares])
        self.shadows.forget([w for w in spares if hashes[w] != hashes[source]])

    # -- BOUNDARY --------------------------------------------------------------

    def _boundary(self) -> Phase:
        """No step in flight: warm newcomers into spares, drop dead spares, swap stragglers out, grow."""
        warmed = self.group.warm_newcomers()
        spares = tuple(s for s in self.placement.spares if s not in self.dead) + tuple(warmed)
        if spares != self.placement.spares:
            self.placement = dataclasses.replace(self.placement, spares=spares)
        while self.swap_pending:
            slow = self.swap_pending.pop(0)
            swapped = decide_swap(self.placement, slow)
            if swapped is not None:
                self._remap(swapped, "straggler_replaced", slow=slow)
                self.group.shutdown(slow)
        grown = decide_grow(self.placement, self.opts.slices)
        if grown is not None:
            self._remap(grown, "grown")
        self._sync_shadows()
        return Phase.RUNNING

    def _sync_shadows(self) -> None:
        """Spares that should shadow and do not (new, or fell behind) get a copy of the committed state."""
        behind = self.shadows.behind(self.placement.spares, self.dead)
        if not behind:
            return
        committed = len(self.losses)
        source = next(w for w in self.placement.active if w in self.replicas)
        for dest in behind:
            t0 = time.time()
            nbytes, sha = self.group.transfer(source, dest, committed)
            self.shadows.synced(dest, committed)
            self.events.emit("shadow_synced", source=source, dest=dest, step=committed, bytes=nbytes,
                             seconds=time.time() - t0, sha256=sha)

    def _remap(self, placement: Placement, kind: str, **fields) -> None:
        """A planned membership change at a step boundary: fence, copy state to the newcomers, check."""
        committed = len(self.losses)
        promoted = [w for w in placement.active if w not in self.placement.active]
        source = next(w for w in self.placement.active if w in self.replicas and w in placement.active)
        self._adopt(placement)
        self.shadows.forget(placement.active)
        self.group.abort(placement.members)
        moved = self._copy_to_newcomers(source, committed)
        self.events.emit(kind, epoch=placement.epoch, promoted=promoted, active=list(placement.active),
                         bytes_moved=moved, step=committed, **fields)
