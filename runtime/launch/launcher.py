"""Starts worker processes. ``LocalLauncher``: subprocesses on loopback.

A worker binds port 0 and registers its address with the controller, so no
ports are chosen here. Each worker writes its log to ``log_dir``.

Starts are paced by a token bucket: the first ``LAUNCH_BURST`` starts go at
once, later ones at ``LAUNCH_RATE`` per second (each start forks a Python
process that imports JAX; a burst of hundreds would stall the host). A
normal run of a few workers is never slowed; how many workers a run may ask
for at all is checked before anything starts (``elastic.preflight``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from runtime.launch import zygote as zygotes
from runtime.core.child_env import jax_child_env
from runtime.core.owner import Owner
from runtime.wire import rpc

__all__ = ["LAUNCH_BURST", "LAUNCH_RATE", "ExternalLauncher", "LocalLauncher", "SliceProcesses", "listen_host",
           "make_launcher", "preload_of", "prestart_workers"]

log = logging.getLogger("jax_elastic.launcher")

#: Worker starts allowed back to back before pacing begins.
LAUNCH_BURST = 8
#: Worker starts per second once the burst is spent.
LAUNCH_RATE = 4.0
#: How many times one run starts a new zygote after its zygote died (then workers start on their own).
ZYGOTE_RESTARTS = 3


class _TokenBucket:
    """``burst`` tokens refilled at ``rate`` per second; :meth:`take` waits (at most ``1/rate`` s) for one."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.rate, self.burst, self.clock, self.sleep = rate, burst, clock, sleep
        self.tokens = float(burst)
        self.updated = clock()
        self._lock = threading.Lock()

    def take(self) -> float:
        """Takes one token, sleeping until one is there; returns the seconds slept."""
        with self._lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now
            wait = 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate
            self.tokens -= 1   # may go negative: the token is ours once the wait is over
            if wait > 0:
                self.sleep(wait)
            return wait


