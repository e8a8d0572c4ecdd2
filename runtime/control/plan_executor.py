"""Carries out membership changes: the I/O half of :mod:`runtime.control.plan`.

:class:`PlanExecutor` does two things and decides nothing:

- :meth:`PlanExecutor.survey` gathers the facts a plan is made from: after a
  failure it probes every member, fences the live ones into the next epoch
  (their step in flight stops; each answers its applied steps, recent loss
  sums and the snapshots on its host), and lists the backups only when some
  stage has no live replica left (a ``gs://`` listing is a round trip);
- the ``carry_out`` methods do what a :class:`~runtime.control.plan.Plan` says, in
  its order: adopt its placement (fence its epoch), relaunch the dead it names
  now, load the pipeline stages it names, roll back its survivors, load its
  backup, make its copies, check every replica's hash, record the outcome.
  Each returns a value: a recovery that could not be carried out as planned
  (a snapshot that does not read, a pipelined restore whose loads came back
  older) returns the facts that changed (:class:`Replan`), and the controller
  plans again.

The three events of a recovery are written here only: ``failure_detected``,
``recovery_decision`` (one per plan) and ``recovered``. A worker lost while a
plan is carried out raises its ``WorkerLostError`` (the controller starts
another recovery). Nothing here calls back into the controller.
"""

from __future__ import annotations

import dataclasses
import time

from runtime.core.errors import (CapacityExhaustedError, DeviceMismatchError, ElasticError, ReplicaDivergenceError,
                                 StateLostError, WorkerFencedError, WorkerLostError)
from runtime.control.plan import Action, Failure, Plan, Survey
from runtime.control.placement import Placement
from runtime.control.state_copies import StateCopies
from runtime.control.tiers import Holding

__all__ = ["Done", "PlanExecutor", "Replan", "failed"]

# The event a restore from each tier records (literal kinds, so a search for the kind finds where it is emitted).
RESTORED_EVENT = {"checkpoint": "checkpoint_restored", "snapshot": "snapshot_restored"}
# The event each boundary change records.
REMAPPED_EVENT = {"grow": "grown", "swap": "straggler_replaced", "release": "released"}


def failed(plan: Plan, message: str, step: int | None = None) -> Exception:
    """The error that ends the run for a ``FAIL`` plan, by its typed ``failure`` (never by the reason's text):
    ``StateLostError`` when no copy of the state is left, ``DeviceMismatchError`` when the workers that joined
    have other devices than a slice's, ``ReplicaDivergenceError`` when the survivors disagree, else
    ``CapacityExhaustedError``."""
    if plan.failure is Failure.DIVERGED:
        return ReplicaDivergenceError(message, step=step, cause=plan.reason)
    kind = {Failure.STATE_LOST: StateLostError, Failure.DEVICES: DeviceMismatchError}.get(plan.failure,
                                                                                      CapacityExhaustedError)
    return kind(message, step=step, cause=plan.reason)


@dataclasses.dataclass(frozen=True)
class Done:
    """A recovery carried out: training resumes at ``resume``."""

    resume: int


@dataclasses.dataclass(frozen=True)
class Replan:
    """A plan that could not be carried out as it stands: the survey with the facts that changed."""

    survey: Survey


