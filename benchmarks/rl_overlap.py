"""RL post-training: what overlapping rollouts with training buys (rl_off_policy_steps=1 against 0), and what a
weight sync costs against a memory copy and against a loopback TCP stream of the same bytes.

1. Overlapped against sequential. The same ``elastic run rl_tiny`` (a larger
   policy than the config's: ``base_emb_dim=64 rl_max_new_tokens=8
   max_target_length=12``, so a step's rollouts and its training each take
   tens of milliseconds) with ``rl_off_policy_steps=1`` and ``=0``, each in a
   fresh run directory, alternated (ABBA) ``--repeats`` times per layout
   (samplers:trainers; default the config's 2:2, and 1:1). Per run, over the
   committed steps after ``--warmup``: wall seconds per step (the event log's
   commit times), and CPU per step of the client and of every worker, read
   from ``/proc/<pid>/stat`` while the run goes (busy cores x wall per step);
   the report's ``rl.overlap``; and how many steps ``s`` had the next step's
   rollouts made before ``s`` committed (what an overlap needs). Both roles
   share this host's cores, so the overlapped step cannot be shorter than
   the CPU per step divided by the cores; the output says where that floor is.
2. Weight sync. The runs' ``weights_synced`` events (bytes, seconds): the
   median sync bandwidth, per mode, against ``np.copyto`` of the same bytes
   (median of several, this process) and a loopback TCP stream of the same
   bytes (a connection kept open, TCP_NODELAY as the data plane sets it, a
   one-byte answer once all arrived; median of several). One more run with
   ``rl_weights_dtype=bfloat16`` shows the bytes halved.

Usage: .venv/bin/python benchmarks/rl_overlap.py [--repeats 3] [--steps 24] [--warmup 4] [--layouts 2:2,1:1]
                                                [key=value ...]
Prints each run, then the ratios; the last line: overlapped / sequential step time and sync / memcpy, sync / link.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from _cli import new_events

ROOT = pathlib.Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
MODEL = ["base_emb_dim=64", "rl_max_new_tokens=8", "max_target_length=12"]
BIG = ["base_emb_dim=256", "base_mlp_dim=1024", "rl_max_new_tokens=8", "max_target_length=12"]   # 6.3 MB of weights


# -- pure helpers (tests/unit/test_bench_helpers.py) ---------------------------------------------------------------

def step_timeline(events: list[dict], warmup: int) -> dict:
    """What the event log of one RL run says about its steps after ``warmup``: ``wall_per_step`` (first commit
    time of the last step less that of step ``warmup``, over the steps between), ``window`` (those two steps),
    ``early`` (steps ``s >= warmup`` whose step ``s + 1`` rollouts were all made before ``s`` committed) and
    ``started`` (whose step ``s + 1`` rollouts had their first call before ``s`` committed) out of ``pairs``,
    and the medians of the rollout and the trainer seconds per step in the window."""
    commits, made, dispatched = {}, {}, {}
    for e in events:
        if e["kind"] == "step_committed":
            commits.setdefault(e["step"], e["t"])
        elif e["kind"] == "rollouts_made":
            made.setdefault(e["step"], e)
        elif e["kind"] == "step_dispatched":
            dispatched[e["step"]] = e["t"]
    last = max(commits)
    if last <= warmup:
        raise ValueError(f"no committed step after the warm-up ({warmup}); the run committed up to {last}")
    pairs = [s for s in range(warmup, last) if s + 1 in made and s in commits]
    window = [s for s in range(warmup + 1, last + 1) if s in commits and s in dispatched]
    return {
        "wall_per_step": (commits[last] - commits[warmup]) / (last - warmup),
        "window": (warmup, last),
        "early": sum(made[s + 1]["t"] < commits[s] for s in pairs),
        "started": sum(made[s + 1]["t"] - made[s + 1]["seconds"] < commits[s] for s in pairs),
        "pairs": len(pairs),
        "rollout_median": statistics.median(made[s]["seconds"] for s in window if s in made),
        "train_median": statistics.median(commits[s] - dispatched[s] for s in window),
    }


def syncs_of(events: list[dict], skip_version0: bool = True) -> list[tuple[int, float]]:
    """``(bytes, seconds)`` of each weight sync (the first version's, before any step, left out by default)."""
    return [(e["bytes"], e["seconds"]) for e in events
            if e["kind"] == "weights_synced" and not (skip_version0 and e["version"] == 0)]


# -- measuring ---------------------------------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


class RunFailed(Exception):
    """A run that failed or stalled: ``events`` holds what its log said so far."""

    def __init__(self, why: str, events: list[dict]):
        super().__init__(why)
        self.events = events


def read_events(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def stop(proc: subprocess.Popen, pids) -> None:
    """Ends a stalled run: its process group (the client's session), then any of its workers still there."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(10)
            break
        except subprocess.TimeoutExpired:
            continue
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_rl(base: pathlib.Path, name: str, args: list[str], warmup: int, steps: int, stall: float = 60,
           first_step: float = 25) -> dict:
    """One ``elastic run rl_tiny ARGS`` in ``base/name``, its processes' CPU read from /proc between the commits
    of step ``warmup`` and step ``steps - 2`` (before the run ends and its processes go). ``RunFailed`` when
    it fails, or commits no step for ``stall`` seconds, or none ``first_step`` seconds after its samplers
    started (it is then stopped)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "elastic.cli", "run", "rl_tiny", f"steps={steps}", *args,
           f"base_output_directory={base}", f"run_name={name}", "--quiet"]
    errlog = base / f"{name}.stderr"
    with open(errlog, "w") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=base, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
    path = base / name / "events.jsonl"
    progress, limit = time.monotonic(), stall
    roles: dict[int, str] = {proc.pid: "client"}
    committed, offset, marks = -1, 0, {}
    start_at, end_at = warmup, steps - 2
    while proc.poll() is None:
        time.sleep(0.02)
        events, offset = new_events(path, offset)
        for e in events:
            if e["kind"] == "samplers_started":   # the programs are built: a first step is seconds away
                progress, limit = time.monotonic(), min(stall, first_step)
            elif e["kind"] == "worker_registered":
                sampler = e["worker"][:1] == "s" and e["worker"][1:].isdigit()
                roles[e["pid"]] = "sampler" if sampler else "trainer"
            elif e["kind"] == "step_committed":
                committed = max(committed, e["step"])
                progress, limit = time.monotonic(), stall
        if time.monotonic() - progress > limit:
            stop(proc, [p for p in roles if p != proc.pid])
            raise RunFailed(f"no step committed for {limit:.0f} s (step {committed} the last); stopped",
                            read_events(path))
        for at in (start_at, end_at):
            if committed >= at and at not in marks:
                marks[at] = (time.monotonic(), {pid: cpu_seconds(pid) for pid in roles})
    proc.wait()
    err = errlog.read_text()
    report_path = base / name / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    if proc.returncode != 0:
        raise RunFailed(f"elastic run rl_tiny {' '.join(args)} failed ({proc.returncode}): "
                        f"{report.get('verdict_reasons') or err[-2000:]}", read_events(path))
    events = read_events(path)
    out = {"report": report, "events": events, **step_timeline(events, warmup)}
    if start_at in marks and end_at in marks:
        (t0, c0), (t1, c1) = marks[start_at], marks[end_at]
        busy: dict[str, float] = {}
        for pid, role in roles.items():
            if c0.get(pid) is not None and c1.get(pid) is not None:
                busy[role] = busy.get(role, 0.0) + (c1[pid] - c0[pid]) / (t1 - t0)
        out["cores"] = busy   # role -> busy cores over the window
        out["cpu_per_step"] = {r: b * out["wall_per_step"] for r, b in busy.items()}
    return out


def memcpy_seconds(nbytes: int, repeats: int = 100) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def loopback_seconds(nbytes: int, repeats: int = 100) -> float:
    """Median seconds to stream ``nbytes`` over a local TCP connection (kept open, TCP_NODELAY both ends) until
    the receiver, in a thread, has them all and answered one byte."""
    listener = socket.create_server(("127.0.0.1", 0))
    payload = memoryview(np.ones(nbytes, dtype=np.uint8).tobytes())

    def serve():
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(nbytes)
        view = memoryview(buf)
        with conn:
            for _ in range(repeats + 1):
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:])
                    if not n:
                        return
                    got += n
                conn.sendall(b"k")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    times = []
    with socket.create_connection(listener.getsockname()) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(repeats + 1):
            t = time.perf_counter()
            sock.sendall(payload)
            sock.recv(1)
            if i:   # the first warms the connection
                times.append(time.perf_counter() - t)
    thread.join(5)
    listener.close()
    return statistics.median(times)


