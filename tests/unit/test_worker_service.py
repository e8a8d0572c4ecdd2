"""The worker's gRPC service on a real in-process server (no programs loaded) and its fault switchboard;
the checks every request passes before it touches anything (the step plan check is pure)."""


import time

import grpc
import ml_dtypes
import numpy as np
import pytest

from runtime import FAULT_ACTIONS
from runtime.wire import auth, rpc
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.wire.parts import checksum, inline
from runtime.state.state_copy import assemble_state, state_chunks, state_digest
from runtime.core.errors import ProtocolError
from runtime.worker.fault_injection import PHASES, PartitionInterceptor, WorkerFaults
from runtime.core.microbatch import assign_microbatches
from runtime.wire.requests import check_step_request
from runtime.worker.lease import Lease
from runtime.worker.worker import WorkerService

FENCE = pb.Fence(run_id="run", epoch=1)


@pytest.fixture
def served():
    """A worker service on a real server: ``(service, its address)``."""
    service = WorkerService("run", "w")
    server, port = rpc.make_server()
    pb_grpc.add_WorkerServicer_to_server(service, server)
    server.start()
    try:
        yield service, f"127.0.0.1:{port}"
    finally:
        server.stop(0)
        service.close()


@pytest.fixture
def worker(served):
    service, address = served
    return service, pb_grpc.WorkerStub(grpc.insecure_channel(address))


