"""Control-plane scale: one client's health monitor over up to 2,048 simulated workers (or more), some of them killed.

Each simulated worker is what the controller sees of a worker, without JAX:
its own ``grpc.aio`` server on loopback serving the standard
``grpc.health.v1`` Health service (Check and Watch, as
``runtime.worker.worker_process`` serves it) and the worker's ``Refusals``
RPC, refusing every call without the run secret (the metadata
``runtime.wire.auth.SecretServerInterceptor`` checks, counted in an
``auth.Refusals`` as the worker counts them); its server keeps gRPC's
default HTTP/2 ping policy, as the worker's (``runtime.wire.rpc.make_server``)
does. It registers with the controller's real registration service
(``runtime.control.registry.Registry`` on a server built as ``WorkerGroup``
builds it) and keeps the worker's lease on its controller: once the
controller has called it, it fences itself (answers NOT_SERVING, on its
Watch streams too) when no Check or ``Refusals`` call came for
``elastic_worker_lease_seconds``. The workers run ``--per-process`` to a
child process, all of a process's servers on its one event loop (no thread
per worker or per call); a few small child processes of ``--group`` workers
each are the victims. The parts that need no runtime module (the child
processes, the table, the verdicts) are in ``benchmarks/_scale_helpers.py``.

The client (this process) runs the real ``runtime.control.health.HealthMonitor``
over all of them with the runtime's default settings
(``elastic_heartbeat_seconds``, ``elastic_lease_seconds``,
``elastic_probe_retries``), then, per worker count:

- idle (``--idle`` seconds, after the faults): the client's CPU with every
  live worker watched by a monitor that sends nothing in that time (every
  Watch stream open, no call out): what watching a worker costs by itself;
- steady state (``--window`` seconds, after ``--warmup``): the client's CPU
  (its CPU seconds per second, read from ``/proc``: 1.00 is one core busy),
  that per monitored worker (millicores) and per call answered (Checks and
  ``Refusals`` asks, as the workers counted them: the client's cost of one
  call, microseconds), the simulated workers' CPU (all their processes), the
  calls answered per second against those asked (``workers / period +
  workers / refusals_seconds``), the Watch streams opened in the window
  (after the first ones: broken or ended streams), and the longest gap any
  worker saw between two calls that renew its lease (a gap over the worker
  lease fences it);
- faults: ``--crash`` victim processes SIGKILLed (their sockets close: a
  crash) and ``--hang`` victim processes SIGSTOPped (a hang), half a second
  apart; detection latency is fault -> ``on_dead`` for each of their
  workers, p50 and p99 (nearest rank);
- false deaths: workers declared dead that were never killed (a live worker
  that looked silent, or fenced itself because its lease lapsed).

Prints one table row per count, then the verdicts (issue 28, "Health at
fleet scale"): the client's CPU per worker at the largest count over that at
the smallest (target: within 1.5x), and the crash detection p99 at the
largest count against the 0.5 s target. CPU per worker is a cost per worker
only while the host makes every call asked: where it cannot (the client and
the simulated workers share this host's cores), each worker's period
stretches, the client does less per worker than the monitor asks, and its
CPU per worker falls for that reason alone (the old version of this
benchmark reported that fall as the slope). Such a count is marked
"saturated" in the table, and the slope verdict is then "not measured" at
that count, not met: the slope is printed over the counts the host kept up
with, beside the CPU per call over all counts. Every simulated worker costs
this host file descriptors (its listening socket and the connection from the
client, on both sides): a count this host has no room for is skipped.
Usage: .venv/bin/python benchmarks/control_plane_scale.py [--counts 256,512,1024,2048] [--window 10]
"""

import argparse
import asyncio
import hmac
import json
import os
import signal
import sys
import tempfile
import time

from _scale_helpers import (Child, cpu_seconds, die_with_parent, file_room, print_header, print_row,
                            raise_file_limit, verdicts)

from _cli import ROOT

sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from elastic.config_loading import load_config  # noqa: E402
from runtime import EventLog  # noqa: E402
from runtime.wire import auth, rpc  # noqa: E402
from runtime._proto import elastic_pb2 as pb  # noqa: E402
from runtime._proto import elastic_pb2_grpc as pb_grpc  # noqa: E402
from runtime.control.health import Dialer, HealthMonitor  # noqa: E402
from runtime.control.registry import Registry  # noqa: E402

FDS_PER_WORKER = 6             # measured: about 4 in the simulated worker's process, 1 in the client, and slack
RUN_ID = "control-plane-scale"
# The calls from the controller that renew a worker's lease (runtime.worker.lease.Lease.CONTROLLER_METHODS,
# of which the health monitor makes Check and Refusals; a Watch does not).
CHECK, WATCH = "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"
REFUSALS = "/jax_elastic.Worker/Refusals"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


# -- the simulated workers (child processes) -------------------------------------------------------


class SimulatedWorker(pb_grpc.WorkerServicer, health_pb2_grpc.HealthServicer):
    """One worker as the controller sees it: health, ``Refusals``, registration and the lease; no JAX.

    Only ``Refusals`` of the Worker service is served (the health monitor
    calls nothing else); every other method answers UNIMPLEMENTED. Lives on
    its process's event loop.
    """

    def __init__(self, worker_id: str, secret: str, lease: float):
        self.worker_id, self.lease, self.secret = worker_id, lease, secret.encode()
        self.refusals = auth.Refusals()
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", 1 << 20)])
        pb_grpc.add_WorkerServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.status, self.changed = SERVING, asyncio.Event()
        self.last_contact: float | None = None   # the lease runs from the controller's first call (a worker's Load)
        self.fenced = False
        self.mark()

    def mark(self) -> None:
        """Starts counting calls (Checks, ``Refusals`` asks, Watch streams opened) and the lease's gaps afresh (the
        steady-state window): the longest time between two calls that renew the lease."""
        self.checks, self.asks, self.watches, self.seen, self.max_gap = 0, 0, 0, False, 0.0

    async def admit(self, context, method: str) -> None:
        """The run secret check of every call (``auth.SecretServerInterceptor``'s rule); then the lease hook."""
        values = [v for k, v in context.invocation_metadata() or () if k == auth.METADATA_KEY]
        reason = ("missing run secret" if not values else
                  None if all(hmac.compare_digest(v if isinstance(v, bytes) else v.encode(), self.secret)
                              for v in values) else "wrong run secret")
        if reason is not None:
            self.refusals.record(method, context.peer(), reason)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong run secret for {method}")
        if method == WATCH:
            self.watches += 1
            return
        now = time.monotonic()
        if self.seen:   # a call in the window came before this one
            self.max_gap = max(self.max_gap, now - self.last_contact)
        self.seen, self.last_contact = True, now
        if method == CHECK:
            self.checks += 1
        else:
            self.asks += 1

    def lease_lapsed(self, now: float) -> bool:
        """Fences this worker (NOT_SERVING from now on) once the controller was silent for longer than the lease."""
        if not self.fenced and self.lease and self.last_contact is not None and now - self.last_contact > self.lease:
            self.fenced = True
            self.status = NOT_SERVING
            self.changed.set()
        return self.fenced

    async def Check(self, request, context):
        await self.admit(context, CHECK)
        return health_pb2.HealthCheckResponse(status=self.status)

    async def Watch(self, request, context):
        await self.admit(context, WATCH)
        while True:
            changed = self.changed
            await context.write(health_pb2.HealthCheckResponse(status=self.status))
            await changed.wait()
            self.changed = asyncio.Event()

    async def Refusals(self, request, context):
        """As ``runtime.worker.worker.WorkerService.Refusals``: the calls refused for their secret since the last
        ask."""
        await self.admit(context, REFUSALS)
        return pb.RefusalsReply(refusals=[pb.Refusal(method=m, peer=p, reason=r, count=n)
                                          for m, p, r, n in self.refusals.drain()])


