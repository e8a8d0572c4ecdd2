"""Where a worker's step goes: seconds per named phase, for the step reply and the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

__all__ = ["Clock", "slowest_phases"]


class Clock:
    """Accumulates seconds per named phase: :meth:`lap` charges the time since the last lap to ``name``.

    One clock per step, used by one thread at a time (the step's).
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now


def slowest_phases(per_worker: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Each phase's longest time over the workers of one step (a step waits for its slowest worker)."""
    out: dict[str, float] = {}
    for phases in per_worker:
        for name, seconds in phases.items():
            out[name] = max(out.get(name, 0.0), seconds)
    return out
