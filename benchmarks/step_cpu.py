"""CPU time per training step of each process of a run: the client and every worker, read from /proc.

On a loaded two-core host, wall time per step swings with whatever else
runs; CPU time per step is what the runtime itself spends, and it is
steadier. Runs `elastic run` (default: the bundled tiny model, 4 slices x 2
devices, long enough for a window of steady steps), follows its event log,
and over a window of committed steps after the warm-up reads
`/proc/<pid>/stat` (user + system time of every thread) of the client and
each worker (their pids from `worker_registered`). Prints per process the
CPU milliseconds per committed step, then the workers' median and the
client's, last. Compare two trees by running each (same venv, same sitting).

Usage: .venv/bin/python benchmarks/step_cpu.py [--warmup 60] [--window 300] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads, as the kernel sums them)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def follow(path: pathlib.Path, state: dict) -> None:
    """Reads new events of ``path`` into ``state`` (committed step, worker pids)."""
    if not path.exists():
        return
    with open(path) as f:
        f.seek(state.get("offset", 0))
        for line in f:
            if not line.endswith("\n"):
                break
            state["offset"] = state.get("offset", 0) + len(line.encode())
            e = json.loads(line)
            if e["kind"] == "step_committed":
                state["step"] = e["step"]
            elif e["kind"] == "worker_registered":
                state.setdefault("workers", {})[e["worker"]] = e["pid"]


def wait_for_step(path, state, step: int, proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while state.get("step", -1) < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the run ended or stalled before step {step} ({proc.returncode})")
        time.sleep(0.05)
        follow(path, state)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=60, help="steps before the window")
    ap.add_argument("--window", type=int, default=300, help="committed steps measured")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    steps = args.warmup + args.window + 40
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
        env.pop("XLA_FLAGS", None)
        cmd = [sys.executable, "-m", "elastic.cli", "run", "tiny", "dcn_data_parallelism=4", "ici_fsdp_parallelism=2",
               f"steps={steps}", *args.overrides, f"base_output_directory={tmp}", "run_name=cpu", "--quiet"]
        proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        events, state = pathlib.Path(tmp) / "cpu" / "events.jsonl", {}
        try:
            wait_for_step(events, state, args.warmup, proc, 600)
            pids = {"client": proc.pid, **state["workers"]}
            s0, c0 = state["step"], {k: cpu_seconds(p) for k, p in pids.items()}
            wait_for_step(events, state, args.warmup + args.window, proc, 600)
            s1, c1 = state["step"], {k: cpu_seconds(p) for k, p in pids.items()}
        finally:
            try:
                proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                proc.kill()
        if proc.returncode:
            raise SystemExit(f"elastic run failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    n = s1 - s0
    per = {k: (c1[k] - c0[k]) / n * 1e3 for k in pids}
    print(f"{n} steps measured (steps {s0 + 1}-{s1})")
    for k, ms in per.items():
        print(f"  {k}: {ms:.2f} ms CPU per step")
    workers = [v for k, v in per.items() if k != "client"]
    print(f"workers' median: {statistics.median(workers):.2f} ms CPU per step; client: {per['client']:.2f} ms")


if __name__ == "__main__":
    main()
