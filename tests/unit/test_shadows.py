"""Shadow spares (runtime.control.shadows) over the fake worker group (``tests/support/fake_group.py``): which spares
shadow is the run state's (folded from ``shadow_synced``, ``shadows_started``, ``shadow_behind``); ``Shadows`` keeps
only the shadows' steps in flight. The test plays the controller's part of each step (dispatch to the active worker
``a`` and the shadows, wait for ``a``), and the group decides how each shadow's step ends."""

import pytest

from runtime.control.controller_options import ControllerOptions
from runtime.control.placement import Placement, plan_step
from runtime.control.run_state import RunLedger, RunState
from runtime.control.shadows import Shadows
from runtime.core.errors import WorkerLostError
from runtime.core.events import EventLog
from tests.support.fake_group import FakeGroup


def shadowed(applied=0, faults=None, enabled=True):
    """The fake group with the active worker ``a`` and the spares ``s1``, ``s2``, ``s3``, each after ``applied``
    steps; the run's log and ledger (its placement: ``a`` active) and its ``Shadows``."""
    options = ControllerOptions(slices=1, devices_per_slice=2, run_dir="unused", spares=3, shadow_spares=enabled)
    events = EventLog(None)
    events.seen = []
    events.subscribe(events.seen.append)   # what the run wrote, as written
    ledger = RunLedger(events, RunState(placement=Placement(1, ("a",), ("s1", "s2", "s3"))))
    group = FakeGroup(options, events, faults)
    for w in ("a", "s1", "s2", "s3"):
        group.hold(w, applied)
    return group, events, ledger, Shadows(group, events, ledger, enabled)


def synced(events, *workers, step):
    for w in workers:
        events.emit("shadow_synced", source="a", dest=w, step=step, bytes=1, seconds=0.0, digest="d")


def dispatch(group, shadows, step, feeding):
    """Step ``step`` sent to ``a`` and to the shadows ``feeding``, as the controller does; ``a``'s futures."""
    futs = group.dispatch(plan_step(Placement(epoch=0, active=("a",)), step, 1), shadows=feeding)
    shadows.dispatched(step, {w: futs.pop(w) for w in feeding})
    return futs


def polls(group):
    """Whether each of the group's ``poll`` calls waited (was given a deadline)."""
    return [c[2] for c in group.calls if c[0] == "poll"]


def behind(events):
    return [(e["worker"], e["step"]) for e in events_of(events, "shadow_behind")]


def events_of(events, kind):
    return [e for e in events.seen if e["kind"] == kind]


def test_a_shadow_falls_behind_on_a_failed_step_and_the_run_state_drops_it():
    group, events, ledger, shadows = shadowed(faults={1: ("partition", "s2")})   # s2 gets no pushes in step 1
    synced(events, "s1", "s2", step=0)
    assert shadows.feeding(ledger.state) == ["s1", "s2"]
    assert shadows.behind(ledger.state) == ["s3"]   # a new spare needs a copy first
    f0 = dispatch(group, shadows, 0, ("s1", "s2"))
    f1 = dispatch(group, shadows, 1, ("s1", "s2"))
    group.wait(f0)
    group.wait(f1)
    shadows.poll()
    assert ledger.state.shadows == {"s1"} and behind(events) == [("s2", 1)]
    assert shadows.behind(ledger.state) == ["s2", "s3"]
    synced(events, "s2", step=2)   # caught up by a copy
    group.declare_dead("s1", "test", cause="crash")
    assert shadows.feeding(ledger.state) == ["s2"]


def test_recovery_waits_only_for_committed_steps_and_counts_the_live_shadows():
    group, events, ledger, shadows = shadowed(applied=4, faults={5: ("kill", "a")})
    synced(events, "s1", "s2", step=4)
    group.wait(dispatch(group, shadows, 4, ("s1", "s2")))
    f5 = dispatch(group, shadows, 5, ("s1", "s2"))
    with pytest.raises(WorkerLostError):
        group.wait(f5)   # the step the ranks died in: it never ends on the shadows
    group.declare_dead("s2", "test", cause="crash")
    assert shadows.holding(committed=5, wait_seconds=2.0) == {"s1"}
    assert polls(group) == [True, False]   # step 4 (committed) was waited for, step 5 was not
    assert behind(events) == []   # step 5 is past the frontier: not confirming it is no fault
    shadows.abandon()
    shadows.poll()
    assert polls(group) == [True, False]   # nothing pending after the abandon


def test_a_shadow_that_does_not_confirm_a_committed_step_before_a_recovery_falls_behind(monkeypatch):
    group, events, ledger, shadows = shadowed(applied=4)
    synced(events, "s1", "s2", step=4)
    futs = dispatch(group, shadows, 4, ("s1", "s2"))
    monkeypatch.setattr(group, "poll", lambda futs, deadline=None: {})   # s1 and s2 never answer step 4
    assert shadows.holding(committed=5, wait_seconds=0.0) == set()
    assert behind(events) == [("s1", 4), ("s2", 4)] and ledger.state.shadows == set()
    assert group.wait(futs)


def test_the_spares_that_start_with_the_state_shadow_from_the_first_step():
    group, events, ledger, shadows = shadowed()
    events.emit("shadows_started", workers=["s1", "s3"], step=0)
    assert shadows.feeding(ledger.state) == ["s1", "s3"] and shadows.behind(ledger.state) == ["s2"]


def test_shadows_off_ask_for_nothing():
    group, events, ledger, shadows = shadowed(enabled=False)
    assert shadows.feeding(ledger.state) == [] and shadows.behind(ledger.state) == []
    assert shadows.holding(3, wait_seconds=1.0) == set() and group.calls == []
