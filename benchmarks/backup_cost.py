"""What keeping a backup of the state costs the active slices: step time with no backup, with a shadow spare
(``elastic_shadow_spares``) and with in-memory snapshots (``elastic_snapshot_interval``).

The same run (the bundled model, ``slices`` x ``devices``, one spare) in the
three modes, alternated ``--repeats`` times in this invocation so all see the
same host. A shadow gets every step's reduced chunks from each rank (pushes
not waited for) and applies them; a snapshot is written by one replica every
``--interval`` steps from a background thread, and streamed to the spare's
host. The active slices' step time should not move. Step time: the report's
``step_seconds_median`` (median interval between commits).

Usage: .venv/bin/python benchmarks/backup_cost.py [--slices 2] [--devices 1] [--steps 60] [--repeats 3]
                                                [--interval 5] [key=value ...]
Prints each run, the medians and the ratios shadow / none and snapshot / none (last).
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
    ap.add_argument("--interval", type=int, default=5, help="steps between snapshots")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = ap.parse_args()
    base_args = ["run", "tiny", f"dcn_data_parallelism={args.slices}", f"ici_fsdp_parallelism={args.devices}",
                 f"steps={args.steps}", "elastic_spares=1", *args.overrides]
    modes = {"none": [], "shadow": ["elastic_shadow_spares=true"],
             "snapshot": [f"elastic_snapshot_interval={args.interval}"]}
    times: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="backup-cost-") as tmp:
        base = pathlib.Path(tmp)
        run_elastic(base, "warm", [*base_args, "steps=5"])   # fills the compilation cache for all
        for i in range(args.repeats):
            for mode, extra in modes.items():
                report, events = run_elastic(base, f"r{i}-{mode}", [*base_args, *extra])
                times[mode].append(report["step_seconds_median"])
                note = {"shadow": f" ({sum(e['kind'] == 'shadow_behind' for e in events)} shadow_behind)",
                        "snapshot": f" ({sum(e['kind'] == 'snapshot_copied' for e in events)} snapshots copied, "
                                    f"{sum(e['kind'] == 'snapshot_failed' for e in events)} failed)"}.get(mode, "")
                print(f"repeat {i} {mode:8s}: step {1e3 * report['step_seconds_median']:.1f} ms{note}", flush=True)
    med = {m: statistics.median(t) for m, t in times.items()}
    print("median step: " + ", ".join(f"{m} {1e3 * t:.1f} ms" for m, t in med.items()))
    print(f"ratio shadow / none: {med['shadow'] / med['none']:.3f}x, snapshot / none: "
          f"{med['snapshot'] / med['none']:.3f}x ({args.slices} x {args.devices}, one spare, "
          f"a snapshot every {args.interval} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
