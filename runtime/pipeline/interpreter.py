"""Executes a stage's instruction stream: one instruction at a time, over any transport.

A :class:`StageRunner` holds what one stage worker keeps during a step
(inputs kept for the backward, outputs waiting to be sent, gradients waiting
to be used) and runs one :class:`~runtime.pipeline.schedule.Instr` at a time
on its :class:`~runtime.worker.executor.SliceExecutor`. Transfers
go through a :class:`Transport`: ``send(to_stage, what, m, arrays)`` and
``recv(from_stage, what, m) -> arrays``. Sends go out where the stream puts
them; a receive is taken just before the compute that needs it, so a
transport that buffers (every one here does) never idles a stage on a value
the compiler's model of time expected earlier than it came. The same runner serves the
sequential one-process run (the global order) and the threaded one (a
stream per thread), both over :class:`LocalWire`, and a worker (the data
plane).

With a :class:`~runtime.core.timing.Clock`, a stage's step is laps of its own
between the computes' (``forward``, ``backward``): ``pipeline_wait`` (waiting
for a neighbour's activations or gradients) and ``pipeline_send`` (pushing to
a neighbour). ``busy`` and :attr:`StageRunner.stream_seconds` give the step's
measured bubble (:mod:`runtime.pipeline.bubble`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Protocol

import numpy as np

from runtime.core.microbatch import Node
from runtime.core.timing import Clock
from runtime.pipeline.schedule import ACT, BACKWARD, FORWARD, FREE, GRAD, LAST, RECV, SEND, Instr

__all__ = ["LocalWire", "StageRunner", "Transport"]


class Transport(Protocol):
    def send(self, src: int, dst: int, what: str, microbatch: int, arrays: list[np.ndarray]) -> None: ...

    def recv(self, dst: int, src: int, what: str, microbatch: int) -> list[np.ndarray]: ...


@dataclasses.dataclass
class StageRunner:
    """One stage's step in progress. ``vecs``: each microbatch's ``float32[P_k + 1]`` once its backward ran;
    ``peak_bytes``: the most activation bytes it held at once; ``busy``: seconds in forward and backward (the
    ``delay`` included: it stands for compute)."""

    stage: int
    executor: object            # a SliceExecutor (or anything with its forward/backward)
    step: int
    clock: Clock | None = None
    delay: float = 0.0          # extra seconds per forward, and per backward (a last counts both): for benchmarks
    vecs: dict = dataclasses.field(default_factory=dict)
    peak_bytes: int = 0
    busy: float = 0.0
    _held: dict = dataclasses.field(default_factory=dict)
    _due: list = dataclasses.field(default_factory=list)   # receives the stream reached, taken when needed
    _began: float | None = None   # perf_counter when its first instruction started
    _ended: float = 0.0           # and when its latest one ended

    def __post_init__(self):
        self._cond = threading.Condition()

    def _hold(self, key, arrays: list[np.ndarray]) -> None:
        with self._cond:
            self._held[key] = arrays
            self.peak_bytes = max(self.peak_bytes, sum(a.nbytes for v in self._held.values() for a in v))

    def deliver(self, src: int, what: str, microbatch: int, arrays: list[np.ndarray]) -> None:
        """A value sent to this stage arrives (it is held from now on)."""
        self._hold(("inbox", src, what, microbatch), arrays)
        with self._cond:
            self._cond.notify_all()

    def take(self, src: int, what: str, microbatch: int, timeout: float) -> list[np.ndarray]:
        key = ("inbox", src, what, microbatch)
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._held, timeout):
                raise TimeoutError(f"stage {self.stage} got no {what}[{microbatch}] from stage {src} in {timeout} s")
            return self._held.pop(key)

    @property
    def stream_seconds(self) -> float:
        """Seconds from the start of its first instruction to the end of its last (0 before any ran)."""
        return 0.0 if self._began is None else self._ended - self._began

    def run(self, instr: Instr, transport: Transport) -> None:
        if self._began is None:
            self._began = time.perf_counter()
        self._run(instr, transport)
        self._ended = time.perf_counter()

    def _run(self, instr: Instr, transport: Transport) -> None:
        k, m, ex = self.stage, instr.microbatch, self.executor
        if instr.op in (FORWARD, LAST, BACKWARD):   # take what it needs now, not where the stream said it comes
            for key in [key for key in self._due if key[2] == m and (key[1] == ACT) == (instr.op != BACKWARD)]:
                self._receive(key, transport)
            self._lap("pipeline_wait")
        if instr.op == FORWARD:
            t0 = time.perf_counter()
            self._pause(1)   # before the program, so that its lap counts it
            out = ex.forward(self.step, m, self._held.get(("in", m), []), self.clock)
            self.busy += time.perf_counter() - t0
            self._hold(("send", ACT, m), out)
        elif instr.op in (BACKWARD, LAST):
            t0 = time.perf_counter()
            with self._cond:
                g_out = self._held.pop(("g_out", m), [])
            self._pause(2 if instr.op == LAST else 1)
            vec, g_in = ex.backward(self.step, m, self._held.get(("in", m), []), g_out, self.clock)
            self.busy += time.perf_counter() - t0
            self.vecs[Node(0, m)] = vec
            if k > 0:
                self._hold(("send", GRAD, m), g_in)
        elif instr.op == FREE:
            with self._cond:
                self._held.pop(("in", m), None)
        elif instr.op == SEND:
            with self._cond:
                arrays = self._held.pop(("send", instr.what, m))
            transport.send(k, instr.peer, instr.what, m, arrays)
            self._lap("pipeline_send")
        elif instr.op == RECV:
            self._due.append((instr.peer, instr.what, m))
        else:
            raise ValueError(f"unknown pipeline instruction {instr}")

    def _receive(self, key: tuple, transport: Transport) -> None:
        self._due.remove(key)
        src, what, m = key
        arrays = transport.recv(self.stage, src, what, m)
        self._hold(("in", m) if what == ACT else ("g_out", m), arrays)

    def _lap(self, name: str) -> None:
        if self.clock is not None:
            self.clock.lap(name)

    def _pause(self, units: int) -> None:
        if self.delay:
            time.sleep(self.delay * units)


class LocalWire:
    """Transfers between the runners of one process: a send lands in the receiving runner's inbox (counted in
    what it holds); a receive waits for it at most ``timeout`` seconds (0: it must be there already)."""

    def __init__(self, runners: list[StageRunner], timeout: float = 300.0):
        self.runners, self.timeout = runners, timeout

    def send(self, src: int, dst: int, what: str, microbatch: int, arrays: list[np.ndarray]) -> None:
        self.runners[dst].deliver(src, what, microbatch, arrays)

    def recv(self, dst: int, src: int, what: str, microbatch: int) -> list[np.ndarray]:
        return self.runners[dst].take(src, what, microbatch, self.timeout)
