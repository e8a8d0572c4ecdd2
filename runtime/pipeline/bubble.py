"""The pipeline bubble, theoretical and measured (pure): one definition for the model of time, the one-process
benchmark and stage workers.

The bubble is the idle fraction of a pipeline replica's ``S`` stages over a
step: ``1 - sum(busy) / (S x step seconds)``, where ``busy`` is each stage's
seconds computing (forward, backward, last) and the step lasts as long as the
slowest stage's stream. With equal per-stage costs GPipe and 1F1B both idle
``(S - 1) / (M + S - 1)`` of it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["measured_bubble", "stage_workers_bubble", "theoretical_bubble"]


def theoretical_bubble(num_stages: int, num_microbatches: int) -> float:
    """The idle fraction of GPipe and 1F1B with equal per-stage costs: (S - 1) / (M + S - 1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def measured_bubble(busy: Sequence[float], seconds: float) -> float:
    """The idle fraction of one pipeline replica whose stages computed ``busy[k]`` seconds each in a step of
    ``seconds``: ``1 - sum(busy) / (S x seconds)``. ``ValueError`` unless ``seconds > 0``."""
    if not seconds > 0:
        raise ValueError(f"a step of {seconds} seconds has no bubble")
    return 1.0 - sum(busy) / (len(busy) * seconds)


def stage_workers_bubble(busy: Sequence[Sequence[float]], stream: Sequence[Sequence[float]]) -> float | None:
    """A step's bubble on stage workers: ``busy[k][r]`` and ``stream[k][r]`` are the compute seconds and the
    stream seconds (its first instruction to its last) of stage ``k``'s worker in pipeline replica ``r``.

    Each replica's bubble counts its stages' busy seconds against its slowest stage's stream; the step's is
    their mean over the replicas. None when a replica's streams took no time (a worker that reported none).
    """
    replicas = list(zip(*busy)), list(zip(*stream))
    if not replicas[0] or any(max(s) <= 0 for s in replicas[1]):
        return None
    bubbles = [measured_bubble(b, max(s)) for b, s in zip(*replicas)]
    return sum(bubbles) / len(bubbles)
