"""``elastic status`` and ``elastic stacks``, their pure parts: the stacks' text and file names, the status view of
a run's log (with and without its client's answer), the fold of the stacks a failure kept, and one clear line for a
directory that is not a run's."""

import json
import os
import sys
import threading
from types import SimpleNamespace

import pytest

from elastic.cli import main
from elastic.report import build_report, render_html
from elastic.status import render, status_view, watch
from runtime.control.watchdog import SlowSteps
from runtime.core.stacks import file_name, format_stacks, stacks_path, stacks_text, thread_stacks
from tests.support.events import ev
from tests.support.fake_group import FakeGroup


def _stuck_in_a_named_frame(ready, release):
    ready.set()
    release.wait(10)


def test_thread_stacks_name_every_thread_and_the_frame_it_waits_in():
    ready, release = threading.Event(), threading.Event()
    t = threading.Thread(target=_stuck_in_a_named_frame, args=(ready, release), name="stuck-one")
    t.start()
    try:
        ready.wait(5)
        text = thread_stacks()
    finally:
        release.set()
        t.join()
    assert "Thread stuck-one (" in text and "_stuck_in_a_named_frame" in text
    assert "Thread MainThread (" in text and "test_thread_stacks_name_every_thread" in text


def test_stacks_text_is_cut_at_its_limit():
    text = format_stacks(sys._current_frames(), {}, limit=50)
    assert len(text) < 100 and text.endswith("cut at 50 characters\n")


def test_stacks_files_are_named_by_worker_and_step_relative_to_the_run_directory():
    assert file_name("w3", 12) == "w3-12.txt"
    assert file_name("../evil/w", 1) == ".._evil_w-1.txt"   # never a path out of the folder
    assert stacks_path("w1/h0", 4) == "stacks/w1_h0-4.txt"


def test_several_processes_stacks_read_as_one_text_each_under_its_header():
    text = stacks_text([{"name": "client", "host": "h", "pid": 7, "text": "Thread MainThread (1):\n  x\n"},
                        {"name": "w1", "host": "", "pid": 0, "text": "", "error": "Deadline Exceeded within 2 s"}])
    assert text.startswith("== client on h, pid 7 ==\nThread MainThread")
    assert "== w1 ==\n(no stacks: Deadline Exceeded within 2 s)" in text


class _Stalled(FakeGroup):
    """w1 computes while w0 waits (holding the step up), w2 is silent (hung): whom the watchdog asks for stacks."""

    def __init__(self, events):
        super().__init__(SimpleNamespace(snapshot_interval=0), events)
        self.hung.add("w2")
        self.asked = []

    def progress(self, worker_id):
        return None if worker_id in self.hung else (5, "grad", 9.0) if worker_id == "w1" else (5, "reduce", 0.1)

    def keep_stacks(self, workers, step, timeout=2.0):
        self.asked.append((list(workers), step))
        return super().keep_stacks(workers, step, timeout)


def test_the_watchdog_keeps_the_stacks_of_the_suspects_that_answered_and_names_them_in_their_deaths():
    emitted = []
    events = SimpleNamespace(emit=lambda kind, **f: emitted.append({"kind": kind, **f}))
    group = _Stalled(events)
    opts = SimpleNamespace(replace_stragglers=True, straggler_factor=3.0, straggler_patience=3)
    slow = SlowSteps(group, events, opts, live_spare=lambda: True, queued=lambda: ())
    slow.stalled(SimpleNamespace(workers=["w0", "w1", "w2"], step=5), ["w1", "w2"], 1.0)
    assert group.asked == [(["w1"], 5)]   # the silent w2 is not asked: it would not answer, only delay
    dead = {e["worker"]: (e["cause"], e.get("stacks")) for e in emitted if e["kind"] == "worker_dead"}
    assert dead == {"w1": ("stuck", "stacks/w1-5.txt"), "w2": ("hang", None)}
    [straggler] = [e for e in emitted if e["kind"] == "straggler"]
    assert straggler["worker"] == "w1" and straggler["stacks"] == "stacks/w1-5.txt"


