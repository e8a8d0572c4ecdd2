"""The report fold (``elastic.report.build_report``) over hand-built event logs (pure)."""

from elastic.report import build_report


def ev(t, kind, **fields):
    return {"t": 1_700_000_000.0 + t, "kind": kind, **fields}


def commits(t0, first, n):
    return [ev(t0 + 0.1 * i, "step_committed", step=first + i, loss=2.0 - 0.1 * (first + i)) for i in range(n)]


def test_report_counts_a_recommitted_step_as_lost():
    events = [{"t": 0.0, "kind": "step_committed", "step": 0, "loss": 2.0},
              {"t": 1.0, "kind": "step_committed", "step": 1, "loss": 1.5},
              {"t": 2.0, "kind": "step_committed", "step": 1, "loss": 1.5}]
    report = build_report(events)
    assert report["steps_completed"] == 2 and report["steps_lost"] == 1 and report["losses"] == [2.0, 1.5]


def test_checkpoint_restores_counts_checkpoint_restored_events():
    events = commits(0, 0, 3)
    assert build_report(events)["checkpoint_restores"] == 0
    events += [ev(1.0, "checkpoint_restored", step=1, tier="memory"), *commits(1.1, 1, 2),
               ev(2.0, "checkpoint_restored", step=2, tier="disk"), *commits(2.1, 2, 1)]
    report = build_report(events)
    assert report["checkpoint_restores"] == 2
    assert report["steps_completed"] == 3 and report["steps_lost"] == 3


def test_a_fault_is_folded_by_the_fault_kind_its_event_recorded():
    events = [ev(0, "run_started", run_id="r", slices=2, devices_per_slice=1, steps=6), *commits(0.1, 0, 3),
              ev(1.0, "fault_injected", index=0, fault="partition(for=4s):slice=1@step=3", fault_kind="partition",
                 workers=["w1"], step=3, errors={}, seconds=0.9),
              ev(1.5, "worker_dead", worker="w1", reason="lease expired", cause="crash"),
              ev(1.6, "failure_detected", error="WorkerLostError", detail="w1", committed=3),
              ev(1.7, "recovery_decision", action="shrink", dead=["w1"], active=["w0"]),
              ev(2.0, "recovered", path="shrink", resume_step=3, bytes_moved=0),
              ev(2.1, "fault_skipped", index=1, fault="kill:role=spare@step=4", fault_kind="kill",
                 reason="no spare left", step=4),
              *commits(2.2, 3, 3)]
    report = build_report(events)
    [failure] = report["failures"]
    assert failure["kind"] == "partition" and failure["path"] == "shrink" and failure["workers"] == ["w1"]
    injected, skipped = report["faults"]
    assert injected["kind"] == "partition" and injected["path"] == "shrink"
    assert abs(injected["detected_after_s"] - 0.5) < 1e-6 and abs(injected["recovered_after_s"] - 1.0) < 1e-6
    assert skipped["kind"] == "kill" and skipped["skipped"] == "no spare left" and skipped["injected_at"] is None
