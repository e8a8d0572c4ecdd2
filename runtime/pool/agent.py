"""A pool's host (``elastic worker --pool ADDRESS``): serves one lease at a time, wipes it after.

Contract: an :class:`Agent` polls its pool (with the pool secret) every
``POLL_SECONDS``. Told to serve a lease, it starts that run's worker process as
the run's own launcher would (:class:`runtime.launch.launcher.LocalLauncher`:
forked from a zygote this agent keeps warm across leases, the run's secret in
its environment, its log under the lease's directory, its compiled programs in
the run's own compilation cache if it names one, listening on ``listen``),
named for this host so the run's snapshots land in this host's directory.
The worker then joins the run's controller like any other: nothing of the run
goes through the agent or the pool.

A lease ends when its worker exits (the run ended, sent it home, or it died)
or the pool reclaims it (the run gave it back, was preempted, or its client
is gone): the worker is killed if still running, and the lease is wiped: its
directory, and this host's snapshots of the run, removed. What could not be
removed is reported (``leftovers``), and such a host leaves the pool (its agent
exits). The run's checkpoints and compilation cache are the run's own, not the
host's, and are left alone. The end
is reported on the next poll that is answered: an agent whose pool is away
keeps its worker serving and keeps polling (a restarted pool finds it again).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import sys
import time

import grpc

from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.core.child_env import jax_child_env
from runtime.launch import zygote as zygotes
from runtime.launch.launcher import LocalLauncher
from runtime.state.snapshot import host_directory
from runtime.wire import rpc

__all__ = ["Agent", "POLL_SECONDS", "PoolRefusedError", "SECRET_ENV", "main"]

log = logging.getLogger("jax_elastic.pool.agent")

#: Where a host finds the pool secret (the pool passes it to the hosts it starts).
SECRET_ENV = "ELASTIC_POOL_SECRET"
#: How often a host polls its pool.
POLL_SECONDS = 0.2


class PoolRefusedError(RuntimeError):
    """The pool refused this host's secret."""


