"""Every membership change of a run, decided once: pure functions from facts to one :class:`Plan`.

A change is decided from everything known at once and carried out as it says
(:mod:`runtime.control.plan_executor`); nothing else chooses. There are three
entry points, one per moment a run's membership can change:

- :func:`plan_start`: the first placement, from the workers that registered;
- :func:`plan_recovery`: a step failed or a member was lost. It reads the
  run's :class:`~runtime.control.run_state.RunState` (placement, committed
  frontier, the dead, the replicas, the recovery count) and one
  :class:`Survey` (what every live member answered when fenced: its applied
  steps and recent loss sums, the snapshots on its host; which spares shadow
  the state; the backups, listed only when no live replica is left), and
  answers the whole change: the action (replace, shrink, retry, wait,
  restore, fail), the placement, the steps to commit from the survivors'
  losses and the survivors to roll back, each copy as (source, destination),
  the pipeline stages to load, the backup to restore and who loads it, the
  dead to relaunch now or after the next commit, the tier and the reason;
- :func:`plan_grow` and :func:`plan_swap`: at a step boundary, spares are
  promoted, or a straggler's slice moves onto one;
- :func:`plan_sampler_loss`: an RL run's sampler was lost. Its rollouts go
  to the samplers left (``REASSIGN``: the trainers' placement stays, no step
  is stopped) and a fresh one is launched in its place by the one launch rule
  (:func:`decide_launch`), or the run ends when no sampler is left or coming.

A plan that cannot be carried out as it stands (a snapshot that does not
read, a pipeline stage's programs that must be loaded before its snapshots
can be listed) comes back with new facts (a new :class:`Survey`) and is
planned again: one plan per set of facts, each recorded.

A pipelined run is the same code over a placement grid
(:class:`runtime.control.placement.Placement`: a row per stage, a column per
pipeline replica; an unpipelined run is the one-row grid) and the rules that differ per stage live in
:mod:`runtime.control.stage_plan`. Nothing here reads a clock, a socket or a
file: the time is passed in (``now``: a wait for capacity past its deadline
becomes a ``FAIL``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping

from runtime.control.placement import Layout, Placement, WorkerInfo, place
from runtime.control.run_state import SAMPLER
from runtime.control.stage_plan import (arrange_stages, copy_source, fill_slots, grow_replicas,
                                        stage_without_replica, unmatched_stages)
from runtime.control.tiers import Holding, TierChoice, choose_source, stage_snapshot

__all__ = ["Action", "Copy", "Failure", "Launch", "decide_launch", "launches_for", "Plan", "Restore", "Survey", "Wait", "capacity_timed_out",
           "decide_grow", "decide_recovery", "decide_release", "decide_swap", "membership_change_due", "plan_grow", "realign",
           "plan_recovery", "plan_release", "plan_sampler_loss", "plan_start", "plan_swap"]


class Action(enum.Enum):
    """What a change does."""

    REPLACE = "replace"   # every lost slice got a spare; the spares receive the state
    SHRINK = "shrink"     # some slices were dropped; the survivors take their microbatches
    RETRY = "retry"       # no one died (a transient error): re-run the step in a new epoch
    WAIT = "wait"         # below the minimum, but capacity may still arrive
    RESTORE = "restore"   # no replica is left: the newest complete snapshot or checkpoint comes back
    FAIL = "fail"         # nothing applies: the run ends (the plan's ``failure`` says which error)
    GROW = "grow"         # at a boundary: spares promoted back to the run's slice count
    SWAP = "swap"         # at a boundary: a straggler's slice moved onto a spare
    KEEP = "keep"         # at a boundary: nothing changes (the reason says why)
    RELEASE = "release"   # at a boundary: slices given back (a shared pool asked for them): spares, then the run shrinks
    REASSIGN = "reassign" # an RL run's sampler lost: its rollouts go to the other samplers, the trainers go on


class Failure(enum.Enum):
    """Why a ``FAIL`` ends the run (:func:`runtime.control.plan_executor.failed` maps each to its error)."""

    CAPACITY = "capacity"       # too few workers: no spare, below the minimum, recoveries used up
    STATE_LOST = "state_lost"   # and no copy of the state is left, in a replica or a backup
    DEVICES = "devices"         # workers joined, but with another device count than a slice's
    DIVERGED = "diverged"       # the survivors cannot be brought to one step (their losses disagree)


@dataclasses.dataclass(frozen=True)
class Copy:
    """One state copy: ``dest`` pulls the state of ``source`` (both of pipeline stage ``stage``), from the
    source's layout to the destination's (``source_layout``, ``dest_layout``: their slices' shapes, None where
    the run state does not know it yet). A copy is the same copy whatever the layouts (they are not compared):
    today both are the run's one slice shape; a copy between two shapes is where a live reshard plugs in."""

    source: str
    dest: str
    stage: int = 0
    source_layout: Layout | None = dataclasses.field(default=None, compare=False)
    dest_layout: Layout | None = dataclasses.field(default=None, compare=False)

    @property
    def reshards(self) -> bool:
        """The copy moves the state between slices of two shapes."""
        return None not in (self.source_layout, self.dest_layout) and self.source_layout != self.dest_layout


