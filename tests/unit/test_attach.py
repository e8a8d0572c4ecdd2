"""A restarted client re-attaches the live workers of a run whose client died: the controller against a fake
group whose workers outlive their client (the dead client's group and the new one share them)."""

import dataclasses
import types

from runtime import EventLog, Reattach, RunState, can_attach, read_events
from runtime.control.controller import Controller, Starting
from runtime.control.controller_options import ControllerOptions
from tests.support.controller_run import M, expected_losses
from tests.support.events import committed_steps, kinds
from tests.support.fake_group import FakeGroup

PROGRAMS = types.SimpleNamespace(num_microbatches=M)
STEPS = 8


def _options(tmp_path, **opts):
    return ControllerOptions(**{"slices": 2, "devices_per_slice": 2, "run_dir": str(tmp_path), "spares": 1,
                                "watchdog_min_seconds": 0.0, **opts})


def _client_dies_after(tmp_path, committed: int, **opts):
    """A first client runs until ``committed`` steps committed, then dies (nothing of it runs again); its
    workers (the group's replicas) live on. Returns its group and the log's path."""
    options = _options(tmp_path, **opts)
    path = tmp_path / "events.jsonl"
    events = EventLog(path)
    group = FakeGroup(options, events)
    ctl = Controller(PROGRAMS, b"", options, events, group=group)
    ctl.begin(STEPS, seed=0)
    while ctl.state.committed < committed:
        ctl.advance()
    events.close()   # SIGKILL: the log ends here, the controller is never closed
    return group, path


def _restart(tmp_path, dead_group, path, prepare=None):
    """A new client of the same run: replays the log, attaches the workers the dead client's group left."""
    history = read_events(path)
    state = RunState.replay(history)
    assert can_attach(state)
    options = dataclasses.replace(_options(tmp_path), generation=1)
    events = EventLog(path)
    group = FakeGroup(options, events)
    group.replicas = dead_group.replicas   # the same worker processes
    group.crashed = dead_group.crashed
    if prepare is not None:
        prepare(group)
    ctl = Controller(PROGRAMS, b"", options, events, group=group, reattach=Reattach(state, downtime_seconds=1.5))
    with ctl:
        result = ctl.train(STEPS, seed=0)
    events.close()
    log = read_events(path)
    replayed = RunState.replay(log)
    assert replayed == ctl.state, f"the log does not rebuild the run state: {replayed.differences(ctl.state)}"
    return result, log[len(history):], log


def test_the_restarted_client_goes_on_from_the_live_workers_with_no_step_lost(tmp_path):
    group, path = _client_dies_after(tmp_path, 3)
    result, new, log = _restart(tmp_path, group, path)
    assert result.losses == expected_losses(STEPS)
    assert committed_steps(log) == list(range(STEPS))   # each step committed once, across both clients
    [attached] = kinds(new, "client_attached")
    assert attached["generation"] == 1 and sorted(attached["workers"]) == ["w0", "w1", "w2"]
    assert attached["lost"] == [] and attached["committed"] == 3
    assert kinds(new, "run_started") == []            # the same attempt goes on
    assert not kinds(new, "state_transferred") and not kinds(new, "checkpoint_restored")
    [recovered] = kinds(new, "recovered")
    assert recovered["resume_step"] == 3 and recovered["bytes_moved"] == 0


def test_a_step_the_dead_client_never_recorded_is_committed_or_rolled_back(tmp_path):
    group, path = _client_dies_after(tmp_path, 3)
    for w in ("w0", "w1"):   # both applied step 3; its commit never reached the log
        group.replicas[w].apply(3)
    group.replicas["w0"].apply(4)   # w0 also applied step 4, which w1 did not
    result, new, log = _restart(tmp_path, group, path)
    assert result.losses == expected_losses(STEPS)
    assert committed_steps(log) == list(range(STEPS))
    [step3] = [e for e in new if e["kind"] == "step_committed" and e["step"] == 3]
    assert step3.get("recovered")   # committed from what the survivors applied, not run again
    assert [(e["worker"], e["to_step"]) for e in kinds(new, "rolled_back")] == [("w0", 4)]


