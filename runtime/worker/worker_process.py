"""The worker process: serves a :class:`runtime.worker.worker.WorkerService` until the run lets it go.

``python -m runtime.worker.worker_process --controller HOST:PORT --run-id RUN`` (what
:class:`runtime.launch.launcher.LocalLauncher` starts) or ``elastic worker``. Binds
port 0 unless told otherwise, registers its address with the controller, and
exits when told to shut down, when the run's owner (the client that
launched it, ``--owner-pid``; see :mod:`runtime.core.owner`) dies, or when it
fenced itself and the controller refused to take it back. A worker whose
run has a client grace (``elastic_client_grace_seconds``, told with its
registration's answer) outlives its client instead, whether it holds a
state or has loaded nothing yet: fenced, keeping what it holds, it waits
that long for a restarted client of the run to attach it, then exits as it
would have.
Locally launched workers run in a process group of their own, so a signal to the
client's process group (a terminal closing) does not reach them.

A worker that must go goes at once, whatever its other threads do: an XLA
compile or a step cannot be interrupted, so :func:`main` ends the process
with ``os._exit`` after a bounded cleanup instead of waiting for them (a
normal interpreter exit joins every thread of the gRPC server's pool).

Exit status: 0 told to shut down, or the run it came to join had ended;
1 failed to start (the first registration was refused, its run secret too;
no controller answered within ``--register-timeout``), with one line that
says why; 3 fenced itself and was refused (or could not ask) when it asked
to come back, or its grace ran out after its lease lapsed; 4 the run's owner
died (at once, or when the grace ran out).

Set ``XLA_FLAGS`` (device count) before this module is imported.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import socket
import sys
import time
import uuid

import grpc
import jax
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from runtime.core import allocator, compile_cache
from runtime.core.arguments import positive_seconds, slice_flags_problem
from runtime.core.errors import AuthenticationError, ElasticError, RegistrationTimeoutError
from runtime.wire import auth, rpc
from runtime.core.owner import Owner, set_title
from runtime.core.platforms import join_slice
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.wire.dataplane import DataServer
from runtime.worker.fault_injection import PartitionInterceptor
from runtime.worker.worker import WorkerService

__all__ = ["serve", "main", "slice_id", "EXIT_SHUTDOWN", "EXIT_FAILED", "EXIT_FENCED", "EXIT_ORPHANED"]

log = logging.getLogger("jax_elastic.worker")

EXIT_SHUTDOWN, EXIT_FAILED, EXIT_FENCED, EXIT_ORPHANED = 0, 1, 3, 4
STOP_GRACE_SECONDS = 0.5   # calls in flight get this long to finish when the worker goes
REGISTER_SECONDS = 60.0    # the first registration waits this long for a controller (--register-timeout)
#: Benchmarks only (benchmarks/pipeline_bubble.py --workers): seconds each pipeline stage worker sleeps per forward
#: and per backward (a last counts both), so stages are equal and slower than the host's noise. Read by the worker
#: process alone (a run's client passes its environment on to the workers it launches); never a config key.
STAGE_DELAY_VARIABLE = "ELASTIC_SIMULATED_STAGE_DELAY"


def serve(controller: str, run_id: str, worker_id: str, host: str = "127.0.0.1", port: int = 0,
          register_timeout: float = REGISTER_SECONDS, owner: Owner | None = None, secret: str = "",
          chaos: bool = False, tls=None, host_name: str = "", stage_delay: float = 0.0,
          slice_host: int = 0, slice_hosts: int = 1) -> int:
    """Runs a worker until told to shut down, its ``owner`` dies (None: no owner), or it fences itself.

    Returns the process exit status once the server stopped (a bounded
    wait; handlers still running, such as a compile, are left behind):
    ``EXIT_SHUTDOWN`` after a shutdown, ``EXIT_FENCED`` after fencing itself
    (it lost the controller's lease and was refused when it asked to come
    back: the run has moved on without it), ``EXIT_ORPHANED`` when its
    owner died; ``EXIT_SHUTDOWN`` at once when the controller answers that
    the run already ended. Raises ``SystemExit`` when the controller refuses
    the first registration, ``AuthenticationError`` when it refuses the run
    secret, ``RegistrationTimeoutError`` when no controller answers within
    ``register_timeout`` seconds (each message one line that says what to
    do). ``stage_delay``: benchmarks only, seconds a pipeline stage sleeps per
    forward and per backward (a simulated compute; see :func:`main`).
    ``slice_host`` of ``slice_hosts``: which host of its slice this worker is
    (it joined the slice's distributed system first: :func:`join_slice`).

    Only calls that passed the transport and the run secret renew the
    worker's lease on its controller; a chaos partition drops calls before
    either (see :func:`runtime.wire.rpc.make_server`).
    """
    allocator.retain_freed_memory()   # before the first step's buffers
    service = WorkerService(run_id, worker_id, secret, chaos=chaos, tls=tls, host=host_name, stage_delay=stage_delay)
    try:
        server, bound = rpc.make_server(host, port, secret=secret, tls=tls,
                                        interceptors=[PartitionInterceptor(service.faults)],
                                        refusals=service.refusals, on_authenticated=service.lease.heard)
    except FileNotFoundError as e:   # a TLS file (the message names it)
        raise ElasticError(str(e)) from None
    except OSError as e:
        raise ElasticError(f"{e}: give --host an address of this machine (in a pod, its IP) and --port a free port "
                           "(0: any)") from None
    pb_grpc.add_WorkerServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    server.start()
    address = f"{host}:{bound}"
    data = DataServer(host, secret=secret, tls=tls, on_push=service.receive_push, on_state=service.state_parts,
                      on_shared_state=service.shared_state, status_name=rpc.status_name, refusals=service.refusals,
                      dropped=service.faults.partitioned, on_steps=service.serve_step_connection)
    devices = jax.devices()
    lease = service.lease
    lease.controller, lease.owner = controller, owner
    service.identity = pb.AttachReply(worker_id=worker_id, pid=os.getpid(), host=service.host,
                                      num_devices=len(devices), platform=devices[0].platform, address=address,
                                      data_address=data.address)
    stubs: dict[str, pb_grpc.ControllerStub] = {}

    def register(rejoin: bool, timeout: float = register_timeout) -> pb.RegisterReply:
        where = lease.controller   # a restarted client may listen elsewhere (its Attach says where)
        if where not in stubs:
            stubs[where] = pb_grpc.ControllerStub(rpc.channel(where, secret, tls))
        return stubs[where].Register(pb.RegisterRequest(run_id=run_id, worker_id=worker_id, address=address,
                                                        data_address=data.address,
                                                        num_devices=len(devices), platform=devices[0].platform,
                                                        pid=os.getpid(), rejoin=rejoin, host=service.host,
                                                        slice_host=slice_host, slice_hosts=slice_hosts),
                                     timeout=timeout, wait_for_ready=True)

    lease.joining()   # the controller may call before the answer below is read: those calls wait for it
    try:
        reply = register(False)
    except BaseException as e:
        server.stop(0)
        data.close()
        if isinstance(e, grpc.RpcError):
            raise _registration_error(e, controller, register_timeout, tls is not None) from None
        raise
    if not reply.accepted:
        server.stop(0)
        data.close()
        if reply.run_ended:   # a replacement that came too late: nothing to do, and nothing went wrong
            log.warning("%s: nothing to do; exiting", reply.reason)
            return EXIT_SHUTDOWN
        raise SystemExit(f"controller refused worker {worker_id}: {reply.reason}")
    lease.joined(reply.generation, reply.client_grace_seconds)   # the client generation it joined, and its grace
    log.info("worker %s%s serving on %s with %d %s devices (%s)", worker_id,
             f" (host {slice_host} of {slice_hosts})" if slice_hosts > 1 else "", address, len(devices),
             devices[0].platform, ", ".join(sorted({d.device_kind for d in devices})))
    status = _serve_run(service, register, register_timeout, health_servicer)
    health_servicer.enter_graceful_shutdown()
    # Bounded: a handler stuck in a compile is cancelled for its caller and left behind.
    server.stop(grace=STOP_GRACE_SECONDS).wait(STOP_GRACE_SECONDS + 1.0)
    data.close()
    service.close()
    return status


def _registration_error(e: grpc.RpcError, controller: str, timeout: float, tls: bool) -> ElasticError:
    """What a first registration that failed with ``e`` means, in one line that says what to do."""
    code = e.code()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"the controller at {controller} refused this worker's run secret: give it the "
                                   "run's secret in $ELASTIC_RUN_SECRET (the client's)")
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
        return RegistrationTimeoutError(
            f"no controller answered at {controller} within {timeout:g} s: start the run's client first, check "
            f"--controller{' and the TLS files' if tls else ' (a run over TLS also needs --tls-cert/key/ca)'}, or "
            "wait longer with --register-timeout (a run that already ended has no controller either)")
    return ElasticError(f"registering with the controller at {controller} failed: {code.name}: {e.details()}")


def _serve_run(service: WorkerService, register, register_timeout: float, health_servicer) -> int:
    """Watches the run until this worker must go; returns its exit status.

    It goes when told to shut down; when its owner died or its lease lapsed,
    at once without a client grace, else once the grace
    ran out with no new client attached; when it fenced itself and its
    client, asked, refused to take it back (the run moved on without it).
    """
    orphaned = False   # the grace began with the owner's death (exit 4 at its end)
    last_ask = 0.0
    lease = service.lease
    lease.serving = lambda ok: health_servicer.set("", health_pb2.HealthCheckResponse.SERVING if ok
                                                   else health_pb2.HealthCheckResponse.NOT_SERVING)
    while not service.stopped.wait(0.2):
        owner = lease.owner
        if owner is not None and not owner.alive():
            lease.owner = None
            why = f"the run's owner (process {owner.pid}) is gone"
            if not lease.lose_client(why):
                log.warning("%s; exiting", why)
                return _run_over(service, EXIT_ORPHANED)
            orphaned = True
        if lease.client_lost_at is not None:   # within the grace: a new client may attach this worker
            if lease.grace_over():
                log.warning("no client of run %s attached this worker within %.0f s; exiting", lease.run_id,
                            lease.client_grace)
                return _run_over(service, EXIT_ORPHANED if orphaned else EXIT_FENCED)
            if time.monotonic() - last_ask > 1.0 and not service.faults.partitioned():
                last_ask = time.monotonic()
                reply = _ask(register)
                if reply is not None and not reply.accepted and not reply.wait \
                        and reply.generation == lease.generation and lease.client_lost_at is not None:
                    log.warning("asked to rejoin after fencing: refused: %s", reply.reason)
                    return _run_over(service, EXIT_FENCED)   # its client lives and went on without it
            continue
        if lease.lease_lapsed():
            orphaned = False
            lease.serving(False)
            if lease.lose_client(lease.fenced):
                continue
            reply = _rejoin(service, register, register_timeout, lease.owner)
            log.warning("asked to rejoin after fencing: %s", "no answer" if reply is None else
                        f"accepted={reply.accepted} {reply.reason}")
            if reply is None or not reply.accepted:
                return EXIT_FENCED
    return EXIT_SHUTDOWN


def _ask(register) -> pb.RegisterReply | None:
    """One short rejoin request during the grace; None when no client answers."""
    try:
        return register(True, 1.0)
    except grpc.RpcError:
        return None


def _run_over(service: WorkerService, status: int) -> int:
    """The worker leaves the run for good: its snapshots on this host serve nobody now."""
    snapshots = service.state_mover.snapshots
    if snapshots is not None:
        snapshots.remove_all()
    return status


def _rejoin(service: WorkerService, register, timeout: float, owner: Owner | None):
    """A fenced worker asks the controller to take it back (it will be refused while the run lives).

    None when there is no answer within ``timeout`` seconds, or the owner died meanwhile.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if owner is not None and not owner.alive():
            return None
        if not service.faults.partitioned():
            try:
                return register(True, min(max(deadline - time.monotonic(), 0.1), 5.0))
            except grpc.RpcError as e:
                log.warning("rejoin failed: %s", e.code().name)
        time.sleep(0.5)
    return None


def main(argv=None) -> None:
    """Parses the command line, serves, and ends the process with :func:`serve`'s status (never returns).

    Ends it with ``os._exit`` once :func:`serve` returned or raised, so no
    thread still compiling or stepping keeps it alive.
    """
    ap = argparse.ArgumentParser(prog="elastic worker", description="Run a jax-elastic worker.")
    ap.add_argument("--controller", required=True, help="HOST:PORT of the controller")
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--worker-id", default="",
                    help="default: this machine's name and a random suffix; a slice of several hosts takes its host "
                         "0's (see slice_id)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--host-name", default="",
                    help="the host this worker runs on, where its in-memory snapshots live (default: this machine's "
                         "name; the local launcher names one simulated host per worker slot)")
    ap.add_argument("--slice-hosts", type=int, default=1,
                    help="how many hosts (worker processes) this worker's slice has; more than 1: they join one "
                         "JAX distributed system at --slice-coordinator and run the slice's programs together")
    ap.add_argument("--slice-host", type=int, default=0, help="which host of its slice this worker is (0-based)")
    ap.add_argument("--slice-coordinator", default="",
                    help="HOST:PORT of the slice's JAX coordinator (served by its host 0)")
    ap.add_argument("--owner-pid", type=int, default=None,
                    help="exit when this process (the run's client) dies; the local launcher passes its own pid")
    ap.add_argument("--exit-with-parent", action="store_true",
                    help="exit when the launching process dies (--owner-pid of the parent)")
    ap.add_argument("--standby", action="store_true",
                    help="start JAX, then wait for '<worker id> [<host name>]' on stdin, or in --identity-fifo "
                         "(the launcher's standby processes)")
    ap.add_argument("--identity-fifo", default="",
                    help="a standby's named pipe to read its identity from (instead of stdin)")
    ap.add_argument("--chaos", action="store_true", default=os.environ.get("ELASTIC_CHAOS") == "1",
                    help="serve fault-injection calls from the chaos harness (default: $ELASTIC_CHAOS=1)")
    for name, env in (("cert", "ELASTIC_TLS_CERT"), ("key", "ELASTIC_TLS_KEY"), ("ca", "ELASTIC_TLS_CA")):
        ap.add_argument(f"--tls-{name}", default=os.environ.get(env, ""),
                        help=f"PEM {name} file for mutual TLS (default: ${env})")
    ap.add_argument("--compilation-cache-dir", default=os.environ.get("ELASTIC_COMPILATION_CACHE_DIR", ""),
                    help="JAX's persistent compilation cache, shared with the run's other processes "
                         "(default: $ELASTIC_COMPILATION_CACHE_DIR; empty: none)")
    ap.add_argument("--simulated-stage-delay", type=_delay, default=os.environ.get(STAGE_DELAY_VARIABLE, "0"),
                    help="benchmarks only: seconds a pipeline stage worker sleeps per forward and per backward, a "
                         f"simulated compute that makes stages equal (default: ${STAGE_DELAY_VARIABLE}, else 0)")
    ap.add_argument("--secret", default=None,
                    help="the run secret (default: $ELASTIC_RUN_SECRET; an argument is visible in ps)")
    ap.add_argument("--register-timeout", type=positive_seconds, default=REGISTER_SECONDS, metavar="SECONDS",
                    help=f"how long to wait for the controller to answer the first registration (default: "
                         f"{REGISTER_SECONDS:g}); then exit 1")
    args = ap.parse_args(argv)
    if problem := slice_flags_problem(args.slice_hosts, args.slice_host, args.slice_coordinator):
        ap.error(problem)
    if args.slice_hosts > 1 and args.standby:
        ap.error("a host of a slice of several (--slice-hosts > 1) cannot be a --standby (it joins its slice before "
                 "JAX starts)")
    if not args.worker_id and (args.slice_host == 0 or args.standby):
        args.worker_id = f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    secret = args.secret if args.secret is not None else os.environ.get("ELASTIC_RUN_SECRET", "")
    name = args.worker_id if args.slice_hosts == 1 else f"{args.worker_id or 'slice'}/{args.slice_host}"
    logging.basicConfig(level=logging.INFO, format=_log_format(name), stream=sys.stderr)
    owner_pid = args.owner_pid if args.owner_pid is not None else os.getppid() if args.exit_with_parent else None
    owner = Owner(owner_pid) if owner_pid is not None else None
    if args.simulated_stage_delay:
        log.warning("simulated compute: each pipeline forward and backward sleeps %g s more (%s, for benchmarks)",
                    args.simulated_stage_delay, STAGE_DELAY_VARIABLE)
    try:
        compile_cache.enable(args.compilation_cache_dir)
        if args.standby:
            set_title(f"elastic-worker standby run={args.run_id}")
            args.worker_id, args.host_name = _wait_for_identity(args.identity_fifo, owner)
        set_title(f"elastic-worker run={args.run_id} worker={name} host={args.host_name or '-'}")
        if args.slice_hosts > 1:
            join_slice(args.slice_coordinator, args.slice_hosts, args.slice_host, args.register_timeout)
            args.worker_id = _agree_slice_id(args.worker_id, args.slice_host, args.register_timeout)
            logging.getLogger().handlers[0].setFormatter(
                logging.Formatter(_log_format(f"{args.worker_id}/{args.slice_host}")))
        status = serve(args.controller, args.run_id, args.worker_id, args.host, args.port,
                       register_timeout=args.register_timeout, owner=owner,
                       secret=secret, chaos=args.chaos, host_name=args.host_name,
                       stage_delay=args.simulated_stage_delay, slice_host=args.slice_host,
                       slice_hosts=args.slice_hosts,
                       tls=auth.TlsFiles(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert else None)
    except SystemExit as e:
        log.error("%s", e.code)
        status = e.code if isinstance(e.code, int) else EXIT_FAILED
    except ElasticError as e:   # it could not join: one line says why and what to do
        log.error("cannot join run %s: %s", args.run_id, e)
        status = EXIT_FAILED
    except BaseException:   # noqa: BLE001 - reported here, then the process ends
        log.exception("worker %s failed", args.worker_id)
        status = EXIT_FAILED
    _exit_now(status)


#: The key of a slice's id in its key-value store (its JAX coordinator's), written once by its host 0.
_SLICE_ID_KEY = "jax_elastic/slice_id"


def slice_id(given: str, host: int, host0s: str) -> str:
    """The id that host ``host`` of a slice of several registers as: its host 0's (``host0s``), so that the hosts
    of a slice started by hand (or restarted by a scheduler: a fresh slice needs a fresh id) agree without being
    told. ``given``: this host's ``--worker-id`` ("": none). ``ElasticError`` in one line when a host other than 0
    was given another id. Pure."""
    if host and given and given != host0s:
        raise ElasticError(f"--worker-id {given!r} is not its slice's: host 0 of this slice joined as {host0s!r} "
                           "(give every host of a slice the same --worker-id, or none but host 0)")
    return host0s


def _agree_slice_id(given: str, host: int, timeout: float) -> str:
    """:func:`slice_id` over the slice's key-value store: host 0 writes its id there, the others read it (waiting
    up to ``timeout`` seconds)."""
    from jax._src import distributed   # the client has no public name; runtime.worker.agreement uses it too

    client = distributed.global_state.client
    if host == 0:
        client.key_value_set(_SLICE_ID_KEY, given)
        return given
    return slice_id(given, host, client.blocking_key_value_get(_SLICE_ID_KEY, int(timeout * 1000)))


def _delay(text: str) -> float:
    """A simulated stage delay: seconds, finite and >= 0."""
    try:
        seconds = float(text or 0)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{STAGE_DELAY_VARIABLE} must be seconds >= 0, got {text!r}")
    return seconds


def _log_format(worker_id: str) -> str:
    return f"%(asctime)s {worker_id} %(levelname)s %(message)s"


def _start_backend() -> None:
    """Pays JAX's one-time costs of a first load now: the backend, and what calling an exported program sets up."""
    x = jax.numpy.zeros((), jax.numpy.float32)
    exported = jax.export.deserialize(jax.export.export(jax.jit(lambda v: v + 1))(x).serialize())
    jax.block_until_ready(jax.jit(exported.call)(x))


def _wait_for_identity(fifo: str, owner: Owner | None) -> tuple[str, str]:
    """A standby: starts the devices, then waits for ``<worker id> [<host name>]`` on stdin, or in the named pipe
    ``fifo``; exits 0 at end-of-file or an empty line (not needed), and 4 when its owner dies first."""
    _start_backend()
    log.info("standby process %d waiting for its worker id", os.getpid())
    line = _read_identity(fifo, owner) if fifo else sys.stdin.readline()
    worker_id, _, host_name = line.strip().partition(" ")
    if not worker_id:
        _exit_now(EXIT_SHUTDOWN)
    logging.getLogger().handlers[0].setFormatter(logging.Formatter(_log_format(worker_id)))
    log.info("standby process %d serves as worker %s", os.getpid(), worker_id)
    return worker_id, host_name.strip()


def _read_identity(fifo: str, owner: Owner | None) -> str:
    """One line from the named pipe ``fifo`` (removed once read), watching the owner meanwhile.

    The pipe is opened for reading and writing, so it never reads end-of-file
    while no writer has it open: the launcher opens it only to write the line.
    """
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    line, orphaned = b"", False
    try:
        while not line.endswith(b"\n"):
            if owner is not None and not owner.alive():
                orphaned = True
                break
            readable, _, _ = select.select([fd], [], [], 0.2)
            if readable:
                line += os.read(fd, 4096)
    finally:
        os.close(fd)
        try:
            os.unlink(fifo)
        except OSError:
            pass
    if orphaned:
        log.warning("the run's owner (process %d) is gone before this standby was needed; exiting", owner.pid)
        _exit_now(EXIT_ORPHANED)
    return line.decode()


def _exit_now(status: int) -> None:
    """Ends the process at once: flushes the logs, then ``os._exit`` (threads are not joined)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


if __name__ == "__main__":
    main()
