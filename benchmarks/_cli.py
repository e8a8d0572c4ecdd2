"""Runs `elastic run|chaos` in a child process for a benchmark and reads what the run wrote.

Shared by the benchmarks that measure whole runs: the child gets the CPU
platform, this checkout on its path, no inherited device count (the CLI sets
its own) and no inherited compilation cache (runs under one output directory
share ``<base>/jax_cache``).
"""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_elastic(base: pathlib.Path, name: str, args: list[str], timeout: float = 900,
                env: dict[str, str] | None = None) -> tuple[dict, list[dict]]:
    """``elastic ARGS base_output_directory=BASE run_name=NAME --quiet``; returns (report.json, events).

    ``env``: variables set for the run (its client and the workers it launches) on top of this environment.
    Exits with the run's verdict reasons (or its stderr) when the command fails.
    """
    env = dict(os.environ, **(env or {}), JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "elastic.cli", *args, f"base_output_directory={base}", f"run_name={name}", "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=base, timeout=timeout)
    run_dir = base / name
    report_path = run_dir / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    if proc.returncode != 0:
        why = report.get("verdict_reasons") or proc.stderr[-2000:]
        raise SystemExit(f"elastic {' '.join(args)} failed ({proc.returncode}): {why}")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return report, events


def new_events(path: pathlib.Path, offset: int) -> tuple[list[dict], int]:
    """The complete events a running run appended to its log ``path`` since byte ``offset``, and the offset after
    them ([] and ``offset`` while the log does not exist or has no new whole line)."""
    if not path.exists():
        return [], offset
    events = []
    with open(path) as f:
        f.seek(offset)
        for line in f:
            if not line.endswith("\n"):
                break
            offset += len(line.encode())
            events.append(json.loads(line))
    return events, offset