class LocalLauncher:
    """Launches ``python -m runtime.worker.worker_process`` children with N devices each (simulated ones on the CPU).

    ``platform``: the JAX platform of the workers (see :func:`jax_child_env`).

    With ``zygote`` (the default), the workers are forked from one
    :class:`runtime.launch.zygote.Zygote` (pooled across the runs of this process:
    :func:`runtime.launch.zygote.acquire`), which
    imported JAX and the runtime (and the ``preload`` modules, such as the
    data source's) once for all of them; if it cannot be
    started, workers start as subprocesses of their own. If it dies, nothing
    else does: its workers answer to this process (``--owner-pid``), the next
    start is a subprocess, and a new zygote starts in the background for the
    ones after (at most ``ZYGOTE_RESTARTS`` times a run).

    With ``standby`` > 0, that many extra processes are kept started ahead of
    need (:meth:`prepare_standby`): each has imported JAX, created its devices
    and opened the compilation cache, and waits on a named pipe in
    ``log_dir`` (``--identity-fifo``) for the worker id it is to serve as.
    :meth:`launch` hands a waiting one its id instead of starting a process,
    so a relaunched worker registers at once rather than after a Python and
    JAX start (seconds), and then starts a new standby. A standby whose
    launcher goes away sees its owner gone and exits.
    """

    external = False   # it starts (and relaunches) the workers itself
    host = ""          # the client's host in the workers' host names: none of their simulated hosts

    def __init__(self, run_id: str, controller_address: str, devices_per_worker: int, log_dir: str,
                 secret: str = "", chaos: bool = False, tls=None, launch_rate: float = LAUNCH_RATE,
                 launch_burst: int = LAUNCH_BURST, compilation_cache_dir: str = "", standby: int = 0,
                 platform: str = "", zygote: bool = True, preload: tuple[str, ...] = (), hosts_per_slice: int = 1,
                 listen: str = ""):
        self.listen = listen   # the address its workers listen on ("": the worker's default, loopback)
        self.hosts_per_slice = hosts_per_slice   # >1: a worker id is a slice of that many processes (its hosts)
        self.platform = platform   # the workers' JAX platform; "": as this process's JAX_PLATFORMS says (jax_child_env)
        self.secret = secret
        self.compilation_cache_dir = compilation_cache_dir
        self.chaos = chaos
        self.tls = tls
        self.run_id = run_id
        self.controller_address = controller_address
        self.devices_per_worker = devices_per_worker
        self.log_dir = log_dir
        self.standby = standby
        self.procs: dict[str, subprocess.Popen] = {}
        self._standbys: list[tuple[subprocess.Popen, str, str]] = []   # (process, log file, fifo) waiting for an id
        self._standby_seq = 0
        self._pace = _TokenBucket(launch_rate, launch_burst)
        self._lock = threading.Lock()
        self._zygote: zygotes.Zygote | None = None
        self._use_zygote = zygote
        self._preload = preload
        self._zygote_lock = threading.Lock()
        self._zygote_restarts = 0
        self._replacement: zygotes.Zygote | None = None   # a zygote started after the first died
        os.makedirs(log_dir, exist_ok=True)

    def launch(self, worker_id: str, host_name: str = "", devices: int = 0) -> subprocess.Popen:
        """Starts worker ``worker_id`` on simulated host ``host_name`` (where its in-memory snapshots live; "":
        this machine's name): a standby takes the id if one waits, else a new process starts. ``devices``: its
        own device count when not the run's (an RL run's sampler; no standby has it).

        A new process waits its turn past the first ``LAUNCH_BURST`` starts
        (at most ``1/LAUNCH_RATE`` s). Handing a standby its id also starts
        its successor.
        """
        if devices and devices != self.devices_per_worker:
            self._pace.take()
            identity = ["--worker-id", worker_id] + (["--host-name", host_name] if host_name else [])
            proc = self.procs[worker_id] = self._start(identity, f"worker-{worker_id}.log", devices)
            return proc
        if self.hosts_per_slice > 1:
            return self._launch_slice(worker_id, host_name)
        proc = self._take_standby(worker_id, host_name)
        if proc is not None:
            self.procs[worker_id] = proc
            self.prepare_standby()
            return proc
        self._pace.take()
        identity = ["--worker-id", worker_id] + (["--host-name", host_name] if host_name else [])
        proc = self.procs[worker_id] = self._start(identity, f"worker-{worker_id}.log")
        return proc

    def _launch_slice(self, worker_id: str, host_name: str) -> SliceProcesses:
        """Starts the ``hosts_per_slice`` processes of slice ``worker_id``, each with its share of the slice's
        devices, joined by a JAX coordinator on a free loopback port that its host 0 serves."""
        coordinator = f"127.0.0.1:{rpc.free_port()}"
        hosts = self.hosts_per_slice
        procs = []
        for k in range(hosts):
            self._pace.take()
            identity = ["--worker-id", worker_id, "--slice-host", str(k), "--slice-hosts", str(hosts),
                        "--slice-coordinator", coordinator] + (["--host-name", f"{host_name}.{k}"] if host_name else [])
            procs.append(self._start(identity, f"worker-{worker_id}.host{k}.log"))
        proc = self.procs[worker_id] = SliceProcesses(procs)
        return proc

    def queued(self) -> str:
        """Why the run waits for capacity beyond its registration timeout: never (a pool's run may)."""
        return ""

    def explain_unregistered(self, workers) -> str:
        """Where to look when launched ``workers`` did not register (called by the worker group as it gives up):
        their logs."""
        return f"see the worker logs in {self.log_dir}"

    def prepare_standby(self) -> None:
        """Starts standby processes until ``standby`` of them wait (none when ``standby`` is 0)."""
        with self._lock:
            for p, _, fifo in self._standbys:
                if p.poll() is not None:
                    _unlink(fifo)
            self._standbys = [entry for entry in self._standbys if entry[0].poll() is None]
            while len(self._standbys) < self.standby:
                self._standby_seq += 1
                log = f"worker-standby-{self._standby_seq}.log"
                fifo = os.path.join(self.log_dir, f".standby-{self._standby_seq}.fifo")
                _unlink(fifo)
                os.mkfifo(fifo, 0o600)
                self._standbys.append((self._start(["--standby", "--identity-fifo", fifo], log), log, fifo))

    def _take_standby(self, worker_id: str, host_name: str) -> subprocess.Popen | None:
        """A waiting standby, told to serve as ``worker_id`` (its log renamed to match); None if none waits."""
        with self._lock:
            while self._standbys:
                proc, log, fifo = self._standbys.pop(0)
                if proc.poll() is not None or not _tell(fifo, f"{worker_id} {host_name}\n"):
                    _unlink(fifo)   # it died (between the poll and the write, perhaps)
                    continue
                _take_name(os.path.join(self.log_dir, log), os.path.join(self.log_dir, f"worker-{worker_id}.log"))
                return proc
        return None

    def _env(self, devices: int = 0) -> dict[str, str]:
        """Every worker's environment (the same for all but an RL sampler of its own ``devices``: only their
        arguments differ)."""
        env = jax_child_env(devices or self.devices_per_worker, self.platform)
        env["ELASTIC_RUN_SECRET"] = self.secret  # by environment: argv is visible to every local user
        env["ELASTIC_CHAOS"] = "1" if self.chaos else "0"
        # The controller decides where compiled programs are shared ("": nowhere), not an inherited variable.
        env["ELASTIC_COMPILATION_CACHE_DIR"] = self.compilation_cache_dir
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        if self.tls is not None:
            env.update(self.tls.environ())
        return env

    def _start(self, identity: list[str], log_name: str, devices: int = 0):
        # Every worker answers to this process, the run's owner: never to the zygote it is forked from.
        argv = ["--controller", self.controller_address, "--run-id", self.run_id, *identity,
                "--owner-pid", str(os.getpid()), *(["--host", self.listen] if self.listen else [])]
        path = os.path.join(self.log_dir, log_name)
        env = self._env(devices)
        zygote = self._zygote_for(env)
        if zygote is not None:
            try:
                return zygote.start(argv, path, env=env)
            except zygotes.ZygoteError as e:
                self._zygote_lost(zygote, env, e)
        with open(path, "ab") as log_file:
            return subprocess.Popen([sys.executable, "-m", "runtime.worker.worker_process", *argv], env=env,
                                    stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    process_group=0)   # outlives a signal to the client's process group

    def _zygote_for(self, env: dict[str, str]) -> zygotes.Zygote | None:
        """The zygote to fork the next worker from; None: start a process of its own (no zygote, or its
        replacement still importing)."""
        with self._zygote_lock:
            if self._use_zygote and self._zygote is None:
                try:
                    self._zygote = zygotes.acquire(env, os.path.join(self.log_dir, "zygote.log"), self._preload)
                except OSError as e:
                    log.warning("worker processes start on their own: the zygote did not start (%s)", e)
                    self._use_zygote = False
            zygote = self._zygote if self._use_zygote else None
        if zygote is not None and zygote is self._replacement and not zygote.ready():
            return None   # a replacement still importing: a subprocess now beats waiting for it
        return zygote

    def _zygote_lost(self, zygote: zygotes.Zygote, env: dict[str, str], error: Exception) -> None:
        """The zygote stopped answering (killed, crashed): its workers go on; a new one is started in the
        background for later starts, unless this run already replaced it ``ZYGOTE_RESTARTS`` times."""
        with self._zygote_lock:
            if self._zygote is not zygote:
                return   # another start saw it first
            zygote.close()
            self._zygote = None
            if self._zygote_restarts >= ZYGOTE_RESTARTS:
                log.warning("worker processes start on their own from now on: %s", error)
                self._use_zygote = False
                return
            self._zygote_restarts += 1
            log.warning("the zygote is gone (%s); workers start on their own until a new one is ready", error)
            try:
                self._zygote = self._replacement = zygotes.Zygote(env, os.path.join(self.log_dir, "zygote.log"),
                                                                  self._preload)
            except OSError as e:
                log.warning("worker processes start on their own from now on: no new zygote (%s)", e)
                self._use_zygote = False

    def adopt(self, worker_id: str, pid: int | list[int]) -> None:
        """A worker an earlier client of the run launched, attached by this one: it is stopped and killed like
        this launcher's own (by its pid: it is no child of this process). A slice of several hosts: its hosts'
        pids, in host order."""
        pids = pid if isinstance(pid, list) else [pid]
        if all(p > 1 for p in pids) and worker_id not in self.procs:
            self.procs[worker_id] = Adopted(pids[0]) if len(pids) == 1 else SliceProcesses([Adopted(p) for p in pids])

    def kill(self, worker_id: str) -> None:
        """SIGKILLs a worker declared dead (works on a stopped process too)."""
        p = self.procs.get(worker_id)
        if p is not None and p.poll() is None:
            p.kill()

    def stop_all(self, timeout: float = 10.0) -> None:
        """Terminates every child (standbys read end-of-file and exit), then kills what is left after ``timeout``."""
        with self._lock:
            waiting, self._standbys = self._standbys, []
        standbys = [p for p, _, _ in waiting]
        for p, _, fifo in waiting:
            _tell(fifo, "\n")   # not needed: it exits 0
            _unlink(fifo)
        every = list(self.procs.values()) + standbys
        for p in every:
            if p.poll() is None:
                p.terminate()
        for p in every:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout)
        if self._zygote is not None:
            zygotes.release(self._zygote)   # the next run of this process forks from it too
            self._zygote = None