@pytest.mark.parametrize("chunk_bytes", [-1, 100, 4095])
def test_load_refuses_a_chunk_size_out_of_range_before_any_work(worker, chunk_bytes):
    service, stub = worker
    with pytest.raises(grpc.RpcError) as info:
        stub.Load(pb.LoadRequest(fence=FENCE, chunk_bytes=chunk_bytes), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"chunk_bytes={chunk_bytes}" in info.value.details()
    assert service.replica.executor is None and service.replica.chunk_bytes == 4 << 20


def test_load_checks_the_fence_before_the_chunk_size(worker):
    _, stub = worker
    with pytest.raises(grpc.RpcError) as info:
        stub.Load(pb.LoadRequest(fence=pb.Fence(run_id="other", epoch=1), chunk_bytes=-1), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_call_from_the_controller_renews_the_lease_and_a_peer_call_does_not():
    service = WorkerService("run", "w")
    try:
        for method, renews in [("/jax_elastic.Worker/Progress", True), ("/jax_elastic.Worker/Step", True),
                               ("/grpc.health.v1.Health/Check", True), ("/jax_elastic.Worker/Push", False),
                               ("/jax_elastic.Worker/GetState", False)]:
            service.lease.last_contact = 0.0
            service.lease.heard(method)
            assert (service.lease.last_contact > 0.0) == renews, method
    finally:
        service.close()


def test_a_worker_answers_stacks_with_its_own_threads_without_a_fence_and_progress_with_its_memory(worker):
    _, stub = worker
    [p] = stub.Stacks(pb.StacksRequest(), timeout=10).processes
    assert p.name == "w" and p.pid > 0 and "Thread MainThread (" in p.text and "in Stacks\n" in p.text
    assert stub.Progress(pb.ProgressRequest(fence=pb.Fence(run_id="run")), timeout=10).rss_bytes > 1 << 20


def test_the_stacks_of_a_slice_come_back_per_host_and_a_host_that_cannot_answer_is_named(served):
    from types import SimpleNamespace

    from runtime.control.worker_calls import WorkerCalls

    _, address = served
    calls = WorkerCalls(SimpleNamespace(rpc_timeout_seconds=5.0, tls=None), None, None, b"", "", lambda: FENCE,
                        dict, lambda *a, **k: None)
    try:
        calls.adopt("w3", [grpc.insecure_channel(address),
                           grpc.insecure_channel(f"127.0.0.1:{rpc.free_port()}")])
        [up, down] = calls.stacks(["w3"], timeout=1.0)["w3"]
    finally:
        calls.close()
    assert (up.name, down.name) == ("w3/0", "w3/1")
    assert "Thread MainThread (" in up.text and up.pid > 0 and not up.error
    assert not down.text and down.error.endswith("within 1 s")


def test_every_controller_method_is_a_method_of_the_service():
    names = {m for m in pb.DESCRIPTOR.services_by_name["Worker"].methods_by_name}
    assert {m for m in Lease.CONTROLLER_METHODS if not m.startswith("/")} <= names
    assert names - {"Push", "GetState", "KeepSnapshot"} == {m for m in Lease.CONTROLLER_METHODS if not m.startswith("/")}


def test_worker_faults_refuse_unknown_actions_naming_the_vocabulary():
    faults = WorkerFaults(enabled=True)
    with pytest.raises(ValueError, match="expected one of " + ", ".join(FAULT_ACTIONS)):
        faults.arm("explode")
    with pytest.raises(ValueError, match="phase must be one of " + ", ".join(PHASES)):
        faults.arm("kill_in_phase", phase="compile")
    with pytest.raises(PermissionError):
        WorkerFaults(enabled=False).arm("straggle", factor=2.0, seconds=1.0)
    faults.arm("partition", seconds=30.0)
    assert faults.partitioned() > 0
    faults.arm("clear")
    assert faults.partitioned() == 0.0


# -- hardening: every request checked before it touches anything -------------------------------

SECRET = "s3cret"


def _push(fence=FENCE, **fields):
    data = fields.pop("data", b"\0" * 8)
    return pb.TensorChunk(fence=fence, step=0, phase=0, src_rank=1, node=pb.Node(level=0, index=0),
                          total=len(data) // 4, offset=0, data=data, xxh3=checksum(data), **fields)


@pytest.mark.parametrize("call", ["Init", "Step", "StateHash", "Rollback", "GetState", "PullState", "Push"])
def test_calls_before_load_are_refused_as_out_of_order(worker, call):
    _, stub = worker
    requests = {
        "Init": lambda: stub.Init(pb.InitRequest(fence=FENCE, seed=1), timeout=10),
        "Step": lambda: stub.Step(pb.StepRequest(fence=FENCE, step=0), timeout=10),
        "StateHash": lambda: stub.StateHash(pb.HashRequest(fence=FENCE), timeout=10),
        "Rollback": lambda: stub.Rollback(pb.RollbackRequest(fence=FENCE), timeout=10),
        "GetState": lambda: list(stub.GetState(pb.GetStateRequest(fence=FENCE), timeout=10)),
        "PullState": lambda: stub.PullState(pb.PullStateRequest(fence=FENCE, source_address="127.0.0.1:1"), timeout=10),
        "Push": lambda: stub.Push(iter([_push()]), timeout=10),
    }
    with pytest.raises(grpc.RpcError) as info:
        requests[call]()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()


@pytest.mark.parametrize("method", ["Load", "Step", "Progress", "Abort"])
def test_a_request_that_does_not_parse_is_invalid_argument_not_internal(armed_worker, method):
    _, address = armed_worker
    raw = auth.secure_channel(grpc.insecure_channel(address), SECRET)
    try:
        with pytest.raises(grpc.RpcError) as info:
            raw.unary_unary(f"/jax_elastic.Worker/{method}")(b"\xff\xff\xff", timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not parse" in info.value.details() and "Traceback" not in info.value.details()
    finally:
        raw.close()


@pytest.fixture
def armed_worker():
    """A worker with chaos enabled, behind the secret."""
    service = WorkerService("run", "w", secret=SECRET, chaos=True)
    server, port = rpc.make_server(secret=SECRET, refusals=service.refusals, on_authenticated=service.lease.heard,
                                   interceptors=[PartitionInterceptor(service.faults)])
    pb_grpc.add_WorkerServicer_to_server(service, server)
    server.start()
    try:
        yield service, f"127.0.0.1:{port}"
    finally:
        server.stop(0)
        service.close()


@pytest.mark.parametrize("request_", [pb.ChaosRequest(action="explode"), pb.ChaosRequest(action="straggle", factor=0.5),
                                      pb.ChaosRequest(action="partition", seconds=float("nan")),
                                      pb.ChaosRequest(action="kill_in_phase", phase="compile")])
def test_a_bad_chaos_request_is_invalid_argument(armed_worker, request_):
    _, address = armed_worker
    stub = pb_grpc.WorkerStub(rpc.channel(address, SECRET))
    with pytest.raises(grpc.RpcError) as info:
        stub.Chaos(request_, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


def test_only_calls_that_pass_the_secret_and_the_partition_renew_the_lease(armed_worker):
    service, address = armed_worker
    stranger = pb_grpc.WorkerStub(grpc.insecure_channel(address))
    liar = pb_grpc.WorkerStub(rpc.channel(address, "not-the-secret"))
    controller = pb_grpc.WorkerStub(rpc.channel(address, SECRET))
    for stub in (stranger, liar):
        service.lease.last_contact = 0.0
        with pytest.raises(grpc.RpcError) as info:
            stub.Progress(pb.ProgressRequest(fence=FENCE), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert service.lease.last_contact == 0.0
    controller.Progress(pb.ProgressRequest(fence=FENCE), timeout=10)
    assert service.lease.last_contact > 0.0
    controller.Chaos(pb.ChaosRequest(action="partition", seconds=30.0), timeout=10)
    service.lease.last_contact = 0.0
    with pytest.raises(grpc.RpcError) as info:
        controller.Progress(pb.ProgressRequest(fence=FENCE), timeout=0.5)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert service.lease.last_contact == 0.0   # dropped by the partition before anything saw it
    service.faults.arm("clear")
    refusals = {(m, r): n for m, _, r, n in service.refusals.drain()}
    assert refusals == {("/jax_elastic.Worker/Progress", "missing run secret"): 1,
                        ("/jax_elastic.Worker/Progress", "wrong run secret"): 1}


def test_the_refusals_rpc_reports_counts_since_the_last_report(armed_worker):
    _, address = armed_worker
    stranger = pb_grpc.WorkerStub(grpc.insecure_channel(address))
    for _ in range(5):
        with pytest.raises(grpc.RpcError):
            stranger.StateHash(pb.HashRequest(fence=FENCE), timeout=10)
    controller = pb_grpc.WorkerStub(rpc.channel(address, SECRET))
    [r] = controller.Refusals(pb.RefusalsRequest(), timeout=10).refusals
    assert (r.method, r.peer, r.reason, r.count) == ("/jax_elastic.Worker/StateHash", "ipv4:127.0.0.1",
                                                     "missing run secret", 5)
    assert list(controller.Refusals(pb.RefusalsRequest(), timeout=10).refusals) == []


# -- the step plan check (pure) ---------------------------------------------------------------


def _plan(num_microbatches, ranks, me, **changes):
    """The step plan rank ``me`` gets from the scheduler, with ``changes`` to its fields."""
    shares = assign_microbatches(num_microbatches, ranks)
    all_nodes = [pb.Node(level=n.level, index=n.index) for nodes in shares for n in nodes]
    owners = [r for r, nodes in enumerate(shares) for _ in nodes]
    req = pb.StepRequest(fence=FENCE, step=3, rank=me,
                         peers=[pb.Peer(rank=r, address=f"h:{r + 1}") for r in range(ranks)], nodes=[pb.Node(level=n.level, index=n.index) for n in shares[me]], all_nodes=all_nodes,
                         node_owner=owners)
    for field, value in changes.items():
        if isinstance(value, list):
            req.ClearField(field)
            getattr(req, field).extend(value)
        else:
            setattr(req, field, value)
    return req


@pytest.mark.parametrize("m,ranks", [(1, 1), (2, 1), (2, 2), (8, 3), (16, 4), (16, 16)])
def test_every_plan_the_scheduler_makes_passes_the_step_check(m, ranks):
    for rank in range(ranks):
        check_step_request(_plan(m, ranks, rank), m)


N = pb.Node
BAD_PLANS = {
    "negative step": dict(step=-1),
    "rank out of range": dict(rank=3),
    "ranks not 0..n-1": dict(peers=[pb.Peer(rank=r, address="a") for r in (0, 2, 3)]),
    "more ranks than microbatches": dict(peers=[pb.Peer(rank=r, address="a") for r in range(9)]),
    "a peer without address": dict(peers=[pb.Peer(rank=0, address="a"), pb.Peer(rank=1, address="b"),
                                          pb.Peer(rank=2, address="")]),
    "owners and nodes differ in length": dict(node_owner=[0, 1]),
    "a subtree outside the tree": dict(all_nodes=[N(level=4, index=0), N(level=0, index=0)], node_owner=[0, 1]),
    "a gap": dict(all_nodes=[N(level=2, index=0), N(level=1, index=3)], node_owner=[0, 1]),
    "an overlap": dict(all_nodes=[N(level=3, index=0), N(level=2, index=0)], node_owner=[0, 1]),
    "a rank owning nothing": dict(all_nodes=[N(level=3, index=0)], node_owner=[0]),
    "an owner out of range": dict(node_owner=[0, 0, 7]),
    "not this rank's share": dict(nodes=[N(level=0, index=0)]),
    "a negative level": dict(all_nodes=[N(level=-1, index=0)], node_owner=[0]),
    "huge repeated": dict(all_nodes=[N(level=0, index=0)] * 10_000, node_owner=[0] * 10_000),
}


@pytest.mark.parametrize("defect", sorted(BAD_PLANS))
def test_a_plan_that_could_not_run_to_the_end_is_refused(defect):
    with pytest.raises(ProtocolError):
        check_step_request(_plan(8, 3, 1, **BAD_PLANS[defect]), 8)


# -- state transfers ---------------------------------------------------------------------------


def test_a_bfloat16_state_crosses_a_transfer_as_bfloat16():
    leaf = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3)
    other = np.ones(3, dtype=np.float32)
    chunks = list(inline(state_chunks([leaf, other], 4, 5)))
    leaves, applied, digest = assemble_state(iter(chunks), expect=[((2, 3), leaf.dtype), ((3,), np.float32)])
    assert applied == 4 and leaves[0].dtype == leaf.dtype and (leaves[0] == leaf).all() and (leaves[1] == other).all()
    assert digest == state_digest([leaf, other])


def test_a_state_of_another_layout_or_hash_is_refused_before_it_is_adopted():
    leaf = np.arange(8, dtype=np.float32)
    good = list(inline(state_chunks([leaf], 2, 16, state_digest([leaf]))))
    assert (assemble_state(iter(good), expect=[((8,), np.float32)])[0][0] == leaf).all()
    with pytest.raises(ProtocolError, match="expect"):
        assemble_state(iter(good), expect=[((4, 2), np.float32)])
    lying = list(inline(state_chunks([leaf], 2, 16, state_digest([leaf + 1]))))
    with pytest.raises(ProtocolError, match="hash"):
        assemble_state(iter(lying), expect=[((8,), np.float32)])
    huge = [pb.StateChunk.FromString(c.SerializeToString()) for c in good]
    huge[0].total_bytes = 1 << 60
    with pytest.raises(ProtocolError):
        assemble_state(iter(huge))   # refused by its shape, without allocating 2**60 bytes


def test_a_snapshot_copy_is_kept_whole_or_refused_and_the_run_end_gives_the_memory_back(worker, tmp_path):
    from runtime.state.snapshot import SnapshotStore

    service, stub = worker
    leaves = [np.arange(8, dtype=np.float32)]
    source = SnapshotStore(str(tmp_path / "writer-host"))
    source.save(4, leaves, digest=state_digest(leaves), metadata={})

    def pieces(cut=0):
        got = [pb.SnapshotPiece(fence=FENCE, step=s, total_bytes=n, data=d) for s, n, d in source.pieces(4, 16)]
        return iter(got[:len(got) - cut])

    with pytest.raises(grpc.RpcError) as info:   # a worker of a run without snapshots keeps none
        stub.KeepSnapshot(pieces(), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "keeps no snapshots" in info.value.details()
    service.state_mover.snapshots = SnapshotStore(str(tmp_path / "peer-host"))
    with pytest.raises(grpc.RpcError) as info:   # cut off: refused, nothing listed or left
        stub.KeepSnapshot(pieces(cut=1), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ended after" in info.value.details()
    assert service.state_mover.snapshots.steps() == [] and service.state_mover.snapshots.leftovers() == []
    stub.KeepSnapshot(pieces(), timeout=10)
    kept = service.state_mover.snapshots
    assert kept.steps() == [4] and kept.restore().digest == state_digest(leaves)

    stub.Shutdown(pb.ShutdownRequest(fence=FENCE), timeout=10)   # sent home mid-run: its host keeps them
    assert service.state_mover.snapshots.steps() == [4]
    stub.Shutdown(pb.ShutdownRequest(fence=FENCE, run_ended=True), timeout=10)
    assert not (tmp_path / "peer-host").exists()


def test_a_pipelined_runs_snapshot_copy_goes_into_its_stages_directory_on_any_worker(worker, tmp_path):
    from runtime.state.snapshot import SnapshotStore

    service, stub = worker
    leaves = [np.arange(8, dtype=np.float32)]
    source = SnapshotStore(str(tmp_path / "writer-host" / "stage1"))
    source.save(4, leaves, digest=state_digest(leaves), metadata={})

    def pieces(stage):
        return iter([pb.SnapshotPiece(fence=FENCE, step=s, total_bytes=n, data=d, stage=stage)
                     for s, n, d in source.pieces(4, 16)])

    home = tmp_path / "peer-host"
    mover = service.state_mover
    mover.snapshots, mover.snapshot_home = SnapshotStore(str(home / "stage0")), str(home)   # it runs stage 0
    for bad in ("../escape", "stage1/.."):
        with pytest.raises(grpc.RpcError) as info:
            stub.KeepSnapshot(pieces(bad), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "has no place" in info.value.details()
    stub.KeepSnapshot(pieces("stage1"), timeout=10)   # stage 1's copy, kept by a worker of stage 0
    assert SnapshotStore(str(home / "stage1")).steps() == [4] and service.state_mover.snapshots.steps() == []
    stub.Shutdown(pb.ShutdownRequest(fence=FENCE, run_ended=True), timeout=10)
    assert not home.exists()   # every stage's copies on this host go with the run


# --------------------------------------------------------------------------- client generations and the grace


def test_an_older_client_generation_is_refused_as_superseded_and_a_newer_one_must_attach(worker):
    service, stub = worker
    service.lease.generation = 2
    with pytest.raises(grpc.RpcError) as info:
        stub.Progress(pb.ProgressRequest(fence=pb.Fence(run_id="run", epoch=1, generation=1)), timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "taken over by generation 2" in \
        info.value.details()
    with pytest.raises(grpc.RpcError) as info:   # a newer one is not served before its Attach
        stub.Progress(pb.ProgressRequest(fence=pb.Fence(run_id="run", epoch=1, generation=3)), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "has not attached" in info.value.details()
    stub.Progress(pb.ProgressRequest(fence=pb.Fence(run_id="run", epoch=1, generation=2)), timeout=10)


def test_a_call_that_comes_before_the_registrations_answer_waits_for_the_generation_it_brings(worker):
    """A worker relaunched by a restarted client (generation 1) is called as soon as it registered, and may
    read its registration's answer only after the call came: the call waits for it, and is not refused."""
    service, stub = worker
    service.lease.joining()
    call = stub.Progress.future(pb.ProgressRequest(fence=pb.Fence(run_id="run", epoch=1, generation=1)), timeout=10)
    time.sleep(0.3)
    assert not call.done()
    service.lease.joined(1)
    assert call.result(timeout=10) is not None and service.lease.generation == 1


def test_attach_adopts_the_newer_generation_unfences_and_answers_who_it_is(worker):
    service, stub = worker
    service.identity = pb.AttachReply(worker_id="w", address="127.0.0.1:1", num_devices=1, platform="cpu", pid=7)
    service.lease.fenced, service.lease.client_lost_at = "no word from the controller", 1.0
    seen = []
    service.lease.serving = seen.append
    reply = stub.Attach(pb.AttachRequest(fence=pb.Fence(run_id="run", epoch=5, generation=1), controller="h:9",
                                         lease_seconds=3.0, client_grace_seconds=30.0), timeout=10)
    assert (reply.worker_id, reply.address, reply.applied_steps, reply.previous_generation) == ("w", "127.0.0.1:1",
                                                                                                 -1, 0)
    assert (service.lease.generation, service.replica.epoch, service.lease.fenced, service.lease.client_lost_at) == \
        (1, 5, "", None)
    assert (service.lease.controller, service.lease.seconds, service.lease.client_grace) == ("h:9", 3.0, 30.0)
    assert seen == [True]
    for generation in (1, 0):   # the same generation again, or an older one: a stale client
        with pytest.raises(grpc.RpcError) as info:
            stub.Attach(pb.AttachRequest(fence=pb.Fence(run_id="run", epoch=6, generation=generation)), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert service.lease.generation == 1 and service.replica.epoch == 5


def test_attach_with_other_programs_is_refused_and_changes_nothing(worker):
    service, stub = worker
    service.state_mover.fingerprint = "a" * 64
    with pytest.raises(grpc.RpcError) as info:
        stub.Attach(pb.AttachRequest(fence=pb.Fence(run_id="run", epoch=5, generation=1), fingerprint="b" * 64),
                    timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "other programs" in info.value.details()
    assert service.lease.generation == 0 and service.replica.epoch == 0
    # a pipelined run's client brings each stage's programs: a worker running one of them is taken over
    with pytest.raises(grpc.RpcError) as info:
        stub.Attach(pb.AttachRequest(fence=pb.Fence(run_id="run", epoch=5, generation=1),
                                     stage_fingerprints=["b" * 64, "c" * 64]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bbbbbbbbbbbb, cccccccccccc" in \
        info.value.details()
    reply = stub.Attach(pb.AttachRequest(fence=pb.Fence(run_id="run", epoch=5, generation=1),
                                         stage_fingerprints=["b" * 64, "a" * 64]), timeout=10)
    assert reply.fingerprint == "a" * 64 and service.lease.generation == 1


def test_a_worker_with_a_grace_waits_it_out_whatever_it_holds(monkeypatch):
    """The grace comes with the registration's answer (``joined``): a worker relaunched, a spare, a newcomer not
    loaded yet outlives its client for it as one holding a state does; without a grace every worker exits."""
    import types

    service = WorkerService("run", "w")
    try:
        service.lease.joined(0, client_grace=0.0)
        service.replica.executor = types.SimpleNamespace(state=object())
        assert not service.lease.lose_client("gone")   # no grace: it exits at once, as before
        clock = [100.0]
        monkeypatch.setattr("runtime.worker.lease.time.monotonic", lambda: clock[0])
        for executor in (None, types.SimpleNamespace(state=None)):   # nothing loaded yet; programs, no state
            service.lease.joined(0, client_grace=30.0)
            service.lease.client_lost_at, service.lease.fenced = None, ""
            service.replica.executor = executor
            assert service.lease.lose_client("the run's owner is gone")
            assert service.lease.fenced == "the run's owner is gone" and not service.lease.grace_over()
        clock[0] += 30.5
        assert service.lease.grace_over()
    finally:
        service.close()
