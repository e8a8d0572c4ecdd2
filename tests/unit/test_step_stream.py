"""The step stream (runtime.control.step_stream and runtime.worker.step_stream), on both its transports: real gRPC
(``Steps``) and a real data-plane connection (``STEP`` frames after the run secret's handshake). Each answer
resolves the future of its (epoch, step), failures arrive as the unary call's would, and a broken stream, a
cancel, a deadline, a partition and an old stream each end the way the unary call would have."""

import threading
import time
from concurrent import futures

import grpc
import pytest

from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.control.step_stream import StepStreams
from runtime.core.errors import StaleEpochError, WorkerFencedError, WorkerLostError
from runtime.worker.step_stream import serve_step_connection, serve_steps
from runtime.wire import rpc
from runtime.wire.dataplane import DataServer
from runtime.wire.dataplane_client import DataClient
from runtime.wire.dataplane_wire import REPLY, STEP, read_frame_head, recv_bytes, send_frame

SECRET = "step-stream-secret"
TRANSPORTS = ["grpc", "dataplane"]


class Worker(pb_grpc.WorkerServicer):
    """Answers each step after ``hold[step]`` is set (at once when absent); ``fail[step]`` raises instead. Serves
    the stream on gRPC and on a data plane; ``transport`` says which one its controller uses."""

    def __init__(self, transport: str = "grpc"):
        self.hold, self.fail, self.heard, self.partitioned = {}, {}, 0, False
        self.transport = transport
        self.server = grpc.server(futures.ThreadPoolExecutor(8))
        pb_grpc.add_WorkerServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.stub = pb_grpc.WorkerStub(grpc.insecure_channel(f"127.0.0.1:{self.port}"))
        self.data = DataServer("127.0.0.1", secret=SECRET, tls=None, on_push=self.refuse, on_state=self.refuse,
                               status_name=rpc.status_name, on_steps=self.serve_connection)

    @staticmethod
    def refuse(_):
        raise ValueError("not this test's")

    def serve_connection(self, sock, first):
        serve_step_connection(sock, first, step=self.step, heard=self.count, dropped=lambda: self.partitioned)

    def count(self):
        self.heard += 1

    def streams(self, secret: str = SECRET, **kw) -> StepStreams:
        return StepStreams(dial=lambda a: DataClient(secret, None).connect(a, time.monotonic() + 5), **kw)

    def send(self, streams: StepStreams, req: pb.StepRequest):
        return streams.send("w", self.stub, req, self.data.address if self.transport == "dataplane" else "")

    def stop(self):
        self.server.stop(0)
        self.data.close()

    def step(self, req, caller):
        gate = self.hold.get(req.step)
        while gate is not None and not gate.wait(0.05):
            if not caller.is_active():
                raise StaleEpochError("the caller went away")
        if req.step in self.fail:
            raise self.fail[req.step]
        return pb.StepReply(loss_sum=float(req.step) + req.fence.epoch / 10)

    def Steps(self, request_iterator, context):
        return serve_steps(request_iterator, context, step=self.step, heard=self.count,
                           dropped=lambda: self.partitioned)


def request(step, epoch=1):
    return pb.StepRequest(fence=pb.Fence(run_id="r", epoch=epoch), step=step)


@pytest.fixture(params=TRANSPORTS)
def worker(request):
    w = Worker(request.param)
    yield w
    w.stop()


def test_answers_resolve_their_own_steps_in_any_order_and_each_renews_the_lease(worker):
    streams = worker.streams(step_seconds=30)
    worker.hold[0] = threading.Event()
    first, second = worker.send(streams, request(0)), worker.send(streams, request(1))
    assert second.result(10).loss_sum == 1.1 and not first.done()   # step 1 answered first
    worker.hold[0].set()
    assert first.result(10).loss_sum == 0.1 and worker.heard == 2
    again = worker.send(streams, request(0, epoch=2))   # the same step in a new epoch, same stream
    assert again.result(10).loss_sum == 0.2
    streams.close()


def test_a_failed_step_arrives_as_the_unary_call_would_have_ended(worker):
    told = []
    streams = worker.streams(step_seconds=30, heard=lambda w, sent: told.append((w, sent)))
    worker.fail[3] = WorkerFencedError("fenced: lease lapsed")
    worker.fail[4] = ValueError("user code")
    with pytest.raises(grpc.RpcError) as err:
        worker.send(streams, request(3)).result(10)
    assert isinstance(rpc.to_error("w", err.value), WorkerFencedError)
    with pytest.raises(grpc.RpcError) as err:
        worker.send(streams, request(4)).result(10)
    assert err.value.code() == grpc.StatusCode.INTERNAL and "ValueError: user code" in err.value.details()
    before = time.monotonic()
    assert worker.send(streams, request(5)).result(10).loss_sum == 5.1   # the stream goes on
    # The health monitor hears of the answered step only (a failed one is no sign of a healthy worker), with
    # the time it was sent.
    assert len(told) == 1 and told[0][0] == "w" and before <= told[0][1] <= time.monotonic()
    streams.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_worker_gone_fails_its_steps_in_flight_as_lost(transport):
    w = Worker(transport)
    streams = w.streams(step_seconds=30)
    w.hold[0] = threading.Event()
    fut = w.send(streams, request(0))
    time.sleep(0.3)
    w.stop()
    with pytest.raises(grpc.RpcError) as err:
        fut.result(10)
    assert isinstance(rpc.to_error("w", err.value), WorkerLostError)
    streams.close()


