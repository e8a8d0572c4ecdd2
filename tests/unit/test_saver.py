"""The worker's background checkpoint writer (runtime.saver), over a store that records what it is given."""

import threading

import numpy as np
import pytest

from runtime.executor import state_sha256
from runtime.saver import CheckpointWriter, Drained


class Store:
    def __init__(self, directory, gate=None, fail=False):
        self.directory, self.saved, self.gate, self.fail = directory, [], gate, fail
        self.entered = threading.Event()

    def save(self, step, leaves, *, sha256, metadata):
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(5)
        if self.fail:
            raise OSError("disk full")
        self.saved.append((step, [x.copy() for x in leaves], sha256, metadata))

    def wait(self):
        pass


def test_a_checkpoint_is_written_in_the_background_with_its_digest():
    stores = {}
    writer = CheckpointWriter(store_for=lambda d: stores.setdefault(d, Store(d)))
    leaves = [np.arange(6, dtype=np.float32).reshape(2, 3), np.int32(7)]
    writer.submit("/ck", 4, leaves, {"fingerprint": "fp"})
    assert writer.wait(5)
    (step, got, digest, meta), = stores["/ck"].saved
    assert step == 4 and digest == state_sha256(got) == state_sha256([np.asarray(x) for x in leaves])
    assert meta == {"fingerprint": "fp"}
    assert writer.drain() == Drained([4]) and writer.drain() == Drained()


def test_a_newer_request_replaces_a_waiting_one_and_errors_are_reported_once():
    gate = threading.Event()
    store = Store("/ck", gate=gate)
    writer = CheckpointWriter(store_for=lambda d: store)
    writer.submit("/ck", 1, [np.zeros(2)], {"fingerprint": "fp"})        # being written (blocked on the gate)
    assert store.entered.wait(5)
    writer.submit("/ck", 2, [np.ones(2)], {"fingerprint": "fp"})         # waits...
    writer.submit("/ck", 3, [np.full(2, 3.0)], {"fingerprint": "fp"})    # ...and is replaced by the newest
    gate.set()
    assert writer.wait(5)
    assert [s for s, *_ in store.saved] == [1, 3]
    store.fail = True
    writer.submit("/ck", 4, [np.zeros(2)], {"fingerprint": "fp"})
    assert writer.wait(5)
    done = writer.drain()
    assert 4 not in done.saved and "checkpoint of step 4 in /ck: OSError: disk full" in done.error
    assert writer.drain() == Drained()


def test_wait_times_out_while_a_write_is_stuck():
    gate = threading.Event()
    writer = CheckpointWriter(store_for=lambda d: Store(d, gate=gate))
    writer.submit("/ck", 1, [np.zeros(2)], {"fingerprint": "fp"})
    assert writer.wait(0.05) is False
    gate.set()
    assert writer.wait(5) is True


def test_a_snapshot_never_displaces_a_waiting_checkpoint_and_its_copy_is_reported_per_kind():
    gate = threading.Event()
    ck, snap = Store("/ck", gate=gate), Store("/snap")
    writer = CheckpointWriter(store_for=lambda d: ck)
    copied = []

    def copy(store, step):
        if step == 3:
            raise OSError("peer gone")
        copied.append((store, step))

    writer.submit("/ck", 1, [np.zeros(2)], {})                            # being written (blocked on the gate)
    assert ck.entered.wait(5)
    writer.submit("/ck", 2, [np.ones(2)], {})                             # a checkpoint waits...
    writer.submit("/snap", 2, [np.ones(2)], {}, store=snap, then=copy)    # ...and a snapshot beside it
    gate.set()
    assert writer.wait(5)
    assert [s for s, *_ in ck.saved] == [1, 2] and [s for s, *_ in snap.saved] == [2]
    assert copied == [(snap, 2)]
    assert writer.drain() == Drained([1, 2]) and writer.drain("snapshot") == Drained([2], [2])
    writer.submit("/snap", 3, [np.ones(2)], {}, store=snap, then=copy)
    assert writer.wait(5)
    done = writer.drain("snapshot")
    assert done.saved == [3] and done.followed == [] and "copy of snapshot 3: OSError: peer gone" in done.error
    assert writer.drain() == Drained()
