"""The step watchdog: when a step is far slower than usual, find who holds it up.

Called by the controller when :meth:`WorkerGroup.wait` answers ``Stalled``
(the step ran past :func:`runtime.control.policy.watchdog_limit`). It asks every
worker of the step where it is (``Progress``), probes the suspects, and
returns a :class:`WatchdogFinding`: the event to record, the stragglers to
report, and the workers to fence out. It records nothing and declares no one
dead itself; the controller carries the finding out.
"""

from __future__ import annotations

import dataclasses

from runtime.control.policy import StepPlan, holding_up, straggler_action

__all__ = ["WatchdogFinding", "investigate"]


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
