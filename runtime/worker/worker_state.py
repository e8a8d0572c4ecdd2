"""A worker's whole state coming in and going out other than by a step: copies, checkpoints and snapshots.

:class:`StateMover` is the object the service delegates these RPCs to; it
owns what they need beyond the replica (:class:`runtime.worker.replica.Replica`,
which holds the state and its lock): this host's snapshot store, the
background checkpoint writer, and the loaded programs' fingerprint that every
save records and every restore checks. The bodies of the operations are
functions here, each given explicitly what it needs (the data client, the
peer channels, the snapshot store, the faults, a timeout):

- :func:`pull_state` (``PullState``): a spare or a relaunched worker copies a
  live replica's state, out of its memory when both are on one host, else
  over the data plane or gRPC ``GetState`` (:mod:`runtime.state.state_copy`),
  and adopts it only if it is the one asked for;
- :func:`load_checkpoint` (``LoadCheckpoint``): the newest valid checkpoint
  or snapshot at or before a step, refused when other programs wrote it;
- :func:`keep_snapshot` (``KeepSnapshot``) and :func:`copy_snapshot`: a
  snapshot's copy on another host, kept whole or not at all;
- :func:`save_step`, :func:`drain_saves` and :func:`flush_checkpoints`
  (``Checkpoints``): a step's state handed to the background writer
  (:mod:`runtime.worker.saver`) with what it records (:func:`loss_sums`), and the
  saves it reports; :func:`while_saving` and :func:`strike_save_in_progress`
  are its chaos fault (``kill_save``: the save being written, or the next).

Replacing the state stays with the replica (:meth:`runtime.worker.replica.Replica.adopt`),
under its lock and refused while a step runs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
import numpy as np

from runtime._proto import elastic_pb2 as pb
from runtime.wire.dataplane_client import DataClient, NotLocal, RemoteError
from runtime.core.errors import ProtocolError, StaleEpochError, StepAbortedError
from runtime.worker.fault_injection import WorkerFaults, mid_stream
from runtime.wire.peers import PeerChannels
from runtime.wire.requests import for_host
from runtime.core.hosts import take_blocks
from runtime.worker.agreement import SliceAgreement
from runtime.worker.saver import CheckpointWriter, Drained
from runtime.state.checkpoint_hosts import host_directory
from runtime.state.snapshot import SnapshotStore
from runtime.state.state_copy import (assemble_state, copy_shared_state, landing, shared_state, state_chunks,
                                      state_digest)
from runtime.core.fingerprint import legacy_programs_fingerprint, programs_fingerprint

if TYPE_CHECKING:
    from collections.abc import Iterator

    from runtime.wire.parts import Part
    from runtime.worker.executor import SliceExecutor
    from runtime.worker.lease import Lease
    from runtime.worker.replica import Replica

__all__ = ["Landing", "StateMover", "copy_snapshot", "drain_saves", "flush_checkpoints", "keep_snapshot",
           "load_checkpoint", "loss_sums", "loss_sums_of", "pull_state", "save_step", "strike_save_in_progress",
           "while_saving"]

_STAGE_DIRECTORY = re.compile(r"stage[0-9]+")   # a pipelined run's stage directory of a host's snapshots


class Landing:
    """A spare's host memory for the state it will be copied (:func:`runtime.state.state_copy.landing`), faulted
    in on a thread of its own once it loaded, so that a recovery's copy does not pay the page faults.

    :meth:`take` hands it out once (None while it is still being made, or
    after :meth:`drop`: the worker got a state some other way and frees it);
    :meth:`give_back` returns it after a copy that failed. Thread-safe.
    """

    def __init__(self, layout):
        self._lock = threading.Lock()
        self._memory, self._dropped = None, False
        threading.Thread(target=self._make, args=(list(layout),), name="state-landing", daemon=True).start()

    def _make(self, layout) -> None:
        try:
            memory = landing(layout)
        except (MemoryError, OSError) as e:   # only a spare's head start is lost: a copy allocates as before
            logging.getLogger("jax_elastic").warning("no landing memory for a state copy: %s", e)
            return
        with self._lock:
            if not self._dropped:
                self._memory = memory

    def take(self):
        with self._lock:
            memory, self._memory = self._memory, None
            return memory

    def give_back(self, memory) -> None:
        with self._lock:
            if not self._dropped and memory is not None:
                self._memory = memory

    def drop(self) -> None:
        with self._lock:
            self._memory, self._dropped = None, True


class StateMover:
    """Moves this worker's whole state in and out, other than by a step; the service delegates ``GetState``,
    ``PullState``, ``LoadCheckpoint``, ``Checkpoints``, ``KeepSnapshot`` and ``Rollback`` here, the data plane
    its state reads (:meth:`parts`, :meth:`shared`), the step its saves (:meth:`save`, :meth:`drain_saves`).

    Owns this host's snapshot store of the run (:attr:`snapshots`, None when the run takes none, and
    :attr:`snapshot_home`, the host's directory of them: a pipelined run keeps one per stage in it), the
    background writer (created on first use), and the loaded programs' :attr:`fingerprint`. Every operation
    checks the fence first; a refused one leaves the state as it was.
    """

    def __init__(self, replica: Replica, lease: Lease, *, peers: PeerChannels, data: DataClient,
                 faults: WorkerFaults, step_timeout: float, agreement: SliceAgreement | None = None):
        self._replica, self._lease = replica, lease
        # A slice of several hosts: a checkpoint is saved once every host's part is (runtime.worker.agreement).
        self._agreement = agreement if agreement is not None else SliceAgreement()
        self._unconfirmed: list[int] = []   # checkpoints this host wrote, not yet every host of the slice
        self._peers, self._data, self._faults = peers, data, faults
        self._step_timeout = step_timeout
        self.fingerprint = ""                 # sha256 of the loaded programs: which math a checkpoint holds
        self._blobs: dict[str, bytes] = {}    # the loaded programs, for the fingerprint older checkpoints hold
        self._writer: CheckpointWriter | None = None   # checkpoints and snapshots (runtime.worker.saver), on first use
        self.snapshots: SnapshotStore | None = None   # this host's snapshots of the run (runtime.state.snapshot)
        self.snapshot_home = ""               # this host's directory of them (a pipelined run: one per stage in it)

    def loaded(self, blobs: dict[str, bytes], snapshots: SnapshotStore | None, home: str) -> None:
        """``Load``, within the replica's :meth:`~runtime.worker.replica.Replica.exclusive`: the programs
        loaded (by name, serialized) and where this host keeps the run's snapshots."""
        self._blobs = blobs
        self.fingerprint = programs_fingerprint(blobs)
        self.snapshots, self.snapshot_home = snapshots, home

    def status(self) -> pb.StatusReply:
        """What this worker holds, and the snapshots its host keeps (``Abort``, ``Rollback``, ``Attach``)."""
        return self._replica.status(self.snapshots.steps() if self.snapshots is not None else [])

    # -- saves -------------------------------------------------------------------

    def writer(self) -> CheckpointWriter:
        """The background writer, created on first use (with the ``kill_save`` fault when chaos is on)."""
        if self._writer is None:
            chaos = functools.partial(while_saving, self._faults) if self._faults.enabled else None
            self._writer = CheckpointWriter(while_saving=chaos)
        return self._writer

    def save(self, req: pb.StepRequest) -> None:
        """Under the replica's lock, right after ``req.step`` applied (or between steps, for ``Checkpoints``):
        hands the state to the writer (:func:`save_step`)."""
        replica, agreement = self._replica, self._agreement
        if req.checkpoint_directory:
            agreement.undone("checkpoint", replica.executor.steps_applied)
        save_step(self.writer(), req, replica.executor, fingerprint=self.fingerprint, recent=replica.recent,
                  snapshots=self.snapshots, peers=self._peers, timeout=self._step_timeout,
                  written=lambda store, step: agreement.done("checkpoint", step),
                  failed=lambda step: agreement.done("checkpoint", step, ok=False))

    def drain_saves(self) -> tuple[Drained, Drained]:
        """The checkpoints (those every host of the slice wrote its part of), then the snapshots, finished since
        the last step asked (:func:`drain_saves`)."""
        checkpoints, snapshots = drain_saves(self._writer)
        return self._confirmed(checkpoints), snapshots

    def _confirmed(self, drained: Drained, deadline: float | None = None) -> Drained:
        """``drained`` with only the checkpoints every host of the slice wrote its part of (waiting for them
        until ``deadline``, monotonic; None: not); those a host failed are dropped (that host reports the
        error), the others kept for the next call."""
        self._unconfirmed += drained.saved
        outcome = {s: self._agreement.outcome("checkpoint", s, deadline) for s in self._unconfirmed}
        self._unconfirmed = [s for s, ok in outcome.items() if ok is None]
        return dataclasses.replace(drained, saved=[s for s, ok in outcome.items() if ok])

    def save_striker(self) -> Callable[[], None]:
        """Chaos, when ``kill_in_phase`` of the save phase is armed: what cuts off the save the writer (as it is
        now) is writing, run once the arming call was answered (:func:`strike_save_in_progress`)."""
        return functools.partial(strike_save_in_progress, self._faults, self._writer)

    def checkpoints(self, request: pb.CheckpointsRequest) -> pb.CheckpointsReply:
        """Controller (``Checkpoints``, at the end of a run): waits for the checkpoints in flight, then reports
        them. With ``save_directory`` it first saves the state as it is now there (the run's last checkpoint was
        cut off with its writer); refused while a step runs."""
        self._lease.check_fence(request.fence)
        replica = self._replica
        if request.save_directory:
            replica.need_executor()
            with replica.exclusive("a step is running; cannot save the state now"):
                ex = replica.executor
                self.save(pb.StepRequest(step=ex.steps_applied - 1, checkpoint_directory=request.save_directory,
                                         committed_loss_sums=request.committed_loss_sums))
        seconds = max(0.0, min(request.wait_seconds, self._step_timeout))
        deadline = time.monotonic() + seconds
        reply = flush_checkpoints(self._writer, seconds)
        done = self._confirmed(Drained(saved=list(reply.saved)), deadline)
        return pb.CheckpointsReply(saved=done.saved, error=reply.error, idle=reply.idle and not self._unconfirmed)

    def remove_snapshots(self) -> None:
        """The run ended (``Shutdown``): the RAM this host's snapshots hold serves nobody now, every stage's."""
        if self.snapshots is not None:
            self.snapshots.remove_all()
            if self.snapshot_home and self.snapshot_home != self.snapshots.directory:   # a pipeline's: all stages
                SnapshotStore(self.snapshot_home).remove_all()

    # -- out: this replica's state to a peer ---------------------------------------

    def parts(self, request: pb.GetStateRequest) -> Iterator[Part]:
        """Peer (``GetState``, or the data plane): the parts of this replica's state at
        ``request.applied_steps``. Raises, before anything is sent, when the request is fenced off or the state
        is not at that step."""
        leaves, applied, digest = self._state_at(request)
        return mid_stream(state_chunks(leaves, applied, self._replica.chunk_bytes, digest),
                          self._faults.sending_state)

    def shared(self, request: pb.GetStateRequest) -> Iterator[pb.SharedState]:
        """Peer on this host (the data plane's ``on_shared_state``): yields where the state's host leaves lie,
        then (the reader copying them, at the second ``next``) passes the chaos point midway and yields None; the
        leaves stay alive until the data server closes this generator (a slice of several hosts' are arrays of
        their own, made for the read: freed with the generator's frame). Raises, before yielding, as
        :meth:`parts`."""
        leaves, applied, digest = self._state_at(request)
        leaves = [np.require(x, requirements='C') for x in leaves]   # (ascontiguousarray makes a scalar 1-d)
        yield shared_state(leaves, applied, digest)
        self._faults.sending_state()
        yield None   # holds the leaves until the reader is done and the server closes this

    def _state_at(self, request: pb.GetStateRequest) -> tuple[list, int, str]:
        self._lease.check_fence(request.fence)
        return self._replica.state_at(request.applied_steps)

    # -- in: a state from elsewhere --------------------------------------------------

    def pull(self, request: pb.PullStateRequest) -> pb.PullStateReply:
        """Controller (``PullState``): replace this replica's state with a copy pulled from
        ``source_address`` (:func:`pull_state`)."""
        self._lease.check_fence(request.fence)
        replica = self._replica
        replica.need_executor()
        request = for_host(request, replica.executor.host)   # host k of a slice copies host k's blocks
        return pull_state(request, replica.layout, data=self._data, peers=self._peers, faults=self._faults,
                          timeout=self._step_timeout, adopt=replica.adopt, landing_memory=replica.landing)

    def restore(self, request: pb.LoadCheckpointRequest) -> pb.PullStateReply:
        """Controller (``LoadCheckpoint``): replace this replica's state with a checkpoint or snapshot
        (:func:`load_checkpoint`), or its parameters only (:func:`load_parameters`)."""
        self._lease.check_fence(request.fence)
        replica = self._replica
        replica.need_executor()
        ex = replica.executor
        if request.parameters_only:
            return load_parameters(request, ex, replica.adopt)
        return load_checkpoint(request, snapshots=self.snapshots, executor=ex,
                               fingerprints=(self.fingerprint, lambda: legacy_programs_fingerprint(self._blobs)),
                               layout=replica.layout, adopt=replica.adopt)

    def keep(self, request_iterator) -> None:
        """Peer (``KeepSnapshot``): keep a copy of its snapshot on this host (:func:`keep_snapshot`)."""
        keep_snapshot(request_iterator, self.snapshots, self._lease.check_fence, self.snapshot_home)

    def rollback(self, request: pb.RollbackRequest) -> pb.StatusReply:
        """Controller (``Rollback``): back to ``to_applied_steps`` (at most one step back); refused while a step
        runs."""
        self._lease.check_fence(request.fence)
        replica = self._replica
        replica.need_state()
        with replica.exclusive("cannot roll back while a step runs; abort first"):
            replica.rollback(request.to_applied_steps)
            return self.status()


