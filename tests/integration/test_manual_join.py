"""Workers that join by themselves (``elastic_launcher=none``): the path a Kubernetes pod takes, on loopback.

The client starts with a fixed address, run id and secret and launches nothing. Three ``elastic worker``
processes are started by hand with the command the client printed (two slices and a spare), plus one with a wrong
secret, which is refused. Once
steps are committed an active worker is SIGKILLed: the spare takes its slice, and a fourth worker started like a
restarted pod joins as the new spare. Then the client itself is SIGKILLed and started again with the same command
(a Job's pod restarted with ``restartPolicy: OnFailure``): it re-attaches the workers, which waited for it. The
workers share the client's compilation cache (a shared volume in a cluster), so the newcomer loads the programs
instead of compiling them. The run ends bit-identical to the reference, and every worker it did not lose exits 0
when it ends.
"""

import json
import os
import shlex
import socket
import subprocess
import sys
import time

from tests.conftest import ROOT, run_cli
from tests.support.events import live_events

RUN_ID, SECRET = "manual-join", "s3cret-for-this-test"
# Long enough (a few seconds of steps after the kill) for the replacement to start JAX and join before the end.
MODEL = ["tiny", "steps=600", "dcn_data_parallelism=2", "ici_fsdp_parallelism=1", "elastic_microbatches=2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(what: str, predicate, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_workers_started_by_hand_train_and_a_replacement_joins_as_a_spare(tmp_path):
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), ELASTIC_RUN_SECRET=SECRET)
    env.pop("XLA_FLAGS", None)
    run_dir = tmp_path / "m"
    command = [sys.executable, "-m", "elastic.cli", "run", *MODEL, "elastic_spares=1", "elastic_launcher=none",
               f"elastic_controller_address=127.0.0.1:{port}", f"elastic_run_id={RUN_ID}", "run_name=m",
               f"base_output_directory={tmp_path}", "elastic_client_grace_seconds=60",
               # The spare holds no state, so it has no client grace: it waits for the restarted client only as long
               # as its lease, which must outlast the restart on a loaded host (5 s did not, once).
               "elastic_worker_lease_seconds=15", "--quiet"]
    client = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / "client.log", "wb"))
    workers: dict[str, subprocess.Popen] = {}
    printed: list[str] = []   # the command the client printed, as it printed it

    def start(name: str, secret: str = SECRET) -> None:
        workers[name] = subprocess.Popen(
            [sys.executable, "-m", "elastic.cli", *printed[1:], "--worker-id", name,
             "--compilation-cache-dir", str(tmp_path / "jax_cache")],
            env=dict(env, ELASTIC_RUN_SECRET=secret), cwd=tmp_path, stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / f"{name}.log", "wb"))

    try:
        awaited = _wait_for("the command to start workers with", lambda: next(
            (e for e in live_events(run_dir) if e["kind"] == "workers_awaited"), None))
        assert awaited["command"] == f"elastic worker --controller 127.0.0.1:{port} --run-id {RUN_ID} --devices 1"
        printed[:] = shlex.split(awaited["command"])
        for name in ("pod-a", "pod-b", "pod-c"):
            start(name)
        start("pod-intruder", secret="wrong")
        placement = _wait_for("the placement", lambda: next(
            (e for e in live_events(run_dir) if e["kind"] == "placement"), None))
        assert sorted(placement["active"] + placement["spares"]) == ["pod-a", "pod-b", "pod-c"]
        victim = placement["active"][1]
        _wait_for("step 8", lambda: sum(e["kind"] == "step_committed" for e in live_events(run_dir)) >= 8)
        workers[victim].kill()
        start("pod-d")   # what the scheduler does for a pod that died: a new one, with a new name
        _wait_for("the new spare", lambda: any(e["kind"] == "worker_warmed" for e in live_events(run_dir)))
        client.kill()   # the client's pod dies too; the Job starts it again with the same command
        client.wait()
        client = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                                  stderr=open(tmp_path / "client-2.log", "wb"))
        assert client.wait(timeout=240) == 0, (tmp_path / "client-2.log").read_text()[-3000:]
        codes = {name: p.wait(timeout=30) for name, p in workers.items()}
    finally:
        for p in [client, *workers.values()]:
            if p.poll() is None:
                p.kill()
    assert codes[victim] == -9 and codes["pod-intruder"] != 0
    assert all(code == 0 for name, code in codes.items() if name not in (victim, "pod-intruder")), codes

    report = json.loads((run_dir / "report.json").read_text())
    events = live_events(run_dir)
    assert report["finished"] and report["steps_completed"] == 600 and report["steps_lost"] == 0
    failure, restart = report["failures"]
    assert failure["workers"] == [victim] and failure["path"] == "replace", failure
    assert restart["error"] == "ClientLostError" and report["client_restarts"] == 1
    assert report["attempts"][1]["reattached"]["workers"] == sorted({"pod-a", "pod-b", "pod-c", "pod-d"} - {victim})
    assert "re-attached 3 live workers" in (tmp_path / "client-2.log").read_text()
    assert report["checkpoint_restores"] == report["snapshot_restores"] == 0
    assert any(e["kind"] == "worker_warmed" and e["worker"] == "pod-d" for e in events)   # the new spare
    assert not any(e["kind"] == "worker_relaunched" for e in events)   # the client launches nothing
    assert [e["command"] for e in events if e["kind"] == "workers_awaited"] == [awaited["command"]]
    assert not any(e["kind"] == "worker_registered" and e["worker"] == "pod-intruder" for e in events)

    _, ref = run_cli(["run", *MODEL, "run_name=ref", "--reference"], tmp_path)
    assert report["final_state_digest"] == ref["final_state_digest"] and report["losses"] == ref["losses"]


