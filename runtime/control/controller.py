"""The controller: the client side of a run, as a small state machine.

Phases (:class:`Phase`, each a class whose fields carry what its transition needs)::

    Starting --> Running <--> Boundary           (membership changes between steps)
                   |  ^
                   v  |
                Recovering(error)                (a worker was lost or a step aborted)
                   |
    Running --> Finished(result)                 (every step committed, replicas agree)

Each call of :meth:`Controller.advance` runs one transition. The controller
keeps the loop: it dispatches steps ahead, commits them in order, records
them and finishes the run. Every membership change (the first placement, a
recovery, growing back, a straggler's swap) is one pure plan
(:mod:`runtime.control.plan`) made from the run state and one survey, and
carried out by :class:`runtime.control.plan_executor.PlanExecutor`, which
decides nothing; a recovery that cannot be carried out as planned comes back
with the facts that changed and is planned again (:meth:`Controller.recover`).
A failure is a value: deaths arrive on the group's queue, failed calls as
typed errors, a stalled step as ``Stalled``.

What the controller knows of the run is one :class:`~runtime.control.run_state.RunState`
(``self.state``), the fold of the events written to its log
(:class:`~runtime.control.run_state.RunLedger`, shared with the worker group:
who is dead is the state's, and no one keeps a copy), so the log alone
rebuilds it (``RunState.replay``).

It never holds the training state: only programs (bytes), per-step losses
and timings pass through it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
import uuid
from collections.abc import Mapping

import numpy as np

from runtime.wire import auth
from runtime.control.attach import Reattach, attach
from runtime.control.calls import Stalled, settled
from runtime.control.checkpointing import Checkpointing
from runtime.control.controller_options import ControllerObserver, ControllerOptions, RunResult, peak_rss_bytes
from runtime.core.errors import (CapacityExhaustedError, ClientSupersededError, ReplicaDivergenceError, StaleEpochError,
                                 StepAbortedError,
                                 WorkerFencedError, WorkerLostError)
from runtime.control.evaluation import Evaluations
from runtime.core.events import EventLog
from runtime.control.plan import (Action, Plan, Wait, decide_launch, membership_change_due, plan_grow, plan_recovery,
                                  plan_release, plan_sampler_loss, plan_start, plan_swap)
from runtime.control.plan_executor import Done, PlanExecutor, failed
from runtime.control.placement import StepPlan, plan_step
from runtime.core.programs import ProgramSet, SamplerPrograms
from runtime.control.sampling import Sampling
from runtime.core.programs import stages_digest
from runtime.control.run_state import SAMPLER, RunLedger, RunState
from runtime.control.shadows import Shadows
from runtime.control.snapshotting import Snapshotting
from runtime.control.startup import start
from runtime.core.timing import slowest_phases
from runtime.pipeline.bubble import stage_workers_bubble
from runtime.control.watchdog import SlowSteps
from runtime.control.worker_group import WorkerGroup

__all__ = ["Attempt", "Boundary", "Controller", "Finished", "Phase", "Recovering", "Running", "Starting"]

# Errors that mean "a member was lost or the step cannot finish": the run recovers from them.
RECOVERABLE = (WorkerLostError, StepAbortedError, StaleEpochError)


class Phase:
    """A state of the controller: its class says what the next transition does, its fields carry what that
    transition needs (Ray Train v2's controller states do the same)."""


@dataclasses.dataclass(frozen=True)
class Starting(Phase):
    """Launch, register, place, load, initialize (or attach the live workers of a restarted client's run)."""


@dataclasses.dataclass(frozen=True)
class Running(Phase):
    """Dispatch ahead, commit in order."""


@dataclasses.dataclass(frozen=True)
class Boundary(Phase):
    """Nothing in flight: warm newcomers, swap stragglers out, grow."""


@dataclasses.dataclass(frozen=True)
class Recovering(Phase):
    """A step failed with ``error``: survey, plan, carry the plan out."""

    error: Exception


@dataclasses.dataclass(frozen=True)
class Finished(Phase):
    """Every step committed and the replicas agree: ``result``."""

    result: RunResult


@dataclasses.dataclass
class Attempt:
    """What this client process was asked for (not run state: a restarted client is asked again)."""

    seed: int
    steps: int = 0                     # the steps asked for (a restarted client may ask for more)
    on_step: object = None
    max_seconds: float | None = None
    t0: float = 0.0
    deadline: float | None = None      # dispatching stops then (max_seconds, counted from the first step)


class Controller:
    """Drives one run. Use as a context manager; :meth:`train` does the work.

    ``group``: the worker group to drive (default: a :class:`WorkerGroup` of
    local worker processes); a test passes a fake one. ``reattach``: the run
    a restarted client takes back (:class:`runtime.control.attach.Reattach`:
    the state replayed from its log); its ``Starting`` attaches the live
    workers instead of launching new ones (:func:`runtime.control.attach.attach`).
    """

    def __init__(self, programs: ProgramSet, data_source: bytes, options: ControllerOptions, events: EventLog,
                 group=None, reattach: Reattach | None = None, *, observer: ControllerObserver | None = None,
                 ownership=None, samplers: SamplerPrograms | None = None):
        self.programs = programs
        self.opts = options
        self.reattach = reattach
        self.run_id = reattach.state.run_id if reattach else options.run_id or uuid.uuid4().hex[:12]
        self.events = events
        self.ledger = RunLedger(events, reattach.state if reattach else None)   # the run's one state
        self.group = group or WorkerGroup(self.run_id, options.secret or auth.new_secret(), programs, data_source,
                                          options, events, self.ledger)
        self.observer = observer or ControllerObserver()
        self.checkpoints = Checkpointing(self.group, options, events, self.ledger,
                                         notify=lambda step: self.observer.checkpoint_saved(step))
        self.snapshots = Snapshotting(self.group, options, events, self.ledger,
                                      notify=lambda step: self.observer.snapshot_saved(step))
        self.shadows = Shadows(self.group, events, self.ledger, options.shadow_spares)
        self.evals = Evaluations(options, programs, events)
        # An RL run's samplers (None otherwise): the rollouts each step trains on, the weights versions they use.
        self.sampling = Sampling(self.group, options, events, samplers, self.ledger) if samplers is not None \
            else None
        self._trainers_seen: tuple = ()
        self.executor = PlanExecutor(self.group, options, events, self.ledger, checkpoints=self.checkpoints,
                                     snapshots=self.snapshots, shadows=self.shadows,
                                     before_transfer=lambda source, dest: self.observer.before_transfer(source, dest))
        self.phase: Phase = Starting()
        self.plans: dict[int, StepPlan] = {}     # dispatched, not yet committed
        self.pending: collections.deque = collections.deque()   # (plan, futures, dispatch time), oldest first
        self.slow = SlowSteps(self.group, events, options, live_spare=lambda: bool(self.live_spares()),
                              queued=lambda: self.state.swaps)
        self.attempt = Attempt(seed=0)
        # ownership.check(ctl): raises ClientSupersededError once another client owns the run (elastic.reattach);
        # ownership.take_back(ctl, generation): this client may take its run back as ``generation`` (its workers
        # fenced themselves while it was silent), or raises ClientSupersededError. None: the run is this
        # client's alone, and it may not take a fenced run back (the run then recovers as from any refusal).
        self.ownership = ownership

    @property
    def state(self) -> RunState:
        """The run's state: the fold of every event written so far (:class:`RunLedger`)."""
        return self.ledger.state

    # -- lifecycle -----------------------------------------------------------

    @property
    def address(self) -> str:
        return self.group.address

    def __enter__(self) -> Controller:
        self.group.start()
        return self

    def __exit__(self, kind, error, tb) -> None:
        self.close(superseded=isinstance(error, ClientSupersededError))

    def close(self, superseded: bool = False) -> None:
        """Ends the run's side of this client: the workers are sent home, unless this client was
        ``superseded`` (a newer client drives them: they are left alone)."""
        self.observer.close()
        if superseded:
            self.group.detach()
        else:
            self.group.close()
        self.ledger.close()

    # -- what observers may use (the chaos injector) -------------------------

    @property
    def placement(self):
        """The adopted placement (None before the first)."""
        return self.state.placement

    @property
    def losses(self) -> list[float]:
        return list(self.state.losses)

    @property
    def recoveries(self) -> int:
        return self.state.recoveries

    @property
    def dead(self) -> Mapping[str, str]:
        """Workers declared dead, with why (the run state's)."""
        return self.state.dead

    def live_spares(self) -> tuple[str, ...]:
        """Spares of the current placement not declared dead."""
        return tuple(s for s in self.placement.spares if s not in self.dead) if self.placement else ()

    def live_samplers(self) -> tuple[str, ...]:
        """An RL run's samplers not declared dead (none for a training run)."""
        return tuple(w for w in self.sampling.live if w not in self.dead) if self.sampling is not None else ()

    def next_checkpoint_writer(self) -> str | None:
        """A worker with a checkpoint save still ahead of it: the writer of the next checkpoint not yet
        dispatched (if the placement stays), else of the newest one dispatched and not reported complete (its
        save waits or is being written); None when no save remains (``runtime.control.checkpointing.checkpoint_writer``)."""
        if self.placement is None:
            return None
        live = [w for w in self.placement.active if w not in self.dead]
        return (self.checkpoints.next_writer(self.state.dispatched, self.state.steps, self.placement.grid)
                or self.checkpoints.unfinished_writer(live))

    def pid(self, worker_id: str, host: int = 0) -> int:
        """The process id a worker (host ``host`` of its slice) registered with; ``KeyError`` for an unknown
        worker."""
        return self.group.pid(worker_id, host)

    def hosts_of(self, worker_id: str) -> int:
        """How many hosts (processes) ``worker_id``'s slice has."""
        return self.group.hosts_of(worker_id)

    def inject_fault(self, worker_id: str, action: str, *, factor: float = 0.0, seconds: float = 0.0,
                     phase: str = "", after_step: int = 0, host: int | None = None) -> None:
        """Arms one worker-side fault (one of ``FAULT_ACTIONS``) on a worker started with chaos enabled.
        ``after_step`` (``kill_in_phase`` ``save``): only a save of a later step counts. ``host``: on that host
        of a slice of several alone (None: on every host).

        Raises the typed error of the call (``WorkerLostError``, ``WorkerError``, ...) when it fails.
        """
        self.group.inject_fault(worker_id, action, factor=factor, seconds=seconds, phase=phase,
                                after_step=after_step, host=host)

    # -- the state machine -----------------------------------------------------

    def train(self, steps: int, seed: int, on_step=None, max_seconds: float | None = None) -> RunResult:
        """Runs ``steps`` steps from a fresh state; returns the run's summary.

        Step ``s`` is committed when every active slice applied it. When a
        worker is lost, in-flight steps are abandoned, the policy decides
        (replace / shrink / wait / fail), and training resumes at the first
        step not applied by every survivor: no committed step is lost or
        applied twice. With ``max_seconds``, dispatching stops that long after
        training started and the run ends at the last dispatched step
        (``run_truncated``). Raises ``CapacityExhaustedError`` when too few
        workers are left, ``StateLostError`` when no copy of the state is left,
        ``ReplicaDivergenceError`` when replicas disagree and
        ``BadInputError`` for an unusable ``load_full_state_path`` (all
        ``ElasticTrainingFailedError``).
        """
        self.begin(steps, seed, on_step, max_seconds)
        while not isinstance(self.phase, Finished):
            self.advance()
        return self.result

    @property
    def result(self) -> RunResult | None:
        """The run's result once it finished (its :class:`Finished` phase carries it), else None."""
        return self.phase.result if isinstance(self.phase, Finished) else None

    def begin(self, steps: int, seed: int, on_step=None, max_seconds: float | None = None) -> None:
        """Sets up a run without starting it; :meth:`advance` then moves it one transition at a time."""
        self.attempt = Attempt(seed=seed, steps=steps, on_step=on_step, max_seconds=max_seconds, t0=time.time())
        self.phase: Phase = Starting()
        if self.reattach is not None:   # the same run goes on: attach records it (client_attached)
            return
        self.events.emit("run_started", run_id=self.run_id, slices=self.opts.slices,
                         devices_per_slice=self.opts.devices_per_slice, spares=self.opts.spares,
                         stages=self.opts.pipeline_stages,
                         microbatches=self.programs.num_microbatches, steps=steps, controller=self.address,
                         controller_host=self.group.client_host, generation=self.opts.generation)

    def advance(self) -> Phase:
        """Runs one transition of the current phase; returns the next phase.

        A lost worker or an aborted step in ``Running``, ``Boundary`` or
        ``Recovering`` leads to (another) ``Recovering`` with that error; any other error
        propagates and ends the run. Before a membership change
        (``Recovering``, ``Boundary``) ``ownership.check`` is asked: a client
        another one took the run from raises ``ClientSupersededError`` there.
        """
        phase = self.phase
        handler = {Starting: self._starting, Running: self._running, Boundary: self._boundary,
                   Recovering: self._recovering}[type(phase)]
        try:
            self.phase = handler(phase)
        except WorkerFencedError as err:
            if isinstance(phase, Starting) or self.ownership is None or not self.opts.client_grace_seconds:
                raise
            self.phase = self._take_back(err)
        except RECOVERABLE as err:
            if isinstance(phase, Starting):
                raise
            self.pending.clear()
            self.phase = Recovering(err)
        if isinstance(self.phase, (Recovering, Boundary)) and self.ownership is not None:
            self.ownership.check(self)   # a stale client that woke changes nothing of a run that is another's now
        return self.phase

    def _take_back(self, err: WorkerFencedError) -> Phase:
        """Its workers fenced themselves (``err``): this client was silent longer than their lease, stopped or
        cut off, and they wait for a client. While the run is still its own (``ownership.take_back`` checks), it takes
        it back as the next client generation (``ownership.take_back``), exactly as a restarted client would
        (:func:`runtime.control.attach.attach`: the workers that answer, realigned; the others replaced)."""
        generation = self.opts.generation + 1
        self.ownership.take_back(self, generation)   # ClientSupersededError: another client owns the run now
        self.opts = dataclasses.replace(self.opts, generation=generation)
        self.group.new_generation(generation)
        self.pending.clear()
        self.plans.clear()
        self.evals.forget()
        self._trainers_seen = ()   # an RL run's trainers answer which weights versions they hold, as after a restart
        attach(self, time.time() - self.ledger.last_event_t, os.getpid(), first=False)
        self.slow.restart()
        return Running()

    # -- Starting --------------------------------------------------------------

    def _starting(self, _: Starting) -> Phase:
        """Launches, registers, places, loads and initializes (:func:`runtime.control.startup.start`); a restarted
        client attaches the live workers instead (:func:`runtime.control.attach.attach`)."""
        if self.reattach is not None:
            attach(self, self.reattach.downtime_seconds, self.reattach.previous_pid)
        else:
            start(self)
            self.evals.floor = self.state.committed   # a resumed run: the earlier attempt recorded its evals
            if self.sampling is not None:
                self.sampling.start(self.placement.active, self.attempt.seed)
                self._trainers_seen = self.placement.active
        self.slow.restart()
        if self.attempt.max_seconds:   # counted from the first step, not from launch
            self.attempt.deadline = self.slow.last_commit + self.attempt.max_seconds
        return Running()

    # -- Running ---------------------------------------------------------------

    def _running(self, _: Running) -> Phase:
        """Commits the oldest step in flight after filling the pipeline; drains it first when membership changes."""
        for death in self.group.drain_deaths():
            if death.cause == "fenced":   # alive, waiting to be taken back (see _take_back), unless it was already
                if death.worker in self.group.fenced and death.worker in self.placement.members:
                    raise WorkerFencedError(f"worker {death.worker} fenced itself: {death.reason}")
                continue
            if death.worker not in self.dead:   # answered an Attach since: alive after all
                continue
            if self.sampling is not None and self.state.role_of(death.worker) == SAMPLER:
                self._sampler_lost(death.worker)
                continue
            if death.worker in self.placement.active:
                raise WorkerLostError(death.worker, death.reason)
        s, a = self.state, self.attempt
        if s.committed >= s.steps:
            return self._finish()
        if a.deadline is not None and time.monotonic() > a.deadline and s.steps > max(s.dispatched, 1):
            self.events.emit("run_truncated", steps=max(s.dispatched, 1),
                             reason=f"max_seconds={a.max_seconds:g} reached")
        if membership_change_due(self.placement, self.opts.slices, self.dead, unadopted=self.group.has_newcomers(),
                                 warmed=self.group.warmed(), swaps=bool(s.swaps)) or \
                self.shadows.behind(self.state) or self.group.release_due():
            if self.pending:      # drain, so the change happens at a step boundary
                self.group.start_warming()   # a newcomer loads its programs meanwhile
                self._collect(*self.pending.popleft())
                return Running()
            return Boundary()
        fed = self.sampling is not None
        if fed:
            self._pump_samplers()
        while len(self.pending) < self.opts.dispatch_depth and self.state.dispatched < self.state.steps:
            if fed and not self.sampling.ready(self.state.dispatched):
                break
            self._dispatch(plan_step(self.placement, self.state.dispatched, self.programs.num_microbatches))
        if self.pending:
            if fed:   # the samplers work on (the next steps' rollouts, syncs) while this step trains
                self._samplers_during(self.pending[0][1])
            self._collect(*self.pending.popleft())
        elif fed:   # waiting for rollouts: nothing of the trainers' in flight
            self.sampling.wait(0.05)
        return Running()

    def _samplers_during(self, futs) -> None:
        """An RL run: while the trainers' step ``futs`` is in flight, the samplers' calls are taken in as they end
        and the next ones started (so step s+1's rollouts are made while step s trains), until the step's
        workers all answered, one of them failed (a trainer lost: its peers would wait for it in the reduction
        until their own timeout, 10 s) or the step watchdog's deadline came (``_collect`` then waits and judges as
        ever)."""
        deadline, _ = self.slow.deadline()
        while not settled(futs) and (deadline is None or time.monotonic() < deadline):
            self._pump_samplers()   # (a trainer that answered already wakes no one: the others are waited for)
            self.sampling.wait(0.05, also=[f for f in futs.values() if not f.done()])

    def _pump_samplers(self) -> None:
        """An RL run: the samplers' calls that ended are taken in and the next ones started; trainers that
        changed since (a recovery) publish the version the run stands at."""
        s = self.state
        if self.placement.active != self._trainers_seen:
            self.sampling.trainers_changed([w for w in self.placement.active if w not in self.dead])
            self._trainers_seen = self.placement.active
        self.sampling.pump(s.committed, s.steps, self.dead)
        if self.sampling.starved(self.dead):
            raise self._no_sampler()

    def _sampler_lost(self, worker: str) -> None:
        """An RL run's sampler was lost: the one planner decides (:func:`~runtime.control.plan.plan_sampler_loss`:
        its rollouts to the others, a fresh one in its place, or the end), the decision is recorded
        (``sampler_lost``), then carried out; the trainers' step goes on."""
        plan = plan_sampler_loss(self.state, self.opts, worker)
        self.events.emit("sampler_lost", worker=worker, action=plan.action.value, reason=plan.reason,
                         relaunched=bool(plan.launches))
        self.sampling.forget(worker)
        if plan.action is Action.FAIL:
            raise self._no_sampler()
        for launch in plan.launches:
            self.group.relaunch(launch)

    def _no_sampler(self) -> CapacityExhaustedError:
        last = f"; the last failure: {self.sampling.last_error}" if self.sampling.last_error else ""
        return CapacityExhaustedError("every sampler is lost and none can be launched in its place "
                                      f"(elastic_max_retries={self.opts.max_retries} relaunches used){last}")

    def _dispatch(self, plan: StepPlan) -> None:
        shadows = self.shadows.feeding(self.state)
        steps = self.state.steps
        evals = self.evals.order_for(plan, self.state)
        futs = self.group.dispatch(plan, self.checkpoints.order_for(plan.step, steps, plan.grid,
                                                                    self.state.loss_sums),
                                   shadows, self.snapshots.order_for(plan.step, steps, self.placement, len(shadows)),
                                   evals=evals, feed=self.sampling.feed(plan.step) if self.sampling else None)
        self.shadows.dispatched(plan.step, {w: futs.pop(w) for w in shadows})
        self.plans[plan.step] = plan
        self.events.emit("step_dispatched", step=plan.step, epoch=plan.epoch, workers=list(plan.workers))
        self.pending.append((plan, futs, time.time()))

    def _collect(self, plan: StepPlan, futs, t_dispatch: float) -> None:
        """Waits for a step (the watchdog looks once if it runs far past the median), checks and records it."""
        deadline, median = self.slow.deadline()
        results = self.group.wait(futs, deadline)
        if isinstance(results, Stalled):
            self.slow.stalled(plan, results.pending, median)
            results = self.group.wait(futs)
        sums = {results[w].loss_sum for w in plan.loss_workers}   # (a pipeline's earlier stages compute none)
        if len(sums) != 1:
            raise ReplicaDivergenceError("replicas disagree on the step loss", step=plan.step, cause=str(sums))
        self.slow.observe(plan, results)
        self.checkpoints.note({w: (r.checkpoints_saved, r.checkpoint_error) for w, r in results.items()})
        self.snapshots.note({w: (r.snapshots_saved, r.snapshots_copied, r.snapshot_error) for w, r in results.items()})
        self.shadows.poll()
        stages = {}
        if plan.stages > 1:   # each stage's phases (its slowest replica's) and the step's measured bubble
            groups = plan.grid
            stages["stage_phases"] = {str(k): slowest_phases([results[w].phases for w in g])
                                      for k, g in enumerate(groups)}
            bubble = stage_workers_bubble([[results[w].stage_busy_seconds for w in g] for g in groups],
                                          [[results[w].stage_stream_seconds for w in g] for g in groups])
            if bubble is not None:
                stages["bubble"] = bubble
        evals = self.evals.results(plan.step, results)
        self._commit(plan.step, plan.epoch, sums.pop(), t_dispatch=t_dispatch, plan=plan, **stages,
                     grad_seconds=max(r.grad_seconds for r in results.values()),
                     reduce_seconds=max(r.reduce_seconds for r in results.values()),
                     apply_seconds=max(r.apply_seconds for r in results.values()),
                     bytes_sent=sum(r.bytes_sent for r in results.values()),
                     phases=slowest_phases([r.phases for r in results.values()]))
        self.evals.record(evals)

    def _commit(self, step: int, epoch: int, loss_sum: float, *, t_dispatch=None, plan=None, **fields) -> None:
        """Commits one step: the only place that emits ``step_committed``, calls ``on_step`` and the observer."""
        loss = self.mean_loss(loss_sum)
        if plan is not None:
            fields["microbatches"] = plan.microbatches()
        if t_dispatch is not None:
            fields["seconds"] = time.time() - t_dispatch
        self.slow.committed(bool(fields.get("recovered")))
        deferred = self.state.deferred
        self.events.emit("step_committed", step=step, epoch=epoch, loss=loss, loss_sum=float(loss_sum), **fields)
        self.plans.pop(step, None)
        if self.sampling is not None:   # its rollouts are let go; the trainers that applied it hold its version
            self.sampling.committed(step, plan.workers if plan is not None else self.placement.active)
        if self.attempt.on_step is not None:
            self.attempt.on_step(step, loss)
        self.observer.step_committed(step)
        if deferred and not fields.get("recovered"):
            for w in deferred:   # the recovery's first step is done: the replacements its plan decided start now
                if (launch := decide_launch(self.state, self.opts, w)) is not None:
                    self.group.relaunch(launch)

    def mean_loss(self, loss_sum: float, microbatches: int | None = None) -> float:
        """The step's loss: the workers' canonical sum over microbatches, averaged in float32 as a plain loop would."""
        return float(np.float32(loss_sum) / np.float32(microbatches or self.programs.num_microbatches))

    def _finish(self) -> Phase:
        """Every step committed: wait for the checkpoints in flight, check that the replicas agree, build the result."""
        s = self.state
        self.evals.at_end(s)
        self.checkpoints.finish(self.placement.grid, s.loss_sums)
        hashes = {w: digest for w, (_, digest) in self.group.hashes(self.placement.active).items()}
        result = RunResult(steps_completed=s.committed, losses=list(s.losses), recoveries=s.recoveries,
                           final_state_digest=self._final_digest(hashes, s.steps), replica_hashes=hashes,
                           wall_seconds=time.time() - self.attempt.t0, client_peak_rss_bytes=peak_rss_bytes(),
                           state_bytes=s.state_bytes)
        self.events.emit("run_finished", steps_completed=result.steps_completed,
                         final_state_digest=result.final_state_digest, replica_hashes=hashes,
                         wall_seconds=result.wall_seconds, client_peak_rss_bytes=result.client_peak_rss_bytes)
        return Finished(result)

    def _final_digest(self, hashes: dict[str, str], step: int) -> str:
        """The state's digest: every replica's, which must agree; a pipeline's, over its stages' (the replicas of
        each stage must agree). ``ReplicaDivergenceError`` otherwise."""
        per_stage = [{hashes[w] for w in group} for group in self.placement.grid]
        if any(len(digests) != 1 for digests in per_stage):
            raise ReplicaDivergenceError("replicas diverged", step=step, cause=f"state hashes {hashes}")
        return stages_digest([d.pop() for d in per_stage])

    # -- Recovering and Boundary: membership changes ---------------------------------

    def _recovering(self, phase: Recovering) -> Phase:
        """One recovery (:meth:`recover`); training resumes where it says."""
        self.pending = collections.deque()
        self.recover(phase.error)
        self.plans.clear()
        self.evals.forget()
        self.slow.restart()   # the watchdog times the next step from here
        return Running()

    def recover(self, err: Exception, has_state: bool = True) -> None:
        """One recovery after ``err``: survey, plan, carry the plan out; plan again from the facts that changed
        until one is carried out. ``has_state``: False while the run starts (no state yet).

        The survey stops the run (steps in flight abandoned, every member probed, the live ones fenced and
        asked where they stand); :func:`runtime.control.plan.plan_recovery` decides everything from it and the
        run state; each distinct plan is recorded (``recovery_decision``). A ``WAIT`` waits for capacity and
        surveys the workers that joined; a ``FAIL`` raises its error; the executor carries the others out and
        answers :class:`~runtime.control.plan_executor.Done` or the facts that changed. A worker lost while a
        plan is carried out raises ``WorkerLostError``: the controller starts another recovery.
        """
        started, x = time.time(), self.executor
        committed_before = self.state.committed
        shadows = x.stop(self.state, has_state)
        x.failure(type(err).__name__, str(err), getattr(err, "worker_id", None), self.state.committed)
        old = self.state.placement
        x.probe(old, f"no answer after {type(err).__name__}")
        survey = x.survey(self.state, has_state=has_state, shadows=shadows)
        dead = sorted(w for w in old.members if w in self.state.dead)
        recorded, wait, found, t_wait = None, None, [], 0.0
        while True:
            plan = plan_recovery(self.state, survey, self.opts, time.monotonic())
            if plan != recorded:
                x.decision(plan, dead)
                recorded = plan
            if plan.action is Action.WAIT:
                if wait is None:
                    wait, t_wait = self._wait_begins(plan), time.time()
                joined = x.wait_for_capacity(wait.until)
                found += joined
                survey = x.survey(self.state, has_state=has_state, previous=survey, ask=joined,
                                  joined=survey.joined + tuple(joined), wait=wait)
                continue
            if wait is not None:
                self.events.emit("capacity_wait_ended", seconds=time.time() - t_wait, found=found)
                wait = None
            if plan.action is Action.FAIL:
                raise failed(plan, "cannot recover", step=self.state.committed)
            x.adopt(plan, self.state.deferred)
            for step, loss_sum in plan.commits:   # every survivor applied them: committed from their losses
                self._commit(step, plan.placement.epoch, loss_sum, plan=self.plans.get(step), recovered=True)
            if plan.commits:   # their replies, and evals, are lost; the last's is owed to the next step
                self.evals.lost(self.state, committed_before - 1)
            outcome = x.carry_out(plan, survey, self.state.committed, dead, started)
            if isinstance(outcome, Done):
                return
            survey = x.survey(self.state, has_state=has_state, previous=outcome.survey, ask=plan.placement.members)

    def _wait_begins(self, plan: Plan) -> Wait:
        """A recovery waits for capacity: up to ``capacity_timeout_seconds`` for a worker to join, else (none may
        join) ``register_timeout_seconds`` for the relaunched ones; the dead of the placement start again now."""
        o = self.opts
        limit = "capacity_timeout_seconds" if o.capacity_timeout_seconds else "register_timeout_seconds"
        timeout = getattr(o, limit)
        for launch in plan.launches:
            if not launch.later:
                self.group.relaunch(launch)
        self.events.emit("capacity_wait", needed=o.min_slices, timeout_seconds=timeout)
        return Wait(time.monotonic() + timeout, limit, timeout)

    def place(self, workers, lost, started: float) -> None:
        """The first placement (:func:`runtime.control.plan.plan_start`) of the registered ``workers``; ``lost``:
        launched workers that died first."""
        o = self.opts
        plan = plan_start(o.slices, o.devices_per_slice, workers, lost=lost, min_slices=o.min_slices,
                          stages=o.pipeline_stages)
        self.executor.start(plan, sorted(lost), started)

    def before_state(self, during: str) -> None:
        """Members lost while the run starts (no state yet): a recovery without state (``during``: what the
        run was doing)."""
        dead = sorted(w for w in self.state.placement.members if w in self.dead)
        if dead:
            self.recover(WorkerLostError(dead[0], f"lost while {during}: {self.dead[dead[0]]}"), has_state=False)

    def _give_back(self, loaded) -> None:
        """A shared pool asked for slices back (a run of a higher priority needs them): spares go first, then the
        run shrinks (never below its minimum); each given back is asked for again, to grow back once the pool
        has a host free."""
        due = self.group.release_due()
        if not due:
            return
        plan, given = plan_release(self.state, self.opts, loaded(), due)
        self.events.emit("lease_preempted", count=due, workers=given)
        if plan.action is Action.KEEP:
            self.group.release_refused(due)
            return
        self.executor.remap(plan, self.state, given=given)
        for w in given:
            self.group.release(w)
        for launch in plan.launches:
            self.group.relaunch(launch)

    def _boundary(self, _: Boundary) -> Phase:
        """No step in flight: warm newcomers into spares, drop dead spares, swap stragglers out, grow."""
        warmed = self.group.warm_newcomers()
        p = self.placement
        spares = tuple(s for s in p.spares if s not in self.dead) + tuple(warmed)
        if spares != p.spares:
            self.events.emit("placement_changed", epoch=p.epoch, active=list(p.active), spares=list(spares),
                             why="spares")
        loaded = lambda: {w: k for w in self.placement.members if (k := self.group.loaded_stage(w)) is not None}
        for slow in self.state.swaps:
            plan = plan_swap(self.state, self.opts, loaded(), slow)
            if plan.action is Action.KEEP:
                self.events.emit("straggler_kept", worker=slow, reason=plan.reason)
                continue
            self.executor.remap(plan, self.state, slow=slow)
            self.group.shutdown(slow)
        self._give_back(loaded)
        plan = plan_grow(self.state, self.opts, loaded())
        if plan.action is not Action.KEEP:
            self.executor.remap(plan, self.state)
        self.executor.copies.sync_shadows(self.state)
        self.slow.restart()
        return Running()
