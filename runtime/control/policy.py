"""The control plane's step-by-step decisions, as pure functions over frozen facts.

Nothing here reads a clock, a socket or a file: time is passed in (``now``),
as torchft's ``quorum_compute`` takes it, so every rule is table-testable in
microseconds. Membership changes (start, recovery, realign, grow, swap) are
decided in :mod:`runtime.control.plan`; the rules here are the rest, in the order a
run meets them:

- placement: :class:`Placement`, :func:`place`, :func:`plan_step`;
- failure detection: :func:`is_suspect`, :func:`reprobe_wait`, :func:`cause_of`;
- the step watchdog: :func:`watchdog_limit`, :func:`holding_up`;
- stragglers: :class:`StragglerDetector`, :func:`straggler_action`;
- relaunches: :func:`may_relaunch`;
- backups: :func:`checkpoint_writer`, :func:`snapshot_order`.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping

from runtime.core.microbatch import Node, assign_microbatches

__all__ = ["Placement", "StepPlan", "StragglerDetector", "StragglerPolicy", "WorkerInfo", "cause_of",
           "checkpoint_writer", "holding_up", "is_suspect", "may_relaunch", "place", "plan_step", "reprobe_wait",
           "shadow_stage", "slice_stages", "snapshot_order", "stage_groups", "straggler_action", "watchdog_limit"]


# -- placement ---------------------------------------------------------------


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


def shadow_stage(shadows: Mapping[str, int | None], stages: int) -> int:
    """The pipeline stage a new shadow spare shadows: the one with the fewest shadows (``shadows``: each
    shadowing spare's stage), the first of those tied."""
    count = [0] * stages
    for k in shadows.values():
        if k is not None and 0 <= k < stages:
            count[k] += 1
    return count.index(min(count))


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
        """One step's ``{worker: seconds per microbatch}``; returns ``(worker, seconds, median of others)``
        flagged now."""
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


def may_relaunch(relaunch: bool, launched: int, slices: int, spares: int, max_retries: int) -> bool:
    """Whether a fresh process may be launched for a dead one: at most ``max_retries`` beyond the initial set."""
    return relaunch and launched < slices + spares + max_retries


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


def snapshot_order(step: int, steps: int, interval: int, active, spares, hosts: Mapping[str, str],
                   others=()) -> tuple[str, str | None] | None:
    """``(writer, peer)`` of the in-memory snapshot after step ``step`` (0-based), or None (no snapshot then).

    A snapshot follows every ``interval``-th step but the last of ``steps``
    (the run ends there; ``interval`` 0: never). The writer rotates over
    ``active`` (the step's slices, in rank order) as checkpoint writers do;
    the peer, which keeps the second copy, is the first worker on another
    host (``hosts``: worker -> host; a worker missing there is a host of its
    own): a spare first (it takes over when the active slices die), else the
    next active slice after the writer, else one of ``others`` (a pipelined
    run's other stages' slices, when ``active`` is one stage's). None when
    every worker shares the writer's host.
    """
    n = step + 1
    if interval <= 0 or not active or n % interval or n >= steps:
        return None
    i = (n // interval) % len(active)
    writer = active[i]
    home = hosts.get(writer, writer)
    peer = next((w for w in (*spares, *active[i + 1:], *active[:i], *others) if hosts.get(w, w) != home), None)
    return writer, peer
