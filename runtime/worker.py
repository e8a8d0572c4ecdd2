"""The worker: one process per host, serving gRPC, owning its JAX devices.

Started by a launcher (or by hand with ``elastic worker``). It registers with
the controller, then receives programs and a data source, initializes its
replica of the state, and runs steps: local gradients over its subtrees of
microbatches, the peer-to-peer reduction, then the optimizer update.

Contract: steps run strictly in order; a ``Step`` request for step ``s+1``
that arrives early waits (bounded) for step ``s`` to finish, so the controller
may dispatch ahead. Messages of another run are refused (fencing).

Set ``XLA_FLAGS`` (device count) before this module is imported.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import socket
import sys
import threading
import time
import uuid
from concurrent import futures

import grpc
import jax
import numpy as np

from runtime import rpc
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.collective import ALL_GATHER, REDUCE_SCATTER, Mailbox, chunk_bounds, pieces
from runtime.errors import StaleEpochError, StepAbortedError
from runtime.executor import SliceExecutor, add_f32
from runtime.microbatch import Node, root, tree_reduce
from runtime.programs import ProgramSet

__all__ = ["WorkerService", "serve", "main"]

log = logging.getLogger("jax_elastic.worker")


def _node(n: pb.Node) -> Node:
    return Node(n.level, n.index)


class WorkerService(pb_grpc.WorkerServicer):
    """gRPC face of one worker. Each handler maps failures to status codes."""

    def __init__(self, run_id: str, worker_id: str, step_timeout: float = 300.0):
        self.run_id = run_id
        self.worker_id = worker_id
        self.epoch = 0
        self.step_timeout = step_timeout
        self.executor: SliceExecutor | None = None
        self.mailbox = Mailbox()
        self.chunk_bytes = 4 << 20
        self.next_step = 0
        self._order = threading.Condition()
        self._peers: dict[str, pb_grpc.WorkerStub] = {}
        self._send_pool = futures.ThreadPoolExecutor(max_workers=16)
        self.stopped = threading.Event()

    # -- fencing -------------------------------------------------------------

    def check_fence(self, fence: pb.Fence) -> None:
        if fence.run_id != self.run_id:
            raise StaleEpochError(f"message for run {fence.run_id!r}, this worker serves {self.run_id!r}")
        if fence.epoch < self.epoch:
            raise StaleEpochError(f"message from epoch {fence.epoch}, worker is at epoch {self.epoch}")
        self.epoch = fence.epoch

    def _guard(self, context, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every failure goes back to the caller as a status
            log.exception("request failed")
            rpc.abort_with(context, e)

    # -- control RPCs --------------------------------------------------------

    def Load(self, request, context):
        def load():
            self.check_fence(request.fence)
            programs = ProgramSet.from_parts({p.name: p.serialized for p in request.programs}, request.layout)
            source = pickle.loads(request.data_source)
            self.executor = SliceExecutor(programs, source)
            return pb.LoadReply(compile_seconds=self.executor.load())
        return self._guard(context, load)

    def Init(self, request, context):
        def init():
            self.check_fence(request.fence)
            self._need_executor()
            nbytes = self.executor.init(request.seed)
            with self._order:
                self.next_step = 0
            return pb.InitReply(state_bytes=nbytes)
        return self._guard(context, init)

    def StateHash(self, request, context):
        def digest():
            self.check_fence(request.fence)
            self._need_executor()
            with self._order:
                return pb.HashReply(sha256=self.executor.state_sha256(), step=self.executor.steps_applied)
        return self._guard(context, digest)

    def Shutdown(self, request, context):
        def stop():
            self.check_fence(request.fence)
            self.stopped.set()
            return pb.Empty()
        return self._guard(context, stop)

    def Push(self, request_iterator, context):
        def push():
            self.mailbox.receive(request_iterator, self.check_fence)
            return pb.Empty()
        return self._guard(context, push)

    def Step(self, request, context):
        return self._guard(context, lambda: self._step(request))

    # -- the step ------------------------------------------------------------

    def _need_executor(self):
        if self.executor is None:
            raise StaleEpochError("no programs loaded on this worker yet")

    def _step(self, req: pb.StepRequest) -> pb.StepReply:
        self.check_fence(req.fence)
        self._need_executor()
        deadline = time.monotonic() + self.step_timeout
        with self._order:
            while self.next_step != req.step:
                if self.next_step > req.step:
                    raise StaleEpochError(f"step {req.step} already applied (worker at {self.next_step})")
                if not self._order.wait(deadline - time.monotonic()) and time.monotonic() >= deadline:
                    raise StepAbortedError(req.step, f"still waiting for step {self.next_step}")
            reply = self._run_step(req, deadline)
            self.next_step = req.step + 1
            self._order.notify_all()
            return reply

    def _run_step(self, req: pb.StepRequest, deadline: float) -> pb.StepReply:
        ex = self.executor
        t0 = time.perf_counter()
        mine = ex.partials(req.step, [_node(n) for n in req.nodes])
        t1 = time.perf_counter()
        grad_sum, sent = self._all_reduce(req, {n: g for n, (_, g) in mine.items()}, deadline)
        t2 = time.perf_counter()
        ex.apply(grad_sum)
        t3 = time.perf_counter()
        losses = [pb.NodeLoss(node=pb.Node(level=n.level, index=n.index), loss_sum=float(l))
                  for n, (l, _) in mine.items()]
        return pb.StepReply(step=req.step, losses=losses, grad_seconds=t1 - t0, reduce_seconds=t2 - t1,
                            apply_seconds=t3 - t2, bytes_sent=sent)

    def _stub(self, address: str) -> pb_grpc.WorkerStub:
        stub = self._peers.get(address)
        if stub is None:
            stub = self._peers[address] = pb_grpc.WorkerStub(rpc.channel(address))
        return stub

    def _send(self, address: str, messages, deadline: float) -> None:
        try:
            self._stub(address).Push(messages, timeout=max(deadline - time.monotonic(), 0.001))
        except grpc.RpcError as e:
            raise StepAbortedError(-1, f"push to {address} failed: {e.code().name}") from e

    def _all_reduce(self, req: pb.StepRequest, partials: dict[Node, np.ndarray], deadline: float):
        """Reduce-scatter + all-gather; returns (canonical gradient sum, bytes sent)."""
        n = len(req.peers)
        size = self.executor.programs.grad_size
        top = root(self.executor.programs.num_microbatches)
        if n == 1:
            return tree_reduce(partials, top, add_f32), 0
        bounds = chunk_bounds(size, n)
        me = req.rank
        others = [p for p in req.peers if p.rank != me]
        expected = {r: {_node(nd) for nd, o in zip(req.all_nodes, req.node_owner) if o == r} for r in range(n)}

        def stream(phase, rank, items):
            lo, hi = bounds[rank]
            for node, vec in items:
                yield from pieces(req.fence, req.step, phase, me, node, vec[lo:hi] if phase == REDUCE_SCATTER
                                  else vec, self.chunk_bytes)

        sent = 0
        sends = []
        for p in others:
            lo, hi = bounds[p.rank]
            sent += 4 * (hi - lo) * len(partials)
            sends.append(self._send_pool.submit(self._send, p.address,
                                                stream(REDUCE_SCATTER, p.rank, partials.items()), deadline))
        got = self.mailbox.wait(req.step, REDUCE_SCATTER, {p.rank for p in others}, deadline)
        lo, hi = bounds[me]
        mine = {node: vec[lo:hi] for node, vec in partials.items()}
        for r, nodes in got.items():
            if set(nodes) != expected[r]:
                raise StepAbortedError(req.step, f"rank {r} sent subtrees {sorted(nodes)}, expected {sorted(expected[r])}")
            for node, vec in nodes.items():
                if vec.size != hi - lo:
                    raise StepAbortedError(req.step, f"rank {r} sent {vec.size} elements for a chunk of {hi - lo}")
            mine.update(nodes)
        reduced = tree_reduce(mine, top, add_f32)
        for f in sends:
            f.result()
        sends = []
        for p in others:
            sent += 4 * reduced.size
            sends.append(self._send_pool.submit(self._send, p.address,
                                                stream(ALL_GATHER, p.rank, [(top, reduced)]), deadline))
        gathered = self.mailbox.wait(req.step, ALL_GATHER, {p.rank for p in others}, deadline)
        out = np.empty(size, dtype=np.float32)
        out[lo:hi] = reduced
        for r, nodes in gathered.items():
            rlo, rhi = bounds[r]
            vec = nodes.get(top)
            if vec is None or vec.size != rhi - rlo:
                raise StepAbortedError(req.step, f"rank {r} sent a malformed all-gather chunk")
            out[rlo:rhi] = vec
        for f in sends:
            f.result()
        return out, sent


def serve(controller: str, run_id: str, worker_id: str, host: str = "127.0.0.1", port: int = 0,
          register_timeout: float = 60.0, parent_pid: int | None = None) -> None:
    """Runs a worker until told to shut down (or its parent process dies)."""
    service = WorkerService(run_id, worker_id)
    server, bound = rpc.make_server(host, port)
    pb_grpc.add_WorkerServicer_to_server(service, server)
    server.start()
    address = f"{host}:{bound}"
    stub = pb_grpc.ControllerStub(rpc.channel(controller))
    devices = jax.devices()
    reply = stub.Register(pb.RegisterRequest(run_id=run_id, worker_id=worker_id, address=address,
                                             num_devices=len(devices), platform=devices[0].platform,
                                             pid=os.getpid()),
                          timeout=register_timeout, wait_for_ready=True)
    if not reply.accepted:
        server.stop(0)
        raise SystemExit(f"controller refused worker {worker_id}: {reply.reason}")
    log.info("worker %s serving on %s with %d %s devices", worker_id, address, len(devices), devices[0].platform)
    while not service.stopped.wait(0.5):
        if parent_pid is not None and os.getppid() != parent_pid:
            log.warning("parent process %d is gone; exiting", parent_pid)
            break
    server.stop(grace=1.0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="elastic worker", description="Run a jax-elastic worker.")
    ap.add_argument("--controller", required=True, help="HOST:PORT of the controller")
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--worker-id", default=f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--exit-with-parent", action="store_true", help="exit when the launching process dies")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.worker_id} %(levelname)s %(message)s",
                        stream=sys.stderr)
    serve(args.controller, args.run_id, args.worker_id, args.host, args.port,
          parent_pid=os.getppid() if args.exit_with_parent else None)


if __name__ == "__main__":
    main()
