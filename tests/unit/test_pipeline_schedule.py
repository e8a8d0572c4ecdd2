"""Pipeline schedules: the compiled central order, its streams, and what they cost on a model of time (pure)."""

from __future__ import annotations

import itertools

import pytest

from runtime.pipeline.bubble import theoretical_bubble
from runtime.pipeline.schedule import (ACT, BACKWARD, FORWARD, FREE, GRAD, LAST, RECV, SEND, Costs, Instr,
                                       compile_schedule, compute_order)
from runtime.pipeline.simulate import Deadlock, simulate

SHAPES = [(s, m) for s, m in itertools.product((2, 3, 4), (1, 2, 3, 4, 5, 8, 16))]
EQUAL = {FORWARD: 1.0, BACKWARD: 1.0, LAST: 2.0}   # forward and backward cost the same on every stage


def equal_cost(stage, instr):
    return EQUAL[instr.op]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", SHAPES)
def test_streams_hold_every_op_once_in_policy_order_and_pair_every_transfer(kind, stages, microbatches):
    mbs = list(range(10, 10 + microbatches))   # any distinct ids
    sched = compile_schedule(kind, stages, mbs)
    for k, stream in enumerate(sched.streams):
        computes = [i for i in stream if i.op in (FORWARD, BACKWARD, LAST)]
        assert computes == compute_order(kind, stages, k, mbs)
        assert sorted(i.microbatch for i in stream if i.op == FREE) == mbs
        for i, instr in enumerate(stream):   # a value is received before it is used, and used before it is freed
            if instr.op in (FORWARD, LAST) and k > 0:
                assert Instr(RECV, instr.microbatch, ACT, k - 1) in stream[:i]
            if instr.op == BACKWARD:
                assert Instr(RECV, instr.microbatch, GRAD, k + 1) in stream[:i]
            if instr.op == FREE:
                assert any(j.op in (BACKWARD, LAST) and j.microbatch == instr.microbatch for j in stream[:i])
    order = list(sched.order)
    for n, (k, instr) in enumerate(order):   # in the global order a receive follows its send at once
        if instr.op == SEND:
            assert order[n + 1] == (instr.peer, Instr(RECV, instr.microbatch, instr.what, k))
    sends = sorted((k, i.peer, i.what, i.microbatch) for k, s in enumerate(sched.streams) for i in s if i.op == SEND)
    recvs = sorted((i.peer, k, i.what, i.microbatch) for k, s in enumerate(sched.streams) for i in s if i.op == RECV)
    assert sends == recvs and len(sends) == 2 * (stages - 1) * microbatches


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", SHAPES)
def test_the_central_order_never_deadlocks_even_when_every_send_waits_for_its_receive(kind, stages, microbatches):
    sched = compile_schedule(kind, stages, list(range(microbatches)), Costs(forward=1.0, backward=3.0))
    simulate(sched.streams, equal_cost, rendezvous=True)   # raises Deadlock if any stage gets stuck


def arrival_order_streams(kind, stages, mbs):
    """Each worker orders its own transfers: send a value as soon as it exists, receive one just before use."""
    streams = []
    for k in range(stages):
        out = []
        for c in compute_order(kind, stages, k, mbs):
            m = c.microbatch
            if c.op in (FORWARD, LAST) and k > 0:
                out.append(Instr(RECV, m, ACT, k - 1))
            if c.op == BACKWARD:
                out.append(Instr(RECV, m, GRAD, k + 1))
            out.append(c)
            if c.op == FORWARD:
                out.append(Instr(SEND, m, ACT, k + 1))
            elif k > 0:
                out.append(Instr(SEND, m, GRAD, k - 1))
            if c.op in (BACKWARD, LAST):
                out.append(Instr(FREE, m))
        streams.append(out)
    return streams


def test_per_worker_arrival_order_deadlocks_where_the_central_order_does_not():
    # 1F1B on 2 stages: stage 0 sends microbatch 1's activations while stage 1 sends microbatch 0's gradient;
    # each waits for the other to receive. The central order puts stage 1's receive of activation 1 first.
    local = arrival_order_streams("1f1b", 2, range(4))
    with pytest.raises(Deadlock, match=r"stage 0 at send act\[1\] to 1; stage 1 at send grad\[0\] to 0"):
        simulate(local, equal_cost, rendezvous=True)
    simulate(local, equal_cost, rendezvous=False)   # the same streams finish when sends never wait
    central = compile_schedule("1f1b", 2, range(4)).streams
    assert simulate(central, equal_cost, rendezvous=True).makespan > 0


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", [(4, 8), (4, 16), (2, 4), (3, 5)])
def test_bubble_of_equal_stages_is_the_theoretical_one(kind, stages, microbatches):
    sched = compile_schedule(kind, stages, list(range(microbatches)), Costs(forward=1.0, backward=1.0))
    timeline = simulate(sched.streams, equal_cost, rendezvous=False)
    assert timeline.bubble == pytest.approx(theoretical_bubble(stages, microbatches), abs=1e-9)


@pytest.mark.parametrize("microbatches", [8, 16])
def test_1f1b_holds_fewer_activations_than_gpipe(microbatches):
    costs = Costs(forward=1.0, backward=1.0)
    gpipe = simulate(compile_schedule("gpipe", 4, range(microbatches), costs).streams, equal_cost, rendezvous=False)
    one_f_one_b = simulate(compile_schedule("1f1b", 4, range(microbatches), costs).streams, equal_cost,
                           rendezvous=False)
    for k in range(1, 4):   # stage 0 keeps no input (its backward recomputes from the batch)
        assert one_f_one_b.peak_live[k] < gpipe.peak_live[k]
        assert one_f_one_b.peak_live[k] <= 2 * (4 - k) + 1   # bounded by the stages ahead, not by M
    assert max(gpipe.peak_live) >= microbatches


def test_1f1b_warms_up_with_one_forward_per_stage_ahead():
    assert [str(i) for i in compute_order("1f1b", 4, 1, range(4))] == [
        "forward[0]", "forward[1]", "forward[2]", "backward[0]", "forward[3]", "backward[1]", "backward[2]",
        "backward[3]"]
    assert [str(i) for i in compute_order("gpipe", 3, 2, range(2))] == ["last[0]", "last[1]"]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_one_stage_is_data_parallelism_each_microbatch_s_whole_gradient_in_order(kind):
    sched = compile_schedule(kind, 1, [2, 3])
    assert [str(i) for _, i in sched.order] == ["last[2]", "free[2]", "last[3]", "free[3]"]


def test_bad_schedules_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'.*gpipe, 1f1b"):
        compile_schedule("zb", 2, range(4))
    with pytest.raises(ValueError, match="at least 1 stage"):
        compile_schedule("1f1b", 0, range(4))
    with pytest.raises(ValueError, match="distinct microbatches"):
        compile_schedule("1f1b", 2, [0, 0])
    with pytest.raises(ValueError, match="costs must be positive"):
        compile_schedule("1f1b", 2, range(2), Costs(forward=0.0))
