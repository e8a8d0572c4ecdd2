"""The report fold (``elastic.report.build_report``) over hand-built event logs (pure)."""

import re

from elastic.report import build_report
from tests.support.events import ev

# A worker as a client_attached event records it (runtime.control.attach).
ATTACHED = {"address": "127.0.0.1:1", "data_address": "", "devices": 1, "platform": "cpu", "pid": 1, "host": "h",
            "applied_steps": 0}


def X(pair: str) -> str:
    """A state digest as the runtime writes it (``runtime.state.state_copy.state_digest``): xxh3_128, 32 hex digits."""
    return "xxh3_128:" + pair * 16


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


def test_a_client_fault_is_matched_to_the_client_s_loss_and_a_worker_lost_meanwhile_to_its_own():
    """kill:client, then a worker killed while the client was down: the restart's one failure (ClientLostError,
    losing w1 too) is the client's; both faults are matched to it, and the run reports the restart."""
    events = [ev(0, "job_started", mode="distributed", config={}, global_batch_size=4, microbatches=2),
              ev(0, "run_started", run_id="r", slices=2, devices_per_slice=1, steps=6), *commits(0.1, 0, 3),
              ev(1.0, "fault_injected", index=0, fault="kill:slice=1@step=3", fault_kind="kill", workers=["w1"],
                 step=3, errors={}, seconds=0.1),
              ev(1.0, "fault_injected", index=1, fault="kill:client@step=3", fault_kind="kill", workers=[],
                 step=3, errors={}, seconds=0.1),
              ev(3.0, "job_started", mode="distributed", config={}, global_batch_size=4, microbatches=2),
              ev(3.5, "worker_dead", worker="w1", reason="did not answer the restarted client", cause="crash"),
              ev(3.5, "client_attached", run_id="r", generation=1, steps=6, workers={"w0": ATTACHED}, lost=["w1"],
                 committed=3, downtime_seconds=2.5),
              ev(3.5, "failure_detected", error="ClientLostError", detail="restart", committed=3),
              ev(3.6, "recovery_decision", action="shrink", dead=["w1"], active=["w0"]),
              ev(3.7, "recovered", path="shrink", resume_step=3, bytes_moved=0),
              *commits(3.8, 3, 3)]
    report = build_report(events)
    [failure] = report["failures"]
    assert failure["kind"] == "client" and failure["path"] == "shrink"
    worker, client = report["faults"]
    assert worker["path"] == client["path"] == "shrink" and client["recovered_after_s"] is not None
    assert report["client_restarts"] == 1 and report["client_downtime_seconds"] == 2.5 and report["steps_lost"] == 0
    second = report["attempts"][1]
    assert second["started_from"] == {"tier": "live", "step": 3, "directory": None}
    assert second["reattached"] == {"generation": 1, "workers": ["w0"], "lost": ["w1"], "downtime_seconds": 2.5}


# --------------------------------------------------------------------------- attempts: one log across restarts

D = "/runs/x/checkpoints"


def attempt_start(t, run_id, steps=40):
    return [ev(t, "job_started", mode="distributed", config={"run_name": "x", "steps": steps, "seed": 0},
               global_batch_size=8, microbatches=2),
            ev(t + 0.5, "programs_built", program_bytes={"grad": 1}, state_bytes=64, seconds=0.5),
            ev(t + 1, "run_started", run_id=run_id, slices=2, devices_per_slice=1, steps=steps),
            ev(t + 1.5, "placement", epoch=1, active=["w0", "w1"], spares=[]),
            ev(t + 2, "programs_loaded", compile_seconds={"w0": 0.3, "w1": 0.4})]


def loss(step):
    return 2.0 - 0.01 * step


def killed_then_resumed():
    """Attempt 1 commits steps 0..36 (checkpoints at 10, 20, 30) and its client is SIGKILLed: the log just
    ends. Attempt 2 (the same command again, 12 s later) resumes from checkpoint 30 and finishes at 40."""
    first = attempt_start(0, "r1") + [ev(2.5, "state_initialized", seed=0, state_bytes=64)]
    for s in range(37):
        first.append(ev(3 + 0.1 * s, "step_committed", step=s, loss=loss(s)))
        if s in (9, 19, 29):
            first.append(ev(3.05 + 0.1 * s, "checkpoint_saved", worker="w0", step=s + 1, directory=D))
    second = attempt_start(18.7, "r2") + [
        ev(21, "run_resumed", step=30, directory=D, tier="checkpoint", bytes=128, state_bytes=64,
           losses=[loss(s) for s in range(30)], losses_recorded=True, resharded_from=None)]
    second += [ev(21.5 + 0.1 * i, "step_committed", step=s, loss=loss(s)) for i, s in enumerate(range(30, 40))]
    second.append(ev(23, "run_finished", final_state_digest=X("ab"), replica_hashes={}, client_peak_rss_bytes=1))
    return first, second


