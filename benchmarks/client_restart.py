"""A client restart against a worker crash and against a checkpoint-restart, of the same run, in one invocation.

Each case runs ``elastic run tiny`` (``--slices`` slices of ``--devices``
CPU devices, one spare, a checkpoint every ``--checkpoint-period`` steps) as
a child process and SIGKILLs something once the step counts of the schedule
are committed (``--kills`` times, ``--kill-gap`` steps apart, each in the
middle of a checkpoint period):

- (w) a worker: the active worker of slice 1; the spare takes its slice;
- (c) the client: the supervisor (this script) starts the same command again
  at once, which re-attaches the live workers (the workers' client grace);
- (r) the client, with ``elastic_client_grace_seconds=0``: every worker exits
  with its client (the checkpoint-restart that was the only way back before
  the grace), and the same command again resumes from the newest checkpoint,
  recomputing the steps after it.

For each kill, from the run's ``events.jsonl``: kill -> next committed step
(SIGKILL to the first step committed afterwards that was also dispatched
after it, so computed after it: a step in flight at the kill whose commit
only follows is not counted), and the steps recomputed (committed again). What (c) and (r)
include: the new client's Python start, imports and tracing of the programs
(the supervisor restarts it at once: a real one, a pod or a job scheduler,
adds its own delay to both); (r) also the workers' start, compile (from the
warm compilation cache) and the checkpoint's load. The wall time of one step
is printed for scale.

Prints a row per case (median, min, max of kill -> next committed step; steps
recomputed) and LAST the ratios (c)/(w) (the issue's goal: under 3) and
(r)/(c).

Usage: .venv/bin/python benchmarks/client_restart.py [--kills 2] [--kill-gap 150] [--checkpoint-period 20]
       [--slices 2] [--devices 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from _cli import ROOT


def _events(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def _committed(events) -> int:
    return len({e["step"] for e in events if e["kind"] == "step_committed"})


def _start(base: pathlib.Path, name: str, args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return subprocess.Popen([sys.executable, "-m", "elastic.cli", *args, f"base_output_directory={base}",
                             f"run_name={name}", "--quiet"], env=env, cwd=base, stdout=subprocess.DEVNULL,
                            stderr=open(base / f"{name}.client.log", "ab"))


def _wait_for_step(proc, run_dir: pathlib.Path, step: int) -> None:
    deadline = time.monotonic() + 900
    while _committed(_events(run_dir)) < step:
        if proc.poll() is not None:
            raise SystemExit(f"{run_dir.name}: the client exited ({proc.returncode}) before step {step}; see "
                             f"{run_dir.parent / (run_dir.name + '.client.log')}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{run_dir.name}: no step {step} within 900 s")
        time.sleep(0.01)


def _kill(pid: int) -> float:
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    return t


def run_case(base: pathlib.Path, name: str, args: list[str], kill_steps: list[int], what: str) -> list[dict]:
    """Runs one case to its end; returns ``[{"t": kill time, "frontier": committed then}]`` per kill."""
    run_dir = base / name
    proc = _start(base, name, args)
    kills = []
    for step in kill_steps:
        _wait_for_step(proc, run_dir, step)
        events = _events(run_dir)
        if what == "worker":
            placement = [e for e in events if e["kind"] in ("placement", "recovery_decision", "grown",
                                                              "placement_changed") and e.get("active")][-1]
            victim = placement["active"][1]
            pid = next(e["pid"] for e in reversed(events) if e["kind"] == "worker_registered" and e["worker"] == victim)
            kills.append({"t": _kill(pid), "frontier": _committed(events)})
        else:
            kills.append({"t": _kill(proc.pid), "frontier": _committed(events)})
            proc.wait()
            if what == "restart":   # the client's death took the workers (no grace): make sure they are gone
                for e in events:
                    if e["kind"] == "worker_registered":
                        try:
                            os.kill(e["pid"], signal.SIGKILL)
                        except ProcessLookupError:
                            pass
            proc = _start(base, name, args)   # the supervisor: the same command again, at once
    if proc.wait(timeout=1800) != 0:
        raise SystemExit(f"{name}: the run failed; see {base / (name + '.client.log')}")
    events = _events(run_dir)
    for k in kills:
        # The first step committed after the kill that was dispatched after it (computed after it: not a step in
        # flight at the kill whose commit the recovery only recorded).
        dispatched = {}
        after = None
        for e in events:
            if e["kind"] == "step_dispatched":
                dispatched[e["step"]] = e["t"]
            elif e["kind"] == "step_committed" and e["t"] > k["t"] and dispatched.get(e["step"], 0) > k["t"]:
                after = e
                break
        k["kill_to_next_commit"] = after["t"] - k["t"]
        k["steps_recomputed"] = max(0, k["frontier"] - after["step"])
    report = json.loads((run_dir / "report.json").read_text())
    if not report.get("finished") or report.get("steps_lost") != sum(k["steps_recomputed"] for k in kills):
        print(f"note: {name}: report steps_lost {report.get('steps_lost')}, kills "
              f"{[k['steps_recomputed'] for k in kills]}")
    steps = [e for e in events if e["kind"] == "step_committed" and not e.get("recovered")]
    gaps = sorted(b["t"] - a["t"] for a, b in zip(steps, steps[1:]) if b["step"] == a["step"] + 1)
    return [{**k, "step_seconds": gaps[len(gaps) // 2] if gaps else float("nan")} for k in kills]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--kill-gap", type=int, default=150)
    ap.add_argument("--checkpoint-period", type=int, default=20)
    ap.add_argument("--slices", type=int, default=2)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--out", default="", help="keep the runs' directories here (default: a temporary directory)")
    a = ap.parse_args()
    base = pathlib.Path(a.out or tempfile.mkdtemp(prefix="client-restart-")).resolve()
    base.mkdir(parents=True, exist_ok=True)
    # Kills in the middle of a checkpoint period, the first after the run is warm.
    kill_steps = [a.kill_gap * (i + 1) + a.checkpoint_period // 2 for i in range(a.kills)]
    steps = kill_steps[-1] + a.kill_gap
    common = ["run", "tiny", f"dcn_data_parallelism={a.slices}", f"ici_fsdp_parallelism={a.devices}",
              "elastic_microbatches=0", f"steps={steps}", "elastic_spares=1", "enable_checkpointing=true",
              f"checkpoint_period={a.checkpoint_period}"]
    cases = {
        "(w) worker killed, spare takes over": run_case(base, "worker", common, kill_steps, "worker"),
        "(c) client killed, re-attached": run_case(base, "client", common, kill_steps, "client"),
        "(r) client killed, checkpoint-restart": run_case(base, "restart",
                                                           [*common, "elastic_client_grace_seconds=0"],
                                                           kill_steps, "restart"),
    }
    print(f"{steps} steps, {a.slices} slices x {a.devices} devices, 1 spare, checkpoint every "
          f"{a.checkpoint_period} steps, kills at {kill_steps}; runs in {base}")
    print(f"{'case':40s} {'kill -> next committed step (s)':>32s} {'recomputed':>11s} {'step (s)':>9s}")
    print(f"{'':40s} {'median':>10s} {'min':>10s} {'max':>10s}")
    medians = {}
    for label, kills in cases.items():
        t = [k["kill_to_next_commit"] for k in kills]
        medians[label[:3]] = statistics.median(t)
        print(f"{label:40s} {statistics.median(t):10.2f} {min(t):10.2f} {max(t):10.2f} "
              f"{'/'.join(str(k['steps_recomputed']) for k in kills):>11s} {kills[0]['step_seconds']:9.3f}")
    print(f"ratio client restart / worker kill (goal < 3): {medians['(c)'] / medians['(w)']:.2f}x")
    print(f"ratio checkpoint-restart / client restart: {medians['(r)'] / medians['(c)']:.2f}x")


if __name__ == "__main__":
    main()
