"""RunState: the run's state as a pure fold of its event log (the fake-group runs of test_controller.py check
that replaying each faulted run's log gives the live controller's state; every chaos run checks it too)."""

import math

import pytest

from chaos.verdict import judge
from runtime import Backup, EventLog, RunState, read_events
from runtime.control.placement import Placement
from tests.support.events import timeless as ev


START = [ev("run_started", run_id="r", slices=2, devices_per_slice=1, microbatches=2, steps=6),
         ev("placement", epoch=1, active=["a", "b"], spares=["s"], seconds=0.1),
         ev("state_initialized", seed=0, state_bytes=10)]


def commit(step, loss=1.0, **fields):
    return [ev("step_dispatched", step=step, epoch=1, workers=["a", "b"]),
            ev("step_committed", step=step, epoch=1, loss=loss, loss_sum=2 * loss, **fields)]


def test_a_fault_free_prefix_folds_into_frontiers_losses_and_replicas():
    s = RunState.replay(START + commit(0, 0.5) + commit(1, 0.25) + [
        ev("step_dispatched", step=2, epoch=1, workers=["a", "b"])])
    assert (s.run_id, s.steps, s.epoch, s.state_bytes) == ("r", 6, 1, 10)
    assert (s.committed, s.dispatched, list(s.in_flight)) == (2, 3, [2])
    assert s.losses == (0.5, 0.25) and s.loss_sums == (1.0, 0.5)
    assert s.replicas == {"a", "b"} and s.placement == Placement(1, ("a", "b"), ("s",))


def test_a_recovery_adopts_its_decision_defers_relaunches_and_resumes_at_its_step():
    log = START + commit(0) + commit(1) + [
        ev("step_dispatched", step=2, epoch=1, workers=["a", "b"]),
        ev("worker_dead", worker="b", reason="gone", cause="crash"),
        ev("failure_detected", error="WorkerLostError", detail="", worker="b", committed=2),
        ev("recovery_decision", action="wait", reason="", dead=["b"], epoch=1, active=["a", "b"], spares=[]),
        ev("recovery_decision", action="replace", reason="", dead=["b"], epoch=2, active=["a", "s"], spares=[]),
        ev("relaunch_deferred", workers=["b"]),
        ev("recovered", path="replace", epoch=2, resume_step=2, dead=["b"], bytes_moved=5, seconds=0.1,
           restore_tier="replica")]
    s = RunState.replay(log)
    assert s.placement == Placement(2, ("a", "s"), ()), "a wait keeps the placement; the replace is adopted"
    assert (s.recoveries, s.dead, s.deferred) == (1, {"b": "gone"}, ("b",))
    assert (s.committed, s.dispatched, s.replicas) == (2, 2, {"a", "s"})
    s = s.apply(ev("step_committed", step=2, epoch=2, loss=1.0, loss_sum=2.0, recovered=True))
    assert s.deferred == ("b",), "a step committed by the recovery itself does not start the replacements"
    s = s.apply(ev("step_committed", step=3, epoch=2, loss=1.0, loss_sum=2.0))
    assert s.deferred == () and s.committed == 4


def test_a_restore_undoes_the_steps_after_the_restored_one():
    s = RunState.replay(START + sum((commit(i, float(i)) for i in range(5)), []) + [
        ev("recovery_decision", action="restore", reason="", dead=["a", "b"], epoch=2, active=["s"], spares=[]),
        ev("recovered", path="restore", epoch=2, resume_step=3, dead=["a", "b"], bytes_moved=9, seconds=1.0,
           restore_tier="snapshot")])
    assert (s.committed, s.dispatched, s.losses, s.replicas) == (3, 3, (0.0, 1.0, 2.0), {"s"})


