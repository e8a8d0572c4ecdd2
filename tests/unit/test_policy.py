import pathlib
import re

import types

import pytest

from runtime.core.microbatch import Node
from runtime.control.checkpointing import checkpoint_writer
from runtime.control.placement import WorkerInfo, place, plan_step


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
    from runtime.control.watchdog import holding_up

    waiting = {"w0": (7, "reduce", 3.0), "w1": (7, "grad", 3.1), "w2": (7, "reduce", 2.9)}
    assert holding_up(waiting, 7) == ["w1"]
    behind = {"w0": (7, "reduce", 3.0), "w1": (6, "idle", 3.0), "w2": (7, "idle", 0.1)}
    assert holding_up(behind, 7) == ["w1"]
    stuck_in_apply = {"w0": (7, "idle", 2.0), "w1": (7, "apply", 2.0)}
    assert holding_up(stuck_in_apply, 7) == ["w1"]
    everyone_slow = {"w0": (7, "grad", 3.0), "w1": (7, "grad", 3.0)}
    assert holding_up(everyone_slow, 7) == []


def test_the_straggler_detector_needs_patience_and_reports_once_per_episode():
    from runtime.control.watchdog import StragglerDetector, StragglerPolicy

    d = StragglerDetector(StragglerPolicy(factor=3.0, patience=2, min_seconds=0.0))
    slow = {"w0": 0.01, "w1": 0.05, "w2": 0.01}
    assert d.observe(slow) == []
    [(w, seconds, median)] = d.observe(slow)
    assert (w, seconds, median) == ("w1", 0.05, 0.01)
    assert d.observe(slow) == []          # the streak restarted
    assert d.observe({"w0": 0.01, "w1": 0.01, "w2": 0.01}) == []


# -- table-driven tests of every decision ----------------------------------------

from runtime.control.plan import (Action, Failure, Plan, capacity_timed_out, decide_grow,  # noqa: E402
                                  decide_recovery, decide_swap, membership_change_due, realign)
from runtime.control.health_schedule import is_suspect, reprobe_wait  # noqa: E402
from runtime.control.placement import Placement  # noqa: E402
from runtime.control.watchdog import watchdog_limit  # noqa: E402
from runtime.control.plan import Launch, decide_launch, launches_for  # noqa: E402
from runtime.control.run_state import RunState  # noqa: E402

P = Placement(epoch=3, active=("a", "b", "c"), spares=("s", "t"))
ALL = set(P.members)

RECOVERY_CASES = [
    # dead, replicas, min_slices, recoveries, max_retries, may_wait -> action, active, spares, reason fragment
    ((), ALL, 1, 1, 5, False, Action.RETRY, ("a", "b", "c"), ("s", "t"), "no worker was lost"),
    (("b",), ALL, 1, 1, 5, False, Action.REPLACE, ("a", "s", "c"), ("t",), "spares replace"),
    (("a", "c"), ALL, 1, 1, 5, False, Action.REPLACE, ("s", "b", "t"), (), "spares replace"),
    (("b", "s"), ALL, 1, 1, 5, False, Action.REPLACE, ("a", "t", "c"), (), "spares replace"),
    (("a", "b", "s", "t"), ALL, 1, 1, 5, False, Action.SHRINK, ("c",), (), "no spare for 2 slice(s)"),
    (("a", "s", "t"), ALL, 2, 1, 5, False, Action.SHRINK, ("b", "c"), (), "2 survivors take over"),
    (("a", "b", "s", "t"), ALL, 2, 1, 5, False, Action.FAIL, ("c",), (), "min_slices is 2"),
    (("a", "b", "s", "t"), ALL, 2, 1, 5, True, Action.WAIT, ("a", "b", "c"), ("s", "t"), "waiting for capacity"),
    (("a", "b", "c"), set(P.active), 1, 1, 5, False, Action.FAIL, ("s", "t"), (), "every active slice is gone"),
    (("a", "b", "c"), set(P.active), 1, 1, 5, True, Action.FAIL, ("s", "t"), (), "no live replica"),
    (("b",), ALL, 1, 6, 5, False, Action.FAIL, ("a", "b", "c"), ("s", "t"), "gave up after 5 recoveries"),
    (("b",), ALL, 1, 1, 0, False, Action.FAIL, ("a", "b", "c"), ("s", "t"), "recovery is off"),
    # a promoted spare that never received the state is alive but no replica: with the only replica dead, fail
    (("a",), {"a"}, 1, 1, 5, False, Action.FAIL, ("s", "b", "c"), ("t",), "hold no copy of the state"),
    (("a",), {"a", "c"}, 1, 1, 5, False, Action.REPLACE, ("s", "b", "c"), ("t",), "spares replace"),
]


