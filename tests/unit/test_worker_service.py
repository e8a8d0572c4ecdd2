"""The worker's gRPC service on a real in-process server (no programs loaded) and its fault switchboard."""

import grpc
import pytest

from runtime import FAULT_ACTIONS, rpc
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.fault_injection import PHASES, WorkerFaults
from runtime.worker import WorkerService

FENCE = pb.Fence(run_id="run", epoch=1)


@pytest.fixture
def worker():
    service = WorkerService("run", "w")
    server, port = rpc.make_server()
    pb_grpc.add_WorkerServicer_to_server(service, server)
    server.start()
    try:
        yield service, pb_grpc.WorkerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    finally:
        server.stop(0)
        service.collective.close()


@pytest.mark.parametrize("chunk_bytes", [-1, 100, 4095])
def test_load_refuses_a_chunk_size_out_of_range_before_any_work(worker, chunk_bytes):
    service, stub = worker
    with pytest.raises(grpc.RpcError) as info:
        stub.Load(pb.LoadRequest(fence=FENCE, chunk_bytes=chunk_bytes), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"chunk_bytes={chunk_bytes}" in info.value.details()
    assert service.executor is None and service.chunk_bytes == 4 << 20


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
            service.last_contact = 0.0
            service.heard(method)
            assert (service.last_contact > 0.0) == renews, method
    finally:
        service.collective.close()


def test_every_controller_method_is_a_method_of_the_service():
    names = {m for m in pb.DESCRIPTOR.services_by_name["Worker"].methods_by_name}
    assert {m for m in WorkerService.CONTROLLER_METHODS if not m.startswith("/")} <= names
    assert names - {"Push", "GetState"} == {m for m in WorkerService.CONTROLLER_METHODS if not m.startswith("/")}


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
