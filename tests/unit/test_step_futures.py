"""A step in flight needs no more waiting once one of its workers failed: the RL loop, which serves the samplers
while the trainers' step runs, waited for every trainer, and a lost trainer's peer waits in the reduction until
its own timeout: a trainer's loss was found 10 s after its death."""

import concurrent.futures

import grpc
import pytest

from runtime import WorkerLostError
from runtime.control.calls import gather, settled
from runtime.wire.rpc import StatusError


def test_a_step_is_settled_when_every_worker_answered_or_one_failed():
    a, b = concurrent.futures.Future(), concurrent.futures.Future()
    futs = {"w0": a, "w1": b}
    assert not settled(futs)
    b.set_exception(StatusError(grpc.StatusCode.UNAVAILABLE, "the step connection ended"))
    assert settled(futs)   # w0 still waits for w1 in the reduction: nothing more to wait for
    with pytest.raises(WorkerLostError, match="w1"):
        gather(futs, deadline=None)   # the failed one's error, at once
    c, d = concurrent.futures.Future(), concurrent.futures.Future()
    c.set_result(1)
    assert not settled({"w0": c, "w1": d})
    d.cancel()   # declared dead: its call cancelled
    assert settled({"w0": c, "w1": d})
    e = concurrent.futures.Future()
    e.set_result(2)
    assert settled({"w0": c, "w1": e})
