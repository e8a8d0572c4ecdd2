"""Every membership change of a run, as one pure decision: ``plan_change(facts, now) -> ChangePlan``.

A run's membership changes in five ways (:class:`Change`), and each is a
case of :func:`plan_change`:

- ``START``: the first placement, from the workers that registered
  (:func:`decide_start`);
- ``RECOVER``: a step failed or a member was lost: replace, shrink, retry,
  wait for capacity, restore a backup, or fail (:func:`decide_recovery`),
  with the restore tier chosen over all four tiers at once
  (:func:`runtime.control.tiers.choose_source`, one :class:`~runtime.control.tiers.TierChoice`)
  and the dead relaunched now (no state yet) or after the next commit;
- ``RESTORE``: no replica was left and every member is fenced: the tier again,
  from what the members' hosts answered they hold;
- ``REALIGN``: the survivors, fenced, answered their applied steps: commit the
  steps they all applied, roll back those one ahead (:func:`plan_realign`);
- ``GROW`` and ``SWAP``: at a step boundary, spares are promoted, or a
  straggler's slice moves onto one (:func:`decide_grow`, :func:`decide_swap`).

A pipelined run's changes keep each slice's stage and ask per stage
(:mod:`runtime.control.stage_plan`).

:mod:`runtime.control.membership` carries a plan out. Nothing here reads a clock, a
socket or a file: the time is passed in (``now``: a wait for capacity past
its deadline becomes a ``FAIL``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping

from runtime.control.policy import Placement, WorkerInfo, place
from runtime.control.stage_plan import (arrange_stages, copy_source, fill_slots, grow_replicas,
                                        stage_without_replica, unmatched_stages)
from runtime.control.tiers import Holding, TierChoice, choose_source

__all__ = ["Action", "Change", "ChangePlan", "Facts", "Failure", "RealignPlan", "RecoveryDecision",
           "capacity_timed_out", "decide_grow", "decide_recovery", "decide_start", "decide_swap",
           "membership_change_due", "plan_change", "plan_realign"]


# -- recovery ----------------------------------------------------------------


class Action(enum.Enum):
    """What a recovery does."""

    REPLACE = "replace"   # every lost slice got a spare; the spares receive the state
    SHRINK = "shrink"     # some slices were dropped; the survivors take their microbatches
    RETRY = "retry"       # no one died (a transient error): re-run the step in a new epoch
    WAIT = "wait"         # below the minimum, but capacity may still arrive
    RESTORE = "restore"   # no replica is left: the newest complete snapshot or checkpoint comes back
    FAIL = "fail"         # nothing applies: the run ends (the decision's ``failure`` says which error)
    GROW = "grow"         # at a boundary: spares promoted back to the run's slice count
    SWAP = "swap"         # at a boundary: a straggler's slice moved onto a spare


class Failure(enum.Enum):
    """Why a ``FAIL`` ends the run: ``CAPACITY`` raises ``CapacityExhaustedError``, ``STATE_LOST``
    ``StateLostError``, ``DEVICES`` ``DeviceMismatchError`` (:mod:`runtime.core.errors`;
    :func:`runtime.control.membership.failed` maps them)."""

    CAPACITY = "capacity"       # too few workers: no spare, below the minimum, recoveries used up
    STATE_LOST = "state_lost"   # and no copy of the state is left, in a replica or a backup
    DEVICES = "devices"         # workers joined, but with another device count than a slice's


@dataclasses.dataclass(frozen=True)
class RecoveryDecision:
    """The answer of :func:`decide_recovery`: the action, the placement to adopt and why (``failure``: for a
    ``FAIL``, which kind; None for every other action).

    ``reason`` speaks the runtime's own terms (``ControllerOptions`` field names, never a config key);
    ``limit`` names the ``ControllerOptions`` field whose value decided a ``WAIT`` or ``FAIL``
    (``max_retries``, ``min_slices``, ``capacity_timeout_seconds``, ``register_timeout_seconds``; "" when
    none did), for a caller that speaks another vocabulary (``elastic.options.in_config_terms``)."""

    action: Action
    placement: Placement
    reason: str
    failure: Failure | None = None
    limit: str = ""



NO_REPLICA = ("no live replica of the state is left and no complete snapshot or checkpoint to restore "
              "(snapshot_interval keeps in-memory snapshots; checkpoint_period keeps checkpoints)")

def decide_recovery(placement: Placement, dead: Iterable[str], replicas: Iterable[str], *, min_slices: int,
                    recoveries: int, max_retries: int, may_wait: bool = False,
                    checkpoint_step: int | None = None, backup: str = "checkpoint",
                    stages: int = 1, spare_stages: Mapping[str, int] | None = None) -> RecoveryDecision:
    """Replace dead active slices with live spares; else shrink down to ``min_slices``; else wait or fail.

    ``replicas``: the workers known to hold the state at the committed
    frontier: active ones, and spares that shadow it (these are promoted
    first). A survivor that is not one (a spare promoted in an earlier
    attempt whose copy never finished) keeps its slice but cannot supply
    the state; with no replica in the new placement the answer is ``RESTORE`` when a
    complete checkpoint exists (``checkpoint_step``: its step, None when
    there is none) and at least ``min_slices`` slices have a worker (else
    ``WAIT`` for capacity, when it may come), otherwise ``FAIL``. ``backup``:
    what holds that step ("checkpoint" or "snapshot"), for the reason.
    ``stages``: a pipelined run's stages (the active slices are stage-major,
    :func:`runtime.control.policy.stage_groups`): each stage holds its own
    state, so each must keep a replica, and a replacement takes the lost
    slice's stage, a spare that shadows that stage first (``spare_stages``:
    the stage each spare's programs are for); with too few workers whole
    pipeline replicas are dropped (:func:`runtime.control.stage_plan.fill_slots`).
    ``recoveries``: attempts so far including this one; past ``max_retries``
    the answer is ``FAIL``. ``may_wait``: capacity may still
    arrive (a relaunched or joining worker), so being below the minimum
    answers ``WAIT`` (with the unchanged placement) instead of ``FAIL``.
    """
    dead, replicas = frozenset(dead), frozenset(replicas)
    if recoveries > max_retries:
        if max_retries == 0:
            return RecoveryDecision(Action.FAIL, placement, "recovery is off (max_retries=0): a lost worker ends "
                                                            "the run", failure=Failure.CAPACITY, limit="max_retries")
        return RecoveryDecision(Action.FAIL, placement, f"gave up after {max_retries} recoveries (max_retries)",
                                failure=Failure.CAPACITY, limit="max_retries")
    slots, spares, dropped = fill_slots(placement, dead, replicas, stages, spare_stages or {})
    active = [w for w in slots if w is not None]
    replaced = sum(w not in placement.active for w in active)
    new = Placement(epoch=placement.epoch + 1, active=tuple(active), spares=tuple(spares))
    survivors = [w for w in placement.active if w not in dead]
    lost_state = ("" if any(w in replicas for w in active) else "every active slice is gone" if not survivors else
                  "the surviving slices hold no copy of the state")
    if stages > 1 and not lost_state:
        lost_state = stage_without_replica(placement, dead, replicas, stages, spare_stages or {})
    if lost_state and checkpoint_step is None:
        return RecoveryDecision(Action.FAIL, new, f"{lost_state}: {NO_REPLICA}", failure=Failure.STATE_LOST)
    if lost_state:
        if len(active) >= min_slices:
            return RecoveryDecision(Action.RESTORE, new, f"{lost_state}: {len(active)} slice(s) restore the "
                                                         f"{backup} of step {checkpoint_step}")
        if may_wait:
            return RecoveryDecision(Action.WAIT, placement, f"{lost_state} and {len(active)} slices have a worker "
                                                            f"(min_slices {min_slices}): waiting for "
                                                            f"capacity to restore step {checkpoint_step}",
                                    limit="min_slices")
        return RecoveryDecision(Action.FAIL, new, f"{lost_state}, a {backup} of step {checkpoint_step} exists but "
                                                  f"no worker is left to restore it", failure=Failure.CAPACITY,
                                    limit="min_slices")
    if len(active) < min_slices:
        if may_wait:
            return RecoveryDecision(Action.WAIT, placement, f"{len(active)} slices left, min_slices "
                                                            f"is {min_slices}: waiting for capacity",
                                    limit="min_slices")
        return RecoveryDecision(Action.FAIL, new, f"{len(active)} slices left, min_slices is "
                                                  f"{min_slices} and no spare is available", failure=Failure.CAPACITY,
                                limit="min_slices")
    if dropped and stages > 1:
        return RecoveryDecision(Action.SHRINK, new, f"too few workers for every pipeline replica: "
                                                    f"{dropped // stages} dropped, {len(active) // stages} "
                                                    f"take over their microbatches")
    if dropped:
        return RecoveryDecision(Action.SHRINK, new, f"no spare for {dropped} slice(s): {len(active)} survivors "
                                                    f"take over")
    if replaced:
        return RecoveryDecision(Action.REPLACE, new, "spares replace the lost slices")
    return RecoveryDecision(Action.RETRY, new, "no worker was lost; re-run the step")


def decide_start(num_vslices: int, devices_per_slice: int, workers: Iterable[WorkerInfo], *,
                 lost: Iterable[str], min_slices: int) -> RecoveryDecision:
    """The first placement, from the workers that registered; ``lost``: launched workers that died first.

    A worker that registered and then died is in both: it is lost, never
    placed. ``REPLACE`` when every slice has a worker (nothing lost, or the others
    covered the lost ones), ``SHRINK`` when fewer fit but at least
    ``min_slices`` (the run grows back when capacity returns), ``FAIL``
    (with the shortfall) otherwise: ``Failure.DEVICES`` when workers that do
    not fit a slice registered (the reason names them and their devices),
    else ``Failure.CAPACITY``.
    """
    lost = sorted(lost)
    alive = [w for w in workers if w.worker_id not in lost]
    try:
        placement = place(num_vslices, devices_per_slice, alive, min_slices=min_slices)
    except ValueError as e:
        why = f"; {len(lost)} worker(s) died before registering" if lost else ""
        if any(w.num_devices != devices_per_slice for w in alive):
            need = min(min_slices, num_vslices)
            return RecoveryDecision(Action.FAIL, Placement(1, ()), f"{_misfits(alive, devices_per_slice, need)}{why}",
                                    failure=Failure.DEVICES)
        return RecoveryDecision(Action.FAIL, Placement(1, ()), f"{e}{why}", failure=Failure.CAPACITY)
    if len(placement.active) < num_vslices:
        return RecoveryDecision(Action.SHRINK, placement, f"{len(lost)} worker(s) died before registering: "
                                                          f"starting with {len(placement.active)} of "
                                                          f"{num_vslices} slices")
    return RecoveryDecision(Action.REPLACE, placement, "every slice has a worker" + (
        f" ({len(lost)} that died before registering were replaced)" if lost else ""))


def _misfits(workers: list[WorkerInfo], devices_per_slice: int, need: int, named: int = 3) -> str:
    """Why the workers that joined fit no slice: how many devices a slice needs, which workers (the first
    ``named``) have how many, and how a worker is started to fit (``need``: the fitting workers needed)."""
    misfits = sorted((w for w in workers if w.num_devices != devices_per_slice), key=lambda w: w.worker_id)
    fit = len(workers) - len(misfits)
    text = (f"a slice needs {devices_per_slice} devices and {fit} of the {need} workers needed have them: "
            + ", ".join(f"worker {w.worker_id} has {w.num_devices} {w.platform} device(s)" for w in misfits[:named]))
    if len(misfits) > named:
        text += f", and {len(misfits) - named} more"
    if any(w.platform == "cpu" for w in misfits):
        return text + f"; start each CPU worker with `elastic worker --devices {devices_per_slice}`"
    return text + f"; start workers where JAX finds {devices_per_slice} devices each"


def capacity_timed_out(decision: RecoveryDecision, timeout_seconds: float,
                       limit: str = "capacity_timeout_seconds") -> RecoveryDecision:
    """A ``WAIT`` whose capacity never came: the ``FAIL`` that replaces it, naming the option that set the
    wait (``limit``: ``capacity_timeout_seconds``, or ``register_timeout_seconds`` when that one applied)."""
    return RecoveryDecision(Action.FAIL, decision.placement,
                            f"{decision.reason.split(':')[0]}: no capacity arrived within "
                            f"{limit}={timeout_seconds:g}", failure=Failure.CAPACITY, limit=limit)



@dataclasses.dataclass(frozen=True)
class RealignPlan:
    """How survivors are brought to one step after a failure.

    ``target``: the step every survivor will have applied (training resumes
    there). ``commits``: ``(step, loss_sum)`` of steps every survivor applied
    but the controller had not committed yet; they are committed now from
    the survivors' recorded losses. ``rollbacks``: survivors one step ahead,
    to roll back to ``target``. ``error``: non-empty when the survivors
    cannot be reconciled (the run must fail).
    """

    target: int
    commits: tuple[tuple[int, float], ...] = ()
    rollbacks: tuple[str, ...] = ()
    error: str = ""


def plan_realign(applied: Mapping[str, int], losses: Mapping[str, Mapping[int, float]],
                 committed: int) -> RealignPlan:
    """Reconciles survivors that differ by at most one applied step.

    A step applies only once every rank finished its reduce-scatter, so live
    replicas are at most one step apart (in a pipelined run too: a stage applies
    a step only after every later stage sent it that step's gradients).
    ``applied``: each survivor's applied step count; ``losses``: the recent
    ``{step: loss_sum}`` of the survivors that compute the loss (every one, or a
    pipelined run's last stage);
    ``committed``: steps the controller committed. Steps all survivors
    applied are committed (their loss sums must agree); those ahead roll back.
    """
    target = min(applied.values())
    if target < committed or max(applied.values()) > target + 1:
        return RealignPlan(target, error=f"replicas are out of step: applied {dict(applied)}, "
                                         f"{committed} committed")
    commits = []
    for step in range(committed, target):
        sums = {losses[w].get(step) for w in losses}
        if len(sums) != 1 or None in sums:
            return RealignPlan(target, error=f"no agreed loss for applied step {step}: {sorted(map(str, sums))}")
        commits.append((step, sums.pop()))
    return RealignPlan(target, tuple(commits), tuple(sorted(w for w, a in applied.items() if a == target + 1)))


# -- membership at a step boundary --------------------------------------------


def membership_change_due(placement: Placement, slices: int, dead: Iterable[str], *, unadopted: bool,
                          warmed: bool, swaps: bool, stages: int = 1) -> bool:
    """Whether the next step boundary has work: a worker to adopt or promote, a dead spare, a straggler to swap.

    ``unadopted``: a worker registered that the controller has not taken on;
    ``warmed``: a joining worker finished loading its programs; ``swaps``: a
    straggler waits to be moved onto a spare; ``stages``: a pipelined run
    grows by a spare per stage.
    """
    dead = frozenset(dead)
    return (unadopted or warmed or swaps or any(s in dead for s in placement.spares)
            or (len(placement.active) < slices and len(placement.spares) >= stages))


def decide_grow(placement: Placement, slices: int, stages: int = 1,
                spare_stages: Mapping[str, int] | None = None) -> Placement | None:
    """Promotes spares while fewer than ``slices`` run; None when nothing changes. A pipelined run grows by whole
    pipeline replicas, a spare per stage (one whose programs are that stage's first: ``spare_stages``)."""
    missing = slices - len(placement.active)
    if missing <= 0 or len(placement.spares) < stages:
        return None
    if stages > 1:
        return grow_replicas(placement, missing, stages, spare_stages or {})
    take = placement.spares[:missing]
    return Placement(epoch=placement.epoch + 1, active=placement.active + take, spares=placement.spares[len(take):])


def decide_swap(placement: Placement, slow: str) -> Placement | None:
    """Moves ``slow``'s virtual slice onto the first spare (a straggler replaced); None without a spare.

    The slow worker leaves the placement: a host known to be slow is not kept
    as a spare.
    """
    if slow not in placement.active or not placement.spares:
        return None
    active = tuple(placement.spares[0] if w == slow else w for w in placement.active)
    return Placement(epoch=placement.epoch + 1, active=active, spares=placement.spares[1:])


# -- one membership change -----------------------------------------------------


class Change(enum.Enum):
    """Which membership change a :class:`Facts` asks about (see the module docstring)."""

    START = "start"
    RECOVER = "recover"
    RESTORE = "restore"
    REALIGN = "realign"
    GROW = "grow"
    SWAP = "swap"


@dataclasses.dataclass(frozen=True)
class Facts:
    """What :func:`plan_change` decides from: the case, the run's state and the limits; each case reads its own.

    ``replicas``: the workers known to hold the committed state (active ones, and spares that shadow it);
    ``snapshots`` and ``checkpoints``: the complete backups known, as :class:`~runtime.control.tiers.Holding`;
    ``has_state``: False while the run starts (no state yet: the dead are relaunched at once, nothing is
    restored); ``wait_until``: the deadline (in ``now``'s clock) of a wait for capacity, with the option that
    set it (``wait_limit``, ``wait_seconds``). ``workers`` and ``lost``: the registered and the lost (START);
    ``applied`` and ``losses``: each fenced survivor's applied steps and recent loss sums (REALIGN);
    ``slow``: the straggler (SWAP); ``stages``: a pipelined run's stages (RECOVER: each must keep a replica),
    ``spare_stages`` the stage each spare's programs are for (a shadow spare shadows that stage);
    ``backup_hosts``: a pipelined run's, for each stage, the hosts holding its snapshot a restore would take,
    and ``hosts``: each member's host (a restore then gives each stage a worker on such a host:
    :func:`arrange_stages`).
    """

    change: Change
    placement: Placement | None = None
    committed: int = 0
    dead: frozenset[str] = frozenset()
    replicas: frozenset[str] = frozenset()
    snapshots: tuple[Holding, ...] = ()
    checkpoints: tuple[Holding, ...] = ()
    recoveries: int = 0
    slices: int = 1
    devices_per_slice: int = 1
    min_slices: int = 1
    max_retries: int = 0
    may_wait: bool = False
    has_state: bool = True
    wait_until: float | None = None
    wait_limit: str = "capacity_timeout_seconds"
    wait_seconds: float = 0.0
    workers: tuple[WorkerInfo, ...] = ()
    lost: tuple[str, ...] = ()
    applied: Mapping[str, int] = dataclasses.field(default_factory=dict)
    losses: Mapping[str, Mapping[int, float]] = dataclasses.field(default_factory=dict)
    slow: str = ""
    stages: int = 1
    spare_stages: Mapping[str, int] = dataclasses.field(default_factory=dict)
    backup_hosts: tuple[frozenset[str], ...] = ()
    hosts: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ChangePlan:
    """What to do: the ``action``, the ``placement`` to adopt (None: it stays), why, where the state comes from
    (``tier``, None when nothing is copied or restored), whom to relaunch at once and after the next commit,
    and for a REALIGN the step to resume at (``target``), the steps to commit from the survivors' losses
    (``commits``) and the survivors to roll back. ``failure`` and ``limit``: as in :class:`RecoveryDecision`."""

    change: Change
    action: Action | None
    placement: Placement | None
    reason: str
    tier: TierChoice | None = None
    relaunch_now: tuple[str, ...] = ()
    relaunch_later: tuple[str, ...] = ()
    target: int = 0
    commits: tuple[tuple[int, float], ...] = ()
    rollbacks: tuple[str, ...] = ()
    failure: Failure | None = None
    limit: str = ""

    @property
    def decision(self) -> RecoveryDecision:
        """The recovery decision this plan carries (what ``recovery_decision`` records and a ``FAIL`` raises)."""
        return RecoveryDecision(self.action, self.placement, self.reason, self.failure, self.limit)


def plan_change(facts: Facts, now: float = 0.0) -> ChangePlan:
    """The plan for one membership change (see the module docstring for the cases)."""
    return _PLANNERS[facts.change](facts, now)


def _from(change: Change, d: RecoveryDecision, **fields) -> ChangePlan:
    return ChangePlan(change, d.action, d.placement, d.reason, failure=d.failure, limit=d.limit, **fields)


def _plan_start(f: Facts, now: float) -> ChangePlan:
    return _from(Change.START, decide_start(f.slices, f.devices_per_slice, f.workers, lost=f.lost,
                                            min_slices=f.min_slices))


def _backup(f: Facts) -> TierChoice:
    """The newest backup (snapshot or checkpoint) a restore would use, by the one tier rule."""
    return choose_source({}, {}, f.snapshots, f.checkpoints, f.committed)


def _plan_recover(f: Facts, now: float) -> ChangePlan:
    old = f.placement
    backup = _backup(f) if f.has_state else None
    dead = sorted(w for w in old.members if w in f.dead)
    d = decide_recovery(old, dead, f.replicas, min_slices=f.min_slices, recoveries=f.recoveries,
                        max_retries=f.max_retries, may_wait=f.may_wait,
                        checkpoint_step=backup.step if backup and backup.ok else None,
                        backup=backup.tier if backup and backup.ok else "checkpoint", stages=f.stages,
                        spare_stages=f.spare_stages)
    if d.action is Action.WAIT and f.wait_until is not None and now >= f.wait_until:
        d = capacity_timed_out(d, f.wait_seconds, f.wait_limit)
    if not f.has_state:   # nothing to copy: every live member counts as a replica; the dead start again now
        return _from(Change.RECOVER, d, relaunch_now=tuple(dead))
    tier = None
    if d.action in (Action.REPLACE, Action.SHRINK, Action.RETRY):
        tier = copy_source(d.placement.active, old.active, f.stages, f.replicas, f.spare_stages, f.committed)
    elif d.action is Action.RESTORE:
        tier = backup
        if f.stages > 1 and f.backup_hosts:
            d = dataclasses.replace(d, placement=arrange_stages(d.placement, f.stages, f.backup_hosts, f.hosts))
            missing = unmatched_stages(d.placement, f.stages, f.backup_hosts, f.hosts)
            if missing and f.may_wait and (f.wait_until is None or now < f.wait_until):
                d = RecoveryDecision(Action.WAIT, old, f"{d.reason.split(':')[0]}: waiting for a worker on a host "
                                                       f"holding the snapshot of stage {missing[0]}",
                                     limit="min_slices")
                return _from(Change.RECOVER, d, relaunch_later=tuple(dead))
    return _from(Change.RECOVER, d, tier=tier, relaunch_later=tuple(dead))


def _plan_restore(f: Facts, now: float) -> ChangePlan:
    tier = _backup(f)
    if not tier.ok:
        return ChangePlan(Change.RESTORE, Action.FAIL, f.placement, tier.reason, tier=tier,
                          failure=Failure.STATE_LOST)
    return ChangePlan(Change.RESTORE, Action.RESTORE, f.placement, tier.reason, tier=tier)


def _plan_realign(f: Facts, now: float) -> ChangePlan:
    r = plan_realign(f.applied, f.losses, f.committed)
    if r.error:
        return ChangePlan(Change.REALIGN, Action.FAIL, f.placement, r.error, target=r.target)
    return ChangePlan(Change.REALIGN, None, f.placement, f"resume at step {r.target}", target=r.target,
                      commits=r.commits, rollbacks=r.rollbacks)


def _plan_grow(f: Facts, now: float) -> ChangePlan:
    grown = decide_grow(f.placement, f.slices, f.stages, f.spare_stages)
    if grown is None:
        return ChangePlan(Change.GROW, None, None, f"{len(f.placement.active)} of {f.slices} slices run "
                                                   f"and {len(f.placement.spares)} spare(s) wait")
    promoted = [w for w in grown.active if w not in f.placement.active]
    return ChangePlan(Change.GROW, Action.GROW, grown, f"spares {', '.join(promoted)} promoted")


def _plan_swap(f: Facts, now: float) -> ChangePlan:
    swapped = decide_swap(f.placement, f.slow)
    if swapped is None:
        why = "it no longer runs a slice" if f.slow not in f.placement.active else "no spare to move it onto"
        return ChangePlan(Change.SWAP, None, None, why)
    spare = swapped.active[f.placement.active.index(f.slow)]
    return ChangePlan(Change.SWAP, Action.SWAP, swapped, f"{f.slow}'s slice moves to {spare}")


_PLANNERS = {Change.START: _plan_start, Change.RECOVER: _plan_recover, Change.RESTORE: _plan_restore,
             Change.REALIGN: _plan_realign, Change.GROW: _plan_grow, Change.SWAP: _plan_swap}
