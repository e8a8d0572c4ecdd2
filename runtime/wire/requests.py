"""The worker's checks of what the controller sends it, before anything touches its state. Pure.

A step plan that does not cover the microbatches, programs that do not match
their sha256 or do not parse, programs for a platform this worker's JAX does
not run on (:class:`PlatformMismatchError`), a layout that does not fit them
or this host, and a data source that does not unpickle are refused with
:class:`ProtocolError` (the caller sees INVALID_ARGUMENT).
"""

from __future__ import annotations

import hashlib
import pickle

import jax
import numpy as np

from runtime._proto import elastic_pb2 as pb
from runtime.core.errors import ProtocolError
from runtime.core.hosts import host_address
from runtime.core.microbatch import Node, is_power_of_two, root
from runtime.core.platforms import check_runnable, local_platform
from runtime.core.programs import StagePrograms

__all__ = ["check_step_request", "decode_programs", "for_host", "node_of", "unpickle_source"]

_MAX_MICROBATCHES = 1 << 20


def node_of(n: pb.Node) -> Node:
    """The subtree a ``pb.Node`` names."""
    return Node(n.level, n.index)


def check_step_request(req: pb.StepRequest, num_microbatches: int) -> None:
    """Refuses (:class:`ProtocolError`) a step plan that this worker could not run to the end.

    The ranks must be ``0..n-1`` with an address each; ``all_nodes`` must cut
    the microbatches ``0..M-1`` into aligned subtrees, each owned by a rank,
    every rank owning at least one; ``nodes`` must be this rank's share (a
    shadow has no rank and no share: it only receives the all-gather).
    """
    n, m = len(req.peers), num_microbatches
    if req.step < 0:
        raise ProtocolError(f"step {req.step} is negative")
    if not 1 <= n <= m or sorted(p.rank for p in req.peers) != list(range(n)):
        raise ProtocolError(f"step {req.step}: peer ranks {sorted(p.rank for p in req.peers)[:8]} are not 0..n-1 "
                            f"with 1 <= n <= {m} microbatches")
    if any(not p.address for p in req.peers if p.rank != req.rank or req.shadow):
        raise ProtocolError(f"step {req.step}: a peer has no address")
    if any(not p.address for p in req.shadows):
        raise ProtocolError(f"step {req.step}: a shadow has no address")
    if req.shadow and (req.nodes or req.shadows or req.checkpoint_directory):
        raise ProtocolError(f"step {req.step}: a shadow computes no subtree, feeds no shadow and writes no "
                            "checkpoint")
    if not req.shadow and not 0 <= req.rank < n:
        raise ProtocolError(f"step {req.step}: rank {req.rank} is not among the {n} ranks")
    if len(req.all_nodes) != len(req.node_owner) or not 1 <= len(req.all_nodes) <= m:
        raise ProtocolError(f"step {req.step}: {len(req.all_nodes)} subtrees and {len(req.node_owner)} owners "
                            f"for {m} microbatches")
    top = root(m).level
    nodes = [node_of(x) for x in req.all_nodes]
    if any(not (0 <= x.level <= top and 0 <= x.index < m >> x.level) for x in nodes):
        raise ProtocolError(f"step {req.step}: a subtree lies outside microbatches 0..{m - 1}")
    covered = 0
    for x in sorted(nodes, key=lambda x: x.start):
        if x.start != covered:
            raise ProtocolError(f"step {req.step}: the subtrees do not cut microbatches 0..{m - 1} into pieces")
        covered += x.size
    if covered != m:
        raise ProtocolError(f"step {req.step}: the subtrees cover {covered} of {m} microbatches")
    if any(not 0 <= o < n for o in req.node_owner) or set(req.node_owner) != set(range(n)):
        raise ProtocolError(f"step {req.step}: every one of the {n} ranks must own a subtree, and only they")
    mine = sorted(x for x, o in zip(nodes, req.node_owner) if o == req.rank)
    if not req.shadow and sorted(node_of(x) for x in req.nodes) != mine:
        raise ProtocolError(f"step {req.step}: the subtrees of rank {req.rank} are not its share of all_nodes")


def checked_programs(request: pb.LoadRequest) -> dict[str, bytes]:
    """``{name: bytes}`` of the programs a ``Load`` carries, each checked against its ``sha256`` first (a corrupted
    program must not reach the deserializer): :class:`ProtocolError` naming the one that does not match."""
    by_name = {}
    for p in request.programs:
        if p.sha256 and hashlib.sha256(p.serialized).hexdigest() != p.sha256:
            raise ProtocolError(f"program {p.name!r}: its bytes do not match their sha256 (corrupted on the way)")
        by_name[p.name] = p.serialized
    return by_name


