"""The worker's gRPC service: one per process, owning its JAX devices.

Started by :mod:`runtime.worker_process` (the process entry point), which
registers it with the controller. It receives programs and a data source,
initializes its replica of the state, and runs steps: local gradients over
its subtrees of microbatches, the peer-to-peer reduction
(:class:`runtime.collective.AllReduce` over ``Push`` streams), then the
optimizer update.

Contract: steps run strictly in order; a ``Step`` request for step ``s+1``
that arrives early waits (bounded) for step ``s`` to finish, so the controller
may dispatch ahead. Messages of another run are refused (fencing).

Set ``XLA_FLAGS`` (device count) before this module is imported.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time

import grpc
import jax
import numpy as np

from runtime import rpc
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.collective import (DEFAULT_CHUNK_BYTES, AllReduce, Mailbox, assemble_state, checked_chunk_bytes,
                                state_chunks)
from runtime.errors import StaleEpochError, StepAbortedError
from runtime.executor import SliceExecutor, add_f32
from runtime.fault_injection import WorkerFaults
from runtime.microbatch import Node, root
from runtime.programs import ProgramSet

__all__ = ["WorkerService", "probe_devices"]

log = logging.getLogger("jax_elastic.worker")


def _node(n: pb.Node) -> Node:
    return Node(n.level, n.index)


class _PeerChannels:
    """Channels to peer workers, one per address, opened on first use. Thread-safe.

    Counts the pushes in flight per address, so that an abort closes exactly
    the channels a step may be blocked on: closing a channel cancels its calls
    at once (a blocking push to a hung peer would otherwise wait until the
    step deadline); the next call to that address opens a new channel.
    """

    def __init__(self, secret: str, tls):
        self._secret = secret
        self._tls = tls
        self._lock = threading.Lock()
        self._open: dict[str, tuple[grpc.Channel, pb_grpc.WorkerStub]] = {}
        self._pushing: dict[str, int] = {}   # address -> pushes in flight to it

    def stub(self, address: str) -> pb_grpc.WorkerStub:
        with self._lock:
            return self._stub(address)

    @contextlib.contextmanager
    def pushing(self, address: str):
        """The stub for ``address``, with a push to it counted in flight while the block runs."""
        with self._lock:
            stub = self._stub(address)
            self._pushing[address] = self._pushing.get(address, 0) + 1
        try:
            yield stub
        finally:
            with self._lock:
                self._pushing[address] -= 1

    def _stub(self, address: str) -> pb_grpc.WorkerStub:
        entry = self._open.get(address)
        if entry is None:
            ch = rpc.channel(address, self._secret, self._tls)
            entry = self._open[address] = (ch, pb_grpc.WorkerStub(ch))
        return entry[1]

    def close_pushing(self) -> None:
        """Closes the channels with pushes in flight; those pushes raise ``ValueError`` or CANCELLED."""
        with self._lock:
            for address in [a for a, n in self._pushing.items() if n]:
                entry = self._open.pop(address, None)
                if entry is not None:
                    entry[0].close()


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
        self.chunk_bytes = DEFAULT_CHUNK_BYTES  # set by Load
        self.next_step = 0
        self._running = False
        self._recent: dict[int, float] = {}   # step -> loss sum, last few applied
        self._cond = threading.Condition()
        self._peers = _PeerChannels(secret, tls)
        self.collective = AllReduce(self._push, self.mailbox, add_f32)
        self.stopped = threading.Event()
        self.faults = WorkerFaults(chaos)
        self.tls = tls
        self.lease = 0.0                      # seconds without the controller before fencing; 0: off
        self.last_contact = time.monotonic()
        self.fenced = ""                      # why this worker fenced itself ("" while a member)
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
                          "Chaos", "Progress", "/grpc.health.v1.Health/Check")

    def heard(self, method: str) -> None:
        """Any call from the controller (not from a peer) renews the lease."""
        if method.endswith(self.CONTROLLER_METHODS):
            self.last_contact = time.monotonic()

    def lease_lapsed(self) -> bool:
        """Fences this worker when the controller has been silent longer than the lease.

        Called periodically by :func:`runtime.worker_process.serve`. A fenced
        worker refuses all work and wakes a step waiting on peers; it never
        serves this run again.
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
        # Pushes are blocking calls, not futures (futures cost ~5 ms a step):
        # to stop one, close its channel.
        self._peers.close_pushing()
        self._cond.notify_all()

    # -- control RPCs --------------------------------------------------------

    def Load(self, request, context):
        """Controller: programs, data source, lease and chunk size for this run; probes the devices.

        Refuses (INVALID_ARGUMENT) a ``chunk_bytes`` out of range before any
        work; a failed compile or probe leaves the previous load in place.
        """
        def load():
            self.check_fence(request.fence)
            chunk_bytes = checked_chunk_bytes(request.chunk_bytes)
            programs = ProgramSet.from_parts({p.name: p.serialized for p in request.programs}, request.layout)
            source = pickle.loads(request.data_source)
            executor = SliceExecutor(programs, source)
            t0 = time.perf_counter()
            probed = probe_devices()
            probe_seconds = time.perf_counter() - t0
            compile_seconds = executor.load()
            self.executor = executor
            self.chunk_bytes = chunk_bytes
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
            stream = self._peers.stub(request.source_address).GetState(
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
        total, sent = self.collective.run(
            vecs, fence=req.fence, step=req.step, rank=req.rank, peers={p.rank: p.address for p in req.peers},
            owners={_node(nd): o for nd, o in zip(req.all_nodes, req.node_owner)},
            top=root(ex.programs.num_microbatches), chunk_bytes=self.chunk_bytes, deadline=deadline,
            between_phases=lambda: self.faults.in_phase("reduce"))
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

    def _push(self, address: str, messages, deadline: float) -> None:
        """The collective's transport: one blocking ``Push`` stream to a peer (with the chaos faults)."""
        if self.faults.partitioned():
            raise StepAbortedError(-1, f"push to {address} failed: partitioned (chaos)")
        if self.faults.take_corruption():
            messages = _corrupt_first(messages)
        with self._peers.pushing(address) as stub:
            try:
                stub.Push(messages, timeout=max(deadline - time.monotonic(), 0.001))
            except grpc.RpcError as e:
                raise StepAbortedError(-1, f"push to {address} failed: {e.code().name}: {e.details()}") from e
            except ValueError as e:   # the channel was closed by an abort
                raise StepAbortedError(-1, f"push to {address} cancelled: the step was aborted ({e})") from None


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
