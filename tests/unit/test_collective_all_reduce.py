"""The all-reduce of runtime.worker.collective, several ranks in threads over an in-memory transport."""

import threading
import time

import numpy as np
import pytest

from runtime._proto import elastic_pb2 as pb
from runtime.worker.collective import ONE_ROUND_BYTES, AllReduce
from runtime.wire.parts import (DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, checked_chunk_bytes, checksum,
                           chunk_bounds, inline)
from runtime.core.errors import ProtocolError, StepAbortedError
from runtime.worker.executor import add_f32
from runtime.worker.mailbox import Mailbox
from runtime.core.microbatch import Node, assign_microbatches, root, tree_reduce

FENCE = pb.Fence(run_id="r", epoch=1)
SIZE = 1001   # not a multiple of any rank count: uneven chunks


def leaves(num_microbatches, seed=0):
    """One gradient-like vector per microbatch, magnitudes spread so the order of additions shows in the bits."""
    rng = np.random.default_rng(seed)
    return {mb: (rng.standard_normal(SIZE) * 10.0 ** rng.uniform(-4, 4, SIZE)).astype(np.float32)
            for mb in range(num_microbatches)}


def canonical(values):
    """``runtime.core.microbatch.tree_reduce`` of every microbatch in one place: the bits to match."""
    return tree_reduce({Node(0, mb): v for mb, v in values.items()}, root(len(values)), add_f32)


def partials_by_rank(values, num_ranks):
    """What each rank's executor computes: the canonical sum of each of its subtrees."""
    by_id = {Node(0, mb): v for mb, v in values.items()}
    return [{node: tree_reduce(by_id, node, add_f32) for node in nodes}
            for nodes in assign_microbatches(len(values), num_ranks)]


class Loopback:
    """In-memory transport: a send delivers the stream into the receiving rank's mailbox.

    Like a ``Push`` over gRPC, a stream the receiver refuses fails the send
    (StepAbortedError); the receiver's error is kept in ``refused``.
    ``tamper(src, address, messages)`` may rewrite a stream on its way.
    """

    def __init__(self, num_ranks, tamper=None):
        self.boxes = {f"rank{r}": Mailbox() for r in range(num_ranks)}
        self.tamper = tamper
        self.refused = []

    def sender(self, src):
        def send(address, messages, deadline):
            messages = list(inline(messages))   # as the gRPC transport sends them
            if self.tamper is not None:
                messages = self.tamper(src, address, messages)
            try:
                self.boxes[address].receive(iter(messages), lambda fence: None)
            except ProtocolError as e:
                self.refused.append(e)
                raise StepAbortedError(-1, f"push to {address} refused: {e}") from e
        return send


def run_ranks(parts, *, chunk_bytes=DEFAULT_CHUNK_BYTES, deadline_s=30.0, tamper=None, num_microbatches=8,
              one_round=False):
    """Runs every rank's AllReduce in its own thread; returns (per-rank result or error, transport, hook calls).

    ``one_round``: the one-round reduction of small vectors, else the reduce-scatter and all-gather."""
    n = len(parts)
    net = Loopback(n, tamper)
    peers = {r: f"rank{r}" for r in range(n)}
    owners = {node: r for r, p in enumerate(parts) for node in p}
    deadline = time.monotonic() + deadline_s
    results, hooks = [None] * n, [0] * n
    collectives = [AllReduce(net.sender(r), net.boxes[f"rank{r}"], add_f32, one_round_bytes=1 << 30 if one_round else 0)
                   for r in range(n)]

    def rank(r):
        def hook():
            hooks[r] += 1
        try:
            results[r] = collectives[r].run(parts[r], fence=FENCE, step=7, rank=r, peers=peers, owners=owners,
                                            top=root(num_microbatches), chunk_bytes=chunk_bytes, deadline=deadline,
                                            between_phases=hook)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline_s + 10)
        assert not t.is_alive(), "a rank did not return by its deadline"
    for c in collectives:
        c.close()
    return results, net, hooks


