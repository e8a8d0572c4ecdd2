"""The client survives its own crash: ``elastic run`` SIGKILLed mid-run, then run again with the same command.

Real processes from outside, as a user meets them: the client is killed with
SIGKILL (its workers are not touched: they run in process groups of their own);
the same command run again within the workers' client grace re-attaches the
live workers, says so, and finishes bit-identical to the reference with no
step lost and no checkpoint or snapshot read. A command whose programs
differ (a changed learning rate) is refused with one line and changes
nothing on the workers, which the right command then re-attaches. With no
client, every worker exits once its grace ran out, leaving nothing behind:
no process, no in-memory snapshot.
"""

import contextlib
import io
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from elastic.cli import main
from tests.conftest import ROOT, processes, run_cli
from tests.support.events import live_events

RUN = ["run", "tiny", "dcn_data_parallelism=2", "ici_fsdp_parallelism=1", "elastic_microbatches=2"]


def _start(args, tmp_path) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen([sys.executable, "-m", "elastic.cli", *args, f"base_output_directory={tmp_path}",
                             "--quiet"], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_for_committed(proc: subprocess.Popen, run_dir: pathlib.Path, committed: int) -> None:
    """Waits (up to 240 s) until ``committed`` steps are in the run's log, the client still running."""
    deadline = time.monotonic() + 240
    while sum(e["kind"] == "step_committed" for e in live_events(run_dir)) < committed:
        assert proc.poll() is None, f"the run ended before {committed} steps: {proc.stderr.read().decode()[-2000:]}"
        assert time.monotonic() < deadline, f"no {committed} steps within 240 s"
        time.sleep(0.05)


def _kill_client_after(proc: subprocess.Popen, run_dir: pathlib.Path, committed: int) -> list[int]:
    """SIGKILLs the client once ``committed`` steps are in its log; returns its workers' pids."""
    _wait_for_committed(proc, run_dir, committed)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return [e["pid"] for e in live_events(run_dir) if e["kind"] == "worker_registered"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free reference of the runs here (150 steps), in one process."""
    _, ref = run_cli([*RUN, "steps=150", "run_name=ref", "--reference"], tmp_path_factory.mktemp("ref"))
    return ref


def _cli_out(argv) -> str:
    """``elastic ARGV``'s standard output, run in this process (a command of its own costs a second of start-up,
    which a short run may not last)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def _status(run_dir) -> dict:
    return json.loads(_cli_out(["status", "--json", str(run_dir)]))


def _alive(pids) -> list[int]:
    live = processes()
    return [p for p in pids if p in live]


def test_a_killed_client_is_re_attached_by_the_same_command_and_a_changed_model_is_refused(tmp_path, reference):
    args = [*RUN, "steps=150", "run_name=rc"]
    run_dir = tmp_path / "rc"
    client = _start(args, tmp_path)
    _wait_for_committed(client, run_dir, 20)
    # From another terminal, while it runs: every worker with its step, a stack of every worker and the client.
    live = _status(run_dir)
    stacks = _cli_out(["stacks", str(run_dir)])
    assert client.poll() is None, "the run ended before it was looked at"
    assert live["client"]["answered"] and [s["worker"] for s in live["slices"]] == ["w0", "w1"]
    assert all(live["workers"][w]["step"] >= 19 and live["workers"][w]["rss_bytes"] > 0 for w in ("w0", "w1"))
    assert [line.split(" on ")[0] for line in stacks.splitlines() if line.startswith("== ")] == \
        ["== client", "== w0", "== w1"]
    assert stacks.count("Thread MainThread (") == 3
    pids = _kill_client_after(client, run_dir, 20)
    assert len(_alive(pids)) == 2, "the workers died with their client"
    gone = _status(run_dir)   # the client is gone: the event log's view
    assert not gone["client"]["answered"] and "not running" in gone["client"]["note"] and gone["committed"] >= 20
    before = live_events(run_dir)

    # The model changed (another learning rate: another apply program): refused, nothing changes on the workers.
    refused, _ = run_cli([*args, "learning_rate=0.5"], tmp_path, check=False)
    assert refused.returncode == 1
    [line] = [x for x in refused.stderr.splitlines() if "cannot re-attach" in x]
    assert "programs" in line and "run_name" in line, line
    assert len(_alive(pids)) == 2
    assert live_events(run_dir)[:len(before)] == before   # the log was appended to, never rewritten

    proc, report = run_cli(args, tmp_path)   # the same command again
    assert "re-attached 2 live workers" in proc.stderr
    assert report["finished"] and report["steps_completed"] == 150 and report["steps_lost"] == 0
    assert report["checkpoint_restores"] == report["snapshot_restores"] == 0
    assert report["client_restarts"] == 1 and report["client_downtime_seconds"] > 0
    last = report["attempts"][-1]
    assert last["reattached"]["workers"] == ["w0", "w1"] and last["started_from"]["tier"] == "live"
    _, refused = report["attempts"][:2]   # the refused command changed nothing: the last follows the killed one
    assert refused["end"] == "refused" and last["after"] == "died" and len(report["attempts"]) == 3
    assert last["gap_before_s"] > last["started_at"] - refused["ended_at"]
    assert not any(e["kind"] in ("state_transferred", "checkpoint_restored", "snapshot_restored")
                   for e in live_events(run_dir)[len(before):])

    assert report["final_state_digest"] == reference["final_state_digest"]
    assert report["losses"] == reference["losses"]
    assert not _alive(pids)   # sent home at the end


def test_with_no_client_every_worker_exits_after_its_grace_and_leaves_nothing(tmp_path):
    shm = tmp_path / "shm"
    args = [*RUN, "steps=400", "run_name=gone", "elastic_client_grace_seconds=3", "elastic_snapshot_interval=2",
            f"elastic_snapshot_directory={shm}"]
    run_dir = tmp_path / "gone"
    pids = _kill_client_after(_start(args, tmp_path), run_dir, 10)
    assert any(shm.rglob("*")), "no snapshot was kept"
    assert len(_alive(pids)) == 2, "the workers died with their client, not after their grace"
    deadline = time.monotonic() + 30
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pids), "a worker outlived its client grace"
    assert not any(shm.iterdir()), f"a worker left its snapshots behind: {sorted(shm.rglob('*'))}"
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("worker-w*.log"))
    assert "no client of run" in logs and "keeping the state" in logs
    assert json.loads((run_dir / "client.json").read_text())["generation"] == 0


