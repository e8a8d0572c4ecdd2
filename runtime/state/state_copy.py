"""A whole replica's state between workers: its digest, cut into checked chunks, and assembled again.

A spare or a relaunched worker takes its state from a live replica
(``PullState``): the source cuts its leaves into :class:`runtime.wire.parts.Part`
s (views, each with its xxh3_64 checksum and the state's digest), any
transport carries them (the data plane or gRPC ``GetState``), and the
receiver checks and assembles them into aligned leaves it can place on its
devices without a copy, hashing them as they arrive. On one host the reader
copies the leaves out of the source's memory instead (:func:`shared_state`
names where they lie, :func:`copy_shared_state` copies and checks them:
one copy, made by the kernel, hashed as it lands). :func:`state_digest` is
also the digest replicas compare, the report records, and checkpoints and
snapshots record.

A digest names its algorithm (``"xxh3_128:<32 hex digits>"``), so a record
written with another one (``"sha256:<64 hex digits>"``: checkpoints and
snapshots of format 1) is still verified with the algorithm it was made
with. The digest guards against corruption and divergence, not against a
forger: peers are authenticated by the run secret or mutual TLS, and a
writer of the checkpoint directory could rewrite a sha256 as easily as the
leaves (docs/performance.md, "The state digest").
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Iterator
from concurrent import futures

import numpy as np
import xxhash

from runtime._proto import elastic_pb2 as pb
from runtime.wire.cross_memory import fresh_buffer, read_into
from runtime.wire.parts import HOST_ALIGNMENT, Part, checksum, host_buffer, payload_of
from runtime.core.errors import ProtocolError

__all__ = ["DIGEST", "DIGEST_ALGORITHMS", "assemble_state", "copy_shared_state", "digest_algorithm", "landing",
           "shared_state", "slice_digest", "state_chunks", "state_digest"]

#: The algorithm of the state digest: what replicas compare, a transfer checks, the report records, and new
#: checkpoints and snapshots record. xxh3_128 hashes faster than memcpy copies, on one core (5-7x sha256 here).
DIGEST = "xxh3_128"
#: Every algorithm a digest may name, with its hasher and its hex digest's length: the current one, and
#: sha256 (the digest before, which checkpoints and snapshots of record format 1 hold).
DIGEST_ALGORITHMS = {"xxh3_128": (xxhash.xxh3_128, 32), "sha256": (hashlib.sha256, 64)}


def state_digest(leaves, algorithm: str = DIGEST) -> str:
    """``"<algorithm>:<hex>"`` of state leaves as host arrays: each leaf's ``(shape, dtype.str)`` then its bytes,
    in order (the same on every replica, whichever device layout it has).

    :meth:`runtime.worker.executor.SliceExecutor.state_digest` is this function of
    its state's leaves, so a replica's digest and a copy's agree. ``algorithm``:
    one of :data:`DIGEST_ALGORITHMS` (another: ValueError); ``"sha256"`` gives
    the digest of format-1 records (their bare hex digits, prefixed).
    """
    h = _hasher(algorithm)
    for leaf in leaves:
        arr = np.asarray(leaf)
        h.update(_layout_text(arr.shape, arr.dtype))
        h.update(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))   # no copy; any dtype
    return f"{algorithm}:{h.hexdigest()}"


def slice_digest(digests: list[str]) -> str:
    """A slice's state digest from its hosts' (:func:`state_digest` each, in host order; see
    :mod:`runtime.core.hosts`): a one-host slice's is its host's, else the hosts' algorithm over them; "" when a
    host holds no state."""
    if len(digests) == 1:
        return digests[0]
    if not digests or not all(digests):
        return ""
    algorithm = digest_algorithm(digests[0])
    h = _hasher(algorithm)
    h.update("\n".join(digests).encode())
    return f"{algorithm}:{h.hexdigest()}"


def digest_algorithm(digest: str) -> str:
    """The algorithm ``digest`` (a :func:`state_digest` value) was made with; ValueError, naming what is wrong,
    when it is not ``"<algorithm>:<hex>"`` of a known algorithm with its number of lowercase hex digits."""
    algorithm, _, hexdigits = digest.partition(":") if isinstance(digest, str) else ("", "", "")
    if algorithm not in DIGEST_ALGORITHMS:
        raise ValueError(f"a state digest is '<algorithm>:<hex digits>' with an algorithm of "
                         f"{sorted(DIGEST_ALGORITHMS)}, got {digest!r}")
    width = DIGEST_ALGORITHMS[algorithm][1]
    if not re.fullmatch(f"[0-9a-f]{{{width}}}", hexdigits):
        raise ValueError(f"a {algorithm} state digest has {width} lowercase hex digits, got {digest!r}")
    return algorithm


def _hasher(algorithm: str):
    try:
        return DIGEST_ALGORITHMS[algorithm][0]()
    except KeyError:
        raise ValueError(f"unknown state digest algorithm {algorithm!r} (known: {sorted(DIGEST_ALGORITHMS)})") from None


def _layout_text(shape, dtype) -> bytes:
    """What :func:`state_digest` hashes before a leaf's bytes."""
    return str((tuple(shape), np.dtype(dtype).str)).encode()


