"""Placement: which worker runs each virtual slice, and who computes what in a step, as pure functions.

A run's active slices are stage-major: virtual slice ``v`` is stage ``v // R``
of pipeline replica ``v % R`` (``R`` slices per stage; an unpipelined run is
the one-stage case), each slice one worker today. Membership changes are
decided over placements in :mod:`runtime.control.plan`; the other rules sit
beside what they decide: failure detection with the health schedule
(:mod:`runtime.control.health_schedule`), the step watchdog and stragglers
with the watchdog (:mod:`runtime.control.watchdog`), relaunch limits with the
worker group, checkpoint and snapshot writers with their tiers
(:mod:`runtime.control.checkpointing`, :mod:`runtime.control.snapshotting`),
a shadow's stage with the state copies. Nothing here reads a clock, a socket
or a file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from runtime.core.microbatch import Node, assign_microbatches

__all__ = ["Placement", "StepPlan", "WorkerInfo", "place", "plan_step", "slice_stages", "stage_groups"]


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """A registered physical slice (one worker process for now)."""

    worker_id: str
    address: str
    num_devices: int
    platform: str = "cpu"
    pid: int = 0
    data_address: str = ""   # its data plane (runtime.wire.dataplane); "" when it serves none
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
    stages: int = 1   # pipeline stages: workers are stage-major, each stage's replicas in order

    @property
    def replica_count(self) -> int:
        """The pipeline replicas (data-parallel width): the workers of one stage."""
        return len(self.workers) // self.stages

    @property
    def loss_workers(self) -> tuple[str, ...]:
        """The workers that compute the loss: every one, or the last pipeline stage's."""
        return self.workers[-self.replica_count:]

    def microbatches(self) -> dict[str, list[int]]:
        """``{worker: microbatch ids}`` whose loss this step computed there (what the report's exactly-once check
        reads): every worker's, or the last pipeline stage's."""
        return {w: [i for n in nodes for i in n.ids] for w, nodes in zip(self.workers, self.nodes)
                if w in self.loss_workers}


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


def slice_stages(active: tuple[str, ...], stages: int) -> dict[str, int]:
    """``{worker: the pipeline stage of its slice}`` (:func:`stage_groups`; every one 0 for an unpipelined run)."""
    return {w: k for k, group in enumerate(stage_groups(active, stages)) for w in group}


def stage_groups(active: tuple[str, ...], stages: int) -> tuple[tuple[str, ...], ...]:
    """The active slices of each pipeline stage (stage-major: virtual slice ``v`` is stage ``v // R``); one group
    of every slice for an unpipelined run."""
    if len(active) % stages:
        raise ValueError(f"{len(active)} active slices do not split into {stages} pipeline stages")
    r = len(active) // stages
    return tuple(active[k * r:(k + 1) * r] for k in range(stages))


def plan_step(placement: Placement, step: int, num_microbatches: int, stages: int = 1) -> StepPlan:
    """Assigns the step's microbatch subtrees to the active slices in vslice order; with pipeline ``stages``,
    virtual slice ``v`` is stage ``v // R`` of pipeline replica ``v % R`` (``R`` = slices / stages), and each
    stage of a replica works on that replica's subtrees."""
    replicas = len(stage_groups(placement.active, stages)[0])
    nodes = assign_microbatches(num_microbatches, replicas)
    return StepPlan(step=step, epoch=placement.epoch, workers=placement.active,
                    nodes=tuple(tuple(nodes[v % replicas]) for v in range(len(placement.active))), stages=stages)