def _laid_out(plan, state):
    """``plan`` with each copy's layouts, as the run state knows its members' slices."""
    def layout(w: str) -> Layout | None:
        m = state.members.get(w)
        return m.info.layout if m is not None and m.info is not None else None
    if not plan.copies:
        return plan
    return dataclasses.replace(plan, copies=tuple(dataclasses.replace(c, source_layout=layout(c.source),
                                                                      dest_layout=layout(c.dest))
                                                  for c in plan.copies))


@dataclasses.dataclass(frozen=True)
class Launch:
    """One process to start: a ``role`` member in place of dead member ``replaces``, on ``host`` ("": a host of
    its own); ``later``: after the next commit (a replacement's program load would compete with the step that
    recovers)."""

    replaces: str
    role: str = "trainer"
    host: str = ""
    later: bool = False


def decide_launch(state, opts, dead: str, *, later: bool = False) -> Launch | None:
    """Whether a fresh process starts in dead member ``dead``'s place, and where: once per dead member, when the
    run launches its workers itself (``opts.launcher`` not "none": whoever starts them restarts them, and
    they join as newcomers) and relaunches (``opts.relaunch``), at most ``opts.max_retries`` per role in an
    attempt (the run state's ``relaunches``, those decided and not started yet included). A trainer's on the
    host it ran on (:attr:`~runtime.control.run_state.Member.home`). Pure."""
    if not opts.relaunch or opts.launcher == "none" or state.replaced(dead):
        return None
    m = state.members.get(dead)
    role = m.role if m is not None else "trainer"
    if state.relaunches(role) >= opts.max_retries:
        return None
    # A trainer's replacement goes where it ran (it finds the snapshots left on that host); a sampler keeps no
    # state on its host: anywhere.
    host = "" if role == SAMPLER else m.home if m is not None else dead
    return Launch(dead, role, host, later)


