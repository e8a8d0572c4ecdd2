"""Detection latency and kill-to-next-commit time: p50 and p99 over several faults, against the lease.

Runs `elastic chaos tiny` once per fault (one spare; the fault-free reference
is computed once and reused from the cache), each with one fault after a few
committed steps, and reads the faulted run's event log:

- detected after: fault injected -> the worker declared dead (or the failure
  detected, whichever came first);
- next commit after: fault injected -> the first step committed after the
  recovery.

Prints, per fault kind, p50 and p99 (nearest rank) of both, and last the
ratio of detection p99 to the configured lease (`elastic_lease_seconds`: a
hang can only be detected by the lease; a crash is seen earlier, by the
health watch stream ending).
Usage: .venv/bin/python benchmarks/recovery_latency.py [--repeats 5]
"""

import argparse
import math
import pathlib
import sys
import tempfile

from _cli import ROOT, run_elastic

sys.path.insert(0, str(ROOT))

from elastic.config_loading import load_config  # noqa: E402

FAULTS = {
    "crash (SIGKILL)": "kill:slice={v}@step=3",
    "hang (SIGSTOP)": "hang:slice={v}@step=3",
    "partition": "partition(for=5s):slice={v}@step=3",
}


def one(base: pathlib.Path, name: str, spec: str) -> tuple[float, float]:
    report, events = run_elastic(base, name, ["chaos", "tiny", "steps=20", "elastic_spares=1", "--faults", spec],
                                 timeout=600)
    t_fault = next(e["t"] for e in events if e["kind"] == "fault_injected")
    t_recovered = next(e["t"] for e in events if e["kind"] == "recovered" and e["t"] > t_fault)
    t_next = next(e["t"] for e in events if e["kind"] == "step_committed" and e["t"] > t_recovered)
    return report["faults"][0]["detected_after_s"], t_next - t_fault


def _q(values, q: float) -> float:
    """The nearest-rank ``q`` quantile (with few samples, p99 is the worst one)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    p99 = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(tmp)
        for kind, spec in FAULTS.items():
            runs = [one(base, f"{kind.split()[0]}-{i}", spec.format(v=i % 4)) for i in range(args.repeats)]
            detect = [d for d, _ in runs]
            commit = [c for _, c in runs]
            print(f"{kind:16s} detected after: p50 {_q(detect, .5) * 1e3:6.0f} ms, p99 {_q(detect, .99) * 1e3:6.0f} ms   "
                  f"fault to next committed step: p50 {_q(commit, .5) * 1e3:6.0f} ms, p99 {_q(commit, .99) * 1e3:6.0f} ms"
                  f"   ({args.repeats} faults, tiny, 4 slices x 2 devices + 1 spare)")
            p99[kind] = _q(detect, .99)
        lease = load_config("tiny").elastic_lease_seconds
        print("detection p99 / lease (" + f"{lease:g} s): "
              + "   ".join(f"{k.split()[0]} {v / lease:.2f}" for k, v in p99.items()))


if __name__ == "__main__":
    main()
