"""Carries out every membership change: the one executor of :func:`runtime.control.plan.plan_change`'s plans.

The controller calls :class:`Membership` for each change, and only here are
``failure_detected``, ``recovery_decision`` and ``recovered`` emitted (each
from one method). A change:

1. gathers the facts (probes every member after a failure, lists the backups
   only when no live replica is left: a ``gs://`` listing is a round trip);
2. asks :func:`~runtime.control.plan.plan_change`, waiting for capacity while the plan
   says ``WAIT`` (re-planned with ``now`` until its deadline);
3. adopts the plan's placement (fences every member into its epoch), relaunches
   the dead at once or records that they start after the next commit
   (``relaunch_deferred``: a replacement's program load would compete with the
   step that recovers);
4. brings the state back: from the survivors (fenced, then realigned: the steps
   they all applied are committed, those one ahead roll back), or from a
   snapshot or checkpoint (``RESTORE``, tier chosen again from what the fenced
   members hold);
5. copies it to the active members that lack it and checks every replica's hash
   (:class:`runtime.control.state_copies.StateCopies`).

The run's state (committed frontier, replicas, placement) is read from the
controller's :class:`~runtime.control.run_state.RunState` (``state()``), which the
events emitted here update. A failure inside a change propagates as its typed
error (the controller starts another attempt); giving up raises
``CapacityExhaustedError`` (``StateLostError`` when no copy of the state is
left) or ``ReplicaDivergenceError``.
"""

from __future__ import annotations

import dataclasses
import time

from runtime.core.errors import (CapacityExhaustedError, DeviceMismatchError, ElasticError, ReplicaDivergenceError,
                                 StateLostError, WorkerLostError)
from runtime.control.plan import Action, Change, ChangePlan, Facts, Failure, RecoveryDecision, plan_change
from runtime.control.policy import Placement, slice_stages, stage_groups
from runtime.control.state_copies import StateCopies
from runtime.control.tiers import Holding, choose_source, stage_snapshot

__all__ = ["Membership", "failed"]

# The event a restore from each tier records (literal kinds, so a search for the kind finds where it is emitted).
RESTORED_EVENT = {"checkpoint": "checkpoint_restored", "snapshot": "snapshot_restored"}


def failed(decision: RecoveryDecision, message: str, step: int | None = None) -> CapacityExhaustedError:
    """The error that ends the run for a ``FAIL`` decision, by its typed ``failure`` (never by the reason's
    text): ``StateLostError`` when no copy of the state is left, ``DeviceMismatchError`` when the workers that
    joined have other devices than a slice's, else ``CapacityExhaustedError``."""
    kind = {Failure.STATE_LOST: StateLostError, Failure.DEVICES: DeviceMismatchError}.get(decision.failure,
                                                                                          CapacityExhaustedError)
    return kind(message, step=step, cause=decision.reason)


