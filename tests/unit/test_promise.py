"""The promise of what a fault left (chaos.promise), table-tested over hand-built event logs (pure)."""

import pytest

from chaos.promise import KINDS, promises
from chaos.verdict import judge
from tests.support.events import timeless as ev

CFG = {"elastic_dispatch_depth": 2, "elastic_snapshot_interval": 4, "checkpoint_period": 4,
       "enable_checkpointing": True, "elastic_shadow_spares": False, "steps": 20}
SHADOWING = {**CFG, "elastic_shadow_spares": True}


def start(active=("w0", "w1"), spares=()):
    return [ev("placement", active=list(active), spares=list(spares)), ev("state_initialized")]


def commits(first, last):
    return [ev("step_committed", step=s, loss=1.0) for s in range(first, last)]


def dead(*workers):
    return [ev("worker_dead", worker=w) for w in workers]


def failure(committed):
    return ev("failure_detected", error="WorkerLostError", detail="", committed=committed)


def decision(action, active, spares=()):
    return ev("recovery_decision", action=action, dead=[], active=list(active), spares=list(spares))


def recovered(tier="replica"):
    return ev("recovered", resume_step=0, bytes_moved=0, restore_tier=tier)


def restored(tier, step, committed):
    return ev(f"{tier}_restored", step=step, steps_lost=committed - step)


def saved(tier, step):
    return ev("checkpoint_saved" if tier == "checkpoint" else "snapshot_saved", step=step, worker="w0")


def kill_all_then_restore(tier, kept_steps, restore_step, committed, *, extra=()):
    """Two slices commit ``committed`` steps, copies of ``kept_steps`` saved (each reported one step late), both
    die; a relaunched worker restores ``restore_step`` and recomputes up to ``committed``, then on to 20."""
    events = start()
    for s in range(committed):
        events += commits(s, s + 1)
        events += [saved(tier, k) for k in kept_steps if k == s]   # reported as step s commits: 1 step late
    events += [failure(committed), *dead("w0", "w1"), *extra, decision("wait", ["w0", "w1"]),
               decision("restore", ["w2"]), restored(tier, restore_step, committed), recovered(tier),
               *commits(restore_step, 20)]
    return events