@pytest.mark.parametrize("dead,replicas,min_slices,recoveries,max_retries,may_wait,action,active,spares,why",
                         RECOVERY_CASES)
def test_decide_recovery(dead, replicas, min_slices, recoveries, max_retries, may_wait, action, active, spares, why):
    d = decide_recovery(P, dead, replicas, min_slices=min_slices, recoveries=recoveries, max_retries=max_retries,
                        may_wait=may_wait)
    assert d.action is action and why in d.reason
    assert (d.placement.active, d.placement.spares) == (active, spares)
    moved = action in (Action.REPLACE, Action.SHRINK, Action.RETRY)
    assert d.placement.epoch == (P.epoch + 1 if moved else d.placement.epoch)
    if action is Action.WAIT:
        assert d.placement == P, "a wait keeps the placement until capacity arrives"


def test_a_capacity_wait_that_times_out_fails_naming_the_option():
    wait = decide_recovery(P, ("a", "b", "s", "t"), ALL, min_slices=2, recoveries=1, max_retries=5, may_wait=True)
    assert wait.limit == "min_slices"
    failed = capacity_timed_out(wait, 7.0)
    assert failed.action is Action.FAIL and failed.limit == "capacity_timeout_seconds"
    assert failed.reason == "1 slices left, min_slices is 2: no capacity arrived within " \
                            "capacity_timeout_seconds=7"


def test_a_capacity_wait_under_the_register_timeout_names_that_one():
    # Issue 24: the reason named elastic_timeout_seconds even when the register timeout set the wait.
    wait = decide_recovery(P, ("a", "b", "s", "t"), ALL, min_slices=2, recoveries=1, max_retries=5, may_wait=True)
    failed = capacity_timed_out(wait, 120.0, "register_timeout_seconds")
    assert failed.limit == "register_timeout_seconds"
    assert failed.reason.endswith("no capacity arrived within register_timeout_seconds=120")


@pytest.mark.parametrize("recoveries,max_retries,why", [(1, 0, "recovery is off (max_retries=0)"),
                                                        (6, 5, "gave up after 5 recoveries (max_retries)")])
def test_running_out_of_retries_names_the_limit(recoveries, max_retries, why):
    d = decide_recovery(P, ("b",), ALL, min_slices=1, recoveries=recoveries, max_retries=max_retries)
    assert d.action is Action.FAIL and d.limit == "max_retries" and why in d.reason


def test_reasons_speak_the_runtimes_terms_not_the_configs():
    # runtime knows nothing of elastic: a reason names ControllerOptions fields, never a config key
    src = "".join((pathlib.Path(__file__).parents[2] / "runtime" / "control" / f).read_text()
                  for f in ("placement.py", "plan.py", "plan_executor.py", "health_schedule.py", "watchdog.py"))
    assert not re.findall(r"\belastic_\w+|\benable_checkpointing\b", src)


@pytest.mark.parametrize("placement,slices,expected", [
    (Placement(2, ("a",), ("s", "t")), 3, Placement(3, ("a", "s", "t"), ())),
    (Placement(2, ("a",), ("s", "t")), 2, Placement(3, ("a", "s"), ("t",))),
    (Placement(2, ("a", "b"), ("s",)), 2, None),
    (Placement(2, ("a",), ()), 2, None),
])
def test_decide_grow(placement, slices, expected):
    assert decide_grow(placement, slices) == expected


@pytest.mark.parametrize("slow,expected", [
    ("b", Placement(4, ("a", "s", "c"), ("t",))),
    ("x", None),
])
def test_decide_swap(slow, expected):
    assert decide_swap(P, slow) == expected
    assert decide_swap(Placement(1, ("a", "b")), "a") is None


