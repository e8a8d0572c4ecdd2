"""Runs pipeline instruction streams on a model of time (pure): makespan, idle time, live activations, deadlock.

Each stage worker executes its stream in order. A compute takes
``durations(stage, instr)``; a transfer takes ``transfer`` seconds and,
with ``rendezvous=True``, starts only when the sender is at its ``send``
and the receiver at its ``recv`` (as a send with no buffer space waits,
e.g. a flow-controlled stream); with ``rendezvous=False`` a send never
waits. Streams that can never finish raise :class:`Deadlock` naming what
each stuck worker waits for.

``live`` counts activation-sized arrays a stage holds: inputs kept from a
forward until their ``free``, outputs not yet sent, gradients received and
not yet used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from runtime.pipeline.bubble import measured_bubble
from runtime.pipeline.schedule import ACT, BACKWARD, FORWARD, FREE, GRAD, LAST, RECV, SEND, Instr

__all__ = ["Deadlock", "Timeline", "simulate"]


class Deadlock(RuntimeError):
    """Every unfinished worker waits on a transfer its peer will never reach."""


@dataclasses.dataclass(frozen=True)
class Timeline:
    makespan: float
    busy: tuple[float, ...]        # per stage: seconds computing
    peak_live: tuple[int, ...]     # per stage: most activation-sized arrays held at once

    @property
    def bubble(self) -> float:
        """The idle fraction over all stages (:func:`runtime.pipeline.bubble.measured_bubble` over the makespan)."""
        return measured_bubble(self.busy, self.makespan)


def simulate(streams: Sequence[Sequence[Instr]], durations: Callable[[int, Instr], float], *,
             transfer: float = 0.0, rendezvous: bool = True) -> Timeline:
    n = len(streams)
    pc, clock, busy = [0] * n, [0.0] * n, [0.0] * n
    live, peak = [0] * n, [0] * n
    sent: dict[tuple[int, int, str, int], float] = {}   # buffered sends: (src, dst, what, m) -> arrival time

    def hold(k: int, delta: int) -> None:
        live[k] += delta
        peak[k] = max(peak[k], live[k])

    def step(k: int) -> bool:
        """Runs worker ``k``'s next instruction if it can; returns whether it did."""
        instr = streams[k][pc[k]]
        if instr.op in (FORWARD, BACKWARD, LAST):
            d = durations(k, instr)
            clock[k] += d
            busy[k] += d
            if instr.op == FORWARD:
                hold(k, 1 if k + 1 < n else 0)            # the output, until sent
            if instr.op == BACKWARD:
                hold(k, -1)                                # the received gradient is used
        elif instr.op == FREE:
            hold(k, -1 if k > 0 else 0)                    # the stage input kept for the backward
        elif instr.op == SEND:
            key = (k, instr.peer, instr.what, instr.microbatch)
            if rendezvous:
                peer = instr.peer
                want = Instr(RECV, instr.microbatch, instr.what, k)
                if pc[peer] >= len(streams[peer]) or streams[peer][pc[peer]] != want:
                    return False
                clock[k] = clock[peer] = max(clock[k], clock[peer]) + transfer
                hold(peer, 1)                              # an input (kept until its free) or a gradient
                pc[peer] += 1
            else:
                sent[key] = clock[k] + transfer
            hold(k, -1 if instr.what == ACT else 0)
        elif instr.op == RECV:
            if rendezvous:
                return False                               # completed by the sender's step
            key = (instr.peer, k, instr.what, instr.microbatch)
            if key not in sent:
                return False
            clock[k] = max(clock[k], sent.pop(key))
            hold(k, 1)
        pc[k] += 1
        return True

    while any(pc[k] < len(streams[k]) for k in range(n)):
        moved = False
        for k in range(n):
            while pc[k] < len(streams[k]) and step(k):
                moved = True
        if not moved:
            stuck = "; ".join(f"stage {k} at {streams[k][pc[k]]}" for k in range(n) if pc[k] < len(streams[k]))
            raise Deadlock(f"no stage can move: {stuck}")
    return Timeline(max(clock), tuple(busy), tuple(peak))