async def serve(controller: str, first: int, count: int, lease: float) -> None:
    """A child process: ``count`` simulated workers, registered with ``controller``; obeys its stdin.

    Prints ``ready`` once every worker is registered. Commands, one a line:
    ``mark`` (start counting calls afresh), ``unlease`` (no controller has
    called yet: the lease stops running), ``report`` (prints a JSON line:
    Checks, ``Refusals`` asks and Watch streams opened since ``mark``, the
    longest gap between two calls that renew the lease, fenced workers).
    Ends at end-of-file (its parent is gone or done).
    """
    raise_file_limit()
    die_with_parent()
    secret = os.environ["ELASTIC_RUN_SECRET"]
    workers = [SimulatedWorker(f"w{first + i:05d}", secret, lease) for i in range(count)]
    for w in workers:
        await w.server.start()
    async with grpc.aio.insecure_channel(controller, options=rpc.CHANNEL_OPTIONS) as channel:
        registry = pb_grpc.ControllerStub(channel)
        for w in workers:
            reply = await registry.Register(
                pb.RegisterRequest(run_id=RUN_ID, worker_id=w.worker_id, address=w.address, num_devices=1,
                                   platform="cpu", pid=os.getpid()),
                timeout=300, wait_for_ready=True, metadata=((auth.METADATA_KEY, secret),))
            if not reply.accepted:
                raise SystemExit(f"{w.worker_id} refused: {reply.reason}")
    print("ready", flush=True)
    loop, lines, buffer = asyncio.get_running_loop(), asyncio.Queue(), bytearray()

    def readable() -> None:
        data = os.read(sys.stdin.fileno(), 4096)
        if not data:
            os._exit(0)
        buffer.extend(data)
        while b"\n" in buffer:
            line, _, rest = bytes(buffer).partition(b"\n")
            buffer[:] = rest
            lines.put_nowait(line.decode().strip())

    loop.add_reader(sys.stdin.fileno(), readable)
    while True:
        try:
            command = await asyncio.wait_for(lines.get(), 0.2)
        except TimeoutError:
            command = None
        now = time.monotonic()
        for w in workers:
            w.lease_lapsed(now)
        if command == "mark":
            for w in workers:
                w.mark()
        elif command == "unlease":
            for w in workers:
                w.last_contact = None
        elif command == "report":
            print(json.dumps({"checks": sum(w.checks for w in workers), "asks": sum(w.asks for w in workers),
                              "watches": sum(w.watches for w in workers),
                              "max_gap": max(w.max_gap for w in workers),
                              "fenced": sum(w.fenced for w in workers)}), flush=True)