def pull_state(request: pb.PullStateRequest, layout, *, data: DataClient, peers: PeerChannels, faults: WorkerFaults,
               timeout: float, adopt, landing_memory: Landing | None = None) -> pb.PullStateReply:
    """``PullState``: the state pulled from ``request.source_address``, checked against ``layout`` (the
    ``[(shape, dtype)]`` of this worker's leaves), the step asked for and the expected digest, then given to
    ``adopt(leaves, applied, digest)``. Raises, with the state unchanged, when any of them does not match.
    ``landing_memory``: where the leaves land, when this worker (a spare) prepared it (given back if the copy
    fails)."""
    if not request.source_address:
        raise ProtocolError("PullState without a source address")
    memory = landing_memory.take() if landing_memory is not None else None
    try:
        return _pull_state(request, layout, data, peers, faults, timeout, adopt, memory)
    except BaseException:
        if landing_memory is not None:
            landing_memory.give_back(memory)
        raise


def _receive(request, layout, data, peers, faults, timeout, memory) -> tuple[tuple[list, int, str], str]:
    """The state ``request`` names, checked against ``layout``, and how it came: out of the source's memory
    when it is on this host and the request allows it, else over the data plane, else over gRPC."""
    ask = pb.GetStateRequest(fence=request.fence, applied_steps=request.applied_steps)
    deadline = time.monotonic() + timeout
    if request.shared_memory and request.source_data_address:
        try:
            return data.read_shared_state(request.source_data_address, ask, deadline, functools.partial(
                copy_shared_state, expect=layout, midway=faults.receiving_state, landing_memory=memory)), \
                "shared_memory"
        except NotLocal:
            pass   # another host, or one that forbids it: the stream below
    if request.source_data_address:
        stream, transport = data.get_state(request.source_data_address, ask, deadline), "tcp"
    else:
        stream = peers.stub(request.source_address).GetState(ask, timeout=max(deadline - time.monotonic(), 0.001))
        transport = "grpc"
    return assemble_state(mid_stream(stream, faults.receiving_state), expect=layout, landing_memory=memory), transport


