"""The canonical math in one process, without workers: the ground truth.

Runs the same exported programs through the same :class:`SliceExecutor` as a
worker, sums all M microbatches in the canonical tree, and applies. A
distributed run of the same programs must match it bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from runtime.executor import SliceExecutor
from runtime.microbatch import root
from runtime.programs import ProgramSet

__all__ = ["run_reference"]


def run_reference(programs: ProgramSet, data_source, *, steps: int, seed: int,
                  on_step: Callable[[int, float], None] | None = None, start_step: int = 0) -> tuple[list[float], str]:
    """Trains ``steps`` steps; returns (per-step mean losses, final state sha256)."""
    ex = SliceExecutor(programs, data_source)
    ex.load()
    ex.init(seed)
    top = root(programs.num_microbatches)
    losses = []
    for step in range(start_step, start_step + steps):
        total = ex.partials(step, [top])[top]
        ex.apply(total[:-1])
        loss = float(total[-1] / np.float32(programs.num_microbatches))
        losses.append(loss)
        if on_step is not None:
            on_step(step, loss)
    return losses, ex.state_sha256()
