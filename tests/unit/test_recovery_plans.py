"""A recovery is decided once and carried out as decided: each recovery, driven through the controller against
the fake group, makes exactly one plan per set of facts (each recorded), and the executor's calls are the plan's,
nothing more (its inputs determine them: it chooses no source, no step, no worker)."""

import types

import pytest

from runtime import ControllerObserver, EventLog, RunState, read_events
from runtime.control import controller as controller_module
from runtime.control.controller import Controller
from runtime.control.controller_options import ControllerOptions
from runtime.control.plan import Action
from tests.support.controller_run import M, expected_losses
from tests.support.events import committed_steps, kinds
from tests.support.fake_group import FakeGroup


class Recording(FakeGroup):
    """The fake group, recording the calls that move state: ``(what, worker(s), step)``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.moves: list[tuple] = []

    def transfer(self, source, dest, applied):
        self.moves.append(("copy", source, dest, applied))
        return super().transfer(source, dest, applied)

    def rollback(self, worker_id, to_applied_steps):
        self.moves.append(("rollback", worker_id, to_applied_steps))
        return super().rollback(worker_id, to_applied_steps)

    def load_snapshots(self, workers, applied):
        replies = super().load_snapshots(workers, applied)
        self.moves.append(("load", tuple(workers), applied))
        return replies


def run(tmp_path, monkeypatch, *, steps=8, faults=None, observer=None, **opts):
    """Trains through the controller with the recording fake group; answers ``(result, events, group, plans)``,
    ``plans`` being every ``(survey, plan)`` the controller asked for."""
    options = ControllerOptions(**{"slices": 2, "devices_per_slice": 2, "run_dir": str(tmp_path), "spares": 1,
                                   "watchdog_min_seconds": 0.0, **opts})
    events = EventLog(tmp_path / "events.jsonl")
    group = Recording(options, events, faults)
    plans = []

    def planned(state, survey, o, now=0.0):
        plan = real(state, survey, o, now)
        plans.append((survey, plan))
        return plan

    real = controller_module.plan_recovery
    monkeypatch.setattr(controller_module, "plan_recovery", planned)
    if observer is not None:
        observer.group = group
    with Controller(types.SimpleNamespace(num_microbatches=M), b"", options, events, group=group,
                    observer=observer) as ctl:
        result = ctl.train(steps, seed=0)
    events.close()
    log = read_events(tmp_path / "events.jsonl")
    assert RunState.replay(log) == ctl.state
    return result, log, group, plans


def moves_of(plan, step):
    """The state moves a plan asks for, in the order the executor carries them out."""
    out = [("rollback", w, plan.resume) for w in plan.rollbacks]
    if plan.restore is not None:
        out.append(("load", plan.restore.loaders, plan.restore.step))
    return out + [("copy", c.source, c.dest, step) for c in plan.copies]


def one_plan_per_set_of_facts(log, plans):
    """Every plan asked for came from facts no earlier plan of its recovery had, and each was recorded."""
    decisions = kinds(log, "recovery_decision")
    assert [d["action"] for d in decisions] == [p.action.value for _, p in plans]
    assert [tuple(d["active"]) for d in decisions] == [p.placement.active for _, p in plans]
    surveys = [s for s, _ in plans]
    assert all(a != b for a, b in zip(surveys, surveys[1:])), "a plan was asked for again from the same facts"


def test_a_crash_with_a_spare_is_one_plan_carried_out_as_planned(tmp_path, monkeypatch):
    result, log, group, plans = run(tmp_path, monkeypatch, faults={3: ("kill", "w1")})
    assert result.losses == expected_losses(8) and committed_steps(log) == list(range(8))
    [(survey, plan)] = plans
    one_plan_per_set_of_facts(log, plans)
    assert plan.action is Action.REPLACE and plan.placement.active == ("w0", "w2")
    assert set(survey.statuses) == {"w0", "w2"} and plan.relaunch_later == ("w1",)
    assert group.moves == moves_of(plan, 3) == [("copy", "w0", "w2", 3)]


def test_a_crash_with_no_spare_shrinks_with_no_move(tmp_path, monkeypatch):
    result, log, group, plans = run(tmp_path, monkeypatch, faults={2: ("kill", "w0")}, spares=0, relaunch=False)
    assert result.losses == expected_losses(8)
    [(_, plan)] = plans
    one_plan_per_set_of_facts(log, plans)
    assert plan.action is Action.SHRINK and plan.placement.active == ("w1",) and group.moves == []


def test_survivors_a_step_apart_are_realigned_by_the_plan_not_by_the_executor(tmp_path, monkeypatch):
    result, log, group, plans = run(tmp_path, monkeypatch, slices=3, spares=0, relaunch=False,
                                    faults={4: ("kill_after_apply", "w2")})
    assert result.losses == expected_losses(8)
    [(_, plan)] = plans
    assert plan.rollbacks == ("w0",) and plan.resume == 4
    assert group.moves == moves_of(plan, 4) == [("rollback", "w0", 4)]


def test_a_restore_from_a_snapshot_is_one_plan_with_its_loader_and_copies(tmp_path, monkeypatch):
    """One slice and a spare; a snapshot every 2 steps (written by w0, its copy kept on the spare's host); w0 dies
    at step 5: no replica is left, the spare restores the snapshot of step 4 its host holds."""
    result, log, group, plans = run(tmp_path, monkeypatch, slices=1, spares=1, faults={5: ("kill", "w0")},
                                    snapshot_interval=2, snapshot_directory=str(tmp_path / "snapshots"))
    assert result.losses == expected_losses(8) and committed_steps(log)[-1] == 7
    [(survey, plan)] = plans
    one_plan_per_set_of_facts(log, plans)
    assert plan.action is Action.RESTORE and plan.restore.tier == "snapshot" and plan.restore.loaders == ("w1",)
    assert survey.statuses["w1"].snapshots == (2, 4) and plan.restore.step == 4
    assert group.moves == moves_of(plan, 4) == [("load", ("w1",), 4)]
    [restored] = kinds(log, "snapshot_restored")
    assert (restored["step"], restored["steps_lost"]) == (4, 1)


class KillTheSource(ControllerObserver):
    fired = False

    def before_transfer(self, source, dest):
        if not self.fired:
            self.fired = True
            self.group.crash(source)


def test_a_copy_source_lost_mid_recovery_is_planned_again_from_the_new_facts(tmp_path, monkeypatch):
    """Three slices, one spare: w1 dies, the plan copies w0's state to the spare; w0 dies as the copy starts. The
    next recovery plans from the new facts (w0 dead too): w2 supplies the state, the run goes on narrower."""
    result, log, group, plans = run(tmp_path, monkeypatch, slices=3, spares=1, relaunch=False,
                                    faults={3: ("kill", "w1")}, observer=KillTheSource())
    assert result.losses == expected_losses(8) and committed_steps(log) == list(range(8))
    assert len(plans) == 2
    one_plan_per_set_of_facts(log, plans)
    (first_facts, first), (then_facts, then) = plans
    assert first.copies[0].source == "w0" and "w0" not in then.placement.active
    assert "w0" in then_facts.statuses.keys() ^ first_facts.statuses.keys()   # the facts changed: w0 is gone
    assert [c.source for c in then.copies] == ["w2"]
    assert group.moves == [("copy", "w0", "w3", 3)] + moves_of(then, 3)
    assert result.recoveries == 2


@pytest.mark.parametrize("pick", [0, 1])
def test_the_executor_chooses_nothing_its_calls_follow_from_the_plan_alone(tmp_path, monkeypatch, pick):
    """Swapping which survivor a plan names as the copy source swaps the executor's copy: the executor reads
    the plan, it does not choose."""
    real = controller_module.plan_recovery

    def steered(state, survey, o, now=0.0):
        plan = real(state, survey, o, now)
        if plan.copies:
            source = ("w0", "w2")[pick]
            plan = plan.__class__(**{**plan.__dict__, "copies": tuple(c.__class__(source, c.dest, c.stage)
                                                                       for c in plan.copies)})
        return plan

    monkeypatch.setattr(controller_module, "plan_recovery", steered)
    options = ControllerOptions(slices=3, devices_per_slice=2, run_dir=str(tmp_path), spares=1)
    events = EventLog(tmp_path / "events.jsonl")
    group = Recording(options, events, {3: ("kill", "w1")})
    with Controller(types.SimpleNamespace(num_microbatches=M), b"", options, events, group=group) as ctl:
        result = ctl.train(6, seed=0)
    assert result.losses == expected_losses(6)
    assert group.moves == [("copy", ("w0", "w2")[pick], "w3", 3)]


def test_a_release_gives_live_spares_first_then_the_last_slices_down_to_the_minimum_and_a_pipeline_only_spares():
    from runtime.control.placement import Placement
    from runtime.control.plan import decide_release

    p = Placement(3, ("w0", "w1", "w2"), ("w3", "w4"), 1)
    assert decide_release(p, 1, 1) == (Placement(4, ("w0", "w1", "w2"), ("w3",), 1), ["w4"])
    assert decide_release(p, 1, 1, dead=["w4"]) == (Placement(4, ("w0", "w1", "w2"), ("w4",), 1), ["w3"])
    placement, given = decide_release(p, 4, 2)   # two spares, then one slice: the minimum is 2
    assert given == ["w3", "w4", "w2"] and placement.active == ("w0", "w1") and placement.spares == ()
    assert decide_release(Placement(1, ("w0",), (), 1), 1, 1) is None
    piped = Placement(1, ("a0", "a1", "b0", "b1"), ("s0",), 2)   # a pipeline of 2 stages: whole replicas only
    assert decide_release(piped, 2, 1) == (Placement(2, piped.active, (), 2), ["s0"])


def test_a_release_asks_a_host_again_in_each_ones_place_and_uses_no_relaunch_of_the_runs_budget():
    import types

    from runtime.control.plan import Action, Launch, decide_launch, plan_release
    from runtime.control.run_state import RunState

    state = RunState.replay([{"kind": "run_started", "run_id": "r", "steps": 9},
                             *({"kind": "worker_launched", "worker": w, "host": "", "role": "trainer"}
                               for w in ("w0", "w1", "w2")),
                             {"kind": "placement", "epoch": 1, "active": ["w0", "w1"], "spares": ["w2"]},
                             {"kind": "state_initialized", "seed": 0, "state_bytes": 1}])
    opts = types.SimpleNamespace(min_slices=1, relaunch=True, launcher="pool", max_retries=1)
    plan, given = plan_release(state, opts, {}, 1)
    assert (plan.action, given, plan.launches) == (Action.RELEASE, ["w2"], (Launch("w2"),))
    after = state.apply({"kind": "released", "epoch": 2, "active": ["w0", "w1"], "spares": [], "given": ["w2"],
                         "promoted": [], "bytes_moved": 0, "step": 0}).apply(
        {"kind": "worker_relaunched", "replaces": "w2", "worker": "w3", "host": "", "role": "trainer"})
    assert after.relaunches("trainer") == 0 and decide_launch(after, opts, "w0") == Launch("w0", "trainer", "w0")