# -- the client ------------------------------------------------------------------------------------




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
        dead: dict[str, tuple[float, str]] = {}
        faults: dict[str, tuple[float, str]] = {}
        monitor = None
        try:
            for c in children:
                c.wait_ready()
            started = time.monotonic() - t_start

            def on_dead(worker_id, reason, cause):
                dead.setdefault(worker_id, (time.monotonic(), cause))

            monitor = HealthMonitor(Dialer(secret), on_dead, interval=cfg.elastic_heartbeat_seconds,
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
            me = os.getpid()
            cpu0, wall0 = cpu_seconds(me), time.monotonic()
            workers_cpu0 = sum(c.cpu_seconds() for c in children)
            time.sleep(args.window)
            cpu1, wall1 = cpu_seconds(me), time.monotonic()
            workers_cpu1 = sum(c.cpu_seconds() for c in children)
            reports = [c.ask("report") for c in children]
            threads = len(os.listdir("/proc/self/task")) + sum(c.threads() for c in children)
            window = wall1 - wall0
            calls = sum(r["checks"] + r["asks"] for r in reports)
            polled = count - declared
            steady = dict(client_cpu=(cpu1 - cpu0) / window,
                          workers_cpu=(workers_cpu1 - workers_cpu0) / window,
                          checks_per_s=sum(r["checks"] for r in reports) / window, calls_per_s=calls / window,
                          asked=polled / monitor.period + polled / monitor.refusals_seconds,
                          cpu_per_call=(cpu1 - cpu0) / max(calls, 1), reopened=sum(r["watches"] for r in reports),
                          max_gap=max(r["max_gap"] for r in reports), load=os.getloadavg()[0], threads=threads,
                          polled=polled, period=monitor.period)

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
            monitor.stop()
            for c in children:
                if c not in crash + hang:
                    c.ask("unlease")   # no lease to lapse (and no NOT_SERVING on the streams) while idle
            # Idle: the live workers watched (each Watch stream open) by a monitor that sends nothing meanwhile.
            monitor = HealthMonitor(Dialer(secret), lambda *args: None, interval=3600.0, lease=7200.0, retries=0,
                                    refusals_seconds=3600.0)
            monitor.start()
            for info in registry.workers.values():
                if info.worker_id not in faults:
                    monitor.watch(info.worker_id, info.address)
            time.sleep(1.0 + count / 512)   # the streams open
            cpu0, wall0 = cpu_seconds(me), time.monotonic()
            time.sleep(args.idle)
            idle_cpu = (cpu_seconds(me) - cpu0) / (time.monotonic() - wall0)
        finally:
            if monitor is not None:
                monitor.stop()
            for c in children:
                c.close()
            server.stop(0)
            events.close()
    # A victim declared dead before its fault, or for another cause (it had fenced itself), is a false death.
    early = {w for w, (t, kind) in faults.items() if w in dead and (dead[w][0] < t or dead[w][1] != kind)}
    latency = {kind: [dead[w][0] - t for w, (t, k) in faults.items() if k == kind and w in dead and w not in early]
               for kind in ("crash", "hang")}
    return dict(count=count, processes=len(children), started=started, watched=watched, idle_cpu=idle_cpu, **steady,
                latency=latency, missed=len(set(faults) - set(dead)), fenced=fenced,
                false_deaths=sorted((w, cause) for w, (_, cause) in dead.items() if w not in faults or w in early))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--counts", default="256,512,1024,2048", help="simulated worker counts, comma-separated")
    ap.add_argument("--per-process", type=int, default=256, help="simulated workers per child process")
    ap.add_argument("--worker-lease", type=float, default=None,
                    help="seconds without a call from the controller before a worker fences itself "
                         "(default: elastic_worker_lease_seconds; 0: off)")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds watched before the steady-state window")
    ap.add_argument("--window", type=float, default=10.0, help="seconds of steady state measured")
    ap.add_argument("--idle", type=float, default=3.0,
                    help="seconds of the client's CPU measured with every Watch stream open and no call out")
    ap.add_argument("--crash", type=int, default=4, help="victim processes SIGKILLed")
    ap.add_argument("--hang", type=int, default=4, help="victim processes SIGSTOPped")
    ap.add_argument("--group", type=int, default=8, help="simulated workers per victim process")
    ap.add_argument("--detect-timeout", type=float, default=30.0, help="seconds to wait for every victim's death")
    ap.add_argument("--serve", nargs=4, metavar=("CONTROLLER", "FIRST", "COUNT", "LEASE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        controller, first, count, lease = args.serve
        asyncio.run(serve(controller, int(first), int(count), float(lease)))
        return
    files = raise_file_limit()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # stop the children on the way out
    cfg = load_config("tiny")
    counts = [int(c) for c in args.counts.split(",")]
    worker_lease = cfg.elastic_worker_lease_seconds if args.worker_lease is None else args.worker_lease
    print(f"health monitor: interval {cfg.elastic_heartbeat_seconds:g} s (a Check every interval, Refusals every "
          f"5 s), lease {cfg.elastic_lease_seconds:g} s, {cfg.elastic_probe_retries} re-probes; worker lease "
          f"{worker_lease:g} s; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}; victims: {args.crash} processes SIGKILLed and {args.hang} "
          f"SIGSTOPped, {args.group} workers each; {args.per_process} workers per other process")
    print_header()
    rows = []
    for count in counts:
        need, room = FDS_PER_WORKER * count, min(file_room(), files)
        if need > room * 0.8:
            print(f"{count:>7}  skipped: needs about {need} file descriptors, this host has room for {room}")
            continue
        r = measure(count, args, cfg)
        rows.append(r)
        print_row(r)
    if not rows:
        raise SystemExit("no count could run here")
    verdicts(rows)


if __name__ == "__main__":
    main()
