"""Checkpoints of slices of several hosts (runtime.state.checkpoint_hosts): each host's blocks in a store of its
own, a step listed once every host's is there, and any host count reading any other's, to the bit (real orbax,
a local directory); the hosts agreeing that each wrote its part, and orbax keeping each host's saves to itself
(a real JAX coordination service of two clients, in this process)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from runtime.core.hosts import join_blocks, take_blocks
from runtime.state import checkpoint_hosts
from runtime.state.checkpoint import CheckpointStore
from runtime.state.checkpoint_hosts import host_directory, layouts, restore_for_host, steps
from runtime.state.checkpoint_record import CheckpointNotFoundError
from runtime.state.state_copy import state_digest
from runtime.worker.agreement import SliceAgreement

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


@pytest.fixture
def slice_store():
    """The key-value clients of a slice's two hosts: JAX's own coordination service, on loopback."""
    from jax._src.lib import _jax

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    service = _jax.get_distributed_runtime_service(address, 2)
    clients = [_jax.get_distributed_runtime_client(address, k) for k in range(2)]
    each(lambda c: c.connect(), clients)   # (each waits for the other)
    yield clients
    each(lambda c: c.shutdown(), clients)
    service.shutdown()


def each(call, clients) -> None:
    threads = [threading.Thread(target=call, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def test_a_checkpoint_counts_once_every_host_wrote_its_part_and_is_given_up_once_one_failed(slice_store):
    host0, host1 = (SliceAgreement(2, k, c) for k, c in enumerate(slice_store))
    host0.done("checkpoint", 4)
    assert host0.outcome("checkpoint", 4) is None                           # host 1 still writing
    t = time.monotonic()
    assert host0.outcome("checkpoint", 4, deadline=t + 0.2) is None and time.monotonic() - t >= 0.15
    host1.done("checkpoint", 4)
    assert host0.outcome("checkpoint", 4) is True and host1.outcome("checkpoint", 4) is True
    host1.undone("checkpoint", 4)                                            # the step redone: written again
    assert host0.outcome("checkpoint", 4) is None
    host1.done("checkpoint", 8, ok=False)                                    # host 1's part failed (or was replaced):
    assert host0.outcome("checkpoint", 8, deadline=time.monotonic() + 10) is False   # no waiting for host 0's own
    assert SliceAgreement().outcome("checkpoint", 8) is True                 # a one-host slice: its part is all


def test_each_host_of_a_slice_keeps_orbaxs_signals_to_itself_and_writes_alone(slice_store, monkeypatch, tmp_path):
    """orbax signals between a save's threads through the distributed system's store under per-process ids: two
    hosts saving at once read each other's "directory made" and wrote into directories not made yet."""
    from jax._src import distributed
    from orbax.checkpoint._src.futures import signaling_client
    from orbax.checkpoint._src.multihost import multihost

    from runtime.state import checkpoint_orbax

    for module, names in ((multihost, ("process_index", "process_count", "should_skip_process_sync",
                                       "broadcast_one_to_all")), (signaling_client, ("get_signaling_client",))):
        for name in names:   # restored after the test, as the rest of this process expects them
            monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(checkpoint_orbax, "_ALONE", False)
    monkeypatch.setattr(distributed.global_state, "client", slice_store[0])
    monkeypatch.setattr(distributed.global_state, "num_processes", 2)
    checkpoint_orbax._ocp()   # as host 0 of two
    signaling_client.get_signaling_client().key_value_set("jax-elastic-test/directory-made", "1")
    with pytest.raises(Exception):
        slice_store[1].key_value_try_get("jax-elastic-test/directory-made")   # not in the slice's store
    assert multihost.process_index() == 0 and multihost.process_count() == 1
    write(tmp_path, 4, hosts=2, only=[0])   # a save runs through orbax's whole path as the one process
    assert steps(str(tmp_path / "host0-of-2")) == [4]
