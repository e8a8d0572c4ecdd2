"""The controller's state machine stepped against a fake worker group: recoveries in milliseconds, no processes."""

import dataclasses
import types

import pytest

from runtime import (CapacityExhaustedError, ControllerObserver, EventLog, ReplicaDivergenceError, RunState,
                     StateLostError, read_events)
from runtime.core.errors import WorkerFencedError
from runtime.control.controller import Boundary, Controller, Finished, Recovering, Running
from runtime.control.controller_options import ControllerOptions
from tests.support.controller_run import M, expected_losses
from tests.support.events import committed_steps, kinds
from tests.support.fake_group import FakeGroup


def run(tmp_path, steps=8, faults=None, observer=None, stepwise=False, **opts):
    options = ControllerOptions(**{"slices": 2, "devices_per_slice": 2, "run_dir": str(tmp_path), "spares": 1,
                                   "watchdog_min_seconds": 0.0, **opts})
    events = EventLog(tmp_path / "events.jsonl")
    group = FakeGroup(options, events, faults)
    if observer is not None:
        observer.group = group
    ctl = Controller(types.SimpleNamespace(num_microbatches=M), b"", options, events, group=group, observer=observer)
    phases = []
    with ctl:
        if stepwise:
            ctl.begin(steps, seed=0)
            while not isinstance(ctl.phase, Finished):
                phases.append(ctl.advance())
            result = ctl.result
        else:
            result = ctl.train(steps, seed=0)
    events.close()
    log = read_events(tmp_path / "events.jsonl")
    replayed = RunState.replay(log)
    assert replayed == ctl.state, f"the log does not rebuild the run state: {replayed.differences(ctl.state)}"
    return result, log, group, phases


@pytest.fixture
def fault_free(tmp_path_factory):
    result, *_ = run(tmp_path_factory.mktemp("ref"))
    return result


def test_a_fault_free_run_commits_every_step_once_in_order(tmp_path):
    result, events, group, phases = run(tmp_path, stepwise=True)
    assert result.losses == expected_losses(8)
    assert committed_steps(events) == list(range(8))
    assert isinstance(phases[0], Running) and phases[-1] == Finished(result)
    assert not any(isinstance(p, Recovering) for p in phases) and result.recoveries == 0
    assert len(set(result.replica_hashes.values())) == 1


def test_a_kill_is_replaced_by_the_spare_with_no_step_lost(tmp_path, fault_free):
    result, events, group, phases = run(tmp_path, faults={3: ("kill", "w1")}, stepwise=True)
    assert result.losses == fault_free.losses
    assert result.final_state_digest == fault_free.final_state_digest
    assert committed_steps(events) == list(range(8))
    [decision] = kinds(events, "recovery_decision")
    assert decision["action"] == "replace" and decision["dead"] == ["w1"] and decision["active"] == ["w0", "w2"]
    [recovered] = kinds(events, "recovered")
    assert recovered["path"] == "replace" and recovered["resume_step"] == 3 and recovered["bytes_moved"] == 1024
    [transfer] = kinds(events, "state_transferred")
    assert (transfer["source"], transfer["dest"]) == ("w0", "w2")
    assert [type(p.error).__name__ for p in phases if isinstance(p, Recovering)] == ["WorkerLostError"]
    assert [e["worker"] for e in kinds(events, "worker_relaunched")] == ["w3"]


def test_workers_that_fenced_themselves_as_their_step_failed_are_taken_back_not_declared_dead(tmp_path):
    """The client was stopped past its workers' lease: they fenced themselves, and its step failed first. The
    recovery's probe finds them fenced, waiting for it: this client takes them back (WorkerFencedError, which
    the controller turns into a take-back when the run has an owner), and none is recorded dead."""
    with pytest.raises(WorkerFencedError, match="fenced itself"):
        run(tmp_path, faults={3: ("fence", None)}, client_grace_seconds=30.0)
    assert not kinds(read_events(tmp_path / "events.jsonl"), "worker_dead")


def test_a_kill_without_a_spare_shrinks_onto_the_survivor(tmp_path, fault_free):
    result, events, group, _ = run(tmp_path, faults={2: ("kill", "w0")}, spares=0, relaunch=False)
    assert result.losses == fault_free.losses and result.final_state_digest == fault_free.final_state_digest
    [recovered] = kinds(events, "recovered")
    assert recovered["path"] == "shrink" and recovered["bytes_moved"] == 0
    assert list(result.replica_hashes) == ["w1"]


def test_a_hang_is_found_by_the_step_watchdog_and_replaced(tmp_path, fault_free):
    result, events, group, _ = run(tmp_path, faults={5: ("hang", "w0")})
    assert result.losses == fault_free.losses and result.final_state_digest == fault_free.final_state_digest
    [alarm] = kinds(events, "step_watchdog")
    assert alarm["step"] == 5 and alarm["suspects"] == ["w0"] and alarm["pending"] == ["w0"]
    [dead] = kinds(events, "worker_dead")
    assert dead["worker"] == "w0" and dead["cause"] == "hang"
    assert kinds(events, "recovered")[0]["path"] == "replace"


