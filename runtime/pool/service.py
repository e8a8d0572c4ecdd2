"""The pool process (``elastic pool serve``): its gRPC service, its record, and the local hosts it starts.

Contract: :class:`PoolService` answers three polls, each under one lock, each
deciding through the :class:`~runtime.pool.ledger.Ledger` and recording what it
decided in the pool's event log (``<dir>/events.jsonl``) before it is applied:

- ``Host``: an agent (:mod:`runtime.pool.agent`, calling with the pool secret)
  reports itself and what ended; it is told what to serve or reclaim;
- ``Run``: a run's client (:mod:`runtime.launch.pool_launcher`, calling with a client
  token) says what it wants, holds and gives back; it is told its grants, how
  many hosts to give back, and where it stands;
- ``Status``: the pool secret sees everything; a client token sees its own
  runs and the free capacity.

A call with neither credential is refused (UNAUTHENTICATED) and counted
(``pool_calls_refused``), its reason naming the credential it lacked (the pool
secret, a client token), never the run secret. The pool's directory holds its secret and client
tokens (created on first start, mode 0600; ``$ELASTIC_POOL_SECRET`` and
``$ELASTIC_POOL_TOKENS``, ``name=token,...``, take precedence), its address
(``pool.json``: a restarted pool binds the same port, so its agents and clients
find it again) and its log. A restarted pool folds its log and stands where it
stood (:meth:`Ledger.replay`); the runs never noticed it was gone, since no
call of theirs goes through it.

:func:`serve` also starts ``local_hosts`` agents on this machine, each in a
session of its own (a pool that dies leaves them serving), and only those of
its hosts not running already.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import grpc

from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.core.child_env import jax_child_env
from runtime.core.events import EventLog, read_events
from runtime.core.owner import pid_alive
from runtime.pool.agent import SECRET_ENV   # the pool's own secret, else ``<dir>/secret``
from runtime.pool.ledger import HOST_SILENT_SECONDS, Ledger, status_json
from runtime.wire import auth, rpc

__all__ = ["PoolBusyError", "PoolService", "SECRET_ENV", "TOKENS_ENV", "pool_credentials", "pool_secret", "serve"]

log = logging.getLogger("jax_elastic.pool")

#: Client tokens, ``name=token,...``, else ``<dir>/tokens`` (one ``name=token`` a line).
TOKENS_ENV = "ELASTIC_POOL_TOKENS"
#: How often the pool decides without being called (timeouts).
TICK_SECONDS = 0.25
#: How long a stopped pool still answers, so that its hosts hear it close (and leave once free).
DRAIN_SECONDS = 2.0

#: The module that decides every event this service records (tests/unit/test_event_kinds.py reads its kinds).
DECIDED_BY = "runtime.pool.ledger"

_RUN = "/jax_elastic.Pool/Run"
_STATUS = "/jax_elastic.Pool/Status"


def _private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def pool_secret(directory: str) -> str:
    """The pool secret: ``$ELASTIC_POOL_SECRET``, else the pool's directory's ``secret`` file ("": neither)."""
    path = os.path.join(directory, "secret")
    return os.environ.get(SECRET_ENV, "") or (open(path).read().strip() if os.path.exists(path) else "")


def pool_credentials(directory: str) -> tuple[str, dict[str, str]]:
    """The pool secret and the client tokens (``{token: client name}``), from the environment, else from the
    pool's directory, created there on first use."""
    if not pool_secret(directory):
        _private(os.path.join(directory, "secret"), auth.new_secret())
    secret = pool_secret(directory)
    text = os.environ.get(TOKENS_ENV, "").replace(",", "\n")
    if not text.strip():
        path = os.path.join(directory, "tokens")
        if not os.path.exists(path):
            _private(path, f"default={secrets.token_hex(16)}\n")
        text = open(path).read()
    tokens = {}
    for line in text.splitlines():
        name, sep, token = line.strip().partition("=")
        if sep and token:
            tokens[token.strip()] = name.strip()
    if not tokens:
        raise ValueError("the pool has no client token: give ELASTIC_POOL_TOKENS as name=token,...")
    return secret, tokens


def _token_of(context) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == auth.METADATA_KEY:
            return v if isinstance(v, str) else v.decode()
    return ""