def last_sync_failure(logs: pathlib.Path) -> str:
    """The samplers' last ``sync failed`` line (a run that stalled) and their count, as ``"; ..."``, or ""."""
    lines = [line for f in sorted(logs.glob("worker-s*.log"))
             for line in f.read_text(errors="replace").splitlines() if "sync failed" in line]
    return f"; a sampler logged {len(lines)} failed syncs, the last: {lines[-1].split(' WARNING ')[-1]}" if lines else ""


def mbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="pairs of runs per layout")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4, help="committed steps left out of each run's figures")
    ap.add_argument("--layouts", default="2:2,1:1", help="samplers:trainers, comma-separated")
    ap.add_argument("--big-sync", action="store_true",
                    help="one more sequential run of a 6.3 MB policy (%s, 6 steps; about 40 s), for the sync's "
                         "bandwidth past its fixed cost" % " ".join(BIG))
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = ap.parse_args()
    if args.steps < args.warmup + 4:
        raise SystemExit("--steps must leave at least 4 steps after --warmup")
    cores = len(os.sched_getaffinity(0))
    layouts = [tuple(int(x) for x in lay.split(":")) for lay in args.layouts.split(",")]
    results: dict[tuple, dict[int, list[dict]]] = {}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rl-overlap-") as tmp:
        base = pathlib.Path(tmp)
        print(f"elastic run rl_tiny {' '.join(MODEL + args.overrides)}, {args.steps} steps, the first "
              f"{args.warmup} left out; {cores} cores for every process of a run", flush=True)
        for samplers, trainers in layouts:
            lay = [f"rl_samplers={samplers}", f"dcn_data_parallelism={trainers}", *MODEL, *args.overrides]
            run_rl(base, f"warm-{samplers}-{trainers}", [*lay, "rl_off_policy_steps=1"], 1, 6)  # compile cache
            per = results[(samplers, trainers)] = {0: [], 1: []}
            for i in range(args.repeats):
                for k in ((1, 0) if i % 2 == 0 else (0, 1)):
                    r = run_rl(base, f"r{i}-{samplers}-{trainers}-k{k}", [*lay, f"rl_off_policy_steps={k}"],
                               args.warmup, args.steps)
                    per[k].append(r)
                    cpu, busy = r.get("cpu_per_step", {}), sum(r.get("cores", {}).values())
                    print(f"{samplers}:{trainers} repeat {i} off_policy={k}: {1e3 * r['wall_per_step']:6.1f} ms/step "
                          f"wall, {1e3 * sum(cpu.values()):6.1f} ms/step CPU ({busy:.2f} cores busy: "
                          + ", ".join(f"{role} {1e3 * v:.1f}" for role, v in sorted(cpu.items()))
                          + f"), rollouts {1e3 * r['rollout_median']:.1f} ms, train {1e3 * r['train_median']:.1f} ms "
                          f"(medians), report overlap {r['report']['rl']['overlap']:+.3f}, next step's rollouts "
                          f"started / all made before the commit {r['started']}/{r['early']} of {r['pairs']}",
                          flush=True)
        bf_lay = [f"rl_samplers={layouts[0][0]}", f"dcn_data_parallelism={layouts[0][1]}", *MODEL, *args.overrides]
        try:
            bf16, bf16_failed = run_rl(base, "bf16", [*bf_lay, "rl_off_policy_steps=0", "rl_weights_dtype=bfloat16"],
                                       args.warmup, args.steps), ""
        except RunFailed as e:   # what it published is still in its log
            bf16, bf16_failed = {"events": e.events}, str(e) + last_sync_failure(base / "bf16" / "logs")
        big = run_rl(base, "big-sync", [*bf_lay[:2], *BIG, *args.overrides, "rl_off_policy_steps=0"], 1, 6) \
            if args.big_sync else None

    print("\n== 1. overlapped (rl_off_policy_steps=1) against sequential (=0), medians over the runs ==")
    print(f"Both roles share this host's {cores} cores: the overlapped step cannot be shorter than "
          f"(CPU per step) / {cores}, and the ratio is bounded by the CPU, not only by the schedule.")
    summary = []
    for (samplers, trainers), per in results.items():
        wall = {k: statistics.median(r["wall_per_step"] for r in rs) for k, rs in per.items()}
        cpu = {k: statistics.median(sum(r.get("cpu_per_step", {}).values()) for r in rs) for k, rs in per.items()}
        busy = {k: statistics.median(sum(r.get("cores", {}).values()) for r in rs) for k, rs in per.items()}
        ovl = {k: statistics.median(r["report"]["rl"]["overlap"] for r in rs) for k, rs in per.items()}
        roll = {k: statistics.median(r["rollout_median"] for r in rs) for k, rs in per.items()}
        train = {k: statistics.median(r["train_median"] for r in rs) for k, rs in per.items()}
        early = {k: (sum(r["started"] for r in rs), sum(r["early"] for r in rs), sum(r["pairs"] for r in rs))
                 for k, rs in per.items()}
        floor = cpu[1] / cores
        ideal = max(roll[0], train[0])
        ratio = wall[1] / wall[0]
        summary.append(f"{samplers}:{trainers} overlapped/sequential {ratio:.3f}x")
        print(f"{samplers} samplers + {trainers} trainers:")
        for k, what in ((0, "sequential"), (1, "overlapped")):
            print(f"  {what:10s} {1e3 * wall[k]:6.1f} ms/step wall, {1e3 * cpu[k]:6.1f} ms/step CPU "
                  f"({busy[k]:.2f} of {cores} cores busy), rollouts {1e3 * roll[k]:.1f} ms + train "
                  f"{1e3 * train[k]:.1f} ms, report overlap {ovl[k]:+.3f}, next step's rollouts started / all made "
                  f"before the commit {early[k][0]}/{early[k][1]} of {early[k][2]}")
        print(f"  ratio overlapped / sequential: wall {ratio:.3f}x, CPU per step {cpu[1] / cpu[0]:.3f}x; "
              f"CPU floor of the overlapped step {1e3 * floor:.1f} ms ({floor / wall[0]:.2f} of the sequential step); "
              f"with free cores, max(rollouts, train) of the sequential runs would be {1e3 * ideal:.1f} ms "
              f"({ideal / wall[0]:.2f})")

    print("\n== 2. weight sync against a memory copy and a loopback TCP stream of the same bytes ==")
    every = [(k, s) for per in results.values() for k, rs in per.items() for r in rs for s in syncs_of(r["events"])]
    nbytes = statistics.median(b for _, (b, _) in every)
    copy = memcpy_seconds(int(nbytes))
    link = loopback_seconds(int(nbytes))
    print(f"weights: {int(nbytes)} bytes (float32); np.copyto {1e6 * copy:.1f} us ({mbps(nbytes, copy):.0f} MB/s), "
          f"loopback TCP {1e6 * link:.1f} us ({mbps(nbytes, link):.0f} MB/s), medians in this process")
    sync_bw = {}
    for k, what in ((0, "sequential"), (1, "overlapped")):
        secs = [s for kk, (_, s) in every if kk == k]
        med = statistics.median(secs)
        sync_bw[k] = mbps(nbytes, med)
        print(f"  {what:10s} runs: {len(secs)} syncs, median {1e3 * med:.2f} ms ({sync_bw[k]:.0f} MB/s; p90 "
              f"{1e3 * float(np.percentile(secs, 90)):.2f} ms): sync / memcpy {sync_bw[k] / mbps(nbytes, copy):.4f}x, "
              f"sync / link {sync_bw[k] / mbps(nbytes, link):.3f}x (bandwidth)")
    bf = syncs_of(bf16["events"])
    published = [e["bytes"] for e in bf16["events"] if e["kind"] == "weights_published"]
    bf_bytes = statistics.median(b for b, _ in bf) if bf else (published[0] if published else float("nan"))
    if bf:
        bf_med = statistics.median(s for _, s in bf)
        print(f"  rl_weights_dtype=bfloat16 (sequential): {int(bf_bytes)} bytes per sync, {bf_bytes / nbytes:.3f}x "
              f"the float32 bytes; median {1e3 * bf_med:.2f} ms "
              f"({bf_med / statistics.median(s for k, (_, s) in every if k == 0):.2f}x the float32 sync's time)")
    else:
        print(f"  rl_weights_dtype=bfloat16: the trainers published {bf_bytes} bytes ({bf_bytes / nbytes:.3f}x the "
              f"float32 bytes), but no sync succeeded: {bf16_failed}")
    if big is not None:
        syncs = syncs_of(big["events"])
        b, med = statistics.median(x for x, _ in syncs), statistics.median(t for _, t in syncs)
        copy_b, link_b = memcpy_seconds(int(b)), loopback_seconds(int(b))
        print(f"  {' '.join(BIG)} (sequential, {len(syncs)} syncs): {int(b)} bytes, median {1e3 * med:.2f} ms "
              f"({mbps(b, med):.0f} MB/s); np.copyto {1e3 * copy_b:.2f} ms ({mbps(b, copy_b):.0f} MB/s), loopback TCP "
              f"{1e3 * link_b:.2f} ms ({mbps(b, link_b):.0f} MB/s): sync / memcpy {copy_b / med:.4f}x, sync / link "
              f"{link_b / med:.3f}x")
    print(f"(benchmark wall time {time.monotonic() - t_start:.0f} s)")
    print(f"ratios: {', '.join(summary)} (wall, bounded by {cores} shared cores); sync / memcpy "
          f"{sync_bw[0] / mbps(nbytes, copy):.4f}x, sync / link {sync_bw[0] / mbps(nbytes, link):.3f}x (sequential "
          f"runs' syncs), bfloat16 / float32 bytes {bf_bytes / nbytes:.2f}x"
          + (" (published; its syncs failed)" if bf16_failed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
