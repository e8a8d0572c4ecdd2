"""A run's side of the pool: :class:`PoolLauncher`, the launcher of a run with ``elastic_pool=ADDRESS``.

Contract: the launcher asks the pool for a host for each worker the run
launches (``launch``), gives a host back for each worker the run kills, sends
home or releases (``kill``, ``release``), and everything when the run ends
(``stop_all``). One thread polls the pool every ``POLL_SECONDS`` with the
whole of what the run wants, holds and gives back (state, not deltas: a lost
reply or a restarted pool changes nothing), and takes in its orders: hosts
granted (a worker starts there and registers with the run's controller as any
worker does), workers that ended before registering (their ``procs`` entry
answers their exit status, so the run declares them dead), and how many
hosts a run of a higher priority needs back (:meth:`give_back_due`; the
controller releases that many at its next step boundary).

A pool that does not answer costs the run nothing: it trains on the workers it
holds, and the next answered poll carries on. The run's lease timeline goes to
its own event log: ``pool_waiting``, ``lease_granted``, ``lease_returned``,
``lease_preempted`` (the controller's).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import grpc

from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.core.errors import ElasticError
from runtime.wire import rpc

__all__ = ["POLL_SECONDS", "PoolLauncher", "pool_status", "TOKEN_ENV"]

log = logging.getLogger("jax_elastic.pool.client")

#: How often a run polls its pool.
POLL_SECONDS = 0.25
#: A client's token for its pool.
TOKEN_ENV = "ELASTIC_POOL_TOKEN"


class _Leased:
    """A worker on a pool's host, as the run's ``procs`` sees it: running until the pool says it ended."""

    pid = 0

    def __init__(self):
        self.code: int | None = None
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.code

    @property
    def returncode(self) -> int | None:
        return self.code

    def ended(self, code: int) -> None:
        if self.code is None:
            self.code = code
        self._ended.set()

    def wait(self, timeout: float | None = None) -> int | None:
        self._ended.wait(timeout)
        return self.code

    def kill(self) -> None:
        """Not this process's to kill: the pool reclaims the host (see :meth:`PoolLauncher.kill`)."""

    terminate = kill