class SliceProcesses:
    """The processes of one slice of several hosts (in host order), as one: it has ended once any of them did
    (the slice cannot run without it), and ``kill``/``terminate``/``wait`` reach all of them."""

    def __init__(self, procs: list):
        self.procs = list(procs)

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    def poll(self) -> int | None:
        for p in self.procs:
            code = p.poll()
            if code is not None:
                return code
        return None

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def terminate(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        codes = [p.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0)) for p in self.procs]
        return next((c for c in codes if c), codes[0])


class Adopted(zygotes.Signalled):
    """A worker process this process did not start (an earlier client of the run did), with the part of
    ``subprocess.Popen``'s interface the launcher uses; watched without being its parent
    (:class:`runtime.core.owner.Owner`: a pidfd, immune to pid reuse)."""

    def __init__(self, pid: int):
        self.pid, self._watch = pid, Owner(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._watch.alive():
            self.returncode = -signal.SIGKILL   # not our child: its status is its parent's to read
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker process {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def _tell(fifo: str, line: str) -> bool:
    """Writes ``line`` to a waiting standby's named pipe; False when no standby reads it any more."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)   # ENXIO at once when its reader is gone
    except OSError:
        return False
    try:
        return os.write(fd, line.encode()) == len(line.encode())   # one line is under PIPE_BUF: written whole
    except OSError:
        return False
    finally:
        os.close(fd)


def _take_name(log: str, name: str) -> None:
    """Renames a standby's ``log`` to the worker's ``name`` when no log has that name yet; else (the worker it
    replaces wrote one: its record of how it died) to ``<name without .log>.<standby's name>``, so neither is
    lost. A rename that fails leaves the log under its standby name."""
    target = name if not os.path.exists(name) else f"{name.removesuffix('.log')}.{os.path.basename(log)}"
    try:
        os.link(log, target)   # fails if the name was taken meanwhile: nothing is ever overwritten
        os.unlink(log)
    except OSError:
        pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def preload_of(opts) -> tuple[str, ...]:
    """What the zygote imports for a run's workers: ``opts.worker_preload``, and orbax when the run writes or
    reads checkpoints (a 2 s import, once in the zygote instead of at each worker's first save)."""
    orbax = ("orbax.checkpoint",) if opts.checkpoint_directory or opts.load_full_state_path else ()
    return (*opts.worker_preload, *orbax)


def prestart_workers(opts) -> None:
    """Starts the zygote a run's local workers will be forked from, ahead of the run (its imports overlap
    the caller's tracing of the programs); nothing for other launchers. See :mod:`runtime.launch.zygote`."""
    if opts.launcher == "local":
        zygotes.prestart(jax_child_env(1, opts.platform), preload_of(opts))


def listen_host(opts) -> str:
    """The address the controller listens on: ``opts.host``, except for Ray actors with the default loopback
    (they may run on other nodes): this node's IP as Ray sees it (connecting to the cluster first)."""
    if opts.launcher == "ray" and (opts.host, opts.port) == ("127.0.0.1", 0):
        from runtime.launch.ray_launcher import connect

        return connect(opts.ray_address, timeout=min(opts.register_timeout_seconds, 60.0))
    return opts.host


def make_launcher(opts, run_id: str, controller_address: str, secret: str, on_lost=None, events=None,
                  snapshot_root: str = ""):
    """Who starts the workers of a run (``opts.launcher``, a ``ControllerOptions``): local subprocesses
    (:class:`LocalLauncher`), Ray actors (:class:`runtime.launch.ray_launcher.RayLauncher`; ``on_lost(worker, reason)``
    is Ray's failure signal), a shared pool's hosts (:class:`runtime.launch.pool_launcher.PoolLauncher`, recording the
    run's lease timeline in ``events``; ``snapshot_root``: what its hosts wipe of the run) or nobody
    (:class:`ExternalLauncher`)."""
    if opts.launcher == "none":
        return ExternalLauncher()
    if opts.launcher == "pool":
        from runtime.launch.pool_launcher import PoolLauncher

        return PoolLauncher(opts.pool, run_id, controller_address, secret, devices=opts.devices_per_slice,
                            min_hosts=max(opts.min_slices, 1), priority=opts.pool_priority,
                            grace_seconds=opts.client_grace_seconds or 30.0, snapshot_directory=snapshot_root,
                            chaos=opts.chaos, platform=opts.platform, events=events,
                            run_name=os.path.basename(opts.run_dir.rstrip("/")),
                            compilation_cache_dir=opts.compilation_cache_dir)
    hosts = opts.hosts_per_slice   # a slice of several: each process has its share of the slice's devices
    if opts.launcher == "ray":
        from runtime.launch.ray_launcher import RayLauncher   # Ray is imported only for this launcher

        return RayLauncher(run_id, controller_address, opts.devices_per_slice // hosts, address=opts.ray_address,
                           secret=secret, chaos=opts.chaos, tls=opts.tls,
                           compilation_cache_dir=opts.compilation_cache_dir, platform=opts.platform, on_lost=on_lost,
                           hosts_per_slice=hosts)
    return LocalLauncher(run_id, controller_address, opts.devices_per_slice // hosts, f"{opts.run_dir}/logs",
                         secret=secret, chaos=opts.chaos, tls=opts.tls,
                         compilation_cache_dir=opts.compilation_cache_dir,
                         # a standby starts JAX before it knows its slice: none for slices of several hosts
                         standby=opts.standby_workers if opts.relaunch and opts.max_retries and hosts == 1 else 0,
                         platform=opts.platform, preload=preload_of(opts), hosts_per_slice=hosts)


class ExternalLauncher:
    """No launcher: the workers are started by someone else (Kubernetes, any scheduler, or by hand with
    ``elastic worker``) and join the controller by themselves; a replacement joins the same way, as a newcomer.

    The run waits for them until its registration timeout; a relaunch
    starts nothing (the scheduler restarts what died) and killing a worker
    declared dead is left to that scheduler (the worker fences itself when
    its lease runs out).
    """

    external = True
    host = ""          # the client's host is not known in the names its workers give

    def __init__(self):
        self.procs: dict = {}   # nothing of this process's making to poll

    def launch(self, worker_id: str, host_name: str = "", devices: int = 0) -> None:
        """Nothing to start: workers come by themselves."""

    def queued(self) -> str:
        """Workers come by themselves, within the registration timeout."""
        return ""

    def prepare_standby(self) -> None:
        """No standby processes outside the local launcher."""

    def adopt(self, worker_id: str, pid: int | list[int]) -> None:
        """Nothing to adopt: the scheduler owns the processes."""

    def kill(self, worker_id: str) -> None:
        """Not ours to kill: a worker declared dead is fenced, and fences itself after its lease."""

    def stop_all(self, timeout: float = 10.0) -> None:
        """Nothing to stop: live workers were told to shut down."""
