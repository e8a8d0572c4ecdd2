"""Every decision of the control plane, as pure functions over frozen facts.

The controller, the recovery and the watchdog ask; these functions answer
with frozen dataclasses (an enum action and a ``reason`` where there is a
choice). Nothing here reads a clock, a socket or a file: time is passed in
(``now``), as torchft's ``quorum_compute`` takes it, so every rule is
table-testable in microseconds.

The rules, in the order a run meets them:

- placement: :func:`place`, :func:`plan_step`;
- failure detection: :func:`is_suspect`, :func:`reprobe_wait`, :func:`cause_of`;
- the step watchdog: :func:`watchdog_limit`, :func:`holding_up`;
- stragglers: :class:`StragglerDetector`, :func:`straggler_action`;
- recovery: :func:`decide_recovery` (replace / shrink / retry / wait / fail),
  :func:`plan_realign`, :func:`may_relaunch`;
- membership at a step boundary: :func:`membership_change_due`,
  :func:`decide_grow`, :func:`decide_swap`.
"""

from __future__ import annotations

import dataclasses
import enum
import statistics
from collections.abc import Iterable, Mapping

from runtime.microbatch import Node, assign_microbatches

__all__ = ["Action", "Failure", "Placement", "RealignPlan", "RecoveryDecision", "StepPlan", "StragglerDetector", "capacity_timed_out", "decide_start",
           "StragglerPolicy", "WorkerInfo", "cause_of", "checkpoint_writer", "decide_grow", "decide_recovery", "decide_swap",
           "holding_up", "is_suspect", "may_relaunch", "membership_change_due", "place", "plan_realign", "plan_step",
           "reprobe_wait", "snapshot_order", "straggler_action", "watchdog_limit"]


# -- placement ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """A registered physical slice (one worker process for now)."""

    worker_id: str
    address: str
    num_devices: int
    platform: str = "cpu"
    pid: int = 0
    data_address: str = ""   # its data plane (runtime.dataplane); "" when it serves none
    host: str = ""           # the host it runs on (where its in-memory snapshots live)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which worker runs each virtual slice, in one membership epoch.

    ``active[v]`` is the worker id of virtual slice ``v``; ``spares`` are
    registered, warmed workers no virtual slice uses.
    """

    epoch: int
    active: tuple[str, ...]
    spares: tuple[str, ...] = ()

    @property
    def members(self) -> tuple[str, ...]:
        return self.active + self.spares


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Who computes what in one step: rank ``r`` is ``workers[r]`` with ``nodes[r]``."""

    step: int
    epoch: int
    workers: tuple[str, ...]
    nodes: tuple[tuple[Node, ...], ...]

    def microbatches(self) -> dict[str, list[int]]:
        """``{worker: microbatch ids}`` of this step (what the report's exactly-once check reads)."""
        return {w: [i for n in nodes for i in n.ids] for w, nodes in zip(self.workers, self.nodes)}


def place(num_vslices: int, devices_per_slice: int, workers: Iterable[WorkerInfo], epoch: int = 1,
          min_slices: int | None = None) -> Placement:
    """Initial placement: the first ``num_vslices`` fitting workers (by id) are active.

    A worker fits when it has exactly ``devices_per_slice`` devices (same
    program shapes on every slice keep the math identical). The rest become
    spares. With ``min_slices``, fewer fitting workers (some died during
    startup) still give a placement of at least that many slices (the run
    grows back when capacity returns). Raises ``ValueError`` naming the
    shortfall when too few fit.
    """
    workers = list(workers)
    fitting = sorted((w for w in workers if w.num_devices == devices_per_slice), key=lambda w: w.worker_id)
    need = num_vslices if min_slices is None else min(min_slices, num_vslices)
    if len(fitting) < need:
        others = sorted({w.num_devices for w in workers if w.num_devices != devices_per_slice})
        extra = f" (also registered: workers with {others} devices)" if others else ""
        raise ValueError(f"need {need} workers with {devices_per_slice} devices, "
                         f"have {len(fitting)}{extra}")
    ids = tuple(w.worker_id for w in fitting)
    return Placement(epoch=epoch, active=ids[:num_vslices], spares=ids[num_vslices:])