def _log(*, failed=False, recovered=False, ended=False):
    """A two-slice run with a spare: w1 died at step 4 (its stacks kept), w2 replaced it."""
    events = [
        ev(0, "job_started", mode="distributed", config=None, global_batch_size=4, microbatches=2),
        ev(0.1, "run_started", run_id="r1", slices=2, devices_per_slice=1, steps=10),
        *[ev(0.2, "worker_registered", worker=w, address=f"a{w}", devices=1, platform="cpu", pid=1, host=f"h{w}")
          for w in ("w0", "w1", "w2")],
        ev(0.3, "placement", epoch=0, active=["w0", "w1"], spares=["w2"]),
        ev(0.4, "state_initialized", state_bytes=8),
        *[ev(1 + s, "step_committed", step=s, loss=1.0) for s in range(4)],
    ]
    if failed:
        events += [ev(5, "step_watchdog", step=4, seconds=3.0, median_seconds=1.0, pending=["w1"], suspects=["w1"],
                      progress={"w1": [4, "grad", 3.0]}),
                   ev(5.1, "worker_dead", worker="w1", reason="stuck in grad", cause="stuck", stacks="stacks/w1-4.txt"),
                   ev(5.2, "failure_detected", error="WorkerLostError", detail="w1 lost", committed=4),
                   ev(5.3, "recovery_decision", action="replace", dead=["w1"], active=["w0", "w2"], spares=[],
                      reason="a spare")]
    if recovered:
        events += [ev(6, "placement", epoch=1, active=["w0", "w2"], spares=[]),
                   ev(6.1, "recovered", resume_step=4, bytes_moved=8, path="replace")]
    if ended:
        events += [ev(7, "run_finished", replica_hashes={}, client_peak_rss_bytes=1)]
    return events


def test_the_view_from_the_log_alone_shows_every_slice_spare_and_the_committed_step():
    view = status_view(_log(), None, now=ev(10, "x")["t"], client={"note": "its client is not running"})
    assert view["run_id"] == "r1" and view["committed"] == 4 and view["steps"] == 10 and view["ended"] is None
    assert view["slices"] == [{"slice": 0, "worker": "w0"}, {"slice": 1, "worker": "w1"}] and view["spares"] == ["w2"]
    assert {w: (v["role"], v["host"], v["step"], v["lag"]) for w, v in view["workers"].items()} == {
        "w0": ("slice 0", "hw0", 4, 0), "w1": ("slice 1", "hw1", 4, 0), "w2": ("spare", "hw2", None, None)}
    assert view["client"]["answered"] is False and 0 < view["goodput_fraction"] <= 1
    assert view["recovery"] is None
    json.dumps(view)   # --json prints it as it is


def test_a_pool_run_shows_where_it_waits_in_the_queue_then_the_hosts_it_holds():
    from rich.console import Console

    waiting = [ev(0, "pool_waiting", status="queued for 0 s: 2 host(s) asked, 0 held (minimum 1); place 1 in the queue")]
    view = status_view(waiting, None, now=ev(1, "x")["t"])
    assert view["pool"] == {"hosts": 0, "waiting": waiting[0]["status"]}
    console = Console(record=True, width=200)
    console.print(render(view))
    assert "pool: queued for 0 s" in console.export_text()
    held = waiting + [ev(1, "lease_granted", worker=w, host=f"pool-{w}", lease=f"lease-{w}") for w in ("w0", "w1")]
    held.append(ev(2, "lease_returned", worker="w1", why="preempted"))
    assert status_view(held, None, now=ev(3, "x")["t"])["pool"] == {"hosts": 1, "waiting": None}
    assert status_view(_log(), None, now=ev(10, "x")["t"])["pool"] is None   # a run on its own workers


def test_the_live_view_has_each_workers_own_step_phase_lag_memory_and_last_heard():
    live = {"workers": {
        "w0": {"answered": True, "step": 6, "phase": "reduce", "seconds": 0.2, "rss_bytes": 3 << 20,
               "heard_seconds": 0.1},
        "w1": {"answered": True, "step": 5, "phase": "grad", "seconds": 1.5, "rss_bytes": 2 << 20,
               "heard_seconds": 0.3},
        "w2": {"answered": True, "step": -1, "phase": "idle", "seconds": 9.0, "rss_bytes": 1, "heard_seconds": 0.2}}}
    view = status_view(_log(), live, now=ev(10, "x")["t"])
    w0, w1, w2 = (view["workers"][w] for w in ("w0", "w1", "w2"))
    assert (w0["step"], w0["phase"], w0["lag"], w0["rss_bytes"], w0["heard_seconds"]) == (6, "reduce", 0, 3 << 20, 0.1)
    assert (w1["step"], w1["phase"], w1["lag"], w1["phase_seconds"]) == (5, "grad", 1, 1.5)
    assert (w2["step"], w2["phase"], w2["lag"]) == (None, "idle", None)   # a spare: no step yet, lags no one
    assert view["client"]["answered"] is True