def decode_programs(request: pb.LoadRequest) -> tuple[StagePrograms, list]:
    """The stage's programs a ``Load`` carries (an unpipelined run's one stage, or one stage of a pipeline when
    its layout names a stage) and the ``[(shape, dtype)]`` of the state, checked before any compile.

    Raises :class:`ProtocolError` naming what does not fit: a program whose
    bytes do not match its ``sha256`` (checked first: a corrupted program
    must not reach the deserializer), that does not parse, or that does not
    agree with the layout; a layout that does not parse or asks for more
    devices than this host has.
    """
    by_name = checked_programs(request)
    try:
        programs = StagePrograms.from_parts(by_name, request.layout)
    except Exception as e:  # noqa: BLE001 - JSON, unknown keys, missing programs: a malformed message
        raise ProtocolError(f"the program set does not parse: {type(e).__name__}: {e}") from None
    parsed = {}
    for name, blob in programs.programs().items():
        try:
            exp = jax.export.deserialize(bytearray(blob))
            parsed[name] = (exp, exp.in_avals, exp.out_avals, exp.nr_devices, tuple(exp.platforms))
            exp.mlir_module()
        except Exception as e:  # noqa: BLE001 - the serialization format raises many kinds
            raise ProtocolError(f"program {name!r} does not parse: {type(e).__name__}: {e}") from None
    # First, as it says the most: programs for a GPU on a worker without one would otherwise fail on the
    # device count (a worker whose JAX fell back to the CPU has one CPU device).
    local = local_platform()
    for name, (*_, platforms) in parsed.items():
        check_runnable(platforms, local, f"the {name!r} program")
    _check_layout(programs)
    exported = {}
    for name, (exp, avals, out_avals, devices, _) in parsed.items():
        if devices != programs.devices_per_slice:
            raise ProtocolError(f"program {name!r} is for {devices} devices, the layout says "
                                f"{programs.devices_per_slice}")
        specs = programs.in_specs[name]
        if len(specs) != len(avals) or any(d is not None and not 0 <= d < len(a.shape) for d, a in zip(specs, avals)):
            raise ProtocolError(f"program {name!r}: the layout's input placements {specs} do not fit its "
                                f"{len(avals)} inputs")
        exported[name] = (avals, out_avals)
    name = programs.grad_program
    grad_out = exported[name][1]
    if (len(grad_out) < 1 or (not programs.pipelined and len(grad_out) != 1)
            or tuple(grad_out[0].shape) != (programs.grad_size + 1,)):
        raise ProtocolError(f"the {name} program does not return float32[{programs.grad_size + 1}] "
                            "(the gradient, then the loss)")
    return programs, [(tuple(a.shape), np.dtype(a.dtype)) for a in exported["apply"][0][:-1]]


def _check_layout(programs: StagePrograms) -> None:
    def count(x, lo, hi):
        return type(x) is int and lo <= x <= hi

    if not count(programs.devices_per_slice, 1, len(jax.devices())):
        raise ProtocolError(f"the layout asks for {programs.devices_per_slice!r} devices; this worker has "
                            f"{len(jax.devices())}")
    m = programs.num_microbatches
    if not (count(m, 1, _MAX_MICROBATCHES) and is_power_of_two(m)):
        raise ProtocolError(f"the layout's microbatch count {m!r} is not a power of two <= {_MAX_MICROBATCHES}")
    if not count(programs.grad_size, 1, 1 << 40):
        raise ProtocolError(f"the layout's gradient size {programs.grad_size!r} is not a positive count")
    specs, names = programs.in_specs, sorted(programs.programs())
    if (not isinstance(specs, dict) or any(not isinstance(specs.get(k), list) for k in names)
            or any(d is not None and type(d) is not int for k in names for d in specs[k])):
        raise ProtocolError("the layout's input placements are not lists of dimensions (or null) per program")


def unpickle_source(blob: bytes):
    """The data source of a ``Load``; :class:`ProtocolError` when it does not unpickle here."""
    try:
        return pickle.loads(blob)
    except Exception as e:  # noqa: BLE001 - truncated bytes, a module missing on this host, ...
        raise ProtocolError(f"the data source does not unpickle on this worker: {type(e).__name__}: {e}") from None


def for_host(request, host: int):
    """A step or a state pull as host ``host`` of a slice reads it: every peer's address (a slice's addresses,
    :mod:`runtime.core.hosts`) narrowed to that peer's host ``host``, in place; the request itself is answered.
    A one-host slice's addresses are left as they are."""
    try:
        if isinstance(request, pb.PullStateRequest):
            request.source_address = host_address(request.source_address, host)
            request.source_data_address = host_address(request.source_data_address, host)
            return request
        for p in _peers(request):
            if "," in p.address or "," in p.data_address:
                p.address, p.data_address = host_address(p.address, host), host_address(p.data_address, host)
    except ValueError as e:
        raise ProtocolError(f"this worker is host {host} of its slice: {e}") from None
    return request


def _peers(request: pb.StepRequest) -> list:
    """Every peer a step names: its ranks, the shadows, the snapshot's peer and a pipeline stage's neighbours."""
    peers = [*request.peers, *request.shadows]
    if request.HasField("snapshot_peer"):
        peers.append(request.snapshot_peer)
    if request.HasField("pipeline"):
        peers += [request.pipeline.prev, request.pipeline.next]
    return peers
