"""The worker's gRPC service: one per process, owning its JAX devices.

Started by :mod:`runtime.worker.worker_process` (the process entry point), which
registers it with the controller. It receives programs and a data source,
initializes its replica of the state, and runs steps: local gradients over
its subtrees of microbatches, the peer-to-peer reduction
(:class:`runtime.worker.collective.AllReduce` over the data plane,
:mod:`runtime.wire.dataplane`, or ``Push`` streams to a peer without one), then the
optimizer update.

:class:`WorkerService` is a thin adapter: it implements the gRPC methods and
the data plane's entry points, and maps failures to status codes; the work is
done by objects that each own their state:

- :class:`~runtime.worker.replica.Replica` (:mod:`runtime.worker.replica`): the
  executor and its state, the epoch, whose turn it is, and the one lock over them;
- :class:`~runtime.worker.lease.Lease` (:mod:`runtime.worker.lease`): the fence
  (other runs, older epochs and client generations refused, a newer epoch
  adopted), the client it serves, the lease on the controller, the grace;
- :class:`~runtime.worker.step_runner.StepRunner` (:mod:`runtime.worker.step_runner`):
  the step, run strictly in order, and the pushes of its pieces;
- :class:`~runtime.worker.worker_state.StateMover` (:mod:`runtime.worker.worker_state`):
  the operations that move a whole state (a copy to or from a peer, a
  checkpoint or snapshot restored, a snapshot kept or saved, a rollback).

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

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator

from runtime.wire import auth, rpc
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.wire.parts import Part, checked_chunk_bytes, inline
from runtime.wire.dataplane_client import DataClient
from runtime.core.errors import ProtocolError, StaleEpochError, StepAbortedError
from runtime.worker.agreement import SliceAgreement
from runtime.worker.executor import SliceExecutor, probe_devices
from runtime.worker.stage_step import packed_size
from runtime.worker.fault_injection import WorkerFaults
from runtime.worker.lease import Lease
from runtime.worker.mailbox import Mailbox
from runtime.worker.replica import Replica
from runtime.core.microbatch import root
from runtime.core.stacks import thread_stacks
from runtime.core.owner import Owner
from runtime.wire.peers import PeerChannels
from runtime.wire.requests import checked_programs, decode_programs, unpickle_source
from runtime.state.snapshot import SnapshotStore, host_directory
from runtime.worker.step_runner import StepRunner
from runtime.worker.step_stream import serve_step_connection, serve_steps
from runtime.worker.worker_state import Landing, StateMover
from runtime.worker.fault_injection import mid_stream
from runtime.worker.sampler import Sampler, sampler_role
from runtime.worker.weights import WeightOutbox, cast_weights, pull_weights
from runtime.core.fingerprint import programs_fingerprint

__all__ = ["WorkerService", "probe_devices"]

log = logging.getLogger("jax_elastic.worker")

_INT32 = (-(1 << 31), (1 << 31) - 1)


class WorkerService(pb_grpc.WorkerServicer):
    """gRPC face of one worker: each handler delegates to the object that owns what it touches, and maps
    failures to status codes.

    Concurrency: one step runs at a time; ``Abort`` may arrive at any moment
    from another thread, adopts the new epoch, wakes the step if it waits on
    peers, and returns once no step runs. A step of an older epoch never
    applies after an abort was received (:class:`~runtime.worker.replica.Replica`).
    """

    def __init__(self, run_id: str, worker_id: str, secret: str = "", step_timeout: float = 300.0,
                 chaos: bool = False, tls=None, host: str = "", stage_delay: float = 0.0):
        self.worker_id = worker_id
        self.host = host or socket.gethostname()   # where this worker's in-memory snapshots live
        self.step_timeout = step_timeout
        self.faults = WorkerFaults(chaos)
        self.stopped = threading.Event()
        self.identity = pb.AttachReply()      # who this worker is, as an Attach answers it (set by serve)
        self.refusals = auth.Refusals(log)    # calls refused for their secret, until the controller asks
        self._mailbox = Mailbox()
        peers = PeerChannels(secret, tls)
        self._data = DataClient(secret, tls)   # to peers' data planes (runtime.wire.dataplane_client)
        self.replica = Replica(self._mailbox, peers, self._data)
        self.lease = Lease(run_id, worker_id, self.replica, step_timeout)
        agreement = SliceAgreement.of_this_process()   # a slice of several hosts' votes and checkpoint parts
        self.state_mover = StateMover(self.replica, self.lease, peers=peers, data=self._data, faults=self.faults,
                                      step_timeout=step_timeout, agreement=agreement)
        self.weights = WeightOutbox()   # an RL run's trainer: the policy's weights versions it published
        self.sampler: Sampler | None = None   # an RL run's sampler (loaded with role "sampler")
        self._peers = peers
        self.step_runner = StepRunner(self.replica, self.lease, self.state_mover, mailbox=self._mailbox, peers=peers,
                                      data=self._data, faults=self.faults, step_timeout=step_timeout,
                                      stage_delay=stage_delay, agreement=agreement, weights=self.weights)

    def close(self) -> None:
        """``serve``, once the servers stopped (and tests): ends the connections to peers' data planes and the
        all-reduce's push threads."""
        self._data.close()
        self.step_runner.collective.close()

    def _guard(self, context, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every failure goes back to the caller as a status
            rpc.log_failure(log, getattr(fn, "__name__", "request"), e)
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
            self.lease.check_fence(request.fence)
            chunk_bytes = checked_chunk_bytes(request.chunk_bytes)
            _check_seconds(request)
            role = sampler_role(request)
            if role:
                return self._load_sampler(request, role, chunk_bytes)
            programs, state_layout = decode_programs(request)
            source = unpickle_source(request.data_source)
            if request.snapshot_directory and not os.path.isabs(request.snapshot_directory):
                raise ProtocolError(f"snapshot_directory {request.snapshot_directory!r} is not an absolute path")
            home = host_directory(request.snapshot_directory, self.host) if request.snapshot_directory else ""
            stage = f"stage{programs.stage}" if programs.pipelined else ""
            snapshots = SnapshotStore(os.path.join(home, stage) if stage else home) if home else None
            log.info("loading %d programs (%d bytes) for %d devices", len(request.programs),
                     sum(len(p.serialized) for p in request.programs), programs.devices_per_slice)
            executor = SliceExecutor(programs, source)
            if request.checkpointing:   # beside the compile: the first save would pay orbax's start-up (~2 s)
                self.state_mover.writer().warm()
            t0 = time.perf_counter()
            probed = probe_devices()
            probe_seconds = time.perf_counter() - t0
            compile_seconds = executor.load()
            with self.replica.exclusive("a step is running; cannot load new programs now"):
                self.state_mover.loaded({p.name: p.serialized for p in request.programs}, snapshots, home)
                m, p = programs.num_microbatches, programs.grad_size + 1   # the loss rides along
                p = max(p, packed_size(programs.activation_in), packed_size(programs.activation_out))   # activations
                self._mailbox.limit(max_piece=p, top=root(m), max_buffered=4 * (m + 1) * p)
                self.replica.load(executor, executor.state_layout(state_layout), chunk_bytes, Landing if request.spare else None)
            self._take_lease(request)
            return pb.LoadReply(compile_seconds=compile_seconds, devices_probed=probed, probe_seconds=probe_seconds)
        return self._guard(context, load)

    def _take_lease(self, request) -> None:
        """A ``Load`` that succeeded: the lease it names, counted from now (the client grace came with the
        registration's answer: :meth:`~runtime.worker.lease.Lease.joined`)."""
        self.lease.seconds = request.lease_seconds
        self.lease.last_contact = time.monotonic()

    def _load_sampler(self, request, layout: dict, chunk_bytes: int) -> pb.LoadReply:
        """``Load`` of an RL run's sampler: its rollout program and prompt source (:mod:`runtime.worker.sampler`)."""
        blobs = checked_programs(request)
        sampler = Sampler(layout, blobs, unpickle_source(request.data_source))
        t0 = time.perf_counter()
        probed = probe_devices()
        probe_seconds = time.perf_counter() - t0
        compile_seconds = sampler.load()
        self.sampler, self._chunk_bytes = sampler, chunk_bytes
        self.state_mover.fingerprint = programs_fingerprint(blobs)
        self._take_lease(request)
        return pb.LoadReply(compile_seconds=compile_seconds, devices_probed=probed, probe_seconds=probe_seconds)

    # -- RL: weights versions and rollouts (runtime.worker.weights, runtime.worker.sampler) -------

    def PublishWeights(self, request, context):
        """Controller (a trainer of an RL run): keeps the state's parameter leaves as weights version ``applied
        steps`` (after a recovery, or at the start, when no step published the version the samplers need)."""
        def publish():
            self.lease.check_fence(request.fence)
            replica = self.replica
            replica.need_state()
            with replica.locked():
                version = replica.executor.steps_applied
                leaves = cast_weights(replica.executor.state, request.leaves, request.dtype)
            self.weights.put(version, leaves)
            return pb.PublishWeightsReply(version=version, digest=self.weights.get(version)[1],
                                          bytes=sum(x.nbytes for x in leaves), held=self.weights.versions())
        return self._guard(context, publish)

    def SyncWeights(self, request, context):
        """Controller (a sampler): installs weights version ``request.version``, pulled whole from the first of
        its sources that sends it (:func:`runtime.worker.weights.pull_weights`)."""
        def sync():
            self.lease.check_fence(request.fence)
            sampler = self._need_sampler()
            leaves, digest, reply = pull_weights(request, sampler.weights_layout, data=self._data, peers=self._peers,
                                                 timeout=self.step_timeout, midway=self.faults.receiving_state)
            sampler.install(request.version, leaves, digest)
            return reply
        return self._guard(context, sync)

    def Rollout(self, request, context):
        """Controller (a sampler): the rollouts of ``request.microbatches`` of its step with the weights version
        it names (refused unless installed)."""
        def rollout():
            self.lease.check_fence(request.fence)
            sampler = self._need_sampler()
            t0 = time.perf_counter()
            self.step_runner.progress = (request.step, "rollout", time.monotonic())
            try:
                batches = sampler.rollout(request.step, list(request.microbatches), request.version, request.seed)
                self.faults.in_phase("rollout")
            finally:
                self.step_runner.progress = (request.step, "idle", time.monotonic())
            return pb.RolloutReply(batches=batches, seconds=time.perf_counter() - t0)
        return self._guard(context, rollout)

    def _need_sampler(self) -> Sampler:
        if self.sampler is None:
            raise StaleEpochError(f"worker {self.worker_id} is not a sampler (no rollout program loaded)")
        return self.sampler

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
            self.lease.check_fence(request.fence)
            step, phase, since = self.step_runner.progress
            return pb.ProgressReply(step=step, phase=phase, seconds=time.monotonic() - since, rss_bytes=_rss_bytes())
        return self._guard(context, progress)

    def Stacks(self, request, context):
        """Controller (``elastic stacks``; the step watchdog before a stuck worker is replaced): every thread's
        Python stack now. Not fenced, like ``Refusals``: only a caller with the run secret gets here, and the
        stacks of a worker fenced out for a hang are the ones worth reading. Reads frames only: a worker busy in
        a step answers all the same (the gRPC thread pool serves it)."""
        def stacks():
            return pb.StacksReply(processes=[pb.ProcessStacks(name=self.worker_id, host=self.host, pid=os.getpid(),
                                                              text=thread_stacks())])
        return self._guard(context, stacks)

    def Chaos(self, request, context):
        def arm():
            try:
                self.faults.arm(request.action, request.factor, request.seconds, request.phase, request.after_step)
            except PermissionError as e:
                raise StaleEpochError(str(e)) from None
            if request.action == "kill_in_phase" and request.phase == "save":   # the save being written counts
                strike = threading.Thread(target=self.state_mover.save_striker(), name="chaos-kill-save",
                                          daemon=True)
                if not context.add_callback(strike.start):   # once this call is answered: the arming succeeded
                    strike.start()
            log.warning("chaos: armed %s (factor %s, %s s)", request.action, request.factor, request.seconds)
            return pb.Empty()
        return self._guard(context, arm)

    def Init(self, request, context):
        def init():
            self.lease.check_fence(request.fence)
            self.replica.need_executor()
            if not _INT32[0] <= request.seed <= _INT32[1]:
                raise ProtocolError(f"seed {request.seed} is not an int32")
            return pb.InitReply(state_bytes=self.replica.init(request.seed))
        return self._guard(context, init)

    def StateHash(self, request, context):
        def digest():
            self.lease.check_fence(request.fence)
            replica = self.replica
            replica.need_state()
            with replica.locked():
                return pb.HashReply(digest=replica.executor.state_digest(), step=replica.executor.steps_applied)
        return self._guard(context, digest)

    def Shutdown(self, request, context):
        def stop():
            self.lease.check_fence(request.fence)
            if request.run_ended:
                self.state_mover.remove_snapshots()
            self.stopped.set()
            return pb.Empty()
        return self._guard(context, stop)

    def Attach(self, request, context):
        """A restarted client of this run takes this worker over (a newer generation; see
        :meth:`~runtime.worker.lease.Lease.attach`) and learns what it holds.

        Refused, with nothing changed, when this worker loaded other programs
        than the client's (INVALID_ARGUMENT: the model changed) or the
        generation is not newer (a stale client: PERMISSION_DENIED)."""
        def attach():
            _check_seconds(request)
            fingerprint = self.state_mover.fingerprint
            brought = [request.fingerprint] if request.fingerprint else list(request.stage_fingerprints)
            if brought and fingerprint and fingerprint not in brought:   # (a pipeline: one per stage)
                raise ProtocolError(f"worker {self.worker_id} runs other programs (fingerprint "
                                    f"{fingerprint[:12]}), the client brings {', '.join(f[:12] for f in brought)}")
            lease = self.lease
            previous = lease.generation
            lease.attach(request.fence)
            lease.seconds, lease.client_grace = request.lease_seconds, request.client_grace_seconds
            if request.controller:
                lease.controller = request.controller
            if request.owner_pid > 1:
                lease.owner = Owner(request.owner_pid)
            log.warning("client generation %d of run %s attached this worker (was %d)", lease.generation,
                        lease.run_id, previous)
            status = self.state_mover.status()
            reply = pb.AttachReply()
            reply.CopyFrom(self.identity)
            reply.applied_steps, reply.digest = status.applied_steps, status.digest
            reply.recent.extend(status.recent)
            reply.snapshots.extend(status.snapshots)
            reply.fingerprint, reply.previous_generation = fingerprint, previous
            return reply
        return self._guard(context, attach)

    def Abort(self, request, context):
        def abort():
            self.lease.check_fence(request.fence)
            deadline = time.monotonic() + self.step_timeout
            replica = self.replica
            with replica.idle(deadline, lambda: StepAbortedError(replica.next_step, "the running step did not stop")):
                return self.state_mover.status()
        return self._guard(context, abort)

    # -- the state, moved whole (runtime.worker.worker_state.StateMover) ---------------

    def Rollback(self, request, context):
        def rollback():
            return self.state_mover.rollback(request)
        return self._guard(context, rollback)

    def GetState(self, request, context):
        """Peer (over gRPC): streams this replica's state (checksummed chunks, each naming the state's digest)."""
        try:
            parts = self.state_parts(request)
        except Exception as e:  # noqa: BLE001
            rpc.abort_with(context, e)
        yield from inline(parts)

    def state_parts(self, request: pb.GetStateRequest) -> Iterator[Part]:
        """The parts of this replica's state at ``request.applied_steps`` (for ``GetState`` and the data plane,
        ``DataServer``'s ``on_state``), or of the weights version it names (an RL run's trainer or sampler).
        Raises, before anything is sent, when the request is fenced off, or the state is not at that step, or
        the version is not held here."""
        if request.weights:
            self.lease.check_fence(request.fence)
            box = self.sampler.outbox if self.sampler is not None else self.weights
            chunk = self._chunk_bytes if self.sampler is not None else self.replica.chunk_bytes
            return mid_stream(box.parts(request.weights_version, chunk), lambda: self.faults.in_phase("weights"))
        return self.state_mover.parts(request)

    def shared_state(self, request: pb.GetStateRequest) -> Iterator[pb.SharedState]:
        """The data plane's same-host read of this replica's state (``DataServer``'s ``on_shared_state``; see
        :meth:`runtime.worker.worker_state.StateMover.shared`)."""
        return self.state_mover.shared(request)

    def PullState(self, request, context):
        """Controller: replace this replica's state with a copy pulled from ``source_address``.

        The copy is adopted only if it has this worker's state layout, the
        step asked for, the digest its source announced and, when given,
        ``expected_digest``; otherwise (INVALID_ARGUMENT) the state is unchanged.
        """
        def pull():
            return self.state_mover.pull(request)
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
            return self.state_mover.restore(request)
        return self._guard(context, load)

    def Checkpoints(self, request, context):
        """Controller (at the end of a run): waits for the checkpoints in flight, then reports them. With
        ``save_directory`` it first saves the state as it is now there (the run's last checkpoint was cut off
        with its writer); refused while a step runs."""
        def flush():
            return self.state_mover.checkpoints(request)
        return self._guard(context, flush)

    def KeepSnapshot(self, request_iterator, context):
        """Peer: keep a copy of its snapshot on this host (complete, or nothing; see ``SnapshotStore.receive``)."""
        def keep():
            self.state_mover.keep(request_iterator)
            return pb.Empty()
        return self._guard(context, keep)

    # -- the step (runtime.worker.step_runner.StepRunner) ------------------------------

    def Push(self, request_iterator, context):
        """Peer: the pieces one sender has for this worker in one phase of one step."""
        def push():
            self.receive_push(request_iterator)
            return pb.Empty()
        return self._guard(context, push)

    def receive_push(self, chunks) -> None:
        """One peer's push stream (``Push``, or the data plane's ``Incoming`` chunks) into the mailbox."""
        self.step_runner.receive_push(chunks)

    def Step(self, request, context):
        return self._guard(context, lambda: self.step_runner.run(request, context))

    def Steps(self, request_iterator, context):
        """Controller: the same steps on one long-lived stream (:mod:`runtime.worker.step_stream`)."""
        return serve_steps(request_iterator, context, step=self.step_runner.run,
                           heard=lambda: self.lease.heard("Steps"), dropped=self.faults.partitioned)

    def serve_step_connection(self, sock, first) -> None:
        """Controller: the same stream on a data-plane connection (:func:`serve_step_connection`)."""
        serve_step_connection(sock, first, step=self.step_runner.run, heard=lambda: self.lease.heard("Steps"),
                              dropped=self.faults.partitioned)


def _check_seconds(request) -> None:
    """``Load`` and ``Attach``: the lease (and an Attach's client grace) are finite numbers of seconds >= 0."""
    for name in ("lease_seconds", "client_grace_seconds"):
        if name not in request.DESCRIPTOR.fields_by_name:
            continue
        value = getattr(request, name)
        if not (math.isfinite(value) and value >= 0):
            raise ProtocolError(f"{name}={value} is not a number of seconds >= 0")


def _rss_bytes() -> int:
    """This process's resident memory (0 where ``/proc`` has none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