def test_a_recovery_in_progress_says_since_when_and_what_it_is_doing_and_the_dead_show():
    view = status_view(_log(failed=True), None, now=ev(8, "x")["t"])
    assert view["recovery"] == {"error": "WorkerLostError", "detail": "w1 lost", "since_seconds": pytest.approx(2.8),
                                "doing": "recovery_decision (action replace)"}
    assert view["workers"]["w1"]["role"] == "dead" and view["workers"]["w1"]["why"] == "stuck in grad"
    done = status_view(_log(failed=True, recovered=True, ended=True), None, now=ev(8, "x")["t"])
    assert done["recovery"] is None and done["ended"] == "run_finished"
    assert [s["worker"] for s in done["slices"]] == ["w0", "w2"]
    from rich.console import Console
    console = Console(width=120, record=True)
    console.print(render(done))
    out = console.export_text()
    assert "ended (run_finished)" in out and "w1" in out and "dead" in out


def test_to_a_pipe_status_writes_plain_frames_as_the_run_goes_and_ends_with_the_last():
    """Not a terminal (``| cat``, a CI log): each frame is plain text, written when it is made (a live view would
    write only when it stops: nothing at all when SIGTERM stops it)."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    written = []   # what the pipe held each time the command waited for its next frame
    with os.fdopen(write_end, "w") as out:
        running = status_view(_log(), {"workers": {}}, now=ev(10, "x")["t"])
        ended = status_view(_log(failed=True, recovered=True, ended=True), None, now=ev(10, "x")["t"])
        watch(running, lambda: ended, out, interval=5.0, sleep=lambda s: written.append(os.read(read_end, 1 << 16)))
    last = os.read(read_end, 1 << 16).decode()
    os.close(read_end)
    assert len(written) == 1, written
    first = written[0].decode()
    assert first.startswith("== ") and "run r1: 4 of 10 steps committed" in first and "client pid" in first, first
    assert "slice 0" in first and "spare" in first and "\x1b" not in first + last, (first, last)
    assert last.startswith("== ") and "ended (run_finished)" in last and "dead" in last, last


def test_the_report_links_the_stacks_a_failure_kept():
    events = _log(failed=True, recovered=True, ended=True)
    report = build_report(events)
    [failure] = report["failures"]
    assert failure["stacks"] == {"w1": "stacks/w1-4.txt"} and failure["kind"] == "straggler"
    assert "<a href='stacks/w1-4.txt'>w1</a>" in render_html(report, events)
    assert build_report(_log())["failures"] == []


@pytest.mark.parametrize("make, says", [
    (lambda d: d / "missing", "is not a directory"),
    (lambda d: d, "is not a run directory: it has no events.jsonl"),
    (lambda d: (d / "events.jsonl").write_text(json.dumps(ev(0, "job_started", mode="distributed")) + "\n") and d,
     "never started"),
])
@pytest.mark.parametrize("command", ["status", "stacks"])
def test_bad_input_is_one_line_and_changes_nothing(tmp_path, capsys, make, says, command):
    run_dir = make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main([command, str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_stacks_of_a_run_whose_client_is_gone_say_so_in_one_line(tmp_path, capsys):
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _log(ended=True)))
    assert main(["stacks", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the run ended (run_finished)" in err


def test_an_rl_runs_samplers_show_with_the_step_they_make_rollouts_for():
    events = _log() + [ev(0.5, "samplers_started", workers=["s3", "s4"]),
                       ev(5, "worker_dead", worker="s4", reason="killed", cause="crash"),
                       ev(5.1, "sampler_relaunched", replaces="s4", worker="s5")]
    live = {"workers": {"s3": {"answered": True, "step": 5, "phase": "rollout", "seconds": 0.1, "rss_bytes": 1,
                               "heard_seconds": 0.1}}}
    view = status_view(events, live, now=ev(10, "x")["t"])
    assert {w: (v["role"], v["step"], v["phase"]) for w, v in view["workers"].items() if w[0] == "s"} == {
        "s3": ("sampler", 5, "rollout"), "s5": ("sampler", None, None), "s4": ("dead", None, "dead")}
    assert view["slices"] == [{"slice": 0, "worker": "w0"}, {"slice": 1, "worker": "w1"}]   # not in the grid