def plan_step(placement: Placement, step: int, num_microbatches: int) -> StepPlan:
    """Assigns the step's microbatch subtrees to the active slices in vslice order."""
    nodes = assign_microbatches(num_microbatches, len(placement.active))
    return StepPlan(step=step, epoch=placement.epoch, workers=placement.active,
                    nodes=tuple(tuple(n) for n in nodes))


# -- failure detection -------------------------------------------------------

_CAUSES = {"refused": "crash", "silent": "hang", "not_serving": "fenced"}


def is_suspect(now: float, last_ok: float, lease: float, failure: str) -> bool:
    """Whether a failed health probe makes a worker suspect.

    ``failure`` is how the probe failed: ``"refused"`` (the process is gone:
    suspect at once), ``"not_serving"`` (it fenced itself: at once) or
    ``"silent"`` (no answer: suspect once silent for half the ``lease``, so
    the re-probes that confirm it fill the other half and a hung worker is
    declared dead about when its lease ends).
    """
    return failure != "silent" or now - last_ok >= lease / 2


def reprobe_wait(lease: float, retries: int, probe_timeout: float) -> float:
    """Seconds between the ``retries`` re-probes of a suspect, spreading them over the second half of the lease."""
    return max(lease / 2 - (retries + 1) * probe_timeout, 0.0) / max(retries, 1)


def cause_of(failure: str) -> str:
    """The recorded cause of a death, from how its last probe failed: crash, hang or fenced."""
    return _CAUSES.get(failure, "unresponsive")


# -- the step watchdog and stragglers ---------------------------------------