@pytest.mark.parametrize("applied,losses,committed,target,commits,rollbacks,error", [
    ({"a": 5, "b": 5}, {"a": {}, "b": {}}, 5, 5, (), (), ""),
    ({"a": 6, "b": 5}, {"a": {5: 2.0}, "b": {}}, 5, 5, (), ("a",), ""),
    ({"a": 6, "b": 6}, {"a": {5: 2.0}, "b": {5: 2.0}}, 5, 6, ((5, 2.0),), (), ""),
    ({"a": 7, "b": 6}, {"a": {5: 2.0, 6: 1.0}, "b": {5: 2.0}}, 5, 6, ((5, 2.0),), ("a",), ""),
    ({"a": 6, "b": 6}, {"a": {5: 2.0}, "b": {5: 2.5}}, 5, 6, (), (), "no agreed loss for applied step 5"),
    ({"a": 6, "b": 6}, {"a": {5: 2.0}, "b": {}}, 5, 6, (), (), "no agreed loss for applied step 5"),
    ({"a": 8, "b": 6}, {"a": {}, "b": {}}, 6, 6, (), (), "out of step"),
    ({"a": 4, "b": 4}, {"a": {}, "b": {}}, 5, 4, (), (), "out of step"),
])
def test_realign(applied, losses, committed, target, commits, rollbacks, error):
    got_target, got_commits, got_rollbacks, got_error = realign(applied, losses, committed)
    assert error in got_error and bool(got_error) == bool(error)
    if not error:
        assert (got_target, got_commits, got_rollbacks) == (target, commits, rollbacks)


@pytest.mark.parametrize("now,last_ok,failure,suspect", [
    (10.0, 10.0, "refused", True),
    (10.0, 10.0, "not_serving", True),
    (10.0, 9.5, "silent", False),
    (10.0, 9.25, "silent", True),
    (10.0, 8.0, "silent", True),
])
def test_is_suspect(now, last_ok, failure, suspect):
    assert is_suspect(now, last_ok, lease=1.5, failure=failure) is suspect


def test_reprobes_spread_over_the_second_half_of_the_lease():
    assert reprobe_wait(lease=1.5, retries=2, probe_timeout=0.1) == pytest.approx((0.75 - 0.3) / 2)
    assert reprobe_wait(lease=0.2, retries=2, probe_timeout=0.25) == 0.0
    assert reprobe_wait(lease=1.0, retries=0, probe_timeout=0.1) == pytest.approx(0.4)


@pytest.mark.parametrize("samples,expected", [
    ([], None),
    ([0.1, 0.2], None),
    ([0.1, 0.3, 0.2], (10.0, 0.2)),
    ([2.0, 1.0, 3.0, 5.0], (30.0, 3.0)),
])
def test_watchdog_limit(samples, expected):
    assert watchdog_limit(samples, factor=10.0, min_seconds=10.0) == expected


@pytest.mark.parametrize("placement,dead,flags,due", [
    (Placement(1, ("a", "b"), ("s",)), (), {}, False),
    (Placement(1, ("a", "b"), ("s",)), ("s",), {}, True),
    (Placement(1, ("a", "b"), ("s",)), ("a",), {}, False),
    (Placement(1, ("a",), ("s",)), (), {}, True),
    (Placement(1, ("a",), ()), (), {}, False),
    (Placement(1, ("a", "b"), ()), (), {"unadopted": True}, True),
    (Placement(1, ("a", "b"), ()), (), {"warmed": True}, True),
    (Placement(1, ("a", "b"), ()), (), {"swaps": True}, True),
])
def test_membership_change_due(placement, dead, flags, due):
    facts = {"unadopted": False, "warmed": False, "swaps": False, **flags}
    assert membership_change_due(placement, 2, dead, **facts) is due


def _launch_log(*relaunches, deferred=()):
    """A run state: trainers w0..w2 and samplers s3, s4 launched, the ``relaunches`` (dead, new, role) done."""
    events = [{"kind": "run_started", "run_id": "r", "steps": 9}]
    events += [{"kind": "worker_launched", "worker": f"w{k}", "host": f"h{k}", "role": "trainer"} for k in range(3)]
    events += [{"kind": "worker_launched", "worker": f"s{k}", "host": "", "role": "sampler"} for k in (3, 4)]
    for dead, new, role in relaunches:
        events += [{"kind": "worker_dead", "worker": dead, "reason": "killed"},
                   {"kind": "worker_relaunched", "replaces": dead, "worker": new, "host": "h", "role": role}]
    if deferred:
        events += [{"kind": "worker_dead", "worker": w, "reason": "killed"} for w in deferred]
        events.append({"kind": "relaunch_deferred", "workers": list(deferred)})
    return RunState.replay(events)


