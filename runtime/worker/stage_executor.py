"""Runs one pipeline stage's programs (:class:`~runtime.core.stage_programs.StagePrograms`) on local devices.

A :class:`~runtime.worker.executor.SliceExecutor` whose grad program is
replaced by the stage's forward and backward (or last) programs. Activations
and their gradients cross between stages as host arrays (as they cross the
wire between workers), so a stage's inputs are placed on its own mesh.
Within a step each microbatch's batch is loaded once, for its forward and its
backward.
"""

from __future__ import annotations

import jax
import numpy as np

from runtime.core.stage_programs import StagePrograms
from runtime.core.timing import Clock
from runtime.worker.executor import SliceExecutor

__all__ = ["StageExecutor"]


class StageExecutor(SliceExecutor):
    """One replica of one stage's state; call :meth:`load`, :meth:`init`, then steps of forward/backward/apply."""

    def __init__(self, programs: StagePrograms, data_source, devices=None):
        super().__init__(programs, data_source, devices)
        self._batches: dict[tuple[int, int], dict] = {}

    def _batch(self, step: int, microbatch: int) -> dict:
        key = (step, microbatch)
        if key not in self._batches:
            self._batches[key] = self.data.batch(step, microbatch)
        return self._batches[key]

    def forward(self, step: int, microbatch: int, a_in: list, clock: Clock | None = None) -> list[np.ndarray]:
        """This stage's output activations for one microbatch, on the host."""
        out = self._call("forward", self.state, self._batch(step, microbatch), *([list(a_in)] if a_in else []))
        return _host(out, clock, "forward")

    def backward(self, step: int, microbatch: int, a_in: list, g_out: list,
                 clock: Clock | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
        """``(float32[P_k + 1], gradient of the input)`` of one microbatch (the last stage: from its loss)."""
        batch = self._batch(step, microbatch)
        if self.programs.is_last:
            vec, g_in = self._call("last", self.state, batch, list(a_in))
        else:
            vec, g_in = self._call("backward", self.state, batch, *([list(a_in)] if a_in else []), list(g_out))
        self._batches.pop((step, microbatch), None)
        vec, *g_in = _host([vec, *g_in], clock, "backward")
        return vec, g_in

    def apply(self, grad_sum: np.ndarray, clock: Clock | None = None) -> None:
        self._batches.clear()
        super().apply(grad_sum, clock)


def _host(arrays, clock: Clock | None, lap: str) -> list[np.ndarray]:
    arrays = list(arrays)
    jax.block_until_ready(arrays)
    out = [np.asarray(a) for a in arrays]
    if clock is not None:
        clock.lap(lap)
    return out
