"""The chaos verdict over hand-built reports and event logs (pure)."""

import pytest

from chaos.verdict import compare_trajectory, exactly_once, judge

M, STEPS = 4, 3
LOSSES = [2.5, 2.25, 2.0]
DIGEST = "xxh3_128:" + "ab" * 16
VERDICT_KEYS = {"verdict", "verdict_reasons", "trajectory", "first_diverging_step", "exactly_once",
                "exactly_once_detail", "promises", "run_state_replayed"}


def commit(step, mbs=None, loss=1.0):
    event = {"t": float(step), "kind": "step_committed", "step": step, "epoch": 0, "loss": loss}
    if mbs is not None:
        event["microbatches"] = mbs
    return event


def clean_events():
    return [{"t": 0.0, "kind": "run_started"}] + [
        commit(s, {"w0": [0, 1], "w1": [2, 3]}, LOSSES[s]) for s in range(STEPS)]


def clean_report(**changes):
    report = {"steps_requested": STEPS, "steps_completed": STEPS, "finished": True, "losses": list(LOSSES),
              "final_state_digest": DIGEST, "steps_lost": 0, "checkpoint_restores": 0, "microbatches": M,
              "config": {"steps": STEPS}}
    report.update(changes)
    return report


REFERENCE = {"finished": True, "losses": list(LOSSES), "final_state_digest": DIGEST, "microbatches": M}


def test_a_clean_run_passes():
    result = judge(clean_report(), REFERENCE, clean_events())
    assert set(result) == VERDICT_KEYS
    assert result["verdict"] == "pass" and result["verdict_reasons"] == []
    assert result["trajectory"] == "identical" and result["first_diverging_step"] is None
    assert result["exactly_once"] is True
    assert result["exactly_once_detail"]["missing"] == [] and result["exactly_once_detail"]["duplicated"] == []


def test_without_a_reference_the_trajectory_is_not_judged():
    result = judge(clean_report(losses=[9.0, 9.0, 9.0]), None, clean_events())
    assert result["verdict"] == "pass" and result["trajectory"] is None and result["first_diverging_step"] is None


def test_a_run_that_failed_names_the_step_and_the_error():
    report = clean_report(steps_completed=1, finished=False, losses=LOSSES[:1], final_state_digest=None,
                          failure_reason="ElasticTrainingFailedError: cannot recover: no spare")
    result = judge(report, REFERENCE, clean_events()[:2])
    assert result["verdict"] == "fail"
    assert result["verdict_reasons"] == [
        "stopped at step 1 of 3: the run failed (ElasticTrainingFailedError: cannot recover: no spare)."]
    # The trajectory is recorded, but stopping early is one reason, not two.
    assert result["trajectory"] == "diverged" and result["first_diverging_step"] == 1
    assert result["exactly_once"] is True and result["exactly_once_detail"]["uncommitted_steps"] == [1, 2]


def test_an_unfinished_run_without_an_error_text():
    result = judge(clean_report(finished=False), None, clean_events())
    assert result["verdict_reasons"] == ["stopped at step 3 of 3: the run did not finish (no run_finished event)."]


def test_lost_steps_and_restores_no_recovery_explains_each_fail():
    # The log shows no failure, so nothing promised a restore or a recomputed step (tests/unit/test_promise.py
    # judges those against what each fault left).
    result = judge(clean_report(steps_lost=2, checkpoint_restores=1, snapshot_restores=2), REFERENCE, clean_events())
    assert result["verdict"] == "fail" and result["promises"] == []
    lost, snapshots, checkpoints = result["verdict_reasons"]
    assert "2 committed steps were recomputed outside any recovery (steps_lost)" in lost
    assert "restored a snapshot 2 times outside any recovery (snapshot_restores)" in snapshots
    assert "restored a checkpoint 1 time outside any recovery (checkpoint_restores)" in checkpoints


def test_exactly_once_violations_fail_with_the_microbatches():
    events = clean_events()
    events[2] = commit(1, {"w0": [0, 1], "w1": [1, 3]}, LOSSES[1])  # 2 missing, 1 twice
    result = judge(clean_report(), REFERENCE, events)
    assert result["verdict"] == "fail" and result["exactly_once"] is False
    assert result["exactly_once_detail"]["missing"] == [[1, 2]]
    assert result["exactly_once_detail"]["duplicated"] == [[1, 1]]
    assert result["verdict_reasons"] == ["exactly-once violated: never applied: step 1 microbatch 2; "
                                         "applied more than once: step 1 microbatch 1."]


