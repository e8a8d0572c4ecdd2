"""Placement: the grid of virtual slices and the workers serving it, and who computes what in a step, as pure
functions.

A :class:`Placement` is a grid: row ``k`` is pipeline stage ``k``, column ``r``
pipeline replica ``r`` (the data-parallel axis), and each cell names the slice
serving it. An unpipelined run is the one-row grid; nothing outside the stage
schedule and the stage cut asks whether a run is pipelined. Read stage-major,
the grid is ``active``: virtual slice ``v`` is stage ``v // R``, replica
``v % R`` (``R`` replicas). A slice is one worker process today, named by its
worker id; the host axis (a slice of several worker processes running one SPMD
program) extends a cell to the slice's hosts, and nothing that reads the grid
by stage and replica changes. Membership changes are
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
import functools
from collections.abc import Iterable, Mapping

from runtime.core.hosts import Layout
from runtime.core.microbatch import Node, assign_microbatches

__all__ = ["Placement", "StepPlan", "WorkerInfo", "place", "plan_step"]


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """A registered physical slice: one worker process, or H of them (its hosts, :mod:`runtime.core.hosts`).

    A slice of several hosts has ``hosts``, each host's own ``WorkerInfo`` in host order (their ``worker_id``:
    :func:`runtime.core.hosts.host_id`); its ``address`` and ``data_address`` are theirs joined, its ``pid``
    and ``host`` its host 0's.
    """

    worker_id: str
    address: str
    num_devices: int
    platform: str = "cpu"
    pid: int = 0
    data_address: str = ""   # its data plane (runtime.wire.dataplane); "" when it serves none
    host: str = ""           # the host it runs on (where its in-memory snapshots live)
    hosts: tuple = ()        # a slice of several hosts: each host's WorkerInfo, in host order

    @property
    def layout(self) -> Layout:
        """The slice's shape: its devices over its hosts."""
        return Layout(self.num_devices, len(self.slice_hosts))

    @property
    def slice_hosts(self) -> tuple:
        """Every host of the slice, in host order: each host's ``WorkerInfo`` (a slice of one host: itself)."""
        return self.hosts or (self,)

    def host_records(self) -> list[dict]:
        """How the event log records a slice's hosts (``worker_registered``, ``client_attached``: ``hosts``), in
        host order; ``run_state`` reads them back. Empty for a slice of one host."""
        return [{"address": h.address, "data_address": h.data_address, "pid": h.pid, "host": h.host}
                for h in self.hosts]


@dataclasses.dataclass(frozen=True)
class Placement:
    """The placement grid of one membership epoch: the slice serving each (stage, replica), and the spares.

    ``active`` is the grid read stage-major (virtual slice ``v`` is stage ``v // replicas``, replica
    ``v % replicas``); ``stages`` its rows (1: an unpipelined run); ``spares`` registered, warmed workers no
    cell uses.
    """

    epoch: int
    active: tuple[str, ...]
    spares: tuple[str, ...] = ()
    stages: int = 1

    @property
    def members(self) -> tuple[str, ...]:
        return self.active + self.spares

    @property
    def replicas(self) -> int:
        """The grid's columns: pipeline replicas (the data-parallel width)."""
        return len(self.active) // self.stages

    @functools.cached_property
    def grid(self) -> tuple[tuple[str, ...], ...]:
        """``grid[stage][replica]``: the slice serving that cell (every slice in row 0 when unpipelined). A
        ``ValueError`` when the active slices do not fill the rows (a pipelined run that lost a slice nobody
        took: the plan that made it restores or fails)."""
        return _rows(self.active, self.stages)

    @functools.cached_property
    def stage_of(self) -> Mapping[str, int]:
        """``{active slice: its stage}`` (the grid's row)."""
        return {w: k for k, row in enumerate(self.grid) for w in row}

    def following(self, active: Iterable[str], spares: Iterable[str]) -> Placement:
        """The next epoch's placement of the same grid shape with these slices."""
        return Placement(self.epoch + 1, tuple(active), tuple(spares), self.stages)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Who computes what in one step: rank ``r`` is ``workers[r]`` with ``nodes[r]``."""

    step: int
    epoch: int
    workers: tuple[str, ...]
    nodes: tuple[tuple[Node, ...], ...]
    stages: int = 1   # the placement grid's rows: workers are stage-major, each stage's replicas in order

    @property
    def replica_count(self) -> int:
        """The pipeline replicas (data-parallel width): the workers of one stage."""
        return len(self.workers) // self.stages

    @property
    def grid(self) -> tuple[tuple[str, ...], ...]:
        """The workers of each stage, as :attr:`Placement.grid`."""
        return _rows(self.workers, self.stages)

    @property
    def loss_workers(self) -> tuple[str, ...]:
        """The workers that compute the loss: every one, or the last pipeline stage's."""
        return self.workers[-self.replica_count:]

    def microbatches(self) -> dict[str, list[int]]:
        """``{worker: microbatch ids}`` whose loss this step computed there (what the report's exactly-once check
        reads): every worker's, or the last pipeline stage's."""
        return {w: [i for n in nodes for i in n.ids] for w, nodes in zip(self.workers, self.nodes)
                if w in self.loss_workers}


def _rows(slices: tuple[str, ...], stages: int) -> tuple[tuple[str, ...], ...]:
    """Stage-major ``slices`` cut into ``stages`` rows of equal length (the grid); ``ValueError`` when they do not
    fill the rows."""
    if len(slices) % stages:
        raise ValueError(f"{len(slices)} active slices do not split into {stages} pipeline stages")
    r = len(slices) // stages
    return tuple(slices[k * r:(k + 1) * r] for k in range(stages))


def place(num_vslices: int, devices_per_slice: int, workers: Iterable[WorkerInfo], epoch: int = 1,
          min_slices: int | None = None, stages: int = 1) -> Placement:
    """Initial placement: the first ``num_vslices`` fitting workers (by id) are active.

    A worker fits when it has exactly ``devices_per_slice`` devices (same
    program shapes on every slice keep the math identical). The rest become
    spares; the grid has ``stages`` rows. With ``min_slices``, fewer fitting workers (some died during
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
    return Placement(epoch=epoch, active=ids[:num_vslices], spares=ids[num_vslices:], stages=stages)


def plan_step(placement: Placement, step: int, num_microbatches: int) -> StepPlan:
    """Assigns the step's microbatch subtrees to the grid's columns: every stage of pipeline replica ``r`` works
    on replica ``r``'s subtrees (an unpipelined run: each slice on its own)."""
    replicas = placement.replicas
    nodes = assign_microbatches(num_microbatches, replicas)
    return StepPlan(step=step, epoch=placement.epoch, workers=placement.active,
                    nodes=tuple(tuple(nodes[v % replicas]) for v in range(len(placement.active))),
                    stages=placement.stages)
