"""Bounded fuzz of the Worker's RPCs with well-formed messages that break its rules, from a caller with the run secret.

One real worker process (chaos off, no lease; ``_rpc_fuzz_target.py``) holds a freshly initialized state. Each
example sends one message with a wrong fence, a broken Load, an impossible step plan, a bad Push stream, or a state
call out of order (a step it does not have, a source that is no worker or that lies about the state), and checks that
it is refused with a status that ``runtime.wire.rpc.to_error`` maps to a typed error (never INTERNAL with a
traceback), that the worker process lives, and that its state hash and applied step are what they were. The last test
shows it still runs a valid step. Undecodable bytes, oversized messages and the controller's Register are fuzzed in
``test_rpc_fuzz_wire.py``. Examples are derandomized (the same every run) and no example database is written.
"""

import hashlib
import json

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime._proto import elastic_pb2 as pb
from runtime.wire.parts import checksum
from runtime.state.state_copy import state_digest
from tests.integration._rpc_fuzz_target import EPOCH, FUZZ, M, P, ROOT_NODE, TYPED, Target, fence, open_target
from tests.support.worker_harness import RUN, load_request

INT64 = st.integers(-(1 << 63), (1 << 63) - 1)
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")


BAD_FENCES = st.one_of(
    st.builds(pb.Fence, run_id=st.text(max_size=24).filter(lambda r: r != RUN), epoch=INT64),
    st.builds(pb.Fence, run_id=st.just(RUN), epoch=st.integers(-(1 << 63), EPOCH - 1)),
)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    yield from open_target(tmp_path_factory)


# -- fences ---------------------------------------------------------------------------


def _fenced_calls(t: Target):
    chunk = lambda f: pb.TensorChunk(fence=f, step=0, phase=0, src_rank=1, node=pb.Node(level=0, index=1),  # noqa: E731
                                     total=2, offset=0, data=b"\0" * 8, xxh3=checksum(b"\0" * 8))
    s = t.stub
    return {
        "Load": lambda f: s.Load(load_request(t.programs, fence=f), timeout=30),
        "Init": lambda f: s.Init(pb.InitRequest(fence=f, seed=1), timeout=10),
        "Step": lambda f: s.Step(pb.StepRequest(fence=f, step=0, rank=0, peers=[pb.Peer(rank=0, address=t.address)],
                                                nodes=[ROOT_NODE], all_nodes=[ROOT_NODE], node_owner=[0]), timeout=10),
        "StateHash": lambda f: s.StateHash(pb.HashRequest(fence=f), timeout=10),
        "Shutdown": lambda f: s.Shutdown(pb.ShutdownRequest(fence=f), timeout=10),
        "Abort": lambda f: s.Abort(pb.AbortRequest(fence=f), timeout=10),
        "Rollback": lambda f: s.Rollback(pb.RollbackRequest(fence=f, to_applied_steps=0), timeout=10),
        "PullState": lambda f: s.PullState(pb.PullStateRequest(fence=f, source_address=t.address, applied_steps=0),
                                           timeout=10),
        "GetState": lambda f: list(s.GetState(pb.GetStateRequest(fence=f, applied_steps=0), timeout=10)),
        "Progress": lambda f: s.Progress(pb.ProgressRequest(fence=f), timeout=10),
        "Push": lambda f: s.Push(iter([chunk(f)]), timeout=10),
    }


