"""Goodput is a partition of the wall time: every second has exactly one label."""

import math

import pytest

from elastic.report import BADPUT_LABELS, LABELS, goodput, intervals
from elastic.report.goodput import idle_gaps
from tests.support.events import events_from

ev = events_from(1000.0)


def startup(t_state=10.5):
    """job_started at 0; compile 0-1, startup 1-3, compile 3-10, startup 10-t_state."""
    return [ev(0, "job_started", mode="distributed"), ev(1, "programs_built"), ev(1.1, "run_started"),
            ev(2, "worker_registered", worker="w0"), ev(3, "placement", active=["w0", "w1"]),
            ev(10, "programs_loaded"), ev(t_state, "state_initialized")]


def commit(t, step, **fields):
    return ev(t, "step_committed", step=step, loss=1.0, **fields)


def by_label(events):
    totals = {lab: 0.0 for lab in LABELS}
    for s, e, lab in intervals(events):
        totals[lab] += e - s
    return totals


def check_partition(events):
    ivs = intervals(events)
    gp = goodput(events)
    assert ivs[0][0] == 0.0
    for (s0, e0, l0), (s1, e1, l1) in zip(ivs, ivs[1:]):
        assert e0 == pytest.approx(s1) and l0 != l1
    assert all(e > s and lab in LABELS for s, e, lab in ivs)
    assert ivs[-1][1] == pytest.approx(gp["wall_seconds"])
    assert gp["productive_seconds"] + sum(gp["badput_seconds"].values()) == pytest.approx(gp["wall_seconds"])
    assert set(gp["badput_seconds"]) == set(BADPUT_LABELS)
    return gp


def test_fault_free_run_is_compile_startup_productive_other():
    events = startup() + [commit(11, 0), commit(12, 1), commit(13, 2), ev(13.5, "run_finished")]
    gp = check_partition(events)
    b = gp["badput_seconds"]
    assert gp["wall_seconds"] == pytest.approx(13.5)
    assert b["compile"] == pytest.approx(1 + 7) and b["startup"] == pytest.approx(2 + 0.5)
    assert gp["productive_seconds"] == pytest.approx(2.5) and b["other"] == pytest.approx(0.5)
    assert gp["goodput_fraction"] == pytest.approx(2.5 / 13.5)
    for k in ("data", "checkpoint_save", "checkpoint_restore", "detection", "recovery", "wasted_progress"):
        assert b[k] == 0.0
    assert [lab for _, _, lab in intervals(events)] == ["compile", "startup", "compile", "startup", "productive",
                                                          "other"]


def test_failure_splits_the_step_into_wasted_detection_recovery_and_rerun():
    events = startup() + [commit(11, 0), commit(12, 1), ev(12.3, "fault_injected", index=0, workers=["w1"]),
                          ev(12.5, "failure_detected", error="WorkerLostError", committed=2),
                          ev(13, "recovery_decision", action="shrink", active=["w0"]),
                          ev(14, "recovered", path="shrink"), commit(14.5, 2), commit(15.5, 3),
                          ev(16, "run_finished")]
    gp = check_partition(events)
    b = gp["badput_seconds"]
    assert gp["productive_seconds"] == pytest.approx(1.5 + 1.0)
    assert b["wasted_progress"] == pytest.approx(0.3 + 0.5)
    assert b["detection"] == pytest.approx(0.2)
    assert b["recovery"] == pytest.approx(1.5)
    assert [lab for _, _, lab in intervals(events)][4:] == ["productive", "wasted_progress", "detection", "recovery",
                                                             "wasted_progress", "productive", "other"]


def test_without_an_injected_fault_detection_starts_at_the_previous_commit():
    events = startup() + [commit(11, 0), ev(11.4, "failure_detected", committed=1), ev(12, "recovered"),
                          commit(12.5, 1), ev(13, "run_finished")]
    b = check_partition(events)["badput_seconds"]
    assert b["detection"] == pytest.approx(0.4) and b["recovery"] == pytest.approx(0.6)
    assert b["wasted_progress"] == pytest.approx(0.5)