def test_a_worker_lost_while_the_client_was_down_is_replaced_like_any_loss(tmp_path):
    group, path = _client_dies_after(tmp_path, 3)
    group.crashed.add("w1")
    result, new, log = _restart(tmp_path, group, path)
    assert result.losses == expected_losses(STEPS)
    [attached] = kinds(new, "client_attached")
    assert attached["lost"] == ["w1"] and sorted(attached["workers"]) == ["w0", "w2"]
    [decision] = kinds(new, "recovery_decision")
    assert decision["action"] == "replace" and decision["active"] == ["w0", "w2"]
    assert [(t["source"], t["dest"]) for t in kinds(new, "state_transferred")] == [("w0", "w2")]


def test_with_no_worker_left_the_restart_fails_as_any_loss_of_every_replica_does(tmp_path):
    """No live replica, no snapshot, no checkpoint: the run cannot go on (a real client then starts again
    from a checkpoint when it has one: elastic.reattach only re-attaches a run whose workers may wait)."""
    group, path = _client_dies_after(tmp_path, 3, relaunch=False)
    group.crashed.update(group.replicas)
    try:
        _restart(tmp_path, group, path)
    except Exception as e:   # noqa: BLE001
        assert type(e).__name__ in ("StateLostError", "CapacityExhaustedError"), e
    else:
        raise AssertionError("a restart with every worker gone and no backup went on")


def test_a_log_without_a_state_yet_is_not_re_attached(tmp_path):
    options = _options(tmp_path)
    events = EventLog(tmp_path / "events.jsonl")
    ctl = Controller(PROGRAMS, b"", options, events, group=FakeGroup(options, events))
    ctl.begin(STEPS, seed=0)
    events.close()
    assert isinstance(ctl.phase, Starting) and not can_attach(RunState.replay(read_events(tmp_path / "events.jsonl")))


def test_a_worker_the_dead_client_had_not_placed_yet_is_attached_and_joins_the_run(tmp_path):
    """A worker relaunched (or joined) that registered just before its client died outlives it (its grace came
    with its registration's answer): the restarted client attaches it and warms it as a newcomer."""
    group, path = _client_dies_after(tmp_path, 3)
    events = EventLog(path)
    group.replicas["w3"] = None   # registered, never loaded: the dead client had not warmed it yet
    events.emit("worker_registered", worker="w3", address="fake:w3", devices=2, platform="cpu", pid=2, host="")
    events.close()
    result, new, log = _restart(tmp_path, group, path)
    assert result.losses == expected_losses(STEPS)
    [attached] = kinds(new, "client_attached")
    assert sorted(attached["workers"]) == ["w0", "w1", "w2", "w3"] and attached["lost"] == []
    assert [e["worker"] for e in kinds(new, "worker_warmed")] == ["w3"]
    assert "w3" in kinds(new, "placement_changed")[-1]["spares"]



def test_a_worker_given_back_to_the_pool_is_not_asked_to_attach_nor_recorded_dead(tmp_path):
    """A pool took w2 back (``lease_preempted``, ``released``: it went home). A restarted client (or one taking its
    run back) asks only the run's members: nothing says w2 "did not answer", for nothing asked it."""
    options = _options(tmp_path)
    path = tmp_path / "events.jsonl"
    events = EventLog(path)
    group = FakeGroup(options, events, faults={2: ("give_back", 1)})
    ctl = Controller(PROGRAMS, b"", options, events, group=group)
    ctl.begin(STEPS, seed=0)
    while not ctl.state.left or ctl.state.committed < 4:
        ctl.advance()
    events.close()
    assert ctl.state.left == {"w2"} and ("release", "w2") in group.calls
    del group.replicas["w2"]   # it went home
    result, new, log = _restart(tmp_path, group, path)
    assert result.losses == expected_losses(STEPS)
    [attached] = kinds(new, "client_attached")
    assert "w2" not in attached["workers"] and attached["lost"] == [] and not kinds(new, "worker_dead")
