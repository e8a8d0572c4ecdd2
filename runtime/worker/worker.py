"""The worker's gRPC service: one per process, owning its JAX devices.

Started by :mod:`runtime.worker.worker_process` (the process entry point), which
registers it with the controller. It receives programs and a data source,
initializes its replica of the state, and runs steps: local gradients over
its subtrees of microbatches, the peer-to-peer reduction
(:class:`runtime.worker.collective.AllReduce` over the data plane,
:mod:`runtime.wire.dataplane`, or ``Push`` streams to a peer without one), then the
optimizer update. This module holds the service's state, its lock and its
gRPC methods; three modules hold the rest:

- :mod:`runtime.worker.worker_fence` (:class:`~runtime.worker.worker_fence.Fencing`, a base
  class): other runs and older epochs refused, a newer epoch adopted, the
  lease on the controller;
- :mod:`runtime.worker.worker_step` (:class:`~runtime.worker.worker_step.Stepping`, a base
  class): the step, run strictly in order, and the pushes of its pieces;
- :mod:`runtime.worker.worker_state`: the operations that move a whole state (a copy
  from a peer, a checkpoint or snapshot restored, a snapshot kept or saved).

Every request is checked before it touches the state: a malformed one (a
layout that does not parse, a step plan that does not cover the microbatches,
a piece larger than a gradient, a state of another layout or hash) is refused
with :class:`ProtocolError` (INVALID_ARGUMENT), a well-formed one that does not
apply now (another run, an older epoch, a step already applied, no state yet)
with :class:`StaleEpochError` (FAILED_PRECONDITION). Either way the state and
the applied step are unchanged.

Set ``XLA_FLAGS`` (device count) before this module is imported.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np

from runtime.wire import auth, rpc
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.worker.collective import AllReduce
from runtime.wire.parts import DEFAULT_CHUNK_BYTES, Part, checked_chunk_bytes, inline
from runtime.wire.dataplane_client import DataClient
from runtime.core.errors import ProtocolError, StaleEpochError, StepAbortedError
from runtime.worker.executor import SliceExecutor, add_f32, probe_devices
from runtime.core.stage_programs import StagePrograms
from runtime.worker.stage_executor import StageExecutor
from runtime.worker.stage_step import packed_size
from runtime.worker.fault_injection import WorkerFaults, mid_stream
from runtime.worker.mailbox import Mailbox
from runtime.core.microbatch import root
from runtime.core.owner import Owner
from runtime.wire.peers import PeerChannels
from runtime.core.fingerprint import legacy_programs_fingerprint, programs_fingerprint
from runtime.wire.requests import decode_programs, unpickle_source
from runtime.worker.saver import CheckpointWriter
from runtime.state.snapshot import SnapshotStore, host_directory
from runtime.state.state_copy import shared_state, state_chunks
from runtime.worker.worker_fence import Fencing
from runtime.worker.worker_state import (Landing, flush_checkpoints, keep_snapshot, load_checkpoint, load_parameters,
                                         pull_state, save_step, strike_save_in_progress, while_saving)
from runtime.worker.step_stream import serve_step_connection, serve_steps
from runtime.worker.worker_step import Stepping

__all__ = ["WorkerService", "probe_devices"]

log = logging.getLogger("jax_elastic.worker")

_INT32 = (-(1 << 31), (1 << 31) - 1)


class WorkerService(Fencing, Stepping, pb_grpc.WorkerServicer):
    """gRPC face of one worker. Each handler maps failures to status codes.

    Concurrency: one step runs at a time (``_running``); ``Abort`` may arrive
    at any moment from another thread, adopts the new epoch, wakes the step if
    it waits on peers, and returns once no step runs. A step of an older
    epoch never applies after an abort was received.
    """

    def __init__(self, run_id: str, worker_id: str, secret: str = "", step_timeout: float = 300.0,
                 chaos: bool = False, tls=None, host: str = "", stage_delay: float = 0.0):
        self.run_id = run_id
        self.stage_delay = stage_delay   # benchmarks only: seconds slept per forward and per backward of a stage
        self.host = host or socket.gethostname()   # where this worker's in-memory snapshots live
        self.worker_id = worker_id
        self.secret = secret
        self.epoch = 0
        self.step_timeout = step_timeout
        self.executor: SliceExecutor | None = None
        self.mailbox = Mailbox()
        self.chunk_bytes = DEFAULT_CHUNK_BYTES  # set by Load
        self._running = False
        self._recent: dict[int, float] = {}   # step -> loss sum, last few applied
        self._cond = threading.Condition()
        self._peers = PeerChannels(secret, tls)
        self.data = DataClient(secret, tls)   # to peers' data planes (runtime.wire.dataplane_client)
        self.collective = AllReduce(self._push, self.mailbox, add_f32)
        self.stopped = threading.Event()
        self.faults = WorkerFaults(chaos)
        self.tls = tls
        self.lease = 0.0                      # seconds without the controller before fencing; 0: off
        self.last_contact = time.monotonic()
        self.fenced = ""                      # why this worker fenced itself ("" while a member)
        self.generation = 0                   # the client generation served (a restarted client attaches a newer)
        self.client_grace = 0.0               # seconds it waits for a new client once its client is gone
        self.client_lost_at: float | None = None
        self.owner = None                     # the client process watched (runtime.core.owner.Owner), if any
        self.controller = ""                  # host:port the worker registers with (a new client may move it)
        self.identity = pb.AttachReply()      # who this worker is, as an Attach answers it (set by serve)
        self.serving = lambda ok: None        # the health service's status (set by serve)
        self.progress = (-1, "idle", time.monotonic())
        self.refusals = auth.Refusals(log)    # calls refused for their secret, until the controller asks
        self._state_layout: list | None = None   # [(shape, dtype)] of the state leaves, from the programs
        self._landing: Landing | None = None     # a spare's memory for the state it will be copied
        self.fingerprint = ""                 # sha256 of the loaded programs: which math a checkpoint holds
        self._blobs: dict[str, bytes] = {}    # the loaded programs, for the fingerprint older checkpoints hold
        self._writer: CheckpointWriter | None = None   # checkpoints and snapshots (runtime.worker.saver), on first use
        self.snapshots: SnapshotStore | None = None   # this host's snapshots of the run (runtime.state.snapshot)
        self.snapshot_home = ""               # this host's directory of them (a pipelined run: one per stage in it)


    @property
    def next_step(self) -> int:
        """The step this worker runs next: its executor's applied steps (one count of them, kept there)."""
        return self.executor.steps_applied if self.executor is not None else 0
    def _guard(self, context, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every failure goes back to the caller as a status
            log.warning("%s failed: %s: %s", getattr(fn, "__name__", "request"), type(e).__name__, e)
            rpc.abort_with(context, e)

    # -- control RPCs --------------------------------------------------------

    def Load(self, request, context):
        """Controller: programs, data source, lease and chunk size for this run; probes the devices.

        Refuses (INVALID_ARGUMENT) a ``chunk_bytes`` out of range, a lease
        that is not a finite number of seconds >= 0, programs that do not
        match their ``sha256`` or do not parse, a layout that does not fit
        them or this host, and a data source that does not unpickle, before
        any compile; a failed compile or probe leaves the previous load in
        place.
        """
        def load():
            self.check_fence(request.fence)
            chunk_bytes = checked_chunk_bytes(request.chunk_bytes)
            for name in ("lease_seconds", "client_grace_seconds"):
                value = getattr(request, name)
                if not (math.isfinite(value) and value >= 0):
                    raise ProtocolError(f"{name}={value} is not a number of seconds >= 0")
            programs, state_layout = decode_programs(request)
            source = unpickle_source(request.data_source)
            if request.snapshot_directory and not os.path.isabs(request.snapshot_directory):
                raise ProtocolError(f"snapshot_directory {request.snapshot_directory!r} is not an absolute path")
            home = host_directory(request.snapshot_directory, self.host) if request.snapshot_directory else ""
            stage = f"stage{programs.stage}" if isinstance(programs, StagePrograms) else ""
            snapshots = SnapshotStore(os.path.join(home, stage) if stage else home) if home else None
            log.info("loading %d programs (%d bytes) for %d devices", len(request.programs),
                     sum(len(p.serialized) for p in request.programs), programs.devices_per_slice)
            executor = (StageExecutor if isinstance(programs, StagePrograms) else SliceExecutor)(programs, source)
            if request.checkpointing:   # beside the compile: the first save would pay orbax's start-up (~2 s)
                self._checkpoints().warm()
            t0 = time.perf_counter()
            probed = probe_devices()
            probe_seconds = time.perf_counter() - t0
            compile_seconds = executor.load()
            with self._cond:
                if self._running:
                    raise StaleEpochError("a step is running; cannot load new programs now")
                self.executor = executor
                self._state_layout = state_layout
                self._blobs = {p.name: p.serialized for p in request.programs}
                self.fingerprint = programs_fingerprint(self._blobs)
                self.chunk_bytes = chunk_bytes
                self.snapshots, self.snapshot_home = snapshots, home
                m, p = programs.num_microbatches, programs.grad_size + 1   # the loss rides along
                if isinstance(programs, StagePrograms):   # activations travel as pieces too
                    p = max(p, packed_size(programs.activation_in), packed_size(programs.activation_out))
                self.mailbox.limit(max_piece=p, top=root(m), max_buffered=4 * (m + 1) * p)
                self._drop_landing()   # one of earlier programs
                self._landing = Landing(state_layout) if request.spare else None
            self.lease = request.lease_seconds
            self.client_grace = request.client_grace_seconds
            self.last_contact = time.monotonic()
            return pb.LoadReply(compile_seconds=compile_seconds, devices_probed=probed, probe_seconds=probe_seconds)
        return self._guard(context, load)

    def Refusals(self, request, context):
        """Controller (its health monitor): calls refused for their secret since the last report, then resets.

        Counts per (method, peer host, reason); a report lost on the way is
        not sent again (at most once). Not fenced: only a caller with the run
        secret gets here, and a fenced worker's refusals are worth reading too.
        """
        def report():
            return pb.RefusalsReply(refusals=[pb.Refusal(method=m, peer=p, reason=r, count=n)
                                              for m, p, r, n in self.refusals.drain()])
        return self._guard(context, report)

    def Progress(self, request, context):
        def progress():
            self.check_fence(request.fence)
            step, phase, since = self.progress
            return pb.ProgressReply(step=step, phase=phase, seconds=time.monotonic() - since)
        return self._guard(context, progress)

    def Chaos(self, request, context):
        def arm():
            try:
                self.faults.arm(request.action, request.factor, request.seconds, request.phase, request.after_step)
            except PermissionError as e:
                raise StaleEpochError(str(e)) from None
            if request.action == "kill_in_phase" and request.phase == "save":   # the save being written counts
                strike = threading.Thread(target=strike_save_in_progress, args=(self.faults, self._writer),
                                          name="chaos-kill-save", daemon=True)
                if not context.add_callback(strike.start):   # once this call is answered: the arming succeeded
                    strike.start()
            log.warning("chaos: armed %s (factor %s, %s s)", request.action, request.factor, request.seconds)
            return pb.Empty()
        return self._guard(context, arm)

    def Init(self, request, context):
        def init():
            self.check_fence(request.fence)
            self._need_executor()
            if not _INT32[0] <= request.seed <= _INT32[1]:
                raise ProtocolError(f"seed {request.seed} is not an int32")
            with self._cond:
                if self._running:
                    raise StaleEpochError("a step is running; abort it before initializing")
                nbytes = self.executor.init(request.seed)
                self._recent.clear()
                self._drop_landing()
            return pb.InitReply(state_bytes=nbytes)
        return self._guard(context, init)

    def StateHash(self, request, context):
        def digest():
            self.check_fence(request.fence)
            self._need_state()
            with self._cond:
                return pb.HashReply(digest=self.executor.state_digest(), step=self.executor.steps_applied)
        return self._guard(context, digest)

    def Shutdown(self, request, context):
        def stop():
            self.check_fence(request.fence)
            if request.run_ended and self.snapshots is not None:   # the RAM they hold serves nobody now
                self.snapshots.remove_all()
                if self.snapshot_home and self.snapshot_home != self.snapshots.directory:   # a pipeline's: all stages
                    SnapshotStore(self.snapshot_home).remove_all()
            self.stopped.set()
            return pb.Empty()
        return self._guard(context, stop)

    def Attach(self, request, context):
        """A restarted client of this run takes this worker over (a newer generation; see
        :meth:`~runtime.worker.worker_fence.Fencing.attach`) and learns what it holds.

        Refused, with nothing changed, when this worker loaded other programs
        than the client's (INVALID_ARGUMENT: the model changed) or the
        generation is not newer (a stale client: PERMISSION_DENIED)."""
        def attach():
            for name in ("lease_seconds", "client_grace_seconds"):
                value = getattr(request, name)
                if not (math.isfinite(value) and value >= 0):
                    raise ProtocolError(f"{name}={value} is not a number of seconds >= 0")
            brought = [request.fingerprint] if request.fingerprint else list(request.stage_fingerprints)
            if brought and self.fingerprint and self.fingerprint not in brought:   # (a pipeline: one per stage)
                raise ProtocolError(f"worker {self.worker_id} runs other programs (fingerprint "
                                    f"{self.fingerprint[:12]}), the client brings {', '.join(f[:12] for f in brought)}")
            previous = self.generation
            self.attach(request.fence)
            self.lease, self.client_grace = request.lease_seconds, request.client_grace_seconds
            if request.controller:
                self.controller = request.controller
            if request.owner_pid > 1:
                self.owner = Owner(request.owner_pid)
            log.warning("client generation %d of run %s attached this worker (was %d)", self.generation,
                        self.run_id, previous)
            with self._cond:
                status = self._status()
            reply = pb.AttachReply()
            reply.CopyFrom(self.identity)
            reply.applied_steps, reply.digest = status.applied_steps, status.digest
            reply.recent.extend(status.recent)
            reply.snapshots.extend(status.snapshots)
            reply.fingerprint, reply.previous_generation = self.fingerprint, previous
            return reply
        return self._guard(context, attach)

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
                    if ex.prev_state is None:
                        raise ProtocolError(f"cannot roll back from {ex.steps_applied} applied steps: no step of "
                                            "history (the state was just initialized or copied)")
                    ex.rollback()
                    self._recent.pop(ex.steps_applied, None)
                elif ex.steps_applied != request.to_applied_steps:
                    raise ProtocolError(f"cannot roll back from {ex.steps_applied} to {request.to_applied_steps} "
                                        "applied steps (one step of history is kept)")
                return self._status()
        return self._guard(context, rollback)

    def GetState(self, request, context):
        """Peer (over gRPC): streams this replica's state (checksummed chunks, each naming the state's digest)."""
        try:
            parts = self.state_parts(request)
        except Exception as e:  # noqa: BLE001
            rpc.abort_with(context, e)
        yield from inline(parts)

    def state_parts(self, request: pb.GetStateRequest) -> Iterator[Part]:
        """The parts of this replica's state at ``request.applied_steps`` (for ``GetState`` and the data plane).

        Raises, before anything is sent, when the request is fenced off or
        the state is not at that step.
        """
        leaves, applied, digest = self._state_at(request)
        return mid_stream(state_chunks(leaves, applied, self.chunk_bytes, digest), self.faults.sending_state)

    def shared_state(self, request: pb.GetStateRequest) -> Iterator[pb.SharedState]:
        """The data plane's same-host read of this replica's state (``DataServer``'s ``on_shared_state``): yields
        where its host leaves lie, then (the reader copying them) the chaos point midway; they stay alive until
        the data server closes this generator. Raises, before yielding, as :meth:`state_parts`."""
        leaves, applied, digest = self._state_at(request)
        leaves = [np.require(x, requirements='C') for x in leaves]   # (ascontiguousarray makes a scalar 1-d)
        yield shared_state(leaves, applied, digest)
        self.faults.sending_state()

    def _state_at(self, request: pb.GetStateRequest) -> tuple[list, int, str]:
        """``(host leaves, applied steps, digest)`` of this replica's state, if at the step ``request`` asks for."""
        self.check_fence(request.fence)
        self._need_state()
        with self._cond:
            if self.executor.steps_applied != request.applied_steps or self._running:
                raise StaleEpochError(f"state is at {self.executor.steps_applied} applied steps, "
                                      f"asked for {request.applied_steps}")
            leaves = self.executor.host_state()
            applied = self.executor.steps_applied
            digest = self.executor.state_digest()   # cached: the controller's Abort usually computed it
        return leaves, applied, digest

    def PullState(self, request, context):
        """Controller: replace this replica's state with a copy pulled from ``source_address``.

        The copy is adopted only if it has this worker's state layout, the
        step asked for, the digest its source announced and, when given,
        ``expected_digest``; otherwise (INVALID_ARGUMENT) the state is unchanged.
        """
        def pull():
            self.check_fence(request.fence)
            self._need_executor()
            return pull_state(request, self._state_layout, data=self.data, peers=self._peers, faults=self.faults,
                              timeout=self.step_timeout, adopt=self._adopt_state, landing_memory=self._landing)
        return self._guard(context, pull)

    def LoadCheckpoint(self, request, context):
        """Controller: replace this replica's state with a persistent checkpoint (every replica was lost).

        The newest complete checkpoint at or before the step asked for that
        hashes to the digest it recorded (older ones are tried when newer ones
        are corrupt; the reply says which were skipped) must hold this
        worker's state layout and come from the same programs; otherwise the
        state is unchanged and the error names the checkpoint.
        """
        def load():
            self.check_fence(request.fence)
            self._need_executor()
            if request.parameters_only:
                return load_parameters(request, self.executor, self._state_layout, self._adopt_state)
            return load_checkpoint(request, snapshots=self.snapshots, programs=self.executor.programs,
                                   fingerprints=(self.fingerprint, lambda: legacy_programs_fingerprint(self._blobs)),
                                   layout=self._state_layout, adopt=self._adopt_state,
                                   tree=self.executor.checkpoint_tree)
        return self._guard(context, load)

    def _adopt_state(self, leaves, applied: int, digest: str) -> None:
        """Replaces this replica's state (a copy from a peer or a checkpoint); refused while a step runs."""
        with self._cond:
            if self._running:
                raise StaleEpochError("a step is running; cannot replace the state")
            self.executor.set_state(leaves, applied, digest=digest)
            self._recent.clear()
            self._drop_landing()

    def _drop_landing(self) -> None:
        """This replica holds a state now: a spare's landing memory, unused, is freed."""
        if self._landing is not None:
            self._landing.drop()
            self._landing = None

    def Checkpoints(self, request, context):
        """Controller (at the end of a run): waits for the checkpoints in flight, then reports them. With
        ``save_directory`` it first saves the state as it is now there (the run's last checkpoint was cut off
        with its writer); refused while a step runs."""
        def flush():
            self.check_fence(request.fence)
            if request.save_directory:
                self._need_executor()
                with self._cond:
                    if self._running:
                        raise StaleEpochError("a step is running; cannot save the state now")
                    ex = self.executor
                    now = pb.StepRequest(step=ex.steps_applied - 1, checkpoint_directory=request.save_directory,
                                         committed_loss_sums=request.committed_loss_sums)
                    save_step(self._checkpoints(), now, ex, fingerprint=self.fingerprint, recent=self._recent,
                              snapshots=self.snapshots, peers=self._peers, timeout=self.step_timeout)
            return flush_checkpoints(self._writer, max(0.0, min(request.wait_seconds, self.step_timeout)))
        return self._guard(context, flush)

    def KeepSnapshot(self, request_iterator, context):
        """Peer: keep a copy of its snapshot on this host (complete, or nothing; see ``SnapshotStore.receive``)."""
        def keep():
            keep_snapshot(request_iterator, self.snapshots, self.check_fence, self.snapshot_home)
            return pb.Empty()
        return self._guard(context, keep)

    def Push(self, request_iterator, context):
        """Peer: the pieces one sender has for this worker in one phase of one step."""
        def push():
            self.receive_push(request_iterator)
            return pb.Empty()
        return self._guard(context, push)

    def receive_push(self, chunks) -> None:
        """One peer's push stream (``Push``, or the data plane's ``Incoming`` chunks) into the mailbox."""
        self._need_executor()
        self.mailbox.receive(chunks, self.check_fence, admit=self._admit_push)

    def Step(self, request, context):
        return self._guard(context, lambda: self._step(request, context))

    def Steps(self, request_iterator, context):
        """Controller: the same steps on one long-lived stream (:mod:`runtime.worker.step_stream`)."""
        return serve_steps(request_iterator, context, step=self._step, heard=lambda: self.heard("Steps"),
                           dropped=self.faults.partitioned)

    def serve_step_connection(self, sock, first) -> None:
        """Controller: the same stream on a data-plane connection (:func:`serve_step_connection`)."""
        serve_step_connection(sock, first, step=self._step, heard=lambda: self.heard("Steps"),
                              dropped=self.faults.partitioned)

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
                              digest=ex.state_digest() if has else "",
                              recent=[pb.StepLoss(step=k, loss_sum=v) for k, v in sorted(self._recent.items())],
                              snapshots=self.snapshots.steps() if self.snapshots is not None else [])

    def _checkpoints(self) -> CheckpointWriter:
        if self._writer is None:
            chaos = functools.partial(while_saving, self.faults) if self.faults.enabled else None
            self._writer = CheckpointWriter(while_saving=chaos)
        return self._writer