def launches_for(state, opts, dead, *, later: bool = False) -> tuple[Launch, ...]:
    """:func:`decide_launch` for each of ``dead`` in turn, each counting those before it."""
    out = []
    for w in dead:
        pending = state if not out else dataclasses.replace(state, deferred=state.deferred + tuple(
            x.replaces for x in out))
        launch = decide_launch(pending, opts, w, later=later)
        if launch is not None:
            out.append(launch)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Restore:
    """A backup brought back: ``tier`` ("snapshot" or "checkpoint") of ``step`` (the newest valid at or before
    it), loaded by ``loaders`` (a snapshot: the worker of each stage on whose host it lies; a checkpoint: every
    active member)."""

    tier: str
    step: int
    loaders: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Wait:
    """A wait for capacity under way: its deadline (in ``now``'s clock) and the option that set it."""

    until: float
    limit: str = "capacity_timeout_seconds"
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class Survey:
    """What one survey round found, besides what :class:`~runtime.control.run_state.RunState` holds.

    ``has_state``: False while the run starts (no state yet: every live member counts as a replica, the dead
    restart at once, nothing is fenced or restored). ``shadows``: the live spares that hold the committed
    state (or one step past it). ``statuses``: each live member's answer to the fence that stopped its step
    (``WorkerStatus``: applied steps, recent loss sums, the snapshot steps on its host). ``loaded``: the
    pipeline stage whose programs each member loaded. ``hosts``: each member's host. ``joined``: workers that
    joined and warmed while the run waited for capacity (spares now). ``snapshots`` and ``checkpoints``: the
    newest complete backups the controller knows of (listed only when some stage has no live replica), with
    ``snapshot_hosts``: a pipelined run's, per stage, the hosts its newest snapshot lies on.
    ``unreadable``: workers whose snapshot did not read in this recovery; ``at_most``: a pipelined
    snapshot restore found the stages' loads at an older step (restore at or before it). ``wait``: a wait
    for capacity under way. ``placement``: the one the recovery started from (None: the run state's; a
    recovery planned again keeps planning from where it started, not from the placement its first plan
    adopted).
    """

    has_state: bool = True
    placement: Placement | None = None
    shadows: frozenset[str] = frozenset()
    statuses: Mapping[str, object] = dataclasses.field(default_factory=dict)
    loaded: Mapping[str, int] = dataclasses.field(default_factory=dict)
    hosts: Mapping[str, str] = dataclasses.field(default_factory=dict)
    joined: tuple[str, ...] = ()
    snapshots: tuple[Holding, ...] = ()
    checkpoints: tuple[Holding, ...] = ()
    snapshot_hosts: tuple[frozenset[str], ...] = ()
    unreadable: frozenset[str] = frozenset()
    at_most: int | None = None
    wait: Wait | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """One membership change, whole (see the module docstring).

    ``placement``: the one to adopt (for ``WAIT``: the current one, for ``KEEP``: None); ``failure`` and
    ``limit`` (the ``ControllerOptions`` field whose value decided a ``WAIT`` or ``FAIL``) for a caller that
    speaks another vocabulary (``elastic.options.in_config_terms``); ``tier``: where the state comes from.
    ``resume``: the step training resumes at; ``commits``: ``(step, loss_sum)`` of steps every survivor
    applied that were not committed yet; ``rollbacks``: survivors one step ahead, rolled back to ``resume``.
    ``loads``: ``(worker, stage)`` whose stage programs are loaded first; ``restore``: the backup loaded;
    ``copies``: then carried out in order, each replica's hash checked after. ``resurvey``: the facts this
    plan needs are known only once its ``loads`` are done (a pipelined restore lists each stage's snapshots
    with that stage's programs): carry them out, survey again and plan again. ``retired``: the dead members the
    plan leaves (no longer watched); ``launches``: the processes started in their place, now or after the next
    commit (:func:`decide_launch`).
    """

    action: Action
    placement: Placement | None
    reason: str
    failure: Failure | None = None
    limit: str = ""
    tier: TierChoice | None = None
    resume: int = 0
    commits: tuple[tuple[int, float], ...] = ()
    rollbacks: tuple[str, ...] = ()
    loads: tuple[tuple[str, int], ...] = ()
    restore: Restore | None = None
    copies: tuple[Copy, ...] = ()
    resurvey: bool = False
    retired: tuple[str, ...] = ()
    launches: tuple[Launch, ...] = ()

    @property
    def relaunch_now(self) -> tuple[str, ...]:
        """The dead replaced by a process started now."""
        return tuple(x.replaces for x in self.launches if not x.later)

    @property
    def relaunch_later(self) -> tuple[str, ...]:
        """The dead replaced by a process started after the next commit."""
        return tuple(x.replaces for x in self.launches if x.later)


# -- a sampler lost ---------------------------------------------------------------


def plan_sampler_loss(state, opts, lost: str) -> Plan:
    """An RL run's sampler ``lost`` was declared dead (the run state holds it so): ``REASSIGN``, its
    microbatches to the samplers left, a fresh sampler launched in its place when :func:`decide_launch` says
    so; ``FAIL`` (capacity) when no sampler is left, loading or launched. The trainers' placement is not
    touched: the step in flight goes on. Pure."""
    launches = launches_for(state, opts, [lost])
    left = [w for w in state.of_role(SAMPLER) if w != lost]   # (the dead are no members: of_role skips them)
    if not left and not launches:
        why = ("no sampler is left and none is relaunched" + (f" (max_retries={opts.max_retries} used)"
                                                            if opts.relaunch and opts.launcher != "none" else ""))
        return Plan(Action.FAIL, state.placement, why, failure=Failure.CAPACITY, limit="max_retries",
                    retired=(lost,))
    reason = (f"sampler {lost} lost: its rollouts go to " + (", ".join(left) if left else "its replacement")
              + (f"; a fresh sampler replaces it" if launches else ""))
    return Plan(Action.REASSIGN, state.placement, reason, retired=(lost,), launches=launches)


