"""Straggler detection: a slice whose grad phase is far slower than its peers'.

Pure bookkeeping, no I/O: the controller feeds each committed step's
per-worker grad seconds per microbatch, and gets back the workers that were
more than ``factor`` times the median of the others for ``patience``
consecutive steps. A flagged worker is reported once per episode (its streak
restarts), so a slow host is not flagged again at every step.
"""

from __future__ import annotations

import dataclasses
import statistics

__all__ = ["StragglerPolicy", "StragglerDetector", "holding_up"]


@dataclasses.dataclass(frozen=True)
class StragglerPolicy:
    factor: float = 3.0        # slower than factor x median of the others
    patience: int = 3          # for this many consecutive steps
    min_seconds: float = 0.002  # ignore phases too short to time reliably


class StragglerDetector:
    def __init__(self, policy: StragglerPolicy):
        self.policy = policy
        self._streak: dict[str, int] = {}

    def observe(self, seconds: dict[str, float]) -> list[tuple[str, float, float]]:
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


def holding_up(progress: dict[str, tuple[int, str, float]], step: int) -> list[str]:
    """The workers holding up ``step``, from each worker's ``(step, phase, seconds in phase)``.

    A worker holds the step up when it is behind (still on an earlier step)
    or computing (``grad`` or ``apply``) while some peer is already done with
    its part (waiting in ``reduce``, or finished). When every worker is in
    the same state, no one is singled out: the step is slow, not a worker.
    """
    behind = {w for w, (s, phase, _) in progress.items() if s < step or (s == step and phase in ("grad", "apply"))}
    return sorted(behind) if behind and len(behind) < len(progress) else []
