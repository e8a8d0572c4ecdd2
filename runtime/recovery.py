"""Recovery after a failed step, up to the point where the survivors agree.

Called by the controller in its ``recovering`` phase. One attempt:

1. abandon the steps in flight and probe every member in parallel (a worker
   that does not answer is declared dead);
2. ask :func:`runtime.policy.decide_recovery` (replace, shrink, retry,
   wait for capacity, or fail);
3. fence every member of the new placement into the new epoch (``Abort``)
   and reconcile the survivors with :func:`runtime.policy.plan_realign`,
   rolling back those one step ahead.

:meth:`Recovery.decide` answers the decision (the controller adopts its
placement at once); :meth:`Recovery.realign` answers a
:class:`~runtime.policy.RealignPlan`: the step to resume at and the steps to
commit from the survivors' recorded losses. It records no step and notifies
no observer; the controller does both, then copies the state to the
newcomers. A failure inside an attempt propagates as its typed error
(the controller starts another attempt); giving up raises a typed
``ElasticTrainingFailedError``: ``CapacityExhaustedError`` (``StateLostError``
when no copy of the state is left), ``ReplicaDivergenceError`` when the
survivors cannot be reconciled.
"""

from __future__ import annotations

import dataclasses
import time

from runtime.errors import CapacityExhaustedError, ElasticError, ReplicaDivergenceError, StateLostError, \
    WorkerLostError
from runtime.policy import Action, Failure, Placement, RealignPlan, RecoveryDecision, capacity_timed_out, \
    decide_recovery, plan_realign
from runtime.tiers import choose_source

__all__ = ["Recovery", "Restore", "failed"]


def failed(decision: RecoveryDecision, message: str, step: int | None = None) -> CapacityExhaustedError:
    """The error that ends the run for a ``FAIL`` decision, by its typed ``failure`` (never by the reason's
    text): ``StateLostError`` when no copy of the state is left, else ``CapacityExhaustedError``."""
    kind = StateLostError if decision.failure is Failure.STATE_LOST else CapacityExhaustedError
    return kind(message, step=step, cause=decision.reason)


@dataclasses.dataclass(frozen=True)
class Restore:
    """What :meth:`Recovery.restore` brought back: the ``tier`` ("snapshot" or "checkpoint"), the ``step`` it
    holds, the ``bytes`` read, the members that hold it now (``holders``; the active others get a copy) and,
    for a checkpoint, its ``directory``."""

    tier: str
    step: int
    bytes: int
    holders: tuple[str, ...]
    directory: str


