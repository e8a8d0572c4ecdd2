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
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from runtime import auth, rpc
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.collective import ALL_GATHER, REDUCE_SCATTER, Mailbox, assemble_state, chunk_bounds, pieces, state_chunks
from runtime.errors import StaleEpochError, StepAbortedError
from runtime.executor import SliceExecutor, add_f32
from runtime.fault_injection import FaultInjector, PartitionInterceptor
from runtime.microbatch import Node, root, tree_reduce
from runtime.programs import ProgramSet

__all__ = ["WorkerService", "serve", "main"]

log = logging.getLogger("jax_elastic.worker")


def _node(n: pb.Node) -> Node:
    return Node(n.level, n.index)


class WorkerService(pb_grpc.WorkerServicer):
    """gRPC face of one worker. Each handler maps failures to status codes.

    Concurrency: one step runs at a time (``_running``); ``Abort`` may arrive
    at any moment from another thread, adopts the new epoch, wakes the step if
    it waits on peers, and returns once no step runs. A step of an older
    epoch never applies after an abort was received.
    """

    def __init__(self, run_id: str, worker_id: str, secret: str = "", step_timeout: float = 300.0,
                 chaos: bool = False, tls=None):
        self.run_id = run_id
        self.worker_id = worker_id
        self.secret = secret
        self.epoch = 0
        self.step_timeout = step_timeout
        self.executor: SliceExecutor | None = None
        self.mailbox = Mailbox()
        self.chunk_bytes = 4 << 20
        self.next_step = 0
        self._running = False
        self._recent: dict[int, float] = {}   # step -> loss sum, last few applied
        self._cond = threading.Condition()
        self._peers: dict[str, tuple[grpc.Channel, pb_grpc.WorkerStub]] = {}
        self._send_pool = futures.ThreadPoolExecutor(max_workers=16)
        self.stopped = threading.Event()
        self.faults = FaultInjector(chaos)
        self.tls = tls
        self.lease = 0.0                      # seconds without the controller before fencing; 0: off
        self.last_contact = time.monotonic()
        self.fenced = ""                      # why this worker fenced itself ("" while a member)
        self._outgoing: dict[str, int] = {}   # peer address -> pushes in flight to it
        self.progress = (-1, "idle", time.monotonic())

    # -- fencing -------------------------------------------------------------

    def check_fence(self, fence: pb.Fence) -> None:
        """Refuses other runs and older epochs; adopts a newer epoch."""
        if fence.run_id != self.run_id:
            raise StaleEpochError(f"message for run {fence.run_id!r}, this worker serves {self.run_id!r}")
        if self.fenced:
            raise StaleEpochError(f"worker {self.worker_id} fenced itself: {self.fenced}")
        with self._cond:
            if fence.epoch < self.epoch:
                raise StaleEpochError(f"message from epoch {fence.epoch}, worker is at epoch {self.epoch}")
            if fence.epoch > self.epoch:
                self.epoch = fence.epoch
                self._abort_step(fence.epoch)

    def _guard(self, context, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every failure goes back to the caller as a status
            log.warning("%s failed: %s: %s", getattr(fn, "__name__", "request"), type(e).__name__, e)
            rpc.abort_with(context, e)

    # -- the worker's lease on its controller ---------------------------------

    CONTROLLER_METHODS = ("Load", "Init", "Step", "StateHash", "Shutdown", "Abort", "Rollback", "PullState",
                          "Chaos", "/grpc.health.v1.Health/Check")

    def heard(self, method: str) -> None:
        """Any call from the controller (not from a peer) renews the lease."""
        if method.endswith(self.CONTROLLER_METHODS):
            self.last_contact = time.monotonic()

    def lease_lapsed(self) -> bool:
        """Fences this worker when the controller has been silent longer than the lease.

        Called periodically by :func:`serve`. A fenced worker refuses all work
        and wakes a step waiting on peers; it never serves this run again.
        """
        if not self.lease or self.fenced:
            return bool(self.fenced)
        silent = time.monotonic() - self.last_contact
        if silent <= self.lease:
            return False
        self.fenced = f"no word from the controller for {silent:.1f} s (lease {self.lease:.1f} s)"
        log.warning("fencing myself: %s", self.fenced)
        with self._cond:
            self._abort_step(self.epoch + 1)
        return True

    def _abort_step(self, epoch: int) -> None:
        """With ``_cond`` held: a step waiting on peers or on a push gives up now."""
        self.mailbox.set_epoch(epoch)
        # A push to a hung peer would block until the step deadline: closing
        # the channel cancels its calls (the next push opens a new channel).
        # Blocking calls, not futures, on the hot path: futures cost ~5 ms a step.
        for address in [a for a, n in self._outgoing.items() if n]:
            entry = self._peers.pop(address, None)
            if entry is not None:
                entry[0].close()
        self._cond.notify_all()

    # -- control RPCs --------------------------------------------------------

    def Load(self, request, context):
        def load():
            self.check_fence(request.fence)
            programs = ProgramSet.from_parts({p.name: p.serialized for p in request.programs}, request.layout)
            source = pickle.loads(request.data_source)
            executor = SliceExecutor(programs, source)
            t0 = time.perf_counter()
            probed = probe_devices()
            probe_seconds = time.perf_counter() - t0
            compile_seconds = executor.load()
            self.executor = executor
            self.lease = max(request.lease_seconds, 0.0)
            self.last_contact = time.monotonic()
            return pb.LoadReply(compile_seconds=compile_seconds, devices_probed=probed, probe_seconds=probe_seconds)
        return self._guard(context, load)

    def Progress(self, request, context):
        def progress():
            self.check_fence(request.fence)
            step, phase, since = self.progress
            return pb.ProgressReply(step=step, phase=phase, seconds=time.monotonic() - since)
        return self._guard(context, progress)

    def Chaos(self, request, context):
        def arm():
            try:
                self.faults.arm(request.action, request.factor, request.seconds, request.phase)
            except PermissionError as e:
                raise StaleEpochError(str(e)) from None
            log.warning("chaos: armed %s (factor %s, %s s)", request.action, request.factor, request.seconds)
            return pb.Empty()
        return self._guard(context, arm)

    def Init(self, request, context):
        def init():
            self.check_fence(request.fence)
            self._need_executor()
            nbytes = self.executor.init(request.seed)
            with self._cond:
                self.next_step = 0
            return pb.InitReply(state_bytes=nbytes)
        return self._guard(context, init)

    def StateHash(self, request, context):
        def digest():
            self.check_fence(request.fence)
            self._need_state()
            with self._cond:
                return pb.HashReply(sha256=self.executor.state_sha256(), step=self.executor.steps_applied)
        return self._guard(context, digest)

    def Shutdown(self, request, context):
        def stop():
            self.check_fence(request.fence)
            self.stopped.set()
            return pb.Empty()
        return self._guard(context, stop)

    def Abort(self, request, context):
        def abort():
            self.check_fence(request.fence)
            deadline = time.monotonic() + self.step_timeout
            with self._cond:
                while self._running:
                    if not self._cond.wait(max(deadline - time.monotonic(), 0)):
                        raise StepAbortedError(self.next_step, "the running step did not stop")
                return self._status()
        return self._guard(context, abort)

    def Rollback(self, request, context):
        def rollback():
            self.check_fence(request.fence)
            self._need_state()
            with self._cond:
                if self._running:
                    raise StaleEpochError("cannot roll back while a step runs; abort first")
                ex = self.executor
                if ex.steps_applied == request.to_applied_steps + 1:
                    ex.rollback()
                    self._recent.pop(ex.steps_applied, None)
                elif ex.steps_applied != request.to_applied_steps:
                    raise ValueError(f"cannot roll back from {ex.steps_applied} to {request.to_applied_steps} "
                                     "applied steps (one step of history is kept)")
                self.next_step = ex.steps_applied
                return self._status()
        return self._guard(context, rollback)

    def GetState(self, request, context):
        """Streams this replica's state to a peer (checksummed chunks)."""
        try:
            self.check_fence(request.fence)
            self._need_state()
            with self._cond:
                if self.executor.steps_applied != request.applied_steps or self._running:
                    raise StaleEpochError(f"state is at {self.executor.steps_applied} applied steps, "
                                          f"asked for {request.applied_steps}")
                leaves = self.executor.host_state()
                applied = self.executor.steps_applied
        except Exception as e:  # noqa: BLE001
            rpc.abort_with(context, e)
        yield from _mid_stream(state_chunks(leaves, applied, self.chunk_bytes), self.faults.sending_state)

    def PullState(self, request, context):
        def pull():
            self.check_fence(request.fence)
            self._need_executor()
            t0 = time.perf_counter()
            stream = self._stub(request.source_address).GetState(
                pb.GetStateRequest(fence=request.fence, applied_steps=request.applied_steps),
                timeout=self.step_timeout)
            try:
                leaves, applied = assemble_state(_mid_stream(stream, self.faults.receiving_state))
            except grpc.RpcError as e:
                raise StepAbortedError(-1, f"state transfer from {request.source_address} failed: "
                                           f"{e.code().name}") from e
            with self._cond:
                if self._running:
                    raise StaleEpochError("a step is running; cannot replace the state")
                self.executor.set_state(leaves, applied)
                self.next_step = applied
                self._recent.clear()
                digest = self.executor.state_sha256()
            return pb.PullStateReply(sha256=digest, bytes=sum(x.nbytes for x in leaves),
                                     seconds=time.perf_counter() - t0)
        return self._guard(context, pull)

    def Push(self, request_iterator, context):
        def push():
            self.mailbox.receive(request_iterator, self.check_fence)
            return pb.Empty()
        return self._guard(context, push)

    def Step(self, request, context):
        return self._guard(context, lambda: self._step(request))

    # -- helpers -------------------------------------------------------------

    def _need_executor(self):
        if self.executor is None:
            raise StaleEpochError("no programs loaded on this worker yet")

    def _need_state(self):
        self._need_executor()
        if self.executor.state is None:
            raise StaleEpochError("this worker holds no state yet")

    def _status(self) -> pb.StatusReply:
        ex = self.executor
        has = ex is not None and ex.state is not None
        return pb.StatusReply(applied_steps=ex.steps_applied if has else -1,
                              sha256=ex.state_sha256() if has else "",
                              recent=[pb.StepLoss(step=k, loss_sum=v) for k, v in sorted(self._recent.items())])

    def _stub(self, address: str) -> pb_grpc.WorkerStub:
        with self._cond:
            entry = self._peers.get(address)
            if entry is None:
                ch = rpc.channel(address, self.secret, self.tls)
                entry = self._peers[address] = (ch, pb_grpc.WorkerStub(ch))
            return entry[1]

    # -- the step ------------------------------------------------------------

    def _step(self, req: pb.StepRequest) -> pb.StepReply:
        self.check_fence(req.fence)
        self._need_state()
        deadline = time.monotonic() + self.step_timeout
        epoch = req.fence.epoch
        with self._cond:
            while self.next_step != req.step or self._running:
                if self.epoch != epoch:
                    raise StaleEpochError(f"step {req.step} of epoch {epoch} superseded by epoch {self.epoch}")
                if self.next_step > req.step:
                    raise StaleEpochError(f"step {req.step} already applied (worker at {self.next_step})")
                if not self._cond.wait(max(deadline - time.monotonic(), 0)) and time.monotonic() >= deadline:
                    raise StepAbortedError(req.step, f"still waiting for step {self.next_step}")
            self._running = True
        try:
            return self._run_step(req, epoch, deadline)
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()

    def _phase(self, step: int, phase: str) -> None:
        self.progress = (step, phase, time.monotonic())   # one tuple: read without a lock

    def _run_step(self, req: pb.StepRequest, epoch: int, deadline: float) -> pb.StepReply:
        try:
            return self._run_phases(req, epoch, deadline)
        finally:
            self._phase(req.step, "idle")

    def _run_phases(self, req: pb.StepRequest, epoch: int, deadline: float) -> pb.StepReply:
        ex = self.executor
        t0 = time.perf_counter()
        self._phase(req.step, "grad")
        mine = ex.partials(req.step, [_node(n) for n in req.nodes])
        self.faults.straggle(time.perf_counter() - t0)
        self.faults.in_phase("grad")
        # The loss rides along as one more element, reduced in the same tree order.
        vecs = {n: np.append(g, np.float32(loss)) for n, (loss, g) in mine.items()}
        t1 = time.perf_counter()
        self._phase(req.step, "reduce")
        total, sent = self._all_reduce(req, vecs, epoch, deadline)
        t2 = time.perf_counter()
        self._phase(req.step, "apply")
        with self._cond:
            if self.epoch != epoch:
                raise StepAbortedError(req.step, f"aborted by epoch {self.epoch} before apply")
            ex.apply(total[:-1])
            self.faults.in_phase("apply")
            self.next_step = req.step + 1
            self._recent[req.step] = float(total[-1])
            for old in [k for k in self._recent if k < req.step - 4]:
                del self._recent[old]
        t3 = time.perf_counter()
        return pb.StepReply(step=req.step, loss_sum=float(total[-1]), grad_seconds=t1 - t0, reduce_seconds=t2 - t1,
                            apply_seconds=t3 - t2, bytes_sent=sent)

    def _send(self, address: str, messages, deadline: float) -> None:
        if self.faults.partitioned():
            raise StepAbortedError(-1, f"push to {address} failed: partitioned (chaos)")
        if self.faults.take_corruption():
            messages = _corrupt_first(messages)
        with self._cond:
            stub = self._stub(address)
            self._outgoing[address] = self._outgoing.get(address, 0) + 1
        try:
            stub.Push(messages, timeout=max(deadline - time.monotonic(), 0.001))
        except grpc.RpcError as e:
            raise StepAbortedError(-1, f"push to {address} failed: {e.code().name}: {e.details()}") from e
        except ValueError as e:   # the channel was closed by an abort
            raise StepAbortedError(-1, f"push to {address} cancelled: the step was aborted ({e})") from None
        finally:
            with self._cond:
                self._outgoing[address] -= 1

    def _all_reduce(self, req: pb.StepRequest, partials: dict[Node, np.ndarray], epoch: int, deadline: float):
        """Reduce-scatter + all-gather; returns (canonical sum, bytes sent)."""
        n = len(req.peers)
        size = self.executor.programs.grad_size + 1
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
        got = self.mailbox.wait(epoch, req.step, REDUCE_SCATTER, {p.rank for p in others}, deadline)
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
        self.faults.in_phase("reduce")
        sends = []
        for p in others:
            sent += 4 * reduced.size
            sends.append(self._send_pool.submit(self._send, p.address,
                                                stream(ALL_GATHER, p.rank, [(top, reduced)]), deadline))
        gathered = self.mailbox.wait(epoch, req.step, ALL_GATHER, {p.rank for p in others}, deadline)
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


def _mid_stream(chunks, hook):
    """Passes ``chunks`` through, calling ``hook()`` after the first (chaos: a fault mid-transfer)."""
    for i, chunk in enumerate(chunks):
        if i == 1:
            hook()
        yield chunk


def _corrupt_first(messages):
    """Chaos: flips one byte of the first message after its checksum was computed."""
    for i, m in enumerate(messages):
        if i == 0 and m.data:
            m.data = bytes([m.data[0] ^ 0xFF]) + m.data[1:]
        yield m


def probe_devices() -> int:
    """Runs a tiny program on every local device; returns how many gave the right answer.

    Raises ``RuntimeError`` naming the first device that computed a wrong
    result, so a worker with a bad device never joins the run.
    """
    n = 0
    for d in jax.devices():
        x = jax.device_put(np.arange(16, dtype=np.float32), d)
        got = float(jax.jit(lambda v: (v * 2.0).sum())(x))
        if got != 240.0:
            raise RuntimeError(f"device probe failed on {d}: computed {got}, expected 240.0")
        n += 1
    return n


def serve(controller: str, run_id: str, worker_id: str, host: str = "127.0.0.1", port: int = 0,
          register_timeout: float = 60.0, parent_pid: int | None = None, secret: str = "",
          chaos: bool = False, tls=None) -> int:
    """Runs a worker until told to shut down, its parent dies, or it fences itself.

    Returns the process exit status: 0 after a shutdown, 3 after fencing
    itself (it lost the controller's lease and was refused when it asked to
    come back: the run has moved on without it).
    """
    service = WorkerService(run_id, worker_id, secret, chaos=chaos, tls=tls)
    server, bound = rpc.make_server(host, port, secret=secret, tls=tls,
                                    interceptors=[PartitionInterceptor(service.faults, service.heard)])
    pb_grpc.add_WorkerServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    server.start()
    address = f"{host}:{bound}"
    stub = pb_grpc.ControllerStub(rpc.channel(controller, secret, tls))
    devices = jax.devices()

    def register(rejoin: bool) -> pb.RegisterReply:
        return stub.Register(pb.RegisterRequest(run_id=run_id, worker_id=worker_id, address=address,
                                                num_devices=len(devices), platform=devices[0].platform,
                                                pid=os.getpid(), rejoin=rejoin),
                             timeout=register_timeout, wait_for_ready=True)

    reply = register(False)
    if not reply.accepted:
        server.stop(0)
        raise SystemExit(f"controller refused worker {worker_id}: {reply.reason}")
    log.info("worker %s serving on %s with %d %s devices", worker_id, address, len(devices), devices[0].platform)
    status = 0
    while not service.stopped.wait(0.2):
        if parent_pid is not None and os.getppid() != parent_pid:
            log.warning("parent process %d is gone; exiting", parent_pid)
            break
        if service.lease_lapsed():
            health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            status = 3
            reply = _rejoin(service, register, register_timeout)
            log.warning("asked to rejoin after fencing: %s", reply)
            if reply is None or not reply.accepted:
                break
    server.stop(grace=1.0)
    return status


def _rejoin(service: WorkerService, register, timeout: float):
    """A fenced worker asks the controller to take it back (it will be refused while the run lives)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not service.faults.partitioned():
            try:
                return register(True)
            except grpc.RpcError as e:
                log.warning("rejoin failed: %s", e.code().name)
        time.sleep(0.5)
    return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="elastic worker", description="Run a jax-elastic worker.")
    ap.add_argument("--controller", required=True, help="HOST:PORT of the controller")
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--worker-id", default=f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--exit-with-parent", action="store_true", help="exit when the launching process dies")
    ap.add_argument("--chaos", action="store_true", default=os.environ.get("ELASTIC_CHAOS") == "1",
                    help="serve fault-injection calls from the chaos harness (default: $ELASTIC_CHAOS=1)")
    for name, env in (("cert", "ELASTIC_TLS_CERT"), ("key", "ELASTIC_TLS_KEY"), ("ca", "ELASTIC_TLS_CA")):
        ap.add_argument(f"--tls-{name}", default=os.environ.get(env, ""),
                        help=f"PEM {name} file for mutual TLS (default: ${env})")
    ap.add_argument("--secret", default=None,
                    help="the run secret (default: $ELASTIC_RUN_SECRET; an argument is visible in ps)")
    args = ap.parse_args(argv)
    secret = args.secret if args.secret is not None else os.environ.get("ELASTIC_RUN_SECRET", "")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.worker_id} %(levelname)s %(message)s",
                        stream=sys.stderr)
    status = serve(args.controller, args.run_id, args.worker_id, args.host, args.port,
                   parent_pid=os.getppid() if args.exit_with_parent else None, secret=secret, chaos=args.chaos,
                   tls=auth.TlsFiles(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert else None)
    sys.exit(status)


if __name__ == "__main__":
    main()
