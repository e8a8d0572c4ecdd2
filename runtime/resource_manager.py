"""Maps virtual slices to physical slices (workers). Pure decisions only.

The controller asks; these functions answer with frozen dataclasses and never
do I/O, so every decision is unit-testable.
"""

from __future__ import annotations

import dataclasses

from runtime.microbatch import Node, assign_microbatches

__all__ = ["WorkerInfo", "Placement", "StepPlan", "place", "plan_step"]


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