def _pull_state(request, layout, data, peers, faults, timeout, adopt, memory) -> pb.PullStateReply:
    t0 = time.perf_counter()
    try:
        (leaves, applied, digest), transport = _receive(request, layout, data, peers, faults, timeout, memory)
    except grpc.RpcError as e:
        raise StepAbortedError(-1, f"state transfer from {request.source_address} failed: "
                                   f"{e.code().name}") from e
    except (RemoteError, OSError) as e:
        raise StepAbortedError(-1, f"state transfer from {request.source_address} failed: {e}") from e
    if applied != request.applied_steps:
        raise ProtocolError(f"{request.source_address} sent a state at {applied} applied steps, "
                            f"asked for {request.applied_steps}")
    if request.expected_digest and digest != request.expected_digest:
        raise ProtocolError(f"the state from {request.source_address} does not hash to the expected "
                            f"{request.expected_digest[:21]}...")
    adopt(leaves, applied, digest)
    # The digest of the leaves now in place (the controller then checks every replica's own digest).
    return pb.PullStateReply(digest=digest, bytes=sum(x.nbytes for x in leaves),
                             seconds=time.perf_counter() - t0, transport=transport)


def load_checkpoint(request: pb.LoadCheckpointRequest, *, snapshots: SnapshotStore | None, executor,
                    fingerprints: tuple[str, Callable[[], str]], layout, adopt) -> pb.PullStateReply:
    """``LoadCheckpoint``: the newest valid checkpoint (or, with ``request.snapshot``, snapshot in
    ``snapshots``) at or before ``request.applied_steps``, given to ``adopt(leaves, step, digest)`` unless
    other programs than ``executor``'s (this host's state ``layout``) wrote it. ``fingerprints``: the programs'
    fingerprint, and a function giving the one checkpoints written before it record (asked only when the
    first does not match). A checkpoint is read as this host's blocks of it, whatever host count wrote it
    (:func:`runtime.state.checkpoint_hosts.restore_for_host`; the programs' checkpoint tree reads one
    MaxText's trainer wrote)."""
    from runtime.state.checkpoint_hosts import restore_for_host

    t0 = time.perf_counter()
    ex = executor
    if request.snapshot and snapshots is None:
        raise StaleEpochError("this worker keeps no snapshots (the run takes none)")
    if request.snapshot:   # a snapshot is this host's own, of this slice's shape
        (step, leaves, digest, meta), skipped = snapshots.restore_newest_valid(at_most=request.applied_steps)
    else:
        (step, leaves, digest, meta), skipped = restore_for_host(
            request.directory, request.applied_steps, layout=ex.whole_layout(), dims=ex.state_dims(),
            hosts=ex.hosts, host=ex.host, tree=ex.checkpoint_tree)
    mesh = (ex.programs.devices_per_slice, ex.programs.num_microbatches)
    written_on = (meta.get("devices_per_slice"), meta.get("microbatches"))
    fingerprint, legacy = fingerprints
    resharded = meta.get("fingerprint") not in ("", None, fingerprint) and meta["fingerprint"] != legacy()
    if resharded and (written_on == mesh or None in written_on
                      or [(tuple(x.shape), x.dtype) for x in leaves] != list(layout)):
        where = snapshots.directory if request.snapshot else request.directory
        raise ProtocolError(f"checkpoint {where} step {step} was written by other programs "
                            "(another model or optimizer); it cannot resume this run (to start afresh, "
                            "use another run_name or remove that directory)")
    adopt(leaves, step, digest)   # placed on this slice's devices, however many
    return pb.PullStateReply(digest=digest, bytes=sum(x.nbytes for x in leaves),
                             seconds=time.perf_counter() - t0, applied_steps=step,
                             skipped=[f"step {s.step} ({s.path}): {s.reason}" for s in skipped],
                             loss_sums=loss_sums_of(meta, step),
                             written_devices_per_slice=written_on[0] if resharded else 0,
                             written_microbatches=written_on[1] if resharded else 0)


