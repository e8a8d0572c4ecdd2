"""Control-plane scale: one client's health monitor over up to 4,096 simulated workers, some of them killed.

Each simulated worker is what the controller sees of a worker, without JAX:
its own gRPC server on loopback built by the runtime's ``rpc.make_server``
with the run secret (so every call passes the real secret check), serving
the standard ``grpc.health.v1`` Health service (Check and Watch, as
``runtime.worker.worker_process`` serves it) and the worker's ``Refusals`` RPC. It
registers with the controller's real registration service
(``runtime.control.registry.Registry`` on a server built as ``WorkerGroup`` builds
it) and keeps the worker's lease on its controller: once the controller has
called it, it fences itself (answers NOT_SERVING) when no Check or
``Refusals`` call came for ``elastic_worker_lease_seconds``. The workers run
``--per-process`` to a child process; a few small child processes of
``--group`` workers each are the victims.

The client (this process) runs the real ``runtime.control.health.HealthMonitor``
over all of them with the runtime's default settings
(``elastic_heartbeat_seconds``, ``elastic_lease_seconds``,
``elastic_probe_retries``), then, per worker count:

- steady state (``--window`` seconds, after ``--warmup``): the client's CPU
  share (its CPU time over wall time: 1.00 is one core busy), the
  simulated workers' CPU (all their processes), the Checks the workers
  received per second, each worker's Check period (the workers still
  watched over those Checks a second) and the longest gap any worker saw
  between two Checks (a gap over the worker lease fences it);
- faults: ``--crash`` victim processes SIGKILLed (their sockets close: a
  crash) and ``--hang`` victim processes SIGSTOPped (a hang), half a second
  apart; detection latency is fault -> ``on_dead`` for each of their
  workers, p50 and p99 (nearest rank);
- false deaths: workers declared dead that were never killed (a live worker
  that looked silent, or fenced itself because its lease lapsed).

Prints one table row per count, then last the detection p99 at the largest
count against the 2 s target (issue 12, "Control-plane scale").
Every simulated worker costs its process about three threads (the server's
poller, its Watch and Check handlers) and the client one (gRPC's thread for
that channel's open Watch stream), and this host the CPU of its Checks
(each a real gRPC call on both sides): the benchmark skips a count this host
has no room for, or with more than 512 workers per core unless ``--force``
(at 4,096 workers on 2 cores, the simulated workers alone would need
several times the host, and what it measured would be that).
Usage: .venv/bin/python benchmarks/control_plane_scale.py [--counts 256,512,1024,2048,4096] [--window 10] [--force]
"""

import argparse
import ctypes
import json
import math
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time

from _cli import ROOT

sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # noqa: E402

from elastic.config_loading import load_config  # noqa: E402
from runtime import EventLog
from runtime.wire import auth, rpc
from runtime._proto import elastic_pb2 as pb  # noqa: E402
from runtime._proto import elastic_pb2_grpc as pb_grpc  # noqa: E402
from runtime.control.health import HealthMonitor  # noqa: E402
from runtime.control.registry import Registry  # noqa: E402

TARGET_SECONDS = 2.0
WORKERS_PER_CORE = 512       # above this many simulated workers per core, a count is skipped (see --force)
THREADS_PER_WORKER = 4        # measured: about 2.4 in the simulated worker's process, 1 in the client
RUN_ID = "control-plane-scale"
# The calls from the controller that renew a worker's lease (runtime.worker.worker.WorkerService.CONTROLLER_METHODS,
# of which the health monitor makes these two).
LEASE_METHODS = ("/grpc.health.v1.Health/Check", "/jax_elastic.Worker/Refusals")


# -- the simulated workers (child processes) -------------------------------------------------------