def test_steps_recovery_commits_from_survivors_keep_the_pre_fault_work_productive():
    events = startup() + [commit(11, 0), ev(11.6, "fault_injected", index=0), ev(12, "failure_detected"),
                          commit(12.5, 1, recovered=True), ev(13, "recovered"), commit(13.4, 2),
                          ev(13.4, "run_finished")]
    gp = check_partition(events)
    assert gp["productive_seconds"] == pytest.approx(0.5 + 0.6)
    assert gp["badput_seconds"]["detection"] == pytest.approx(0.4)
    assert gp["badput_seconds"]["recovery"] == pytest.approx(1.0)
    assert gp["badput_seconds"]["wasted_progress"] == pytest.approx(0.4)


def test_recovery_that_fails_again_stays_recovery_until_recovered():
    events = startup() + [commit(11, 0), ev(11.5, "failure_detected"), ev(12, "failure_detected"),
                          ev(13, "recovered"), commit(13.5, 1), ev(14, "run_finished")]
    b = check_partition(events)["badput_seconds"]
    assert b["detection"] == pytest.approx(0.5) and b["recovery"] == pytest.approx(1.5)


def test_growing_counts_as_recovery():
    events = startup() + [commit(11, 0), ev(11.4, "worker_warmed", worker="w2"),
                          ev(11.6, "grown", active=["w0", "w1", "w2"]), commit(12, 1), ev(12, "run_finished")]
    gp = check_partition(events)
    assert gp["badput_seconds"]["recovery"] == pytest.approx(0.6)
    assert gp["productive_seconds"] == pytest.approx(0.5 + 0.4)


def test_a_capacity_wait_is_recovery_over_the_seconds_it_waited():
    events = startup() + [commit(11, 0), ev(11.5, "failure_detected"), ev(13, "capacity_wait", seconds=1.2),
                          ev(13.5, "recovered"), commit(14, 1), commit(15, 2), ev(15.5, "run_finished")]
    events_wait_in_steps = startup() + [commit(11, 0), ev(12, "capacity_wait", seconds=0.25), commit(12.5, 1),
                                        ev(12.5, "run_finished")]
    assert check_partition(events)["badput_seconds"]["recovery"] == pytest.approx(2.0)
    gp = check_partition(events_wait_in_steps)
    assert gp["badput_seconds"]["recovery"] == pytest.approx(0.25)
    assert gp["productive_seconds"] == pytest.approx(2.0 - 0.25)


def test_a_capacity_wait_from_start_to_end_event_is_recovery():
    events = startup() + [commit(11, 0), ev(11.2, "capacity_wait", needed=2), commit(11.5, 1),
                          ev(11.9, "capacity_wait_ended", seconds=0.3, found=[]), commit(12, 2),
                          ev(12.5, "capacity_wait", needed=2), ev(12.6, "capacity_wait_ended", found=["w3"]),
                          commit(13, 3), ev(13.2, "capacity_wait", needed=2), ev(13.6, "worker_registered")]
    gp = check_partition(events)  # unfinished: the last wait runs to the last event
    assert gp["badput_seconds"]["recovery"] == pytest.approx(0.3 + 0.1 + 0.4)
    assert gp["badput_seconds"]["other"] == pytest.approx(0.2)
    assert gp["productive_seconds"] == pytest.approx(13 - 10.5 - 0.3 - 0.1)


def test_a_recommitted_step_is_wasted_progress():
    events = startup() + [commit(11, 0), commit(12, 1), commit(13, 1), ev(13, "run_finished")]
    gp = check_partition(events)
    assert gp["badput_seconds"]["wasted_progress"] == pytest.approx(1.0)


