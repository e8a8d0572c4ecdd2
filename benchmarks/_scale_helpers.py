"""The control-plane benchmark's parts that need no runtime module: its child processes, what it reads of
them from ``/proc``, and its table and verdicts (``benchmarks/control_plane_scale.py`` runs the rest).

The verdicts (issue 28, "Health at fleet scale"): the client's CPU per worker at the largest count over that at
the smallest (target: within 1.5x), and the crash detection p99 at the largest count against 0.5 s. CPU per worker
is a cost per worker only while the host makes every call asked: a count that made under 90 % of them is
"saturated" (each worker's period stretched, and the client's CPU per worker fell for that reason alone), and the
slope is then "not measured" there, not met.
"""

import ctypes
import json
import math
import os
import pathlib
import resource
import signal
import subprocess
import sys

from _cli import ROOT

SCRIPT = pathlib.Path(__file__).with_name("control_plane_scale.py")   # a child process runs it with --serve
CRASH_TARGET_SECONDS = 0.5     # crash detection p99 at the largest count
SLOPE_TARGET = 1.5             # client CPU per worker, largest count over smallest
KEPT_UP = 0.9                  # a count whose calls made are under this share of those asked is saturated


class Child:
    """One child process of simulated workers ``w{first}`` .. ``w{first + count - 1}``."""

    def __init__(self, controller: str, first: int, count: int, lease: float, secret: str):
        self.ids = [f"w{first + i:05d}" for i in range(count)]
        env = dict(os.environ, ELASTIC_RUN_SECRET=secret, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), "--serve", controller, str(first), str(count),
                                      str(lease)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def wait_ready(self) -> None:
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"a simulated worker process failed to start (exit {self.proc.wait()})")

    def ask(self, command: str) -> dict | None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline()) if command == "report" else None

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def close(self) -> None:
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait()


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` (all its threads), from ``/proc``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a SIGSTOPped victim cannot read end-of-file)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


def raise_file_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def file_room() -> int:
    """File descriptors this host can still open: the kernel's limit minus what is open now."""
    allocated, _, limit = (int(x) for x in open("/proc/sys/fs/file-nr").read().split())
    return limit - allocated


def quantile(values, q: float) -> float:
    """The nearest-rank ``q`` quantile (nan for no values)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def print_header() -> None:
    """The table's header line (one row per count, :func:`print_row`)."""
    print(f"{'workers':>7} {'procs':>5} {'threads':>7} {'idle CPU':>8} {'client CPU':>10} {'mcore/worker':>12} "
          f"{'us/call':>7} {'workers CPU':>11} {'Checks/s':>8} {'calls/s':>7} {'asked':>6} {'period s':>8} "
          f"{'max gap s':>9} {'reopened':>8} {'crash p50/p99 ms':>16} {'hang p50/p99 ms':>15} {'false deaths':>12} "
          f"{'load':>5}")


def print_row(r: dict) -> None:
    """One count's table row and its line of details; adds ``per_worker`` and ``kept_up`` to ``r``."""
    count = r["count"]
    r["per_worker"] = r["client_cpu"] / count
    r["kept_up"] = r["calls_per_s"] >= KEPT_UP * r["asked"]
    crash, hang = r["latency"]["crash"], r["latency"]["hang"]
    false = len(r["false_deaths"]) + r["missed"]
    print(f"{count:>7} {r['processes']:>5} {r['threads']:>7} {r['idle_cpu']:>8.3f} {r['client_cpu']:>10.2f} "
          f"{r['per_worker'] * 1e3:>12.3f} {r['cpu_per_call'] * 1e6:>7.0f} {r['workers_cpu']:>11.2f} "
          f"{r['checks_per_s']:>8.0f} {r['calls_per_s']:>7.0f} {r['asked']:>6.0f} "
          f"{r['polled'] / max(r['checks_per_s'], 1e-9):>8.2f} {r['max_gap']:>9.2f} {r['reopened']:>8} "
          f"{quantile(crash, .5) * 1e3:>7.0f}/{quantile(crash, .99) * 1e3:<8.0f} "
          f"{quantile(hang, .5) * 1e3:>7.0f}/{quantile(hang, .99) * 1e3:<7.0f} {false:>12} {r['load']:>5.1f}"
          + ("" if r["kept_up"] else "  saturated"), flush=True)
    causes = {}
    for _, cause in r["false_deaths"]:
        causes[cause] = causes.get(cause, 0) + 1
    print(f"{'':>7} started and registered in {r['started']:.1f} s, all watched in {r['watched']:.2f} s; "
          f"false deaths by cause {causes or 'none'} ({count - r['polled']} before the window), victims never "
          f"declared {r['missed']}, workers that fenced themselves {r['fenced']}", flush=True)


def verdicts(rows: list[dict]) -> None:
    """The last lines: the slope of the client's CPU per worker and the detection p99 at the largest count."""
    low, high = rows[0], rows[-1]
    kept = [r for r in rows if r["kept_up"]]
    per_call = high["cpu_per_call"] / low["cpu_per_call"]
    print(f"idle (every stream open, no call out): client CPU {low['idle_cpu']:.3f} at {low['count']} workers, "
          f"{high['idle_cpu']:.3f} at {high['count']}")
    if len(kept) >= 2:
        a, b = kept[0], kept[-1]
        slope = b["per_worker"] / a["per_worker"]
        flat = 1 / SLOPE_TARGET <= slope <= SLOPE_TARGET
        kept_line = (f"client CPU per worker {a['count']} -> {b['count']} workers (every call asked made): "
                     f"{a['per_worker'] * 1e3:.3f} -> {b['per_worker'] * 1e3:.3f} mcore = {slope:.2f}x "
                     f"(within {SLOPE_TARGET:g}x: {'yes' if flat else 'no'})")
    else:
        flat, kept_line = False, "fewer than two counts made every call asked: no slope of CPU per worker"
    if high["kept_up"] and low["kept_up"]:
        verdict = f"target (within {SLOPE_TARGET:g}x up to {high['count']}): {'met' if flat else 'NOT met'}"
    else:
        sat = next(r for r in (low, high) if not r["kept_up"])
        verdict = (f"target (within {SLOPE_TARGET:g}x up to {high['count']}): not measured, this host is saturated at "
                   f"{sat['count']} (it made {sat['calls_per_s']:.0f} of the {sat['asked']:.0f} calls/s asked, "
                   f"each worker's Check period stretched from {sat['period']:g} to "
                   f"{sat['polled'] / max(sat['checks_per_s'], 1e-9):.2f} s)")
    print(f"{kept_line}; per call {low['count']} -> {high['count']}: {low['cpu_per_call'] * 1e6:.0f} -> "
          f"{high['cpu_per_call'] * 1e6:.0f} us = {per_call:.2f}x; {verdict}")
    crash = quantile(high["latency"]["crash"], .99)
    hang = quantile(high["latency"]["hang"], .99)
    wrong = len(high["false_deaths"]) + high["missed"]
    print(f"detection p99 at {high['count']} workers: crash (SIGKILL) {crash:.2f} s against the "
          f"{CRASH_TARGET_SECONDS:g} s target = {crash / CRASH_TARGET_SECONDS:.2f}x "
          f"({'met' if crash < CRASH_TARGET_SECONDS else 'NOT met'}), hang (SIGSTOP) {hang:.2f} s; "
          f"{wrong} false or missed deaths")