# -- the first placement --------------------------------------------------------


def plan_start(slices: int, devices_per_slice: int, workers: Iterable[WorkerInfo], *, lost: Iterable[str],
               min_slices: int, stages: int = 1) -> Plan:
    """The first placement (a grid of ``stages`` rows), from the workers that registered; ``lost``: launched
    workers that died first.

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
        placement = place(slices, devices_per_slice, alive, min_slices=min_slices, stages=stages)
    except ValueError as e:
        why = f"; {len(lost)} worker(s) died before registering" if lost else ""
        if any(w.num_devices != devices_per_slice for w in alive):
            need = min(min_slices, slices)
            return Plan(Action.FAIL, Placement(1, ()), f"{_misfits(alive, devices_per_slice, need)}{why}",
                        failure=Failure.DEVICES)
        return Plan(Action.FAIL, Placement(1, ()), f"{e}{why}", failure=Failure.CAPACITY)
    if len(placement.active) < slices:
        return Plan(Action.SHRINK, placement, f"{len(lost)} worker(s) died before registering: starting with "
                                              f"{len(placement.active)} of {slices} slices")
    return Plan(Action.REPLACE, placement, "every slice has a worker" + (
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


# -- a recovery -----------------------------------------------------------------

NO_REPLICA = ("no live replica of the state is left and no complete snapshot or checkpoint to restore "
              "(snapshot_interval keeps in-memory snapshots; checkpoint_period keeps checkpoints)")


def plan_recovery(state, survey: Survey, opts, now: float = 0.0) -> Plan:
    """The whole recovery from ``state`` (the run's ``RunState``), ``survey`` and ``opts`` (the run's
    ``ControllerOptions``: ``slices``, ``min_slices``, ``max_retries``, ``capacity_timeout_seconds``,
    ``relaunch``); see the module docstring. ``now``: the clock a ``survey.wait`` deadline is in."""
    return _laid_out(_plan_recovery(state, survey, opts, now), state)


def _plan_recovery(state, survey: Survey, opts, now: float) -> Plan:
    committed = state.committed
    old = survey.placement or state.placement
    stages = old.stages
    if survey.joined:
        old = dataclasses.replace(old, spares=tuple(w for w in old.spares if w not in state.dead) + survey.joined)
    dead = sorted(w for w in old.members if w in state.dead)
    replicas = (state.replicas | survey.shadows) if survey.has_state else frozenset(old.members)
    spare_stages = ({w: k for w in old.spares if (k := survey.loaded.get(w)) is not None} if stages > 1 else {})
    backup = choose_source({}, {}, survey.snapshots, survey.checkpoints, committed) if survey.has_state else None
    # Capacity may come: a worker may join within capacity_timeout_seconds, and with every replica lost the
    # relaunched workers are waited for (they restore a snapshot left on their host, or the checkpoint); a
    # pipelined run, which does not shrink, waits for them to take the lost slices.
    has_backup = bool(survey.snapshots or survey.checkpoints) or stages > 1
    may_wait = survey.wait is not None or opts.capacity_timeout_seconds > 0 or (has_backup and opts.relaunch)
    d = decide_recovery(old, dead, replicas, min_slices=opts.min_slices, recoveries=state.recoveries,
                        max_retries=opts.max_retries, may_wait=may_wait,
                        checkpoint_step=backup.step if backup and backup.ok else None,
                        backup=backup.tier if backup and backup.ok else "checkpoint", spare_stages=spare_stages)
    wait = survey.wait
    if d.action is Action.WAIT and wait is not None and now >= wait.until:
        d = capacity_timed_out(d, wait.seconds, wait.limit)
    now_ = dict(retired=tuple(dead), launches=launches_for(state, opts, dead))
    if d.action is Action.WAIT:
        return dataclasses.replace(d, **now_)
    if d.action is Action.FAIL:
        return d
    if not survey.has_state:   # nothing to copy: every live member counts as a replica; the dead start again now
        return dataclasses.replace(d, **now_)
    later = dict(retired=tuple(dead), launches=launches_for(state, opts, dead, later=True))
    if d.action is Action.RESTORE:
        return _plan_restore(dataclasses.replace(d, **later), state, survey, opts, now, dead, may_wait)
    tier = copy_source(d.placement, old, replicas, spare_stages, committed)
    return _plan_realign(dataclasses.replace(d, tier=tier, **later), state, survey, replicas, spare_stages)


def _holders(placement: Placement, replicas, loaded: Mapping[str, int]) -> list[str]:
    """The active workers that hold the committed state of their own slice: replicas, and in a pipelined run only
    those whose programs are for their slice's stage (a spare that shadowed another stage, promoted into this
    one, holds that stage's state)."""
    if placement.stages == 1:
        return [w for w in placement.active if w in replicas]
    return [w for w in placement.active if w in replicas and loaded.get(w) == placement.stage_of[w]]