def load_parameters(request: pb.LoadCheckpointRequest, executor, adopt) -> pb.PullStateReply:
    """``LoadCheckpoint`` with ``parameters_only`` (``load_parameters_path``): the leaves the programs'
    checkpoint tree places under ``params`` are replaced by the checkpoint's at ``request.directory``, the rest
    of the state held now (the initialized optimizer) and its applied steps are kept, through
    ``adopt(leaves, step, digest)``."""
    t0 = time.perf_counter()
    leaves, read = with_parameters(executor, request.directory)
    digest = state_digest(leaves)
    adopt(leaves, executor.steps_applied, digest)
    return pb.PullStateReply(digest=digest, bytes=read, seconds=time.perf_counter() - t0,
                             applied_steps=executor.steps_applied)


def with_parameters(executor, directory: str) -> tuple[list[np.ndarray], int]:
    """``executor``'s state as this host holds it (host copies: on a slice of several hosts, its blocks) with the
    leaves its programs' checkpoint tree places under ``params`` read from the checkpoint at ``directory``
    (``<dir>`` or ``<dir>/items``: whole leaves, this host's blocks of them taken), and the bytes read; the
    reference run does the same after its init."""
    from etils import epath

    from runtime.state.checkpoint_orbax import read_parameters

    tree = executor.checkpoint_tree
    if tree is None:
        raise ProtocolError("these programs name no checkpoint tree, so no parameters can be picked out of a "
                            "checkpoint (load_parameters_path needs a model whose checkpoints are named, e.g. "
                            "MaxText's)")
    if executor.state is None:
        raise StaleEpochError("this worker holds no state yet")
    params = read_parameters(epath.Path(directory.rstrip("/").removesuffix("/items")), tree, executor.whole_layout())
    dims = executor.state_dims()
    mine = {i: take_blocks([x], [dims[i]], executor.hosts, executor.host)[0] for i, x in params.items()}
    return ([mine.get(i, x) for i, x in enumerate(executor.host_state())],
            sum(x.nbytes for x in params.values()))


