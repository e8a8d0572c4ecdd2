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


def test_holding_up_singles_out_the_worker_computing_while_peers_wait():
    from runtime.stragglers import holding_up

    waiting = {"w0": (7, "reduce", 3.0), "w1": (7, "grad", 3.1), "w2": (7, "reduce", 2.9)}
    assert holding_up(waiting, 7) == ["w1"]
    behind = {"w0": (7, "reduce", 3.0), "w1": (6, "idle", 3.0), "w2": (7, "idle", 0.1)}
    assert holding_up(behind, 7) == ["w1"]
    stuck_in_apply = {"w0": (7, "idle", 2.0), "w1": (7, "apply", 2.0)}
    assert holding_up(stuck_in_apply, 7) == ["w1"]
    everyone_slow = {"w0": (7, "grad", 3.0), "w1": (7, "grad", 3.0)}
    assert holding_up(everyone_slow, 7) == []


def test_the_straggler_detector_needs_patience_and_reports_once_per_episode():
    from runtime.stragglers import StragglerDetector, StragglerPolicy

    d = StragglerDetector(StragglerPolicy(factor=3.0, patience=2, min_seconds=0.0))
    slow = {"w0": 0.01, "w1": 0.05, "w2": 0.01}
    assert d.observe(slow) == []
    [(w, seconds, median)] = d.observe(slow)
    assert (w, seconds, median) == ("w1", 0.05, 0.01)
    assert d.observe(slow) == []          # the streak restarted
    assert d.observe({"w0": 0.01, "w1": 0.01, "w2": 0.01}) == []