def test_a_killed_client_alone_is_said_to_have_died_not_to_have_no_reason():
    first, _ = killed_then_resumed()
    report = build_report(first)
    assert not report["finished"] and report["steps_completed"] == 37
    why = report["failure_reason"]
    assert why is not None and "without run_finished" in why and "after step 36" in why and "client died" in why
    [attempt] = report["attempts"]
    assert attempt["end"] == "died" and attempt["failure_reason"] == why


def test_steps_an_earlier_attempt_committed_and_a_resumed_one_recomputed_are_lost_and_said_where():
    first, second = killed_then_resumed()
    report = build_report(first + second)
    assert report["finished"] and report["failure_reason"] is None and report["run_id"] == "r2"
    assert report["steps_completed"] == 40 and report["losses"] == [loss(s) for s in range(40)]
    assert report["steps_lost"] == 7   # steps 30..36: committed by attempt 1, computed again by attempt 2
    assert report["resumed_from"]["step"] == 30 and report["resumed_from"]["tier"] == "checkpoint"
    one, two = report["attempts"]
    assert (one["end"], one["steps_committed"], one["steps_recomputed"]) == ("died", 37, 0)
    assert one["started_from"] == {"tier": "seed", "step": 0, "directory": None}
    assert "attempt 1 ends without run_finished after step 36" in one["failure_reason"]
    assert two["after"] == "died" and two["end"] == "finished" and two["failure_reason"] is None
    assert two["started_from"] == {"tier": "checkpoint", "step": 30, "directory": D}
    assert (two["steps_committed"], two["steps_recomputed"]) == (10, 7)
    assert abs(two["gap_before_s"] - (18.7 - (3 + 3.6))) < 1e-6   # from attempt 1's last event
    # The time the client was down is recovery, the recomputed steps wasted progress; it all adds up.
    gp = report["goodput"]
    assert gp["badput_seconds"]["recovery"] >= two["gap_before_s"] - 1e-6
    assert gp["badput_seconds"]["wasted_progress"] > 0
    assert abs(gp["productive_seconds"] + sum(gp["badput_seconds"].values()) - gp["wall_seconds"]) < 1e-6
    assert abs(report["wall_seconds"] - 23) < 1e-6


def test_a_restart_without_a_checkpoint_recomputes_every_committed_step():
    first, _ = killed_then_resumed()
    again = attempt_start(20, "r2", steps=5) + [ev(22.5, "state_initialized", seed=0, state_bytes=64)]
    again += [ev(23 + 0.1 * s, "step_committed", step=s, loss=loss(s)) for s in range(5)]
    report = build_report(first + again)
    assert report["steps_lost"] == 37 and report["steps_completed"] == 5 and len(report["losses"]) == 5
    assert report["attempts"][1]["started_from"]["tier"] == "seed"
    assert report["attempts"][1]["steps_recomputed"] == 37
    assert "the event log ends without run_finished after step 4" in report["failure_reason"]


