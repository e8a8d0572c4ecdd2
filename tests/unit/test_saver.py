"""The worker's background checkpoint writer (runtime.saver), over a store that records what it is given."""

import threading

import numpy as np
import pytest

from runtime.executor import state_sha256
from runtime.saver import CheckpointWriter


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
    assert writer.drain() == ([4], "") and writer.drain() == ([], "")


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
    saved, error = writer.drain()
    assert 4 not in saved and "checkpoint of step 4 in /ck: OSError: disk full" in error
    assert writer.drain() == ([], "")


def test_wait_times_out_while_a_write_is_stuck():
    gate = threading.Event()
    writer = CheckpointWriter(store_for=lambda d: Store(d, gate=gate))
    writer.submit("/ck", 1, [np.zeros(2)], {"fingerprint": "fp"})
    assert writer.wait(0.05) is False
    gate.set()
    assert writer.wait(5) is True