def _plan_realign(d: Plan, state, survey: Survey, replicas, spare_stages) -> Plan:
    """The survivors hold the state: commit the steps they all applied, roll back those one ahead, and copy from
    them to the slices that lack it."""
    new = d.placement
    loaded = {**survey.loaded, **spare_stages}
    survivors = _holders(new, replicas, loaded)
    loss_workers = new.grid[-1]   # (a pipeline's earlier stages compute none)
    applied = {w: survey.statuses[w].applied_steps for w in survivors}
    losses = {w: survey.statuses[w].losses for w in survivors if w in loss_workers}
    target, commits, rollbacks, error = realign(applied, losses, state.committed)
    if error:
        return Plan(Action.FAIL, new, f"cannot realign the survivors: {error}", failure=Failure.DIVERGED)
    source = d.tier.source if d.tier.source in survivors else survivors[0]
    loads, copies = _copies(new, survivors, source, loaded)
    return dataclasses.replace(d, resume=target, commits=commits, rollbacks=rollbacks, loads=loads, copies=copies)


def realign(applied: Mapping[str, int], losses: Mapping[str, Mapping[int, float]],
             committed: int) -> tuple[int, tuple, tuple, str]:
    """``(target, commits, rollbacks, error)`` reconciling survivors that differ by at most one applied step.

    A step applies only once every rank finished its reduce-scatter, so live
    replicas are at most one step apart (in a pipelined run too: a stage applies
    a step only after every later stage sent it that step's gradients).
    ``applied``: each survivor's applied step count; ``losses``: the recent
    ``{step: loss_sum}`` of the survivors that compute the loss (every one, or a
    pipelined run's last stage). Steps all survivors applied are committed
    (their loss sums must agree); those ahead roll back to ``target``.
    """
    target = min(applied.values())
    if target < committed or max(applied.values()) > target + 1:
        return target, (), (), f"replicas are out of step: applied {dict(applied)}, {committed} committed"
    commits = []
    for step in range(committed, target):
        sums = {losses[w].get(step) for w in losses}
        if len(sums) != 1 or None in sums:
            return target, (), (), f"no agreed loss for applied step {step}: {sorted(map(str, sums))}"
        commits.append((step, sums.pop()))
    return target, tuple(commits), tuple(sorted(w for w, a in applied.items() if a == target + 1)), ""


def _copies(placement: Placement, holders, source: str,
            loaded: Mapping[str, int]) -> tuple[tuple[tuple[str, int], ...], tuple[Copy, ...]]:
    """``(loads, copies)`` giving every active slice the state: each stage's slices not in ``holders`` copy
    from ``source`` when it is of that stage, else from the stage's first holder; a pipelined newcomer first
    loads its stage's programs when it has another's (``loaded``)."""
    loads, copies, stages = [], [], placement.stages
    for k, group in enumerate(placement.grid):
        src = source if stages == 1 or source in group else next(w for w in group if w in holders)
        for dest in group:
            if dest in holders:
                continue
            if stages > 1 and loaded.get(dest) != k:
                loads.append((dest, k))
            copies.append(Copy(src, dest, k))
    return tuple(loads), tuple(copies)


