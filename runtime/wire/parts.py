"""What travels between workers: one message at a time, checked.

A stream is a sequence of :class:`Part` (a protobuf header and a payload
that stays a view of the sender's buffer until a transport writes it);
:func:`pieces` cuts a float32 vector into checksummed parts of at most a
chunk size, :func:`payload_of` gives a received chunk's payload whichever
transport brought it, :func:`checksum` is the per-chunk xxh3_64 check and
:func:`host_buffer` the aligned host memory a program can adopt without a
copy. Used by the all-reduce (:mod:`runtime.worker.collective`), its receiving
side (:mod:`runtime.worker.mailbox`), state copies (:mod:`runtime.state.state_copy`) and
the transports (:mod:`runtime.wire.dataplane`, gRPC). Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
import xxhash

from runtime._proto import elastic_pb2 as pb
from runtime.core.errors import ProtocolError
from runtime.core.microbatch import Node

__all__ = ["ALL_GATHER", "DEFAULT_CHUNK_BYTES", "HOST_ALIGNMENT", "MAX_CHUNK_BYTES", "MAX_STEPS_AHEAD",
           "MIN_CHUNK_BYTES", "PIPELINE", "REDUCE_SCATTER", "Part", "Send", "checked_chunk_bytes", "checksum",
           "chunk_bounds", "host_buffer", "inline", "payload_of", "phase_name", "pieces", "pipeline_phase"]

REDUCE_SCATTER, ALL_GATHER = 0, 1
PIPELINE = 2   # phases from here on: a pipeline stage's activations (even) or their gradient (odd), per microbatch


def pipeline_phase(grad: bool, microbatch: int) -> int:
    """The phase a pipeline transfer travels under: one per microbatch and direction, so each is its own piece."""
    return PIPELINE + 2 * microbatch + int(grad)


def phase_name(phase: int) -> str:
    if phase < PIPELINE:
        return ("reduce-scatter", "all-gather")[phase]
    m, grad = divmod(phase - PIPELINE, 2)
    return f"{'gradient of the activations' if grad else 'activations'} of microbatch {m}"

DEFAULT_CHUNK_BYTES = 4 << 20
MIN_CHUNK_BYTES = 4 << 10    # smaller chunks only multiply per-message overhead
MAX_CHUNK_BYTES = 32 << 20   # half of rpc.MAX_MESSAGE: a chunk and its header always fit in one message
#: How far ahead of a worker a ``Step`` (or a peer's ``Push``) may be; further is refused.
MAX_STEPS_AHEAD = 16



@dataclasses.dataclass(frozen=True)
class Part:
    """One message on its way out: a header (``TensorChunk`` or ``StateChunk``, ``xxh3`` set, ``data``
    empty) and its payload, a view of the sender's buffer (nothing is copied until a transport writes it)."""

    header: pb.TensorChunk | pb.StateChunk
    payload: memoryview


def inline(parts: Iterator[Part]) -> Iterator[pb.TensorChunk | pb.StateChunk]:
    """Whole protobuf messages, the payload copied into ``data``: what the gRPC transport sends."""
    for part in parts:
        part.header.data = bytes(part.payload)
        yield part.header


def payload_of(chunk) -> tuple[int, Callable[[np.ndarray], None]]:
    """``(bytes, fill)`` of a received chunk: ``fill(dest)`` writes its payload into the uint8 array ``dest``.

    A protobuf message carries its payload in ``data`` (gRPC); a data-plane
    chunk (:class:`runtime.wire.dataplane_wire.Incoming`) still has it on the socket
    and reads it straight into ``dest``.
    """
    fill = getattr(chunk, "fill", None)
    if fill is not None:
        return chunk.nbytes, fill
    data = chunk.data

    def copy(dest: np.ndarray) -> None:
        dest[:] = np.frombuffer(data, dtype=np.uint8)
    return len(data), copy


Send = Callable[[object, Iterator[Part], float], None]
"""``send(peer, parts, deadline)``: streams ``parts`` to ``peer`` (whatever the
transport needs to reach it) and returns once it accepted them all; blocks at
most until the ``time.monotonic()`` deadline; raises :class:`StepAbortedError`
on failure."""


HOST_ALIGNMENT = 64   # bytes: what XLA's CPU client needs to adopt a host buffer as is


def host_buffer(size: int, dtype=np.float32) -> np.ndarray:
    """An uninitialized array of ``size`` elements whose data starts on a :data:`HOST_ALIGNMENT` boundary.

    ``jax.device_put`` of such an array to a CPU device adopts its memory
    instead of copying it (a misaligned 41 MB vector costs a ~45 ms copy
    here; numpy itself only aligns to 16 bytes). Used for what the runtime
    hands to a program: the reduced gradient, a state received from a peer.
    The array must not be written once a program was given it.
    """
    dtype = np.dtype(dtype)
    raw = np.empty(size * dtype.itemsize + HOST_ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % HOST_ALIGNMENT
    return raw[start:start + size * dtype.itemsize].view(dtype)


def checksum(buf) -> int:
    """The per-chunk check of every transfer: xxh3_64 of ``buf``'s bytes (about 10 GB/s, 4x ``zlib.crc32``).

    It guards against corruption on the way, not against a forger: peers
    are authenticated by the run secret (or mutual TLS) when they connect.
    """
    return xxhash.xxh3_64_intdigest(buf)


def checked_chunk_bytes(requested: int) -> int:
    """The chunk size to stream with: ``requested`` bytes, or the default for 0.

    Called by the worker's ``Load``. Raises :class:`ProtocolError` (the
    caller sees INVALID_ARGUMENT) naming ``chunk_bytes`` when it is negative
    or outside ``[MIN_CHUNK_BYTES, MAX_CHUNK_BYTES]``.
    """
    if requested == 0:
        return DEFAULT_CHUNK_BYTES
    if not MIN_CHUNK_BYTES <= requested <= MAX_CHUNK_BYTES:
        raise ProtocolError(f"chunk_bytes={requested} is out of range: use 0 for the default "
                            f"({DEFAULT_CHUNK_BYTES} bytes) or a value in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
    return requested


def chunk_bounds(size: int, ranks: int) -> list[tuple[int, int]]:
    """Contiguous, balanced ``[lo, hi)`` element ranges, one per rank."""
    base, extra = divmod(size, ranks)
    out, lo = [], 0
    for r in range(ranks):
        hi = lo + base + (1 if r < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def pieces(fence: pb.Fence, step: int, phase: int, src_rank: int, node: Node, data: np.ndarray,
           chunk_bytes: int) -> Iterator[Part]:
    """Cuts one float32 piece into checksummed parts of at most ``chunk_bytes`` (views of ``data``)."""
    raw = memoryview(np.ascontiguousarray(data, dtype="<f4").view(np.uint8).reshape(-1))
    per = max(4, chunk_bytes - chunk_bytes % 4)
    total = data.size
    for off in range(0, max(len(raw), 1), per):
        blob = raw[off:off + per]
        yield Part(pb.TensorChunk(fence=fence, step=step, phase=phase, src_rank=src_rank,
                                  node=pb.Node(level=node.level, index=node.index), total=total,
                                  offset=off // 4, xxh3=checksum(blob)), blob)