def test_stragglers_queue_for_a_swap_until_swapped_or_kept():
    s = RunState.replay(START + [
        ev("straggler", worker="a", step=0, seconds=1.0, median_seconds=0.1, action="replaced", queued=True),
        ev("straggler", worker="b", step=0, seconds=1.0, median_seconds=0.1, action="reported")])
    assert s.swaps == ("a",)
    kept = s.apply(ev("straggler_kept", worker="a", reason="no spare to move it onto"))
    swapped = s.apply(ev("placement_changed", epoch=2, active=["s", "b"], spares=[], why="swap")).apply(
        ev("straggler_replaced", epoch=2, promoted=["s"], active=["s", "b"], spares=[], bytes_moved=1, step=0,
           slow="a"))
    assert kept.swaps == () and swapped.swaps == () and swapped.replicas == {"s", "b"}


def test_backups_are_known_from_their_reports():
    s = RunState.replay(START + [
        ev("checkpoint_saved", worker="a", step=4, directory="d"), ev("checkpoint_saved", worker="b", step=2,
                                                                      directory="d"),
        ev("snapshot_saved", worker="a", host="h1", step=3), ev("snapshot_copied", worker="a", peer="s", host="h2",
                                                                step=3),
        ev("shadow_synced", source="a", dest="s", step=0, bytes=1, seconds=0.1, sha256="x")])
    assert s.checkpoints == (2, 4) and s.snapshots == ((3, "h1", None), (3, "h2", None)) and s.shadows == {"s"}


def test_a_hosts_stage_directory_keeps_its_newest_snapshots_as_its_store_does():
    from runtime.state.snapshot import KEEP

    saved = [ev("snapshot_saved", worker="a", host="h1", step=n, stage=1) for n in range(KEEP + 2)]
    s = RunState.replay(START + saved + [ev("snapshot_saved", worker="b", host="h1", step=0, stage=0),
                                         ev("snapshot_saved", worker="c", host="h9", step=0)])   # (old log: no stage)
    assert [x for x in s.snapshots if x[1:] == ("h1", 1)] == [(n, "h1", 1) for n in range(2, KEEP + 2)]
    assert (0, "h1", 0) in s.snapshots and (0, "h9", None) in s.snapshots


def test_a_new_attempt_starts_from_its_own_events_and_a_resume_brings_the_losses_back():
    first = START + commit(0, 0.5) + commit(1, 0.25)
    second = [ev("run_started", run_id="r2", slices=1, devices_per_slice=1, microbatches=2, steps=6),
              ev("placement", epoch=1, active=["c"], spares=[], seconds=0.1),
              ev("run_resumed", step=2, directory="d", tier="checkpoint", bytes=1, state_bytes=10,
                 resharded_from=None, losses=[0.5, None], loss_sums=[1.0, None], losses_recorded=False)]
    s = RunState.replay(first + second)
    assert (s.run_id, s.committed, s.dispatched, s.replicas, s.recoveries) == ("r2", 2, 2, {"c"}, 0)
    assert s.losses[0] == 0.5 and math.isnan(s.losses[1])
    assert s == RunState.replay(second), "NaN losses compare by their bits; the first attempt leaves nothing"


def test_unknown_kinds_are_passed_over_and_differences_are_named():
    s = RunState.replay(START)
    assert s.apply(ev("fault_injected", index=0)) is s
    assert set(s.differences(s.apply(commit(0)[1]))) == {"losses", "loss_sums"}


