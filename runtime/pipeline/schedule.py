"""Pipeline schedules compiled into one central order: an instruction stream per stage worker (pure).

A pipeline replica is S stage workers that process a list of microbatches.
A schedule policy fixes the order of each stage's compute:

- ``gpipe``: every forward, then every backward (each stage holds all its
  microbatches' inputs at once);
- ``1f1b`` (PipeDream-flush): ``S - 1 - k`` forwards on stage ``k``, then one
  forward and one backward alternately, then the remaining backwards (a stage
  holds at most ``S - k`` inputs).

The last stage runs forward, loss and backward of a microbatch as one
program (``last``); so a single stage (data parallelism alone) runs only that. The compiler then runs the policy on a model of time
(:class:`Costs`) to get one global order of every compute and every transfer,
and projects it onto each stage: a transfer appears in its sender's stream as
``send`` and in its receiver's as ``recv``, at the same place in the global
order. Any projection of one sequential order is deadlock-free even when a
send waits for its receive (a rendezvous): the earliest unfinished event in
the global order always has every participant ready. Streams ordered by each
worker alone (send when the value is ready, receive when it is needed) can
deadlock (``tests/unit/test_pipeline_schedule.py`` shows one);
:mod:`runtime.pipeline.simulate` runs streams either way.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

__all__ = ["Instr", "Costs", "Schedule", "SCHEDULES", "compile_schedule", "compute_order"]

SCHEDULES = ("gpipe", "1f1b")

FORWARD, BACKWARD, LAST, SEND, RECV, FREE = "forward", "backward", "last", "send", "recv", "free"
ACT, GRAD = "act", "grad"   # what a transfer carries: a stage's output activations, or their gradient


@dataclasses.dataclass(frozen=True)
class Instr:
    """One instruction of a stage's stream. ``what``/``peer``: a transfer's payload and the other stage."""

    op: str
    microbatch: int
    what: str = ""
    peer: int = -1

    def __str__(self) -> str:
        if self.op in (SEND, RECV):
            return f"{self.op} {self.what}[{self.microbatch}] {'to' if self.op == SEND else 'from'} {self.peer}"
        return f"{self.op}[{self.microbatch}]"


@dataclasses.dataclass(frozen=True)
class Costs:
    """The model of time the compiler orders by (any positive numbers give a deadlock-free order)."""

    forward: float = 1.0
    backward: float = 2.0

    @property
    def last(self) -> float:
        return self.forward + self.backward


@dataclasses.dataclass(frozen=True)
class Schedule:
    kind: str
    microbatches: tuple[int, ...]
    streams: tuple[tuple[Instr, ...], ...]       # stage -> its instructions, in order
    order: tuple[tuple[int, Instr], ...]         # the global order: (stage, instruction); a transfer twice, adjacent

    @property
    def num_stages(self) -> int:
        return len(self.streams)


def compute_order(kind: str, num_stages: int, stage: int, microbatches: Sequence[int]) -> list[Instr]:
    """Stage ``stage``'s compute instructions under policy ``kind``, in order."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {kind!r}: choose one of {', '.join(SCHEDULES)}")
    mbs = list(microbatches)
    if stage == num_stages - 1:
        return [Instr(LAST, m) for m in mbs]
    fwd = [Instr(FORWARD, m) for m in mbs]
    bwd = [Instr(BACKWARD, m) for m in mbs]
    if kind == "gpipe":
        return fwd + bwd
    warm = min(num_stages - 1 - stage, len(mbs))
    out = fwd[:warm]
    for f, b in zip(fwd[warm:], bwd):
        out += [f, b]
    return out + bwd[len(mbs) - warm:]


def compile_schedule(kind: str, num_stages: int, microbatches: Sequence[int], costs: Costs = Costs()) -> Schedule:
    """The central order of one pipeline replica over ``microbatches``, and each stage's stream (one stage, an
    unpipelined replica: each microbatch's ``last``, the whole gradient, in order, whatever the policy)."""
    if num_stages < 1:
        raise ValueError(f"a pipeline has at least 1 stage, got {num_stages}")
    if min(costs.forward, costs.backward) <= 0:
        raise ValueError(f"costs must be positive, got {costs}")
    if not microbatches or len(set(microbatches)) != len(microbatches):
        raise ValueError(f"a pipeline replica needs distinct microbatches, got {list(microbatches)}")
    s_count = num_stages
    todo = [compute_order(kind, s_count, k, microbatches) for k in range(s_count)]
    pc = [0] * s_count
    free_at = [0.0] * s_count        # when each stage's device is next idle
    ready: dict[tuple[int, str, int], float] = {}   # (stage, ACT|GRAD, m) -> when its input reached that stage
    events: list[tuple[float, int, int, int, Instr]] = []   # (time, rank, seq, stage, instr): the global order
    seq = 0

    def emit(t: float, rank: int, stage: int, instr: Instr) -> None:
        nonlocal seq
        heapq.heappush(events, (t, rank, seq, stage, instr))
        seq += 1

    while any(pc[k] < len(todo[k]) for k in range(s_count)):
        best = None   # the runnable compute that starts first (ties: lower stage)
        for k in range(s_count):
            if pc[k] == len(todo[k]):
                continue
            start = _start(todo[k][pc[k]], k, free_at[k], ready)
            if start is not None and (best is None or start < best[0]):
                best = (start, k)
        if best is None:
            raise AssertionError(f"schedule {kind} cannot make progress at {pc}")   # a policy bug, never input
        start, k = best
        instr = todo[k][pc[k]]
        pc[k] += 1
        cost = {FORWARD: costs.forward, BACKWARD: costs.backward, LAST: costs.last}[instr.op]
        end = free_at[k] = start + cost
        emit(start, 1, k, instr)
        m = instr.microbatch
        if instr.op in (BACKWARD, LAST):
            emit(end, 0, k, Instr(FREE, m))
        if instr.op == FORWARD:            # the output goes to the next stage as soon as it exists
            ready[(k + 1, ACT, m)] = end
            emit(end, 0, k, Instr(SEND, m, ACT, k + 1))
        elif k > 0:                        # a backward (or last) sends its input's gradient back
            ready[(k - 1, GRAD, m)] = end
            emit(end, 0, k, Instr(SEND, m, GRAD, k - 1))
    order: list[tuple[int, Instr]] = []
    while events:
        _, _, _, k, instr = heapq.heappop(events)
        order.append((k, instr))
        if instr.op == SEND:   # the receive sits right after its send in the global order
            order.append((instr.peer, Instr(RECV, instr.microbatch, instr.what, k)))
    streams = tuple(tuple(i for k2, i in order if k2 == k) for k in range(s_count))
    return Schedule(kind, tuple(microbatches), streams, tuple(order))


def _start(instr: Instr, k: int, free_at: float, ready: dict) -> float | None:
    """When stage ``k`` can start ``instr`` (None: its input has not been produced yet)."""
    m = instr.microbatch
    need = []
    if instr.op in (FORWARD, LAST) and k > 0:
        need.append((k, ACT, m))
    if instr.op == BACKWARD:
        need.append((k, GRAD, m))
    times = [ready.get(n) for n in need]
    if any(t is None for t in times):
        return None
    return max([free_at, *times])
