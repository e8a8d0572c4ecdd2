"""The worker under fuzz, shared by ``test_rpc_fuzz.py`` and ``test_rpc_fuzz_wire.py``.

One real worker process (chaos off, no lease) with a freshly initialized state, its controller, and a lying
state source; ``Target.refused`` and ``Target.unharmed`` are the checks every example makes. Each test module
opens its own (``open_target`` behind a module-scoped ``target`` fixture).
"""

import dataclasses

import grpc
from hypothesis import HealthCheck, settings

from runtime.wire import rpc
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.core.errors import ProtocolError, StaleEpochError, StepAbortedError
from tests.support.worker_harness import (RUN, SECRET, Controller, load_request, member, start_worker, stop,
                                          tiny_programs)

EPOCH = 10                      # the worker's epoch during the fuzz; lower ones are old
M, P = 2, 8                     # microbatches and gradient size of the tiny programs
ROOT_NODE = pb.Node(level=1, index=0)
TYPED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED,
         grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


def fence(epoch=EPOCH, run_id=RUN):
    return pb.Fence(run_id=run_id, epoch=epoch)


class LyingSource(pb_grpc.WorkerServicer):
    """A peer with the run secret whose GetState streams whatever the test sets in ``chunks``."""

    def __init__(self):
        self.chunks: list[pb.StateChunk] = []
        self.server, port = rpc.make_server(secret=SECRET)
        pb_grpc.add_WorkerServicer_to_server(self, self.server)
        self.server.start()
        self.address = f"127.0.0.1:{port}"

    def GetState(self, request, context):
        yield from self.chunks


@dataclasses.dataclass
class Target:
    proc: object
    log: object
    address: str
    stub: pb_grpc.WorkerStub
    controller: Controller
    programs: object
    initial: tuple
    state: list            # the worker's state chunks, as GetState streams them
    liar: LyingSource

    def refused(self, call, allow_ok: bool = False):
        """Runs ``call``; it must fail with a typed status (or, with ``allow_ok``, may succeed). Returns the code."""
        try:
            call()
        except grpc.RpcError as e:
            details = e.details() or ""
            assert e.code() in TYPED, (e.code(), details[-2000:])
            assert "Traceback" not in details, details[-2000:]
            assert isinstance(rpc.to_error("w0", e), (ProtocolError, StaleEpochError, StepAbortedError))
            return e.code()
        assert allow_ok, "a malformed call was accepted"
        return grpc.StatusCode.OK

    def unharmed(self):
        assert self.proc.poll() is None, f"the worker died ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}"
        reply = self.stub.StateHash(pb.HashRequest(fence=fence()), timeout=10)
        assert (reply.step, reply.digest) == self.initial


def open_target(tmp_path_factory):
    """Yields a `Target` (for a module-scoped fixture); stops the worker, the liar and the controller after."""
    tmp = tmp_path_factory.mktemp("fuzz")
    controller = Controller(tmp, max_message=1 << 20)
    log = tmp / "worker-w0.log"
    proc = start_worker(controller, "w0", log)
    liar = LyingSource()
    try:
        info = controller.wait_for("w0")
        stub = member(info.address)
        programs = tiny_programs(M)
        stub.Load(load_request(programs, fence=fence()), timeout=120)
        stub.Init(pb.InitRequest(fence=fence(), seed=0), timeout=60)
        reply = stub.StateHash(pb.HashRequest(fence=fence()), timeout=10)
        state = list(stub.GetState(pb.GetStateRequest(fence=fence(), applied_steps=0), timeout=30))
        yield Target(proc, log, info.address, stub, controller, programs, (reply.step, reply.digest), state, liar)
    finally:
        stop(proc)
        liar.server.stop(0)
        controller.close()