def test_a_stopped_client_is_taken_over_and_refused_by_every_worker_when_it_wakes(tmp_path, reference):
    """Split brain: the client is stopped (SIGSTOP: a hung process, Ctrl-Z), a supervisor starts the same command
    again, which takes the run over; when the stopped one wakes, every worker refuses it (or it finds the run
    directory another's before it acts on a failure) and it exits with one line, writing nothing to the run
    directory: the new client finishes the run bit-identical."""
    args = [*RUN, "steps=150", "run_name=zb", "elastic_client_grace_seconds=30"]
    run_dir = tmp_path / "zb"
    zombie = _start(args, tmp_path)
    deadline = time.monotonic() + 240   # for the first client's steps and the successor's attach together
    _wait_for_committed(zombie, run_dir, 15)
    os.kill(zombie.pid, signal.SIGSTOP)
    try:
        successor = _start(args, tmp_path)
        while not any(e["kind"] == "client_attached" for e in live_events(run_dir)):
            assert successor.poll() is None, successor.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    assert zombie.wait(60) == 1
    said = zombie.stderr.read().decode()
    # Told by whichever it meets first: a worker's refusal (generation 1 drives it now), or its own check that
    # the run directory is no longer its own, made before it acts on the failures it finds as it wakes.
    assert "another one took the run over" in said, said[-2000:]
    assert "taken over by generation 1" in said or "the run directory is its own now" in said, said[-2000:]
    assert successor.wait(240) == 0, successor.stderr.read().decode()[-3000:]
    taken = successor.stderr.read().decode()
    assert "is stopped: this one takes the run over" in taken and "re-attached 2 live workers" in taken, taken
    report = json.loads((run_dir / "report.json").read_text())
    assert report["finished"] and report["steps_lost"] == 0 and report["client_restarts"] == 1
    events = live_events(run_dir)
    assert [e["kind"] for e in events].count("run_finished") == 1 and events[-1]["kind"] == "run_finished"
    assert report["final_state_digest"] == reference["final_state_digest"]
    assert report["losses"] == reference["losses"]


def test_a_client_stopped_past_its_workers_lease_takes_its_run_back_when_it_wakes(tmp_path, reference):
    """No supervisor: the client is stopped longer than the workers' lease (a debugger, Ctrl-Z then fg), so
    every worker fences itself and waits; woken, the client finds them fenced and, the run directory still
    being its own, takes its run back as the next generation, as a restarted client would."""
    args = [*RUN, "steps=150", "run_name=tb", "elastic_worker_lease_seconds=1", "elastic_client_grace_seconds=30"]
    run_dir = tmp_path / "tb"
    client = _start(args, tmp_path)
    _wait_for_committed(client, run_dir, 15)
    os.kill(client.pid, signal.SIGSTOP)
    time.sleep(3)   # past the workers' lease: they fence themselves
    os.kill(client.pid, signal.SIGCONT)
    assert client.wait(240) == 0, client.stderr.read().decode()[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["finished"] and report["steps_lost"] == 0 and report["client_restarts"] == 1
    [attached] = [e for e in live_events(run_dir) if e["kind"] == "client_attached"]
    assert attached["generation"] == 1 and sorted(attached["workers"]) == ["w0", "w1"]
    assert json.loads((run_dir / "client.json").read_text())["generation"] == 1
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("worker-w*.log"))
    assert "keeping the state" in logs   # they had fenced themselves
    assert report["final_state_digest"] == reference["final_state_digest"]
    assert report["losses"] == reference["losses"]