class PoolService(pb_grpc.PoolServicer):
    """The pool's three polls (see the module's contract)."""

    def __init__(self, ledger: Ledger, events: EventLog, secret: str, tokens: dict[str, str],
                 clock=time.time):
        self.ledger, self.events, self.secret, self.tokens, self.clock = ledger, events, secret, tokens, clock
        self.lock = threading.Lock()
        self.refusals = auth.Refusals(log)
        self.stopping = False

    def _record(self, events: list[dict]) -> None:
        for e in events:
            self._emit(**e)

    def _emit(self, kind: str, **fields) -> None:
        """One decided event: written to the pool's log first, then applied."""
        self.ledger.apply(self.events.emit(kind, **fields))

    def _decide(self, now: float) -> None:
        for _ in range(10_000):
            events = self.ledger.schedule(now)
            if not events:
                return
            self._record(events)
        raise RuntimeError("the pool's schedule did not settle")   # a bug: each decision changes the state

    def tick(self) -> None:
        """Timeouts, and the refused calls counted since the last tick, recorded."""
        with self.lock:
            for method, peer, reason, count in self.refusals.drain():
                self._emit("pool_calls_refused", method=method, peer=peer, reason=reason, count=count)
            self._decide(self.clock())

    def Host(self, request, context):
        now = self.clock()
        with self.lock:
            events = self.ledger.host_polled(request, now)
            self._record(events)
            first = self.ledger.host_heard(request.host_id, now)   # (a restarted pool's host: grantable now)
            if events or first:   # a poll that changed nothing decides nothing (the tick handles time): O(1)
                self._decide(now)
            lease, reclaim = self.ledger.host_orders(request.host_id)
            order = pb.HostOrder(reclaim=reclaim, stop=self.stopping)
            run = self.ledger.runs.get(lease.run_id) if lease is not None else None
            if lease is not None and run is not None and run.order:
                o = run.order
                order.lease.CopyFrom(pb.PoolLease(lease_id=lease.lease_id, run_id=lease.run_id,
                                                  worker_id=lease.worker_id, controller=o["controller"],
                                                  run_secret=o["secret"], snapshot_directory=o["snapshot"],
                                                  chaos=o["chaos"], platform=o["platform"],
                                                  compilation_cache_dir=o["cache"]))
            return order

    def Run(self, request, context):
        tenant = self.tokens.get(_token_of(context), "")
        if not request.run_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a run's poll names no run_id")
        now = self.clock()
        with self.lock:
            run = self.ledger.runs.get(request.run_id)
            if run is not None and run.tenant != tenant:
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"run {request.run_id!r} is another client's")
            events = self.ledger.run_polled(request, tenant, now)
            self._record(events)
            if self.ledger.take_order(request, now) or events:   # (as a host's: a poll that changed nothing...)
                self._decide(now)
            run = self.ledger.runs.get(request.run_id)
            if run is None:   # it ended
                return pb.RunOrders(status="ended")
            held = self.ledger.held(run.run_id)
            reply = pb.RunOrders(granted=[pb.RunGrant(worker_id=x.worker_id, host_id=x.host_id, lease_id=x.lease_id)
                                          for x in held],
                                 give_back=run.give_back, queued=bool(run.wanted) and len(held) < run.min_hosts,
                                 status=self.ledger.run_status(run.run_id, now))
            for w, code in run.ended_workers.items():
                reply.ended[w] = code
            return reply

    def Status(self, request, context):
        token = _token_of(context)
        with self.lock:
            view = None if token == self.secret else self.tokens.get(token, "")
            return pb.PoolStatusReply(json=status_json(self.ledger.status(self.clock(), view)))