def test_a_live_listener_sees_every_event_as_written_in_the_files_order(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    state = [RunState()]
    log.subscribe(lambda e: state.append(state[-1].apply(e)))
    for e in START + commit(0, 0.1):
        log.emit(e["kind"], **{k: v for k, v in e.items() if k not in ("t", "kind")})
    log.close()
    assert state[-1] == RunState.replay(read_events(tmp_path / "events.jsonl"))
    assert state[-1].losses == (0.1,)


@pytest.mark.parametrize("equal", [True, False])
def test_the_chaos_verdict_fails_when_the_log_does_not_rebuild_the_live_state(equal):
    events = START + commit(0)
    live = RunState.replay(events if equal else events[:-1])
    report = {"steps_requested": 1, "steps_completed": 1, "finished": True}
    verdict = judge(report, None, events, live_state=live)
    assert verdict["run_state_replayed"] is equal
    assert (verdict["verdict"] == "pass") is equal
    if not equal:
        assert "replayed from events.jsonl differs" in " ".join(verdict["verdict_reasons"])


def test_a_series_appends_without_changing_the_views_it_came_from():
    from runtime.control.run_state import Series

    a = Series([1.0, 2.0])
    b = a.appended(3.0)
    short = b.upto(1)
    c = short.appended(9.0)          # past a shorter view's end: a copy, so b keeps its 2.0, 3.0
    d = b.appended(4.0)
    assert (list(a), list(b), list(short), list(c), list(d)) == (
        [1.0, 2.0], [1.0, 2.0, 3.0], [1.0], [1.0, 9.0], [1.0, 2.0, 3.0, 4.0])
    assert b == (1.0, 2.0, 3.0) and b[-1] == 3.0 and b[1:] == (2.0, 3.0) and b != (1.0, 2.0)
    assert Series([float("nan")]) == [float("nan")], "losses compare by their bits"
    with pytest.raises(IndexError):
        b[3]


def test_a_pipelined_run_folds_each_workers_stage_and_its_backups_by_stage():
    s = RunState.replay([ev("run_started", run_id="r", slices=1, stages=2, devices_per_slice=1, microbatches=2,
                            steps=6)] + START[1:] + [
        ev("programs_loaded", compile_seconds={}, program_bytes=0, stages={"a": 0, "b": 1, "s": 0}),
        ev("snapshot_saved", worker="a", host=None, step=4),
        ev("stage_loaded", worker="s", stage=1, compile_seconds=0.1, seconds=0.1),
        ev("snapshot_copied", worker="s", peer=None, host=None, step=4),
        ev("checkpoint_saved", worker="b", step=4, directory="/ck"),
        ev("snapshot_saved", worker="nobody", host=None, step=5)])
    assert s.stages == {"a": 0, "b": 1, "s": 1}, "stage_loaded moves a spare to its stage"
    assert s.backups == {Backup("snapshot", 4, 0, "a"), Backup("snapshot", 4, 1, ""), Backup("checkpoint", 4, 1),
                         Backup("snapshot", 5, None, "nobody")}
    assert s.complete("snapshot") == {4}, "every stage holds step 4"
    assert s.checkpoints == () and s.complete("checkpoint", at_most=9) == set(), "stage 0 saved no checkpoint"


def test_a_logs_transitions_are_its_run_states_one_per_event_and_its_attempts_cut_at_each_job_started():
    from runtime import attempts, transitions

    job = ev("job_started", mode="distributed", config={}, global_batch_size=2, microbatches=2)
    log = [ev("programs_built", program_bytes=1, state_bytes=1)] + START + commit(0) + [job] + START + commit(0)
    steps = list(transitions(log))
    assert [t.event for t in steps] == log and all(a.after is b.before for a, b in zip(steps, steps[1:]))
    assert steps[-1].after == RunState.replay(log) and steps[0].before == RunState()
    assert [t.attempt for t in steps] == [0] * (len(log) - len(START) - 3) + [1] * (len(START) + 3)
    assert [len(a) for a in attempts(log)] == [1 + len(START) + 2, 1 + len(START) + 2] and attempts([]) == []


def test_a_pool_runs_leases_and_its_wait_in_the_queue_are_facts_of_the_run():
    s = RunState.replay(START + [ev("pool_waiting", status="2nd in the queue"),
                                 ev("lease_granted", worker="a", host="h1", lease="L1"),
                                 ev("lease_granted", worker="b", host="h2", lease="L2"),
                                 ev("lease_returned", worker="a", why="preempted")])
    assert (s.leases, s.pool_waiting, s.pooled) == ({"b": ("h2", "L2")}, None, True)
    assert not RunState.replay(START).pooled
    waiting = s.apply({"kind": "pool_waiting", "status": "1st in the queue"})
    assert waiting.pool_waiting == "1st in the queue" and waiting.leases == s.leases
