"""The calls the worker group makes to its adopted workers: one stub per worker and the calls in flight.

:class:`~runtime.control.worker_group.WorkerGroup` decides who is a member
(launch, registration, warming, deaths) and delegates every call to an
adopted worker here: loading programs, initializing, dispatching and waiting
for steps, aborts, rollbacks, state transfers, hashes, checkpoints, progress
and chaos. What a call says and what its answer becomes is
:mod:`runtime.control.calls`; this module holds the stubs, fences each call
with the group's ``(run_id, epoch)`` and tracks the futures in flight, so a
worker declared dead has its calls cancelled (:meth:`WorkerCalls.record_death`).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Mapping

import grpc

from runtime.core import compile_cache
from runtime.wire import rpc
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.control.calls import (LoadResult, Stalled, StepResult, WorkerStatus, collect, gather, load_request,
                                   load_result, step_outcomes, step_requests, step_result, wait_until, worker_status)
from runtime.control.placement import StepPlan
from runtime.control.slice_calls import SliceStub, slice_future
from runtime.core.hosts import host_addresses, host_id
from runtime.core.programs import ProgramSet, SamplerPrograms
from runtime.control.registry import Registry
from runtime.control.step_stream import StepStreams
from runtime.wire.dataplane_client import DataClient
from runtime.wire.dataplane_wire import HANDSHAKE_SECONDS

__all__ = ["WorkerCalls"]


class WorkerCalls:
    """The stubs of the adopted workers and their calls in flight. Thread-safe where noted.

    ``fence`` gives the fence every call carries (the group's epoch);
    ``dead()`` answers the run's ``{worker: why}`` as it is now (the run
    state's: a death is recorded by :meth:`record_death`, through the run's
    event); ``declare_dead(worker, reason, cause)`` is called
    for a worker lost during a call; ``heard(worker, sent_at)`` is told of
    every step a worker answered (the health monitor's: no Check is needed
    while steps answer).
    """

    def __init__(self, opts, registry: Registry, programs: ProgramSet, data_source: bytes, snapshot_root: str,
                 fence: Callable[[], pb.Fence], dead: Callable[[], Mapping[str, str]],
                 declare_dead: Callable[..., None],
                 heard: Callable[[str, float], None] | None = None, secret: str = ""):
        self.opts, self.registry = opts, registry
        self.programs, self.data_source, self.snapshot_root = programs, data_source, snapshot_root
        self._fence, self._dead, self._declare_dead = fence, dead, declare_dead
        self._stubs: dict[str, pb_grpc.WorkerStub] = {}
        self._inflight: dict[str, list[grpc.Future]] = {}
        self._side_calls: dict[str, list[grpc.Future]] = {}   # an RL sampler's calls (start_call), by worker
        self._lock = threading.Lock()
        # Steps go on one stream per worker: on its data plane where it serves one (the run secret's handshake).
        dialer = DataClient(secret, opts.tls)
        self._streams = StepStreams(opts.rpc_timeout_seconds, heard=heard,
                                    dial=lambda address: dialer.connect(address, time.monotonic() + HANDSHAKE_SECONDS))

    # -- the workers reached -----------------------------------------------------

    def adopt(self, worker_id: str, channels: list[grpc.Channel]) -> None:
        """Later calls reach ``worker_id`` over ``channels``, one per host of its slice (in host order): a slice
        of several hosts is called on all of them at once (:class:`~runtime.control.slice_calls.SliceStub`)."""
        self._stubs[worker_id] = SliceStub([pb_grpc.WorkerStub(ch) for ch in channels])

    def reaches(self, worker_id: str) -> bool:
        """``worker_id`` was adopted."""
        return worker_id in self._stubs

    def workers(self) -> list[str]:
        """Every adopted worker, dead or alive."""
        return list(self._stubs)

    def record_death(self, worker_id: str, record: Callable[[], None]) -> list[grpc.Future] | None:
        """Thread-safe. ``record()`` writes the death (its event, which the run state folds at once) and the
        worker's calls in flight are taken (for the caller to cancel); None, and nothing recorded, when it was
        dead already. Atomic with every send: a call sent to a dead worker is cancelled at once."""
        with self._lock:
            if worker_id in self._dead():
                return None
            record()
            for host in self._host_ids(worker_id):
                self._streams.drop(host)
            return self._inflight.pop(worker_id, []) + self._side_calls.pop(worker_id, [])

    def _host_ids(self, worker_id: str) -> list[str]:
        """The ids of ``worker_id``'s hosts (its own, for a slice of one): their step streams' keys."""
        stub = self._stubs.get(worker_id)
        hosts = len(stub.hosts) if stub is not None else 1
        return [host_id(worker_id, k, hosts) for k in range(hosts)]

    def close(self) -> None:
        """The step streams end (the run is over, or another client took it over)."""
        self._streams.close()

    def send_home(self, worker_id: str, run_ended: bool = False) -> None:
        """The Shutdown call (best effort: a worker that does not answer is fenced either way), to each host of
        a slice of several on its own (one lost host must not keep the others from hearing it)."""
        stub = self._stubs[worker_id]
        for host in stub.hosts:
            try:
                host.Shutdown(pb.ShutdownRequest(fence=self._fence(), run_ended=run_ended), timeout=2.0)
            except grpc.RpcError:
                pass

    # -- calls -----------------------------------------------------------------

    def _call(self, worker_id: str, method: str, request, timeout: float | None = None):
        try:
            return getattr(self._stubs[worker_id], method)(request, timeout=timeout or self.opts.rpc_timeout_seconds)
        except grpc.RpcError as e:
            raise rpc.to_error(worker_id, e) from None

    def _all(self, method: str, make_request, workers) -> dict[str, object]:
        """Calls ``method`` on ``workers`` concurrently; see :func:`gather`."""
        return gather({w: getattr(self._stubs[w], method).future(make_request(w), timeout=self.opts.rpc_timeout_seconds)
                       for w in workers})

    def _each(self, method: str, make_request, workers, what: str, timeout: float | None = None) -> dict[str, object]:
        """Calls ``method`` on ``workers`` concurrently; returns the replies of those that succeeded.

        A worker lost during the call (``WorkerLostError``) is declared dead
        (``what`` says why); a declared-dead worker's call is cancelled, so a
        hung one does not hold the others up. Any other failure (the worker
        answered with an error: user code, a bad program) is raised after all
        calls ended.
        """
        futs = {}
        with self._lock:
            for w in workers:
                futs[w] = getattr(self._stubs[w], method).future(make_request(w),
                                                                  timeout=timeout or self.opts.rpc_timeout_seconds)
                self._inflight.setdefault(w, []).append(futs[w])
                if w in self._dead():
                    futs[w].cancel()
        out, raised = collect(futs, lambda w, error: self._declare_dead(w, f"{what}: {error}"[:300], cause="crash"))
        self._settle(futs)
        if raised is not None:
            raise raised
        return out

    def _settle(self, futs: dict[str, grpc.Future]) -> None:
        with self._lock:
            for w, f in futs.items():
                if f in self._inflight.get(w, []):
                    self._inflight[w].remove(f)

    def progress(self, worker_id: str, timeout: float = 2.0) -> pb.ProgressReply | None:
        """Where a worker is in its step (``step``, ``phase``, ``seconds`` in it, its ``rss_bytes``); None when it
        does not answer within ``timeout``."""
        try:
            return self._call(worker_id, "Progress", pb.ProgressRequest(fence=self._fence()), timeout=timeout)
        except Exception:   # noqa: BLE001 -- any failure means "no answer"; the caller probes it next
            return None

    def stacks(self, workers, timeout: float, silent: Mapping[str, str] | None = None
               ) -> dict[str, list[pb.ProcessStacks]]:
        """Thread-safe. Every thread's Python stack of each of ``workers``, asked of each host of a slice on its own
        and all at once: ``{worker: [one ProcessStacks per host, in host order]}``. A host that does not answer
        within ``timeout`` seconds (hung, stopped, gone) has ``error`` instead of ``text``; never waits longer.
        A host in ``silent`` (``{host id: why}``: known not to answer) is not asked: its ``error`` says why."""
        silent = silent or {}
        calls = {}
        for w in workers:
            stub = self._stubs.get(w)
            hosts = stub.hosts if stub is not None else []
            names = [host_id(w, k, len(hosts)) for k in range(len(hosts))]
            calls[w] = [(name, None if name in silent else h.Stacks.future(pb.StacksRequest(), timeout=timeout))
                        for name, h in zip(names, hosts)]
        wait_until({(w, k): f for w, fs in calls.items() for k, (_, f) in enumerate(fs) if f is not None},
                   time.monotonic() + timeout)
        out = {}
        for w, fs in calls.items():
            out[w] = []
            for name, f in fs:
                if f is None:
                    out[w].append(pb.ProcessStacks(name=name, error=silent[name]))
                    continue
                try:
                    for process in f.result(timeout=0).processes:   # named by its host id (host_id)
                        process.name = name
                        out[w].append(process)
                except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError) as e:
                    f.cancel()
                    why = e.details() if isinstance(e, grpc.RpcError) and e.details() else "no answer"
                    out[w].append(pb.ProcessStacks(name=name, error=f"{why} within {timeout:g} s"))
        return out

    # -- programs and state ----------------------------------------------------

    def _load_request(self, spare: bool = False, stage: int | None = None) -> pb.LoadRequest:
        """The run's Load call; ``spare``: to a worker that starts as a spare, which then prepares the memory a
        state copy to it lands in (not when spares shadow: they get a state at once). ``stage``: a pipelined
        run's worker of that stage gets that stage's programs."""
        if stage is None and self.pipelined:   # a spare of a pipelined run warms with stage 0's (it may take any)
            stage = 0
        programs = self.programs if stage is None else self.programs.by_stage[stage]
        request = load_request(self._fence(), programs, self.data_source, self.opts, self.snapshot_root)
        request.spare = spare and not self.opts.shadow_spares
        return request

    @property
    def pipelined(self) -> bool:
        """The run's programs are a pipeline's (one set per stage)."""
        return self.programs.pipelined

    def program_bytes(self) -> int:
        return sum(len(v) for v in self.programs.programs().values())

    def start_load(self, worker_id: str) -> grpc.Future:
        """The Load call to one worker (a newcomer warming: a spare), without waiting and not tracked in flight."""
        return self._stubs[worker_id].Load.future(self._load_request(spare=True), timeout=self.opts.rpc_timeout_seconds)

    def load(self, workers, spares=(), stages: dict[str, int] | None = None) -> dict[str, LoadResult]:
        """Ships programs and the data source to ``workers``; each compiles them and probes its devices.
        Those in ``spares`` start as spares (:meth:`_load_request`); in a pipelined run each worker gets the
        programs of its stage in ``stages`` (a spare not in it: stage 0's; the caller records which, in an event
        the run state folds).

        Returns the workers that loaded. One that fails (or dies: its call is
        cancelled when it is declared dead) is declared dead and left out.

        With a shared compilation cache, the first worker loads alone, then
        the others at once: it compiles each program and writes it to the
        cache, the others read it instead of compiling the same programs side
        by side (on a host shared by several workers, that is several times
        the CPU for nothing). When the cache already holds these programs
        (:func:`runtime.core.compile_cache.holds`: an earlier run or the reference
        run loaded them), all load at once.
        """
        spares, workers = set(spares), list(workers)
        if self.pipelined:   # each worker its stage's programs
            stage_of = {w: (stages or {}).get(w, 0) for w in workers}
            kinds = {key: self._load_request(spare=key[1], stage=key[0])
                     for key in {(stage_of[w], w in spares) for w in workers}}
            requests = {w: kinds[stage_of[w], w in spares] for w in workers}
        else:   # one request of each kind, shared (the programs' bytes are not copied per worker)
            kinds = {False: self._load_request(), True: self._load_request(spare=True)}
            requests = {w: kinds[w in spares] for w in workers}
        cache, programs = self.opts.compilation_cache_dir, self.programs.programs()
        devices = self.programs.devices_per_slice
        cold = not compile_cache.holds(cache, programs, devices)
        leader = workers[:1] if cache and cold and len(workers) > 1 else []
        replies = self._each("Load", requests.__getitem__, leader, "failed to load programs")
        dead = self._dead()
        rest = [w for w in workers if w not in leader and w not in dead]
        replies.update(self._each("Load", requests.__getitem__, rest, "failed to load programs"))
        if replies and cold:
            compile_cache.mark_held(cache, programs, devices)
        return {w: load_result(r) for w, r in replies.items()}

    def attach(self, workers, request: pb.AttachRequest, timeout: float) -> dict[str, pb.AttachReply]:
        """A restarted client's ``Attach`` to ``workers`` (adopted first); answers the replies of those that
        took the new generation. One that does not answer within ``timeout`` is declared dead; a refusal
        (another programs' fingerprint, a newer client) is raised after all calls ended.

        Not cancelled by a death declared meanwhile (the health monitor may find a fenced worker NOT_SERVING
        while its Attach is on the way): the answer decides, and one that answers is alive again."""
        futs = {w: self._stubs[w].Attach.future(request, timeout=timeout) for w in workers}
        # (a restarted client, or this one taking its run back after its workers fenced themselves: the generation)
        taker = f"client generation {request.fence.generation}"
        out, raised = collect(futs, lambda w, error: self._declare_dead(
            w, f"did not answer {taker} taking the run over: {error}"[:300], cause="crash"))
        if raised is not None:
            raise raised
        return out   # those that answered are alive: client_attached says so (the run state folds it)

    def init(self, workers, seed: int) -> dict[str, int]:
        """Each worker initializes its replica from ``seed``; returns ``{worker: state bytes}`` of those that did.

        One that fails is declared dead and left out. Every replica initializes
        from the same seed, so any worker can (re)initialize to the same bits.
        """
        replies = self._each("Init", lambda w: pb.InitRequest(fence=self._fence(), seed=seed), workers,
                             "failed to initialize its state")
        return {w: r.state_bytes for w, r in replies.items()}

    # -- steps -----------------------------------------------------------------

    def dispatch(self, plan: StepPlan, checkpoints: Mapping[str, tuple[str, list[float]]] | None = None,
                 shadows=(), snapshots: Mapping[str, str | None] | None = None, evals=None,
                 feed=None) -> dict[str, grpc.Future]:
        """Sends step ``plan.step`` to its workers without waiting; a dead worker's call fails at once.

        ``checkpoints``: ``{writer: (directory, committed loss sums)}``: each writer (one; a pipelined run: one
        per stage) writes a checkpoint after this step, recording the loss sums (completed with its own) beside
        the state. ``shadows``: spares
        that shadow the state: the ranks also push them the reduced vector, and each gets the step as a
        shadow (its future is in the answer too, under its id). ``snapshots``: ``{writer: peer or None}``: each
        writer snapshots its state on its host after this step and streams a copy to its peer (one writer; a
        pipelined run: one per stage). ``evals``: the step's eval order
        (:class:`runtime.control.evaluation.EvalOrder`: the eval microbatches of each rank), or None. ``feed``:
        an RL run's batches and weights to publish (:class:`runtime.control.sampling.Feed`), or None.
        """
        requests = step_requests(self._fence(), plan, self._addresses, checkpoints, shadows, snapshots,
                                 self.opts.pipeline_schedule, evals, feed)
        futs = {}
        with self._lock:
            for w, req in requests:
                self._send_step(w, req, futs)
        return futs

    def _send_step(self, w: str, req: pb.StepRequest, futs: dict) -> None:
        """With the lock held: one step on the worker's step stream without waiting
        (:mod:`runtime.control.step_stream`), tracked in flight (cancelled at once if dead)."""
        if w in self._dead():   # never sent: cancelled at once
            futs[w] = self._streams.cancelled(req)
            return
        stub, data = self._stubs[w], self._data_address(w)
        # each host on its own stream; the slice's step is all of theirs
        futs[w] = slice_future([self._streams.send(h, s, req, a) for h, s, a in
                                zip(self._host_ids(w), stub.hosts, host_addresses(data) or [""] * len(stub.hosts))])
        self._inflight.setdefault(w, []).append(futs[w])

    def poll(self, futs: dict[str, grpc.Future], deadline: float | None = None) -> dict[str, StepResult | Exception]:
        """The steps of ``futs`` that ended (by ``deadline``, monotonic, when given), each a
        :class:`StepResult` or the typed error; settles them."""
        if deadline is not None:
            wait_until(futs, deadline)
        ended = {w: f for w, f in futs.items() if f.done()}
        self._settle(ended)
        return step_outcomes(ended)

    def wait(self, futs: dict[str, grpc.Future], deadline: float | None = None) -> dict[str, StepResult] | Stalled:
        """Waits for a dispatched step: its results, :class:`Stalled` at ``deadline``, or the first typed error."""
        try:
            replies = gather(futs, deadline)
        except Exception:
            self._settle(futs)
            raise
        if isinstance(replies, Stalled):
            return replies
        self._settle(futs)
        return {w: step_result(r) for w, r in replies.items()}

    def cancel_inflight(self) -> None:
        """Abandons every step in flight (a recovery starts)."""
        with self._lock:
            futs = [f for fs in self._inflight.values() for f in fs]
            self._inflight.clear()
        for f in futs:
            f.cancel()

    # -- recovery --------------------------------------------------------------

    def abort(self, workers) -> dict[str, WorkerStatus]:
        """Fences ``workers`` into the current epoch (their step in flight stops); returns where each stands."""
        replies = self._all("Abort", lambda w: pb.AbortRequest(fence=self._fence()), workers)
        return {w: worker_status(r) for w, r in replies.items()}

    def rollback(self, worker_id: str, to_applied_steps: int) -> None:
        """Undoes a replica's last applied step (it keeps one step of history)."""
        self._call(worker_id, "Rollback", pb.RollbackRequest(fence=self._fence(), to_applied_steps=to_applied_steps))

    def transfer(self, source: str, dest: str, applied: int) -> tuple[int, str, str]:
        """``dest`` pulls the state of live replica ``source`` peer to peer; returns ``(bytes, digest, transport)``
        (``transport``: how it came, ``shared_memory``, ``tcp`` or ``grpc``)."""
        data_address = self._data_address(source)
        reply = self._call(dest, "PullState", pb.PullStateRequest(
            fence=self._fence(), source_address=self.registry.workers[source].address, applied_steps=applied,
            source_data_address=data_address, shared_memory=self.opts.shared_memory and bool(data_address)))
        return reply.bytes, reply.digest, reply.transport

    def load_checkpoints(self, workers, directory: str, applied: int, snapshot: bool = False,
                         parameters_only: bool = False) -> dict[str, pb.PullStateReply]:
        """``workers`` each load the newest valid checkpoint at or before ``applied`` (each reply says which);
        ``snapshot``: each the newest valid in-memory snapshot on its host instead (``directory`` unused);
        ``parameters_only``: each replaces its state's parameters by those of the checkpoint at ``directory``.

        One lost meanwhile is declared dead and left out (see :meth:`_each`)."""
        what = ("an in-memory snapshot" if snapshot else "the parameters of a checkpoint" if parameters_only
                else "a checkpoint")
        return self._each("LoadCheckpoint", lambda w: pb.LoadCheckpointRequest(
            fence=self._fence(), directory=directory, applied_steps=applied, snapshot=snapshot,
            parameters_only=parameters_only), workers, f"failed to load {what}")

    def flush_checkpoints(self, workers, wait_seconds: float, *,
                          save: Mapping[str, tuple[str, list[float]]] | None = None
                          ) -> dict[str, tuple[list[int], str, bool]]:
        """Waits (up to ``wait_seconds``) for the checkpoints ``workers`` are writing; ``{worker: (saved since
        the last report, first error or "", idle: nothing left to write)}``. ``save``: ``{worker: (directory,
        committed loss sums)}``: each first saves its state as it is now (a cut-off last checkpoint)."""
        def request(w):
            if save and w in save:
                return pb.CheckpointsRequest(fence=self._fence(), wait_seconds=wait_seconds, save_directory=save[w][0],
                                             committed_loss_sums=save[w][1])
            return pb.CheckpointsRequest(fence=self._fence(), wait_seconds=wait_seconds)
        replies = self._all("Checkpoints", request, workers)
        return {w: (list(r.saved), r.error, r.idle) for w, r in replies.items()}

    def _addresses(self, worker_id: str) -> tuple[str, str]:
        """Where ``worker_id`` is reached: its gRPC address and its data address (:meth:`_data_address`)."""
        return self.registry.workers[worker_id].address, self._data_address(worker_id)

    def _data_address(self, worker_id: str) -> str:
        """Where peers send ``worker_id`` tensors: its data plane, or "" (gRPC) when it has none or the run
        asked for gRPC (``data_plane``)."""
        return self.registry.workers[worker_id].data_address if self.opts.data_plane == "tcp" else ""

    def hashes(self, workers) -> dict[str, tuple[int, str]]:
        """``{worker: (applied steps, digest of its state)}``."""
        replies = self._all("StateHash", lambda w: pb.HashRequest(fence=self._fence()), workers)
        return {w: (r.step, r.digest) for w, r in replies.items()}

    # -- RL: samplers and weights versions (runtime.control.sampling) -------------

    def load_sampler(self, worker_id: str, programs: SamplerPrograms) -> LoadResult:
        """Ships a sampler its rollout program and prompt source; it compiles and probes its devices. None when it
        was lost meanwhile (declared dead)."""
        request = self.sampler_load_request(programs)
        replies = self._each("Load", lambda w: request, [worker_id], "failed to load the sampler's program")
        return load_result(replies[worker_id]) if worker_id in replies else None

    def sampler_load_request(self, programs: SamplerPrograms) -> pb.LoadRequest:
        """A sampler's Load: its rollout program, its layout (``role: sampler``) and its prompt source."""
        return pb.LoadRequest(fence=self._fence(), data_source=programs.prompts, layout=programs.layout_json(),
                              programs=[pb.Program(name=name, serialized=blob, sha256=hashlib.sha256(blob).hexdigest())
                                        for name, blob in programs.programs().items()],
                              lease_seconds=self.opts.worker_lease_seconds, chunk_bytes=self.opts.chunk_bytes)

    def publish_weights(self, workers, leaves, dtype: str) -> dict[str, pb.PublishWeightsReply]:
        """Each trainer in ``workers`` keeps its state's ``leaves`` as the weights version its applied steps
        make; those lost meanwhile are declared dead and left out."""
        return self._each("PublishWeights", lambda w: pb.PublishWeightsRequest(fence=self._fence(), leaves=leaves,
                                                                               dtype=dtype),
                          workers, "failed to publish its weights")

    def start_call(self, worker_id: str, method: str, request) -> grpc.Future:
        """``method`` on ``worker_id`` without waiting (an RL sampler's calls): cancelled at once when it is declared
        dead (or already dead), and never by a recovery of the trainers (:meth:`cancel_inflight`)."""
        with self._lock:
            fut = getattr(self._stubs[worker_id], method).future(request, timeout=self.opts.rpc_timeout_seconds)
            self._side_calls.setdefault(worker_id, []).append(fut)
            if worker_id in self._dead():
                fut.cancel()
        return fut

    def settle(self, worker_id: str, fut: grpc.Future) -> None:
        """A call of :meth:`start_call` that ended is no longer in flight."""
        with self._lock:
            if fut in self._side_calls.get(worker_id, []):
                self._side_calls[worker_id].remove(fut)

    def where(self, worker_id: str) -> pb.Peer:
        """How peers reach ``worker_id``: its gRPC address and data address."""
        address, data = self._addresses(worker_id)
        return pb.Peer(address=address, data_address=data)

    # -- chaos -------------------------------------------------------------------

    def inject_fault(self, worker_id: str, action: str, *, factor: float = 0.0, seconds: float = 0.0,
                     phase: str = "", after_step: int = 0, host: int | None = None) -> None:
        """A chaos fault on ``worker_id`` (``host``: on that host of its slice alone; None: on every host)."""
        stub = self._stubs[worker_id]
        if host is not None:
            stub = stub.hosts[host]
        try:
            stub.Chaos(pb.ChaosRequest(action=action, factor=factor or 0.0, seconds=seconds or 0.0, phase=phase,
                                       after_step=after_step), timeout=5.0)
        except grpc.RpcError as e:
            raise rpc.to_error(worker_id, e) from None