def test_extending_a_finished_run_loses_nothing_and_the_idle_time_is_not_the_runs():
    first = attempt_start(0, "r1", steps=4) + [ev(2.5, "state_initialized", seed=0, state_bytes=64)]
    first += [ev(3 + s, "step_committed", step=s, loss=loss(s)) for s in range(4)]
    first += [ev(6.5, "checkpoint_saved", worker="w0", step=4, directory=D),
              # written by a build from before the digest named its algorithm: a sha256 of bare hex digits
              ev(7, "run_finished", final_state_sha256="cd" * 32, replica_hashes={"w0": "cd" * 32},
                 client_peak_rss_bytes=1)]
    later = 10_000.0   # extended hours later (by this build)
    second = attempt_start(later, "r2", steps=6) + [
        ev(later + 3, "run_resumed", step=4, directory=D, tier="checkpoint", bytes=64, state_bytes=64,
           losses=[loss(s) for s in range(4)], losses_recorded=True)]
    second += [ev(later + 4 + s, "step_committed", step=4 + s, loss=loss(4 + s)) for s in range(2)]
    second.append(ev(later + 6, "run_finished", final_state_digest=X("ef"), replica_hashes={"w0": X("ef")},
                     client_peak_rss_bytes=1))
    report = build_report(first + second)
    assert report["steps_lost"] == 0 and report["steps_completed"] == 6 and report["final_state_digest"] == X("ef")
    assert report["digest_algorithm"] == "xxh3_128" and report["replica_hashes"] == {"w0": X("ef")}
    assert report["attempts"][1]["after"] == "finished" and report["attempts"][1]["steps_recomputed"] == 0
    assert abs(report["wall_seconds"] - 13) < 1e-6   # 7 s + 6 s: the hours in between were nobody's
    assert abs(report["goodput"]["wall_seconds"] - 13) < 1e-6
    assert report["goodput"]["badput_seconds"]["checkpoint_restore"] > 0   # loaded -> resumed


def test_the_summary_and_the_html_say_where_each_later_attempt_resumed_and_what_it_redid():
    from elastic.report import render_html, summary_text

    first, second = killed_then_resumed()
    events = first + second
    report = build_report(events)
    text = summary_text(report, width=200)
    assert "resumed from" in text and f"checkpoint at step 30 ({D})" in text
    assert "attempt 2" in text and "restarted after the client was lost" in text and "7 committed steps recomputed" in text
    page = render_html(report, events)
    assert "run name <b>x</b>" in page and "config <b>" not in page   # the run's name, labelled as such
    assert "2 attempts" in page and "<h2>Attempts</h2>" in page
    timeline = page[page.index("<svg id='timeline'"):]
    timeline = timeline[:timeline.index("</svg>")]
    assert "attempt 2 (down" in timeline and "resumed from checkpoint step 30" in timeline   # marked on the timeline
    assert "attempt 1" not in timeline   # the first attempt's start is the run's start, not a mark


def test_the_timeline_cuts_the_idle_time_before_an_extension_out_of_its_axis():
    from elastic.report import render_html

    first = attempt_start(0, "r1", steps=2) + [ev(2.5, "state_initialized", seed=0, state_bytes=64)]
    first += [ev(3 + s, "step_committed", step=s, loss=loss(s)) for s in range(2)]
    first.append(ev(5, "run_finished", final_state_digest=X("cd"), replica_hashes={}, client_peak_rss_bytes=1))
    second = attempt_start(86_400, "r2", steps=3) + [
        ev(86_403, "run_resumed", step=2, directory=D, tier="checkpoint", bytes=64, state_bytes=64,
           losses=[loss(0), loss(1)], losses_recorded=True)]
    second += [ev(86_404, "step_committed", step=2, loss=loss(2)),
               ev(86_405, "run_finished", final_state_digest=X("ef"), replica_hashes={}, client_peak_rss_bytes=1)]
    page = render_html(build_report(first + second), first + second)
    timeline = page[page.index("<svg id='timeline'"):]
    timeline = timeline[:timeline.index("</svg>")]
    ticks = [float(x) for x in re.findall(r"text-anchor='middle' fill='#444' >([0-9.]+)</text>", timeline)]
    assert ticks and max(ticks) <= 10, ticks   # 10 s of run on the axis, not a day
    assert "attempt 2 (idle 86395" in timeline


def test_a_log_from_before_the_digest_named_its_algorithm_folds_with_its_sha256_named():
    events = [ev(0, "run_started", run_id="r", slices=2, devices_per_slice=1, steps=1), *commits(0.1, 0, 1),
              ev(1, "run_finished", final_state_sha256="ab" * 32, replica_hashes={"w0": "ab" * 32, "w1": "ab" * 32},
                 client_peak_rss_bytes=1)]
    report = build_report(events)
    assert report["final_state_digest"] == "sha256:" + "ab" * 32 and report["digest_algorithm"] == "sha256"
    assert report["replica_hashes"] == {"w0": "sha256:" + "ab" * 32, "w1": "sha256:" + "ab" * 32}
    assert report["report_version"] == 2 and "final_state_sha256" not in report


