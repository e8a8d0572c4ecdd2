"""Workers killed while the run starts (compiling, initializing) are replaced as a death mid-step would be."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import jsonschema

from tests.conftest import ROOT

SCHEMA = json.loads((ROOT / "docs/report.schema.json").read_text())


def _kill_when_registered(events_path: pathlib.Path, worker: str, stop: threading.Event, killed: list) -> None:
    """Tails the faulted run's event log; SIGKILLs ``worker`` as soon as it registers (it is compiling then)."""
    while not stop.is_set():
        if events_path.exists():
            for line in events_path.read_text().splitlines():
                try:
                    e = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if e["kind"] == "worker_registered" and e["worker"] == worker:
                    os.kill(e["pid"], signal.SIGKILL)
                    killed.append(e["pid"])
                    return
        time.sleep(0.02)


def test_kills_while_compiling_and_while_initializing_lose_no_step(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    # kill@step=0 fires when the workers have loaded, before they initialize the state.
    cmd = [sys.executable, "-m", "elastic.cli", "chaos", "tiny", "steps=4", "dcn_data_parallelism=2",
           "elastic_spares=2", "run_name=faulted", f"base_output_directory={tmp_path}", "--quiet",
           "--faults", "kill:slice=1@step=0"]
    stop, killed = threading.Event(), []
    tail = threading.Thread(target=_kill_when_registered,
                            args=(tmp_path / "faulted" / "events.jsonl", "w0", stop, killed), daemon=True)
    tail.start()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    finally:
        stop.set()
        tail.join(5)
    assert killed, "w0 never registered"
    report = json.loads((tmp_path / "faulted" / "report.json").read_text())
    jsonschema.validate(report, SCHEMA)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["verdict"] == "pass", report["verdict_reasons"]
    assert report["steps_completed"] == 4 and report["steps_lost"] == 0
    assert report["losses"] == report["reference"]["losses"]
    assert report["final_state_digest"] == report["reference"]["final_state_digest"]
    lost = sorted(w for f in report["failures"] for w in f["workers"])
    assert "w0" in lost and len(lost) == 2, report["failures"]
    assert all(f["path"] == "replace" and f["step"] == 0 for f in report["failures"]), report["failures"]
    assert report["slices_at_end"] == 2