class SimulatedWorker(pb_grpc.WorkerServicer):
    """One worker as the controller sees it: health, ``Refusals``, registration and the lease; no JAX.

    Only ``Refusals`` of the Worker service is served (the health monitor
    calls nothing else); every other method answers UNIMPLEMENTED.
    """

    def __init__(self, worker_id: str, secret: str, lease: float):
        self.worker_id, self.lease = worker_id, lease
        self.refusals = auth.Refusals()
        self.server, port = rpc.make_server("127.0.0.1", 0, secret=secret, refusals=self.refusals,
                                            on_authenticated=self.heard)
        pb_grpc.add_WorkerServicer_to_server(self, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.last_contact: float | None = None   # the lease runs from the controller's first call (a worker's Load)
        self.fenced = False
        self.mark()

    def mark(self) -> None:
        """Starts counting Checks and their gaps afresh (the steady-state window)."""
        self.checks, self.last_check, self.max_gap = 0, None, 0.0

    def heard(self, method: str) -> None:
        """``rpc.make_server``'s hook: an authenticated call reached its handler."""
        if not method.endswith(LEASE_METHODS):
            return
        now = time.monotonic()
        self.last_contact = now
        if method.endswith("Check"):
            if self.last_check is not None:
                self.max_gap = max(self.max_gap, now - self.last_check)
            self.last_check = now
            self.checks += 1

    def lease_lapsed(self, now: float) -> bool:
        """Fences this worker (NOT_SERVING from now on) once the controller was silent for longer than the lease."""
        if not self.fenced and self.lease and self.last_contact is not None and now - self.last_contact > self.lease:
            self.fenced = True
            self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        return self.fenced

    def Refusals(self, request, context):
        """As ``runtime.worker.worker.WorkerService.Refusals``: the calls refused for their secret since the last
        ask."""
        return pb.RefusalsReply(refusals=[pb.Refusal(method=m, peer=p, reason=r, count=n)
                                          for m, p, r, n in self.refusals.drain()])


def serve(controller: str, first: int, count: int, lease: float) -> None:
    """A child process: ``count`` simulated workers, registered with ``controller``; obeys its stdin.

    Prints ``ready`` once every worker is registered. Commands, one a line:
    ``mark`` (start counting Checks afresh), ``report`` (prints a JSON line:
    Checks, the longest gap between two Checks, fenced workers). Ends at
    end-of-file (its parent is gone or done).
    """
    _raise_file_limit()
    _die_with_parent()
    secret = os.environ["ELASTIC_RUN_SECRET"]
    workers = [SimulatedWorker(f"w{first + i:05d}", secret, lease) for i in range(count)]
    registry = pb_grpc.ControllerStub(rpc.channel(controller, secret))
    for w in workers:
        reply = registry.Register(pb.RegisterRequest(run_id=RUN_ID, worker_id=w.worker_id, address=w.address,
                                                     num_devices=1, platform="cpu", pid=os.getpid()),
                                  timeout=300, wait_for_ready=True)
        if not reply.accepted:
            raise SystemExit(f"{w.worker_id} refused: {reply.reason}")
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], 0.2)
        now = time.monotonic()
        for w in workers:
            w.lease_lapsed(now)
        if not readable:
            continue
        command = sys.stdin.readline().strip()
        if not command:
            os._exit(0)
        if command == "mark":
            for w in workers:
                w.mark()
        elif command == "report":
            print(json.dumps({"checks": sum(w.checks for w in workers), "max_gap": max(w.max_gap for w in workers),
                              "fenced": sum(w.fenced for w in workers)}), flush=True)


# -- the client ------------------------------------------------------------------------------------


class Child:
    """One child process of simulated workers ``w{first}`` .. ``w{first + count - 1}``."""

    def __init__(self, controller: str, first: int, count: int, lease: float, secret: str):
        self.ids = [f"w{first + i:05d}" for i in range(count)]
        env = dict(os.environ, ELASTIC_RUN_SECRET=secret, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", controller, str(first), str(count),
                                      str(lease)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def wait_ready(self) -> None:
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"a simulated worker process failed to start (exit {self.proc.wait()})")

    def ask(self, command: str) -> dict | None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline()) if command == "report" else None

    def cpu_seconds(self) -> float:
        return _cpu_seconds(self.proc.pid)

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def close(self) -> None:
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a SIGSTOPped victim cannot read end-of-file)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


def _raise_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def thread_room() -> int:
    """Threads (and processes) this host can still start: kernel limits minus what runs now."""
    running = int(open("/proc/loadavg").read().split()[3].split("/")[1])
    limit = min(int(open("/proc/sys/kernel/pid_max").read()), int(open("/proc/sys/kernel/threads-max").read()))
    return limit - running


