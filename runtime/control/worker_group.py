"""The worker group: every RPC, stub, channel and launcher call of one run.

The controller decides; the group carries out. It owns the controller's gRPC
service (worker registration), the launcher, one channel per worker, the
health monitor, and the workers' membership: launching, waiting for them to
register, adopting and warming newcomers, relaunching the dead. The calls to
the adopted workers (one stub each, the futures of the calls in flight) are
its :class:`~runtime.control.worker_calls.WorkerCalls`, which it delegates to.
What those calls say and what their answers become (plain values such as
:class:`~runtime.control.calls.StepResult`, or the typed errors of
:mod:`runtime.core.errors`) is :mod:`runtime.control.calls`, so nothing above it knows
about protocol buffers.

Deaths are values: whoever finds one (the health monitor, a failed probe, the
step watchdog) calls :meth:`WorkerGroup.declare_dead`, which records it once,
fails the worker's calls in flight, and puts a :class:`~runtime.control.calls.Death`
on the queue that the controller drains (:meth:`WorkerGroup.drain_deaths`).
Nothing here calls back into the controller.

A test drives the controller with a fake group offering the same methods.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import shlex
import shutil
import socket
import threading
import time
from collections.abc import Mapping
from concurrent import futures

import grpc

from runtime.wire import rpc
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.control.calls import Death, LoadResult, Stalled, StepResult, WorkerStatus
from runtime.core.errors import AttachRefusedError, ElasticError, ProtocolError, RegistrationTimeoutError
from runtime.core.events import EventLog
from runtime.control.health import Dialer, HealthMonitor
from runtime.control.inspect import Inspector, process_dicts
from runtime.launch.pool_launcher import PoolLauncher
from runtime.launch.launcher import LocalLauncher, listen_host, make_launcher
from runtime.control.placement import StepPlan, WorkerInfo
from runtime.control.plan import Launch, decide_launch
from runtime.control.run_state import SAMPLER, TRAINER
from runtime.core.fingerprint import programs_fingerprint
from runtime.core.programs import ProgramSet
from runtime.control.registry import Registry
from runtime.control.worker_calls import WorkerCalls
from runtime.core.hosts import slice_of_host
from runtime.core.stacks import STACKS_DIR, stacks_path, stacks_text, thread_stacks

log = logging.getLogger("jax_elastic.worker_group")

__all__ = ["ATTACH_SECONDS", "join_command", "WorkerGroup"]


#: How long a worker found hung or stuck may take to give its stacks before it is replaced (and ``elastic stacks``
#: waits for each worker): a hung one may never answer, and the recovery waits no longer than this.
STACKS_SECONDS = 2.0
#: How long a restarted client waits for each worker of the log to answer its Attach.
ATTACH_SECONDS = 15.0
_LOOPBACK = ("127.", "localhost", "::1", "[::1]")


def join_command(address: str, run_id: str, opts) -> str:
    """The ``elastic worker`` command that joins this run (``opts``: its ``ControllerOptions``), as the client
    prints it for workers started by hand (``elastic_launcher=none``): run as it is, on this machine, with the
    run secret in ``$ELASTIC_RUN_SECRET`` (never in a command line), it registers a worker that fits a slice.

    On the CPU a worker simulates the devices of a slice (``--devices``); on an accelerator it has the devices
    its JAX finds, so the command names none. With TLS it names this client's files (the same certificate
    works for a worker on this machine, or where the same Secret is mounted at the same paths). A slice of
    several hosts is that many processes, each with its share of the devices: the command names the slice's
    flags, with ``K`` (which host) and ``HOST0:PORT`` (its coordinator) for the user to fill in. Pure.
    """
    hosts = opts.hosts_per_slice
    words = ["elastic", "worker", "--controller", address, "--run-id", run_id]
    if opts.platform == "cpu":
        words += ["--devices", str(opts.devices_per_slice // hosts)]
    if hosts > 1:
        words += ["--slice-hosts", str(hosts), "--slice-host", "K", "--slice-coordinator", "HOST0:PORT"]
    if opts.tls is not None:
        words += ["--tls-cert", opts.tls.cert_file, "--tls-key", opts.tls.key_file, "--tls-ca", opts.tls.ca_file]
    return shlex.join(words)


class WorkerGroup:
    """The workers of one run, reached over gRPC. Thread-safe where noted; otherwise called by the controller.

    ``opts`` is the run's ``ControllerOptions``; ``ledger`` the run's
    :class:`~runtime.control.run_state.RunLedger`: who is dead is the run
    state's (a death is recorded by its ``worker_dead`` event, written here
    once; the group keeps no copy). The group fences every call
    with ``(run_id, epoch)``; the controller moves the epoch with
    :meth:`fence_at`.
    """

    def __init__(self, run_id: str, secret: str, programs: ProgramSet, data_source: bytes, opts, events: EventLog,
                 ledger):
        self.run_id, self.secret, self.opts, self.events, self.ledger = run_id, secret, opts, events, ledger
        self.programs, self.data_source = programs, data_source
        self.epoch = 0
        self.generation = opts.generation
        self.registry = Registry(run_id, events, refuse=self._why_fenced, generation=opts.generation,
                                 waits=self._may_take_back, hosts_per_slice=opts.hosts_per_slice,
                                 client_grace=opts.client_grace_seconds)
        host = listen_host(opts)
        try:
            self.server, port = rpc.make_server(host, opts.port, max_workers=8, secret=secret, tls=opts.tls,
                                               refusals=self.registry.refusals, max_message=1 << 20)
        except FileNotFoundError:   # a TLS file: the config checked it; the message names it as it is
            raise
        except OSError as e:
            raise ElasticError(f"the controller cannot listen: {e} (is another process, another run's client, "
                               "listening there? is the host an address of this machine?)") from None
        pb_grpc.add_ControllerServicer_to_server(self.registry, self.server)
        pb_grpc.add_InspectorServicer_to_server(Inspector(self), self.server)   # elastic status, elastic stacks
        self.address = f"{host}:{port}"
        # The run's in-memory snapshots, one directory per host under it (runtime.state.snapshot); "": none taken.
        self.snapshot_root = (os.path.join(opts.snapshot_directory, run_id)
                              if opts.snapshot_directory and opts.snapshot_interval else "")
        self.launcher = make_launcher(opts, run_id, self.address, secret,
                                      on_lost=lambda w, why: self.declare_dead(w, why, cause="crash"),
                                      events=events, snapshot_root=self.snapshot_root)
        self.client_host = self.launcher.host   # the Ray node of this client; "" for other launchers
        self.monitor = HealthMonitor(Dialer(secret, opts.tls), self._host_lost, interval=opts.heartbeat_seconds,
                                     lease=opts.lease_seconds, retries=opts.probe_retries, events=events)
        self._deaths: queue.Queue[Death] = queue.Queue()
        self._channels: dict[str, grpc.Channel] = {}
        self._warming: dict[str, grpc.Future] = {}
        self._launched = 0                       # processes launched (the next one's number)
        # Every call to an adopted worker: its stub, the fence it carries, the calls in flight.
        self.calls = WorkerCalls(opts, self.registry, programs, data_source, self.snapshot_root, self._fence,
                                 self._dead, self.declare_dead, heard=self.monitor.heard, secret=secret)

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        self.server.start()
        self.monitor.start()

    def detach(self) -> None:
        """This client was taken over (a newer generation drives the run): stops its own server and monitor,
        and leaves every worker alone (they serve the new client; none of them is this process's to stop)."""
        self.monitor.stop()
        self.calls.close()
        self.server.stop(0)

    def close(self) -> None:
        """Reports refused calls, sends live workers home (those registered but never adopted too; later
        registrations are told the run ended), kills declared-dead processes (a hung one may be stopped), stops
        the server."""
        try:
            self.collect_security_events()
        except Exception:  # noqa: BLE001 - reporting must not keep workers from going home
            log.exception("could not collect the refused calls at close")
        self.monitor.stop()
        self.calls.close()   # the step streams first: a worker going home does not wait for its open stream
        for w in self.registry.end():   # one that registered after the last adoption would wait for ever
            if not self.calls.reaches(w.worker_id):
                self.calls.adopt(w.worker_id, self._channels_of(w))
        for wid in self.calls.workers():
            if wid not in self._dead():
                self.calls.send_home(wid, run_ended=True)
        for wid in self._dead():
            self.launcher.kill(wid)
        self.launcher.stop_all()
        self.server.stop(0)
        if self.snapshot_root:   # every (simulated) host of a local launch is this machine: give the RAM back
            shutil.rmtree(self.snapshot_root, ignore_errors=True)

    def new_generation(self, generation: int) -> None:
        """Every later call carries client generation ``generation`` (this client takes its run back)."""
        self.generation = self.registry.generation = generation

    def fence_at(self, epoch: int) -> None:
        """Every later call carries ``epoch``: workers refuse calls of older epochs."""
        self.epoch = epoch

    def _fence(self) -> pb.Fence:
        return pb.Fence(run_id=self.run_id, epoch=self.epoch, generation=self.generation)

    def _channels_of(self, w: WorkerInfo) -> list[grpc.Channel]:
        """One channel to each host of ``w``'s slice, in host order (one for a slice of one host)."""
        return [self._channel(h.address) for h in w.slice_hosts]

    def _watch(self, w: WorkerInfo) -> None:
        """The health monitor watches each host of ``w``'s slice (by its host id)."""
        for h in w.slice_hosts:
            self.monitor.watch(h.worker_id, h.address)

    def _channel(self, address: str) -> grpc.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = rpc.channel(address, self.secret, self.opts.tls)
        return ch

    # -- membership ----------------------------------------------------------

    def launch(self, host: str = "", role: str = TRAINER, replaces: str = "") -> str:
        """Starts one worker process of ``role`` on ``host`` (default: a simulated host of its own); returns its
        id (it registers by itself) and records it (``worker_launched``; ``worker_relaunched`` in dead member
        ``replaces``'s place). An RL run's sampler (``role`` ``sampler``, id ``s<n>``) the placement never takes."""
        wid = f"{'s' if role == SAMPLER else 'w'}{self._launched}"
        # A local launch simulates one host per worker slot; elsewhere the worker names its own (Ray: its node).
        host = host or (f"local{self._launched}" if isinstance(self.launcher, LocalLauncher) else "")
        self._launched += 1
        if replaces:   # (where it was launched is the run state's from now: Member.host)
            self.events.emit("worker_relaunched", replaces=replaces, worker=wid, host=host, role=role)
        else:
            self.events.emit("worker_launched", worker=wid, host=host, role=role)
        self.launcher.launch(wid, host, devices=self.opts.rl_sampler_devices if role == SAMPLER else 0)
        return wid

    def attach(self, known: dict[str, WorkerInfo], registered, stages: Mapping[str, int] | None = None,
               placed=None) -> dict[str, pb.AttachReply]:
        """A restarted client takes over the live workers of ``known`` (``{worker: WorkerInfo}`` from the
        log; ``registered``: every worker the attempt had, to number new ones after them): each adopts this
        client's generation and answers what it holds; one that does not answer is declared dead. One that
        answers and is not in ``placed`` (the log's placement: a worker relaunched or joined that the dead
        client had not placed yet) warms again as a newcomer does (:meth:`warm_newcomers`).
        ``AttachRefusedError`` when one runs other programs (see :mod:`runtime.control.attach`). A pipelined
        run's workers may run any stage's programs: each is recorded as of the stage ``stages`` gives it (its
        slice's), else of the stage whose programs it answers it runs (a spare)."""
        numbers = [int(w[1:]) for w in registered if w[:1] in "ws" and w[1:].isdigit()]
        self._launched = max([self._launched, *(n + 1 for n in numbers)])
        self._reach(known)
        per_stage = self._stage_fingerprints
        request = self._attach_request("" if per_stage else programs_fingerprint(self.programs.programs()),
                                       per_stage)
        timeout = min(self.opts.rpc_timeout_seconds, ATTACH_SECONDS)
        try:
            replies = self.calls.attach(list(known), request, timeout)
        except ProtocolError as e:
            raise AttachRefusedError(f"cannot re-attach run {self.run_id}: {e}; the programs changed since its "
                                     "client died (the model, or a config key they depend on): run the same "
                                     "command again, or start afresh with another run_name") from None
        for w, r in replies.items():
            # A slice of several hosts answered as all of them: its hosts are the log's (same processes).
            info = known[w] if known[w].hosts else WorkerInfo(w, r.address, r.num_devices, r.platform, r.pid,
                                                               r.data_address, r.host)
            self.registry.add(info)
            self._watch(info)
            self.launcher.adopt(w, [h.pid for h in info.hosts] if info.hosts else info.pid)
            if placed is not None and w not in placed:
                self._warming[w] = self.calls.start_load(w)
        return replies

    def _reach(self, known: dict[str, WorkerInfo]) -> None:
        """A restarted client's calls reach the workers of ``known`` (from the log), on the hosts they registered."""
        for w, info in known.items():
            if not self.calls.reaches(w):
                self.calls.adopt(w, self._channels_of(info))

    def _attach_request(self, fingerprint: str, per_stage=()) -> pb.AttachRequest:
        """A restarted client's ``Attach``: its generation and address, the programs it brings."""
        return pb.AttachRequest(fence=self._fence(), controller=self.address, stage_fingerprints=list(per_stage),
                                fingerprint=fingerprint,
                                owner_pid=os.getpid() if isinstance(self.launcher, LocalLauncher) else 0,
                                lease_seconds=self.opts.worker_lease_seconds,
                                client_grace_seconds=self.opts.client_grace_seconds)

    def attach_samplers(self, known: dict[str, WorkerInfo], fingerprint: str) -> list[str]:
        """A restarted client takes over an RL run's live samplers of ``known`` (their rollout program's
        ``fingerprint``); answers those that took the new generation (the others are declared dead)."""
        self._reach(known)
        try:
            replies = self.calls.attach(list(known), self._attach_request(fingerprint),
                                        min(self.opts.rpc_timeout_seconds, ATTACH_SECONDS))
        except ProtocolError:   # another program: such a sampler is of no use; fresh ones are launched instead
            return []
        for w, r in replies.items():
            info = WorkerInfo(w, r.address, r.num_devices, r.platform, r.pid, r.data_address, r.host)
            self.registry.add(info)
            self._watch(info)
            self.launcher.adopt(w, r.pid)
        return sorted(replies)

    def host_of(self, worker_id: str) -> str:
        """The host a worker runs on (as it registered; else where it was launched, the run state's; else its
        id). A slice of several hosts: where it was launched (its hosts' base), the same for a restarted client."""
        info = self.registry.workers.get(worker_id)
        member = self.ledger.state.members.get(worker_id)
        launched = member.host if member is not None else ""
        if info is not None and info.hosts:
            return launched or info.host
        return (info.host if info is not None and info.host else "") or launched or worker_id

    def relaunch(self, launch: Launch) -> str:
        """Starts the fresh process (a new worker id) a plan decided (:func:`runtime.control.plan.decide_launch`)."""
        return self.launch(launch.host, launch.role, replaces=launch.replaces)

    def wait_for_workers(self, n: int, timeout: float) -> list[WorkerInfo]:
        """Blocks until ``n`` live workers registered, or no launched process is left to register; adopts them.

        A process that exits before it registers is declared dead (cause
        crash) and relaunched within the limits. Returns the live registered
        workers (possibly fewer than ``n``: the caller decides whether that
        is enough). ``RegistrationTimeoutError`` when none registered within
        ``timeout``, or when some that are still running did not. Workers
        started by someone else (``elastic_launcher=none``) are waited for
        until ``timeout``; then those registered are answered.
        """
        deadline = time.monotonic() + timeout
        self.launcher.prepare_standby()   # starts beside the run's own processes: a relaunch takes it over
        join = join_command(self.address, self.run_id, self.opts)
        if self.launcher.external:
            o = self.opts
            needs = "" if o.platform == "cpu" else \
                f" on a machine where JAX finds {o.devices_per_slice} {o.platform or 'accelerator'} device(s)"
            elsewhere = "" if self.address.startswith(_LOOPBACK) else \
                "; from another machine, give --controller a name of this host it reaches and --host its own address"
            self.events.emit("workers_awaited", count=n, controller=self.address, run_id=self.run_id, command=join)
            slices = "" if o.hosts_per_slice == 1 else \
                f" (a slice is {o.hosts_per_slice} of them, K = 0..{o.hosts_per_slice - 1}, HOST0:PORT a free port " \
                "of host 0's machine that the others reach)"
            log.warning("waiting up to %.0f s for %d workers to join: start each with `%s`%s%s and the run secret in "
                        "ELASTIC_RUN_SECRET%s", timeout, n, join, slices, needs, elsewhere)
        while True:
            for wid, proc in list(self.launcher.procs.items()):
                code = proc.poll()
                if code is not None and wid not in self.registry.workers and wid not in self._dead():
                    self.declare_dead(wid, f"exited with status {code} before registering", cause="crash")
                    if (launch := decide_launch(self.ledger.state, self.opts, wid)) is not None:
                        self.relaunch(launch)
            with self.registry.cond:
                live = [w for w in self.registry.workers.values()
                        if w.worker_id not in self._dead() and not self.is_sampler(w.worker_id)]
                waiting = [w for w, p in self.launcher.procs.items()
                           if w not in self.registry.workers and w not in self._dead() and not self.is_sampler(w)]
                queued = self.launcher.queued()   # a pool's run waits in its queue for as long as it takes
                if len(live) >= n or not (waiting or self.launcher.external or queued):
                    break
                if queued:
                    deadline = time.monotonic() + timeout
                left = deadline - time.monotonic()
                if left <= 0 and self.launcher.external and live:
                    break
                if left <= 0:
                    how = f"start them with `{join}`" if self.launcher.external else \
                        self.launcher.explain_unregistered(waiting)
                    raise RegistrationTimeoutError(f"{len(live)} of {n} workers registered within "
                                                   f"{timeout:.0f} s; {how}")
                self.registry.cond.wait(min(left, 0.2))
        if not live:
            raise RegistrationTimeoutError(f"no worker registered: {len(self._dead())} exited first; "
                                           f"{self.launcher.explain_unregistered([])}")
        for w in live:
            self._adopt(w)
        return live

    def is_sampler(self, worker_id: str) -> bool:
        """``worker_id`` is one of this RL run's samplers (the run state's role: a worker that joined by hand is
        a trainer, whatever its name)."""
        return self.ledger.state.role_of(worker_id) == SAMPLER

    def wait_for_samplers(self, workers, timeout: float) -> list[str]:
        """Blocks until each of ``workers`` (samplers launched) registered or ended, at most ``timeout``; adopts
        those registered and answers them (one that exited first is declared dead)."""
        deadline = time.monotonic() + timeout
        while True:
            for wid in workers:
                proc = self.launcher.procs.get(wid)
                code = proc.poll() if proc is not None else None
                if code is not None and wid not in self.registry.workers and wid not in self._dead():
                    self.declare_dead(wid, f"exited with status {code} before registering", cause="crash")
            with self.registry.cond:
                pending = [w for w in workers if w not in self.registry.workers and w not in self._dead()]
                if not pending or time.monotonic() >= deadline:
                    break
                self.registry.cond.wait(min(deadline - time.monotonic(), 0.2))
        up = [w for w in workers if w in self.registry.workers and w not in self._dead()]
        for w in up:
            if not self.calls.reaches(w):
                self._adopt(self.registry.workers[w])
        return up

    def wait_for_newcomer(self, timeout: float) -> None:
        """Blocks up to ``timeout`` while no registered worker is waiting to be adopted."""
        with self.registry.cond:
            if not self.has_newcomers():
                self.registry.cond.wait(timeout)

    def has_newcomers(self) -> bool:
        """A worker registered that the group has not adopted yet."""
        return any(not self.calls.reaches(w) and not self.is_sampler(w) for w in list(self.registry.workers))

    def warmed(self) -> bool:
        """A newcomer finished loading (successfully or not)."""
        return any(f.done() for f in list(self._warming.values()))

    def _adopt(self, w: WorkerInfo) -> None:
        self.calls.adopt(w.worker_id, self._channels_of(w))
        self._watch(w)

    def start_warming(self) -> None:
        """Adopts newly registered workers and starts loading programs on them (no wait; any time, steps run on)."""
        for w in list(self.registry.workers.values()):
            if not self.calls.reaches(w.worker_id) and not self.is_sampler(w.worker_id):
                self._adopt(w)
                self._warming[w.worker_id] = self.calls.start_load(w.worker_id)

    def warm_newcomers(self, block_until: float | None = None) -> list[str]:
        """Adopts newly registered workers and loads programs on them; returns those warmed since the last call.

        A newcomer that fails to load or probe its devices is declared dead.
        With ``block_until`` (monotonic), waits that long for the loads.
        """
        self.start_warming()
        warmed = []
        for wid, fut in list(self._warming.items()):
            if block_until is not None:
                try:
                    fut.result(timeout=max(block_until - time.monotonic(), 0.001))
                except (grpc.RpcError, grpc.FutureCancelledError, grpc.FutureTimeoutError):
                    pass
            if not fut.done():
                continue
            del self._warming[wid]
            try:
                reply = fut.result()
            except (grpc.RpcError, grpc.FutureCancelledError) as e:
                details = getattr(e, "details", None)   # an RpcError says why; a cancelled future does not
                self.events.emit("device_probe", worker=wid, ok=False, devices=0, seconds=0.0,
                                 error=str(e if details is None else details())[:300])
                self.declare_dead(wid, "failed to load programs or probe its devices", cause="load_failed")
                continue
            self.events.emit("device_probe", worker=wid, ok=True, devices=reply.devices_probed,
                             seconds=reply.probe_seconds)
            self.events.emit("worker_warmed", worker=wid, compile_seconds=reply.compile_seconds,
                             **({"stage": 0} if self.calls.pipelined else {}))   # a spare warms with stage 0's
            warmed.append(wid)
        return warmed

    @property
    def fenced(self) -> frozenset[str]:
        """Members that fenced themselves and wait for this client to take them back (the run state's; a
        restarted client's attach, ``client_attached``, takes them off)."""
        return self.ledger.state.fenced

    def _dead(self):
        """The run's ``{worker: why}`` of the workers declared dead, as it is now (the run state's)."""
        return self.ledger.state.dead

    def _may_take_back(self, worker_id: str) -> bool:
        """A fenced worker waits to be taken back (its rejoin is told to wait; the health monitor's finding is
        no death): it is a member this client has not let go, and the run has a client grace."""
        return bool(self.opts.client_grace_seconds) and worker_id in self.registry.workers and \
            worker_id not in self._dead()

    def _why_fenced(self, worker_id: str) -> str:
        if worker_id in self._dead():
            return (f"worker {worker_id} was declared dead ({self._dead()[worker_id]}) and is fenced; the run is at "
                    f"epoch {self.epoch}: a fresh process joins as a new worker")
        return ""

    def declare_dead(self, worker_id: str, reason: str, cause: str = "unresponsive", stacks: str = "") -> None:
        """Thread-safe, idempotent. Records the death, fails the worker's calls in flight, queues a :class:`Death`.

        The process is not killed: on a real cluster a partitioned host cannot
        be reached either. Fencing keeps it harmless (older epoch; refused on
        rejoin) and it fences itself when its lease on the controller lapses.

        ``stacks``: the file its stacks were kept in (:meth:`keep_stacks`), recorded in its ``worker_dead``.

        ``worker_id`` may name one host of a slice of several (the health monitor watches each): the slice is
        the failure unit, so the slice is dead, and its other hosts, stuck in a collective with the lost one,
        are retired with it (:meth:`_retire`).
        """
        worker_id, host = slice_of_host(worker_id)
        info = self.registry.workers.get(worker_id)
        hosts = len(info.slice_hosts) if info is not None else 1
        if cause == "fenced" and self._may_take_back(worker_id):
            # Alive, holding its state, waiting for a client: not a death; this client takes it back.
            if worker_id not in self.fenced:
                self.events.emit("worker_fenced", worker=worker_id, reason=reason)   # (the run state's from now)
                self._deaths.put(Death(worker_id, reason, cause))
            return
        retired = [k for k in range(hosts) if k != host]
        futs = self.calls.record_death(   # atomic with every call sent: see WorkerCalls
            worker_id, lambda: self.events.emit("worker_dead", worker=worker_id, reason=reason, cause=cause,
                                                **({"host": host, "retired": retired} if hosts > 1 else {}),
                                                **({"stacks": stacks} if stacks else {})))
        if futs is None:
            return
        self._deaths.put(Death(worker_id, reason, cause))
        for f in futs:
            f.cancel()
        if hosts > 1:
            self._retire(worker_id)

    def _host_lost(self, host: str, reason: str, cause: str) -> None:
        """The health monitor's finding of ``host`` (on the monitor's thread): declared dead at once, but for one
        host of a slice of several that went silent (``hang``: stopped, hung): its peers wait for it in the
        slice's collective and can show where the slice hung, so their stacks are kept first (as the step
        watchdog keeps a stuck worker's) and named in the slice's ``worker_dead``. That is done on a thread of its
        own, bounded by ``STACKS_SECONDS``: the monitor's loop never waits for it. (A crash is declared at once:
        its step fails at once too, and the death must name the host that crashed.)"""
        slice_id, _ = slice_of_host(host)
        info = self.registry.workers.get(slice_id)
        if cause != "hang" or info is None or not info.hosts or slice_id in self._dead() or not self.opts.run_dir:
            self.declare_dead(host, reason, cause)
            return

        def keep_then_declare():
            kept = self.keep_stacks([slice_id], self.ledger.state.committed, silent={host: f"declared hung: {reason}"})
            self.declare_dead(host, reason, cause, stacks=kept.get(slice_id, ""))

        threading.Thread(target=keep_then_declare, name=f"hung-{slice_id}", daemon=True).start()

    def _retire(self, slice_id: str) -> None:
        """A slice of several hosts lost one: every host of it stops (a new distributed system needs fresh
        processes, jax#11222), told to go home (best effort, on a thread: a host may be stuck) and killed where
        this process launched it."""
        self.forget(slice_id)
        threading.Thread(target=self.calls.send_home, args=(slice_id,), name=f"retire-{slice_id}",
                         daemon=True).start()
        self.launcher.kill(slice_id)

    def drain_deaths(self) -> list[Death]:
        """The deaths declared since the last drain, oldest first (the owner's queue)."""
        out = []
        while True:
            try:
                out.append(self._deaths.get_nowait())
            except queue.Empty:
                return out

    def forget(self, worker_id: str) -> None:
        """Stops watching a worker that left the placement (dead or sent home): each host of its slice."""
        info = self.registry.workers.get(worker_id)
        for h in [h.worker_id for h in info.slice_hosts] if info is not None else [worker_id]:
            self.monitor.unwatch(h)

    def release_due(self) -> int:
        """How many workers a shared pool asked back (a run of a higher priority needs them); 0 off a pool."""
        return self.launcher.give_back_due() if isinstance(self.launcher, PoolLauncher) else 0

    def release(self, worker_id: str) -> None:
        """A worker given back to the pool, which left the placement: sent home, its host returned (a host asked
        for again in its place is the plan's: ``Plan.launches``)."""
        self.forget(worker_id)
        self.calls.send_home(worker_id)
        self.launcher.release(worker_id)

    def release_refused(self, count: int) -> None:
        """Nothing could be given back now (every slice needed, no spare): the pool is told so and asks others."""
        self.launcher.cannot_release(count)

    def shutdown(self, worker_id: str) -> None:
        """Sends a worker that left the placement home (best effort; it is fenced either way)."""
        self.forget(worker_id)
        self.calls.send_home(worker_id)
        self.launcher.kill(worker_id)

    # -- health --------------------------------------------------------------

    def is_alive(self, worker_id: str) -> bool:
        """A health probe with the bounded retry; False once the worker (any host of its slice) is confirmed (or
        declared) dead."""
        info = self.registry.workers.get(worker_id)
        if info is not None and info.hosts:
            return all(self.monitor.is_alive(h.worker_id) for h in info.hosts) and worker_id not in self._dead()
        return self.monitor.is_alive(worker_id)

    def probe(self, workers) -> dict[str, bool]:
        """Probes ``workers`` in parallel; ``{worker: alive}``."""
        workers = list(workers)
        with futures.ThreadPoolExecutor(max_workers=max(len(workers), 1)) as pool:
            return dict(zip(workers, pool.map(self.is_alive, workers)))

    def collect_security_events(self, timeout: float = 2.0) -> list[dict]:
        """Records the calls refused for their run secret since the last report, as ``security_refused`` events.

        Thread-safe. Asks every watched worker now (the health monitor also
        asks every ``refusals_seconds`` on its own), waiting at most
        ``timeout`` seconds, and drains the controller server's own count
        (``worker="controller"``). Each event: ``worker``, ``method``,
        ``peer`` (host, no port), ``count`` and ``reason``; returns them.
        """
        events = self.monitor.collect_refusals(timeout)
        for method, peer, reason, count in self.registry.refusals.drain():
            events.append(self.events.emit("security_refused", worker="controller", method=method, peer=peer,
                                           count=count, reason=reason))
        return events

    def progress(self, worker_id: str) -> tuple[int, str, float] | None:
        """Where a worker is in its step: ``(step, phase, seconds in phase)``; None when it does not answer (see
        :meth:`WorkerCalls.progress`)."""
        r = self.calls.progress(worker_id)
        return None if r is None else (r.step, r.phase, r.seconds)

    def keep_stacks(self, workers, step: int, timeout: float = STACKS_SECONDS,
                    silent: Mapping[str, str] | None = None) -> dict[str, str]:
        """Before ``workers`` (found hung or stuck at ``step``) are replaced: asks each for its Python stacks
        (every host of a slice, but the hosts of ``silent``, ``{host id: why it is not asked}``, which the file
        names with why), waiting at most ``timeout`` seconds in all, and keeps what came back as
        ``<run_dir>/stacks/<worker>-<step>.txt``; ``{worker: path in the run directory}`` of the files written
        (a worker whose hosts all stayed silent leaves none). A file it cannot write is a warning, never an error:
        the recovery goes on."""
        if not workers or not self.opts.run_dir:
            return {}
        kept = {}
        for w, processes in self.calls.stacks(list(workers), timeout, silent or {}).items():
            if not any(p.text for p in processes):
                continue
            path = stacks_path(w, step)
            try:
                os.makedirs(os.path.join(self.opts.run_dir, STACKS_DIR), exist_ok=True)
                with open(os.path.join(self.opts.run_dir, path), "w") as f:
                    f.write(stacks_text(process_dicts(processes)))
            except OSError as e:
                log.warning("could not keep the stacks of %s: %s", w, e)
                continue
            kept[w] = path
        return kept

    def all_stacks(self, timeout: float = STACKS_SECONDS) -> list[pb.ProcessStacks]:
        """Thread-safe. This client's own stacks, then every live adopted worker's by id (each host of a slice), asked
        at once and waited for at most ``timeout`` seconds (``elastic stacks``)."""
        own = pb.ProcessStacks(name="client", host=socket.gethostname(), pid=os.getpid(), text=thread_stacks())
        live = sorted(w for w in self.calls.workers() if w not in self._dead())
        return [own, *(p for ps in self.calls.stacks(live, timeout).values() for p in ps)]

    # -- programs and state (the calls: runtime.control.worker_calls) ----------

    def program_bytes(self) -> int:
        return self.calls.program_bytes()

    def load(self, workers, spares=(), stages: dict[str, int] | None = None) -> dict[str, LoadResult]:
        """Ships programs and the data source to ``workers`` (``spares`` among them start as spares; with
        ``stages``, each gets its pipeline stage's programs); see :meth:`WorkerCalls.load`."""
        return self.calls.load(workers, spares, stages)

    def stage_answered(self, worker_id: str, reply, stages: Mapping[str, int] | None) -> int | None:
        """A pipelined run's worker that answered :meth:`attach`: the stage it is of, the one ``stages`` gives it
        (its slice's), else the one whose programs it answers it runs (a spare); None when unpipelined (the
        caller records it: ``client_attached``)."""
        if not self.programs.pipelined:
            return None
        if worker_id in (stages or {}):
            return stages[worker_id]
        per_stage = self._stage_fingerprints
        return per_stage.index(reply.fingerprint) if reply.fingerprint in per_stage else None

    @functools.cached_property
    def _stage_fingerprints(self) -> list[str]:
        """A pipelined run's programs' fingerprint per stage ([] unpipelined), taken once (the programs do not
        change in a client's life)."""
        return ([programs_fingerprint(stage.programs()) for stage in self.programs.by_stage]
                if self.programs.pipelined else [])

    def loaded_stage(self, worker_id: str) -> int | None:
        """The pipeline stage whose programs ``worker_id`` loaded (None: an unpipelined run, or not loaded): the
        run state's (``RunState.stages``, folded from the events that say so)."""
        return self.ledger.state.stages.get(worker_id)

    def init(self, workers, seed: int) -> dict[str, int]:
        """Each worker initializes its replica from ``seed``; see :meth:`WorkerCalls.init`."""
        return self.calls.init(workers, seed)

    def rollback(self, worker_id: str, to_applied_steps: int) -> None:
        """Undoes a replica's last applied step (it keeps one step of history)."""
        self.calls.rollback(worker_id, to_applied_steps)

    def transfer(self, source: str, dest: str, applied: int) -> tuple[int, str, str]:
        """``dest`` pulls the state of live replica ``source`` peer to peer; returns ``(bytes, digest, transport)``."""
        return self.calls.transfer(source, dest, applied)

    def hashes(self, workers) -> dict[str, tuple[int, str]]:
        """``{worker: (applied steps, digest of its state)}``."""
        return self.calls.hashes(workers)

    def load_checkpoints(self, workers, directory: str, applied: int,
                         parameters_only: bool = False) -> dict[str, pb.PullStateReply]:
        """``workers`` each load the newest valid checkpoint of ``directory`` at or before ``applied`` (or only
        its parameters); see :meth:`WorkerCalls.load_checkpoints`."""
        return self.calls.load_checkpoints(workers, directory, applied, parameters_only=parameters_only)

    def load_snapshots(self, workers, applied: int) -> dict[str, pb.PullStateReply]:
        """``workers`` each load the newest valid in-memory snapshot on their host at or before ``applied``."""
        return self.calls.load_checkpoints(workers, "", applied, snapshot=True)

    def flush_checkpoints(self, workers, wait_seconds: float, *,
                          save: Mapping[str, tuple[str, list[float]]] | None = None
                          ) -> dict[str, tuple[list[int], str, bool]]:
        """Waits for the checkpoints ``workers`` are writing; see :meth:`WorkerCalls.flush_checkpoints`."""
        return self.calls.flush_checkpoints(workers, wait_seconds, save=save)

    # -- steps -------------------------------------------------------------------

    # -- an RL run's samplers and weights versions (runtime.control.sampling) ---------

    def load_sampler(self, worker_id: str, programs) -> LoadResult | None:
        """Loads a sampler's rollout program, waiting; None when it was lost meanwhile (declared dead)."""
        return self.calls.load_sampler(worker_id, programs)

    def start_sampler_load(self, worker_id: str, programs) -> grpc.Future:
        """The same without waiting (a relaunched sampler)."""
        return self.calls.start_call(worker_id, "Load", self.calls.sampler_load_request(programs))

    def publish_weights(self, trainers, leaves, dtype: str) -> dict[str, pb.PublishWeightsReply]:
        """Each of ``trainers`` keeps its state's ``leaves`` as the weights version it stands at."""
        return self.calls.publish_weights(trainers, leaves, dtype)

    def start_sync(self, worker_id: str, version: int, sources) -> grpc.Future:
        """Sampler ``worker_id`` pulls weights ``version`` from the first of ``sources`` (worker ids) that has it."""
        return self.calls.start_call(worker_id, "SyncWeights", pb.SyncWeightsRequest(
            fence=self._fence(), version=version, sources=[self.calls.where(w) for w in sources]))

    def start_rollout(self, worker_id: str, step: int, microbatches, version: int, seed: int) -> grpc.Future:
        """Sampler ``worker_id`` makes the rollouts of ``microbatches`` of ``step`` with weights ``version``."""
        return self.calls.start_call(worker_id, "Rollout", pb.RolloutRequest(
            fence=self._fence(), step=step, microbatches=list(microbatches), version=version, seed=seed))

    def settle(self, worker_id: str, fut: grpc.Future) -> None:
        """A sampler's call that ended is no longer in flight."""
        self.calls.settle(worker_id, fut)

    def dispatch(self, plan: StepPlan, checkpoints: Mapping[str, tuple[str, list[float]]] | None = None,
                 shadows=(), snapshots: Mapping[str, str | None] | None = None, evals=None,
                 feed=None) -> dict[str, grpc.Future]:
        """Sends step ``plan.step`` to its workers without waiting; see :meth:`WorkerCalls.dispatch` (a pipelined
        run's shadows each shadow the stage its programs are for)."""
        if plan.stages > 1:
            shadows = {w: self.loaded_stage(w) or 0 for w in shadows}
        return self.calls.dispatch(plan, checkpoints, shadows, snapshots, evals, feed)

    def poll(self, futs: dict[str, grpc.Future], deadline: float | None = None) -> dict[str, StepResult | Exception]:
        """The steps of ``futs`` that ended (by ``deadline``), each a :class:`StepResult` or the typed error."""
        return self.calls.poll(futs, deadline)

    def wait(self, futs: dict[str, grpc.Future], deadline: float | None = None) -> dict[str, StepResult] | Stalled:
        """Waits for a dispatched step: its results, :class:`Stalled` at ``deadline``, or the first typed error."""
        return self.calls.wait(futs, deadline)

    def cancel_inflight(self) -> None:
        """Abandons every step in flight (a recovery starts)."""
        self.calls.cancel_inflight()

    def abort(self, workers) -> dict[str, WorkerStatus]:
        """Fences ``workers`` into the current epoch (their step in flight stops); returns where each stands."""
        return self.calls.abort(workers)

    # -- for observers (the chaos injector) ------------------------------------

    def pid(self, worker_id: str, host: int = 0) -> int:
        """The process of ``worker_id`` (of host ``host`` of its slice)."""
        info = self.registry.workers[worker_id]
        return info.slice_hosts[host].pid

    def hosts_of(self, worker_id: str) -> int:
        """How many hosts ``worker_id``'s slice has."""
        info = self.registry.workers.get(worker_id)
        return len(info.slice_hosts) if info is not None else 1

    def inject_fault(self, worker_id: str, action: str, *, factor: float = 0.0, seconds: float = 0.0,
                     phase: str = "", after_step: int = 0, host: int | None = None) -> None:
        self.calls.inject_fault(worker_id, action, factor=factor, seconds=seconds, phase=phase, after_step=after_step,
                                host=host)