def _plan_restore(d: Plan, state, survey: Survey, opts, now: float, dead, may_wait: bool) -> Plan:
    """No replica is left: the newest snapshot or checkpoint comes back, to every active slice (loaded, or
    copied from the worker that loaded it). A pipelined run restores every stage at the same step, each on a
    worker where its snapshot lies when one can be."""
    committed, old = state.committed, survey.placement or state.placement
    stages = old.stages
    d = dataclasses.replace(d, tier=choose_source({}, {}, survey.snapshots, survey.checkpoints, committed))
    if stages > 1 and survey.snapshot_hosts:
        d = dataclasses.replace(d, placement=arrange_stages(d.placement, survey.snapshot_hosts, survey.hosts))
        missing = unmatched_stages(d.placement, survey.snapshot_hosts, survey.hosts)
        if missing and may_wait and (survey.wait is None or now < survey.wait.until):
            return Plan(Action.WAIT, old, f"{d.reason.split(':')[0]}: waiting for a worker on a host holding the "
                                          f"snapshot of stage {missing[0]}", limit="min_slices",
                        retired=tuple(dead), launches=launches_for(state, opts, dead))
    new = d.placement
    if stages == 1:
        held = [Holding(w, max(steps)) for w in new.members if w in survey.statuses and w not in survey.unreadable
                and (steps := [s for s in survey.statuses[w].snapshots if s <= committed])]
        choice = choose_source({}, {}, held, survey.checkpoints, committed)
        if choice.tier == "snapshot":
            return dataclasses.replace(d, tier=choice, restore=Restore("snapshot", choice.step, (choice.source,)),
                                       copies=tuple(Copy(choice.source, w) for w in new.active
                                                    if w != choice.source))
        if not choice.ok:
            return Plan(Action.FAIL, new, f"cannot restore the state: {choice.reason}", failure=Failure.STATE_LOST)
        return dataclasses.replace(d, tier=choice, restore=Restore("checkpoint", choice.step, new.active))
    # A pipelined run: each stage's snapshots are listed with that stage's programs loaded.
    groups = new.grid
    loads = tuple((w, k) for k, group in enumerate(groups) for w in group if survey.loaded.get(w) != k)
    if loads:
        return dataclasses.replace(d, loads=loads, resurvey=True)
    why = ""
    if d.tier.tier == "snapshot":
        held = [{w: survey.statuses[w].snapshots for w in group if w in survey.statuses and w not in
                 survey.unreadable} for group in groups]
        at_most = committed if survey.at_most is None else min(committed, survey.at_most)
        found = stage_snapshot(held, at_most)
        if found is not None:
            step, loaders = found
            copies = tuple(Copy(loaders[k], w, k) for k, group in enumerate(groups) for w in group
                           if w != loaders[k])
            return dataclasses.replace(d, restore=Restore("snapshot", step, loaders), copies=copies)
        why = f"no snapshot of one step at or before {at_most} is held for every pipeline stage, and "
    choice = choose_source({}, {}, (), survey.checkpoints, committed)
    if not choice.ok:
        return Plan(Action.FAIL, new, f"cannot restore the state: {why}{choice.reason}", failure=Failure.STATE_LOST)
    return dataclasses.replace(d, tier=choice, restore=Restore("checkpoint", choice.step, new.active))


