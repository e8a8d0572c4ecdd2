"""Checkpoints of slices of several hosts (runtime.state.checkpoint_hosts): each host's blocks in a store of its
own, a step listed once every host's is there, and any host count reading any other's, to the bit (real orbax,
a local directory)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.core.hosts import join_blocks, take_blocks
from runtime.state import checkpoint_hosts
from runtime.state.checkpoint import CheckpointStore
from runtime.state.checkpoint_hosts import host_directory, layouts, restore_for_host, steps
from runtime.state.checkpoint_record import CheckpointNotFoundError
from runtime.state.state_copy import state_digest

DIMS = [0, None, 1, None]   # a leaf split by rows, a replicated one, one split by columns, a scalar


def whole(step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(step)
    return [rng.standard_normal((8, 3)).astype(np.float32), rng.standard_normal(4).astype(np.float32),
            rng.integers(0, 100, (2, 8)).astype(np.int32), np.array(step, np.int32)]   # (a scalar: the step)


LAYOUT = [(x.shape, x.dtype) for x in whole(0)]


def write(directory, step: int, hosts: int, only=None) -> None:
    """The checkpoint of ``step`` as a slice of ``hosts`` hosts writes it (``only``: those hosts alone)."""
    for k in (range(hosts) if only is None else only):
        blocks = take_blocks(whole(step), DIMS, hosts, k)
        store = CheckpointStore(host_directory(str(directory), k, hosts), async_save=False)
        store.save(step, blocks, digest=state_digest(blocks), metadata={"hosts": hosts})


def read(directory, hosts: int, host: int, at_most=None):
    return restore_for_host(str(directory), at_most, layout=LAYOUT, dims=DIMS, hosts=hosts, host=host)


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))


def test_blocks_join_into_the_whole_leaves_and_split_again():
    leaves = whole(1)
    for hosts in (1, 2, 4):
        blocks = [take_blocks(leaves, DIMS, hosts, k) for k in range(hosts)]
        assert same(join_blocks(blocks, DIMS), leaves)
    assert [x.shape for x in take_blocks(leaves, DIMS, 2, 1)] == [(4, 3), (4,), (2, 4), ()]
    with pytest.raises(ValueError, match="blocks"):
        join_blocks([leaves, leaves[:2]], DIMS)


def test_a_checkpoint_of_two_hosts_restores_onto_one_two_and_four_hosts_to_the_bit(tmp_path):
    write(tmp_path, 4, hosts=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host0-of-2", "host1-of-2"]
    assert layouts(str(tmp_path)) == {2: [4]} and steps(str(tmp_path)) == [4]
    (step, leaves, digest, meta), skipped = read(tmp_path, hosts=1, host=0)
    assert (step, skipped, meta["hosts"]) == (4, [], 2) and same(leaves, whole(4))
    assert digest == state_digest(whole(4))
    for hosts in (2, 4):
        for k in range(hosts):
            restored, _ = read(tmp_path, hosts=hosts, host=k)
            assert same(restored.leaves, take_blocks(whole(4), DIMS, hosts, k))
            assert restored.digest == state_digest(restored.leaves)


def test_a_step_counts_once_every_host_wrote_it_and_other_host_counts_beside_it_are_read_too(tmp_path):
    write(tmp_path, 2, hosts=1)              # a one-host slice's, in the directory itself
    write(tmp_path, 4, hosts=2)
    write(tmp_path, 6, hosts=2, only=[0])    # host 1 never finished: not a checkpoint
    assert layouts(str(tmp_path)) == {1: [2], 2: [4]} and steps(str(tmp_path)) == [2, 4]
    assert read(tmp_path, hosts=2, host=1)[0].step == 4
    restored, _ = read(tmp_path, hosts=2, host=1, at_most=3)   # the one-host checkpoint, host 1's blocks of it
    assert restored.step == 2 and same(restored.leaves, take_blocks(whole(2), DIMS, 2, 1))
    assert len(checkpoint_hosts.stores(str(tmp_path))) == 3
    with pytest.raises(CheckpointNotFoundError):
        read(tmp_path, hosts=1, host=0, at_most=1)


def test_one_hosts_part_corrupt_passes_the_step_over_for_the_newest_valid_one(tmp_path):
    write(tmp_path, 2, hosts=2)
    write(tmp_path, 4, hosts=2)
    state = tmp_path / "host1-of-2" / "4" / "state"
    data = max((p for p in state.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0x01
    data.write_bytes(bytes(content))
    assert read(tmp_path, hosts=2, host=0)[0].step == 4   # host 0's own part is whole: the slice's hosts differ,
    restored, [skip] = read(tmp_path, hosts=2, host=1)    # and the controller loads them again at the oldest
    assert restored.step == 2 and skip.step == 4 and "host1-of-2" in skip.path
    restored, [skip] = read(tmp_path, hosts=1, host=0)    # read whole: every host's part is checked
    assert restored.step == 2 and skip.step == 4 and same(restored.leaves, whole(2))


def test_host_directories_are_refused_for_a_host_the_slice_does_not_have():
    assert host_directory("gs://b/run", 0, 1) == "gs://b/run"
    assert host_directory("gs://b/run/", 1, 2) == "gs://b/run/host1-of-2"
    with pytest.raises(ValueError, match="no host 2"):
        host_directory("/x", 2, 2)
