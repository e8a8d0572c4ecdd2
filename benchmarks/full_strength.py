"""Time to full strength after a kill, with and without a standby process, in one invocation.

Runs `elastic chaos tiny` (4 slices x 2 devices + 1 spare, one kill after a
few steps) alternately with `elastic_standby_workers=0` (a relaunch is forked
from the run's zygote, `runtime/launch/zygote.py`, and starts its JAX backend; it was a
fresh Python + JAX process before the zygote) and `=1` (a relaunch takes over a
process started ahead of need, backend up), all sharing one compilation cache
(warmed by a first run that is not counted). From each faulted run's event log:

- spare serving: kill -> the spare replaced the dead slice (`recovered`);
- full strength: kill -> the relaunched worker loaded the programs and is a
  warm spare again (`worker_warmed` of the worker that replaced the dead one),
  so the run could survive the next kill as it survived this one.

Prints the medians and, last, the ratio standby/no-standby ("fresh") of full strength.
Usage: .venv/bin/python benchmarks/full_strength.py [--repeats 3] [--steps 150]
"""

import argparse
import pathlib
import statistics
import tempfile

from _cli import run_elastic


def one(base: pathlib.Path, name: str, standby: int, steps: int) -> tuple[float, float]:
    _, events = run_elastic(base, name, ["chaos", "tiny", f"steps={steps}", "elastic_spares=1",
                                         f"elastic_standby_workers={standby}", "--faults", "kill:slice=1@step=5"])
    t_fault = next(e["t"] for e in events if e["kind"] == "fault_injected")
    t_spare = next(e["t"] for e in events if e["kind"] == "recovered" and e["t"] > t_fault)
    relaunched = next(e["worker"] for e in events if e["kind"] == "worker_relaunched" and e["t"] > t_fault)
    warmed = [e["t"] for e in events if e["kind"] == "worker_warmed" and e["worker"] == relaunched]
    if not warmed:
        raise SystemExit(f"{name}: the relaunched worker {relaunched} never became a warm spare; use more --steps")
    return t_spare - t_fault, warmed[0] - t_fault


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(tmp)
        one(base, "warmup", 1, args.steps)   # fills the compilation cache; not counted
        runs = {0: [], 1: []}
        for i in range(args.repeats):
            for standby in (0, 1):
                runs[standby].append(one(base, f"standby{standby}-{i}", standby, args.steps))
        full = {}
        for standby, label in ((0, "fork, no standby"), (1, "standby process")):
            spare = statistics.median(s for s, _ in runs[standby])
            full[standby] = statistics.median(f for _, f in runs[standby])
            print(f"relaunch by {label:16s} kill -> spare serving: median {spare:5.2f} s   kill -> full strength "
                  f"(relaunched worker warm): median {full[standby]:5.2f} s   "
                  f"(min {min(f for _, f in runs[standby]):.2f}, max {max(f for _, f in runs[standby]):.2f}; "
                  f"{args.repeats} kills, tiny, 4 slices x 2 devices + 1 spare)")
        print(f"full strength, standby / fresh: {full[1] / full[0]:.2f}x")


if __name__ == "__main__":
    main()