def test_an_unfinished_run_names_no_digest_and_no_algorithm():
    report = build_report([ev(0, "run_started", run_id="r", slices=1, devices_per_slice=1, steps=2), *commits(0.1, 0, 1)])
    assert report["final_state_digest"] is None and report["digest_algorithm"] is None


def test_a_resume_from_a_checkpoint_without_losses_folds_and_summarises_the_losses_it_has():
    """A run started from a checkpoint that recorded no losses (MaxText's): the steps before it are None, and
    the summary, the HTML and the verdict take the losses there are."""
    from chaos.verdict import compare_trajectory
    from elastic.report import render_html, summary_text

    events = attempt_start(0, "r1", steps=4) + [
        ev(3, "run_resumed", step=2, directory=D, tier="checkpoint", bytes=64, state_bytes=64,
           losses=[float("nan"), float("nan")], losses_recorded=False)]
    events += [ev(4 + s, "step_committed", step=s, loss=loss(s)) for s in (2, 3)]
    events.append(ev(7, "run_finished", final_state_digest=X("cd"), replica_hashes={}, client_peak_rss_bytes=1))
    report = build_report(events)
    assert report["losses"] == [None, None, loss(2), loss(3)]
    text = summary_text(report, width=200)
    assert f"{loss(2):.4f} → {loss(3):.4f} (steps 0-1: no loss recorded)" in text, text
    assert "<polyline" in render_html(report, events)
    assert compare_trajectory(report["losses"], [None, None, loss(2), loss(3)], final_digest=X("cd"),
                              reference_digest=X("cd")) == ("identical", None)
    assert compare_trajectory(report["losses"], [1.0, 1.0, loss(2), loss(3)], final_digest=X("cd"),
                              reference_digest=X("cd")) == ("within_tolerance", None)   # not comparable: not bits
    assert compare_trajectory(report["losses"], [1.0, 1.0, 9.0, loss(3)], final_digest=None,
                              reference_digest=None) == ("diverged", 2)


def test_an_attempt_stopped_by_ctrl_c_is_stopped_not_died_and_the_next_one_continues_it():
    from elastic import run_records
    from elastic.report import summary_text

    first = attempt_start(0, "r1") + commits(3, 0, 5) + [ev(4, "run_stopped", signal="SIGINT")]
    report = build_report(first)
    [attempt] = report["attempts"]
    assert attempt["end"] == "stopped" and report["failure_reason"] == "stopped by the user (SIGINT) after step 4"
    assert not run_records.client_died(first)   # its workers went home: nobody to re-attach
    second = attempt_start(10, "r2", steps=5) + commits(13, 0, 5) + [
        ev(14, "run_finished", final_state_digest=X("cd"), replica_hashes={}, client_peak_rss_bytes=1)]
    report = build_report(first + second)
    assert report["attempts"][1]["after"] == "stopped" and report["finished"]
    assert "continued after the user stopped it" in summary_text(report, width=200)


def test_a_refused_re_attach_changes_nothing_and_the_next_attempt_follows_the_one_before_it():
    """Attempt 1's client is killed; attempt 2 brings other programs and the live workers refuse it; attempt 3 (the
    right command) re-attaches them: its gap and "after" are attempt 1's, and it re-attaches."""
    from elastic import run_records
    from elastic.report import summary_text

    first = attempt_start(0, "r1") + commits(3, 0, 5)
    refused = attempt_start(20, "r2") + [ev(21.5, "attach_refused", error="AttachRefusedError: other programs")]
    assert run_records.client_died(first + refused)   # attempt 1's workers still wait for the right client
    third = attempt_start(30, "r3", steps=5) + [
        ev(31.5, "client_attached", run_id="r1", generation=2, steps=5,
           workers={"w0": {**ATTACHED, "pid": 1}, "w1": {**ATTACHED, "pid": 2}}, lost=[], committed=5,
           downtime_seconds=27.0),
        ev(32, "run_finished", final_state_digest=X("cd"), replica_hashes={}, client_peak_rss_bytes=1)]
    report = build_report(first + refused + third)
    one, two, three = report["attempts"]
    assert two["end"] == "refused" and two["failure_reason"].startswith("AttachRefusedError")
    assert three["after"] == "died" and three["gap_before_s"] == 30 - one["ended_at"]
    assert report["finished"] and report["failure_reason"] is None
    assert "restarted after the client was lost" in summary_text(report, width=200)