@pytest.mark.parametrize("state,dead,opts,expected", [
    # a trainer lost: a fresh one on its host; a sampler: a sampler
    (_launch_log(), "w1", {}, Launch("w1", "trainer", "h1")),
    (_launch_log(), "s3", {}, Launch("s3", "sampler", "")),
    # once per dead member, also when decided and not started yet (deferred)
    (_launch_log(("w1", "w5", "trainer")), "w1", {}, None),
    (_launch_log(deferred=("w1",)), "w1", {}, None),
    # at most max_retries per role: the samplers' relaunches do not use the trainers' budget
    (_launch_log(("w1", "w5", "trainer"), ("w2", "w6", "trainer")), "w0", {}, None),
    (_launch_log(("s3", "s5", "sampler"), ("s4", "s6", "sampler")), "w0", {}, Launch("w0", "trainer", "h0")),
    (_launch_log(("w1", "w5", "trainer"), deferred=("w2",)), "w0", {}, None),
    # no relaunch, or workers started by someone else: nothing
    (_launch_log(), "w1", {"relaunch": False}, None),
    (_launch_log(), "w1", {"launcher": "none"}, None),
])
def test_one_rule_decides_each_launch_in_a_dead_members_place(state, dead, opts, expected):
    o = types.SimpleNamespace(**{"relaunch": True, "launcher": "local", "max_retries": 2, **opts})
    assert decide_launch(state, o, dead) == expected


def test_launches_of_one_plan_count_each_other_against_the_budget():
    o = types.SimpleNamespace(relaunch=True, launcher="local", max_retries=2)
    got = launches_for(_launch_log(), o, ["w0", "w1", "w2"], later=True)
    assert got == (Launch("w0", "trainer", "h0", True), Launch("w1", "trainer", "h1", True))


def test_a_lost_sampler_is_a_plan_of_the_one_planner():
    """Its rollouts to the samplers left, the trainers' placement untouched, a fresh sampler by the one launch
    rule; the end only when no sampler is left or coming."""
    from runtime.control.plan import Failure, plan_sampler_loss

    o = types.SimpleNamespace(relaunch=True, launcher="local", max_retries=2)
    dead = _launch_log().apply({"kind": "worker_dead", "worker": "s3", "reason": "killed"})
    plan = plan_sampler_loss(dead, o, "s3")
    assert (plan.action, plan.retired, plan.launches) == (Action.REASSIGN, ("s3",), (Launch("s3", "sampler", ""),))
    assert plan.placement is dead.placement and "s4" in plan.reason
    spent = _launch_log(("s3", "s5", "sampler"), ("s5", "s6", "sampler"))   # the samplers' relaunches used up
    last = spent.apply({"kind": "worker_dead", "worker": "s4", "reason": "killed"})
    assert plan_sampler_loss(last, o, "s4").action is Action.REASSIGN, "s6 serves still"
    none = last.apply({"kind": "worker_dead", "worker": "s6", "reason": "killed"})
    failed = plan_sampler_loss(none, o, "s6")
    assert (failed.action, failed.failure, failed.launches) == (Action.FAIL, Failure.CAPACITY, ())


def _workers(*devices):
    return [WorkerInfo(f"w{i}", f"h:{i}", d) for i, d in enumerate(devices)]


@pytest.mark.parametrize("devices,lost,min_slices,action,active,spares,why", [
    ((2, 2, 2), (), 1, Action.REPLACE, ("w0", "w1"), ("w2",), "every slice has a worker"),
    ((2, 2), ("w9",), 1, Action.REPLACE, ("w0", "w1"), (), "1 that died before registering were replaced"),
    ((2,), ("w1",), 1, Action.SHRINK, ("w0",), (), "starting with 1 of 2 slices"),
    # registered, then died before the placement: lost, never placed
    ((2, 2, 2), ("w0",), 1, Action.REPLACE, ("w1", "w2"), (), "1 that died before registering were replaced"),
    ((2, 2), ("w0",), 1, Action.SHRINK, ("w1",), (), "starting with 1 of 2 slices"),
    ((2,), ("w1",), 2, Action.FAIL, (), (), "need 2 workers with 2 devices, have 1; 1 worker(s) died"),
    ((2, 4), (), 2, Action.FAIL, (), (), "1 of the 2 workers needed have them: worker w1 has 4 cpu device(s)"),
])
def test_decide_start(devices, lost, min_slices, action, active, spares, why):
    from runtime.control.plan import plan_start as decide_start

    d = decide_start(2, 2, _workers(*devices), lost=lost, min_slices=min_slices)
    assert d.action is action and why in d.reason
    assert (d.placement.active, d.placement.spares) == (active, spares)


