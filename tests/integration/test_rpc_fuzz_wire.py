"""Bounded fuzz of what reaches the servers as bytes: undecodable messages, oversized ones, and registrations.

From a caller with the run secret: random bytes as every Worker method's request and as the controller's Register,
messages over the size limit to both servers, and malformed or foreign registrations. One real worker process and
its controller (``_rpc_fuzz_target.py``); each example checks that the call is refused with a typed status (never
INTERNAL with a traceback), that the worker lives with its state hash and applied step unchanged, and that no
registration is recorded. The Worker's rules for well-formed messages are fuzzed in ``test_rpc_fuzz.py``. Examples
are derandomized (the same every run) and no example database is written.
"""

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.wire import auth, rpc
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.core.errors import ProtocolError
from tests.integration._rpc_fuzz_target import FUZZ, fence, open_target
from tests.support.worker_harness import RUN, SECRET, load_request

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    yield from open_target(tmp_path_factory)


# -- bytes that are no message at all, and messages over the limit -------------------------


WORKER_METHODS = {name: m for name, m in pb.DESCRIPTOR.services_by_name["Worker"].methods_by_name.items()}


@FUZZ
@given(data=st.data())
def test_random_bytes_as_any_message_are_refused(target, data):
    channel = auth.secure_channel(grpc.insecure_channel(target.address), SECRET)
    try:
        name = data.draw(st.sampled_from(sorted(WORKER_METHODS)), label="method")
        method = WORKER_METHODS[name]
        path = f"/jax_elastic.Worker/{name}"
        blobs = data.draw(st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=3), label="bytes")
        if method.client_streaming and method.server_streaming:   # Steps: each request is answered on the stream
            steps = channel.stream_stream(path)
            call = lambda: [steps_refusal(raw) for raw in steps(iter(blobs), timeout=10)]   # noqa: E731
        elif method.client_streaming:
            call = lambda: channel.stream_unary(path)(iter(blobs), timeout=10)   # noqa: E731
        elif method.server_streaming:
            call = lambda: list(channel.unary_stream(path)(blobs[0], timeout=10))   # noqa: E731
        else:
            call = lambda: channel.unary_unary(path)(blobs[0], timeout=10)   # noqa: E731
        # Refusals takes an empty message: any bytes that parse are a valid request.
        target.refused(call, allow_ok=name == "Refusals")
    finally:
        channel.close()
    target.unharmed()


def steps_refusal(raw: bytes) -> None:
    """A reply on the step stream: a refused step is raised as the failed call it stands for."""
    reply = pb.StepReply.FromString(raw)
    if reply.error_code:
        raise rpc.StatusError(grpc.StatusCode[reply.error_code], reply.error_details, reply.error_kind)


@FUZZ
@given(blob=st.binary(min_size=1, max_size=300))
def test_random_bytes_as_a_registration_are_refused(target, blob):
    channel = auth.secure_channel(grpc.insecure_channel(target.controller.address), SECRET)
    try:
        try:
            register = channel.unary_unary("/jax_elastic.Controller/Register")
            reply = pb.RegisterReply.FromString(register(blob, timeout=10))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
        else:
            assert not reply.accepted
    finally:
        channel.close()
    assert set(target.controller.registry.workers) == {"w0"}


def test_messages_over_the_size_limit_are_refused_by_every_server(target):
    unlimited = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    worker = pb_grpc.WorkerStub(auth.secure_channel(grpc.insecure_channel(target.address, options=unlimited), SECRET))
    big = load_request(target.programs, fence=fence())
    big.data_source = b"\0" * (rpc.MAX_MESSAGE + 1)
    assert target.refused(lambda: worker.Load(big, timeout=60)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    controller = pb_grpc.ControllerStub(auth.secure_channel(
        grpc.insecure_channel(target.controller.address, options=unlimited), SECRET))
    with pytest.raises(grpc.RpcError) as info:   # the controller's server here allows 1 MiB
        controller.Register(pb.RegisterRequest(run_id=RUN, worker_id="w9", address="127.0.0.1:1", num_devices=1,
                                               platform="x" * (2 << 20), pid=2), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert isinstance(rpc.to_error("controller", info.value), ProtocolError)
    target.unharmed()


# -- the controller's Register ---------------------------------------------------------------


def _registration(draw) -> pb.RegisterRequest:
    req = pb.RegisterRequest(run_id=RUN, worker_id="fuzz", address="127.0.0.1:5000", num_devices=1, platform="cpu",
                             pid=1234)
    defect = draw(st.sampled_from(["worker_id", "address", "num_devices", "platform", "pid", "huge"]))
    if defect == "worker_id":
        req.worker_id = draw(st.sampled_from(["", "x" * 129, "a\nb", "\0"]))
    elif defect == "address":
        req.address = draw(st.sampled_from(["", "host", ":5000", "h:0", "h:65536", "h:-1", "h:port", "h:5000\n"]))
    elif defect == "num_devices":
        req.num_devices = draw(st.one_of(st.integers(-(1 << 31), 0), st.integers((1 << 16) + 1, (1 << 31) - 1)))
    elif defect == "platform":
        req.platform = draw(st.sampled_from(["", "x" * 33]))
    elif defect == "pid":
        req.pid = draw(st.one_of(st.integers(-(1 << 63), 1), st.integers(1 << 32, (1 << 63) - 1)))
    else:
        req.worker_id = "y" * draw(st.integers(129, 100_000))
    return req


@FUZZ
@given(data=st.data())
def test_malformed_registrations_are_refused_and_not_recorded(target, data):
    controller = pb_grpc.ControllerStub(rpc.channel(target.controller.address, SECRET))
    req = _registration(data.draw)
    with pytest.raises(grpc.RpcError) as info:
        controller.Register(req, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(rpc.to_error("controller", info.value), ProtocolError)
    assert set(target.controller.registry.workers) == {"w0"}


def test_a_registration_of_another_run_is_answered_not_accepted(target):
    controller = pb_grpc.ControllerStub(rpc.channel(target.controller.address, SECRET))
    reply = controller.Register(pb.RegisterRequest(run_id="other", worker_id="w5", address="127.0.0.1:5000",
                                                   num_devices=1, platform="cpu", pid=1234), timeout=10)
    assert not reply.accepted and "other" in reply.reason
    assert set(target.controller.registry.workers) == {"w0"}