def state_chunks(leaves: list[np.ndarray], applied_steps: int, chunk_bytes: int,
                 digest: str = "") -> Iterator[Part]:
    """Cuts state leaves into checksummed parts (views of the leaves) for a peer-to-peer transfer.

    ``digest``: :func:`state_digest` of ``leaves``, sent along in every chunk
    so the receiver can check what it assembled before adopting it.
    """
    for i, leaf in enumerate(leaves):
        raw = memoryview(np.ascontiguousarray(leaf).view(np.uint8).reshape(-1))
        for off in range(0, max(len(raw), 1), chunk_bytes):
            blob = raw[off:off + chunk_bytes]
            yield Part(pb.StateChunk(leaf=i, num_leaves=len(leaves), shape=leaf.shape, dtype=leaf.dtype.str,
                                     total_bytes=leaf.nbytes, offset=off, xxh3=checksum(blob),
                                     applied_steps=applied_steps, digest=digest), blob)


_PLAIN_KINDS = "biufcV"   # raw bytes may be viewed as these (never as Python objects)


def _leaf_layout(leaf: int, shape, dtype_str: str, nbytes: int, expect) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype announced for state leaf ``leaf`` (of ``nbytes``), checked; ``ProtocolError`` if not
    plausible.

    With ``expect``, the announced layout must be the expected one, and the
    expected dtype is used (``dtype.str`` does not name extension types
    such as bfloat16, which travel as ``<V2``).
    """
    shape = tuple(int(n) for n in shape)
    if expect is not None:
        want_shape, want_dtype = tuple(expect[leaf][0]), np.dtype(expect[leaf][1])
        if (shape, dtype_str) != (want_shape, want_dtype.str):
            raise ProtocolError(f"state leaf {leaf}: got {list(shape)} {dtype_str}, this worker's programs expect "
                                f"{list(want_shape)} {want_dtype.str}")
        dtype = want_dtype
    else:
        try:
            dtype = np.dtype(dtype_str)
        except (TypeError, ValueError):
            raise ProtocolError(f"state leaf {leaf}: {dtype_str!r} is not a dtype") from None
        if dtype.kind not in _PLAIN_KINDS or dtype.itemsize == 0 or any(n < 0 for n in shape):
            raise ProtocolError(f"state leaf {leaf}: shape {list(shape)} x {dtype} is not a plain array")
    if math.prod(shape) * dtype.itemsize != nbytes:
        raise ProtocolError(f"state leaf {leaf}: shape {list(shape)} x {dtype} is not {nbytes} bytes")
    return shape, dtype


def _placement(sizes) -> tuple[list[int], int]:
    """Where leaves of ``sizes`` bytes lie in one buffer (each on a :data:`HOST_ALIGNMENT` boundary), and its size."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // HOST_ALIGNMENT) * HOST_ALIGNMENT
    return offsets, end


def _sizes(layout) -> list[int]:
    """The bytes of each leaf of ``layout`` (``[(shape, dtype)]``)."""
    return [math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in layout]


