import pytest

from runtime.microbatch import Node
from runtime.resource_manager import WorkerInfo, place, plan_step


def workers(*devices):
    return [WorkerInfo(f"w{i}", f"127.0.0.1:{1000 + i}", d) for i, d in enumerate(devices)]


def test_place_uses_fitting_workers_and_keeps_the_rest_as_spares():
    p = place(2, 2, workers(2, 2, 2))
    assert p.active == ("w0", "w1") and p.spares == ("w2",) and p.epoch == 1


def test_place_skips_workers_with_another_mesh_and_says_why():
    with pytest.raises(ValueError, match=r"need 2 workers with 2 devices, have 1 .*\[4\]"):
        place(2, 2, workers(2, 4))


def test_plan_step_assigns_subtrees_in_vslice_order():
    plan = plan_step(place(3, 1, workers(1, 1, 1)), step=7, num_microbatches=4)
    assert plan.step == 7 and plan.workers == ("w0", "w1", "w2")
    assert plan.nodes == ((Node(1, 0),), (Node(0, 2),), (Node(0, 3),))
