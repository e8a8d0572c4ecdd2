"""A pipelined run in one process: the ground truth for a pipelined run on workers.

One :class:`~runtime.pipeline.stage_executor.StageExecutor` per stage runs
every replica's share of the microbatches by following each replica's
compiled schedule in its global order (:mod:`runtime.pipeline.schedule`),
handing activations and gradients between stages as host arrays. Each
stage's per-microbatch gradients are summed in the canonical tree over all
microbatch ids (:mod:`runtime.core.microbatch`), so the result is the same
bits for any number of replicas and either schedule: both only change who
computes a microbatch and when, never the arithmetic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from runtime.core.microbatch import Node, assign_microbatches, root, tree_reduce
from runtime.core.stage_programs import PipelineProgramSet
from runtime.core.timing import Clock
from runtime.pipeline.schedule import ACT, BACKWARD, FORWARD, FREE, GRAD, LAST, RECV, SEND, compile_schedule
from runtime.worker.executor import add_f32

__all__ = ["LocalPipeline", "StepTrace", "run_local_pipeline"]


@dataclasses.dataclass
class StepTrace:
    """What one step held: per stage, the most activation bytes alive at once (inputs kept for the backward,
    outputs not yet sent, gradients not yet used)."""

    peak_bytes: list[int]


class LocalPipeline:
    def __init__(self, programs: PipelineProgramSet, data_source, *, replicas: int = 1, schedule: str = "1f1b",
                 devices=None):
        from runtime.pipeline.stage_executor import StageExecutor

        self.programs = programs
        self.stages = [StageExecutor(p, data_source, devices) for p in programs.stages]
        self.replan(replicas, schedule)

    def replan(self, replicas: int, schedule: str) -> None:
        """Runs the next steps on ``replicas`` pipeline replicas under ``schedule`` (the same math)."""
        self.replicas, self.kind = replicas, schedule
        self.schedules = [compile_schedule(schedule, self.programs.num_stages, [i for n in nodes for i in n.ids])
                          for nodes in assign_microbatches(self.programs.num_microbatches, replicas)]

    def load(self) -> None:
        for ex in self.stages:
            ex.load()

    def init(self, seed: int) -> None:
        for ex in self.stages:
            ex.init(seed)

    def step(self, step: int, clock: Clock | None = None) -> tuple[float, StepTrace]:
        """Runs one step; returns (its mean loss, what it held)."""
        vecs: list[dict[Node, np.ndarray]] = [{} for _ in self.stages]
        trace = StepTrace([0] * len(self.stages))
        for sched in self.schedules:
            self._run(step, sched.order, vecs, trace, clock)
        top = root(self.programs.num_microbatches)
        totals = [tree_reduce(v, top, add_f32) for v in vecs]
        for ex, total in zip(self.stages, totals):
            ex.apply(total[:-1], clock)
        return float(totals[-1][-1] / np.float32(self.programs.num_microbatches)), trace

    def _run(self, step: int, order, vecs, trace: StepTrace, clock) -> None:
        held: list[dict[tuple, list[np.ndarray]]] = [{} for _ in self.stages]   # per stage: what it holds now
        wire: dict[tuple, list[np.ndarray]] = {}

        def hold(k: int, key: tuple, arrays: list[np.ndarray]) -> None:
            held[k][key] = arrays
            trace.peak_bytes[k] = max(trace.peak_bytes[k], sum(a.nbytes for v in held[k].values() for a in v))

        for k, instr in order:
            ex, m = self.stages[k], instr.microbatch
            if instr.op == FORWARD:
                a_in = held[k].get(("in", m), [])
                hold(k, ("send", ACT, m), ex.forward(step, m, a_in, clock))
            elif instr.op in (BACKWARD, LAST):
                g_out = held[k].pop(("g_out", m), [])
                vec, g_in = ex.backward(step, m, held[k].get(("in", m), []), g_out, clock)
                vecs[k][Node(0, m)] = vec
                if k > 0:
                    hold(k, ("send", GRAD, m), g_in)
            elif instr.op == FREE:
                held[k].pop(("in", m), None)
            elif instr.op == SEND:
                wire[(instr.peer, instr.what, m)] = held[k].pop(("send", instr.what, m))
            elif instr.op == RECV:
                arrays = wire.pop((k, instr.what, m))
                hold(k, ("in", m) if instr.what == ACT else ("g_out", m), arrays)
            else:
                raise AssertionError(f"unknown instruction {instr}")

    def digests(self) -> list[str]:
        """Each stage's state digest (the same on every replica of that stage)."""
        return [ex.state_digest() for ex in self.stages]

    def train(self, *, steps: int, seed: int, start_step: int = 0,
              on_step: Callable[[int, float], None] | None = None) -> tuple[list[float], list[str]]:
        """Initializes from ``seed`` and trains ``steps`` steps; returns (per-step mean losses, each stage's
        final digest)."""
        self.init(seed)
        losses = []
        for step in range(start_step, start_step + steps):
            loss, _ = self.step(step)
            losses.append(loss)
            if on_step is not None:
                on_step(step, loss)
        return losses, self.digests()


def run_local_pipeline(programs: PipelineProgramSet, data_source, *, steps: int, seed: int, replicas: int = 1,
                       schedule: str = "1f1b", on_step: Callable[[int, float], None] | None = None,
                       start_step: int = 0) -> tuple[list[float], list[str]]:
    """Trains ``steps`` steps in this process; returns (per-step mean losses, each stage's final digest)."""
    run = LocalPipeline(programs, data_source, replicas=replicas, schedule=schedule)
    run.load()
    return run.train(steps=steps, seed=seed, start_step=start_step, on_step=on_step)