def watchdog_limit(step_seconds: Iterable[float], factor: float, min_seconds: float,
                   min_samples: int = 3) -> tuple[float, float] | None:
    """``(limit, median)``: a step this long past the last commit is stalled; None until ``min_samples`` steps ran.

    The limit is ``factor`` times the median recent step time, and at least
    ``min_seconds`` (so a fast model's hiccup is not an alarm).
    """
    samples = sorted(step_seconds)
    if len(samples) < min_samples:
        return None
    median = samples[len(samples) // 2]
    return max(factor * median, min_seconds), median


def holding_up(progress: Mapping[str, tuple[int, str, float]], step: int) -> list[str]:
    """The workers holding up ``step``, from each worker's ``(step, phase, seconds in phase)``.

    A worker holds the step up when it is behind (still on an earlier step)
    or computing (``grad`` or ``apply``) while some peer is already done with
    its part (waiting in ``reduce``, or finished). When every worker is in
    the same state, no one is singled out: the step is slow, not a worker.
    """
    behind = {w for w, (s, phase, _) in progress.items() if s < step or (s == step and phase in ("grad", "apply"))}
    return sorted(behind) if behind and len(behind) < len(progress) else []


def straggler_action(replace_stragglers: bool, live_spare: bool) -> str:
    """``"replaced"`` when stragglers are to be moved onto spares and a live spare exists, else ``"reported"``."""
    return "replaced" if replace_stragglers and live_spare else "reported"


@dataclasses.dataclass(frozen=True)
class StragglerPolicy:
    factor: float = 3.0         # slower than factor x median of the others
    patience: int = 3           # for this many consecutive steps
    min_seconds: float = 0.002  # ignore phases too short to time reliably


class StragglerDetector:
    """Flags a slice whose grad phase is far slower than its peers'. Bookkeeping only, no I/O.

    Fed each committed step's per-worker grad seconds per microbatch; answers
    the workers more than ``factor`` times the median of the others for
    ``patience`` consecutive steps. A flagged worker is reported once per
    episode (its streak restarts), so a slow host is not flagged at every step.
    """

    def __init__(self, policy: StragglerPolicy):
        self.policy = policy
        self._streak: dict[str, int] = {}

    def observe(self, seconds: Mapping[str, float]) -> list[tuple[str, float, float]]:
        """One step's ``{worker: seconds per microbatch}``; returns ``(worker, seconds, median of others)`` flagged now."""
        flagged = []
        if len(seconds) < 2:
            return flagged
        for w, s in seconds.items():
            others = statistics.median(v for k, v in seconds.items() if k != w)
            slow = s > self.policy.min_seconds and s > self.policy.factor * max(others, 1e-9)
            self._streak[w] = self._streak.get(w, 0) + 1 if slow else 0
            if self._streak[w] >= self.policy.patience:
                self._streak[w] = 0
                flagged.append((w, s, others))
        for w in [k for k in self._streak if k not in seconds]:
            del self._streak[w]
        return flagged


# -- recovery ----------------------------------------------------------------


class Action(enum.Enum):
    """What a recovery does."""

    REPLACE = "replace"   # every lost slice got a spare; the spares receive the state
    SHRINK = "shrink"     # some slices were dropped; the survivors take their microbatches
    RETRY = "retry"       # no one died (a transient error): re-run the step in a new epoch
    WAIT = "wait"         # below the minimum, but capacity may still arrive
    RESTORE = "restore"   # no replica is left: every active slice loads the newest complete checkpoint
    FAIL = "fail"         # nothing applies: the run ends (the decision's ``failure`` says which error)


class Failure(enum.Enum):
    """Why a ``FAIL`` ends the run: ``CAPACITY`` raises ``CapacityExhaustedError``, ``STATE_LOST``
    ``StateLostError`` (:mod:`runtime.errors`; :func:`runtime.recovery.failed` maps them)."""

    CAPACITY = "capacity"       # too few workers: no spare, below the minimum, recoveries used up
    STATE_LOST = "state_lost"   # and no copy of the state is left, in a replica or a backup


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
                    checkpoint_step: int | None = None, backup: str = "checkpoint") -> RecoveryDecision:
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
    ``recoveries``: attempts so far including this one; past
    ``max_retries`` the answer is ``FAIL``. ``may_wait``: capacity may still
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
    spares = sorted((s for s in placement.spares if s not in dead), key=lambda s: s not in replicas)   # stable
    active, replaced, dropped = [], 0, 0
    for w in placement.active:
        if w not in dead:
            active.append(w)
        elif spares:
            active.append(spares.pop(0))
            replaced += 1
        else:
            dropped += 1
    new = Placement(epoch=placement.epoch + 1, active=tuple(active), spares=tuple(spares))
    survivors = [w for w in placement.active if w not in dead]
    lost_state = ("" if any(w in replicas for w in active) else "every active slice is gone" if not survivors else
                  "the surviving slices hold no copy of the state")
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
                                                            f"is {min_slices}: waiting for capacity", limit="min_slices")
        return RecoveryDecision(Action.FAIL, new, f"{len(active)} slices left, min_slices is "
                                                  f"{min_slices} and no spare is available", failure=Failure.CAPACITY,
                                limit="min_slices")
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
    (with the shortfall) otherwise.
    """
    lost = sorted(lost)
    alive = [w for w in workers if w.worker_id not in lost]
    try:
        placement = place(num_vslices, devices_per_slice, alive, min_slices=min_slices)
    except ValueError as e:
        why = f"; {len(lost)} worker(s) died before registering" if lost else ""
        return RecoveryDecision(Action.FAIL, Placement(1, ()), f"{e}{why}", failure=Failure.CAPACITY)
    if len(placement.active) < num_vslices:
        return RecoveryDecision(Action.SHRINK, placement, f"{len(lost)} worker(s) died before registering: "
                                                          f"starting with {len(placement.active)} of "
                                                          f"{num_vslices} slices")
    return RecoveryDecision(Action.REPLACE, placement, "every slice has a worker" + (
        f" ({len(lost)} that died before registering were replaced)" if lost else ""))


def capacity_timed_out(decision: RecoveryDecision, timeout_seconds: float,
                       limit: str = "capacity_timeout_seconds") -> RecoveryDecision:
    """A ``WAIT`` whose capacity never came: the ``FAIL`` that replaces it, naming the option that set the
    wait (``limit``: ``capacity_timeout_seconds``, or ``register_timeout_seconds`` when that one applied)."""
    return RecoveryDecision(Action.FAIL, decision.placement,
                            f"{decision.reason.split(':')[0]}: no capacity arrived within "
                            f"{limit}={timeout_seconds:g}", failure=Failure.CAPACITY, limit=limit)


def may_relaunch(relaunch: bool, launched: int, slices: int, spares: int, max_retries: int) -> bool:
    """Whether a fresh process may be launched for a dead one: at most ``max_retries`` beyond the initial set."""
    return relaunch and launched < slices + spares + max_retries


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
    replicas are at most one step apart. ``applied``: each survivor's applied
    step count; ``losses``: each survivor's recent ``{step: loss_sum}``;
    ``committed``: steps the controller committed. Steps all survivors
    applied are committed (their loss sums must agree); those ahead roll back.
    """
    target = min(applied.values())
    if target < committed or max(applied.values()) > target + 1:
        return RealignPlan(target, error=f"replicas are out of step: applied {dict(applied)}, "
                                         f"{committed} committed")
    commits = []
    for step in range(committed, target):
        sums = {losses[w].get(step) for w in applied}
        if len(sums) != 1 or None in sums:
            return RealignPlan(target, error=f"no agreed loss for applied step {step}: {sorted(map(str, sums))}")
        commits.append((step, sums.pop()))
    return RealignPlan(target, tuple(commits), tuple(sorted(w for w, a in applied.items() if a == target + 1)))


