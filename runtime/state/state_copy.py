"""A whole replica's state between workers: its digest, cut into checked chunks, and assembled again.

A spare or a relaunched worker takes its state from a live replica
(``PullState``): the source cuts its leaves into :class:`runtime.wire.parts.Part`
s (views, each with its xxh3_64 checksum and the state's sha256), any
transport carries them (the data plane or gRPC ``GetState``), and the
receiver checks and assembles them into aligned leaves it can place on its
devices without a copy. :func:`state_sha256` is also the digest replicas
compare, and checkpoints and snapshots record.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from concurrent import futures

import numpy as np

from runtime._proto import elastic_pb2 as pb
from runtime.wire.parts import Part, checksum, host_buffer, payload_of
from runtime.core.errors import ProtocolError

__all__ = ["assemble_state", "state_chunks", "state_sha256"]


def state_sha256(leaves) -> str:
    """Hash of state leaves as host arrays: each leaf's ``(shape, dtype.str)`` then its bytes, in order.

    :meth:`runtime.worker.executor.SliceExecutor.state_sha256` is this function of
    its state's leaves, so a replica's hash and a copy's agree.
    """
    h = hashlib.sha256()
    for leaf in leaves:
        arr = np.asarray(leaf)
        h.update(_layout_text(arr.shape, arr.dtype))
        h.update(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))   # no copy; any dtype
    return h.hexdigest()


def _layout_text(shape, dtype) -> bytes:
    """What :func:`state_sha256` hashes before a leaf's bytes."""
    return str((tuple(shape), np.dtype(dtype).str)).encode()


def state_chunks(leaves: list[np.ndarray], applied_steps: int, chunk_bytes: int,
                 sha256: str = "") -> Iterator[Part]:
    """Cuts state leaves into checksummed parts (views of the leaves) for a peer-to-peer transfer.

    ``sha256``: :func:`state_sha256` of ``leaves``, sent along in every chunk
    so the receiver can check what it assembled before adopting it.
    """
    for i, leaf in enumerate(leaves):
        raw = memoryview(np.ascontiguousarray(leaf).view(np.uint8).reshape(-1))
        for off in range(0, max(len(raw), 1), chunk_bytes):
            blob = raw[off:off + chunk_bytes]
            yield Part(pb.StateChunk(leaf=i, num_leaves=len(leaves), shape=leaf.shape, dtype=leaf.dtype.str,
                                     total_bytes=leaf.nbytes, offset=off, xxh3=checksum(blob),
                                     applied_steps=applied_steps, sha256=sha256), blob)


_PLAIN_KINDS = "biufcV"   # raw bytes may be viewed as these (never as Python objects)


def _leaf_layout(c: pb.StateChunk, expect) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype a state chunk announces for its leaf, checked; ``ProtocolError`` if not plausible.

    With ``expect``, the announced layout must be the expected one, and the
    expected dtype is used (``dtype.str`` does not name extension types
    such as bfloat16, which travel as ``<V2``).
    """
    shape = tuple(int(n) for n in c.shape)
    if expect is not None:
        want_shape, want_dtype = tuple(expect[c.leaf][0]), np.dtype(expect[c.leaf][1])
        if (shape, c.dtype) != (want_shape, want_dtype.str):
            raise ProtocolError(f"state leaf {c.leaf}: got {list(shape)} {c.dtype}, this worker's programs expect "
                                f"{list(want_shape)} {want_dtype.str}")
        dtype = want_dtype
    else:
        try:
            dtype = np.dtype(c.dtype)
        except (TypeError, ValueError):
            raise ProtocolError(f"state leaf {c.leaf}: {c.dtype!r} is not a dtype") from None
        if dtype.kind not in _PLAIN_KINDS or dtype.itemsize == 0 or any(n < 0 for n in shape):
            raise ProtocolError(f"state leaf {c.leaf}: shape {list(shape)} x {dtype} is not a plain array")
    if math.prod(shape) * dtype.itemsize != c.total_bytes:
        raise ProtocolError(f"state leaf {c.leaf}: shape {list(shape)} x {dtype} is not {c.total_bytes} bytes")
    return shape, dtype


def assemble_state(chunks: Iterator[pb.StateChunk], expect=None) -> tuple[list[np.ndarray], int, str]:
    """Rebuilds the leaves of :func:`state_chunks`: ``(leaves, applied steps, their sha256)``.

    ``ProtocolError`` on any inconsistency. ``expect``: ``[(shape, dtype)]``
    of every leaf; when given, a stream of another layout is refused before
    anything is allocated. When the stream carries the source's ``sha256``,
    the assembled leaves must hash to it. The leaves are hashed once, here:
    callers compare with the digest returned.
    """
    bufs: dict[int, np.ndarray] = {}
    meta: dict[int, tuple] = {}
    filled: dict[int, int] = {}
    num = applied = claimed = None
    # Hashed as it arrives while chunks come in order (state_chunks sends them so), on a thread of its
    # own (hashlib lets go of the GIL): one chunk's hash overlaps the reading of the next instead of
    # following the whole stream. Out of order, the leaves are hashed at the end.
    h, at = hashlib.sha256(), (0, 0)   # the next (leaf, byte offset) in order; None once out of order
    hashing = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-hash")
    try:
        for c in chunks:
            if num is None:
                num, applied, claimed = c.num_leaves, c.applied_steps, c.sha256
                if expect is not None and num != len(expect):
                    raise ProtocolError(f"state of {num} leaves, this worker's programs expect {len(expect)}")
            elif (c.num_leaves, c.applied_steps, c.sha256) != (num, applied, claimed):
                raise ProtocolError("state stream changed leaf count, step or hash midway")
            if not 0 <= c.leaf < num:
                raise ProtocolError(f"state leaf {c.leaf} out of range [0, {num})")
            if c.leaf not in bufs:
                meta[c.leaf] = _leaf_layout(c, expect)
                bufs[c.leaf] = host_buffer(c.total_bytes, np.uint8)   # aligned: placed on the devices without a copy
                filled[c.leaf] = 0
            buf = bufs[c.leaf]
            nbytes, fill = payload_of(c)
            if c.offset < 0 or c.offset + nbytes > buf.size:
                raise ProtocolError(f"state leaf {c.leaf}: chunk outside its {buf.size} bytes")
            dest = buf[c.offset:c.offset + nbytes]
            fill(dest)
            if checksum(dest) != c.xxh3:
                raise ProtocolError(f"checksum mismatch in state leaf {c.leaf}")
            filled[c.leaf] += nbytes
            if at == (c.leaf, c.offset):
                if c.offset == 0:
                    hashing.submit(h.update, _layout_text(*meta[c.leaf]))
                hashing.submit(h.update, dest)
                at = (c.leaf, c.offset + nbytes) if c.offset + nbytes < buf.size else (c.leaf + 1, 0)
            else:
                at = None
    finally:
        hashing.shutdown(wait=True)   # every update ran, in order, before h is read (or the stream failed)
    if num is None or len(bufs) != num or any(filled[i] != bufs[i].size for i in bufs):
        raise ProtocolError("state stream ended before every leaf arrived")
    leaves = [bufs[i].view(meta[i][1]).reshape(meta[i][0]) for i in range(num)]
    digest = h.hexdigest() if at == (num, 0) else state_sha256(leaves)
    if claimed and digest != claimed:
        raise ProtocolError("the state received does not hash to what its source announced")
    return leaves, applied, digest