class PlanExecutor:
    """Surveys and carries out plans through a worker group (see the module docstring).

    ``opts``: the run's ``ControllerOptions``; ``ledger``: the run's :class:`~runtime.control.run_state.RunLedger`
    (who is dead: read as it is now, a probe or a call may have declared a death since the plan's state was
    taken); ``checkpoints``, ``snapshots``, ``shadows``: the run's backup tiers
    (:mod:`runtime.control.checkpointing`, :mod:`runtime.control.snapshotting`, :mod:`runtime.control.shadows`);
    ``before_transfer(source, dest)``: the observer's hook before each copy.
    """

    def __init__(self, group, opts, events, ledger, *, checkpoints, snapshots, shadows, before_transfer):
        self.group, self.opts, self.events, self.ledger = group, opts, events, ledger
        self.checkpoints, self.snapshots, self.shadows = checkpoints, snapshots, shadows
        self.copies = StateCopies(group, opts, events, ledger, shadows=shadows, before_transfer=before_transfer)

    def _dead(self):
        return self.ledger.state.dead

    # -- the facts -------------------------------------------------------------------

    def failure(self, error: str, detail: str, worker: str | None, committed: int) -> None:
        """Records ``failure_detected``: a recovery starts after ``error`` (its type's name)."""
        self.events.emit("failure_detected", error=error, detail=detail[:500], worker=worker, committed=committed)

    def stop(self, state, has_state: bool) -> frozenset[str]:
        """A recovery starts: answers the spares that shadow the committed state (they are replicas too:
        promoted first, no transfer), abandons the steps in flight, and probes every member not known dead
        (one that does not answer is declared dead)."""
        group = self.group
        group.drain_deaths()   # the run state has them; the probe below finds the rest
        shadows = frozenset()
        if has_state:
            shadows = frozenset(self.shadows.holding(state.committed, min(2.0, self.opts.rpc_timeout_seconds)))
            self.shadows.abandon()
        group.cancel_inflight()
        return shadows

    def probe(self, placement: Placement, why: str) -> None:
        """Probes every member of ``placement`` not known dead; one that does not answer is declared dead, but for
        one the health monitor found fenced, waiting for this client to take it back (``group.fenced``): then
        ``WorkerFencedError``, so the controller takes its run back (its step may have failed first, as the
        workers fenced themselves)."""
        group = self.group
        for w, alive in group.probe([w for w in placement.members if w not in self._dead()]).items():
            if alive:
                continue
            if w in group.fenced:
                raise WorkerFencedError(f"worker {w} fenced itself ({why})")
            group.declare_dead(w, why)

    def survey(self, state, *, has_state: bool, shadows: frozenset[str] = frozenset(), ask=None,
               previous: Survey | None = None, **changed) -> Survey:
        """The facts of one planning round. ``ask``: the members to fence and ask where they stand (default:
        every live member of the placement and of ``joined``); the answers of ``previous`` are kept for the
        others. ``changed``: other :class:`Survey` fields (``joined``, ``wait``, ``unreadable``, ``at_most``)."""
        group, o = self.group, self.opts
        base = previous or Survey(has_state=has_state, placement=state.placement, shadows=shadows)
        old = base.placement
        joined = changed.get("joined", base.joined)
        members = [*old.members, *(w for w in joined if w not in old.members)]
        statuses = dict(base.statuses)
        if has_state:
            group.fence_at(old.epoch + 1)   # the epoch the plan adopts: a late step of the old one is refused
            asked = [w for w in (members if ask is None else ask) if w not in self._dead()]
            statuses.update(group.abort(asked))
        replicas = (state.replicas | base.shadows) if has_state else frozenset(members)
        dead = self._dead()
        live = all(any(w in replicas and w not in dead for w in stage)   # (each stage holds its own)
                   for stage in old.grid)
        backups = {} if live or not has_state else self._backups(state.committed, old.stages)
        return dataclasses.replace(base, statuses=statuses, shadows=base.shadows - frozenset(dead),
                                   loaded={w: k for w in members if (k := group.loaded_stage(w)) is not None},
                                   hosts={w: group.host_of(w) for w in members}, **backups, **changed)

    def _backups(self, committed: int, stages: int) -> dict:
        """The newest complete backups known: ``snapshots``, ``checkpoints`` and (a pipelined run's) the hosts
        each stage's newest snapshot lies on."""
        snap, ckpt = self.snapshots.newest(committed), self.checkpoints.newest(committed)
        out = {"snapshots": (Holding("snapshot", snap),) if snap is not None else (),
               "checkpoints": (Holding(self.checkpoints.directory or "checkpoint", ckpt),) if ckpt is not None
               else ()}
        reported = self.snapshots.newest(committed, reported=True) if snap is not None else None
        if reported is not None and stages > 1:
            out["snapshot_hosts"] = self.snapshots.stage_hosts(reported)
        return out

    def wait_for_capacity(self, deadline: float) -> list[str]:
        """Waits (to ``deadline``, monotonic, at most half a second) for workers to join and warm: their ids."""
        group = self.group
        group.wait_for_newcomer(max(min(deadline - time.monotonic(), 0.5), 0.0))
        return group.warm_newcomers(block_until=deadline)

    # -- what was decided ------------------------------------------------------------

    def decision(self, plan: Plan, dead) -> None:
        """Records one plan of a recovery (``recovery_decision``)."""
        p = plan.placement
        self.events.emit("recovery_decision", action=plan.action.value, reason=plan.reason, dead=list(dead),
                         epoch=p.epoch, active=list(p.active), spares=list(p.spares))

    def recovered(self, plan: Plan, dead, started: float, resume: int, epoch: int, moved: int = 0,
                  tier: str | None = None) -> None:
        fields = {"restore_tier": tier} if tier else {}
        self.events.emit("recovered", path=plan.action.value, epoch=epoch, resume_step=resume, dead=list(dead),
                         bytes_moved=moved, seconds=time.time() - started, **fields)

    # -- carrying a plan out ---------------------------------------------------------

    def start(self, plan: Plan, lost, started: float) -> None:
        """The first placement: records it (and, when launched workers died first, the failure, the plan and the
        recovery); ``FAIL`` raises its error."""
        if lost:
            self.group.drain_deaths()
            self.failure("WorkerLostError", f"{', '.join(lost)} died before registering: {self._dead().get(lost[0], '')}",
                         lost[0], 0)
            self.decision(plan, lost)
        if plan.action is Action.FAIL:
            raise failed(plan, "cannot place the virtual slices")
        self.group.fence_at(plan.placement.epoch)
        p = plan.placement
        self.events.emit("placement", epoch=p.epoch, active=list(p.active), spares=list(p.spares),
                         seconds=time.time() - started)
        if lost:
            self.recovered(plan, sorted(lost), started, 0, p.epoch)

    def adopt(self, plan: Plan, deferred=()) -> None:
        """Fences the plan's epoch, stops watching the dead it retires, launches what it starts now and records the
        dead replaced after the next commit (``deferred``: already recorded)."""
        group = self.group
        group.fence_at(plan.placement.epoch)
        for w in plan.retired:
            group.forget(w)
        for launch in plan.launches:
            if not launch.later:
                group.relaunch(launch)
        if later := [w for w in plan.relaunch_later if w not in deferred]:
            self.events.emit("relaunch_deferred", workers=later)

    def carry_out(self, plan: Plan, survey: Survey, committed: int, dead, started: float) -> Done | Replan:
        """Brings the state back as ``plan`` says (after :meth:`adopt`): its stage loads, then its backup
        restored or its survivors rolled back, its copies, every replica's hash checked, ``recovered``
        recorded. ``committed``: the committed frontier after the plan's commits."""
        new = plan.placement
        if not survey.has_state:
            self.recovered(plan, dead, started, 0, new.epoch)
            return Done(0)
        for w, k in plan.loads:
            self.copies.take_stage(w, k)
        if plan.resurvey:   # the stages' snapshots are listed with their programs: ask again
            return Replan(dataclasses.replace(survey, statuses={}))
        if plan.restore is not None:
            return self._restore(plan, survey, committed, dead, started)
        for w in plan.rollbacks:
            self.group.rollback(w, plan.resume)
            self.events.emit("rolled_back", worker=w, to_step=plan.resume)
        moved = self.copies.carry_out(plan.copies, plan.resume)
        self.copies.check_replicas(new, plan.resume)
        self.copies.recheck_shadows(new, plan.tier.source)
        self.recovered(plan, dead, started, plan.resume, new.epoch, moved, plan.tier.tier)
        return Done(plan.resume)

    def _restore(self, plan: Plan, survey: Survey, committed: int, dead, started: float) -> Done | Replan:
        """Loads the plan's backup, copies it to the active slices that did not load it, records it."""
        r, new = plan.restore, plan.placement
        if r.tier == "snapshot":
            try:
                replies = self.group.load_snapshots(list(r.loaders), r.step)
            except ElasticError as e:   # its snapshots cannot be read: plan again without them
                self.events.emit("snapshot_unusable", worker=r.loaders[0], error=str(e)[:300])
                return Replan(dataclasses.replace(survey, unreadable=survey.unreadable | set(r.loaders)))
            if lost := [w for w in r.loaders if w not in replies]:
                raise WorkerLostError(lost[0], "lost while loading an in-memory snapshot")
            for w in r.loaders:
                for why in replies[w].skipped:
                    self.events.emit("checkpoint_skipped", worker=w, detail=why[:500])
            step = min(replies[w].applied_steps for w in r.loaders)
            if len(r.loaders) > 1 and step != r.step:   # a stage's newest did not read: every stage goes back
                return Replan(dataclasses.replace(survey, at_most=step))
            nbytes = sum(replies[w].bytes for w in r.loaders)
            where = {"worker": r.loaders[0], "host": self.group.host_of(r.loaders[0])}
        else:
            loaded = self.checkpoints.load(list(r.loaders), r.step)
            if lost := [w for w in r.loaders if w not in loaded.bytes]:
                raise WorkerLostError(lost[0], "lost while loading a checkpoint")
            step, nbytes = loaded.step, sum(loaded.bytes.values())
            where = {"directory": self.checkpoints.directory}
        moved = nbytes + self.copies.carry_out(plan.copies, step)
        self.copies.check_replicas(new, step)
        self.events.emit(RESTORED_EVENT[r.tier], step=step, bytes=nbytes, steps_lost=committed - step, **where)
        self.recovered(plan, dead, started, step, new.epoch, moved, r.tier)
        return Done(step)

    def remap(self, plan: Plan, state, **fields) -> None:
        """A boundary change (grow, swap): fence, copy the state to the newcomers, check, record it (``grown``,
        ``straggler_replaced``, with ``fields``)."""
        old, new = state.placement, plan.placement
        promoted = [w for w in new.active if w not in old.active]
        self.events.emit("placement_changed", epoch=new.epoch, active=list(new.active), spares=list(new.spares),
                         why=plan.action.value)
        self.group.fence_at(new.epoch)
        self.group.abort(new.members)
        for w, k in plan.loads:
            self.copies.take_stage(w, k)
        moved = self.copies.carry_out(plan.copies, plan.resume)
        self.copies.check_replicas(new, plan.resume)
        self.events.emit(REMAPPED_EVENT[plan.action.value], epoch=new.epoch, promoted=promoted, active=list(new.active), spares=list(new.spares),
                         bytes_moved=moved, step=plan.resume, **fields)