def decide_recovery(placement: Placement, dead: Iterable[str], replicas: Iterable[str], *, min_slices: int,
                    recoveries: int, max_retries: int, may_wait: bool = False,
                    checkpoint_step: int | None = None, backup: str = "checkpoint",
                    spare_stages: Mapping[str, int] | None = None) -> Plan:
    """The rule of :func:`plan_recovery` that picks the action and the placement: replace dead active slices with
    live spares; else shrink down to ``min_slices``; else wait or fail.

    ``replicas``: the workers known to hold the state at the committed
    frontier: active ones, and spares that shadow it (these are promoted
    first). A survivor that is not one (a spare promoted in an earlier
    attempt whose copy never finished) keeps its slice but cannot supply
    the state; with no replica in the new placement the answer is ``RESTORE`` when a
    complete backup exists (``checkpoint_step``: its step, None when
    there is none) and at least ``min_slices`` slices have a worker (else
    ``WAIT`` for capacity, when it may come), otherwise ``FAIL``. ``backup``:
    what holds that step ("checkpoint" or "snapshot"), for the reason.
    A pipelined run (a placement grid of several stages) holds each stage's
    own state, so each must keep a replica, and a replacement takes the lost
    slice's stage, a spare that shadows that stage first (``spare_stages``:
    the stage each spare's programs are for); with too few workers whole
    pipeline replicas are dropped (:func:`runtime.control.stage_plan.fill_slots`).
    ``recoveries``: attempts so far including this one; past ``max_retries``
    the answer is ``FAIL``. ``may_wait``: capacity may still
    arrive (a relaunched or joining worker), so being below the minimum
    answers ``WAIT`` (with the unchanged placement) instead of ``FAIL``.
    """
    dead, replicas, stages = frozenset(dead), frozenset(replicas), placement.stages
    if recoveries > max_retries:
        if max_retries == 0:
            return Plan(Action.FAIL, placement, "recovery is off (max_retries=0): a lost worker ends the run",
                        failure=Failure.CAPACITY, limit="max_retries")
        return Plan(Action.FAIL, placement, f"gave up after {max_retries} recoveries (max_retries)",
                    failure=Failure.CAPACITY, limit="max_retries")
    slots, spares, dropped = fill_slots(placement, dead, replicas, spare_stages or {})
    active = [w for w in slots if w is not None]
    replaced = sum(w not in placement.active for w in active)
    new = placement.following(active, spares)
    survivors = [w for w in placement.active if w not in dead]
    lost_state = ("" if any(w in replicas for w in active) else "every active slice is gone" if not survivors else
                  "the surviving slices hold no copy of the state")
    if stages > 1 and not lost_state:
        lost_state = stage_without_replica(placement, dead, replicas, spare_stages or {})
    if lost_state and checkpoint_step is None:
        return Plan(Action.FAIL, new, f"{lost_state}: {NO_REPLICA}", failure=Failure.STATE_LOST)
    if lost_state:
        if len(active) >= min_slices:
            return Plan(Action.RESTORE, new, f"{lost_state}: {len(active)} slice(s) restore the {backup} of step "
                                             f"{checkpoint_step}")
        if may_wait:
            return Plan(Action.WAIT, placement, f"{lost_state} and {len(active)} slices have a worker (min_slices "
                                                f"{min_slices}): waiting for capacity to restore step "
                                                f"{checkpoint_step}", limit="min_slices")
        return Plan(Action.FAIL, new, f"{lost_state}, a {backup} of step {checkpoint_step} exists but no worker is "
                                      f"left to restore it", failure=Failure.CAPACITY, limit="min_slices")
    if len(active) < min_slices:
        if may_wait:
            return Plan(Action.WAIT, placement, f"{len(active)} slices left, min_slices is {min_slices}: waiting "
                                                f"for capacity", limit="min_slices")
        return Plan(Action.FAIL, new, f"{len(active)} slices left, min_slices is {min_slices} and no spare is "
                                      f"available", failure=Failure.CAPACITY, limit="min_slices")
    if dropped and stages > 1:
        return Plan(Action.SHRINK, new, f"too few workers for every pipeline replica: {dropped // stages} dropped, "
                                        f"{len(active) // stages} take over their microbatches")
    if dropped:
        return Plan(Action.SHRINK, new, f"no spare for {dropped} slice(s): {len(active)} survivors take over")
    if replaced:
        return Plan(Action.REPLACE, new, "spares replace the lost slices")
    return Plan(Action.RETRY, new, "no worker was lost; re-run the step")


def capacity_timed_out(plan: Plan, timeout_seconds: float, limit: str = "capacity_timeout_seconds") -> Plan:
    """A ``WAIT`` whose capacity never came: the ``FAIL`` that replaces it, naming the option that set the
    wait (``limit``: ``capacity_timeout_seconds``, or ``register_timeout_seconds`` when that one applied)."""
    return Plan(Action.FAIL, plan.placement, f"{plan.reason.split(':')[0]}: no capacity arrived within "
                                             f"{limit}={timeout_seconds:g}", failure=Failure.CAPACITY, limit=limit)


# -- membership at a step boundary --------------------------------------------


def membership_change_due(placement: Placement, slices: int, dead: Iterable[str], *, unadopted: bool,
                          warmed: bool, swaps: bool) -> bool:
    """Whether the next step boundary has work: a worker to adopt or promote, a dead spare, a straggler to swap.

    ``unadopted``: a worker registered that the controller has not taken on;
    ``warmed``: a joining worker finished loading its programs; ``swaps``: a
    straggler waits to be moved onto a spare. A pipelined run grows by a
    spare per stage.
    """
    dead = frozenset(dead)
    return (unadopted or warmed or swaps or any(s in dead for s in placement.spares)
            or (len(placement.active) < slices and len(placement.spares) >= placement.stages))


def decide_grow(placement: Placement, slices: int,
                spare_stages: Mapping[str, int] | None = None) -> Placement | None:
    """Promotes spares while fewer than ``slices`` run; None when nothing changes. A pipelined run grows by whole
    pipeline replicas, a spare per stage (one whose programs are that stage's first: ``spare_stages``)."""
    missing = slices - len(placement.active)
    if missing <= 0 or len(placement.spares) < placement.stages:
        return None
    if placement.stages > 1:
        return grow_replicas(placement, missing, spare_stages or {})
    take = placement.spares[:missing]
    return placement.following(placement.active + take, placement.spares[len(take):])


