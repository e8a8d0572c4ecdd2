"""Microbatch assignment and the canonical reduction tree (pure).

The global batch of a step is microbatches ``0..M-1`` (M a power of two). The
canonical reduction sums them in a fixed pairwise tree over the ids::

    sum(0..7) = (((0+1)+(2+3)) + ((4+5)+(6+7)))

A :class:`Node` names one aligned subtree. The scheduler gives each active
slice contiguous ids cut into maximal aligned subtrees; a slice sums each of its
subtrees locally, and whoever combines the partials does so by walking the same
tree. Floating-point addition is then applied in the same order whatever the
number of slices, so 1, 2, 3 or 4 slices give the same bits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

__all__ = ["Node", "assign_microbatches", "decompose", "is_power_of_two", "root", "tree_reduce", "tree_sum"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, order=True)
class Node:
    """The aligned subtree of ids ``[index * 2**level, (index + 1) * 2**level)``."""

    level: int
    index: int

    @property
    def start(self) -> int:
        return self.index << self.level

    @property
    def size(self) -> int:
        return 1 << self.level

    @property
    def ids(self) -> range:
        return range(self.start, self.start + self.size)

    def children(self) -> tuple[Node, Node]:
        if self.level == 0:
            raise ValueError(f"leaf {self} has no children")
        return Node(self.level - 1, 2 * self.index), Node(self.level - 1, 2 * self.index + 1)


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def root(num_microbatches: int) -> Node:
    if not is_power_of_two(num_microbatches):
        raise ValueError(f"microbatch count must be a power of two, got {num_microbatches}")
    return Node(num_microbatches.bit_length() - 1, 0)


def decompose(start: int, stop: int) -> list[Node]:
    """Cuts ids ``[start, stop)`` into maximal aligned subtrees, left to right."""
    nodes = []
    while start < stop:
        level = 0
        # Grow while the block stays aligned at `start` and inside the range.
        while start % (1 << (level + 1)) == 0 and start + (1 << (level + 1)) <= stop:
            level += 1
        nodes.append(Node(level, start >> level))
        start += 1 << level
    return nodes


def assign_microbatches(num_microbatches: int, num_slices: int) -> list[list[Node]]:
    """Splits ``0..M-1`` into ``num_slices`` contiguous, balanced runs of subtrees.

    Slice ``r`` gets the ``r``-th run (sizes differ by at most one). Raises
    ``ValueError`` if M is not a power of two or there are more slices than
    microbatches (a slice would have nothing to do).
    """
    root(num_microbatches)
    if not 1 <= num_slices <= num_microbatches:
        raise ValueError(f"need 1 <= slices <= microbatches, got {num_slices} slices for {num_microbatches}")
    base, extra = divmod(num_microbatches, num_slices)
    out, start = [], 0
    for r in range(num_slices):
        stop = start + base + (1 if r < extra else 0)
        out.append(decompose(start, stop))
        start = stop
    return out


def tree_reduce(partials: Mapping[Node, T], top: Node, add: Callable[[T, T], T]) -> T:
    """Combines ``partials`` (disjoint subtrees covering ``top``) in canonical order."""
    if top in partials:
        return partials[top]
    if top.level == 0:
        raise KeyError(f"no partial covers microbatch {top.start}")
    left, right = top.children()
    return add(tree_reduce(partials, left, add), tree_reduce(partials, right, add))


def tree_sum(values: Sequence[T], add: Callable[[T, T], T]) -> T:
    """Pairwise tree sum of a power-of-two-long sequence of leaf values."""
    n = len(values)
    return tree_reduce({Node(0, i): v for i, v in enumerate(values)}, root(n), add)
