"""The controller's registration service: workers announce themselves here.

Contract: :class:`Registry` is the ``Controller`` gRPC servicer. It records
each worker that may join (``worker_registered``) and wakes whoever waits on
``cond``; it refuses, recorded as ``register_refused``, a worker of another
run, an id already in use, or one the run has fenced (``refuse`` says why);
it ends a registration that cannot describe a worker with INVALID_ARGUMENT
(:meth:`Registry.malformed`, pure) and records nothing. Once the run ended
(:meth:`Registry.end`) every registration is answered ``run_ended`` and
recorded nowhere: the worker has nothing to join and exits 0. ``refusals``
counts the calls the controller's server refused for their run secret. Every
worker it accepts is told the run's client grace with its answer, so each
process of the run outlives its client for the grace however and whenever it
was started, loaded or not.
"""

from __future__ import annotations

import threading

import grpc

from runtime.wire import auth
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.core.events import EventLog
from runtime.control.placement import WorkerInfo
from runtime.core.hosts import host_id, slice_address

__all__ = ["Registry", "slice_info"]


class Registry(pb_grpc.ControllerServicer):
    """Receives worker registrations (the controller's gRPC service).

    A registration that cannot describe a worker (no id, an address that is
    not ``host:port``, no devices, a pid that is not a process's) ends with
    INVALID_ARGUMENT and is not recorded; one that may not join (another
    run, an id already in use or fenced) is answered ``accepted=False`` and
    recorded as ``register_refused``. ``refusals`` counts the calls the
    controller's server refused for their run secret (pass it to
    ``rpc.make_server``), drained by :meth:`runtime.control.worker_group.WorkerGroup.collect_security_events`.
    """

    def __init__(self, run_id: str, events: EventLog, refuse, generation: int = 0, waits=lambda worker: False,
                 hosts_per_slice: int = 1, client_grace: float = 0.0):
        self.run_id, self.generation = run_id, generation
        self.client_grace = client_grace   # told every worker it accepts: how long it outlives this client
        self.hosts_per_slice = hosts_per_slice   # a slice registers once all its hosts did (runtime.core.hosts)
        self._forming: dict[str, dict[int, WorkerInfo]] = {}   # slice -> its hosts registered so far
        self.waits = waits   # worker id -> whether a fenced worker asking to rejoin should wait to be taken back
        self.events = events
        self.refuse = refuse   # worker id -> why it may not (re)join, "" if it may
        self.workers: dict[str, WorkerInfo] = {}
        self.ended = False   # the run is over: registrations are answered run_ended (see end)
        self.cond = threading.Condition()
        self.refusals = auth.Refusals()

    def Register(self, request, context):
        malformed = self.malformed(request)
        if malformed:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"registration refused: {malformed}")
        reason, wait = "", False
        hosts = max(request.slice_hosts, 1)
        if request.run_id != self.run_id:
            reason = f"this controller runs {self.run_id!r}, not {request.run_id!r}"
        elif hosts != self.hosts_per_slice:
            reason = (f"this run's slices have {self.hosts_per_slice} host(s) (elastic_hosts_per_slice="
                      f"{self.hosts_per_slice}), this worker's {hosts}: start each host of a slice with "
                      f"--slice-hosts {self.hosts_per_slice}" + (" --slice-host K --slice-coordinator HOST0:PORT"
                                                                 if hosts == 1 else ""))
        elif request.slice_host in self._forming.get(request.worker_id, {}):
            reason = f"host {request.slice_host} of slice {request.worker_id!r} already registered"
        elif request.rejoin and self.waits(request.worker_id):
            reason, wait = "this client takes its fenced workers back (Attach): wait for it", True
        elif request.worker_id in self.workers:
            reason = self.refuse(request.worker_id) or f"worker id {request.worker_id!r} is already a member"
        elif request.rejoin:   # fenced by an earlier client of the run: this one attaches those it knows
            reason = (f"the run's client restarted (generation {self.generation}); it attaches the workers its "
                      "event log names")
        if reason:
            self.events.emit("register_refused", worker=request.worker_id, rejoin=request.rejoin, reason=reason)
            return pb.RegisterReply(accepted=False, reason=reason, generation=self.generation, wait=wait)
        info = WorkerInfo(host_id(request.worker_id, request.slice_host, hosts), request.address,
                          request.num_devices, request.platform, request.pid, request.data_address, request.host)
        with self.cond:   # with end(): a worker is either registered before the end (and sent home) or told it ended
            if self.ended:
                return pb.RegisterReply(accepted=False, run_ended=True, generation=self.generation,
                                        reason=f"run {self.run_id} ended before this worker joined")
            if hosts > 1:   # a host of a slice of several: the slice registers with its last host
                forming = self._forming.setdefault(request.worker_id, {})
                forming[request.slice_host] = info
                if len(forming) < hosts:
                    return self._accepted()
                info = slice_info(request.worker_id, [forming[k] for k in range(hosts)])
                del self._forming[request.worker_id]
            self.add(info)
        self.events.emit("worker_registered", worker=info.worker_id, address=info.address,
                         devices=info.num_devices, platform=info.platform, pid=info.pid, host=info.host,
                         data_address=info.data_address,
                         **({"hosts": info.host_records()} if info.hosts else {}))
        return self._accepted()

    def _accepted(self) -> pb.RegisterReply:
        """The answer to a worker (or a host of a slice) that joins: this client's generation and its grace, the
        one place a worker of the run learns how long to outlive its client."""
        return pb.RegisterReply(accepted=True, generation=self.generation, client_grace_seconds=self.client_grace)

    def add(self, info: WorkerInfo) -> None:
        """Records a worker as registered (a registration, or one a restarted client attached)."""
        with self.cond:
            self.workers[info.worker_id] = info
            self.cond.notify_all()

    def end(self) -> list[WorkerInfo]:
        """The run is over (the client closes it): later registrations are answered ``run_ended``. Answers every
        worker registered until now, for the client to send home (one that registered late was never adopted)."""
        with self.cond:
            self.ended = True
            return list(self.workers.values())

    @staticmethod
    def malformed(r: pb.RegisterRequest) -> str:
        """Why a registration cannot describe a worker ("" when it can). Pure."""
        if not r.worker_id or len(r.worker_id) > 128 or not r.worker_id.isprintable():
            return f"worker id {r.worker_id[:40]!r} is not 1..128 printable characters"
        if not _host_port(r.address):
            return f"address {r.address[:60]!r} is not host:port"
        if r.data_address and not _host_port(r.data_address):
            return f"data address {r.data_address[:60]!r} is not host:port"
        if not 1 <= r.num_devices <= 1 << 16 or not r.platform or len(r.platform) > 32:
            return f"{r.num_devices} devices of platform {r.platform[:40]!r}"
        if not 1 < r.pid < 1 << 32:
            return f"pid {r.pid} is not a process id"   # a chaos fault signals this pid: never 0, 1 or negative
        return ""


def slice_info(slice_id: str, hosts: list[WorkerInfo]) -> WorkerInfo:
    """A slice of several hosts as one registered worker, from its hosts' (in host order; see
    :class:`~runtime.control.placement.WorkerInfo`). Pure."""
    first = hosts[0]
    return WorkerInfo(slice_id, slice_address([h.address for h in hosts]), first.num_devices, first.platform,
                      first.pid, slice_address([h.data_address for h in hosts]) if first.data_address else "",
                      first.host, tuple(hosts))


def _host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and len(address) <= 300 and address.isprintable() and port.isdigit() and 0 < int(port) < 65536
