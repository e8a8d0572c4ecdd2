"""The step stream over real gRPC (runtime.control.step_stream and runtime.worker.step_stream): each answer
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
from runtime.worker.step_stream import serve_steps
from runtime.wire import rpc


class Worker(pb_grpc.WorkerServicer):
    """Answers each step after ``hold[step]`` is set (at once when absent); ``fail[step]`` raises instead."""

    def __init__(self):
        self.hold, self.fail, self.heard, self.partitioned = {}, {}, 0, False
        self.server = grpc.server(futures.ThreadPoolExecutor(8))
        pb_grpc.add_WorkerServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.stub = pb_grpc.WorkerStub(grpc.insecure_channel(f"127.0.0.1:{self.port}"))

    def step(self, req, caller):
        gate = self.hold.get(req.step)
        while gate is not None and not gate.wait(0.05):
            if not caller.is_active():
                raise StaleEpochError("the caller went away")
        if req.step in self.fail:
            raise self.fail[req.step]
        return pb.StepReply(loss_sum=float(req.step) + req.fence.epoch / 10)

    def Steps(self, request_iterator, context):
        def heard():
            self.heard += 1
        return serve_steps(request_iterator, context, step=self.step, heard=heard, dropped=lambda: self.partitioned)


def request(step, epoch=1):
    return pb.StepRequest(fence=pb.Fence(run_id="r", epoch=epoch), step=step)


@pytest.fixture
def worker():
    w = Worker()
    yield w
    w.server.stop(0)


def test_answers_resolve_their_own_steps_in_any_order_and_each_renews_the_lease(worker):
    streams = StepStreams(step_seconds=30)
    worker.hold[0] = threading.Event()
    first, second = streams.send("w", worker.stub, request(0)), streams.send("w", worker.stub, request(1))
    assert second.result(10).loss_sum == 1.1 and not first.done()   # step 1 answered first
    worker.hold[0].set()
    assert first.result(10).loss_sum == 0.1 and worker.heard == 2
    again = streams.send("w", worker.stub, request(0, epoch=2))   # the same step in a new epoch, same stream
    assert again.result(10).loss_sum == 0.2
    streams.close()


def test_a_failed_step_arrives_as_the_unary_call_would_have_ended(worker):
    told = []
    streams = StepStreams(step_seconds=30, heard=lambda w, sent: told.append((w, sent)))
    worker.fail[3] = WorkerFencedError("fenced: lease lapsed")
    worker.fail[4] = ValueError("user code")
    with pytest.raises(grpc.RpcError) as err:
        streams.send("w", worker.stub, request(3)).result(10)
    assert isinstance(rpc.to_error("w", err.value), WorkerFencedError)
    with pytest.raises(grpc.RpcError) as err:
        streams.send("w", worker.stub, request(4)).result(10)
    assert err.value.code() == grpc.StatusCode.INTERNAL and "ValueError: user code" in err.value.details()
    before = time.monotonic()
    assert streams.send("w", worker.stub, request(5)).result(10).loss_sum == 5.1   # the stream goes on
    # The health monitor hears of the answered step only (a failed one is no sign of a healthy worker), with
    # the time it was sent.
    assert len(told) == 1 and told[0][0] == "w" and before <= told[0][1] <= time.monotonic()
    streams.close()


def test_a_worker_gone_fails_its_steps_in_flight_as_lost():
    w = Worker()
    streams = StepStreams(step_seconds=30)
    w.hold[0] = threading.Event()
    fut = streams.send("w", w.stub, request(0))
    time.sleep(0.3)
    w.server.stop(0)
    with pytest.raises(grpc.RpcError) as err:
        fut.result(10)
    assert isinstance(rpc.to_error("w", err.value), WorkerLostError)
    streams.close()


def test_a_cancelled_step_ignores_its_late_answer_and_a_dropped_worker_gets_a_new_stream(worker):
    streams = StepStreams(step_seconds=30)
    worker.hold[0] = threading.Event()
    fut = streams.send("w", worker.stub, request(0))
    assert fut.cancel() and fut.cancelled()
    with pytest.raises(grpc.FutureCancelledError):
        fut.result(1)
    worker.hold[0].set()
    streams.drop("w")   # declared dead: its stream ends
    assert streams.send("w", worker.stub, request(0, epoch=2)).result(10).loss_sum == 0.2
    assert streams.cancelled(request(9)).cancelled()
    streams.close()


def test_an_unanswered_step_fails_at_its_deadline_and_a_partition_drops_requests(worker):
    streams = StepStreams(step_seconds=0.5)
    worker.partitioned = True
    fut = streams.send("w", worker.stub, request(0))
    with pytest.raises(grpc.RpcError) as err:
        fut.result(10)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert isinstance(rpc.to_error("w", err.value), WorkerLostError)
    worker.partitioned = False
    assert streams.send("w", worker.stub, request(1)).result(10).loss_sum == 1.1
    streams.close()


def test_an_old_stream_takes_no_more_requests_but_answers_those_sent_on_it(worker):
    streams = StepStreams(step_seconds=30, stream_seconds=0.2)
    worker.hold[0] = threading.Event()
    first = streams.send("w", worker.stub, request(0))
    time.sleep(0.4)
    second = streams.send("w", worker.stub, request(1))   # on a new stream
    assert second.result(10).loss_sum == 1.1
    worker.hold[0].set()
    assert first.result(10).loss_sum == 0.1
    streams.close()