def decide_swap(placement: Placement, slow: str) -> Placement | None:
    """Moves ``slow``'s virtual slice onto the first spare (a straggler replaced); None without a spare.

    The slow worker leaves the placement: a host known to be slow is not kept
    as a spare.
    """
    if slow not in placement.active or not placement.spares:
        return None
    return placement.following((placement.spares[0] if w == slow else w for w in placement.active),
                               placement.spares[1:])


def plan_grow(state, opts, loaded: Mapping[str, int]) -> Plan:
    """Spares promoted while fewer slices run than asked for (``GROW``), with the copies that give them the
    state; ``KEEP`` when nothing changes. ``loaded``: the pipeline stage each member's programs are for."""
    p = state.placement
    spare_stages = {w: k for w in p.spares if (k := loaded.get(w)) is not None} if p.stages > 1 else {}
    grown = decide_grow(p, opts.slices, spare_stages)
    if grown is None:
        return Plan(Action.KEEP, None, f"{len(p.active)} of {opts.slices} slices run and {len(p.spares)} "
                                       f"spare(s) wait")
    promoted = [w for w in grown.active if w not in p.active]
    return _remap(Plan(Action.GROW, grown, f"spares {', '.join(promoted)} promoted"), state, loaded)


def decide_release(placement: Placement, count: int, min_slices: int, dead: Iterable[str] = ()
                   ) -> tuple[Placement, list[str]] | None:
    """Gives back up to ``count`` members: live spares first, then the last active slices while more than
    ``min_slices`` run (a pipelined run gives back spares only: a replica is a slice per stage). None when
    nothing can be given."""
    dead = frozenset(dead)
    spares = [w for w in placement.spares if w not in dead]
    given = spares[-count:] if count else []
    active = list(placement.active)
    while len(given) < count and placement.stages == 1 and len(active) > max(min_slices, 1):
        given.append(active.pop())
    if not given:
        return None
    return placement.following(tuple(active), tuple(w for w in placement.spares if w not in given)), given


def plan_release(state, opts, loaded: Mapping[str, int], count: int) -> tuple[Plan, list[str]]:
    """``count`` slices given back at a boundary (``RELEASE``: spares first, then a shrink that keeps at least
    ``opts.min_slices``; the survivors hold the committed state, so nothing is copied), and which, each with a
    host asked for again in its place (``launches``: the pool grants it once one is free and the run grows back;
    nothing died, so it uses no relaunch of ``max_retries``); ``KEEP`` and why not."""
    decided = decide_release(state.placement, count, opts.min_slices, state.dead)
    if decided is None:
        return Plan(Action.KEEP, None, f"nothing to give back: {len(state.placement.active)} slice(s) run, the "
                                       f"minimum is {opts.min_slices}, no spare"), []
    placement, given = decided
    plan = Plan(Action.RELEASE, placement, f"{', '.join(given)} given back", launches=tuple(Launch(w) for w in given))
    return _remap(plan, state, loaded), given


def plan_swap(state, opts, loaded: Mapping[str, int], slow: str) -> Plan:
    """Straggler ``slow``'s slice moved onto the first spare (``SWAP``), with its copy; ``KEEP`` and why not."""
    p = state.placement
    swapped = decide_swap(p, slow)
    if swapped is None:
        why = "it no longer runs a slice" if slow not in p.active else "no spare to move it onto"
        return Plan(Action.KEEP, None, why)
    spare = swapped.active[p.active.index(slow)]
    return _remap(Plan(Action.SWAP, swapped, f"{slow}'s slice moves to {spare}"), state, loaded)


def _remap(plan: Plan, state, loaded: Mapping[str, int]) -> Plan:
    """A boundary change's copies: from the first slice that kept its place and holds the committed state."""
    new = plan.placement
    holders = [w for w in new.active if w in state.replicas]
    source = next(w for w in state.placement.active if w in state.replicas and w in new.active)
    loads, copies = _copies(new, holders, source, loaded)
    return _laid_out(dataclasses.replace(plan, resume=state.committed, loads=loads, copies=copies), state)
