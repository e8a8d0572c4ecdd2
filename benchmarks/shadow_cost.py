"""What a shadow spare costs the active slices: step time with ``elastic_shadow_spares`` on and off.

The same run (the bundled model, ``slices`` x ``devices``, one spare), with
the spare shadowing the state and without, alternated ``--repeats`` times in
this invocation so both see the same host. A shadow gets every step's reduced
chunks from each rank (pushes not waited for) and applies them; the active
slices' step time should not move. Step time: the report's
``step_seconds_median`` (median interval between commits).

Usage: .venv/bin/python benchmarks/shadow_cost.py [--slices 2] [--devices 1] [--steps 60] [--repeats 3]
                                                [key=value ...]
Prints each run, the medians and the ratio shadow / no shadow (last).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _cli import run_elastic  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slices", type=int, default=2)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = ap.parse_args()
    base_args = ["run", "tiny", f"dcn_data_parallelism={args.slices}", f"ici_fsdp_parallelism={args.devices}",
                 f"steps={args.steps}", "elastic_spares=1", *args.overrides]
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="shadow-cost-") as tmp:
        base = pathlib.Path(tmp)
        run_elastic(base, "warm", [*base_args, "steps=5"])   # fills the compilation cache for both
        for i in range(args.repeats):
            for shadow in (False, True):
                report, events = run_elastic(base, f"r{i}-{int(shadow)}",
                                             [*base_args, f"elastic_shadow_spares={str(shadow).lower()}"])
                behind = sum(e["kind"] == "shadow_behind" for e in events)
                times[shadow].append(report["step_seconds_median"])
                print(f"repeat {i} shadow={shadow!s:5s}: step {1e3 * report['step_seconds_median']:.1f} ms"
                      + (f" ({behind} shadow_behind)" if shadow else ""), flush=True)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"median step: no shadow {1e3 * off:.1f} ms, shadow {1e3 * on:.1f} ms")
    print(f"ratio shadow / no shadow: {on / off:.3f}x ({args.slices} x {args.devices}, one spare)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