def test_survivors_one_step_apart_are_realigned_by_a_rollback(tmp_path, fault_free):
    result, events, group, _ = run(tmp_path, slices=3, spares=0, relaunch=False,
                                   faults={4: ("kill_after_apply", "w2")})
    assert result.losses == fault_free.losses and result.final_state_digest == fault_free.final_state_digest
    [rolled] = kinds(events, "rolled_back")
    assert rolled == {**rolled, "worker": "w0", "to_step": 4}
    assert committed_steps(events) == list(range(8))


class KillDuringTransfer(ControllerObserver):
    def __init__(self, role):
        self.role, self.fired = role, False

    def before_transfer(self, source, dest):
        if not self.fired:
            self.fired = True
            self.group.crash(source if self.role == "source" else dest)


def test_a_kill_of_the_receiving_spare_mid_transfer_is_recovered_by_another_attempt(tmp_path, fault_free):
    result, events, group, phases = run(tmp_path, spares=2, faults={3: ("kill", "w1")},
                                        observer=KillDuringTransfer("dest"), stepwise=True)
    assert result.losses == fault_free.losses and result.final_state_digest == fault_free.final_state_digest
    assert [d["action"] for d in kinds(events, "recovery_decision")] == ["replace", "replace"]
    assert [d["active"] for d in kinds(events, "recovery_decision")] == [["w0", "w2"], ["w0", "w3"]]
    epochs = [d["epoch"] for d in kinds(events, "recovery_decision")]
    assert epochs == sorted(set(epochs)), "every attempt fences in a new epoch"
    assert sum(isinstance(p, Recovering) for p in phases) == 2 and result.recoveries == 2


def test_a_kill_of_the_only_source_mid_transfer_fails_with_no_replica_left(tmp_path):
    with pytest.raises(StateLostError, match="no live replica"):
        run(tmp_path, faults={3: ("kill", "w1")}, observer=KillDuringTransfer("source"))


def test_losing_every_active_slice_fails_with_a_clear_reason(tmp_path):
    with pytest.raises(StateLostError, match="every active slice is gone"):
        run(tmp_path, slices=1, faults={2: ("kill", "w0")})


def test_recovery_gives_up_after_max_retries(tmp_path):
    with pytest.raises(CapacityExhaustedError, match="recovery is off") as failed:
        run(tmp_path, faults={2: ("kill", "w1")}, max_retries=0)
    assert type(failed.value) is CapacityExhaustedError


def test_a_relaunched_worker_grows_the_run_back_at_a_step_boundary(tmp_path, fault_free):
    result, events, group, phases = run(tmp_path, spares=0, faults={2: ("kill", "w1")}, stepwise=True)
    assert result.losses == fault_free.losses and result.final_state_digest == fault_free.final_state_digest
    assert kinds(events, "recovered")[0]["path"] == "shrink"
    [grown] = kinds(events, "grown")
    assert grown["promoted"] == ["w2"] and grown["active"] == ["w0", "w2"]
    assert Boundary() in phases
    assert sorted(result.replica_hashes) == ["w0", "w2"]


def test_a_dead_spare_is_dropped_at_the_next_boundary_without_a_recovery(tmp_path, fault_free):
    class KillSpare(ControllerObserver):
        def step_committed(self, step):
            if step == 2:
                self.group.declare_dead("w2", "test", cause="crash")

    result, events, group, phases = run(tmp_path, observer=KillSpare(), stepwise=True)
    assert result.losses == fault_free.losses and result.recoveries == 0
    assert Boundary() in phases and not any(isinstance(p, Recovering) for p in phases)


def test_max_seconds_counts_from_the_first_step_not_from_launch(tmp_path):
    """A slow start (compiles) must not eat the training budget of a time-boxed run (soak mode)."""
    import time

    options = ControllerOptions(slices=2, devices_per_slice=2, run_dir=str(tmp_path))
    events = EventLog(tmp_path / "events.jsonl")
    group = FakeGroup(options, events)
    slow_load = group.load
    group.load = lambda workers, spares=(), stages=None: (time.sleep(0.5), slow_load(workers, spares, stages))[1]
    ctl = Controller(types.SimpleNamespace(num_microbatches=M), b"", options, events, group=group)
    with ctl:
        ctl.begin(1000, seed=0, max_seconds=0.4)
        assert ctl.advance() == Running()          # Starting took longer than max_seconds
        ctl.advance()
        ctl.advance()
    events.close()
    assert committed_steps(read_events(tmp_path / "events.jsonl")) == [0, 1]
    assert not kinds(read_events(tmp_path / "events.jsonl"), "run_truncated")