# -- membership at a step boundary --------------------------------------------


def membership_change_due(placement: Placement, slices: int, dead: Iterable[str], *, unadopted: bool,
                          warmed: bool, swaps: bool) -> bool:
    """Whether the next step boundary has work: a worker to adopt or promote, a dead spare, a straggler to swap.

    ``unadopted``: a worker registered that the controller has not taken on;
    ``warmed``: a joining worker finished loading its programs; ``swaps``: a
    straggler waits to be moved onto a spare.
    """
    dead = frozenset(dead)
    return (unadopted or warmed or swaps or any(s in dead for s in placement.spares)
            or (len(placement.active) < slices and bool(placement.spares)))


def decide_grow(placement: Placement, slices: int) -> Placement | None:
    """Promotes spares while fewer than ``slices`` run; None when nothing changes."""
    missing = slices - len(placement.active)
    if missing <= 0 or not placement.spares:
        return None
    take = placement.spares[:missing]
    return Placement(epoch=placement.epoch + 1, active=placement.active + take,
                     spares=placement.spares[len(take):])


def decide_swap(placement: Placement, slow: str) -> Placement | None:
    """Moves ``slow``'s virtual slice onto the first spare (a straggler replaced); None without a spare.

    The slow worker leaves the placement: a host known to be slow is not kept
    as a spare.
    """
    if slow not in placement.active or not placement.spares:
        return None
    active = tuple(placement.spares[0] if w == slow else w for w in placement.active)
    return Placement(epoch=placement.epoch + 1, active=active, spares=placement.spares[1:])


def checkpoint_writer(step: int, steps: int, period: int, workers) -> str | None:
    """Which worker writes a persistent checkpoint after step ``step`` (0-based), or None.

    A checkpoint follows every ``period``-th step and the last of ``steps``
    (``period`` 0: never); the writer rotates over ``workers`` (the step's
    slices, in rank order) from one checkpoint to the next, so no one
    replica carries every write.
    """
    n = step + 1
    if period <= 0 or not workers or (n % period and n != steps):
        return None
    return workers[(n // period) % len(workers)]


def snapshot_order(step: int, steps: int, interval: int, active, spares, hosts: Mapping[str, str]
                   ) -> tuple[str, str | None] | None:
    """``(writer, peer)`` of the in-memory snapshot after step ``step`` (0-based), or None (no snapshot then).

    A snapshot follows every ``interval``-th step but the last of ``steps``
    (the run ends there; ``interval`` 0: never). The writer rotates over
    ``active`` (the step's slices, in rank order) as checkpoint writers do;
    the peer, which keeps the second copy, is the first worker on another
    host (``hosts``: worker -> host; a worker missing there is a host of its
    own): a spare first (it takes over when the active slices die), else the
    next active slice after the writer. None when every worker shares the
    writer's host.
    """
    n = step + 1
    if interval <= 0 or not active or n % interval or n >= steps:
        return None
    i = (n // interval) % len(active)
    writer = active[i]
    home = hosts.get(writer, writer)
    peer = next((w for w in (*spares, *active[i + 1:], *active[:i]) if hosts.get(w, w) != home), None)
    return writer, peer
