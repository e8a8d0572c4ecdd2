"""Deterministic cross-slice reduction, peer to peer over message streams.

Reduce-scatter then all-gather of the flat gradient (:class:`AllReduce`):

1. The flat vector of P elements is cut into one contiguous chunk per rank.
2. Every rank streams, to each chunk owner, its subtree partials restricted to
   that chunk (:func:`pieces`).
3. The owner combines every partial of its chunk in canonical tree order
   (:func:`runtime.core.microbatch.tree_reduce`), so the bits depend only on the
   microbatch ids, not on who combines or how many ranks there are.
4. Every owner streams its reduced chunk to every other rank, and to every
   shadow (a spare that only receives the reduced vector and applies it, so
   it holds the state without computing a gradient: :meth:`AllReduce.receive`).

Small vectors (at most :data:`ONE_ROUND_BYTES` of partials in all) take one
round instead: every rank sends its partials whole to every other rank and
sums all of them in the same canonical order (:class:`AllReduce`).

The transport is an argument: a blocking ``send(address, parts, deadline)``
and the :class:`runtime.worker.mailbox.Mailbox` the receiving side drops complete
streams into. The worker wires its data plane (:mod:`runtime.wire.dataplane`) or
gRPC (``Push``) to both; tests wire them in memory. What travels is a stream
of :class:`Part`: a protobuf header and a payload that stays a view of the
sender's buffer until the transport writes it (:func:`runtime.wire.parts.inline` copies it into
the message's ``data`` for gRPC).

Messages are checked: fence, sender, expected subtrees, sizes and an xxh3_64 checksum per
chunk. A bad message raises :class:`ProtocolError` where it is received; a
missing one raises :class:`StepAbortedError` when the deadline passes; a
well-formed piece of the wrong shape raises :class:`StepAbortedError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import TYPE_CHECKING

import numpy as np

from runtime._proto import elastic_pb2 as pb
from runtime.core.errors import StepAbortedError
from runtime.core.microbatch import Node, tree_reduce
from runtime.wire.parts import ALL_GATHER, REDUCE_SCATTER, Send, chunk_bounds, host_buffer, pieces
from runtime.core.timing import Clock

if TYPE_CHECKING:
    from runtime.worker.mailbox import Mailbox

__all__ = ["AllReduce", "ONE_ROUND_BYTES"]

#: At most this many bytes of partials in a step (all ranks' together), the all-reduce is one round (AllReduce).
ONE_ROUND_BYTES = 1 << 20
# How long a rank waits, before it answers its step, for its reduced chunk to reach the shadows (their failures
# are still ignored): a step committed on the ranks' answers is then on every live shadow, even when the ranks
# die right after; a stalled shadow holds the step up this long at most (then it falls behind).
SHADOW_HANDOFF_SECONDS = 1.0


def _handed(handoff: list, deadline: float) -> None:
    """Waits (at most :data:`SHADOW_HANDOFF_SECONDS`, and not past ``deadline``) for the pushes to shadows."""
    if handoff:
        futures.wait(handoff, timeout=max(0.0, min(SHADOW_HANDOFF_SECONDS, deadline - time.monotonic())))


def _quietly(send, *args) -> None:
    """A push whose failure is nobody's business (to a shadow: it falls behind and is caught up later)."""
    try:
        send(*args)
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def _nothing() -> None:
    return None


