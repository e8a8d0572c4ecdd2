"""A slice of several hosts, its pure parts: each host's blocks of the state, a slice's address and digest, a
registration that forms a slice, a call to all its hosts as one (runtime.core.hosts, runtime.control.slice_calls)."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from runtime._proto import elastic_pb2 as pb
from runtime.control.registry import Registry
from runtime.control.slice_calls import SliceFuture, SliceStub, merge_replies
from runtime.core.errors import ProtocolError
from runtime.core.events import EventLog, read_events
from runtime.core.hosts import block_of, host_address, host_id, host_layout, slice_address, slice_of_host
from runtime.state.state_copy import slice_digest, state_digest
from runtime.wire.requests import for_host


def test_each_host_holds_its_rows_of_a_split_leaf_and_all_of_a_replicated_one():
    layout = [((8, 3), "float32"), ((5,), "int32"), ((2, 12), "float32")]
    dims = [0, None, 1]
    assert host_layout(layout, dims, 1) == [((8, 3), "float32"), ((5,), "int32"), ((2, 12), "float32")]
    assert host_layout(layout, dims, 2) == [((4, 3), "float32"), ((5,), "int32"), ((2, 6), "float32")]
    leaf = np.arange(24).reshape(2, 12)
    blocks = [leaf[block_of(leaf.shape, 1, 4, k)] for k in range(4)]
    assert np.array_equal(np.concatenate(blocks, axis=1), leaf)   # the hosts' blocks, in host order, are the leaf
    assert block_of((5,), None, 4, 3) == (slice(None),)
    with pytest.raises(ValueError, match="does not divide among 3 hosts"):
        host_layout([((8, 3), "float32")], [0], 3)


def test_host_k_of_a_slice_talks_to_host_k_of_another():
    address = slice_address(["a:1", "b:2"])
    assert address == "a:1,b:2"
    assert [host_address(address, k) for k in (0, 1)] == ["a:1", "b:2"]
    assert host_address("c:3", 1) == "c:3"   # a one-host slice serves any host
    with pytest.raises(ValueError, match="has 2 hosts, no host 2"):
        host_address(address, 2)
    assert host_id("w3", 1, 2) == "w3/1" and slice_of_host("w3/1") == ("w3", 1)
    assert host_id("w3", 0, 1) == "w3" and slice_of_host("w3") == ("w3", 0)


def test_a_step_and_a_pull_read_as_host_k_reads_them():
    req = pb.StepRequest(step=3, peers=[pb.Peer(rank=0, address="a:1,b:2", data_address="c:3,d:4"),
                                        pb.Peer(rank=1, address="e:5,f:6", data_address="")])
    assert [(p.address, p.data_address) for p in for_host(req, 1).peers] == [("b:2", "d:4"), ("f:6", "")]
    pull = for_host(pb.PullStateRequest(source_address="a:1,b:2", source_data_address="c:3,d:4"), 0)
    assert (pull.source_address, pull.source_data_address) == ("a:1", "c:3")
    with pytest.raises(ProtocolError, match="host 2 of its slice"):
        for_host(pb.PullStateRequest(source_address="a:1,b:2"), 2)


def test_a_slice_digest_combines_its_hosts_in_order():
    a, b = state_digest([np.arange(3.0)]), state_digest([np.arange(4.0)])
    assert slice_digest([a]) == a
    assert slice_digest([a, b]) != slice_digest([b, a])
    assert slice_digest([a, b]).startswith("xxh3_128:") and len(slice_digest([a, b])) == len(a)
    assert slice_digest([a, ""]) == ""


def test_hosts_answers_are_one():
    d0, d1 = state_digest([np.zeros(2)]), state_digest([np.ones(2)])
    merged = merge_replies([pb.StatusReply(applied_steps=4, digest=d0), pb.StatusReply(applied_steps=4, digest=d1)])
    assert merged.applied_steps == 4 and merged.digest == slice_digest([d0, d1])
    apart = merge_replies([pb.HashReply(step=4, digest=d0), pb.HashReply(step=3, digest=d1)])
    assert (apart.digest, apart.step) == ("", 3)   # hosts at different steps: no one state, the oldest step
    saves = merge_replies([pb.CheckpointsReply(saved=[4], idle=True), pb.CheckpointsReply(error="disk full")])
    assert list(saves.saved) == [4] and saves.error == "disk full"   # any host's error is the slice's
    assert not saves.idle   # host 1 may still be writing: the slice is idle once every host is
    load = merge_replies([pb.LoadReply(compile_seconds=1.0, devices_probed=2, probe_seconds=0.1),
                          pb.LoadReply(compile_seconds=3.0, devices_probed=2, probe_seconds=0.2)])
    assert (load.compile_seconds, load.devices_probed, load.probe_seconds) == (3.0, 4, 0.2)
    assert merge_replies([pb.InitReply(state_bytes=5), pb.InitReply(state_bytes=7)]).state_bytes == 12


class _Future(grpc.Future):
    """A future settled by the test."""

    def __init__(self):
        self._done = threading.Event()
        self._reply = self._error = None
        self._cancelled = False
        self._callbacks = []
        self.cancels = 0

    def settle(self, reply=None, error=None):
        self._reply, self._error = reply, error
        self._done.set()
        for fn in self._callbacks:
            fn(self)

    def cancel(self):
        self.cancels += 1
        if self._done.is_set():
            return False
        self._cancelled = True
        self.settle()
        return True

    def cancelled(self):
        return self._cancelled

    def running(self):
        return not self._done.is_set()

    def done(self):
        return self._done.is_set()

    def result(self, timeout=None):
        if self._cancelled:
            raise grpc.FutureCancelledError()
        if self._error is not None:
            raise self._error
        return self._reply

    def exception(self, timeout=None):
        return self._error

    def traceback(self, timeout=None):
        return None

    def add_done_callback(self, fn):
        if self._done.is_set():
            fn(self)
        else:
            self._callbacks.append(fn)


class _Lost(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "host lost"


def test_a_call_to_a_slice_fails_at_its_first_failed_host_and_cancels_the_others():
    f0, f1 = _Future(), _Future()
    fut = SliceFuture([f0, f1])
    f1.settle(error=_Lost())   # host 1 died: host 0 may be stuck in a collective with it
    assert fut.done() and isinstance(fut.exception(), _Lost) and f0.cancels == 1
    with pytest.raises(_Lost):
        fut.result()


def test_a_call_to_a_slice_answers_once_every_host_did():
    f0, f1 = _Future(), _Future()
    fut = SliceFuture([f0, f1])
    heard = []
    fut.add_done_callback(heard.append)
    f0.settle(pb.InitReply(state_bytes=3))
    assert not fut.done() and not heard
    f1.settle(pb.InitReply(state_bytes=4))
    assert fut.result().state_bytes == 7 and heard == [fut]
    assert not fut.cancel()


def test_a_slice_stub_calls_each_host():
    calls = []

    class Host:
        def __init__(self, k):
            self.k = k

        @property
        def Init(self):
            host = self

            class Method:
                def future(self, request, timeout=None):
                    calls.append((host.k, request.seed, timeout))
                    f = _Future()
                    f.settle(pb.InitReply(state_bytes=10 + host.k))
                    return f
            return Method()

    reply = SliceStub([Host(0), Host(1)]).Init(pb.InitRequest(seed=7), timeout=3.0)
    assert reply.state_bytes == 21 and calls == [(0, 7, 3.0), (1, 7, 3.0)]


def test_a_slice_registers_once_all_its_hosts_did_and_each_host_learns_the_client_grace(tmp_path):
    events = EventLog(tmp_path / "events.jsonl")
    registry = Registry("run", events, refuse=lambda w: "", hosts_per_slice=2, client_grace=45.0)

    class Context:
        def abort(self, code, details):
            raise AssertionError(details)

    def register(k, hosts=2, wid="w0"):
        return registry.Register(pb.RegisterRequest(run_id="run", worker_id=wid, address=f"127.0.0.1:{100 + k}",
                                                    data_address=f"127.0.0.1:{200 + k}", num_devices=4,
                                                    platform="cpu", pid=1000 + k, slice_host=k, slice_hosts=hosts),
                                 Context())

    first = register(1)
    assert first.accepted and "w0" not in registry.workers   # forming: host 0 has not come
    assert not register(1).accepted   # host 1 twice
    refused = register(0, hosts=1, wid="w1")
    assert not refused.accepted and "slices have 2 host(s)" in refused.reason
    last = register(0)
    assert last.accepted and first.client_grace_seconds == last.client_grace_seconds == 45.0
    assert not refused.client_grace_seconds   # (a worker refused joins nothing)
    info = registry.workers["w0"]
    assert info.address == "127.0.0.1:100,127.0.0.1:101" and info.data_address == "127.0.0.1:200,127.0.0.1:201"
    assert [h.worker_id for h in info.hosts] == ["w0/0", "w0/1"] and info.pid == 1000
    events.close()
    registered = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "worker_registered"]
    assert len(registered) == 1 and [h["pid"] for h in registered[0]["hosts"]] == [1000, 1001]


@pytest.mark.parametrize("overrides, says", [
    (["ici_fsdp_parallelism=3"], "'elastic_hosts_per_slice' (2, in overrides) and 'ici_fsdp_parallelism' (3, in "
                                 "overrides) contradict: a slice's devices are spread over its hosts"),
    (["ici_fsdp_parallelism=4", "dcn_pipeline_parallelism=2"], "pipeline stages run on slices of one host"),
])
def test_what_slices_of_several_hosts_cannot_do_is_refused_in_one_line(overrides, says):
    from elastic.config import ConfigError
    from elastic.config_loading import load_config

    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["elastic_hosts_per_slice=2", *overrides])
    assert says in str(e.value) and "\n" not in str(e.value)
