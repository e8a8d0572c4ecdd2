"""Shadow-spare bookkeeping (runtime.control.shadows) over the fake worker group (``tests/support/fake_group.py``):
the test plays the controller's part of each step (dispatch to the active worker ``a`` and the shadows, wait for
``a``), and the group decides how each shadow's step ends."""

import pytest

from runtime.core.errors import WorkerLostError
from runtime.control.controller_options import ControllerOptions
from runtime.control.policy import Placement, plan_step
from runtime.control.shadows import Shadows
from tests.support.fake_group import FakeGroup


class Events:
    def __init__(self):
        self.log = []

    def emit(self, kind, **fields):
        self.log.append((kind, fields))


def shadowed(applied=0, faults=None):
    """The fake group with the active worker ``a`` and the spares ``s1`` and ``s2``, each after ``applied`` steps."""
    options = ControllerOptions(slices=1, devices_per_slice=2, run_dir="unused", spares=2, shadow_spares=True)
    group = FakeGroup(options, Events(), faults)
    for w in ("a", "s1", "s2"):
        group.hold(w, applied)
    return group


def dispatch(group, shadows, step, feeding):
    """Step ``step`` sent to ``a`` and to the shadows ``feeding``, as the controller does; ``a``'s futures."""
    futs = group.dispatch(plan_step(Placement(epoch=0, active=("a",)), step, 1), shadows=feeding)
    shadows.dispatched(step, {w: futs.pop(w) for w in feeding})
    return futs


def polls(group):
    """Whether each of the group's ``poll`` calls waited (was given a deadline)."""
    return [c[2] for c in group.calls if c[0] == "poll"]


def test_a_shadow_advances_with_the_steps_it_applied_and_falls_behind_on_a_failed_one():
    group, events = shadowed(faults={1: ("partition", "s2")}), Events()   # s2 gets no pushes in step 1
    shadows = Shadows(group, events, enabled=True)
    shadows.synced("s1", 0)
    shadows.synced("s2", 0)
    assert shadows.feeding(("s1", "s2", "s3"), dead={}) == ["s1", "s2"]
    assert shadows.behind(("s1", "s2", "s3"), dead={}) == ["s3"]   # a new spare needs a copy first
    f0 = dispatch(group, shadows, 0, ("s1", "s2"))
    f1 = dispatch(group, shadows, 1, ("s1", "s2"))
    group.wait(f0)
    group.wait(f1)
    shadows.poll()
    assert shadows.at == {"s1": 2}
    assert [(k, f["worker"], f["step"]) for k, f in events.log] == [("shadow_behind", "s2", 1)]
    assert shadows.behind(("s1", "s2"), dead={}) == ["s2"]
    shadows.synced("s2", 2)   # caught up by a copy
    assert shadows.feeding(("s1", "s2"), dead={"s1": "crash"}) == ["s2"]


def test_recovery_waits_only_for_committed_steps_and_counts_shadows_at_the_frontier():
    group = shadowed(applied=4, faults={5: ("kill", "a")})
    shadows = Shadows(group, Events(), enabled=True)
    for w in ("s1", "s2"):
        shadows.synced(w, 4)
    group.wait(dispatch(group, shadows, 4, ("s1", "s2")))
    f5 = dispatch(group, shadows, 5, ("s1", "s2"))
    with pytest.raises(WorkerLostError):
        group.wait(f5)   # the step the ranks died in: it never ends on the shadows
    assert shadows.holding(committed=5, dead={"s2": "crash"}, wait_seconds=2.0) == {"s1"}
    assert polls(group) == [True, False]   # step 4 (committed) was waited for, step 5 was not
    shadows.forget(["s1"])   # promoted
    assert "s1" not in shadows and "s2" in shadows
    shadows.abandon()
    shadows.poll()
    assert polls(group) == [True, False]   # nothing pending after the abandon


def test_shadows_off_ask_for_nothing():
    group = shadowed()
    shadows = Shadows(group, Events(), enabled=False)
    shadows.synced("s1", 0)
    assert shadows.feeding(("s1",), dead={}) == [] and shadows.behind(("s1",), dead={}) == []
    assert shadows.holding(3, dead={}, wait_seconds=1.0) == set() and group.calls == []