def quantile(values, q: float) -> float:
    """The nearest-rank ``q`` quantile (nan for no values)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def measure(count: int, args, cfg) -> dict:
    """Starts ``count`` simulated workers, watches them, measures the steady state, injects the faults."""
    secret = auth.new_secret()
    victims = args.crash + args.hang
    plain = count - victims * args.group
    if plain < 0:
        raise SystemExit(f"{count} workers cannot hold {victims} victim processes of {args.group}")
    with tempfile.TemporaryDirectory() as tmp:
        events = EventLog(os.path.join(tmp, "events.jsonl"))
        registry = Registry(RUN_ID, events, refuse=lambda worker_id: "")
        server, port = rpc.make_server("127.0.0.1", 0, max_workers=8, secret=secret, refusals=registry.refusals,
                                       max_message=1 << 20)
        pb_grpc.add_ControllerServicer_to_server(registry, server)
        server.start()
        controller = f"127.0.0.1:{port}"
        lease = cfg.elastic_worker_lease_seconds if args.worker_lease is None else args.worker_lease
        t_start = time.monotonic()
        children, first = [], 0
        sizes = [args.per_process] * (plain // args.per_process) + [plain % args.per_process] + [args.group] * victims
        for size in sizes:
            if size:
                children.append(Child(controller, first, size, lease, secret))
                first += size
        crash, hang = children[len(children) - victims:len(children) - args.hang], children[len(children) - args.hang:]
        channels: dict[str, grpc.Channel] = {}
        dead: dict[str, tuple[float, str]] = {}
        monitor = None
        try:
            for c in children:
                c.wait_ready()
            started = time.monotonic() - t_start

            def on_dead(worker_id, reason, cause):
                dead.setdefault(worker_id, (time.monotonic(), cause))

            def channel(address):
                ch = channels[address] = rpc.channel(address, secret)
                return ch

            monitor = HealthMonitor(channel, on_dead, interval=cfg.elastic_heartbeat_seconds,
                                    lease=cfg.elastic_lease_seconds, retries=cfg.elastic_probe_retries, events=events)
            monitor.start()
            t_watch = time.monotonic()
            for info in sorted(registry.workers.values(), key=lambda i: i.worker_id):
                monitor.watch(info.worker_id, info.address)
            watched = time.monotonic() - t_watch
            time.sleep(args.warmup)

            for c in children:
                c.ask("mark")
            declared = len(dead)   # before the window: not polled in it
            cpu0, wall0 = time.process_time(), time.monotonic()
            workers_cpu0 = sum(c.cpu_seconds() for c in children)
            time.sleep(args.window)
            cpu1, wall1 = time.process_time(), time.monotonic()
            workers_cpu1 = sum(c.cpu_seconds() for c in children)
            reports = [c.ask("report") for c in children]
            threads = len(os.listdir("/proc/self/task")) + sum(c.threads() for c in children)
            window = wall1 - wall0
            steady = dict(client_cpu=(cpu1 - cpu0) / window, workers_cpu=(workers_cpu1 - workers_cpu0) / window,
                          checks_per_s=sum(r["checks"] for r in reports) / window,
                          max_gap=max(r["max_gap"] for r in reports), load=os.getloadavg()[0], threads=threads,
                          polled=count - declared)

            faults: dict[str, tuple[float, str]] = {}
            for i, (c, kind, sig) in enumerate([(c, "crash", signal.SIGKILL) for c in crash]
                                               + [(c, "hang", signal.SIGSTOP) for c in hang]):
                time.sleep(0.5 if i else 0.0)
                t = time.monotonic()
                os.kill(c.proc.pid, sig)
                for wid in c.ids:
                    faults[wid] = (t, kind)
            deadline = time.monotonic() + args.detect_timeout
            while time.monotonic() < deadline and not set(faults) <= set(dead):
                time.sleep(0.1)
            fenced = sum(r["fenced"] for r in [c.ask("report") for c in children if c not in crash + hang])
        finally:
            if monitor is not None:
                monitor.stop()
            for ch in channels.values():
                ch.close()
            for c in children:
                c.close()
            server.stop(0)
            events.close()
    # A victim declared dead before its fault, or for another cause (it had fenced itself), is a false death.
    early = {w for w, (t, kind) in faults.items() if w in dead and (dead[w][0] < t or dead[w][1] != kind)}
    latency = {kind: [dead[w][0] - t for w, (t, k) in faults.items() if k == kind and w in dead and w not in early]
               for kind in ("crash", "hang")}
    return dict(count=count, processes=len(children), started=started, watched=watched, **steady,
                latency=latency, missed=len(set(faults) - set(dead)), fenced=fenced,
                false_deaths=sorted((w, cause) for w, (_, cause) in dead.items() if w not in faults or w in early))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--counts", default="256,512,1024,2048,4096", help="simulated worker counts, comma-separated")
    ap.add_argument("--per-process", type=int, default=64, help="simulated workers per child process")
    ap.add_argument("--worker-lease", type=float, default=None,
                    help="seconds without a call from the controller before a worker fences itself "
                         "(default: elastic_worker_lease_seconds; 0: off)")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds watched before the steady-state window")
    ap.add_argument("--window", type=float, default=10.0, help="seconds of steady state measured")
    ap.add_argument("--crash", type=int, default=4, help="victim processes SIGKILLed")
    ap.add_argument("--hang", type=int, default=4, help="victim processes SIGSTOPped")
    ap.add_argument("--group", type=int, default=8, help="simulated workers per victim process")
    ap.add_argument("--detect-timeout", type=float, default=30.0, help="seconds to wait for every victim's death")
    ap.add_argument("--force", action="store_true",
                    help=f"run counts above {WORKERS_PER_CORE} workers per core of this host too")
    ap.add_argument("--serve", nargs=4, metavar=("CONTROLLER", "FIRST", "COUNT", "LEASE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        controller, first, count, lease = args.serve
        serve(controller, int(first), int(count), float(lease))
        return
    _raise_file_limit()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # stop the children on the way out
    cfg = load_config("tiny")
    counts = [int(c) for c in args.counts.split(",")]
    worker_lease = cfg.elastic_worker_lease_seconds if args.worker_lease is None else args.worker_lease
    print(f"health monitor: interval {cfg.elastic_heartbeat_seconds:g} s, lease {cfg.elastic_lease_seconds:g} s, "
          f"{cfg.elastic_probe_retries} re-probes; worker lease {worker_lease:g} s; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}; victims: {args.crash} processes SIGKILLed and {args.hang} "
          f"SIGSTOPped, {args.group} workers each; {args.per_process} workers per other process")
    print(f"{'workers':>7} {'procs':>5} {'threads':>7} {'client CPU':>10} {'workers CPU':>11} {'Checks/s':>8} "
          f"{'period s':>8} {'max gap s':>9} {'crash p50/p99 ms':>16} {'hang p50/p99 ms':>15} {'false deaths':>12} "
          f"{'load':>5}")
    rows = []
    for count in counts:
        need, room = int(THREADS_PER_WORKER * count), thread_room()
        if need > room * 0.8:
            print(f"{count:>7}  skipped: needs about {need} threads, this host has room for {room}")
            continue
        if count > WORKERS_PER_CORE * os.cpu_count() and not args.force:
            print(f"{count:>7}  skipped: more than {WORKERS_PER_CORE} simulated workers per core of this host "
                  f"({os.cpu_count()} cores) would measure the host, not the client (--force runs it)")
            continue
        r = measure(count, args, cfg)
        rows.append(r)
        crash, hang = r["latency"]["crash"], r["latency"]["hang"]
        false = len(r["false_deaths"]) + r["missed"]
        print(f"{count:>7} {r['processes']:>5} {r['threads']:>7} {r['client_cpu']:>10.2f} {r['workers_cpu']:>11.2f} "
              f"{r['checks_per_s']:>8.0f} {r['polled'] / max(r['checks_per_s'], 1e-9):>8.2f} {r['max_gap']:>9.2f} "
              f"{quantile(crash, .5) * 1e3:>7.0f}/{quantile(crash, .99) * 1e3:<8.0f} "
              f"{quantile(hang, .5) * 1e3:>7.0f}/{quantile(hang, .99) * 1e3:<7.0f} {false:>12} {r['load']:>5.1f}",
              flush=True)
        causes = {}
        for _, cause in r["false_deaths"]:
            causes[cause] = causes.get(cause, 0) + 1
        print(f"{'':>7} started and registered in {r['started']:.1f} s, all watched in {r['watched']:.1f} s; "
              f"false deaths by cause {causes or 'none'} ({count - r['polled']} before the window), victims never "
              f"declared {r['missed']}, workers that fenced themselves {r['fenced']}", flush=True)
    if not rows:
        raise SystemExit("no count could run here")
    last = rows[-1]
    crash, hang = quantile(last["latency"]["crash"], .99), quantile(last["latency"]["hang"], .99)
    wrong = len(last["false_deaths"]) + last["missed"]
    verdict = "met" if crash < TARGET_SECONDS and not wrong else "NOT met"
    print(f"detection p99 at {last['count']} workers against the {TARGET_SECONDS:g} s target: crash (SIGKILL) "
          f"{crash:.2f} s = {crash / TARGET_SECONDS:.2f}x, hang (SIGSTOP) {hang:.2f} s = {hang / TARGET_SECONDS:.2f}x, "
          f"{wrong} false or missed deaths: {verdict} for crashes")

if __name__ == "__main__":
    main()
