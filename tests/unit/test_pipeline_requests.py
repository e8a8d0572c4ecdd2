"""A pipelined step's calls: each stage worker's ranks, neighbours and stream (pure), the worker's checks of
them, and how activations travel as one float32 piece."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from runtime._proto import elastic_pb2 as pb
from runtime.control.calls import step_requests
from runtime.control.placement import Placement, plan_step
from runtime.core.errors import ProtocolError
from runtime.pipeline.schedule import compile_schedule
from runtime.worker.stage_step import check_pipeline_step, pack, packed_size, unpack

FENCE = pb.Fence(run_id="run", epoch=3)


def requests(stages=2, replicas=2, m=8, schedule="1f1b"):
    placement = Placement(epoch=3, active=tuple(f"w{i}" for i in range(stages * replicas)), stages=stages)
    plan = plan_step(placement, 5, m)
    return plan, dict(step_requests(FENCE, plan, lambda w: (f"{w}:1", f"{w}:2"), schedule=schedule))


def test_each_stage_worker_reduces_with_its_stage_and_talks_to_its_replicas_neighbours():
    plan, reqs = requests(stages=3, replicas=2)
    assert plan.loss_workers == ("w4", "w5") and plan.microbatches() == {"w4": [0, 1, 2, 3], "w5": [4, 5, 6, 7]}
    for v in range(6):
        req = reqs[f"w{v}"]
        stage, replica = divmod(v, 2)
        assert (req.rank, req.pipeline.stage, req.pipeline.stages) == (replica, stage, 3)
        assert [p.address for p in req.peers] == [f"w{2 * stage}:1", f"w{2 * stage + 1}:1"]
        assert req.pipeline.prev.address == (f"w{v - 2}:1" if stage else "")
        assert req.pipeline.next.data_address == (f"w{v + 2}:2" if stage < 2 else "")
        assert sorted(i for n in req.nodes for i in range(n.index << n.level, (n.index + 1) << n.level)) == \
            list(range(4 * replica, 4 * replica + 4))
        want = compile_schedule("1f1b", 3, range(4 * replica, 4 * replica + 4)).streams[stage]
        assert [(i.op, i.microbatch, i.what, i.peer) for i in req.pipeline.instructions] == \
            [(i.op, i.microbatch, i.what, i.peer) for i in want]
        assert check_pipeline_step(req, 3, stage) == list(want)


def test_a_stream_that_is_not_this_workers_share_is_refused():
    _, reqs = requests()
    req = reqs["w1"]
    with pytest.raises(ProtocolError, match="stage 0 of 2 asked of a worker that loaded stage 1 of 2"):
        check_pipeline_step(req, 2, 1)
    bad = pb.StepRequest()
    bad.CopyFrom(req)
    del bad.pipeline.instructions[0]   # its first forward
    with pytest.raises(ProtocolError, match="the stream computes microbatches"):
        check_pipeline_step(bad, 2, 0)
    bad.CopyFrom(req)
    bad.pipeline.instructions.add(op="send", microbatch=4, what="act", peer=3)
    with pytest.raises(ProtocolError, match="stage 0 cannot send 'act' with stage 3"):
        check_pipeline_step(bad, 2, 0)
    bad.CopyFrom(req)
    bad.pipeline.instructions.add(op="jump", microbatch=4)
    with pytest.raises(ProtocolError, match="unknown pipeline instruction 'jump'"):
        check_pipeline_step(bad, 2, 0)
    bad.CopyFrom(req)
    bad.pipeline.ClearField("next")
    with pytest.raises(ProtocolError, match="missing the address of a neighbouring stage"):
        check_pipeline_step(bad, 2, 0)


def test_activations_of_any_dtypes_travel_as_one_float32_piece_bit_for_bit():
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1.5, -2.25], dtype=ml_dtypes.bfloat16),
              np.arange(3, dtype=np.int8)]
    specs = [[list(a.shape), a.dtype.str if a.dtype != ml_dtypes.bfloat16 else a.dtype.name] for a in arrays]
    vec = pack(arrays)
    assert vec.dtype == np.float32 and vec.size == packed_size(specs) == 8   # 24 + 4 + 3 bytes, padded
    back = unpack(vec, specs)
    assert all(b.dtype == a.dtype and b.tobytes() == a.tobytes() for a, b in zip(arrays, back))
    with pytest.raises(ProtocolError, match="too short"):
        unpack(vec[:4], specs)


def test_a_stages_shadow_and_snapshot_writer_get_their_stages_share_of_the_step():
    placement = Placement(epoch=3, active=("w0", "w1", "w2", "w3"), stages=2)
    plan = plan_step(placement, 5, 8)
    reqs = dict(step_requests(FENCE, plan, lambda w: (f"{w}:1", f"{w}:2"), shadows={"s0": 0, "s1": 1},
                              snapshots={"w1": "w0", "w3": None}))
    # stage 0's ranks push their reduced chunks to stage 0's shadow only, and it waits for stage 0's ranks
    assert [p.address for p in reqs["w0"].shadows] == ["s0:1"] and [p.address for p in reqs["w3"].shadows] == ["s1:1"]
    assert reqs["s1"].shadow and [p.address for p in reqs["s1"].peers] == ["w2:1", "w3:1"]
    assert not reqs["s1"].HasField("pipeline")
    # one snapshot writer per stage, each with its own peer
    assert [(w, reqs[w].snapshot, reqs[w].snapshot_peer.address) for w in ("w0", "w1", "w2", "w3")] == \
        [("w0", False, ""), ("w1", True, "w0:1"), ("w2", False, ""), ("w3", True, "")]