class AllReduce:
    """One worker's side of the reduce-scatter + all-gather, over a transport it is given.

    Built once per worker with the transport: ``send`` (a blocking push to a
    peer) and the ``mailbox`` its own receiving side fills. Called by the
    worker's step thread, one step at a time. Pushes to the peers overlap on a
    small thread pool of blocking calls: a future per call inside the
    transport (gRPC futures) cost about 5 ms a step.

    When all partials of a step (every rank's together) come to at most
    ``one_round_bytes``, the reduction takes one round of messages instead
    of two: every rank sends its partials whole to every other rank, and
    every rank sums all of them in the canonical order. Small vectors cost
    their messages' latency, not their bytes (the tiny model at 4 x 2 sends
    87 KB instead of 43 KB per peer, and waits for its peers once).

    To abort a step from another thread, the owner sets a newer epoch on the
    mailbox (its waits raise at once) and makes pushes in flight fail (the
    worker closes their channels); :meth:`run` then raises
    :class:`StepAbortedError`.
    """

    def __init__(self, send: Send, mailbox: Mailbox, add: Callable[[np.ndarray, np.ndarray], np.ndarray],
                 max_pushes: int = 16, one_round_bytes: int = ONE_ROUND_BYTES):
        """``add`` is the one float32 addition every rank uses (:func:`runtime.worker.executor.add_f32`);
        ``one_round_bytes``: see the class docstring (every rank of a step must be given the same)."""
        self.mailbox = mailbox
        self.one_round_bytes = one_round_bytes
        self._send = send
        self._add = add
        self._pool = futures.ThreadPoolExecutor(max_workers=max_pushes, thread_name_prefix="push")
        # Pushes to shadows on threads of their own: a stalled shadow never holds up a push to a peer.
        self._shadow_pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="shadow-push")

    def receive(self, *, fence: pb.Fence, step: int, ranks: int, size: int, deadline: float,
                clock: Clock | None = None) -> np.ndarray:
        """A shadow's side of a step: the full reduced vector (``size`` float32), as the ``ranks`` ranks'
        all-gather sends it, bit for bit what each rank assembles.

        Raises :class:`StepAbortedError` when a chunk is missing at
        ``deadline`` (a rank died mid-step: the shadow falls behind) or
        malformed, or the mailbox moved past ``fence.epoch``.
        """
        clock = clock if clock is not None else Clock()
        bounds = chunk_bounds(size, ranks)
        out = host_buffer(size)
        self.mailbox.deliver_into(fence.epoch, step, ALL_GATHER, {r: out[lo:hi] for r, (lo, hi) in enumerate(bounds)})
        gathered = self.mailbox.wait(fence.epoch, step, ALL_GATHER, set(range(ranks)), deadline)
        clock.lap("wait_for_peers")
        for r, nodes in gathered.items():
            lo, hi = bounds[r]
            vec = next(iter(nodes.values()), None) if len(nodes) == 1 else None
            if vec is None or vec.size != hi - lo:
                raise StepAbortedError(step, f"rank {r} sent a malformed all-gather chunk to the shadow")
            if vec.base is not out:
                out[lo:hi] = vec
        clock.lap("gather_copy")
        return out

    def close(self) -> None:
        """Stops the push threads once the pushes in flight returned."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._shadow_pool.shutdown(wait=False, cancel_futures=True)

    def run(self, partials: Mapping[Node, np.ndarray], *, fence: pb.Fence, step: int, rank: int,
            peers: Mapping[int, str], owners: Mapping[Node, int], top: Node, chunk_bytes: int,
            deadline: float, between_phases: Callable[[], None] = _nothing,
            clock: Clock | None = None, shadows: Sequence = ()) -> tuple[np.ndarray, int]:
        """Returns (the canonical tree sum over ``top`` of every rank's partials, bytes this rank sent).

        ``partials``: this rank's subtree sums, equal-length float32 vectors.
        ``peers``: rank -> address for every rank of the step (0..n-1, this one
        included); ``owners``: every subtree of the step -> the rank that
        contributes it. ``between_phases`` runs after this rank's chunk is
        reduced and before the all-gather (chaos: a kill mid-reduction).

        Raises :class:`StepAbortedError` when a peer's data is missing at
        ``deadline``, has the wrong subtrees or sizes, a push fails, or the
        mailbox moved past ``fence.epoch`` (abort). The result is bit-identical
        to ``tree_reduce`` of all partials in one place, whatever ``n``.

        ``shadows``: addresses that also get this rank's reduced chunk in the
        all-gather. Their failures are ignored: a shadow that misses a piece
        falls behind, it never fails the step; before returning the rank waits
        up to :data:`SHADOW_HANDOFF_SECONDS` for those pushes (so a step the
        ranks answered is on every live shadow even if the ranks die at once).

        ``clock`` gets ``wait_for_peers`` (their pieces not here yet),
        ``reduce_add`` (the canonical sums), ``send`` (our pushes still in
        flight once we are done) and ``gather_copy`` (the result assembled).
        """
        clock = clock if clock is not None else Clock()
        n = len(peers)
        if n == 1:
            alone = tree_reduce(partials, top, self._add)
            clock.lap("reduce_add")
            handoff = [self._shadow_pool.submit(_quietly, self._send, address,   # the whole vector is our chunk
                                                pieces(fence, step, ALL_GATHER, rank, top, alone, chunk_bytes),
                                                deadline) for address in shadows]
            _handed(handoff, deadline)
            return alone, 4 * alone.size * len(shadows)
        size = next(iter(partials.values())).size
        bounds = chunk_bounds(size, n)
        others = [(r, address) for r, address in peers.items() if r != rank]
        senders = {r for r, _ in others}
        expected = {r: {node for node, o in owners.items() if o == r} for r in range(n)}
        if 4 * size * len(owners) <= self.one_round_bytes:
            return self._one_round(partials, size, fence, step, rank, others, senders, expected, top, bounds,
                                   chunk_bytes, deadline, between_phases, clock, shadows)
        # The all-gather lands in the result itself (registered now: a fast peer's chunk may come early).
        out = host_buffer(size)   # aligned: the apply program takes it without a copy
        self.mailbox.deliver_into(fence.epoch, step, ALL_GATHER, {r: out[bounds[r][0]:bounds[r][1]] for r in senders})

        def stream(phase, to_rank, items):
            lo, hi = bounds[to_rank]
            for node, vec in items:
                yield from pieces(fence, step, phase, rank, node, vec[lo:hi] if phase == REDUCE_SCATTER else vec,
                                  chunk_bytes)

        # Reduce-scatter: every peer gets our partials cut to its chunk; we get theirs for ours.
        sent = 0
        sends = []
        for r, address in others:
            lo, hi = bounds[r]
            sent += 4 * (hi - lo) * len(partials)
            sends.append(self._pool.submit(self._send, address, stream(REDUCE_SCATTER, r, partials.items()),
                                           deadline))
        clock.lap("send")
        lo, hi = bounds[rank]
        reduced = self._sum_received({node: vec[lo:hi] for node, vec in partials.items()}, fence, step, senders,
                                     expected, hi - lo, f"for a chunk of {hi - lo}", top, sends, deadline,
                                     between_phases, clock)

        # All-gather: our reduced chunk to every peer and shadow; theirs into the full vector.
        handoff = []
        for address in shadows:   # first, so a shadow is served as early as a peer; waited for only at the end
            sent += 4 * reduced.size
            handoff.append(self._shadow_pool.submit(_quietly, self._send, address,
                                                    stream(ALL_GATHER, rank, [(top, reduced)]), deadline))
        sends = []
        for r, address in others:
            sent += 4 * reduced.size
            sends.append(self._pool.submit(self._send, address, stream(ALL_GATHER, r, [(top, reduced)]), deadline))
        clock.lap("send")
        gathered = self.mailbox.wait(fence.epoch, step, ALL_GATHER, senders, deadline)
        clock.lap("wait_for_peers")
        out[lo:hi] = reduced
        for r, nodes in gathered.items():
            rlo, rhi = bounds[r]
            vec = nodes.get(top)
            if vec is None or vec.size != rhi - rlo:
                raise StepAbortedError(step, f"rank {r} sent a malformed all-gather chunk")
            if vec.base is not out:   # it came before deliver_into (or in a second stream): copy it in
                out[rlo:rhi] = vec
        clock.lap("gather_copy")
        for f in sends:
            f.result()
        _handed(handoff, deadline)
        clock.lap("send")
        return out, sent

    def _sum_received(self, own, fence, step, senders, expected, size, what, top, sends, deadline, between_phases,
                      clock) -> np.ndarray:
        """The canonical sum of ``own`` and the reduce-scatter pieces of every rank in ``senders`` (each must
        send its ``expected`` subtrees, of ``size`` elements: ``what`` says of what, for the error), once this
        rank's own pushes (``sends``) are out; then runs ``between_phases``."""
        got = self.mailbox.wait(fence.epoch, step, REDUCE_SCATTER, senders, deadline)
        clock.lap("wait_for_peers")
        every = dict(own)
        for r, nodes in got.items():
            if set(nodes) != expected[r]:
                raise StepAbortedError(step, f"rank {r} sent subtrees {sorted(nodes)}, expected {sorted(expected[r])}")
            for node, vec in nodes.items():
                if vec.size != size:
                    raise StepAbortedError(step, f"rank {r} sent {vec.size} elements {what}")
            every.update(nodes)
        reduced = tree_reduce(every, top, self._add)
        clock.lap("reduce_add")
        for f in sends:
            f.result()
        clock.lap("send")
        between_phases()
        return reduced

    def _one_round(self, partials, size, fence, step, rank, others, senders, expected, top, bounds, chunk_bytes,
                   deadline, between_phases, clock, shadows) -> tuple[np.ndarray, int]:
        """:meth:`run` for small vectors (see the class docstring): every rank sends its whole partials to every
        other rank (in the reduce-scatter phase) and every rank sums all of them in the canonical order, so
        one round of messages instead of two. The same bits: the canonical sum of each element does not
        depend on which rank computes it. Shadows get this rank's chunk of the result, as after the
        all-gather."""
        sent = 4 * size * len(partials) * len(others)
        sends = [self._pool.submit(self._send, address, (part for node, vec in partials.items() for part in
                                                         pieces(fence, step, REDUCE_SCATTER, rank, node, vec,
                                                                chunk_bytes)), deadline)
                 for _, address in others]
        clock.lap("send")
        reduced = self._sum_received(partials, fence, step, senders, expected, size,
                                     f"of a vector of {size}", top, sends, deadline, between_phases, clock)
        lo, hi = bounds[rank]
        handoff = []
        for address in shadows:   # as in the all-gather
            sent += 4 * (hi - lo)
            handoff.append(self._shadow_pool.submit(_quietly, self._send, address,
                                                    pieces(fence, step, ALL_GATHER, rank, top, reduced[lo:hi],
                                                           chunk_bytes), deadline))
        _handed(handoff, deadline)
        return reduced, sent