def test_a_cancelled_step_ignores_its_late_answer_and_a_dropped_worker_gets_a_new_stream(worker):
    streams = worker.streams(step_seconds=30)
    worker.hold[0] = threading.Event()
    fut = worker.send(streams, request(0))
    assert fut.cancel() and fut.cancelled()
    with pytest.raises(grpc.FutureCancelledError):
        fut.result(1)
    worker.hold[0].set()
    streams.drop("w")   # declared dead: its stream ends
    assert worker.send(streams, request(0, epoch=2)).result(10).loss_sum == 0.2
    assert streams.cancelled(request(9)).cancelled()
    streams.close()


def test_an_unanswered_step_fails_at_its_deadline_and_a_partition_drops_requests(worker):
    streams = worker.streams(step_seconds=0.5)
    worker.partitioned = True
    fut = worker.send(streams, request(0))
    with pytest.raises(grpc.RpcError) as err:
        fut.result(10)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert isinstance(rpc.to_error("w", err.value), WorkerLostError)
    worker.partitioned = False
    assert worker.send(streams, request(1)).result(10).loss_sum == 1.1
    streams.close()


def test_an_old_stream_takes_no_more_requests_but_answers_those_sent_on_it(worker):
    streams = worker.streams(step_seconds=30, stream_seconds=0.2)
    worker.hold[0] = threading.Event()
    first = worker.send(streams, request(0))
    time.sleep(0.4)
    second = worker.send(streams, request(1))   # on a new stream
    assert second.result(10).loss_sum == 1.1
    worker.hold[0].set()
    assert first.result(10).loss_sum == 0.1
    streams.close()


def test_a_data_plane_stream_refuses_a_wrong_secret_and_ends_on_a_malformed_request():
    w = Worker("dataplane")
    try:
        streams = w.streams(secret="not the run's", step_seconds=30)
        with pytest.raises(grpc.RpcError) as err:
            w.send(streams, request(0)).result(10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and w.heard == 0
        streams.close()
        # A request that does not parse: the worker answers INVALID_ARGUMENT and closes the connection.
        sock = DataClient(SECRET, None).connect(w.data.address, time.monotonic() + 5)
        send_frame(sock, STEP, b"", b"\xff\xff not a StepRequest")
        kind, header, plen = read_frame_head(sock)
        assert kind == REPLY and header == b"INVALID_ARGUMENT" and b"does not parse" in recv_bytes(sock, plen)
        sock.close()
    finally:
        w.stop()


def test_a_worker_that_stops_reading_fails_its_stream_instead_of_blocking_the_controller():
    stop = threading.Event()
    server = DataServer("127.0.0.1", secret=SECRET, tls=None, on_push=Worker.refuse, on_state=Worker.refuse,
                        status_name=rpc.status_name, on_steps=lambda sock, first: stop.wait(30))   # reads no more
    streams = StepStreams(step_seconds=30, send_seconds=0.5,
                          dial=lambda a: DataClient(SECRET, None).connect(a, time.monotonic() + 5))
    try:
        assert not streams.send("w", None, request(0), server.address).done()   # read, never answered
        big = request(1)
        big.committed_loss_sums.extend([1.0] * (6 << 20))   # 48 MB: more than the socket buffers hold
        began = time.monotonic()
        fut = streams.send("w", None, big, server.address)
        assert time.monotonic() - began < 10   # the write gave up instead of waiting on the worker
        with pytest.raises(grpc.RpcError) as err:
            fut.result(10)
        assert isinstance(rpc.to_error("w", err.value), WorkerLostError)
    finally:
        stop.set()
        streams.close()
        server.close()


def test_a_step_sent_after_its_stream_was_refused_fails_as_the_stream_did_not_as_closed():
    """The data-plane stream's reader may meet the refusal (its handshake) before the first request is written:
    that request fails UNAUTHENTICATED, as one written before would, never with UNAVAILABLE "closed" (seen under
    load in the suite)."""
    from runtime.control.step_stream import _SocketStream
    from runtime.wire.dataplane_client import RemoteError

    def dial():
        raise RemoteError("UNAUTHENTICATED", "wrong run secret")

    ended = threading.Event()
    stream = _SocketStream(dial, lambda s: ended.set(), None, 5.0)
    assert ended.wait(10)   # the reader met the refusal before anything was sent
    with pytest.raises(grpc.RpcError) as err:
        stream.send(request(0), 30).result(10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