class Membership:
    """Membership changes through a worker group (see the module docstring).

    ``state``: a callable answering the controller's current ``RunState``;
    ``record(step, epoch, loss_sum, recovered=True)``: the controller commits a
    step the survivors all applied; ``before_transfer(source, dest)``: the
    observer's hook. ``opts``: the run's ``ControllerOptions``.
    """

    def __init__(self, group, opts, events, *, checkpoints, snapshots, shadows, state, record, before_transfer):
        self.group, self.opts, self.events = group, opts, events
        self.checkpoints, self.snapshots, self.shadows = checkpoints, snapshots, shadows
        self.state, self.record, self.before_transfer = state, record, before_transfer
        self.copies = StateCopies(group, opts, events, shadows=shadows, state=state, before_transfer=before_transfer)

    def _dead(self, placement: Placement) -> list[str]:
        """The members of ``placement`` declared dead, sorted."""
        return sorted(w for w in placement.members if w in self.group.dead)

    # -- the three events of a change (each emitted here only) ---------------------

    def _failure(self, error: str, detail: str, worker: str | None) -> None:
        self.events.emit("failure_detected", error=error, detail=detail[:500], worker=worker,
                         committed=self.state().committed)

    def _decision(self, plan: ChangePlan, dead) -> None:
        p = plan.placement
        self.events.emit("recovery_decision", action=plan.action.value, reason=plan.reason, dead=list(dead),
                         epoch=p.epoch, active=list(p.active), spares=list(p.spares))

    def _recovered(self, plan: ChangePlan, dead: list[str], started: float, resume_step: int, moved: int = 0,
                   tier: str | None = None) -> None:
        fields = {"restore_tier": tier} if tier else {}
        self.events.emit("recovered", path=plan.action.value, epoch=self.state().epoch, resume_step=resume_step,
                         dead=dead, bytes_moved=moved, seconds=time.time() - started, **fields)

    # -- the cases -------------------------------------------------------------------

    def start(self, workers, lost, started: float) -> None:
        """The first placement (``START``): registered ``workers``; ``lost``: launched workers that died first."""
        o = self.opts
        plan = plan_change(Facts(Change.START, slices=o.slices, devices_per_slice=o.devices_per_slice,
                                 min_slices=o.min_slices, workers=tuple(workers), lost=tuple(lost)))
        if lost:
            self.group.drain_deaths()
            self._failure("WorkerLostError", f"{', '.join(lost)} died before registering: {self.group.dead[lost[0]]}",
                          lost[0])
            self._decision(plan, lost)
        if plan.action is Action.FAIL:
            raise failed(plan.decision, "cannot place the virtual slices")
        self._adopt(plan.placement)
        p = plan.placement
        self.events.emit("placement", epoch=p.epoch, active=list(p.active), spares=list(p.spares),
                         seconds=time.time() - started)
        if lost:
            self._recovered(plan, sorted(lost), started, 0)

    def before_state(self, during: str) -> None:
        """Members lost while the run starts (no state yet): replace, shrink or wait; the dead start again now."""
        dead = self._dead(self.state().placement)
        if not dead:
            return
        err = WorkerLostError(dead[0], f"lost while {during}: {self.group.dead[dead[0]]}")
        self.recover(err, has_state=False)

    def recover(self, err: Exception, has_state: bool = True) -> None:
        """One recovery attempt after ``err``: decide, adopt, bring the state back, copy it, record ``recovered``."""
        started = time.time()
        group = self.group
        group.drain_deaths()   # the group's ledger has them; the probe below finds the rest
        s = self.state()
        shadows = frozenset()
        if has_state:   # spares that shadow the committed state are replicas too (promoted first, no transfer)
            shadows = frozenset(self.shadows.holding(s.committed, group.dead, min(2.0, self.opts.rpc_timeout_seconds)))
            self.shadows.abandon()
        group.cancel_inflight()
        self._failure(type(err).__name__, str(err), getattr(err, "worker_id", None))
        old = s.placement
        members = [w for w in old.members if w not in group.dead]
        for w, alive in group.probe(members).items():
            if not alive:
                group.declare_dead(w, f"no answer after {type(err).__name__}")
        replicas = frozenset(old.members) if not has_state else s.replicas | shadows
        plan, facts = self._plan_recovery(old, replicas, has_state)
        self._adopt(plan.placement)
        for w in plan.relaunch_now + plan.relaunch_later:
            group.forget(w)
        for w in plan.relaunch_now:
            group.relaunch(w)
        if plan.relaunch_later:
            self.events.emit("relaunch_deferred", workers=list(plan.relaunch_later))
        if not has_state:
            self._recovered(plan, self._dead(old), started, 0)
        elif plan.action is Action.RESTORE:
            self._restore(plan, facts.checkpoints, old, started)
        else:
            self._realign(plan, old, replicas, started)

    def _plan_recovery(self, old: Placement, replicas: frozenset[str], has_state: bool) -> tuple[ChangePlan, Facts]:
        """Asks for the recovery plan; below the minimum, waits for capacity while it says ``WAIT``. Answers the
        plan and the facts it came from (their backups were listed once: a restore loads from them)."""
        s, o, group = self.state(), self.opts, self.group
        live_replica = all(any(w in replicas and w not in group.dead for w in stage)   # (each stage holds its own)
                           for stage in stage_groups(old.active, o.pipeline_stages))
        backups = {} if live_replica or not has_state else self._backups(s.committed)
        # Capacity may come: a worker may join within capacity_timeout_seconds, and with every replica lost the
        # relaunched workers are waited for (they restore a snapshot left on their host, or the checkpoint); a
        # pipelined run, which does not shrink, waits for them to take the lost slices.
        backup = bool(backups.get("snapshots") or backups.get("checkpoints")) or o.pipeline_stages > 1
        # a pipelined restore gives each stage a worker where the newest snapshot every stage reported lies
        snapshot = self.snapshots.newest(s.committed, reported=True) if backups.get("snapshots") else None
        facts = Facts(Change.RECOVER, placement=old, committed=s.committed, dead=frozenset(group.dead),
                      replicas=replicas, recoveries=s.recoveries, slices=o.slices, min_slices=o.min_slices,
                      max_retries=o.max_retries, has_state=has_state, stages=o.pipeline_stages,
                      backup_hosts=self.snapshots.stage_hosts(snapshot) if snapshot is not None and
                      o.pipeline_stages > 1 else (), hosts={w: group.host_of(w) for w in old.members},
                      spare_stages=self._spare_stages(old.spares),
                      may_wait=o.capacity_timeout_seconds > 0 or (backup and o.relaunch), **backups)
        plan = plan_change(facts)
        self._decision(plan, self._dead(old))
        if plan.action is Action.WAIT:
            plan = self._wait_for_capacity(facts, plan)
        if plan.action is Action.FAIL:
            raise failed(plan.decision, "cannot recover", step=s.committed)
        return plan, facts

    def _spare_stages(self, spares) -> dict[str, int]:
        """A pipelined run's: the stage each spare's programs are for (a shadow spare shadows that stage)."""
        if self.opts.pipeline_stages == 1:
            return {}
        return {w: k for w in spares if (k := self.group.loaded_stage(w)) is not None}

    def _holders(self, active: tuple[str, ...], replicas) -> list[str]:
        """The workers of ``active`` (a placement's) that hold the committed state of their own slice: replicas,
        and in a pipelined run only those whose programs are for their slice's stage (a spare that shadowed
        another stage, promoted into this one, holds that stage's state)."""
        if self.opts.pipeline_stages == 1:
            return [w for w in active if w in replicas]
        stage = slice_stages(active, self.opts.pipeline_stages)
        return [w for w in active if w in replicas and self.group.loaded_stage(w) == stage[w]]

    def _backups(self, committed: int) -> dict:
        snap, ckpt = self.snapshots.newest(committed), self.checkpoints.newest(committed)
        return {"snapshots": (Holding("snapshot", snap),) if snap is not None else (),
                "checkpoints": (Holding(self.checkpoints.directory or "checkpoint", ckpt),) if ckpt is not None
                else ()}

    def _wait_for_capacity(self, facts: Facts, plan: ChangePlan) -> ChangePlan:
        """Below ``min_slices``: waits up to ``capacity_timeout_seconds`` (else ``register_timeout_seconds``, for
        relaunched workers) for workers to join and warm as spares, re-planning as they come."""
        group, o = self.group, self.opts
        limit = "capacity_timeout_seconds" if o.capacity_timeout_seconds else "register_timeout_seconds"
        timeout = getattr(o, limit)
        t0, deadline = time.time(), time.monotonic() + timeout
        facts = dataclasses.replace(facts, may_wait=True, wait_until=deadline, wait_limit=limit, wait_seconds=timeout)
        for w in plan.placement.members:
            if w in group.dead:
                group.relaunch(w)
        self.events.emit("capacity_wait", needed=o.min_slices, timeout_seconds=timeout)
        found: list[str] = []
        while plan.action is Action.WAIT:
            group.wait_for_newcomer(max(min(deadline - time.monotonic(), 0.5), 0.0))
            warmed = group.warm_newcomers(block_until=deadline)
            found += warmed
            p = plan.placement
            spares = tuple(s for s in p.spares if s not in group.dead) + tuple(warmed)
            facts = dataclasses.replace(facts, placement=dataclasses.replace(p, spares=spares),
                                        dead=frozenset(group.dead), spare_stages=self._spare_stages(spares),
                                        hosts={**facts.hosts, **{w: group.host_of(w) for w in warmed}})
            plan = plan_change(facts, time.monotonic())
            if plan.action is not Action.FAIL:
                self._decision(plan, self._dead(p))
        self.events.emit("capacity_wait_ended", seconds=time.time() - t0, found=found)
        return plan

    def _realign(self, plan: ChangePlan, old: Placement, replicas, started: float) -> None:
        """The survivors hold the state: fence them, commit what they all applied, roll back those ahead, copy."""
        s, group = self.state(), self.group
        new = plan.placement
        survivors = self._holders(new.active, replicas)
        statuses = group.abort(new.members)
        loss_workers = stage_groups(new.active, self.opts.pipeline_stages)[-1]   # (a pipeline's earlier stages: none)
        realign = plan_change(Facts(Change.REALIGN, placement=new, committed=s.committed,
                                    applied={w: statuses[w].applied_steps for w in survivors},
                                    losses={w: statuses[w].losses for w in survivors if w in loss_workers}))
        if realign.action is Action.FAIL:
            raise ReplicaDivergenceError("cannot realign the survivors", step=s.committed, cause=realign.reason)
        for w in realign.rollbacks:
            group.rollback(w, realign.target)
            self.events.emit("rolled_back", worker=w, to_step=realign.target)
        for step, loss_sum in realign.commits:
            self.record(step, new.epoch, loss_sum)
        source = plan.tier.source if plan.tier.source in survivors else survivors[0]
        moved = self.copies.copy_to_newcomers(source, realign.target, holders=survivors)
        self.copies.recheck_shadows(source)
        self._recovered(plan, self._dead(old), started, realign.target, moved, plan.tier.tier)

    def _restore(self, plan: ChangePlan, checkpoints: tuple[Holding, ...], old: Placement, started: float) -> None:
        """No replica is left: the newest snapshot or checkpoint comes back (to every active slice: loaded, or
        copied from the one that loaded it); training resumes at its step. ``checkpoints``: those the plan's
        facts listed."""
        if self.opts.pipeline_stages > 1:
            self._restore_stages(plan, checkpoints, old, started)
            return
        committed, new = self.state().committed, plan.placement
        statuses = self.group.abort(new.members)
        held = self.snapshots.holdings(statuses, committed)   # a spare's host may keep the copy
        facts = Facts(Change.RESTORE, placement=new, committed=committed,
                      snapshots=tuple(Holding(w, n) for w, n in held.items()), checkpoints=checkpoints)
        choice = plan_change(facts).tier
        got = None
        if choice.tier == "snapshot":
            try:
                got = self._load_snapshot(choice.source, choice.step)
            except ElasticError as e:   # its snapshots cannot be read: the checkpoint, if there is one
                self.events.emit("snapshot_unusable", worker=choice.source, error=str(e)[:300])
                choice = plan_change(dataclasses.replace(facts, snapshots=())).tier
        if got is None:
            if not choice.ok:
                raise StateLostError("cannot restore the state", step=committed, cause=choice.reason)
            got = self._load_checkpoint(new.active, choice.step)
        self._restored(plan, old, started, got)

    def _load_checkpoint(self, active, step: int) -> tuple:
        """Every active member loads the newest valid checkpoint at or before ``step`` (a pipelined run's: each
        its stage's): ``("checkpoint", step, bytes, holders)``."""
        loaded = self.checkpoints.load(active, step)
        if lost := [w for w in active if w not in loaded.bytes]:
            raise WorkerLostError(lost[0], "lost while loading a checkpoint")
        return "checkpoint", loaded.step, sum(loaded.bytes.values()), list(active)

    def _restored(self, plan: ChangePlan, old: Placement, started: float, got: tuple) -> None:
        """A restore loaded ``got`` (``(tier, step, bytes, holders)``): copies it to the active members that do not
        hold it (checking every hash; a pipelined run's: each stage's), records it; training resumes at its step."""
        committed = self.state().committed
        tier, step, nbytes, holders = got
        moved = nbytes + self.copies.copy_to_newcomers(holders[0], step, holders=holders)
        self.shadows.forget(list(self.shadows.at))   # caught up by a copy at the next boundary
        where = ({"directory": self.checkpoints.directory} if tier == "checkpoint" else
                 {"worker": holders[0], "host": self.group.host_of(holders[0])})
        self.events.emit(RESTORED_EVENT[tier], step=step, bytes=nbytes, steps_lost=committed - step, **where)
        self._recovered(plan, self._dead(old), started, step, moved, tier)

    def _restore_stages(self, plan: ChangePlan, checkpoints: tuple[Holding, ...], old: Placement,
                        started: float) -> None:
        """A pipelined run lost every copy of a stage: every stage restores the same step (a stage's state of
        another step does not fit the others'): its snapshot of the newest step all stages hold, else (none,
        or one that does not read) its checkpoint; the stages' other workers get copies. ``checkpoints``:
        those the plan's facts listed."""
        committed, new = self.state().committed, plan.placement
        groups = stage_groups(new.active, self.opts.pipeline_stages)
        for k, group in enumerate(groups):   # first: each lists the snapshots of its stage's directory
            for w in group:
                self.copies.take_stage(w, k)
        statuses = self.group.abort(new.members)
        got = self._stage_snapshots(groups, statuses, committed) if plan.tier.tier == "snapshot" else None
        if got is None:
            choice = choose_source({}, {}, (), checkpoints, committed)
            if not choice.ok:
                raise StateLostError("cannot restore the state", step=committed,
                                     cause=f"no snapshot of one step is held for every pipeline stage, and "
                                           f"{choice.reason}")
            got = self._load_checkpoint(new.active, choice.step)
        self._restored(plan, old, started, got)

    def _stage_snapshots(self, groups, statuses, committed: int) -> tuple | None:
        """Each stage loads its snapshot of the newest step every stage holds (one that does not read sends all
        back to an older common step): ``("snapshot", step, bytes, loaders)``, or None when no step is held
        by every stage (``snapshot_unusable``)."""
        held = [{w: statuses[w].snapshots for w in group if w in statuses} for group in groups]
        at_most = committed
        while True:
            found = stage_snapshot(held, at_most)
            if found is None:
                why = f"no snapshot of one step at or before {at_most} is held for every pipeline stage: {held}"
                self.events.emit("snapshot_unusable", worker=groups[0][0], error=why[:300])
                return None
            step, loaders = found
            replies = self.group.load_checkpoints(list(loaders), "", step, snapshot=True)
            if lost := [w for w in loaders if w not in replies]:
                raise WorkerLostError(lost[0], "lost while loading an in-memory snapshot")
            for w in loaders:
                for why in replies[w].skipped:
                    self.events.emit("checkpoint_skipped", worker=w, detail=why[:500])
            at_most = min(replies[w].applied_steps for w in loaders)
            if at_most == step:
                return "snapshot", step, sum(replies[w].bytes for w in loaders), list(loaders)

    def _load_snapshot(self, worker: str, step: int) -> tuple:
        replies = self.group.load_checkpoints([worker], "", step, snapshot=True)
        if not replies:
            raise WorkerLostError(worker, "lost while loading an in-memory snapshot")
        reply = replies[worker]
        for why in reply.skipped:
            self.events.emit("checkpoint_skipped", worker=worker, detail=why[:500])
        return "snapshot", reply.applied_steps, reply.bytes, [worker]

    # -- at a step boundary --------------------------------------------------------

    def grow(self) -> None:
        """Promotes spares while fewer slices run than asked for (``GROW``)."""
        s = self.state()
        plan = plan_change(Facts(Change.GROW, placement=s.placement, slices=self.opts.slices,
                                 stages=self.opts.pipeline_stages, spare_stages=self._spare_stages(s.placement.spares)))
        if plan.placement is not None:
            self._remap(plan, "grown")

    def swap(self, slow: str) -> None:
        """Moves straggler ``slow``'s slice onto a spare (``SWAP``) and sends it home; or says why it stays."""
        plan = plan_change(Facts(Change.SWAP, placement=self.state().placement, slow=slow))
        if plan.placement is None:
            self.events.emit("straggler_kept", worker=slow, reason=plan.reason)
            return
        self._remap(plan, "straggler_replaced", slow=slow)
        self.group.shutdown(slow)

    def _remap(self, plan: ChangePlan, kind: str, **fields) -> None:
        """A planned change at a step boundary: fence, copy the state to the newcomers, check, record."""
        s = self.state()
        old, new = s.placement, plan.placement
        promoted = [w for w in new.active if w not in old.active]
        source = next(w for w in old.active if w in s.replicas and w in new.active)
        self.events.emit("placement_changed", epoch=new.epoch, active=list(new.active), spares=list(new.spares),
                         why=plan.change.value)
        self._adopt(new)
        self.shadows.forget(new.active)
        self.group.abort(new.members)
        moved = self.copies.copy_to_newcomers(source, s.committed, holders=[w for w in new.active if w in s.replicas])
        self.events.emit(kind, epoch=new.epoch, promoted=promoted, active=list(new.active), spares=list(new.spares),
                         bytes_moved=moved, step=s.committed, **fields)

    def _adopt(self, placement: Placement) -> None:
        self.group.fence_at(placement.epoch)
