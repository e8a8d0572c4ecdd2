"""Detection latency and kill-to-next-commit time, median over several faults.

Runs `elastic run tiny` with one spare per fault, kills (SIGKILL) or hangs
(SIGSTOP) a worker after a few committed steps, and reads the event log.
Usage: .venv/bin/python benchmarks/recovery_latency.py [--repeats 3]
"""

import argparse
import pathlib
import signal
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.chaos.faults import run_with_faults  # noqa: E402


def measure(sig, repeats):
    detect, commit = [], []
    for i in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            _, events, injected = run_with_faults(pathlib.Path(tmp), ["steps=20", "elastic_spares=1"],
                                                  [(3, f"w{i % 4}", sig)])
            t_kill = injected[0]["t"]
            dead = next(e["t"] for e in events if e["kind"] == "worker_dead")
            first = next(e["t"] for e in events if e["kind"] == "failure_detected")
            nxt = next(e["t"] for e in events if e["kind"] == "step_committed" and e["t"] > t_kill
                       and e.get("epoch", 1) > 1)
            detect.append(min(first, dead) - t_kill if sig == signal.SIGKILL else dead - t_kill)
            commit.append(nxt - t_kill)
    return statistics.median(detect), statistics.median(commit)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for name, sig in (("crash (SIGKILL)", signal.SIGKILL), ("hang (SIGSTOP)", signal.SIGSTOP)):
        d, c = measure(sig, args.repeats)
        print(f"{name}: detection median {d * 1e3:.0f} ms, kill to next committed step median {c * 1e3:.0f} ms "
              f"({args.repeats} faults)")


if __name__ == "__main__":
    main()