@pytest.mark.parametrize("one_round", [False, True], ids=["two-rounds", "one-round"])
@pytest.mark.parametrize("chunk_bytes", [DEFAULT_CHUNK_BYTES, 64])
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_every_rank_gets_the_canonical_tree_sum_bit_for_bit(num_ranks, chunk_bytes, one_round):
    values = leaves(8)
    expected = canonical(values)
    left_to_right = values[0]
    for mb in range(1, 8):
        left_to_right = add_f32(left_to_right, values[mb])
    assert not np.array_equal(left_to_right, expected), "the data must make the order of additions visible"

    results, net, hooks = run_ranks(partials_by_rank(values, num_ranks), chunk_bytes=chunk_bytes,
                                    one_round=one_round)

    bounds = chunk_bounds(SIZE, num_ranks)
    for r, result in enumerate(results):
        assert not isinstance(result, Exception), result
        total, sent = result
        assert total.dtype == np.float32 and total.tobytes() == expected.tobytes()
        own = bounds[r][1] - bounds[r][0]
        subtrees = len(partials_by_rank(values, num_ranks)[r])
        if one_round and num_ranks > 1:   # every partial whole to every peer
            assert sent == 4 * SIZE * subtrees * (num_ranks - 1)
            continue
        scattered = sum(4 * (hi - lo) for o, (lo, hi) in enumerate(bounds) if o != r)
        assert sent == scattered * subtrees + 4 * own * (num_ranks - 1)
    assert hooks == [1 if num_ranks > 1 else 0] * num_ranks
    assert net.refused == []


def test_sixteen_microbatches_on_three_ranks_match_too():
    values = leaves(16, seed=1)
    parts = partials_by_rank(values, 3)
    expected = canonical(values)
    results, _, _ = run_ranks(parts, chunk_bytes=4096, num_microbatches=16)
    assert [r[0].tobytes() for r in results] == [expected.tobytes()] * 3


def _drop_last_message(src, address, messages):
    return messages[:-1] if src == 1 and address == "rank0" else messages


def test_a_short_stream_is_refused_by_the_receiver_and_both_ranks_abort():
    """A stream that ends before its piece is complete: ProtocolError where it lands, StepAbortedError for the step."""
    results, net, _ = run_ranks(partials_by_rank(leaves(8), 2), chunk_bytes=64, deadline_s=1.0)
    assert net.refused == [] and not any(isinstance(r, Exception) for r in results)   # control: untampered
    results, net, _ = run_ranks(partials_by_rank(leaves(8), 2), chunk_bytes=64, deadline_s=1.0,
                                tamper=_drop_last_message)
    assert len(net.refused) == 1 and isinstance(net.refused[0], ProtocolError)
    assert "incomplete" in str(net.refused[0])
    assert isinstance(results[0], StepAbortedError) and "no reduce-scatter data from ranks [1]" in str(results[0])
    assert isinstance(results[1], StepAbortedError) and "refused" in str(results[1])


def _reseal(message, data, total):
    message.data, message.total, message.xxh3 = data, total, checksum(data)
    return message


def _one_element_short(src, address, messages):
    """Well-formed (checksummed, complete) pieces, one element shorter than the chunk they are for."""
    if src != 1 or address != "rank0":
        return messages
    return [_reseal(m, m.data[:-4], m.total - 1) if m.phase == 0 else m for m in messages]


def _wrong_subtree(src, address, messages):
    if src == 1 and address == "rank0":
        for m in messages:
            m.node.index += 1
    return messages


@pytest.mark.parametrize("tamper, error, one_round", [(_one_element_short, "elements for a chunk of", False),
                                                      (_one_element_short, "elements of a vector of", True),
                                                      (_wrong_subtree, "sent subtrees", False),
                                                      (_wrong_subtree, "sent subtrees", True)])
def test_a_piece_of_the_wrong_shape_aborts_the_step_that_receives_it(tamper, error, one_round):
    results, net, _ = run_ranks(partials_by_rank(leaves(8), 2), deadline_s=1.0, tamper=tamper, one_round=one_round)
    assert net.refused == []   # the messages themselves are well-formed
    assert isinstance(results[0], StepAbortedError) and error in str(results[0])
    assert "rank 1" in str(results[0])


def test_a_missing_peer_aborts_the_step_at_its_deadline():
    parts = partials_by_rank(leaves(8), 2)
    box = Mailbox()
    collective = AllReduce(lambda address, messages, deadline: list(messages), box, add_f32)
    try:
        with pytest.raises(StepAbortedError, match=r"no reduce-scatter data from ranks \[1\]"):
            collective.run(parts[0], fence=FENCE, step=3, rank=0, peers={0: "me", 1: "gone"},
                           owners={node: r for r, p in enumerate(parts) for node in p}, top=root(8),
                           chunk_bytes=DEFAULT_CHUNK_BYTES, deadline=time.monotonic() + 0.3)
    finally:
        collective.close()


def test_a_newer_epoch_on_the_mailbox_aborts_a_waiting_step_at_once():
    parts = partials_by_rank(leaves(8), 2)
    box = Mailbox()
    collective = AllReduce(lambda address, messages, deadline: list(messages), box, add_f32)
    timer = threading.Timer(0.2, box.set_epoch, args=(2,))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(StepAbortedError, match="membership moved to epoch 2"):
            collective.run(parts[0], fence=FENCE, step=3, rank=0, peers={0: "me", 1: "peer"},
                           owners={node: r for r, p in enumerate(parts) for node in p}, top=root(8),
                           chunk_bytes=DEFAULT_CHUNK_BYTES, deadline=time.monotonic() + 30)
    finally:
        timer.cancel()
        collective.close()
    assert time.monotonic() - t0 < 10   # woken by the abort, not by the deadline