def test_a_start_that_fails_for_the_workers_devices_says_which_and_how_to_start_them():
    from runtime.control.plan_executor import failed
    from runtime.control.plan import Failure, plan_start as decide_start
    from runtime.core.errors import CapacityExhaustedError, DeviceMismatchError

    cpu = decide_start(1, 2, [WorkerInfo("pod-a", "h:1", 1)], lost=(), min_slices=1)
    assert (cpu.action, cpu.failure) == (Action.FAIL, Failure.DEVICES)
    assert cpu.reason == ("a slice needs 2 devices and 0 of the 1 workers needed have them: worker pod-a has 1 cpu "
                          "device(s); start each CPU worker with `elastic worker --devices 2`")
    err = failed(cpu, "cannot place the virtual slices")
    assert type(err) is DeviceMismatchError and isinstance(err, CapacityExhaustedError)
    assert "run again with more workers" not in str(err)   # more workers like pod-a would not fit either
    gpus = [WorkerInfo(f"g{i}", f"h:{i}", 4, "cuda") for i in range(5)]
    gpu = decide_start(2, 8, gpus, lost=(), min_slices=2)
    assert gpu.failure is Failure.DEVICES and "--devices" not in gpu.reason
    assert gpu.reason.endswith("worker g2 has 4 cuda device(s), and 2 more; start workers where JAX finds 8 devices "
                               "each")
    too_few = decide_start(2, 2, _workers(2), lost=(), min_slices=2)   # the one that joined fits: more are needed
    assert too_few.failure is Failure.CAPACITY and type(failed(too_few, "x")) is CapacityExhaustedError


ACTIVE = set(P.active)
RESTORE_CASES = [
    # dead, replicas, min_slices, may_wait, checkpoint step -> action, active, reason fragment
    (("a", "b", "c"), ACTIVE, 1, False, 40, Action.RESTORE, ("s", "t"), "restore the checkpoint of step 40"),
    (("a",), {"a"}, 1, False, 40, Action.RESTORE, ("s", "b", "c"), "hold no copy of the state"),
    (("a", "b", "c", "s", "t"), ACTIVE, 1, True, 40, Action.WAIT, ("a", "b", "c"), "waiting for capacity"),
    (("a", "b", "c", "s", "t"), ACTIVE, 1, False, 40, Action.FAIL, (), "no worker is left to restore it"),
    (("a", "b", "c"), ACTIVE, 3, True, 40, Action.WAIT, ("a", "b", "c"), "min_slices 3"),
    (("a", "b", "c"), ACTIVE, 1, False, None, Action.FAIL, ("s", "t"), "no complete snapshot or checkpoint"),
    (("b",), ACTIVE, 1, False, 40, Action.REPLACE, ("a", "s", "c"), "spares replace"),   # a replica lives: no restore
    # a spare that shadows the state is a replica: it is promoted first, and nothing is restored
    (("a", "b", "c"), ACTIVE | {"t"}, 1, False, 40, Action.SHRINK, ("t", "s"), "1 slice(s)"),
    (("a", "b", "c"), ACTIVE | {"t"}, 1, False, None, Action.SHRINK, ("t", "s"), "survivors take over"),
    (("b",), ACTIVE | {"t"}, 1, False, None, Action.REPLACE, ("a", "t", "c"), "spares replace"),
]


@pytest.mark.parametrize("dead,replicas,min_slices,may_wait,step,action,active,why", RESTORE_CASES)
def test_without_a_replica_a_checkpoint_is_restored(dead, replicas, min_slices, may_wait, step, action, active, why):
    d = decide_recovery(P, dead, replicas, min_slices=min_slices, recoveries=1, max_retries=5, may_wait=may_wait,
                        checkpoint_step=step)
    assert d.action is action and why in d.reason
    assert d.placement.active == active