def keep_snapshot(request_iterator, snapshots: SnapshotStore | None, check_fence, home: str = "") -> None:
    """``KeepSnapshot``: a peer's snapshot pieces into ``snapshots``, once ``check_fence`` accepted the first; a
    pipelined run's into the directory of the sender's stage under this host's ``home`` (any worker keeps any
    stage's copy)."""
    if snapshots is None:
        raise StaleEpochError("this worker keeps no snapshots (not loaded, or the run takes none)")
    first = next(iter(request_iterator), None)
    if first is None:
        return
    check_fence(first.fence)
    if first.stage:
        if not _STAGE_DIRECTORY.fullmatch(first.stage) or not home or home == snapshots.directory:
            raise ProtocolError(f"a snapshot of stage directory {first.stage!r} has no place on this worker")
        snapshots = SnapshotStore(os.path.join(home, first.stage))

    def pieces():
        for p in itertools.chain([first], request_iterator):
            yield p.step, p.total_bytes, p.data
    try:
        snapshots.receive(pieces())
    except ValueError as e:
        raise ProtocolError(str(e)) from None


def copy_snapshot(peers: PeerChannels, timeout: float, address: str, fence: pb.Fence, stage: str,
                  store: SnapshotStore, step: int) -> None:
    """Streams the snapshot of ``step`` to the worker at ``address``, which keeps it on its host (``stage``: a
    pipelined run's stage directory it belongs in, "" otherwise)."""
    pieces = (pb.SnapshotPiece(fence=fence, step=s, total_bytes=n, data=d, stage=stage)
              for s, n, d in store.pieces(step))
    peers.stub(address).KeepSnapshot(pieces, timeout=timeout)