def test_a_worker_without_the_devices_of_a_slice_is_named_with_the_flag_that_fits(tmp_path):
    """The printed command simulates a slice's devices (--devices 2); a worker started without them is named, with
    what it has, what a slice needs and the flag, not sent to "run again with more workers"; it is sent home."""
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), ELASTIC_RUN_SECRET=SECRET)
    env.pop("XLA_FLAGS", None)
    client = subprocess.Popen(
        [sys.executable, "-m", "elastic.cli", "run", "tiny", "steps=1", "dcn_data_parallelism=1",
         "ici_fsdp_parallelism=2", "elastic_launcher=none", f"elastic_controller_address=127.0.0.1:{port}",
         f"elastic_run_id={RUN_ID}", "run_name=few", f"base_output_directory={tmp_path}", "--quiet"],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    worker = None
    try:
        awaited = _wait_for("the command to start workers with", lambda: next(
            (e for e in live_events(tmp_path / "few") if e["kind"] == "workers_awaited"), None))
        printed = shlex.split(awaited["command"])
        assert printed[-2:] == ["--devices", "2"], printed
        worker = subprocess.Popen([sys.executable, "-m", "elastic.cli", *printed[1:-2], "--worker-id", "pod-small"],
                                  env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                                  stderr=open(tmp_path / "pod-small.log", "wb"))
        _, err = client.communicate(timeout=240)
        assert client.returncode == 1, err
        assert worker.wait(timeout=60) == 0, (tmp_path / "pod-small.log").read_text()[-3000:]
    finally:
        for p in (client, worker):
            if p is not None and p.poll() is None:
                p.kill()
    [line] = [x for x in err.splitlines() if x.startswith("elastic: run failed:")]
    assert "a slice needs 2 devices" in line and "worker pod-small has 1 cpu device(s)" in line, line
    assert "`elastic worker --devices 2`" in line and "run again with more workers" not in line, line
    [failed] = [e for e in live_events(tmp_path / "few") if e["kind"] == "run_failed"]
    assert failed["error"].startswith("DeviceMismatchError: ")