def landing(layout) -> np.ndarray:
    """Host memory a copy of a state of ``layout`` (``[(shape, dtype)]``) lands in, every page faulted in now.

    A spare makes it when it loads, off any recovery's path: on a VM here
    the faults of a fresh 123 MB buffer cost about as much as the copy into
    it. :func:`assemble_state` and :func:`copy_shared_state` use it when given
    one of the right size; the leaves they return are views of it.
    """
    _, end = _placement(_sizes(layout))
    memory = fresh_buffer(end)
    memory[::4096] = 0   # one write per page (per huge page, where the kernel gave those) faults it in
    return memory


def _landing_or_fresh(landing_memory, end: int) -> np.ndarray:
    if landing_memory is not None and landing_memory.nbytes == end:
        return landing_memory
    return fresh_buffer(end)


def assemble_state(chunks: Iterator[pb.StateChunk], expect=None, algorithm: str = DIGEST,
                   landing_memory: np.ndarray | None = None) -> tuple[list[np.ndarray], int, str]:
    """Rebuilds the leaves of :func:`state_chunks`: ``(leaves, applied steps, their digest)``.

    ``ProtocolError`` on any inconsistency. ``expect``: ``[(shape, dtype)]``
    of every leaf; when given, a stream of another layout is refused before
    anything is allocated. When the stream carries the source's ``digest``,
    it must be one of ``algorithm`` (:func:`state_digest`'s; a stream that
    announces another is refused at its first chunk) and the assembled leaves
    must hash to it. The leaves are hashed once, here, as they arrive:
    callers compare with the digest returned. ``landing_memory`` (with
    ``expect``): :func:`landing` memory for that layout, which the leaves
    are then views of.
    """
    bufs: dict[int, np.ndarray] = {}
    meta: dict[int, tuple] = {}
    filled: dict[int, int] = {}
    num = applied = claimed = None
    # Hashed as it arrives while chunks come in order (state_chunks sends them so), on a thread of its
    # own (xxhash and hashlib let go of the GIL): one chunk's hash overlaps the reading of the next instead of
    # following the whole stream. Out of order, the leaves are hashed at the end.
    h, at = _hasher(algorithm), (0, 0)   # the next (leaf, byte offset) in order; None once out of order
    placed = None
    if landing_memory is not None and expect is not None:
        offsets, end = _placement(_sizes(expect))
        if landing_memory.nbytes == end:
            placed = offsets
    hashing = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-hash")
    try:
        for c in chunks:
            if num is None:
                num, applied, claimed = c.num_leaves, c.applied_steps, c.digest
                if claimed:
                    _check_claim(claimed, algorithm)
                if expect is not None and num != len(expect):
                    raise ProtocolError(f"state of {num} leaves, this worker's programs expect {len(expect)}")
            elif (c.num_leaves, c.applied_steps, c.digest) != (num, applied, claimed):
                raise ProtocolError("state stream changed leaf count, step or digest midway")
            if not 0 <= c.leaf < num:
                raise ProtocolError(f"state leaf {c.leaf} out of range [0, {num})")
            if c.leaf not in bufs:
                meta[c.leaf] = _leaf_layout(c.leaf, c.shape, c.dtype, c.total_bytes, expect)
                bufs[c.leaf] = (host_buffer(c.total_bytes, np.uint8) if placed is None   # aligned: placed on the
                                else landing_memory[placed[c.leaf]:placed[c.leaf] + c.total_bytes])   # devices as is
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
    digest = f"{algorithm}:{h.hexdigest()}" if at == (num, 0) else state_digest(leaves, algorithm)
    if claimed and digest != claimed:
        raise ProtocolError("the state received does not hash to what its source announced")
    return leaves, applied, digest


def _check_claim(claimed: str, algorithm: str) -> None:
    """A stream's announced digest must be a digest of ``algorithm``; ``ProtocolError`` saying why not."""
    try:
        announced = digest_algorithm(claimed)
    except ValueError as e:
        raise ProtocolError(f"the state stream announces a malformed digest: {e}") from None
    if announced != algorithm:
        raise ProtocolError(f"the state stream announces a {announced} digest; this worker checks {algorithm}")


