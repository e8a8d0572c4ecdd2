import numpy as np
import pytest

from runtime.worker.executor import add_f32
from runtime.core.microbatch import Node, assign_microbatches, decompose, root, tree_reduce, tree_sum


def test_decompose_gives_maximal_aligned_blocks():
    assert decompose(0, 8) == [Node(3, 0)]
    assert decompose(0, 3) == [Node(1, 0), Node(0, 2)]
    assert decompose(3, 8) == [Node(0, 3), Node(2, 1)]
    for start in range(16):
        for stop in range(start, 17):
            ids = [i for n in decompose(start, stop) for i in n.ids]
            assert ids == list(range(start, stop))
            assert all(n.start % n.size == 0 for n in decompose(start, stop))


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_assignment_covers_every_microbatch_once_and_balances(m):
    for n in range(1, m + 1):
        parts = assign_microbatches(m, n)
        ids = [i for nodes in parts for node in nodes for i in node.ids]
        assert ids == list(range(m))
        sizes = [sum(node.size for node in nodes) for nodes in parts]
        assert max(sizes) - min(sizes) <= 1


def test_assignment_rejects_bad_counts():
    with pytest.raises(ValueError, match="power of two"):
        assign_microbatches(6, 2)
    with pytest.raises(ValueError, match="slices"):
        assign_microbatches(4, 5)
    with pytest.raises(ValueError, match="slices"):
        assign_microbatches(4, 0)


@pytest.mark.parametrize("m", [4, 8, 16])
def test_partial_sums_give_the_same_bits_for_any_slice_count(m):
    rng = np.random.default_rng(0)
    # Values of very different magnitude make float addition order visible.
    leaves = [(rng.standard_normal(257) * 10.0 ** rng.integers(-6, 6)).astype(np.float32) for _ in range(m)]
    want = tree_sum(leaves, add_f32)
    naive = leaves[0]
    for x in leaves[1:]:
        naive = add_f32(naive, x)
    assert not np.array_equal(naive, want), "test data must be order-sensitive"
    for n in range(1, m + 1):
        partials = {}
        for nodes in assign_microbatches(m, n):
            for node in nodes:
                partials[node] = tree_reduce({Node(0, i): leaves[i] for i in node.ids}, node, add_f32)
        got = tree_reduce(partials, root(m), add_f32)
        assert got.tobytes() == want.tobytes(), f"{n} slices changed the bits"


def test_tree_reduce_reports_a_gap():
    with pytest.raises(KeyError, match="microbatch 1"):
        tree_reduce({Node(0, 0): 1.0}, Node(1, 0), lambda a, b: a + b)
