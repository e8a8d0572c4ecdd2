import numpy as np
import pytest

from runtime._proto import elastic_pb2 as pb
from runtime.wire.parts import REDUCE_SCATTER, chunk_bounds, inline, pieces
from runtime.worker.mailbox import Mailbox
from runtime.core.errors import ProtocolError, StepAbortedError
from runtime.core.microbatch import Node

FENCE = pb.Fence(run_id="r", epoch=1)


def ok(fence):
    return None


def test_chunk_bounds_cover_and_balance():
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_pieces_round_trip_through_the_mailbox_in_small_chunks():
    data = np.arange(1000, dtype=np.float32) / 7
    msgs = list(inline(pieces(FENCE, 3, REDUCE_SCATTER, 1, Node(1, 0), data, chunk_bytes=1024)))
    assert len(msgs) == 4
    box = Mailbox()
    box.receive(iter(msgs), ok)
    got = box.wait(1, 3, REDUCE_SCATTER, {1}, deadline=float("inf"))
    assert got[1][Node(1, 0)].tobytes() == data.tobytes()


def test_a_corrupted_chunk_is_refused():
    msgs = list(inline(pieces(FENCE, 0, REDUCE_SCATTER, 0, Node(0, 0), np.ones(64, np.float32), chunk_bytes=64)))
    msgs[1].data = b"\x00" * len(msgs[1].data)
    box = Mailbox()
    with pytest.raises(ProtocolError, match="checksum"):
        box.receive(iter(msgs), ok)
    with pytest.raises(StepAbortedError):
        box.wait(1, 0, REDUCE_SCATTER, {0}, deadline=0)


def test_out_of_range_and_incomplete_pieces_are_refused():
    msgs = list(inline(pieces(FENCE, 0, REDUCE_SCATTER, 0, Node(0, 0), np.ones(64, np.float32), chunk_bytes=64)))
    msgs[0].offset = 60
    with pytest.raises(ProtocolError, match="outside"):
        Mailbox().receive(iter(msgs), ok)
    msgs = list(inline(pieces(FENCE, 0, REDUCE_SCATTER, 0, Node(0, 0), np.ones(64, np.float32), chunk_bytes=64)))
    with pytest.raises(ProtocolError, match="incomplete"):
        Mailbox().receive(iter(msgs[:-1]), ok)


def test_the_fence_check_runs_on_every_chunk():
    msgs = list(inline(pieces(FENCE, 0, REDUCE_SCATTER, 0, Node(0, 0), np.ones(8, np.float32), chunk_bytes=64)))

    def refuse(fence):
        raise ProtocolError(f"epoch {fence.epoch}")

    with pytest.raises(ProtocolError, match="epoch 1"):
        Mailbox().receive(iter(msgs), refuse)


def test_an_all_gather_piece_lands_in_the_buffer_it_was_asked_into_once():
    from runtime.wire.parts import ALL_GATHER
    out = np.zeros(16, np.float32)
    box = Mailbox()
    box.deliver_into(1, 0, ALL_GATHER, {1: out[8:]})
    data = np.arange(8, dtype=np.float32)
    box.receive(iter(list(inline(pieces(FENCE, 0, ALL_GATHER, 1, Node(0, 0), data, chunk_bytes=16)))), ok)
    got = box.wait(1, 0, ALL_GATHER, {1}, deadline=float("inf"))[1][Node(0, 0)]
    assert got.base is out and (out[8:] == data).all() and (out[:8] == 0).all()
    # Used once: a second stream from the same sender gets a buffer of its own, the first stays.
    box.receive(iter(list(inline(pieces(FENCE, 0, ALL_GATHER, 1, Node(0, 0), data + 1, chunk_bytes=16)))), ok)
    again = box.wait(1, 0, ALL_GATHER, {1}, deadline=float("inf"))[1][Node(0, 0)]
    assert again.base is not out and (out[8:] == data).all()


def test_a_piece_of_another_size_or_epoch_never_lands_in_the_asked_buffer():
    from runtime.wire.parts import ALL_GATHER
    out = np.zeros(16, np.float32)
    box = Mailbox()
    box.deliver_into(1, 0, ALL_GATHER, {1: out[8:]})
    box.receive(iter(list(inline(pieces(FENCE, 0, ALL_GATHER, 1, Node(0, 0), np.ones(4, np.float32), 16)))), ok)
    assert box.wait(1, 0, ALL_GATHER, {1}, deadline=float("inf"))[1][Node(0, 0)].base is not out
    box.deliver_into(1, 1, ALL_GATHER, {1: out[8:]})
    box.set_epoch(2)   # the step was aborted: its registration goes with it
    later = pb.Fence(run_id="r", epoch=2)
    box.receive(iter(list(inline(pieces(later, 1, ALL_GATHER, 1, Node(0, 0), np.ones(8, np.float32), 16)))), ok)
    assert box.wait(2, 1, ALL_GATHER, {1}, deadline=float("inf"))[1][Node(0, 0)].base is not out
    assert (out == 0).all()
