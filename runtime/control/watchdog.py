"""Slow steps: the step watchdog (a step far slower than usual: find who holds it up) and stragglers.

:func:`investigate` runs when :meth:`WorkerGroup.wait` answers ``Stalled``
(the step ran past :func:`watchdog_limit`). It asks every
worker of the step where it is (``Progress``), probes the suspects, and
returns a :class:`WatchdogFinding`: the event to record, the stragglers to
report, and the workers to fence out. It records nothing and declares no one
dead itself.

:class:`SlowSteps` is the controller's side of both: it times the commits,
gives the watchdog's deadline, carries a finding out (``step_watchdog``,
``straggler``, the fenced declared dead) and feeds each committed step's
timings to the straggler detector (a straggler is reported, or queued for a
swap onto a spare at the next boundary: ``straggler`` with ``queued``).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from collections.abc import Iterable, Mapping

from runtime.control.placement import StepPlan

__all__ = ["holding_up", "investigate", "SlowSteps", "straggler_action", "StragglerDetector", "StragglerPolicy",
           "watchdog_limit", "WatchdogFinding"]


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


@dataclasses.dataclass(frozen=True)
class WatchdogFinding:
    """What the watchdog found about one stalled step.

    ``progress``: ``{worker: (step, phase, seconds)}`` of those that answered;
    ``suspects``: the silent ones and those holding the step up;
    ``stragglers``: ``(worker, seconds in phase, action)`` of live suspects
    (``action`` "replaced" or "reported"); ``fence``: ``(worker, reason,
    cause)`` of the workers to declare dead.
    """

    step: int
    pending: tuple[str, ...]
    progress: dict[str, tuple[int, str, float]]
    suspects: tuple[str, ...]
    stragglers: tuple[tuple[str, float, str], ...]
    fence: tuple[tuple[str, str, str], ...]


def investigate(group, plan: StepPlan, pending, *, replace_stragglers: bool, live_spare: bool) -> WatchdogFinding:
    """Asks the step's workers where they are and decides whom to fence out.

    A worker that does not answer ``Progress``, or fails its health probe,
    is to be fenced as hung. A live worker stuck computing while its peers
    wait is a straggler: with ``replace_stragglers`` and a live spare it is
    fenced out (the normal recovery replaces it), else reported.
    """
    progress, silent = {}, []
    for w in plan.workers:
        where = group.progress(w)
        if where is None:
            silent.append(w)
        else:
            progress[w] = where
    suspects = sorted(set(silent) | set(holding_up(progress, plan.step)))
    stragglers, fence = [], []
    for w in suspects:
        if w in silent or not group.is_alive(w):
            fence.append((w, "no answer to the step watchdog", "hang"))
            continue
        _, phase, seconds = progress[w]
        action = straggler_action(replace_stragglers, live_spare)
        stragglers.append((w, seconds, action))
        if action == "replaced":
            fence.append((w, f"stuck in {phase} for {seconds:.1f} s (step watchdog)", "stuck"))
    return WatchdogFinding(plan.step, tuple(pending), progress, tuple(suspects), tuple(stragglers), tuple(fence))


class SlowSteps:
    """The controller's watch over slow steps (see the module docstring).

    ``opts``: the run's ``ControllerOptions``; ``live_spare()``: whether a live
    spare exists now; ``queued()``: the stragglers already waiting for a swap.
    """

    def __init__(self, group, events, opts, *, live_spare, queued):
        self.group, self.events, self.opts = group, events, opts
        self.live_spare, self.queued = live_spare, queued
        self.detector = StragglerDetector(StragglerPolicy(opts.straggler_factor, opts.straggler_patience))
        self.step_seconds: collections.deque = collections.deque(maxlen=20)
        self.last_commit = time.monotonic()

    def restart(self) -> None:
        """The next step is timed from now (after a start, a recovery or a boundary)."""
        self.last_commit = time.monotonic()

    def committed(self, recovered: bool) -> None:
        """A step was committed; one the recovery committed from recorded losses is not a step time."""
        now = time.monotonic()
        if not recovered:
            self.step_seconds.append(now - self.last_commit)
        self.last_commit = now

    def deadline(self) -> tuple[float, float] | tuple[None, None]:
        """``(monotonic deadline, median step seconds)`` of the watchdog for the step waited on now, or Nones
        until enough steps ran."""
        limit = watchdog_limit(self.step_seconds, self.opts.watchdog_factor, self.opts.watchdog_min_seconds)
        return (self.last_commit + limit[0], limit[1]) if limit else (None, None)

    def stalled(self, plan: StepPlan, pending, median: float) -> None:
        """The step watchdog fired: record what it found, keep the suspects' stacks (their events name the files)
        and fence out whom it names."""
        f = investigate(self.group, plan, pending, replace_stragglers=self.opts.replace_stragglers,
                        live_spare=self.live_spare())
        self.events.emit("step_watchdog", step=plan.step, seconds=time.monotonic() - self.last_commit,
                         median_seconds=median, pending=list(f.pending), suspects=list(f.suspects),
                         progress={w: list(p) for w, p in f.progress.items()})
        # Where each suspect is stuck, before it goes: its stacks, asked of all at once, bounded. Only of those that
        # answered Progress: one silent for its 2 s (stopped, its gRPC threads starved) would not answer this either,
        # and asking would only delay its recovery by the bound.
        kept = self.group.keep_stacks([w for w in f.suspects if w in f.progress], plan.step)
        for w, seconds, action in f.stragglers:
            self.events.emit("straggler", worker=w, step=plan.step, seconds=seconds, median_seconds=median,
                             action=action, **({"stacks": kept[w]} if w in kept else {}))
        for w, reason, cause in f.fence:
            self.group.declare_dead(w, reason, cause=cause, stacks=kept.get(w, ""))

    def observe(self, plan: StepPlan, results) -> None:
        """A committed step's grad seconds per microbatch, per worker: a straggler is reported or queued, with
        its stacks kept (where it is slow, in the step it runs now; bounded as the watchdog's)."""
        per_mb = {w: results[w].grad_seconds / max(len(ids), 1) for w, ids in plan.microbatches().items()}
        flagged = self.detector.observe(per_mb)
        kept = self.group.keep_stacks([w for w, _, _ in flagged], plan.step) if flagged else {}
        for w, seconds, median in flagged:
            action = straggler_action(self.opts.replace_stragglers, self.live_spare())
            queued = action == "replaced" and w not in self.queued()   # moved onto a spare at the next boundary
            self.events.emit("straggler", worker=w, step=plan.step, seconds=seconds, median_seconds=median,
                             action="replaced" if queued else "reported", **({"queued": True} if queued else {}),
                             **({"stacks": kept[w]} if w in kept else {}))