@FUZZ
@given(data=st.data())
def test_calls_of_another_run_or_an_older_epoch_are_refused(target, data):
    calls = _fenced_calls(target)
    method = data.draw(st.sampled_from(sorted(calls)), label="method")
    code = target.refused(lambda: calls[method](data.draw(BAD_FENCES, label="fence")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    target.unharmed()


# -- Load ---------------------------------------------------------------------------


def _with_layout(req: pb.LoadRequest, **changes) -> None:
    layout = json.loads(req.layout)
    layout.update(changes)
    req.layout = json.dumps(layout).encode()


def _load_defects(draw, req: pb.LoadRequest) -> str:
    """Breaks ``req`` in one way; returns which."""
    defect = draw(st.sampled_from([
        "chunk_bytes", "lease", "random_program", "truncated_program", "flipped_program", "missing_program",
        "layout_bytes", "layout_key", "devices", "microbatches", "grad_size", "in_specs", "data_source",
        "truncated_data_source"]), label="defect")
    programs = {p.name: p for p in req.programs}
    name = draw(st.sampled_from(sorted(programs)), label="program")
    blob = programs[name].serialized
    if defect == "chunk_bytes":
        req.chunk_bytes = draw(st.one_of(st.integers(-(1 << 63), -1), st.integers(1, 4095),
                                         st.integers((32 << 20) + 1, (1 << 63) - 1)))
    elif defect == "lease":
        req.lease_seconds = draw(st.sampled_from([float("nan"), float("inf"), -1.0, -1e-9]))
    elif defect == "random_program":
        programs[name].serialized = draw(st.binary(max_size=2000))
    elif defect == "truncated_program":   # the last 8 bytes are padding: a program without them is whole
        programs[name].serialized = blob[:draw(st.integers(0, len(blob) - 16))]
    elif defect == "flipped_program":   # corrupted on the way: its sha256 no longer matches
        programs[name].sha256 = hashlib.sha256(blob).hexdigest()
        flipped = bytearray(blob)
        for i in draw(st.sets(st.integers(0, len(blob) - 1), min_size=1, max_size=4)):
            flipped[i] ^= draw(st.integers(1, 255))
        programs[name].serialized = bytes(flipped)
    elif defect == "missing_program":
        del req.programs[:]
        req.programs.extend(p for n, p in programs.items() if n != name)
    elif defect == "layout_bytes":
        req.layout = draw(st.binary(max_size=200))
    elif defect == "layout_key":
        _with_layout(req, **{draw(st.sampled_from(["mesh", "seed", "x"])): 1})
    elif defect == "devices":
        _with_layout(req, devices_per_slice=draw(st.sampled_from([0, -1, 2, 1 << 40, "1", 1.0, None])))
    elif defect == "microbatches":
        _with_layout(req, num_microbatches=draw(st.sampled_from([0, -2, 3, 6, 1 << 30, "2", None])))
    elif defect == "grad_size":
        _with_layout(req, grad_size=draw(st.sampled_from([0, -8, P - 1, P + 1, 1 << 50, "8"])))
    elif defect == "in_specs":
        bad = draw(st.sampled_from([{}, {"init": [None]}, {"init": [None, None], "grad": [None, 0], "apply": [None]},
                                    {"init": [None], "grad": [None, 0, 0], "apply": [None]},
                                    {"init": [5], "grad": [None, 0, 0], "apply": [None, None]}, "x", [None]]))
        _with_layout(req, in_specs=bad)
    elif defect == "data_source":
        req.data_source = draw(st.binary(max_size=300))
    else:
        req.data_source = req.data_source[:draw(st.integers(0, len(req.data_source) - 1))]
    return defect


@FUZZ
@given(data=st.data())
def test_malformed_loads_are_refused_before_anything_is_replaced(target, data):
    req = load_request(target.programs, fence=fence())
    _load_defects(data.draw, req)
    assert target.refused(lambda: target.stub.Load(req, timeout=60)) == grpc.StatusCode.INVALID_ARGUMENT
    target.unharmed()


# -- Step ---------------------------------------------------------------------------


def _step_defects(draw, t: Target) -> pb.StepRequest:
    leaf0, leaf1 = pb.Node(level=0, index=0), pb.Node(level=0, index=1)
    req = pb.StepRequest(fence=fence(), step=0, rank=0, peers=[pb.Peer(rank=0, address=t.address)],
                         nodes=[ROOT_NODE], all_nodes=[ROOT_NODE], node_owner=[0])
    defect = draw(st.sampled_from(["step_behind", "step_far_ahead", "rank", "peer_ranks", "too_many_peers",
                                   "no_address", "nodes", "all_nodes", "owners", "huge_repeated", "node_range"]))
    if defect == "step_behind":
        req.step = draw(st.integers(-(1 << 63), -1))
    elif defect == "step_far_ahead":
        req.step = draw(st.integers(17, (1 << 63) - 1))
    elif defect == "rank":
        req.rank = draw(st.one_of(st.integers(-(1 << 31), -1), st.integers(1, (1 << 31) - 1)))
    elif defect == "peer_ranks":
        ranks = draw(st.sampled_from([[], [1], [0, 0], [0, 2], [-1, 0]]))
        del req.peers[:]
        req.peers.extend(pb.Peer(rank=r, address=t.address) for r in ranks)
    elif defect == "too_many_peers":
        del req.peers[:]
        req.peers.extend(pb.Peer(rank=r, address=t.address) for r in range(M + 1))
    elif defect == "no_address":   # two ranks, the other without an address
        req.peers.append(pb.Peer(rank=1, address=""))
        req.ClearField("all_nodes")
        req.all_nodes.extend([leaf0, leaf1])
        req.node_owner[:] = [0, 1]
        req.ClearField("nodes")
        req.nodes.append(leaf0)
    elif defect == "nodes":
        req.ClearField("nodes")
        req.nodes.extend(draw(st.sampled_from([[], [leaf0], [ROOT_NODE, ROOT_NODE], [leaf0, leaf1]])))
    elif defect == "all_nodes":
        req.ClearField("all_nodes")
        req.all_nodes.extend(draw(st.sampled_from([[leaf0], [leaf1, leaf1], [ROOT_NODE, leaf0]])))
        req.node_owner[:] = [0] * len(req.all_nodes)
    elif defect == "owners":
        req.node_owner[:] = draw(st.sampled_from([[], [1], [-1], [0, 0]]))
    elif defect == "huge_repeated":
        n = draw(st.integers(M + 1, 100_000))
        req.ClearField("all_nodes")
        req.all_nodes.extend([leaf0] * n)
        req.node_owner[:] = [0] * n
    else:
        int32 = st.integers(-(1 << 31), (1 << 31) - 1)
        node = pb.Node(level=draw(int32), index=draw(int32))
        if node == ROOT_NODE:
            node.index = 1
        for field in (req.nodes, req.all_nodes):
            del field[:]
            field.append(node)
    return req


@FUZZ
@given(data=st.data())
def test_malformed_step_plans_are_refused(target, data):
    req = _step_defects(data.draw, target)
    target.refused(lambda: target.stub.Step(req, timeout=30))
    target.unharmed()


# -- Push -------------------------------------------------------------------------------


def _chunk(data=b"\0" * 4 * (P + 1), **fields):
    base = dict(fence=fence(), step=0, phase=0, src_rank=1, node=pb.Node(level=0, index=1), total=len(data) // 4,
                offset=0, data=data, xxh3=checksum(data))
    base.update(fields)
    return pb.TensorChunk(**base)


def _push_defects(draw) -> list[pb.TensorChunk]:
    defect = draw(st.sampled_from(["checksum", "not_floats", "piece_too_big", "offset", "node", "gather_node", "phase",
                                   "src_rank", "mixed", "step_behind", "step_far_ahead", "incomplete", "huge_data"]))
    if defect == "checksum":
        return [_chunk(xxh3=draw(st.integers(0, (1 << 64) - 1).filter(lambda c: c != checksum(b"\0" * 36))))]
    if defect == "not_floats":
        data = draw(st.binary(min_size=1, max_size=64).filter(lambda b: len(b) % 4))
        return [_chunk(data=data, total=8)]
    if defect == "piece_too_big":
        return [_chunk(total=draw(st.integers(P + 2, (1 << 63) - 1)))]
    if defect == "offset":
        return [_chunk(offset=draw(st.one_of(st.integers(-(1 << 63), -1), st.integers(1, (1 << 63) - 16))))]
    if defect == "node":
        level, index = draw(st.integers(-5, 40)), draw(st.integers(-5, (1 << 31) - 1))   # Node fields are int32
        if 0 <= level <= 1 and 0 <= index < M >> level:
            level = 2
        return [_chunk(node=pb.Node(level=level, index=index))]
    if defect == "gather_node":
        return [_chunk(phase=1, node=pb.Node(level=0, index=draw(st.integers(0, 1))))]
    if defect == "phase":
        return [_chunk(phase=draw(st.one_of(st.integers(-(1 << 31), -1), st.integers(2, (1 << 31) - 1))))]
    if defect == "src_rank":
        return [_chunk(src_rank=draw(st.one_of(st.integers(-(1 << 31), -1), st.integers(M, (1 << 31) - 1))))]
    if defect == "mixed":
        return [_chunk(), _chunk(step=1)]
    if defect == "step_behind":
        return [_chunk(step=draw(st.integers(-(1 << 63), -1)))]
    if defect == "step_far_ahead":
        return [_chunk(step=draw(st.integers(17, (1 << 63) - 1)))]
    if defect == "incomplete":
        half = b"\0" * 16
        return [_chunk(data=half, total=P + 1)]
    return [_chunk(data=b"\0" * (4 << 20))]   # 1M floats for a gradient of 9


@FUZZ
@given(data=st.data())
def test_malformed_push_streams_are_refused(target, data):
    chunks = _push_defects(data.draw)
    code = target.refused(lambda: target.stub.Push(iter(chunks), timeout=30))
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
    target.unharmed()


# -- state calls out of order ---------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_state_calls_for_a_step_the_worker_does_not_have_are_refused(target, data):
    s, t = target.stub, target
    other_step = st.integers(-(1 << 63), (1 << 63) - 1).filter(lambda n: n != 0)
    kind = data.draw(st.sampled_from(["GetState", "PullState", "Rollback", "Init", "Abort_then_Step"]))
    if kind == "GetState":
        n = data.draw(other_step)
        code = t.refused(lambda: list(s.GetState(pb.GetStateRequest(fence=fence(), applied_steps=n), timeout=10)))
    elif kind == "PullState":   # the source (this worker itself) does not have that step
        n = data.draw(other_step)
        code = t.refused(lambda: s.PullState(pb.PullStateRequest(fence=fence(), source_address=t.address,
                                                                 applied_steps=n), timeout=30))
    elif kind == "Rollback":    # nothing to roll back: the state was just initialized
        n = data.draw(other_step)
        code = t.refused(lambda: s.Rollback(pb.RollbackRequest(fence=fence(), to_applied_steps=n), timeout=10))
    elif kind == "Init":
        seed = data.draw(st.one_of(st.integers(-(1 << 63), -(1 << 31) - 1), st.integers(1 << 31, (1 << 63) - 1)))
        code = t.refused(lambda: s.Init(pb.InitRequest(fence=fence(), seed=seed), timeout=10))
    else:                       # a step of a superseded epoch, after an abort at the same epoch
        s.Abort(pb.AbortRequest(fence=fence()), timeout=10)
        code = t.refused(lambda: s.Step(pb.StepRequest(fence=fence(EPOCH - 1), step=0, rank=0,
                                                       peers=[pb.Peer(rank=0, address=t.address)], nodes=[ROOT_NODE],
                                                       all_nodes=[ROOT_NODE], node_owner=[0]), timeout=10))
    assert code in TYPED
    t.unharmed()


@FUZZ
@given(address=st.one_of(st.just(""), st.just("127.0.0.1:1"), st.text(max_size=40)))
def test_a_pull_from_an_address_that_is_no_worker_is_refused(target, address):
    t = target
    t.refused(lambda: t.stub.PullState(pb.PullStateRequest(fence=fence(), source_address=address, applied_steps=0),
                                       timeout=30))
    t.unharmed()


def _lies(draw, state: list[pb.StateChunk]) -> tuple[list[pb.StateChunk], str]:
    """A state stream that lies in one way, and the ``expected_digest`` to ask for."""
    chunks = [pb.StateChunk.FromString(c.SerializeToString()) for c in state]
    honest = chunks[0].digest
    lie = draw(st.sampled_from(["claimed_hash", "content", "consistent_but_unexpected", "dtype", "shape",
                                "total_bytes", "applied", "short", "checksum", "leaves"]))
    expected = ""
    c = chunks[0]
    if lie == "claimed_hash":
        wrong = hashlib.sha256(draw(st.binary(max_size=8))).hexdigest()
        claim = draw(st.sampled_from([f"xxh3_128:{wrong[:32]}", f"sha256:{wrong}", wrong, "xxh3_128:", "md5:00"]))
        for x in chunks:   # another state's digest, one of another algorithm, or no digest at all
            x.digest = claim
    elif lie in ("content", "consistent_but_unexpected"):
        data = bytearray(c.data)
        data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
        c.data, c.xxh3 = bytes(data), checksum(bytes(data))
        if lie == "consistent_but_unexpected":   # a self-consistent state, not the one the controller expects
            leaf = np.frombuffer(c.data, dtype=np.dtype(c.dtype)).reshape(tuple(c.shape))
            for x in chunks:
                x.digest = state_digest([leaf])
            expected = honest
    elif lie == "dtype":
        c.dtype = draw(st.sampled_from(["<f8", "<i4", "|O", "<U2", "bogus", "", "<V4"]))
    elif lie == "shape":
        c.ClearField("shape")
        c.shape.extend(draw(st.sampled_from([[4], [2, 4], [8, 1], [-8], [1 << 62, 1 << 62], []])))
    elif lie == "total_bytes":
        c.total_bytes = draw(st.one_of(st.integers(-(1 << 63), 31), st.integers(33, (1 << 63) - 1)))
    elif lie == "applied":
        for x in chunks:
            x.applied_steps = draw(st.integers(1, 1 << 40))
    elif lie == "short":
        c.data = c.data[:draw(st.integers(0, len(c.data) - 1))]
        c.xxh3 = checksum(c.data)
    elif lie == "checksum":
        c.xxh3 ^= draw(st.integers(1, (1 << 64) - 1))
    else:
        for x in chunks:
            x.num_leaves = draw(st.sampled_from([0, 2, 1 << 30]))
    return chunks, expected


def test_a_transfer_announces_the_hash_the_worker_reports_for_its_state(target):
    assert {c.digest for c in target.state} == {target.initial[1]}


@FUZZ
@given(data=st.data())
def test_a_pull_from_a_source_that_lies_about_the_state_is_refused(target, data):
    t = target
    t.liar.chunks, expected = _lies(data.draw, t.state)
    code = t.refused(lambda: t.stub.PullState(pb.PullStateRequest(
        fence=fence(), source_address=t.liar.address, applied_steps=0, expected_digest=expected), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    t.unharmed()


# -- afterwards ---------------------------------------------------------------------------


def test_the_worker_still_runs_a_valid_step_after_the_fuzz(target):
    t = target
    step = t.stub.Step(pb.StepRequest(fence=fence(), step=0, rank=0, peers=[pb.Peer(rank=0, address=t.address)],
                                      nodes=[ROOT_NODE], all_nodes=[ROOT_NODE], node_owner=[0]), timeout=60)
    assert step.step == 0 and np.isfinite(step.loss_sum)
    assert t.stub.StateHash(pb.HashRequest(fence=fence()), timeout=10).step == 1
    t.stub.Rollback(pb.RollbackRequest(fence=fence(), to_applied_steps=0), timeout=10)   # as it was, for other tests
    t.unharmed()