@pytest.mark.parametrize("step, steps, period, want", [
    (3, 30, 4, "b"),        # the 4th step ends the first period: 4 // 4 = 1 -> the second worker
    (7, 30, 4, "c"),
    (11, 30, 4, "a"),       # rotates
    (4, 30, 4, None),       # mid-period
    (29, 30, 4, "b"),       # the last step always: 30 // 4 = 7, 7 % 3 = 1
    (3, 30, 0, None),       # period 0: never
])
def test_checkpoints_follow_each_period_and_the_last_step_and_rotate(step, steps, period, want):
    assert checkpoint_writer(step, steps, period, ("a", "b", "c")) == want


FAILURE_CASES = [
    # dead, replicas, min_slices, recoveries, max_retries, checkpoint step -> the FAIL's typed failure
    (("a", "b", "s", "t"), ALL, 2, 1, 5, None, Failure.CAPACITY),        # below the minimum, no spare
    (("b",), ALL, 1, 6, 5, None, Failure.CAPACITY),                      # the recoveries allowed are used up
    (("b",), ALL, 1, 1, 0, None, Failure.CAPACITY),                      # recovery is off
    (("a", "b", "c", "s", "t"), ACTIVE, 1, 1, 5, 40, Failure.CAPACITY),  # a backup exists, no worker to load it
    (("a", "b", "c"), ACTIVE, 1, 1, 5, None, Failure.STATE_LOST),        # every replica gone, no backup
    (("a",), {"a"}, 1, 1, 5, None, Failure.STATE_LOST),                  # survivors hold no copy, no backup
]


@pytest.mark.parametrize("dead,replicas,min_slices,recoveries,max_retries,step,failure", FAILURE_CASES)
def test_a_fail_says_which_failure_it_is(dead, replicas, min_slices, recoveries, max_retries, step, failure):
    d = decide_recovery(P, dead, replicas, min_slices=min_slices, recoveries=recoveries, max_retries=max_retries,
                        checkpoint_step=step)
    assert d.action is Action.FAIL and d.failure is failure


@pytest.mark.parametrize("case", RECOVERY_CASES)
def test_only_a_fail_carries_a_failure(case):
    dead, replicas, min_slices, recoveries, max_retries, may_wait, action = case[:7]
    d = decide_recovery(P, dead, replicas, min_slices=min_slices, recoveries=recoveries, max_retries=max_retries,
                        may_wait=may_wait)
    assert (d.failure is not None) == (action is Action.FAIL)


def test_a_capacity_timeout_and_a_start_short_of_workers_are_capacity_failures():
    from runtime.control.plan import plan_start as decide_start

    wait = decide_recovery(P, ("a", "b", "s", "t"), ALL, min_slices=2, recoveries=1, max_retries=5, may_wait=True)
    assert wait.failure is None and capacity_timed_out(wait, 7.0).failure is Failure.CAPACITY
    assert decide_start(2, 2, _workers(2), lost=("w1",), min_slices=2).failure is Failure.CAPACITY


@pytest.mark.parametrize("failure,error", [(Failure.CAPACITY, "CapacityExhaustedError"),
                                           (Failure.STATE_LOST, "StateLostError")])
def test_each_failure_raises_its_own_type(failure, error):
    from runtime.control.plan_executor import failed
    from runtime.core.errors import ElasticTrainingFailedError

    err = failed(Plan(Action.FAIL, P, "why", failure=failure), "cannot recover", step=3)
    assert type(err).__name__ == error and isinstance(err, ElasticTrainingFailedError)
    assert (err.message, err.step, err.cause) == ("cannot recover", 3, "why")


def test_a_new_shadow_spare_shadows_the_pipeline_stage_with_the_fewest_shadows():
    from runtime.control.state_copies import shadow_stage

    assert shadow_stage({}, 3) == 0
    assert shadow_stage({"a": 0, "b": 1}, 3) == 2
    assert shadow_stage({"a": 0, "b": 0, "c": 2}, 3) == 1
    assert shadow_stage({"a": None, "b": 7}, 2) == 0   # unknown stages count for none
