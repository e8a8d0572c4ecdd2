"""Start-up with and without the shared compilation cache, in one invocation.

Runs `elastic run tiny steps=5` (4 slices x 2 devices + 1 spare: five worker
processes) three ways, each in a fresh output directory except the last:

- off:  `jax_cache_dir=off`, every worker compiles every program (the baseline);
- cold: an empty cache: one worker compiles and writes it, the others read;
- warm: the cache the cold run filled (a second run of the same model, or a
  chaos run after its reference).

For each: wall seconds of the command, seconds from launch to the first
committed step, and the workers' compile seconds (sum and max). Prints the
ratios against `off` last.
Usage: .venv/bin/python benchmarks/compile_cache.py [--repeats 1]
"""

import argparse
import pathlib
import statistics
import tempfile
import time

from _cli import run_elastic


def one(base: pathlib.Path, name: str, cache: str) -> dict:
    t0 = time.perf_counter()
    _, events = run_elastic(base, name, ["run", "tiny", "steps=5", "elastic_spares=1", f"jax_cache_dir={cache}"])
    wall = time.perf_counter() - t0
    started = next(e["t"] for e in events if e["kind"] == "run_started")
    first = next(e["t"] for e in events if e["kind"] == "step_committed")
    compile_s = next(e["compile_seconds"] for e in events if e["kind"] == "programs_loaded")
    return {"wall": wall, "to_first_step": first - started, "compile_sum": sum(compile_s.values()),
            "compile_max": max(compile_s.values())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {"off": [], "cold": [], "warm": []}
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            base = pathlib.Path(tmp)
            rows["off"].append(one(base, f"off{i}", "off"))
            rows["cold"].append(one(base, f"cold{i}", str(base / "cache")))
            rows["warm"].append(one(base, f"warm{i}", str(base / "cache")))
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in rows.items()}
    for k, m in med.items():
        print(f"cache {k:4s}: wall {m['wall']:5.1f} s   launch -> first step {m['to_first_step']:5.1f} s   "
              f"worker compile seconds: sum {m['compile_sum']:5.1f}, max {m['compile_max']:5.1f}   "
              f"(tiny, 5 workers x 2 devices, {args.repeats} run(s))")
    for k in ("cold", "warm"):
        print(f"{k} / off: launch -> first step {med[k]['to_first_step'] / med['off']['to_first_step']:.2f}x, "
              f"compile sum {med[k]['compile_sum'] / med['off']['compile_sum']:.2f}x")


if __name__ == "__main__":
    main()