class Recovery:
    """Carries out a recovery attempt through a worker group, in two calls (see the module docstring).

    The controller calls :meth:`decide`, adopts the placement it answers
    (so a retry after a failed attempt starts from it, in a newer epoch),
    then calls :meth:`realign`. ``opts``: the run's ``ControllerOptions``
    (``min_slices``, ``max_retries``, ``capacity_timeout_seconds``);
    ``checkpoints``: the run's :class:`runtime.checkpointing.Checkpointing`
    (the persistent tier) and ``snapshots`` its
    :class:`runtime.snapshotting.Snapshotting` (the in-memory one), used
    when no replica is left.
    """

    def __init__(self, group, opts, events, checkpoints, snapshots):
        self.group, self.opts, self.events = group, opts, events
        self.checkpoints, self.snapshots = checkpoints, snapshots
        self.deferred: list[str] = []   # dead workers whose replacement starts after the next commit
        self.checkpoint: int | None = None   # the checkpoint step the last decision may restore (None: none)
        self.snapshot: int | None = None     # the newest snapshot step known held somewhere (None: none)

    def decide(self, err: Exception, placement: Placement, replicas: frozenset[str], committed: int,
               recoveries: int) -> tuple[RecoveryDecision, float]:
        """Abandons the steps in flight, probes every member, asks the policy; returns ``(decision, wall start)``.

        Waits for capacity when the policy says so; raises
        ``CapacityExhaustedError`` (``StateLostError`` with no copy of the state left) when it says fail.
        """
        started = time.time()
        group = self.group
        group.cancel_inflight()
        self.events.emit("failure_detected", error=type(err).__name__, detail=str(err)[:500],
                         worker=getattr(err, "worker_id", None), committed=committed)
        members = [w for w in placement.members if w not in group.dead]
        for w, alive in group.probe(members).items():
            if not alive:
                group.declare_dead(w, f"no answer after {type(err).__name__}")
        # The store is listed only when it may be needed (no live replica left): a gs:// listing is a network
        # round trip, kept off the ordinary recoveries.
        live_replica = any(w in replicas and w not in group.dead for w in placement.active)
        self.checkpoint = None if live_replica else self.checkpoints.newest(committed)
        self.snapshot = None if live_replica else self.snapshots.newest(committed)
        # Capacity may come: a worker may join within capacity_timeout_seconds, and with every replica lost the
        # relaunched workers are waited for (they restore a snapshot left on their host, or the checkpoint)
        # rather than the run given up.
        may_wait = self.opts.capacity_timeout_seconds > 0 or (self._backup()[0] is not None and self.opts.relaunch)
        decision = self._decide(placement, replicas, recoveries, may_wait=may_wait)
        if decision.action is Action.WAIT:
            decision = self._wait_for_capacity(decision, replicas, recoveries)
        if decision.action is Action.FAIL:
            raise failed(decision, "cannot recover", step=committed)
        return decision, started

    def realign(self, old: Placement, new: Placement, replicas: frozenset[str], committed: int) -> RealignPlan:
        """Relaunches the dead, fences every member of ``new`` into its epoch, rolls back survivors one step ahead.

        Returns the plan: the step to resume at and the steps to commit from
        the survivors' recorded losses (the caller records them).
        """
        group = self.group
        # Replacements start after the next commit: their start-up (program load) would compete for this
        # host with the step that recovers, which is on the critical path; a spare is not.
        self.deferred += self.retire_dead(old, relaunch=False)
        survivors = [w for w in new.active if w in replicas]
        statuses = group.abort(new.members)
        plan = plan_realign({w: statuses[w].applied_steps for w in survivors},
                            {w: statuses[w].losses for w in survivors}, committed)
        if plan.error:
            raise ReplicaDivergenceError("cannot realign the survivors", step=committed, cause=plan.error)
        for w in plan.rollbacks:
            group.rollback(w, plan.target)
            self.events.emit("rolled_back", worker=w, to_step=plan.target)
        return plan

    def retire_dead(self, old: Placement, relaunch: bool = True) -> list[str]:
        """Stops watching the dead members of ``old`` and relaunches each once (within limits); returns them sorted.

        ``relaunch=False``: the caller relaunches them later (:meth:`relaunch_deferred`).
        """
        dead = sorted(w for w in old.members if w in self.group.dead)
        for w in dead:
            self.group.forget(w)
            if relaunch:
                self.group.relaunch(w)
        return dead

    def restore(self, old: Placement, new: Placement, committed: int) -> Restore:
        """No replica is left: the state comes back from the newest snapshot or checkpoint at or before
        ``committed`` (:func:`runtime.tiers.choose_source`); answers what was loaded, by whom.

        The dead are retired (relaunched after the next commit) and every
        member is fenced into the new epoch first; each answers the
        snapshots its host holds. A snapshot is loaded by one member whose
        host holds it (the caller copies it to the active members); when it
        cannot be loaded, the checkpoint is. A checkpoint is loaded by every
        active member. A member lost meanwhile raises ``WorkerLostError``
        (the controller starts another attempt).
        """
        self.deferred += self.retire_dead(old, relaunch=False)
        statuses = self.group.abort(new.members)
        held = self.snapshots.holdings(statuses, committed)   # a spare's host may keep the copy
        checkpoint = {self.checkpoints.directory: self.checkpoint} if self.checkpoint is not None else {}
        choice = choose_source({}, {}, held, checkpoint, committed)
        if choice.tier == "snapshot":
            try:
                replies = self.group.load_checkpoints([choice.source], "", choice.step, snapshot=True)
            except ElasticError as e:   # its snapshots cannot be read: the checkpoint, if there is one
                self.events.emit("snapshot_unusable", worker=choice.source, error=str(e)[:300])
                choice = choose_source({}, {}, {}, checkpoint, committed)
            else:
                if not replies:
                    raise WorkerLostError(choice.source, "lost while loading an in-memory snapshot")
                reply = replies[choice.source]
                for why in reply.skipped:
                    self.events.emit("checkpoint_skipped", worker=choice.source, detail=why[:500])
                return Restore("snapshot", reply.applied_steps, reply.bytes, (choice.source,), "")
        if not choice.ok:
            raise StateLostError("cannot restore the state", step=committed, cause=choice.reason)
        loaded = self.checkpoints.load(new.active, self.checkpoint)
        if lost := [w for w in new.active if w not in loaded.bytes]:
            raise WorkerLostError(lost[0], "lost while loading a checkpoint")
        return Restore("checkpoint", loaded.step, sum(loaded.bytes.values()), tuple(new.active),
                       self.checkpoints.directory)

    def _backup(self) -> tuple[int | None, str]:
        """The newest step a snapshot or checkpoint holds (a snapshot on a tie: cheaper to read), and which."""
        if self.snapshot is not None and (self.checkpoint is None or self.snapshot >= self.checkpoint):
            return self.snapshot, "snapshot"
        return self.checkpoint, "checkpoint"

    def relaunch_deferred(self) -> None:
        """Relaunches the dead workers :meth:`realign` left for after the first commit (each once, within limits)."""
        deferred, self.deferred = self.deferred, []
        for w in deferred:
            self.group.relaunch(w)

    def _decide(self, placement: Placement, replicas, recoveries: int, may_wait: bool) -> RecoveryDecision:
        dead = sorted(w for w in placement.members if w in self.group.dead)
        step, backup = self._backup()
        decision = decide_recovery(placement, dead, replicas, min_slices=self.opts.min_slices,
                                   recoveries=recoveries, max_retries=self.opts.max_retries, may_wait=may_wait,
                                   checkpoint_step=step, backup=backup)
        self.events.emit("recovery_decision", action=decision.action.value, reason=decision.reason, dead=dead,
                         epoch=decision.placement.epoch, active=list(decision.placement.active),
                         spares=list(decision.placement.spares))
        return decision

    def _wait_for_capacity(self, decision: RecoveryDecision, replicas, recoveries: int) -> RecoveryDecision:
        """Below ``min_slices``: waits up to ``capacity_timeout_seconds`` (else ``register_timeout_seconds``, for
        relaunched workers) for workers to join and warm as spares."""
        group = self.group
        limit = "capacity_timeout_seconds" if self.opts.capacity_timeout_seconds else "register_timeout_seconds"
        timeout = getattr(self.opts, limit)
        t0, deadline = time.time(), time.monotonic() + timeout
        for w in decision.placement.members:
            if w in group.dead:
                group.relaunch(w)
        self.events.emit("capacity_wait", needed=self.opts.min_slices, timeout_seconds=timeout)
        found: list[str] = []
        while decision.action is Action.WAIT:
            left = deadline - time.monotonic()
            if left <= 0:
                self.events.emit("capacity_wait_ended", seconds=time.time() - t0, found=found)
                return capacity_timed_out(decision, timeout, limit)
            group.wait_for_newcomer(min(left, 0.5))
            warmed = group.warm_newcomers(block_until=deadline)
            found += warmed
            placement = decision.placement
            spares = tuple(s for s in placement.spares if s not in group.dead) + tuple(warmed)
            decision = self._decide(dataclasses.replace(placement, spares=spares), replicas, recoveries, True)
        self.events.emit("capacity_wait_ended", seconds=time.time() - t0, found=found)
        return decision
