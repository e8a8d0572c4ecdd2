"""A pipelined run in one process: the ground truth for a pipelined run on workers.

One :class:`~runtime.worker.stage_executor.StageExecutor` per stage runs
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
import threading
import time
from collections.abc import Callable

import numpy as np

from runtime.core.microbatch import assign_microbatches, root, tree_reduce
from runtime.core.stage_programs import PipelineProgramSet
from runtime.core.timing import Clock
from runtime.pipeline.bubble import measured_bubble
from runtime.pipeline.interpreter import LocalWire, StageRunner
from runtime.pipeline.schedule import compile_schedule
from runtime.worker.executor import add_f32
from runtime.worker.stage_executor import StageExecutor

__all__ = ["LocalPipeline", "StepTrace", "run_local_pipeline"]


@dataclasses.dataclass
class StepTrace:
    """What one step cost each stage: the most activation bytes alive at once (inputs kept for the backward,
    outputs not yet sent, gradients not yet used) and seconds spent computing; the step's wall seconds."""

    peak_bytes: list[int]
    busy: list[float]
    seconds: float

    @property
    def bubble(self) -> float:
        """The idle fraction over all stages (:func:`runtime.pipeline.bubble.measured_bubble` over the step)."""
        return measured_bubble(self.busy, self.seconds)


class LocalPipeline:
    def __init__(self, programs: PipelineProgramSet, data_source, *, replicas: int = 1, schedule: str = "1f1b",
                 devices=None):
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

    def step(self, step: int, clock: Clock | None = None, *, threads: bool = False,
             delay: float = 0.0) -> tuple[float, StepTrace]:
        """Runs one step; returns (its mean loss, what it cost).

        Sequentially in the schedules' global order (the default), or with
        ``threads`` each stage's stream on its own thread, as stage workers
        run them (then ``delay`` adds seconds per forward and per backward:
        a stand-in for a slower device, to measure the schedule's bubble).
        """
        t0 = time.perf_counter()
        runners = []
        for sched in self.schedules:
            rs = [StageRunner(k, ex, step, clock, delay) for k, ex in enumerate(self.stages)]
            runners.append(rs)
            if threads:
                _threaded(rs, sched.streams)
            else:
                wire = LocalWire(rs, timeout=0.0)   # the global order sends before it receives
                for k, instr in sched.order:
                    rs[k].run(instr, wire)
        seconds = time.perf_counter() - t0
        top = root(self.programs.num_microbatches)
        totals = [tree_reduce({n: v for rs in runners for n, v in rs[k].vecs.items()}, top, add_f32)
                  for k in range(len(self.stages))]
        for ex, total in zip(self.stages, totals):
            ex.apply(total[:-1], clock)
        trace = StepTrace([max(rs[k].peak_bytes for rs in runners) for k in range(len(self.stages))],
                          [sum(rs[k].busy for rs in runners) for k in range(len(self.stages))], seconds)
        return float(totals[-1][-1] / np.float32(self.programs.num_microbatches)), trace

    def digests(self) -> list[str]:
        """Each stage's state digest (the same on every replica of that stage)."""
        return [ex.state_digest() for ex in self.stages]

    def train(self, *, steps: int, seed: int, start_step: int = 0, threads: bool = False,
              on_step: Callable[[int, float], None] | None = None) -> tuple[list[float], list[str]]:
        """Initializes from ``seed`` and trains ``steps`` steps (see :meth:`step`); returns (per-step mean
        losses, each stage's final digest)."""
        self.init(seed)
        losses = []
        for step in range(start_step, start_step + steps):
            loss, _ = self.step(step, threads=threads)
            losses.append(loss)
            if on_step is not None:
                on_step(step, loss)
        return losses, self.digests()


def _threaded(runners: list[StageRunner], streams) -> None:
    """Each stage's stream on its own thread, queues between them; re-raises the first failure."""
    wire, errors = LocalWire(runners), []

    def run(runner, stream):
        try:
            for instr in stream:
                runner.run(instr, wire)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append(e)
    threads = [threading.Thread(target=run, args=(r, s), name=f"stage-{r.stage}") for r, s in zip(runners, streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def run_local_pipeline(programs: PipelineProgramSet, data_source, *, steps: int, seed: int, replicas: int = 1,
                       schedule: str = "1f1b", on_step: Callable[[int, float], None] | None = None,
                       start_step: int = 0) -> tuple[list[float], list[str]]:
    """Trains ``steps`` steps in this process; returns (per-step mean losses, each stage's final digest)."""
    run = LocalPipeline(programs, data_source, replicas=replicas, schedule=schedule)
    run.load()
    return run.train(steps=steps, seed=seed, start_step=start_step, on_step=on_step)
