"""Shadow-spare bookkeeping (runtime.control.shadows) over a group whose step outcomes the test decides."""

from runtime.core.errors import StepAbortedError
from runtime.control.shadows import Shadows


class Fut:
    def __init__(self, outcome=None):
        self.outcome = outcome   # None: still running; "ok"; or an exception

    def done(self):
        return self.outcome is not None


class Group:
    """``poll`` answers the futures that are done and records whether the caller asked to wait."""

    def __init__(self):
        self.waited = []

    def poll(self, futs, deadline=None):
        self.waited.append(deadline is not None)
        return {w: (f.outcome if isinstance(f.outcome, Exception) else "result") for w, f in futs.items() if f.done()}


class Events:
    def __init__(self):
        self.log = []

    def emit(self, kind, **fields):
        self.log.append((kind, fields))


def test_a_shadow_advances_with_the_steps_it_applied_and_falls_behind_on_a_failed_one():
    group, events = Group(), Events()
    shadows = Shadows(group, events, enabled=True)
    shadows.synced("s1", 0)
    shadows.synced("s2", 0)
    assert shadows.feeding(("s1", "s2", "s3"), dead={}) == ["s1", "s2"]
    assert shadows.behind(("s1", "s2", "s3"), dead={}) == ["s3"]   # a new spare needs a copy first
    f0 = {"s1": Fut("ok"), "s2": Fut("ok")}
    f1 = {"s1": Fut("ok"), "s2": Fut(StepAbortedError(1, "no all-gather data from ranks [1]"))}
    shadows.dispatched(0, f0)
    shadows.dispatched(1, f1)
    shadows.poll()
    assert shadows.at == {"s1": 2}
    assert [(k, f["worker"], f["step"]) for k, f in events.log] == [("shadow_behind", "s2", 1)]
    assert shadows.behind(("s1", "s2"), dead={}) == ["s2"]
    shadows.synced("s2", 2)   # caught up by a copy
    assert shadows.feeding(("s1", "s2"), dead={"s1": "crash"}) == ["s2"]


def test_recovery_waits_only_for_committed_steps_and_counts_shadows_at_the_frontier():
    group = Group()
    shadows = Shadows(group, Events(), enabled=True)
    for w in ("s1", "s2"):
        shadows.synced(w, 4)
    shadows.dispatched(4, {"s1": Fut("ok"), "s2": Fut("ok")})
    shadows.dispatched(5, {"s1": Fut(), "s2": Fut()})   # the step the ranks died in: it never ends
    assert shadows.holding(committed=5, dead={"s2": "crash"}, wait_seconds=2.0) == {"s1"}
    assert group.waited == [True, False]   # step 4 (committed) was waited for, step 5 was not
    shadows.forget(["s1"])   # promoted
    assert "s1" not in shadows and "s2" in shadows
    shadows.abandon()
    shadows.poll()
    assert group.waited == [True, False]   # nothing pending after the abandon


def test_shadows_off_ask_for_nothing():
    shadows = Shadows(Group(), Events(), enabled=False)
    shadows.synced("s1", 0)
    assert shadows.feeding(("s1",), dead={}) == [] and shadows.behind(("s1",), dead={}) == []
    assert shadows.holding(3, dead={}, wait_seconds=1.0) == set()
