"""Slow steps: the step watchdog (a step far slower than usual: find who holds it up) and stragglers.

:func:`investigate` runs when :meth:`WorkerGroup.wait` answers ``Stalled``
(the step ran past :func:`runtime.control.policy.watchdog_limit`). It asks every
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
import time

from runtime.control.policy import (StepPlan, StragglerDetector, StragglerPolicy, holding_up, straggler_action,
                                    watchdog_limit)

__all__ = ["SlowSteps", "WatchdogFinding", "investigate"]


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
        """The step watchdog fired: record what it found and fence out whom it names."""
        f = investigate(self.group, plan, pending, replace_stragglers=self.opts.replace_stragglers,
                        live_spare=self.live_spare())
        self.events.emit("step_watchdog", step=plan.step, seconds=time.monotonic() - self.last_commit,
                         median_seconds=median, pending=list(f.pending), suspects=list(f.suspects),
                         progress={w: list(p) for w, p in f.progress.items()})
        for w, seconds, action in f.stragglers:
            self.events.emit("straggler", worker=w, step=plan.step, seconds=seconds, median_seconds=median,
                             action=action)
        for w, reason, cause in f.fence:
            self.group.declare_dead(w, reason, cause=cause)

    def observe(self, plan: StepPlan, results) -> None:
        """A committed step's grad seconds per microbatch, per worker: a straggler is reported or queued."""
        per_mb = {w: results[w].grad_seconds / max(len(ids), 1) for w, ids in plan.microbatches().items()}
        for w, seconds, median in self.detector.observe(per_mb):
            action = straggler_action(self.opts.replace_stragglers, self.live_spare())
            queued = action == "replaced" and w not in self.queued()   # moved onto a spare at the next boundary
            self.events.emit("straggler", worker=w, step=plan.step, seconds=seconds, median_seconds=median,
                             action="replaced" if queued else "reported", **({"queued": True} if queued else {}))