def _start_local_hosts(directory: str, address: str, count: int, devices: int, platform: str,
                       secret: str) -> list[int]:
    """Starts the local agents ``pool-0 .. pool-<count-1>`` not running already (by the pids in
    ``<dir>/hosts.json``), each in a session of its own; answers every pid."""
    path = os.path.join(directory, "hosts.json")
    known = json.load(open(path)) if os.path.exists(path) else {}
    pids = {}
    for k in range(count):
        host = f"pool-{k}"
        if host in known and pid_alive(known[host]):
            pids[host] = known[host]
            continue
        home = os.path.join(directory, "hosts", host)
        os.makedirs(home, exist_ok=True)
        env = jax_child_env(devices, platform)
        env[SECRET_ENV] = secret
        with open(os.path.join(directory, "hosts", f"{host}.log"), "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "runtime.pool.agent", "--pool", address,
                                     "--host-id", host, "--devices", str(devices), "--directory", home,
                                     *(["--platform", platform] if platform else [])],
                                    env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)   # the pool's death is not theirs
        pids[host] = proc.pid
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(pids, f)
    os.replace(tmp, path)
    return list(pids.values())


class PoolBusyError(OSError):
    """Another pool process serves this directory."""


def _lock(directory: str) -> int:
    """Locks the pool's directory for this process (``<dir>/.lock``, held until it exits); ``PoolBusyError`` when
    another pool holds it: two pools writing one log would each lose the other's leases."""
    fd = os.open(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        raise PoolBusyError(f"another pool (process {holder or '?'}) serves {directory}: stop it first, or give "
                            "this one a directory of its own") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def serve(directory: str, *, host: str = "127.0.0.1", port: int = 0, local_hosts: int = 0, devices: int = 1,
          platform: str = "cpu", host_silent_seconds: float = HOST_SILENT_SECONDS, ready=None,
          stop_event: threading.Event | None = None, ray_hosts: int = 0, ray_address: str = "") -> int:
    """Serves the pool of ``directory`` until SIGTERM or SIGINT (or ``stop_event``); returns 0.

    A directory that served before gives back its port (unless ``port`` is
    given), its secret and tokens, and its log. ``ready(address)`` is called
    once it serves. ``ray_hosts``: that many hosts as Ray actors on the cluster at ``ray_address``
    (:mod:`runtime.pool.ray_hosts`)."""
    stop = stop_event or threading.Event()
    if stop_event is None:   # before anything else (Ray's start, below, must not leave a signal to kill it)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    os.makedirs(directory, exist_ok=True)
    lock = _lock(directory)
    secret, tokens = pool_credentials(directory)
    where = os.path.join(directory, "pool.json")
    before = json.load(open(where)) if os.path.exists(where) else {}
    if not port and before.get("host") == host:
        port = before.get("port", 0)
    log_path = os.path.join(directory, "events.jsonl")
    ledger = Ledger.replay(read_events(log_path) if os.path.exists(log_path) else [], time.time(),
                           host_silent_seconds=host_silent_seconds)
    events = EventLog(log_path)
    service = PoolService(ledger, events, secret, tokens)
    server, bound = rpc.make_server(host, port, secret=secret, refusals=service.refusals, credential="pool secret",
                                    per_method={_RUN: auth.Credential("client token", lambda: service.tokens),
                                                _STATUS: auth.Credential("pool secret or client token",
                                                                         lambda: [*service.tokens, service.secret])})
    pb_grpc.add_PoolServicer_to_server(service, server)
    server.start()
    address = f"{host}:{bound}"
    tmp = where + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"host": host, "port": bound, "address": address, "pid": os.getpid()}, f)
    os.replace(tmp, where)
    events.emit("pool_started", address=address, hosts=len(ledger.hosts), leases=len(ledger.leases),
                restarted=bool(before))
    if local_hosts:
        _start_local_hosts(directory, address, local_hosts, devices, platform, secret)
    if ray_hosts:
        from runtime.pool.ray_hosts import start_ray_hosts   # Ray is imported only for these

        start_ray_hosts(ray_address, address, secret, os.path.basename(directory.rstrip("/")), ray_hosts, devices,
                        platform)
    if stop_event is None and ray_hosts:   # Ray's start may have put handlers of its own: ours again
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    if ready is not None:
        ready(address)
    log.info("pool serving on %s (%s)", address, directory)
    while not stop.wait(TICK_SECONDS):
        service.tick()
    service.stopping = True   # the agents hear it on their next poll and go once free
    deadline = time.monotonic() + DRAIN_SECONDS
    while time.monotonic() < deadline:
        service.tick()
        time.sleep(TICK_SECONDS)
    events.emit("pool_stopped", reason="signal")
    server.stop(0)
    events.close()
    os.close(lock)
    return 0