def test_an_unfinished_run_ends_at_its_last_event():
    events = startup() + [commit(11, 0), ev(11.5, "failure_detected"),
                          ev(12, "recovery_decision", action="fail", active=[])]
    gp = check_partition(events)
    assert gp["wall_seconds"] == pytest.approx(12)
    assert gp["badput_seconds"]["recovery"] == pytest.approx(0.5) and gp["badput_seconds"]["other"] == 0.0


def test_reference_mode_has_no_placement_and_initializes_state_late():
    events = [ev(0, "job_started", mode="reference"), ev(1, "programs_built"), ev(1.1, "run_started"),
              commit(3, 0), commit(3.5, 1), ev(3.6, "state_initialized"), ev(3.7, "run_finished")]
    gp = check_partition(events)
    assert gp["badput_seconds"]["compile"] == pytest.approx(1.0)
    assert gp["badput_seconds"]["startup"] == pytest.approx(2.0)
    assert gp["productive_seconds"] == pytest.approx(0.5)
    assert gp["badput_seconds"]["other"] == pytest.approx(0.2)


def test_events_after_run_finished_are_ignored_and_order_is_by_time():
    events = startup() + [commit(12, 1), commit(11, 0), ev(12.5, "run_finished"), ev(20, "late")]
    gp = check_partition(events)
    assert gp["wall_seconds"] == pytest.approx(12.5) and gp["productive_seconds"] == pytest.approx(1.5)


def test_empty_log():
    assert intervals([]) == []
    gp = goodput([])
    assert gp["wall_seconds"] == 0.0 and gp["goodput_fraction"] == 0.0
    assert set(gp["badput_seconds"]) == set(BADPUT_LABELS)
    assert not any(math.isnan(v) for v in gp["badput_seconds"].values())


def test_a_client_restart_is_recovery_and_the_steps_it_recomputes_are_wasted():
    """Attempt 1 commits 0..2 and its client dies at 13.5; attempt 2 starts at 20 from a checkpoint of step 1."""
    first = startup() + [commit(11, 0), commit(12, 1), commit(13, 2), ev(13.5, "step_dispatched", step=3)]
    second = [ev(20, "job_started", mode="distributed"), ev(21, "programs_built"), ev(22, "placement", active=["w0"]),
              ev(25, "programs_loaded"), ev(26, "run_resumed", step=1), commit(27, 1), commit(28, 2), commit(29, 3),
              ev(29.5, "run_finished")]
    gp = check_partition(first + second)
    labels = [(s, e, lab) for s, e, lab in intervals(first + second)]
    assert (13.0, 13.5, "wasted_progress") in labels and (13.5, 20.0, "recovery") in labels   # in flight, then down
    assert (25.0, 26.0, "checkpoint_restore") in labels
    assert (26.0, 28.0, "wasted_progress") in labels and (28.0, 29.0, "productive") in labels   # 1, 2 again; 3 new
    assert gp["wall_seconds"] == pytest.approx(29.5)


def test_the_idle_time_between_a_finished_attempt_and_its_extension_is_no_ones():
    first = startup() + [commit(11, 0), commit(12, 1), ev(12.5, "run_finished"), ev(12.6, "verdict")]
    second = [ev(500, "job_started", mode="distributed"), ev(501, "programs_built"),
              ev(502, "placement", active=["w0"]), ev(503, "programs_loaded"), ev(504, "run_resumed", step=2),
              commit(505, 2), ev(506, "run_finished")]
    events = first + second
    assert idle_gaps(events) == [(12.5, 500.0)]
    ivs = intervals(events)
    assert not any(s < 499.0 and e > 13.0 for s, e, _ in ivs)   # nothing covers the idle time
    gp = goodput(events)
    assert gp["wall_seconds"] == pytest.approx(12.5 + 6)
    assert gp["productive_seconds"] + sum(gp["badput_seconds"].values()) == pytest.approx(gp["wall_seconds"])
    assert gp["productive_seconds"] == pytest.approx(0.5 + 1.0 + 1.0)   # steps 0 and 1, then 2 after the resume
