"""Where a worker's received pieces of the all-reduce wait for the step that needs them.

The receiving half of :mod:`runtime.worker.collective`: a transport (the data plane
or gRPC ``Push``) hands each incoming stream to :meth:`Mailbox.receive`,
which checks every chunk (fence, sender, subtree, bounds, xxh3_64) and
assembles the pieces, in place when the step asked for that
(:meth:`Mailbox.deliver_into`); :meth:`Mailbox.wait` gives the step thread
the pieces of every sender it needs, or raises when the deadline passes or a
newer membership epoch aborts the step. Bounded: pieces of at most the
program's size, subtrees of the step's tree, a cap on what is held.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping

import numpy as np

from runtime._proto import elastic_pb2 as pb
from runtime.wire.parts import ALL_GATHER, PIPELINE, REDUCE_SCATTER, checksum, host_buffer, payload_of, phase_name
from runtime.core.errors import ProtocolError, StepAbortedError
from runtime.core.microbatch import Node

__all__ = ["Mailbox"]


def _fits(node: Node, phase: int, top: Node) -> bool:
    """Whether a piece for ``node`` belongs in ``phase`` of a step over the microbatch tree ``top``: the whole
    tree in the all-gather, any subtree in the reduce-scatter, its own microbatch in a pipeline transfer."""
    if phase >= PIPELINE:
        return node == Node(0, (phase - PIPELINE) // 2) and node.index < top.size
    return node == top or (phase == REDUCE_SCATTER and 0 <= node.level < top.level
                           and 0 <= node.index < 1 << (top.level - node.level))


class Mailbox:
    """Where a worker's Push handler drops complete pieces for the step thread.

    Keyed by ``(epoch, step, phase)``, then sender rank, then subtree, so a
    step re-run in a new epoch never sees pieces of its aborted attempt.
    Thread-safe.

    Bounded once the worker knows its programs (:meth:`limit`): a piece of
    more elements than a gradient, a subtree outside the microbatch tree (or
    other than the whole tree in the all-gather), a stream of more subtrees
    than there are microbatches, or a deposit that would hold more than
    ``max_buffered`` elements in all is refused with :class:`ProtocolError`,
    so a faulty peer cannot make the worker allocate without bound.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._box: dict[tuple[int, int, int], dict[int, dict[Node, np.ndarray]]] = {}
        self._held = 0   # elements in _box
        self._into: dict[tuple[tuple[int, int, int], int], np.ndarray] = {}   # (key, sender) -> where its piece goes
        self.epoch = 0
        self.max_piece = 1 << 34
        self.top: Node | None = None
        self.max_buffered: int | None = None

    def limit(self, max_piece: int, top: Node, max_buffered: int) -> None:
        """Bounds what :meth:`receive` accepts (called by the worker's ``Load``): pieces of at most
        ``max_piece`` elements, subtrees of ``top``, ``max_buffered`` elements held in all."""
        self.max_piece, self.top, self.max_buffered = max_piece, top, max_buffered

    def deliver_into(self, epoch: int, step: int, phase: int, buffers: Mapping[int, np.ndarray]) -> None:
        """Asks that the next piece each sender sends for ``(epoch, step, phase)`` be assembled in place,
        in ``buffers[sender]`` (a float32 view of the caller's result), instead of a new buffer.

        Used once per sender: a second stream from it gets a buffer of its own.
        A piece that arrived before this call, or of another size, is
        delivered as usual; :meth:`wait` returns whichever the piece is in.
        """
        with self._cond:
            for src, buf in buffers.items():
                self._into[((epoch, step, phase), src)] = buf

    def _buffer(self, key, src: int, size: int) -> np.ndarray:
        with self._cond:
            buf = self._into.pop((key, src), None)
        return buf if buf is not None and buf.size == size else host_buffer(size)

    def receive(self, chunks: Iterator[pb.TensorChunk], check_fence, admit=None) -> None:
        """Assembles one Push stream; deposits it when the stream ends cleanly.

        ``check_fence(fence)`` runs on every chunk, ``admit(step, phase,
        src_rank)`` once on the first (both raise to refuse the stream).
        """
        bufs: dict[Node, np.ndarray] = {}
        filled: dict[Node, int] = {}
        key = src = None
        for c in chunks:
            check_fence(c.fence)
            if key is None:
                key, src = (c.fence.epoch, c.step, c.phase), c.src_rank
                if c.phase < 0 or c.src_rank < 0:
                    raise ProtocolError(f"chunk of phase {c.phase} from rank {c.src_rank}: no such phase or rank")
                if admit is not None:
                    admit(c.step, c.phase, c.src_rank)
            elif (c.fence.epoch, c.step, c.phase) != key or c.src_rank != src:
                raise ProtocolError("one Push stream mixed steps, phases or senders")
            nbytes, fill = payload_of(c)
            if nbytes % 4:
                raise ProtocolError(f"chunk of {nbytes} bytes is not whole float32s")
            node = Node(c.node.level, c.node.index)
            buf = bufs.get(node)
            if buf is None:
                if not 0 <= c.total <= self.max_piece:
                    raise ProtocolError(f"implausible piece size {c.total} (at most {self.max_piece} elements)")
                top = self.top
                if top is not None and not _fits(node, c.phase, top):
                    raise ProtocolError(f"piece for subtree {node}: not a subtree of {top} in phase {c.phase}")
                buf = bufs[node] = (self._buffer(key, src, c.total) if c.phase == ALL_GATHER
                                     else np.empty(c.total, dtype=np.float32))
                filled[node] = 0
            n = nbytes // 4
            if c.total != buf.size or c.offset < 0 or c.offset + n > buf.size:
                raise ProtocolError(f"chunk [{c.offset}, {c.offset + n}) outside a piece of {buf.size}")
            dest = buf[c.offset:c.offset + n].view(np.uint8)
            fill(dest)   # into the piece itself; a bad checksum drops the whole stream, never deposited
            if checksum(dest) != c.xxh3:
                raise ProtocolError(f"checksum mismatch in step {c.step} from rank {c.src_rank}")
            filled[node] += n
        for node, buf in bufs.items():
            if filled[node] != buf.size:
                raise ProtocolError(f"piece {node} from rank {src} incomplete ({filled[node]}/{buf.size})")
        if key is None:
            return
        size = sum(b.size for b in bufs.values())
        with self._cond:
            if key[0] < self.epoch:
                return
            old = self._box.get(key, {}).get(src)
            held = self._held + size - (sum(b.size for b in old.values()) if old else 0)
            if self.max_buffered is not None and held > self.max_buffered:
                raise ProtocolError(f"mailbox full: {held} elements would be held, at most {self.max_buffered}")
            self._box.setdefault(key, {})[src] = bufs
            self._held = held
            self._cond.notify_all()

    def _drop(self, key) -> dict[int, dict[Node, np.ndarray]]:
        """With ``_cond`` held: removes one key's pieces (and where they were to go)."""
        for k in [k for k in self._into if k[0] == key]:
            del self._into[k]
        got = self._box.pop(key, {})
        self._held -= sum(b.size for nodes in got.values() for b in nodes.values())
        return got

    def set_epoch(self, epoch: int) -> None:
        """A new membership epoch: waiters of older epochs abort, their pieces go."""
        with self._cond:
            self.epoch = max(self.epoch, epoch)
            for key in {k for k in self._box if k[0] < self.epoch} | {k for k, _ in self._into if k[0] < self.epoch}:
                self._drop(key)
            self._cond.notify_all()

    def restart(self, epoch: int) -> None:
        """A new client generation took over (no step runs): every piece goes, epochs count from ``epoch``."""
        with self._cond:
            for key in set(self._box) | {k for k, _ in self._into}:
                self._drop(key)
            self.epoch = epoch
            self._cond.notify_all()

    def discard_before(self, step: int) -> None:
        """Drops pieces of steps before ``step`` (they can no longer be used: the worker moved past them)."""
        with self._cond:
            for key in {k for k in self._box if k[1] < step} | {k for k, _ in self._into if k[1] < step}:
                self._drop(key)

    def wait(self, epoch: int, step: int, phase: int, senders: set[int],
             deadline: float) -> dict[int, dict[Node, np.ndarray]]:
        """Blocks until every rank in ``senders`` delivered; pops and returns their pieces.

        Raises :class:`StepAbortedError` at the deadline, or as soon as a newer
        epoch than ``epoch`` is set (the step was aborted).
        """
        key = (epoch, step, phase)
        with self._cond:
            while True:
                if self.epoch > epoch:
                    raise StepAbortedError(step, f"aborted: membership moved to epoch {self.epoch}")
                got = self._box.get(key, {})
                if senders <= got.keys():
                    self._drop(key)
                    return {r: got[r] for r in senders}
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(senders - got.keys())
                    raise StepAbortedError(step, f"no {phase_name(phase)} data from ranks {missing} before "
                                                 "the deadline")
                self._cond.wait(left)