def save_step(writer: CheckpointWriter, req: pb.StepRequest, executor: SliceExecutor, *, fingerprint: str,
              recent: dict[int, float], snapshots: SnapshotStore | None, peers: PeerChannels, timeout: float,
              written=None, failed=None) -> None:
    """Right after step ``req.step`` applied (under the service's lock): hands the new state to ``writer`` for
    the checkpoint and the snapshot ``req`` asks for, with what they record (the programs' ``fingerprint`` and
    mesh, the loss sums); a snapshot's copy then goes to ``req.snapshot_peer``, when named. ``written``: called
    as ``written(store, step)`` once the checkpoint is committed; ``failed``: as ``failed(step)`` if it is not
    (its save failed, or was replaced by a newer one before it began)."""
    ex = executor
    meta = {"fingerprint": fingerprint, "devices_per_slice": ex.programs.devices_per_slice,
            "microbatches": ex.programs.num_microbatches,
            "loss_sums": loss_sums(req.committed_loss_sums, recent, req.step)}
    if req.checkpoint_directory:   # each host of a slice its own blocks (runtime.state.checkpoint_hosts)
        # (a host's blocks are not the leaves a named tree places, MaxText's: they are kept as a flat list)
        writer.submit(host_directory(req.checkpoint_directory, ex.host, ex.hosts), ex.steps_applied, ex.state, meta,
                      tree=ex.checkpoint_tree if ex.hosts == 1 else None, to_host=ex.host_blocks, then=written,
                      failed=failed)
    if req.snapshot:
        peer = req.snapshot_peer.address if req.HasField("snapshot_peer") else ""
        stage = f"stage{ex.programs.stage}" if req.HasField("pipeline") else ""
        copy = functools.partial(copy_snapshot, peers, timeout, peer, req.fence, stage) if peer else None
        writer.submit(snapshots.directory, ex.steps_applied, ex.state, meta, store=snapshots, then=copy,
                      to_host=ex.host_blocks)


