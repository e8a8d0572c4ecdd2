"""Runs every benchmark in benchmarks/, one after another, and prints each one's ratio at the end.

Each benchmark runs as a child process (this Python, from the repository
root) with its output streamed as it comes, prefixed by its name. They run
one at a time: each measures wall time, so two at once would slow each
other. Every benchmark prints its ratio last; the summary at the end repeats
that last line for each, with its status and wall time. A benchmark that
fails does not stop the others; the exit status is 1 if any failed.

A script in benchmarks/ that is not in the table below (a new benchmark) is
run too, with no arguments.

Usage: .venv/bin/python benchmarks/run_all.py [--quick] [--only NAME ...] [--list]
  --quick      fewer repeats and steps (minutes instead of tens of minutes; noisier figures)
  --only NAME  run only these (repeatable, or comma separated); --list prints the names
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from transfer import MODEL  # noqa: E402  (the ~10 M parameter model of transfer.py)

#: name -> (script, arguments, arguments with --quick)
BENCHMARKS: dict[str, tuple[str, list[str], list[str]]] = {
    "step_time": ("step_time.py", [], ["--steps", "15"]),
    "step_time_10m": ("step_time.py", ["--slices", "2", "--devices", "1", *MODEL],
                      ["--slices", "2", "--devices", "1", "--steps", "10", *MODEL]),
    "compile_cache": ("compile_cache.py", [], []),
    # More steps than its default 150: on a loaded host a fresh relaunched worker can take longer to be warm.
    "full_strength": ("full_strength.py", ["--steps", "400"], ["--repeats", "1", "--steps", "400"]),
    "transfer": ("transfer.py", [], []),
    "digest": ("digest.py", [], ["--repeats", "3"]),
    "recovery_latency": ("recovery_latency.py", [], ["--repeats", "2"]),
    "recovery_vs_restart": ("recovery_vs_restart.py", [], ["--kills", "2"]),
    "control_plane_scale": ("control_plane_scale.py", [], ["--counts", "256,1024", "--window", "5"]),
    "backup_cost": ("backup_cost.py", [], ["--repeats", "1", "--steps", "40"]),
    "pipeline_bubble": ("pipeline_bubble.py", [], ["--microbatches", "8", "--steps", "2"]),
    "pipeline_bubble_workers": ("pipeline_bubble.py", ["--workers"],
                                ["--workers", "--microbatches", "8", "--steps", "2"]),
    "pool_start": ("pool_start.py", [], ["--repeats", "1"]),
    "pool_scale": ("pool_scale.py", [], ["--hosts", "100,1000"]),
}


def available() -> dict[str, tuple[str, list[str], list[str]]]:
    """The table's benchmarks whose script exists, then any other script in benchmarks/ (no arguments)."""
    out = {name: spec for name, spec in BENCHMARKS.items() if (HERE / spec[0]).exists()}
    known = {spec[0] for spec in BENCHMARKS.values()}
    for path in sorted(HERE.glob("*.py")):
        if path.name not in known and not path.name.startswith("_") and path.name != pathlib.Path(__file__).name:
            out[path.stem] = (path.name, [], [])
    return out


def last_line(text: str) -> str:
    """The last non-blank line of ``text`` (a benchmark's ratio), stripped; "" if none."""
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")


def run_one(name: str, script: str, args: list[str]) -> tuple[int, float, str]:
    """Runs one benchmark, streaming its stdout prefixed with its name; ``(exit status, seconds, last line)``."""
    cmd = [sys.executable, str(HERE / script), *args]
    print(f"=== {name}: {' '.join(['.venv/bin/python', f'benchmarks/{script}', *args])}", flush=True)
    t0 = time.perf_counter()
    last = ""
    env = dict(os.environ, PYTHONUNBUFFERED="1")   # stream the child's lines as they come
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, bufsize=1, env=env) as proc:
        for line in proc.stdout:
            print(f"[{name}] {line}", end="", flush=True)
            last = last_line(line) or last
    return proc.returncode, time.perf_counter() - t0, last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and steps")
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="run only these (repeatable)")
    ap.add_argument("--list", action="store_true", help="print the benchmark names and exit")
    args = ap.parse_args()
    table = available()
    if args.list:
        for name, (script, full, quick) in table.items():
            print(f"{name:22s} {' '.join([f'benchmarks/{script}', *full])}   (--quick: {' '.join(quick) or 'same'})")
        return 0
    only = [n for item in args.only for n in item.split(",") if n]
    unknown = [n for n in only if n not in table]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(table)}")
    chosen = only or list(table)
    results = {}
    for name in chosen:
        script, full, quick = table[name]
        results[name] = run_one(name, script, quick if args.quick else full)
    print("\n=== summary" + (" (--quick)" if args.quick else ""))
    for name, (rc, seconds, last) in results.items():
        status = "ok" if rc == 0 else f"FAILED ({rc})"
        print(f"{name:22s} {status:11s} {seconds:7.0f} s   {last if rc == 0 else '(no ratio: see its output above)'}")
    return 0 if all(rc == 0 for rc, _, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