def shared_state(leaves: list[np.ndarray], applied_steps: int, digest: str) -> pb.SharedState:
    """Source side of a same-host copy: where each of ``leaves`` (C-contiguous host arrays) lies in this process.

    The caller keeps ``leaves`` alive, unchanged, until the reader is done.
    """
    out = pb.SharedState(applied_steps=applied_steps, digest=digest)
    for leaf in leaves:
        if not leaf.flags.c_contiguous:
            raise ValueError("a shared state leaf must be C-contiguous")
        out.leaves.add(shape=leaf.shape, dtype=leaf.dtype.str, address=leaf.ctypes.data, nbytes=leaf.nbytes)
    return out


#: A same-host copy goes in system calls of at most this many bytes: each one's hash overlaps the next's copy.
SHARED_PIECE_BYTES = 8 << 20
_MAX_IOV = 512   # pieces per call (the kernel takes up to 1024)
#: Threads copying a same-host state (each call's copy is the kernel's, the GIL let go): with the hash of what
#: they copied running meanwhile on the caller's thread.
SHARED_COPY_THREADS = max(1, min(4, os.cpu_count() or 1))


def copy_shared_state(state: pb.SharedState, pid: int, expect=None, algorithm: str = DIGEST,
                      midway=lambda: None, landing_memory: np.ndarray | None = None
                      ) -> tuple[list[np.ndarray], int, str]:
    """Reader side of a same-host copy: the leaves ``state`` names, copied out of process ``pid`` into new aligned
    memory (placed on the devices without a copy), checked as :func:`assemble_state` checks a stream
    (``expect``, the announced digest, which they must hash to): ``(leaves, applied steps, digest)``.

    One copy, by the kernel (:func:`runtime.wire.cross_memory.read_into`), in
    system calls of at most :data:`SHARED_PIECE_BYTES` on
    :data:`SHARED_COPY_THREADS` threads, each piece hashed on the caller's
    thread, in order, while later ones are copied. ``midway()`` is called
    after the first piece
    (chaos). Raises ``ProtocolError`` for a state that does not check,
    :class:`runtime.wire.cross_memory.CrossMemoryUnavailable` when this host
    forbids the read, ``OSError`` when the source went away.
    """
    num = len(state.leaves)
    if not num:
        raise ProtocolError("a shared state of no leaves")
    if expect is not None and num != len(expect):
        raise ProtocolError(f"state of {num} leaves, this worker's programs expect {len(expect)}")
    if state.digest:
        _check_claim(state.digest, algorithm)
    meta = [_leaf_layout(i, x.shape, x.dtype, x.nbytes, expect) for i, x in enumerate(state.leaves)]
    offsets, end = _placement(x.nbytes for x in state.leaves)
    memory = _landing_or_fresh(landing_memory, end)
    # The pieces in state order, then the calls that copy them: consecutive pieces up to SHARED_PIECE_BYTES.
    calls, batch, size = [], [], 0
    for i, x in enumerate(state.leaves):
        for off in range(0, max(x.nbytes, 1), SHARED_PIECE_BYTES):
            n = min(SHARED_PIECE_BYTES, x.nbytes - off)
            if batch and (size + n > SHARED_PIECE_BYTES or len(batch) == _MAX_IOV):
                calls.append(batch)
                batch, size = [], 0
            batch.append((i, off, memory[offsets[i] + off:offsets[i] + off + n]))
            size += n
    calls.append(batch)
    h = _hasher(algorithm)
    copying = futures.ThreadPoolExecutor(max_workers=SHARED_COPY_THREADS, thread_name_prefix="state-copy")
    copied = []
    try:
        copied = [copying.submit(read_into, pid, [(dest, state.leaves[i].address + off) for i, off, dest in call
                                                  if dest.nbytes]) for call in calls]
        for k, (call, done) in enumerate(zip(calls, copied)):
            done.result()
            for i, off, dest in call:
                if off == 0:
                    h.update(_layout_text(*meta[i]))
                h.update(dest)
            if k == 0:
                midway()
    finally:
        for done in copied:
            done.cancel()
        copying.shutdown(wait=True)
    digest = f"{algorithm}:{h.hexdigest()}"
    if state.digest and digest != state.digest:
        raise ProtocolError("the state copied does not hash to what its source announced")
    leaves = [memory[o:o + x.nbytes].view(dtype).reshape(shape)
              for o, x, (shape, dtype) in zip(offsets, state.leaves, meta)]
    return leaves, state.applied_steps, digest