@pytest.mark.parametrize("phase", ["register", "load", "init"])
def test_a_kill_during_startup_is_replaced_and_recorded_like_any_failure(tmp_path, fault_free, phase):
    result, events, group, phases = run(tmp_path, faults={phase: ("kill", "w1")}, stepwise=True)
    assert result.losses == fault_free.losses and result.final_state_digest == fault_free.final_state_digest
    [failure] = kinds(events, "failure_detected")
    assert failure["worker"] == "w1" and failure["committed"] == 0
    [decision] = kinds(events, "recovery_decision")
    assert decision["dead"] == ["w1"] and decision["action"] == "replace"
    [recovered] = kinds(events, "recovered")
    assert recovered["resume_step"] == 0 and recovered["bytes_moved"] == 0
    assert len(result.replica_hashes) == 2 and "w1" not in result.replica_hashes
    assert kinds(events, "worker_relaunched")[0]["replaces"] == "w1"


def test_a_kill_during_load_without_a_spare_starts_narrower_and_grows_back(tmp_path, fault_free):
    result, events, group, phases = run(tmp_path, spares=0, faults={"load": ("kill", "w0")}, stepwise=True)
    assert result.losses == fault_free.losses and result.final_state_digest == fault_free.final_state_digest
    assert [d["action"] for d in kinds(events, "recovery_decision")] == ["shrink"]
    [grown] = kinds(events, "grown")
    assert grown["promoted"] == ["w2"] and sorted(result.replica_hashes) == ["w1", "w2"]


def test_a_kill_during_startup_below_the_minimum_fails_with_the_reason(tmp_path):
    with pytest.raises(CapacityExhaustedError, match="min_slices is 2") as failed:   # no wait: none can come
        run(tmp_path, spares=0, min_slices=2, relaunch=False, capacity_timeout_seconds=0.0,
            faults={"init": ("kill", "w0")})
    assert type(failed.value) is CapacityExhaustedError, "the state was never lost: only capacity ran out"


def _diverging(tmp_path, corrupt):
    """A run whose fake group ``corrupt``s what the replicas answer; returns the error it ends with."""
    options = ControllerOptions(slices=2, devices_per_slice=2, run_dir=str(tmp_path))
    events = EventLog(tmp_path / "events.jsonl")
    group = FakeGroup(options, events)
    corrupt(group)
    ctl = Controller(types.SimpleNamespace(num_microbatches=M), b"", options, events, group=group)
    with ctl, pytest.raises(ReplicaDivergenceError) as failed:
        ctl.train(4, seed=0)
    return failed.value


def test_replicas_whose_final_states_differ_end_the_run_as_a_divergence_not_a_capacity_failure(tmp_path):
    def corrupt(group):
        honest = group.hashes
        group.hashes = lambda workers: {w: (s, sha if w != "w1" else "0" * 64) for w, (s, sha) in
                                        honest(workers).items()}

    err = _diverging(tmp_path, corrupt)
    assert err.step == 4 and "state hashes" in err.cause and not isinstance(err, CapacityExhaustedError)


def test_replicas_that_disagree_on_a_step_loss_end_the_run_as_a_divergence(tmp_path):
    def corrupt(group):
        honest = group.wait

        def wait(plan, deadline=None):
            results = honest(plan, deadline)
            if plan.step == 2 and isinstance(results, dict):
                results["w1"] = dataclasses.replace(results["w1"], loss_sum=results["w1"].loss_sum + 1.0)
            return results
        group.wait = wait

    err = _diverging(tmp_path, corrupt)
    assert err.step == 2 and err.message == "replicas disagree on the step loss"


# -- a shared pool asks for workers back (runtime.launch.pool_launcher: give_back_due) --------------------------

def test_a_run_asked_for_a_host_back_gives_its_spare_first_and_keeps_every_slice(tmp_path, fault_free):
    result, events, group, _ = run(tmp_path, faults={3: ("give_back", 1)})
    assert result.losses == fault_free.losses and result.final_state_digest == fault_free.final_state_digest
    [asked] = kinds(events, "lease_preempted")
    [released] = kinds(events, "released")
    assert asked["workers"] == ["w2"] and released["active"] == ["w0", "w1"] and released["spares"] == []
    assert ("release", "w2") in group.calls and not kinds(events, "recovery_decision")


def test_a_run_without_a_spare_shrinks_at_a_step_boundary_and_grows_back_on_the_host_it_asks_for_again(
        tmp_path, fault_free):
    result, events, group, phases = run(tmp_path, spares=0, faults={2: ("give_back", 1)}, stepwise=True)
    assert result.losses == fault_free.losses and result.final_state_digest == fault_free.final_state_digest
    assert committed_steps(events) == list(range(8))   # at a boundary: no step recomputed
    [released] = kinds(events, "released")
    assert released["given"] == ["w1"] and released["active"] == ["w0"]
    [grown] = kinds(events, "grown")
    assert grown["promoted"] == ["w2"] and grown["active"] == ["w0", "w2"]
    assert not kinds(events, "recovery_decision") and result.recoveries == 0


def test_a_run_at_its_minimum_gives_nothing_back_and_says_so(tmp_path, fault_free):
    result, events, group, _ = run(tmp_path, slices=1, spares=0, faults={2: ("give_back", 1)})
    assert result.losses == fault_free.losses
    [asked] = kinds(events, "lease_preempted")
    assert asked["workers"] == [] and ("release_refused", 1) in group.calls and not kinds(events, "released")