def test_a_failed_push_fails_the_step_with_its_error():
    parts = partials_by_rank(leaves(8), 2)
    owners = {node: r for r, p in enumerate(parts) for node in p}
    box = Mailbox()

    def unreachable(address, messages, deadline):
        raise StepAbortedError(-1, f"push to {address} failed: UNAVAILABLE")

    # The peer's pieces are already here, so only the push can fail the step.
    peer = AllReduce(lambda address, parts, deadline: box.receive(inline(parts), lambda fence: None), Mailbox(),
                     add_f32)
    threading.Thread(target=lambda: _swallow(peer.run, parts[1], fence=FENCE, step=3, rank=1,
                                             peers={0: "me", 1: "peer"}, owners=owners, top=root(8),
                                             chunk_bytes=DEFAULT_CHUNK_BYTES, deadline=time.monotonic() + 1),
                     daemon=True).start()
    collective = AllReduce(unreachable, box, add_f32)
    try:
        with pytest.raises(StepAbortedError, match="UNAVAILABLE"):
            collective.run(parts[0], fence=FENCE, step=3, rank=0, peers={0: "me", 1: "peer"}, owners=owners,
                           top=root(8), chunk_bytes=DEFAULT_CHUNK_BYTES, deadline=time.monotonic() + 30)
    finally:
        collective.close()
        peer.close()


def _swallow(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except StepAbortedError:
        pass


@pytest.mark.parametrize("requested, used", [(0, DEFAULT_CHUNK_BYTES), (MIN_CHUNK_BYTES, MIN_CHUNK_BYTES),
                                             (1 << 20, 1 << 20), (MAX_CHUNK_BYTES, MAX_CHUNK_BYTES)])
def test_chunk_bytes_zero_means_the_default(requested, used):
    assert checked_chunk_bytes(requested) == used


@pytest.mark.parametrize("requested", [-1, -(4 << 20), 1, MIN_CHUNK_BYTES - 1, MAX_CHUNK_BYTES + 1])
def test_chunk_bytes_out_of_range_is_a_protocol_error_naming_it(requested):
    with pytest.raises(ProtocolError, match=f"chunk_bytes={requested}"):
        checked_chunk_bytes(requested)


@pytest.mark.parametrize("one_round_bytes", [0, ONE_ROUND_BYTES], ids=["two-rounds", "one-round"])
@pytest.mark.parametrize("num_ranks", [1, 2, 3])
def test_a_shadow_receives_the_reduced_vector_bit_for_bit_without_slowing_the_ranks(num_ranks, one_round_bytes):
    """The ranks also push their reduced chunks to a shadow (not waited for); the shadow assembles exactly
    what each rank has. A shadow that is gone makes no rank fail: its pushes fail quietly."""
    values = leaves(8)
    parts = partials_by_rank(values, num_ranks)
    net = Loopback(num_ranks)
    net.boxes["shadow"] = Mailbox()
    peers = {r: f"rank{r}" for r in range(num_ranks)}
    owners = {node: r for r, p in enumerate(parts) for node in p}
    deadline = time.monotonic() + 30
    collectives = [AllReduce(net.sender(r), net.boxes[f"rank{r}"], add_f32, one_round_bytes=one_round_bytes)
                   for r in range(num_ranks)]
    shadow = AllReduce(net.sender(-1), net.boxes["shadow"], add_f32)
    results = [None] * num_ranks

    def rank(r):
        results[r] = collectives[r].run(parts[r], fence=FENCE, step=7, rank=r, peers=peers, owners=owners,
                                        top=root(8), chunk_bytes=64, deadline=deadline,
                                        shadows=["shadow", "gone"])   # "gone": no such mailbox

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(num_ranks)]
    for t in threads:
        t.start()
    got = shadow.receive(fence=FENCE, step=7, ranks=num_ranks, size=SIZE, deadline=deadline)
    for t in threads:
        t.join(30)
    assert got.tobytes() == canonical(values).tobytes()
    assert all(total.tobytes() == got.tobytes() for total, _ in results)
    with pytest.raises(StepAbortedError, match="no all-gather data"):   # a step whose ranks never ran
        shadow.receive(fence=FENCE, step=8, ranks=num_ranks, size=SIZE, deadline=time.monotonic() + 0.2)
    for c in (*collectives, shadow):
        c.close()