CASES = {
    # name: (events, kind, kept, allowed, recomputed, reason fragment[, config])
    "a survivor replaces its lost peer through the spare": (
        [*start(spares=["w2"]), *commits(0, 8), failure(8), *dead("w1"), decision("replace", ["w0", "w2"]),
         ev("state_transferred", source="w0", dest="w2"), recovered(), *commits(8, 20)],
        "replica", True, 0, 0, None),
    "a survivor was left, yet a snapshot was restored": (
        [*start(), *commits(0, 9), saved("snapshot", 8), failure(9), *dead("w1"), decision("restore", ["w0"]),
         restored("snapshot", 8, 9), recovered("snapshot"), *commits(8, 20)],
        "replica", False, 0, 1, "left replica w0 holding the committed state, yet the run restored the snapshot"),
    "a survivor was left, yet committed steps were recomputed": (
        [*start(), *commits(0, 9), failure(9), *dead("w1"), decision("shrink", ["w0"]), recovered(),
         *commits(7, 20)],
        "replica", False, 0, 2, "yet 2 steps committed before were recomputed"),
    "every active slice lost, a shadowing spare takes over": (
        [*start(spares=["w2"]), ev("shadow_synced", source="w0", dest="w2"), *commits(0, 12), failure(12),
         *dead("w0", "w1"), decision("shrink", ["w2"]), recovered("shadow"), *commits(12, 20)],
        "shadow", True, 0, 0, None, SHADOWING),
    "a shadow that fell behind is no shadow": (
        [*start(spares=["w2"]), ev("shadow_synced", source="w0", dest="w2"), *commits(0, 12),
         ev("shadow_behind", worker="w2", step=11), failure(12), *dead("w0", "w1")],
        "none", False, None, 0, "left no replica, shadow, snapshot or checkpoint", SHADOWING),
    "spares do not shadow unless asked to": (
        [*start(spares=["w2"]), *commits(0, 12), failure(12), *dead("w0", "w1")],
        "none", False, None, 0, "left no replica, shadow, snapshot or checkpoint"),
    "only a snapshot left: restored, one step recomputed": (
        kill_all_then_restore("snapshot", [8], 8, 9), "snapshot", True, 6, 1, None),
    "only snapshots left, an older one restored": (
        kill_all_then_restore("snapshot", [4, 8], 4, 9), "snapshot", False, 6, 5,
        "the newest snapshot in place was of step 8, yet the run restored the snapshot of step 4"),
    "only an old checkpoint left (later ones never written): more recomputed than promised": (
        kill_all_then_restore("checkpoint", [4], 4, 15), "checkpoint", False, 6, 11,
        "recomputed 11 steps from the checkpoint of step 4, more than the 6 promised (checkpoint_period 4 + 2"),
    "the newest checkpoint was corrupt: the one before is the newest valid": (
        kill_all_then_restore("checkpoint", [4, 8], 4, 9,
                              extra=[ev("checkpoint_skipped", worker="w2", detail="step 8 (/ck/8): truncated")]),
        "checkpoint", True, 6, 5, None),
    "a snapshot and a checkpoint of one step: the snapshot's promise": (
        [*start(), *commits(0, 9), saved("snapshot", 8), saved("checkpoint", 8), failure(9), *dead("w0", "w1"),
         decision("restore", ["w2"]), restored("snapshot", 8, 9), recovered("snapshot"), *commits(8, 20)],
        "snapshot", True, 6, 1, None),
    "nothing left: the run could not recover": (
        [*start(), *commits(0, 9), failure(9), *dead("w0", "w1"), ev("run_failed", error="cannot recover")],
        "none", False, None, 0, "left no replica, shadow, snapshot or checkpoint of the state"),
    "a replica left, and the run stopped anyway: the first rule says why": (
        [*start(), *commits(0, 5), failure(5), *dead("w1"), ev("run_failed", error="below the minimum")],
        "replica", False, 0, 0, None),
    "a worker lost before the state existed": (
        [ev("placement", active=["w0", "w1"], spares=[]), failure(0), *dead("w1"), decision("shrink", ["w0"]),
         recovered(), ev("state_initialized"), *commits(0, 20)],
        "replica", True, 0, 0, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_recovery_is_judged_by_what_its_fault_left(name):
    events, kind, kept, allowed, recomputed, reason, *config = CASES[name]
    (p,) = promises(events, config[0] if config else CFG)
    assert (p.kind, p.kept, p.allowed_recompute, p.recomputed) == (kind, kept, allowed, recomputed), p
    assert p.kind in KINDS
    if reason is None:
        assert p.reason is None
    else:
        assert reason in p.reason, p.reason


def test_in_flight_is_the_most_a_complete_copy_trailed_the_committed_steps():
    # Checkpoint 4 reported 7 steps late: a restore of it at step 12 (8 recomputed) is within 4 + 7.
    events = [*start(), *commits(0, 11), saved("checkpoint", 4), *commits(11, 12), failure(12), *dead("w0", "w1"),
              decision("restore", ["w2"]), restored("checkpoint", 4, 12), recovered("checkpoint"), *commits(4, 20)]
    (p,) = promises(events, CFG)
    assert (p.kind, p.newest, p.in_flight, p.allowed_recompute, p.recomputed, p.kept) == \
        ("checkpoint", 4, 7, 11, 8, True)
    assert p.as_dict()["restored"] == {"tier": "checkpoint", "step": 4} and p.as_dict()["failures"] == [0]


def test_a_failure_during_a_recovery_belongs_to_it_and_what_is_left_is_judged_at_its_end():
    # Two slices, one spare: w1 dies, the spare w2 starts receiving from w0, and w0 dies mid-transfer. No replica
    # is left (w2 never got the state), so the snapshot of step 8 is the promise.
    events = [*start(spares=["w2"]), *commits(0, 9), saved("snapshot", 8), failure(9), *dead("w1"),
              decision("replace", ["w0", "w2"]), ev("transfer_started", source="w0", dest="w2"), failure(9),
              *dead("w0"), decision("restore", ["w2"]), restored("snapshot", 8, 9), recovered("snapshot"),
              *commits(8, 20)]
    (p,) = promises(events, CFG)
    assert p.failures == (0, 1) and p.kind == "snapshot" and p.kept and p.left["replicas"] == []


def test_each_recovery_has_its_own_promise():
    events = [*start(spares=["w2"]), *commits(0, 4), failure(4), *dead("w1"), decision("replace", ["w0", "w2"]),
              ev("state_transferred", source="w0", dest="w2"), recovered(), *commits(4, 9), saved("snapshot", 8),
              failure(9), *dead("w0", "w2"), decision("restore", ["w3"]), restored("snapshot", 8, 9),
              recovered("snapshot"), *commits(8, 20)]
    first, second = promises(events, CFG)
    assert (first.kind, first.left["replicas"], first.kept) == ("replica", ["w0"], True)
    assert (second.kind, second.failures, second.recomputed, second.kept) == ("snapshot", (1,), 1, True)


def _report(events, **changes):
    lost = sum(1 for i, e in enumerate(events) if e["kind"] == "step_committed" and
               e["step"] < max([x["step"] + 1 for x in events[:i] if x["kind"] == "step_committed"] or [0]))
    report = {"steps_requested": 20, "steps_completed": 20, "finished": True, "losses": [1.0] * 20,
              "final_state_digest": "ab", "steps_lost": lost, "config": CFG, "microbatches": None,
              "snapshot_restores": sum(e["kind"] == "snapshot_restored" for e in events),
              "checkpoint_restores": sum(e["kind"] == "checkpoint_restored" for e in events)}
    report.update(changes)
    return report


def test_judge_passes_a_snapshot_restore_within_its_promise_and_reports_it():
    events = CASES["only a snapshot left: restored, one step recomputed"][0]
    result = judge(_report(events), None, events)
    assert result["verdict"] == "pass" and result["verdict_reasons"] == []
    (p,) = result["promises"]
    assert p["kind"] == "snapshot" and p["kept"] and p["newest"] == 8 and p["restored"]["step"] == 8


def test_judge_fails_a_broken_promise_with_its_reason_and_never_blames_a_replica_that_was_not_there():
    events = CASES["only snapshots left, an older one restored"][0]
    result = judge(_report(events), None, events)
    assert result["verdict"] == "fail"
    (reason,) = result["verdict_reasons"]
    assert "a restore takes the newest valid copy" in reason and "surviving replica" not in reason


def test_judge_fails_steps_recomputed_or_restores_outside_any_recovery():
    events = [*start(), *commits(0, 20)]
    result = judge(_report(events, steps_lost=2, checkpoint_restores=1), None, events)
    lost, restores = result["verdict_reasons"]
    assert "2 committed steps were recomputed outside any recovery" in lost
    assert "restored a checkpoint 1 time outside any recovery" in restores


def test_judge_fails_a_kill_save_whose_writer_never_died():
    armed = ev("fault_injected", index=0, fault="kill_save:role=writer@checkpoint=4", fault_kind="kill_save",
               workers=["w1"], step=6, errors={})
    events = [*start(), *commits(0, 6), armed, *commits(6, 20)]
    (reason,) = judge(_report(events), None, events)["verdict_reasons"]
    assert "armed w1 to die mid-save, and no save it wrote afterwards was cut off" in reason
    struck = [*start(spares=["w2"]), *commits(0, 6), armed, failure(6), *dead("w1"), decision("replace", ["w0", "w2"]),
              ev("state_transferred", source="w0", dest="w2"), recovered(), *commits(6, 20)]
    assert judge(_report(struck), None, struck)["verdict"] == "pass"


def test_each_attempt_of_a_run_starts_afresh_with_only_the_checkpoints_left():
    first = [ev("job_started"), *start(), *commits(0, 9), saved("checkpoint", 8), saved("snapshot", 8), failure(9)]
    second = [ev("job_started"), ev("placement", active=["w5", "w6"], spares=[]),
              ev("run_resumed", step=8), *commits(8, 12), failure(12), *dead("w6"), decision("shrink", ["w5"]),
              recovered(), *commits(12, 20)]
    cut, resumed = promises(first + second, CFG)
    assert (cut.recovered, cut.kept, cut.reason) == (False, False, None)   # the client died mid-recovery
    assert (resumed.kind, resumed.left["replicas"], resumed.kept, resumed.failures) == ("replica", ["w5"], True, (1,))
    assert resumed.left["checkpoint"] == 8 and resumed.left["snapshot"] is None   # host memory went with attempt 1


def test_a_pipelined_runs_copy_is_one_every_stage_holds_and_a_stage_without_survivors_loses_the_state():
    piped = {**CFG, "dcn_pipeline_parallelism": 2}
    loaded = ev("programs_loaded", compile_seconds={}, program_bytes=0, stages={"w0": 0, "w1": 0, "w2": 1, "w3": 1})
    snap = lambda worker, step: ev("snapshot_saved", worker=worker, host=None, step=step)
    events = [*start(active=["w0", "w1", "w2", "w3"]), loaded, *commits(0, 9), snap("w0", 4), snap("w2", 4),
              snap("w0", 8), failure(9), *dead("w2", "w3"), decision("restore", ["w0", "w1", "w4", "w5"]),
              restored("snapshot", 4, 9), recovered("snapshot"), *commits(4, 20)]
    (p,) = promises(events, piped)
    # Stage 1 lost both its slices: w0 and w1 hold stage 0's state only. Step 8 is no copy (stage 1 never saved it).
    assert (p.kind, p.left["replicas"], p.newest, p.kept) == ("snapshot", [], 4, True), p