def drain_saves(writer: CheckpointWriter | None) -> tuple[Drained, Drained]:
    """The checkpoints, then the snapshots, ``writer`` finished (and their first error) since it was last asked."""
    return (writer.drain(), writer.drain("snapshot")) if writer is not None else (Drained(), Drained())


def flush_checkpoints(writer: CheckpointWriter | None, wait_seconds: float) -> pb.CheckpointsReply:
    """``Checkpoints``: waits up to ``wait_seconds`` for the saves in flight, then reports them."""
    if writer is None:
        return pb.CheckpointsReply(idle=True)
    idle = writer.wait(wait_seconds)
    done = writer.drain()
    return pb.CheckpointsReply(saved=done.saved, error=done.error, idle=idle)


def loss_sums(committed, recent: dict[int, float], step: int) -> list[float]:
    """The loss sums of steps 0..``step``: the committed ones the controller sent, then this worker's own
    ``recent`` ones; [] when a step between is unknown here (a resumed run then reports those losses as NaN),
    or unknown to the controller too (a run resumed from a checkpoint that recorded none: NaN there)."""
    sums = list(committed)
    if any(math.isnan(x) for x in sums):
        return []
    for k in range(len(sums), step + 1):
        if k not in recent:
            return []
        sums.append(recent[k])
    return sums


def loss_sums_of(metadata: dict, applied: int) -> list[float]:
    """The loss sums a checkpoint of ``applied`` steps recorded: one float per step, else [] (not recorded,
    or not of that length: the checkpoint's file is the truth about the state, not about the losses)."""
    sums = metadata.get("loss_sums")
    if (isinstance(sums, list) and len(sums) == applied
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in sums)):
        return [float(x) for x in sums]
    return []


def while_saving(faults: WorkerFaults, store, step: int) -> None:
    """Chaos (``kill_save``): with a kill armed for the save phase (a save of a step after ``faults.save_after``),
    dies once this save has begun in the store (:func:`_partial`), so the save is cut off half written. A save
    that completes before it is seen begun is let be (the kill waits for the next); one never seen either way
    within 2 s is struck then."""
    if not faults.armed_in("save") or step <= faults.save_after:
        return
    deadline, polls = time.monotonic() + 2.0, 0
    while time.monotonic() < deadline:
        if _partial(store, step):
            faults.in_phase("save")
            return
        polls += 1
        if polls % 10 == 0 and step in store.steps():
            return   # committed before it was seen half written: the next save is struck
        time.sleep(0.002)
    faults.in_phase("save")


def strike_save_in_progress(faults: WorkerFaults, writer: CheckpointWriter | None) -> None:
    """Chaos (``kill_save``), right after the kill was armed: a checkpoint already being written is cut off too
    (the worker dies while it is begun and not complete); when none is, or it completes first, the kill waits
    for the next save (:func:`while_saving`). So an armed writer dies in the save it is writing or the next."""
    current = writer.writing() if writer is not None else None
    if current is None:
        return
    store, step = current
    if step <= faults.save_after:
        return   # an older save, still being written: the kill waits for a save still ahead
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and faults.armed_in("save") and writer.writing() == current:
        if _partial(store, step):
            faults.in_phase("save")
            return
        time.sleep(0.002)


def _partial(store, step: int) -> bool:
    """The save of ``step`` is begun and not complete in ``store``: its temporary directory exists (local disk:
    ``<step>.orbax-checkpoint-tmp...``), or its directory without the commit file (GCS writes in place)."""
    names = (p.rstrip("/").rsplit("/", 1)[-1] for p in store.leftovers())
    return any(name == str(step) or name.startswith(f"{step}.") for name in names)
