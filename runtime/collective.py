"""Deterministic cross-slice reduction, peer to peer over gRPC streams.

Reduce-scatter then all-gather of the flat gradient:

1. The flat vector of P elements is cut into one contiguous chunk per rank.
2. Every rank streams, to each chunk owner, its subtree partials restricted to
   that chunk (:func:`pieces`).
3. The owner combines every partial of its chunk in canonical tree order
   (:func:`runtime.microbatch.tree_reduce`), so the bits depend only on the
   microbatch ids, not on who combines or how many ranks there are.
4. Every owner streams its reduced chunk to every other rank.

Messages are checked: fence, sender, expected subtrees, sizes and a CRC32 per
chunk. A bad message raises :class:`ProtocolError`; a missing one raises
:class:`StepAbortedError` when the deadline passes.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Iterator

import numpy as np

from runtime._proto import elastic_pb2 as pb
from runtime.errors import ProtocolError, StepAbortedError
from runtime.microbatch import Node

__all__ = ["Mailbox", "chunk_bounds", "pieces", "REDUCE_SCATTER", "ALL_GATHER"]

REDUCE_SCATTER, ALL_GATHER = 0, 1


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
           chunk_bytes: int) -> Iterator[pb.TensorChunk]:
    """Cuts one float32 piece into checksummed messages of at most ``chunk_bytes``."""
    raw = np.ascontiguousarray(data, dtype="<f4").view(np.uint8).reshape(-1)
    per = max(4, chunk_bytes - chunk_bytes % 4)
    total = data.size
    for off in range(0, max(len(raw), 1), per):
        blob = raw[off:off + per].tobytes()
        yield pb.TensorChunk(fence=fence, step=step, phase=phase, src_rank=src_rank,
                             node=pb.Node(level=node.level, index=node.index), total=total,
                             offset=off // 4, data=blob, crc32=zlib.crc32(blob))


class Mailbox:
    """Where a worker's Push handler drops complete pieces for the step thread.

    Keyed by ``(step, phase)``, then sender rank, then subtree. Thread-safe.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._box: dict[tuple[int, int], dict[int, dict[Node, np.ndarray]]] = {}

    def receive(self, chunks: Iterator[pb.TensorChunk], check_fence) -> None:
        """Assembles one Push stream; deposits it when the stream ends cleanly."""
        bufs: dict[Node, np.ndarray] = {}
        filled: dict[Node, int] = {}
        key = src = None
        for c in chunks:
            check_fence(c.fence)
            if key is None:
                key, src = (c.step, c.phase), c.src_rank
            elif (c.step, c.phase) != key or c.src_rank != src:
                raise ProtocolError("one Push stream mixed steps, phases or senders")
            if zlib.crc32(c.data) != c.crc32:
                raise ProtocolError(f"checksum mismatch in step {c.step} from rank {c.src_rank}")
            if len(c.data) % 4:
                raise ProtocolError(f"chunk of {len(c.data)} bytes is not whole float32s")
            node = Node(c.node.level, c.node.index)
            buf = bufs.get(node)
            if buf is None:
                if not 0 <= c.total <= 1 << 34:
                    raise ProtocolError(f"implausible piece size {c.total}")
                buf = bufs[node] = np.empty(c.total, dtype=np.float32)
                filled[node] = 0
            n = len(c.data) // 4
            if c.total != buf.size or c.offset < 0 or c.offset + n > buf.size:
                raise ProtocolError(f"chunk [{c.offset}, {c.offset + n}) outside a piece of {buf.size}")
            buf[c.offset:c.offset + n] = np.frombuffer(c.data, dtype="<f4")
            filled[node] += n
        for node, buf in bufs.items():
            if filled[node] != buf.size:
                raise ProtocolError(f"piece {node} from rank {src} incomplete ({filled[node]}/{buf.size})")
        if key is None:
            return
        with self._cond:
            self._box.setdefault(key, {})[src] = bufs
            self._cond.notify_all()

    def wait(self, step: int, phase: int, senders: set[int], deadline: float) -> dict[int, dict[Node, np.ndarray]]:
        """Blocks until every rank in ``senders`` delivered; pops and returns their pieces."""
        key = (step, phase)
        with self._cond:
            while True:
                got = self._box.get(key, {})
                if senders <= got.keys():
                    self._box.pop(key, None)
                    return {r: got[r] for r in senders}
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(senders - got.keys())
                    raise StepAbortedError(step, f"no {('reduce-scatter', 'all-gather')[phase]} data "
                                                 f"from ranks {missing} before the deadline")
                self._cond.wait(left)

    def drop_before(self, step: int) -> None:
        """Forgets pieces of steps older than ``step`` (after an abort)."""
        with self._cond:
            for key in [k for k in self._box if k[0] < step]:
                del self._box[key]