class Agent:
    """One host of a pool (see the module's contract)."""

    def __init__(self, pool: str, secret: str, host_id: str, devices: int, directory: str, platform: str = "cpu",
                 address: str = "", listen: str = ""):
        self.pool, self.host_id, self.devices, self.platform = pool, host_id, devices, platform
        self.directory, self.address = directory, address or socket.gethostname()
        self.listen = listen   # the address its workers listen on ("": loopback, a pool of one machine)
        self.stub = pb_grpc.PoolStub(rpc.channel(pool, secret, options=rpc.RECONNECT_SOON))
        self.lease: pb.PoolLease | None = None
        self.launcher: LocalLauncher | None = None
        self.ended: list[pb.HostEnded] = []   # reported on the next poll answered
        self.stop = False
        self.leaving = False   # a wipe failed: exit once the pool heard of it
        self._unreachable_since: float | None = None

    def start(self) -> None:
        """Leftovers of an earlier agent of this host are wiped; the zygote starts warming."""
        shutil.rmtree(os.path.join(self.directory, "leases"), ignore_errors=True)
        os.makedirs(os.path.join(self.directory, "leases"), exist_ok=True)
        zygotes.prestart(jax_child_env(self.devices, self.platform))

    def run(self) -> int:
        self.start()
        while True:
            self.step()
            if self.stop and self.lease is None:
                log.info("the pool closed: host %s leaves", self.host_id)
                return 0
            time.sleep(POLL_SECONDS)

    def step(self) -> None:
        """One poll: what ended is reported, then the pool's order carried out."""
        if self.lease is not None and self._worker_exited() is not None:
            self._end(self._worker_exited())
        poll = pb.HostPoll(host_id=self.host_id, devices=self.devices, platform=self.platform,
                           lease_id=self.lease.lease_id if self.lease else "",
                           worker_state="serving" if self.lease else "", ended=self.ended, pid=os.getpid(),
                           address=self.address)
        try:
            order = self.stub.Host(poll, timeout=5.0)
        except grpc.RpcError as e:
            if e.code() is grpc.StatusCode.UNAUTHENTICATED and self.lease is None:
                raise PoolRefusedError(f"the pool at {self.pool} refused this host's secret (the pool's directory "
                                       f"has it in 'secret'; give it in ${SECRET_ENV})") from None
            if self._unreachable_since is None:
                self._unreachable_since = time.monotonic()
                log.warning("the pool at %s does not answer (%s): serving on, polling again", self.pool,
                            e.code().name)
            return
        if self._unreachable_since is not None:
            log.info("the pool answers again after %.1f s", time.monotonic() - self._unreachable_since)
            self._unreachable_since = None
        if self.leaving:
            self.stop = True
            return
        self.ended = []
        self.stop = order.stop
        if order.reclaim and self.lease is not None and order.reclaim == self.lease.lease_id:
            self._end(None)
        if order.lease.lease_id and self.lease is None:
            self._serve(order.lease)

    def _worker_exited(self) -> int | None:
        proc = self.launcher.procs.get(self.lease.worker_id) if self.launcher else None
        return proc.poll() if proc is not None else -1

    def _lease_dir(self, lease: pb.PoolLease) -> str:
        return os.path.join(self.directory, "leases", lease.lease_id)

    def _serve(self, lease: pb.PoolLease) -> None:
        home = self._lease_dir(lease)
        os.makedirs(home, exist_ok=True)
        self.lease = lease
        self.launcher = LocalLauncher(lease.run_id, lease.controller, self.devices, os.path.join(home, "logs"),
                                      secret=lease.run_secret, chaos=lease.chaos, platform=lease.platform or
                                      self.platform, compilation_cache_dir=lease.compilation_cache_dir,
                                      listen=self.listen)
        log.info("serving %s as worker %s of run %s", lease.lease_id, lease.worker_id, lease.run_id)
        try:
            self.launcher.launch(lease.worker_id, self.host_id)
        except OSError as e:
            log.error("could not start worker %s: %s", lease.worker_id, e)

    def _end(self, code: int | None) -> None:
        """The lease's worker stopped (killed when ``code`` is None), the lease wiped and reported."""
        lease, launcher = self.lease, self.launcher
        if code is None:
            launcher.kill(lease.worker_id)
            proc = launcher.procs.get(lease.worker_id)
            code = proc.wait(10.0) if proc is not None else -1
        launcher.stop_all(timeout=5.0)   # (the zygote goes back to this process's pool, warm for the next lease)
        leftovers = self.wipe(lease)
        log.info("%s ended (worker %s exited %s); wiped%s", lease.lease_id, lease.worker_id, code,
                 f", except {leftovers}" if leftovers else "")
        self.ended.append(pb.HostEnded(lease_id=lease.lease_id, exit_code=int(code), wiped=not leftovers,
                                       leftovers=leftovers))
        self.lease = self.launcher = None
        if leftovers:   # a host that cannot wipe serves no one again: it leaves once the pool heard
            log.error("could not wipe %s (%s left): this host leaves the pool", lease.lease_id, leftovers)
            self.leaving = True

    def wipe(self, lease: pb.PoolLease) -> list[str]:
        """Removes what the lease left on this host; answers what could not be removed."""
        paths = [self._lease_dir(lease)]
        if lease.snapshot_directory and os.path.isabs(lease.snapshot_directory):
            paths.append(host_directory(os.path.join(lease.snapshot_directory), self.host_id))
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
        return [p for p in paths if os.path.exists(p)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="elastic worker --pool", description=__doc__.splitlines()[0])
    ap.add_argument("--pool", required=True, help="HOST:PORT of the pool")
    ap.add_argument("--host-id", default="", help="this host's name in the pool (default: the machine's name)")
    ap.add_argument("--devices", type=int, default=0, help="simulated CPU devices (default: what JAX finds)")
    ap.add_argument("--platform", default="cpu")
    ap.add_argument("--directory", default="", help="where leases keep their files (wiped after each)")
    ap.add_argument("--listen", default="", help="the address its workers listen on, which the runs' clients and "
                                                 "peers reach (default: 127.0.0.1, a pool of one machine)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        print(f"elastic: error: set the pool secret in ${SECRET_ENV} (the pool's directory has it in "
              "'secret')", file=sys.stderr)
        return 2
    host_id = args.host_id or socket.gethostname()
    directory = args.directory or os.path.join(os.path.expanduser("~"), ".cache", "jax-elastic", "pool", host_id)
    agent = Agent(args.pool, secret, host_id, args.devices or 1, directory, args.platform, listen=args.listen)
    try:
        return agent.run()
    except PoolRefusedError as e:
        print(f"elastic: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
