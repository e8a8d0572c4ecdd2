"""Test helper: run `elastic run` in a subprocess and signal workers from outside."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def read_events(path):
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def run_with_faults(tmp_path, overrides, faults, timeout=240):
    """faults: list of (after_committed_step, worker_id, signal). Returns (report, events, injected)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "elastic.cli", "run", "tiny", "run_name=faulted", f"base_output_directory={tmp_path}",
           "--quiet", *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    events_path = pathlib.Path(tmp_path) / "faulted" / "events.jsonl"
    pending = sorted(faults, key=lambda f: f[0])
    injected = []
    deadline = time.monotonic() + timeout
    try:
        while pending and proc.poll() is None and time.monotonic() < deadline:
            events = read_events(events_path)
            committed = max((e["step"] for e in events if e["kind"] == "step_committed"), default=-1)
            pids = {e["worker"]: e["pid"] for e in events if e["kind"] == "worker_registered"}
            while pending and committed >= pending[0][0]:
                _, worker, sig = pending.pop(0)
                os.kill(pids[worker], sig)
                injected.append({"t": time.time(), "worker": worker, "signal": sig})
            time.sleep(0.02)
        out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not pending, f"faults not injected: {pending}\n{err if proc.returncode is not None else ''}"
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in pathlib.Path(tmp_path).rglob("*.log"))
        raise AssertionError(f"run failed ({proc.returncode}):\n{out}\n{err}\n{logs}")
    report = json.loads((pathlib.Path(tmp_path) / "faulted" / "report.json").read_text())
    return report, read_events(events_path), injected


__all__ = ["run_with_faults", "read_events", "signal"]
