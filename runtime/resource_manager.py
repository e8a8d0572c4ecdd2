"""Maps virtual slices to physical slices (workers). Pure decisions only.

The controller asks; these functions answer with frozen dataclasses and never
do I/O, so every decision is unit-testable.
"""

from __future__ import annotations

import dataclasses

from runtime.microbatch import Node, assign_microbatches

__all__ = ["WorkerInfo", "Placement", "RecoveryDecision", "StepPlan", "decide_grow", "decide_recovery", "decide_swap",
           "place", "plan_step"]


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """A registered physical slice (one worker process for now)."""

    worker_id: str
    address: str
    num_devices: int
    platform: str = "cpu"
    pid: int = 0


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which worker runs each virtual slice, in one membership epoch.

    ``active[v]`` is the worker id of virtual slice ``v``; ``spares`` are
    registered workers no virtual slice uses.
    """

    epoch: int
    active: tuple[str, ...]
    spares: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Who computes what in one step: rank ``r`` is ``workers[r]`` with ``nodes[r]``."""

    step: int
    epoch: int
    workers: tuple[str, ...]
    nodes: tuple[tuple[Node, ...], ...]


def place(num_vslices: int, devices_per_slice: int, workers: list[WorkerInfo], epoch: int = 1) -> Placement:
    """Initial placement: the first ``num_vslices`` fitting workers (by id) are active.

    A worker fits when it has exactly ``devices_per_slice`` devices (same
    program shapes on every slice keep the math identical). The rest become
    spares. Raises ``ValueError`` naming the shortfall when too few fit.
    """
    fitting = sorted((w for w in workers if w.num_devices == devices_per_slice), key=lambda w: w.worker_id)
    if len(fitting) < num_vslices:
        others = sorted({w.num_devices for w in workers if w.num_devices != devices_per_slice})
        extra = f" (also registered: workers with {others} devices)" if others else ""
        raise ValueError(f"need {num_vslices} workers with {devices_per_slice} devices, "
                         f"have {len(fitting)}{extra}")
    ids = tuple(w.worker_id for w in fitting)
    return Placement(epoch=epoch, active=ids[:num_vslices], spares=ids[num_vslices:])


def plan_step(placement: Placement, step: int, num_microbatches: int) -> StepPlan:
    """Assigns the step's microbatch subtrees to the active slices in vslice order."""
    nodes = assign_microbatches(num_microbatches, len(placement.active))
    return StepPlan(step=step, epoch=placement.epoch, workers=placement.active,
                    nodes=tuple(tuple(n) for n in nodes))


@dataclasses.dataclass(frozen=True)
class RecoveryDecision:
    """What to do after ``dead`` workers were lost.

    ``action``: ``replace`` (every dead slice got a spare), ``shrink`` (some
    slices were dropped; survivors take their microbatches), ``retry`` (no one
    died: re-run the step in a new epoch) or ``fail``. ``replacements`` lists
    ``(vslice, spare)`` pairs that need the state copied to them.
    """

    action: str
    placement: Placement
    replacements: tuple[tuple[int, str], ...] = ()
    reason: str = ""


def decide_recovery(placement: Placement, dead: frozenset[str], *, min_slices: int, recoveries: int,
                    max_retries: int, may_wait: bool = False) -> RecoveryDecision:
    """Replace dead active slices with spares; else shrink down to ``min_slices``; else wait or fail.

    ``may_wait``: capacity may still arrive (a relaunched or joining worker,
    within ``elastic_timeout_seconds``), so being below the minimum answers
    ``wait`` instead of ``fail``.
    """
    if recoveries > max_retries:
        return RecoveryDecision("fail", placement, reason=f"gave up after {max_retries} recoveries")
    spares = [s for s in placement.spares if s not in dead]
    active, replacements, dropped = [], [], 0
    for w in placement.active:
        if w not in dead:
            active.append(w)
        elif spares:
            replacements.append((len(active), spares[0]))
            active.append(spares.pop(0))
        else:
            dropped += 1
    new = Placement(epoch=placement.epoch + 1, active=tuple(active), spares=tuple(spares))
    survivors = [w for w in placement.active if w not in dead]
    if not survivors:
        return RecoveryDecision("fail", new, reason="every active slice is gone: no live replica of the state "
                                                   "(restore from a snapshot or checkpoint is not built yet)")
    if len(active) < min_slices:
        if may_wait:
            return RecoveryDecision("wait", placement, reason=f"{len(active)} slices left, elastic_min_slice_count "
                                                              f"is {min_slices}: waiting for capacity")
        return RecoveryDecision("fail", new, reason=f"{len(active)} slices left, elastic_min_slice_count is "
                                                   f"{min_slices} and no spare is available")
    if dropped:
        return RecoveryDecision("shrink", new, tuple(replacements),
                                reason=f"no spare for {dropped} slice(s): {len(active)} survivors take over")
    if replacements:
        return RecoveryDecision("replace", new, tuple(replacements), reason="spares replace the lost slices")
    return RecoveryDecision("retry", new, reason="no worker was lost; re-run the step")


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