def test_a_diverged_trajectory_fails_at_the_first_bad_step():
    result = judge(clean_report(losses=[2.5, 2.25, 2.5]), REFERENCE, clean_events())
    assert result["verdict"] == "fail"
    assert result["trajectory"] == "diverged" and result["first_diverging_step"] == 2
    assert result["verdict_reasons"] == ["the loss trajectory diverged from the reference at step 2: "
                                         "2.5 vs 2.0 (rtol 1e-05)."]


def test_a_trajectory_within_tolerance_passes():
    result = judge(clean_report(losses=[2.5, 2.25, 2.0 * (1 + 1e-7)]), REFERENCE, clean_events())
    assert result["verdict"] == "pass" and result["trajectory"] == "within_tolerance"


def test_an_unfinished_reference_is_a_reason():
    result = judge(clean_report(), dict(REFERENCE, finished=False), clean_events())
    assert result["verdict"] == "fail" and "the reference run did not finish" in result["verdict_reasons"][0]


def test_exactly_once_last_commit_of_a_step_counts():
    events = clean_events()
    events.insert(2, commit(1, {"w0": [0, 0], "w1": [2]}))  # a bad first attempt, recommitted below
    ok, detail = exactly_once(events, M, STEPS)
    assert ok is True and detail["missing"] == [] and detail["duplicated"] == []
    events.append(commit(2, {"w0": [0, 1, 2]}))  # a later recommit that lost microbatch 3
    ok, detail = exactly_once(events, M, STEPS)
    assert ok is False and detail["missing"] == [[2, 3]]


def test_exactly_once_reports_ids_out_of_range_and_truncates():
    ok, detail = exactly_once([commit(0, {"w0": [0, 1, 2, 3, 4]})], M, 1)
    assert ok is False and detail["unexpected"] == [[0, 4]] and detail["missing"] == []
    events = [commit(s, {"w0": []}) for s in range(10)]
    ok, detail = exactly_once(events, M, 10)
    assert ok is False and len(detail["missing"]) == 20 and detail["missing"][:2] == [[0, 0], [0, 1]]


def test_exactly_once_is_unknown_without_microbatch_records():
    assert exactly_once([commit(0), commit(1)], M, 2) == (None, {})
    assert exactly_once([], M, 2) == (None, {})
    # A step committed during recovery (no record) is listed, not counted as missing.
    ok, detail = exactly_once([commit(0, {"w0": [0, 1, 2, 3]}), commit(1)], M, 2)
    assert ok is True and detail["unverified_steps"] == [1]


@pytest.mark.parametrize("losses,sha,expected", [
    ([1.0, 0.5, 0.25], DIGEST, ("identical", None)),
    ([1.0, 0.5, 0.25], "cd" * 32, ("within_tolerance", None)),  # equal losses, different state
    ([1.0, 0.5, 0.25], None, ("within_tolerance", None)),
    ([1.0, 0.5 * (1 + 5e-6), 0.25], DIGEST, ("within_tolerance", None)),
    ([1.0, 0.5 * (1 + 5e-5), 0.25], DIGEST, ("diverged", 1)),
    ([1.1, 0.5, 0.25], DIGEST, ("diverged", 0)),
    ([1.0, 0.5], DIGEST, ("diverged", 2)),
    ([1.0, 0.5, 0.25, 0.125], DIGEST, ("diverged", 3)),
    ([1.0, float("nan"), 0.25], DIGEST, ("diverged", 1)),
])
def test_compare_trajectory(losses, sha, expected):
    assert compare_trajectory(losses, [1.0, 0.5, 0.25], final_digest=sha, reference_digest=DIGEST) == expected


def test_compare_trajectory_rtol_is_relative_to_the_reference():
    assert compare_trajectory([101.0], [100.0], final_digest=None, reference_digest=None, rtol=0.02) == \
        ("within_tolerance", None)
    assert compare_trajectory([101.0], [100.0], final_digest=None, reference_digest=None, rtol=0.005) == ("diverged", 0)


def test_a_fault_that_was_never_injected_fails_the_verdict():
    faults = [{"index": 0, "spec": "kill:slice=1@step=1", "kind": "kill", "workers": ["w1"], "skipped": None},
              {"index": 1, "spec": "kill@time=600s", "kind": "kill", "workers": [],
               "skipped": "never fired: the run ended 3.2 s after training started, before time=600s"}]
    result = judge(clean_report(faults=faults), REFERENCE, clean_events())
    assert result["verdict"] == "fail"
    assert result["verdict_reasons"] == [
        "fault 'kill@time=600s' was not injected (never fired: the run ended 3.2 s after training started, "
        "before time=600s), so the run was not tested against it."]
    assert judge(clean_report(faults=faults[:1]), REFERENCE, clean_events())["verdict"] == "pass"