class PoolLauncher:
    """The launcher of a run whose workers are a pool's hosts (see the module's contract)."""

    external = False
    host = ""

    def __init__(self, pool: str, run_id: str, controller_address: str, secret: str, *, devices: int,
                 min_hosts: int, priority: int = 0, grace_seconds: float = 120.0, snapshot_directory: str = "",
                 chaos: bool = False, platform: str = "", events=None, run_name: str = "", token: str | None = None,
                 poll_seconds: float = POLL_SECONDS, compilation_cache_dir: str = ""):
        token = token if token is not None else os.environ.get(TOKEN_ENV, "")
        if not token:
            raise ElasticError(f"elastic_pool={pool}: set the pool's client token in ${TOKEN_ENV}")
        self.pool, self.run_id, self.events = pool, run_id, events
        self.stub = pb_grpc.PoolStub(rpc.channel(pool, token, options=rpc.RECONNECT_SOON))
        self.request = dict(run_id=run_id, priority=priority, min_hosts=min_hosts, devices=devices,
                            controller=controller_address, run_secret=secret, snapshot_directory=snapshot_directory,
                            chaos=chaos, platform=platform, grace_seconds=grace_seconds, run_name=run_name,
                            compilation_cache_dir=compilation_cache_dir)
        self.procs: dict[str, _Leased] = {}    # granted workers
        self.hosts: dict[str, str] = {}        # worker -> the pool host it runs on
        self._wanted: list[str] = []           # launched, not granted yet
        self._returned: dict[str, str] = {}    # worker -> why, until the pool no longer lists it
        self._asked_back = 0                   # hosts the pool's last answer asks back
        self._declined = 0                     # asked back, but the run had nothing to give
        self.status = ""
        self._done = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._unreachable = False
        self.poll_seconds = poll_seconds
        self._wake = threading.Event()
        self._first_poll()
        self._thread = threading.Thread(target=self._loop, name="pool-poll", daemon=True)
        self._thread.start()

    # -- the launcher's interface (runtime.control.worker_group) ---------------------------------------------

    def launch(self, worker_id: str, host_name: str = "", devices: int = 0) -> None:
        """Asks the pool for a host for ``worker_id``; it registers once granted (``procs`` has it then)."""
        if devices and devices != self.request["devices"]:
            raise ValueError("a pool's run has one device count for all its workers")
        with self._lock:
            self._wanted.append(worker_id)
        self.poke()

    def queued(self) -> str:
        """The pool's status line while the run waits for its minimum of hosts; "" once it holds it."""
        with self._lock:
            live = sum(1 for p in self.procs.values() if p.code is None)
            waiting = bool(self._wanted) and live < self.request["min_hosts"]
        if not waiting:
            return ""
        return self.status or f"waiting for the pool at {self.pool} to answer"

    def explain_unregistered(self, workers) -> str:
        where = ", ".join(f"{w} on {self.hosts.get(w, '?')}" for w in workers)
        return f"they run on the pool's hosts ({where}): see the host logs in the pool's directory"

    def prepare_standby(self) -> None:
        """The pool's hosts are warm already."""

    def adopt(self, worker_id: str, pid) -> None:
        """A restarted client's worker: still the pool's host it was granted (the next poll lists it)."""
        with self._lock:
            self.procs.setdefault(worker_id, _Leased())

    def kill(self, worker_id: str, why: str = "returned") -> None:
        """The worker's host goes back to the pool (which stops the worker and wipes the host)."""
        with self._lock:
            if worker_id in self._wanted:
                self._wanted.remove(worker_id)
                return
            if worker_id not in self.procs or worker_id in self._returned:
                return
            self._returned[worker_id] = why
        if self.events is not None:
            self.events.emit("lease_returned", worker=worker_id, why=why)
        self.poke()

    def release(self, worker_id: str) -> None:
        """A worker given back because the pool asked (:meth:`give_back_due`)."""
        self.kill(worker_id, "preempted")

    def cannot_release(self, count: int) -> None:
        """The run cannot give ``count`` back (no spare, at its minimum): not asked again for those."""
        with self._lock:
            self._declined += count

    def give_back_due(self) -> int:
        """How many hosts the pool asked back that the run has neither released (a release the pool has not
        heard of yet counts as released) nor declined."""
        with self._lock:
            releasing = sum(1 for why in self._returned.values() if why == "preempted")
            return max(self._asked_back - self._declined - releasing, 0)

    def stop_all(self, timeout: float = 10.0) -> None:
        """The run ended: everything goes back to the pool (one last poll, within ``timeout``)."""
        with self._lock:
            self._done = True
            held = [w for w, p in self.procs.items() if p.code is None and w not in self._returned]
        if self.events is not None:
            for w in held:
                self.events.emit("lease_returned", worker=w, why="run ended")
        self._stop.set()
        self._thread.join(timeout=2.0)
        try:
            self._poll_once(timeout=min(timeout, 5.0))
        except grpc.RpcError as e:
            log.warning("could not tell the pool the run ended (%s): it reclaims the hosts after the grace",
                        e.code().name)

    # -- polling ---------------------------------------------------------------

    def _first_poll(self) -> None:
        """The pool answers before anything starts, or the run fails in one line: no answer, or refused."""
        try:
            self._poll_once(timeout=10.0)
        except grpc.RpcError as e:
            code = e.code()
            if code is grpc.StatusCode.UNAUTHENTICATED:
                why = f"it refused this client's token (${TOKEN_ENV}: the pool's directory lists its tokens)"
            elif code is grpc.StatusCode.PERMISSION_DENIED:
                why = f"it refused the run: {e.details()}"
            else:
                why = f"it does not answer ({e.code().name}): is `elastic pool serve` running there?"
            raise ElasticError(f"elastic_pool={self.pool}: {why}") from None

    def poke(self) -> None:
        """Poll now rather than at the next tick."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll_once()
                if self._unreachable:
                    log.info("the pool at %s answers again", self.pool)
                self._unreachable = False
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    self.status = f"refused by the pool at {self.pool}: {e.details()}"
                elif not self._unreachable:
                    held = sum(1 for p in self.procs.values() if p.code is None)
                    log.warning("the pool at %s does not answer (%s): %s", self.pool, e.code().name,
                                f"training on with the {held} worker(s) held" if held else
                                "waiting for it to come back (the run's place in its queue is kept)")
                self._unreachable = True
            self._wake.wait(self.poll_seconds)
            self._wake.clear()

    def _poll_once(self, timeout: float = 5.0) -> None:
        with self._lock:
            held = [w for w, p in self.procs.items() if p.code is None and w not in self._returned]
            poll = pb.RunPoll(**self.request, wanted=list(self._wanted), returned=list(self._returned),
                              held=held, done=self._done)
        orders = self.stub.Run(poll, timeout=timeout)
        granted = []
        with self._lock:
            listed = {g.worker_id for g in orders.granted}
            for w in list(self._returned):
                if w not in listed:
                    del self._returned[w]
                    p = self.procs.get(w)
                    if p is not None:
                        p.ended(p.code if p.code is not None else -9)
            for g in orders.granted:
                if g.worker_id in self._wanted:
                    self._wanted.remove(g.worker_id)
                    self.procs[g.worker_id] = _Leased()
                    self.hosts[g.worker_id] = g.host_id
                    granted.append(g)
            for w, code in orders.ended.items():
                if w in self.procs:
                    self.procs[w].ended(code)
                elif w in self._wanted:   # (a worker granted and ended between two polls)
                    self._wanted.remove(w)
                    self.procs[w] = _Leased()
                    self.procs[w].ended(code)
            self._asked_back, self._declined = orders.give_back, min(self._declined, orders.give_back)
            before, self.status = self.status, orders.status
        if self.events is not None:
            for g in granted:
                self.events.emit("lease_granted", worker=g.worker_id, host=g.host_id, lease=g.lease_id)
            if orders.queued and _place(orders.status) != _place(before):
                self.events.emit("pool_waiting", status=orders.status)
                log.warning("run %s: %s", self.run_id, orders.status)


def _place(status: str) -> str:
    """A status line without its seconds (a new line is recorded when the run's place changes, not its wait)."""
    return status.split(":", 1)[-1]


def pool_status(pool: str, credential: str, timeout: float = 5.0) -> dict:
    """What the pool shows to ``credential`` (the pool secret: everything; a client token: its runs and the free
    capacity)."""
    import json

    reply = pb_grpc.PoolStub(rpc.channel(pool, credential)).Status(pb.PoolStatusRequest(), timeout=timeout)
    return json.loads(reply.json)
