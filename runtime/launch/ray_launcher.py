"""Workers as Ray actors on an existing Ray cluster (``elastic_launcher=ray``).

Ray places, starts and stops the processes; everything else is the runtime's
usual protocol. Each worker is one actor (``max_restarts=0``: a dead worker
is replaced by a new actor, with a new worker id, that joins as a spare),
which serves the same gRPC worker as a local subprocess
(:func:`runtime.worker.worker_process.serve`), bound to its node's IP address. Its
JAX environment (device count, platform) is the actor's ``runtime_env``, so
it is set before the actor imports JAX; its resources are one CPU, plus
its devices as GPUs when the platform is ``gpu``.

A slice of several hosts (``elastic_hosts_per_slice``) is one actor per
host, all in one placement group of the slice's own (:meth:`RayLauncher.launch`):
host 0's actor serves the slice's JAX coordinator on its node, the slice is
lost with any of its actors (the others are killed and the group removed,
like :class:`runtime.launch.launcher.SliceProcesses`), and a fresh slice is a
fresh group.

Actors are detached (``lifetime="detached"``), each named
``jax-elastic-{run_id}-{worker_id}`` (:func:`actor_name`) in the namespace
``jax-elastic`` (:data:`NAMESPACE`: a driver's own namespace is anonymous
unless it names one, so a restarted client would not see them there). They
outlive the client (the Ray driver) that created them: when it dies, its
workers keep their state for the client grace
(``elastic_client_grace_seconds``, counted from their lease lapsing) as
local workers do; the same command run again reaches them by the gRPC
addresses of the run's log and re-attaches them, and
:meth:`RayLauncher.adopt` finds each actor by its name (``ray.get_actor``),
so the new client kills and stops them like its own. That needs a cluster
that outlives the client (``ray start``): a local Ray instance started by the
client dies with it, actors and all.

A detached actor never outlives its run: once its ``serve`` call returned
(told to shut down, fenced and refused, its grace over with no client, or
failed) the actor ends itself (``ray.actor.exit_actor``, from a call of its
own so that ``serve`` still answers its status); one that gets no ``serve``
call within :data:`CLAIM_SECONDS` of starting (its driver died in between)
ends itself too; and the client kills the actors it stops, sends home or
declares dead (``ray.kill``).

Ray's own failure signals feed the health monitor as one more source next to
the lease: a watcher thread waits on every actor's ``serve`` call (an
adopted actor's ``serve`` call belongs to the dead driver, so on its ``watch``
call instead, asked again every :data:`WATCH_SECONDS`), and an
actor that dies (its process killed, its node removed from the cluster) is
reported at once through ``on_lost`` (``WorkerGroup.declare_dead``). A
relaunched worker asks Ray for its dead predecessor's node (soft affinity),
so it finds the in-memory snapshots that node keeps.

Ray is an optional dependency (``pip install jax-elastic[ray]``): only this
module imports it, and only when the launcher is chosen. The cluster is
``address`` (``ray_address``), else ``$RAY_ADDRESS``, else a local one Ray
starts. Worker logs are Ray's (its session's ``logs`` directory on each
node). The run secret reaches the actors as an argument of their call: it is
as visible as anything else in the cluster's control store.

A cluster named by ``host:port`` is asked first, over the gRPC of its control
store (GCS), which nodes it has (:func:`cluster_problem`, :func:`cluster_room`):
the client's Ray driver joins the node of this machine that registered there
(:func:`driver_node`), wherever Ray put it (``ray start --node-ip-address=127.0.0.1``
registers the host's interface address unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is in its environment), and a run
the nodes cannot hold is refused before anything starts.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from runtime.core.hosts import host_id

__all__ = ["NAMESPACE", "SLICE_STRATEGY", "ClusterNode", "ClusterRoom", "RayLauncher", "actor_name", "cluster_problem",
           "cluster_room", "connect", "driver_node", "ray_available", "room_for_actors", "unregistered_reason"]

log = logging.getLogger("jax_elastic.ray")

#: The Ray namespace of every worker actor: a restarted client (another Ray job, in a namespace of its own unless
#: it names one) finds the actors of its run there by name.
NAMESPACE = "jax-elastic"
#: How long one ``watch`` call of an adopted actor waits for its ``serve`` call to end before the watcher asks
#: again (a call whose client died holds one of the actor's threads that long at most).
WATCH_SECONDS = 10.0
#: How long a new actor waits for its ``serve`` call before it ends itself: a driver that died between creating a
#: detached actor and handing it that call (Ray hands it once the actor is up) leaves nobody else to end it.
CLAIM_SECONDS = 60.0
#: Threads of an actor: its ``serve`` call, the ``watch`` call of each client that adopted it (the live one, and
#: a dead one's for at most ``WATCH_SECONDS``), its own ``leave`` call.
_CONCURRENCY = 8

#: How a slice of several hosts is placed: its actors' bundles on as few nodes as hold them (see
#: :meth:`RayLauncher.launch`).
SLICE_STRATEGY = "PACK"
#: How long the last actor of a slice of several waits for its siblings to end before it removes their placement
#: group under them (see :meth:`_WorkerActor.leave`).
RELEASE_SECONDS = 30.0

#: Env vars an actor's JAX reads (from :func:`runtime.core.child_env.jax_child_env`), passed as its runtime_env.
_ENV = ("XLA_FLAGS", "JAX_PLATFORMS", "ELASTIC_CHAOS", "ELASTIC_COMPILATION_CACHE_DIR")


def ray_available() -> str:
    """"" when Ray can be imported here, else why not (for a clear error before a run starts)."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        return f"Ray is not installed ({e}); pip install 'jax-elastic[ray]'"
    return ""


def connect(address: str = "", timeout: float = 60.0) -> str:
    """Connects this process to the Ray cluster at ``address`` (else ``$RAY_ADDRESS``, else a local one Ray
    starts), once; returns this node's IP address (where the controller listens for the actors).

    A cluster named by ``host:port`` must answer within ``timeout`` seconds
    (Ray itself retries for about 15 minutes) and have a node on this machine
    for the driver to join: the one registered at the address given if there
    is one (a cluster on loopback is reached on loopback, never through the
    host's interface address), else wherever Ray registered this machine's
    node. Any failure, Ray's own included, is a ``ClusterUnreachableError``
    whose one line names the key and the address.
    """
    from runtime.core.errors import ClusterUnreachableError

    target = address or os.environ.get("RAY_ADDRESS", "")
    where = _host_port(target)
    import ray

    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    options = {}
    if where is not None:
        problem, node = _survey(address, timeout)
        if problem:
            raise ClusterUnreachableError(problem)
        if _loopback(where[0]):
            # Ray turns a loopback address into the host's interface address (so that other machines could reach
            # it) unless this switch is off; a cluster bound to loopback is not listening there. Set here, not in
            # the environment, as Ray read that at its import.
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = False
        if node or _loopback(where[0]):
            options["_node_ip_address"] = node or where[0]
    try:
        ray.init(address=target or None, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING, **options)
    except Exception as e:   # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError... for this
        ray.shutdown()
        where_to = f"{_key(address)}={target}: Ray could not connect to the cluster there" if target else \
            "elastic_launcher=ray: Ray could not start a local cluster"
        raise ClusterUnreachableError(f"{where_to}: {type(e).__name__}: {_first_line(e)}") from e
    return ray.util.get_node_ip_address()


def _key(address: str) -> str:
    """The name of where a cluster address came from, for messages."""
    return "ray_address" if address else "$RAY_ADDRESS"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port`` (or ``ray://host:port``) cluster address; None for "", ``auto``,
    ``local`` (Ray finds or starts the cluster itself)."""
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _on_this_machine(ip: str) -> bool:
    """Whether ``ip`` is an address of this machine (a socket binds it; nothing is sent)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
    except (OSError, ValueError):
        return False
    return True


@dataclass(frozen=True)
class ClusterNode:
    """A live node of a Ray cluster, as its control store lists it: the address it registered (where its
    raylet and its actors listen) and its total resources (``{"CPU": 4.0, "GPU": 1.0, ...}``)."""

    address: str
    resources: Mapping[str, float]
    head: bool = False


@dataclass(frozen=True)
class ClusterRoom:
    """How many worker actors a cluster's live nodes hold at once (each takes 1 CPU, and its devices as GPUs
    on the GPU platform), and what they have in all."""

    actors: int
    cpus: float
    gpus: float
    nodes: int


def driver_node(host: str, nodes: Sequence[ClusterNode], on_this_machine: Callable[[str], bool]) -> str | None:
    """The address of the node this client's Ray driver joins (a driver joins a node of its own machine): the
    cluster's ``host`` itself when a node registered there and it is this machine's (a head on loopback), else
    the first of ``nodes`` (the head first) at an address of this machine (a head that Ray registered at the
    host's interface address although it was asked for loopback); None when no node is on this machine. Pure
    but for ``on_this_machine``."""
    addresses = [n.address for n in sorted(nodes, key=lambda n: not n.head)]
    if host in addresses and on_this_machine(host):
        return host
    return next((a for a in addresses if on_this_machine(a)), None)


def room_for_actors(nodes: Sequence[ClusterNode], gpus_per_actor: int = 0) -> ClusterRoom:
    """The :class:`ClusterRoom` of ``nodes`` for actors of 1 CPU and ``gpus_per_actor`` GPUs each (an actor
    does not span nodes: a node holds as many as its smallest share allows). Pure."""
    actors = 0
    for node in nodes:
        fits = int(node.resources.get("CPU", 0.0) + 1e-9)
        if gpus_per_actor:
            fits = min(fits, int(node.resources.get("GPU", 0.0) / gpus_per_actor + 1e-9))
        actors += fits
    return ClusterRoom(actors, sum(n.resources.get("CPU", 0.0) for n in nodes),
                       sum(n.resources.get("GPU", 0.0) for n in nodes), len(nodes))


def _hostport(where: tuple[str, int]) -> str:
    return f"{where[0]}:{where[1]}" if ":" not in where[0] else f"[{where[0]}]:{where[1]}"


def _cluster_nodes(where: tuple[str, int], timeout: float) -> tuple[ClusterNode, ...] | None:
    """The live nodes that the control store (GCS) at ``where`` lists; None when it does not answer that call
    (a cluster that asks for a token, a Ray too different)."""
    import grpc
    from ray.core.generated import gcs_pb2, gcs_service_pb2, gcs_service_pb2_grpc

    channel = grpc.insecure_channel(_hostport(where))
    try:
        reply = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetAllNodeInfo(
            gcs_service_pb2.GetAllNodeInfoRequest(), timeout=timeout)
    except grpc.RpcError as e:
        log.info("the Ray cluster at %s did not list its nodes: %s", _hostport(where), e)
        return None
    finally:
        channel.close()
    if reply.status.code:
        return None
    return tuple(ClusterNode(n.node_manager_address, dict(n.resources_total), n.is_head_node)
                 for n in reply.node_info_list if n.state == gcs_pb2.GcsNodeInfo.ALIVE)


def _survey(address: str, timeout: float) -> tuple[str, str | None]:
    """``(problem, node)``: why the cluster at ``address`` (else ``$RAY_ADDRESS``) cannot be used from here
    ("" when it can), and the address of the node on this machine that a driver joins (None: unknown, or Ray
    is to find or start the cluster itself)."""
    target = address or os.environ.get("RAY_ADDRESS", "")
    where = _host_port(target)
    if where is None:
        return "", None
    import grpc

    key = _key(address)
    channel = grpc.insecure_channel(_hostport(where))
    try:   # Ray's GCS (and its client server) speak gRPC: a listener that does not is no cluster either
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        return (f"{key}={target}: no Ray cluster answers there within {timeout:.0f} s (start one with "
                "`ray start --head`, or give the address it prints)"), None
    finally:
        channel.close()
    if target.startswith("ray://"):
        return "", None   # Ray Client: the driver runs in the cluster, on no node of this machine
    nodes = _cluster_nodes(where, timeout)
    if nodes is None:
        return "", None
    if not nodes:
        return f"{key}={target}: the Ray cluster there has no live node (is its head still starting?)", None
    node = driver_node(where[0], nodes, _on_this_machine)
    if node is None:
        listed = ", ".join(sorted({n.address for n in nodes})[:4])
        return (f"{key}={target}: the Ray cluster there has no node on this machine (its nodes: {listed}) and a "
                "Ray driver joins a node of its own machine: run the client on one of them, or give its Ray "
                "Client address (ray://HEAD:10001)"), None
    return "", node


def cluster_problem(address: str, timeout: float = 60.0) -> str:
    """Why the Ray cluster at ``address`` (else ``$RAY_ADDRESS``) cannot be used from here, in one line naming
    the key and the address: it does not answer within ``timeout`` seconds, or it has no node on this machine
    for the client's driver to join. "" when it can be, or when Ray is to find or start the cluster itself (no
    ``host:port``). Starts no Ray driver: the client checks this before anything starts."""
    return _survey(address, timeout)[0]


def cluster_room(address: str, timeout: float = 60.0, gpus_per_actor: int = 0) -> ClusterRoom | None:
    """The :class:`ClusterRoom` of the live nodes of the cluster at ``address`` (else ``$RAY_ADDRESS``); None
    when that is not known (no ``host:port``, a Ray Client address, a control store that does not list its
    nodes to an anonymous caller). Starts no Ray driver."""
    target = address or os.environ.get("RAY_ADDRESS", "")
    where = _host_port(target)
    if where is None or target.startswith("ray://"):
        return None
    nodes = _cluster_nodes(where, timeout)
    return None if nodes is None else room_for_actors(nodes, gpus_per_actor)


def unregistered_reason(not_started: Sequence[str], started: Sequence[str], needs: Mapping[str, float],
                        free: Mapping[str, float], total: Mapping[str, float]) -> str:
    """One line on worker actors that did not register: ``not_started`` (Ray created no actor for them yet),
    ``started`` (their actor runs, its worker did not register), given what one actor ``needs`` and what the
    cluster has ``free`` and in ``total``. Pure."""
    parts = []
    if not_started:
        short = [f"{free.get(r, 0.0):g} of {total.get(r, 0.0):g} {r}s free" for r, n in needs.items()
                 if free.get(r, 0.0) < n]
        each = " and ".join(f"{n:g} {r}" for r, n in needs.items())
        why = (f"no node has what each one needs free ({each}; the cluster has {', '.join(short)}): free some or "
               "add nodes; `ray status` lists them under its pending demands") if short else \
            "Ray has not placed or started them yet (`ray status` shows what it waits for)"
        parts.append(f"the actors of {', '.join(not_started)} did not start: {why}")
    if started:
        parts.append(f"the actors of {', '.join(started)} run but their workers did not register: see their "
                     "logs in Ray's session logs directory on their nodes (worker-*.err)")
    return "; ".join(parts) or "see the actors' logs in Ray's session logs directory on their nodes"


def actor_name(run_id: str, worker_id: str) -> str:
    """The name of the actor serving as ``worker_id`` in run ``run_id`` (in :data:`NAMESPACE`); a host of a slice
    of several is named by its host id (``w3/1``: :func:`runtime.core.hosts.host_id`)."""
    return f"jax-elastic-{run_id}-{worker_id}"


class _Handle:
    """A worker actor (one host) and the call that ends with its worker, polled like a process (``poll()``: None
    while it serves). ``name``: its host id; ``ref``: its ``serve`` call; for an actor an earlier client launched
    (``adopted``), its latest ``watch`` call, which answers None while the worker still serves (the watcher then
    asks again)."""

    def __init__(self, ray, name: str, actor, ref, adopted: bool = False):
        self.ray, self.name, self.actor, self.ref, self.adopted = ray, name, actor, ref, adopted

    @property
    def hosts(self) -> list[_Handle]:
        return [self]

    def poll(self) -> int | None:
        ref = self.ref
        ready, _ = self.ray.wait([ref], timeout=0)
        if not ready:
            return None
        try:
            status = self.ray.get(ref)
        except Exception:  # noqa: BLE001 - the actor died (killed, its node gone): a crash
            return -9
        return None if status is None else int(status)


class _Slice:
    """The actors of one slice of several hosts (in host order) and their placement group, as one: it has ended
    once any of them did (the slice cannot run without it). ``group``: the placement group, or for an adopted
    slice the calls that ask its actors for it (:meth:`_WorkerActor.group`)."""

    def __init__(self, ray, hosts: list[_Handle], group):
        self.ray, self.hosts, self._group = ray, hosts, group

    def poll(self) -> int | None:
        return next((code for code in (h.poll() for h in self.hosts) if code is not None), None)

    def group(self):
        """The slice's placement group; None when no actor of an adopted slice says which it is within 2 s."""
        if not isinstance(self._group, list):
            return self._group
        from ray.util.placement_group import PlacementGroup

        ready, _ = self.ray.wait(self._group, num_returns=1, timeout=2.0)
        for ref in ready:
            try:
                self._group = PlacementGroup(self.ray.PlacementGroupID(bytes.fromhex(self.ray.get(ref))))
                return self._group
            except Exception:  # noqa: BLE001 - that actor is gone: its sibling may say
                continue
        return None


def _serve(controller: str, run_id: str, worker_id: str, secret: str, chaos: bool,
           tls: tuple[str, str, str] | None, cache_dir: str, slice_host: int = 0, slice_hosts: int = 1,
           coordinator: str = "") -> int:
    """The body of a worker actor's ``serve`` call: one worker (host ``slice_host`` of ``slice_hosts``, joined to
    its slice at ``coordinator`` first), bound to this node's IP address."""
    import ray

    from runtime.core import compile_cache
    from runtime.core.platforms import join_slice
    from runtime.wire import auth
    from runtime.worker.worker_process import REGISTER_SECONDS, serve

    name = host_id(worker_id, slice_host, slice_hosts)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    compile_cache.enable(cache_dir)
    if slice_hosts > 1:   # before JAX starts a backend in this actor's process
        join_slice(coordinator, slice_hosts, slice_host, REGISTER_SECONDS)
    # The worker's host, where its in-memory snapshots live, is its Ray node.
    return serve(controller, run_id, worker_id, host=ray.util.get_node_ip_address(), secret=secret, chaos=chaos,
                 tls=auth.TlsFiles(*tls) if tls else None, host_name=ray.get_runtime_context().get_node_id(),
                 slice_host=slice_host, slice_hosts=slice_hosts)


class RayLauncher:
    """Starts each worker as a Ray actor, a slice of several hosts as one actor per host (see the module
    docstring); the interface of ``LocalLauncher``.

    ``on_lost(worker_id, reason)``: called from the watcher thread when Ray
    reports a worker's actor dead or its call ended with a failure status (a
    host of a slice of several: its host id, whose slice is then lost).
    """

    external = False   # it starts (and relaunches) the workers itself
    host = ""          # set on connecting: the Ray node this client runs on

    def __init__(self, run_id: str, controller_address: str, devices_per_worker: int, *, address: str = "",
                 secret: str = "", chaos: bool = False, tls=None, compilation_cache_dir: str = "",
                 platform: str = "", on_lost=None, hosts_per_slice: int = 1):
        import ray

        from runtime.core.child_env import jax_child_env

        self.ray = ray
        connect(address)
        self.host = ray.get_runtime_context().get_node_id()   # a worker's ``host`` names its node the same way
        self.run_id, self.controller_address = run_id, controller_address
        self.devices, self.platform = devices_per_worker, platform   # an actor's (a host's, in a slice of several)
        self.hosts_per_slice = hosts_per_slice
        self.secret, self.chaos, self.tls = secret, chaos, tls
        self.cache_dir = compilation_cache_dir
        env = jax_child_env(devices_per_worker, platform)
        env["ELASTIC_CHAOS"] = "1" if chaos else "0"
        env["ELASTIC_COMPILATION_CACHE_DIR"] = compilation_cache_dir
        self._env = {k: env[k] for k in _ENV if k in env}
        self.on_lost = on_lost or (lambda worker_id, reason: None)
        self.procs: dict[str, _Handle | _Slice] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._actor = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=_CONCURRENCY)(_WorkerActor)
        self._watcher = threading.Thread(target=self._watch, name="ray-watcher", daemon=True)
        self._watcher.start()

    def launch(self, worker_id: str, host_name: str = "", devices: int = 0) -> _Handle | _Slice:
        """Asks Ray for an actor serving as ``worker_id`` (detached, named: see the module docstring).
        ``host_name``: a Ray node id (the host a dead predecessor registered) is asked for first (soft
        affinity: elsewhere when that node is gone).

        A slice of several hosts is ``hosts_per_slice`` actors in one placement group of their own (detached like
        them; :data:`SLICE_STRATEGY`): Ray starts them together or not at all. Host 0's actor chooses its slice's
        JAX coordinator (its node's IP address and a port free there, :meth:`_WorkerActor.coordinator`); every
        host's ``serve`` call takes that address as an argument, so Ray hands it once host 0 chose it and this
        call never waits. A relaunched slice goes wherever its group fits (no affinity)."""
        tls = (self.tls.cert_file, self.tls.key_file, self.tls.ca_file) if self.tls is not None else None
        args = (self.controller_address, self.run_id, worker_id, self.secret, self.chaos, tls, self.cache_dir)
        hosts = self.hosts_per_slice
        if hosts == 1:
            strategy = None
            if re.fullmatch(r"[0-9a-f]{56}", host_name):
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                strategy = NodeAffinitySchedulingStrategy(node_id=host_name, soft=True)
            actor = self._new_actor(worker_id, strategy)
            handle = _Handle(self.ray, worker_id, actor, actor.serve.remote(*args))
        else:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            group = placement_group([self._needs()] * hosts, strategy=SLICE_STRATEGY, lifetime="detached")
            actors = [self._new_actor(host_id(worker_id, k, hosts), PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=k), (self.run_id, worker_id, k, hosts)) for k in range(hosts)]
            coordinator = actors[0].coordinator.remote()
            handle = _Slice(self.ray, [_Handle(self.ray, host_id(worker_id, k, hosts), a,
                                               a.serve.remote(*args, k, hosts, coordinator))
                                       for k, a in enumerate(actors)], group)
        with self._lock:
            self.procs[worker_id] = handle
        return handle

    def _new_actor(self, name: str, strategy, in_slice: tuple | None = None):
        """A detached actor named for host ``name`` of this run, placed by ``strategy`` (None: where Ray likes);
        ``in_slice``: ``(run id, slice id, host, hosts)`` of a host of a slice of several."""
        needs = self._needs()
        options = {"num_cpus": needs["CPU"], "runtime_env": {"env_vars": self._env}, "lifetime": "detached",
                   "name": actor_name(self.run_id, name), "namespace": NAMESPACE}
        if "GPU" in needs:
            options["num_gpus"] = needs["GPU"]
        if strategy is not None:
            options["scheduling_strategy"] = strategy
        return self._actor.options(**options).remote(CLAIM_SECONDS, in_slice)

    def prepare_standby(self) -> None:
        """Ray keeps its own pool of worker processes; no standby here."""

    def queued(self) -> str:
        """Actors wait for Ray's resources within the registration timeout (the cluster was checked first)."""
        return ""

    def explain_unregistered(self, workers: Sequence[str]) -> str:
        """Why the actors of ``workers`` (launched, not registered when the worker group gave up waiting) have no
        worker serving, as far as Ray tells: those Ray has not started (no node with the CPU or GPUs free that
        each one needs), those it started whose worker did not register. Called by the worker group."""
        ray = self.ray
        hosts = [h for w in workers if w in self.procs for h in self.procs[w].hosts]
        probes = {h.actor.__ray_ready__.remote(): h.name for h in hosts}   # answers once it was created
        ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=2.0) if probes else ([], [])
        started = sorted(probes[r] for r in ready)
        return unregistered_reason(sorted({h.name for h in hosts} - set(started)), started, self._needs(),
                                   ray.available_resources(), ray.cluster_resources())

    def _needs(self) -> dict[str, float]:
        """The resources of one worker actor."""
        return {"CPU": 1.0, **({"GPU": float(self.devices)} if self.platform == "gpu" else {})}

    def adopt(self, worker_id: str, pid: int | list[int]) -> None:
        """A worker an earlier client of the run launched, attached by this one: its actor (each host's, for a
        slice of several: ``pid`` lists its hosts' pids), found by name, is killed and stopped like this
        launcher's own, and watched through its ``watch`` call (the ``serve`` call's result would go to the dead
        driver). The pids are not needed otherwise: the names are the run's and the hosts'. A slice's placement
        group is the one its actors say they run in. An actor not found (gone since it answered) is left to the
        health monitor."""
        if worker_id in self.procs:
            return
        hosts = len(pid) if isinstance(pid, list) else 1
        handles = []
        for k in range(hosts):
            name = host_id(worker_id, k, hosts)
            try:
                actor = self.ray.get_actor(actor_name(self.run_id, name), namespace=NAMESPACE)
            except ValueError as e:
                log.warning("worker %s has no actor of run %s in the Ray cluster: %s", name, self.run_id,
                            str(e).splitlines()[0][:200])
                return
            handles.append(_Handle(self.ray, name, actor, actor.watch.remote(WATCH_SECONDS), adopted=True))
        handle = handles[0] if hosts == 1 else _Slice(self.ray, handles, [h.actor.group.remote() for h in handles])
        with self._lock:
            self.procs[worker_id] = handle

    def kill(self, worker_id: str) -> None:
        """Kills a worker declared dead (its actor, a hung one too; a slice's every actor, and its group)."""
        handle = self.procs.get(worker_id)
        if handle is not None:
            self._end(handle)

    def stop_all(self, timeout: float = 10.0) -> None:
        """Kills every actor left (live workers were told to shut down first) and removes the slices' placement
        groups, stops the watcher."""
        self._stop.set()
        for handle in list(self.procs.values()):
            self._end(handle)
        self._watcher.join(timeout)

    def _end(self, handle: _Handle | _Slice) -> None:
        group = handle.group() if isinstance(handle, _Slice) else None   # asked before its actors go
        for host in handle.hosts:
            try:
                self.ray.kill(host.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if group is not None:
            _remove_group(group)

    def _watch(self) -> None:
        """Reports each actor whose ``serve`` (or, adopted, ``watch``) call ended badly: Ray's failure signal
        for that worker (for that host, in a slice of several)."""
        ray = self.ray
        reported: set[str] = set()
        while not self._stop.is_set():
            with self._lock:
                refs = {h.ref: h for w in self.procs for h in self.procs[w].hosts if h.name not in reported}
            if not refs:
                self._stop.wait(0.2)
                continue
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=0.5)
            for ref in ready:
                handle = refs[ref]
                try:
                    status = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - actor died, node removed, ...
                    reported.add(handle.name)
                    if not self._stop.is_set():
                        self.on_lost(handle.name, f"ray: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    continue
                if status is None and handle.adopted:   # it still serves: watch on
                    handle.ref = handle.actor.watch.remote(WATCH_SECONDS)
                    continue
                reported.add(handle.name)
                if status not in (0, None) and not self._stop.is_set():
                    self.on_lost(handle.name, f"ray: its worker exited with status {status}")


def _remove_group(group) -> None:
    """Removes a slice's placement group (its actors with it); one already removed is no error."""
    from ray.util import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception as e:  # noqa: BLE001 - gone already, or Ray is shutting down
        log.info("placement group %s not removed: %s", group.id.hex(), _first_line(e))


class _WorkerActor:
    """A jax-elastic worker inside a Ray actor (decorated with ``ray.remote`` by :class:`RayLauncher`): one
    ``serve`` call for its life, then the actor ends itself; ``watch`` calls meanwhile from the clients that
    adopted it. ``in_slice``: ``(run id, slice id, host, hosts)`` of a host of a slice of several, whose placement
    group the last of its actors to end removes (:meth:`leave`)."""

    def __init__(self, claim_seconds: float = CLAIM_SECONDS, in_slice: tuple | None = None):
        self._started, self._done = threading.Event(), threading.Event()
        self._status: int | None = None
        self._slice = in_slice
        threading.Thread(target=self._unclaimed, args=(claim_seconds,), name="unclaimed", daemon=True).start()

    def serve(self, *args) -> int:
        """Serves the worker; returns its exit status (to the client that launched it, if it still lives).
        Then the actor leaves: detached, nothing else would end it once its client is gone."""
        self._started.set()
        try:
            self._status = _serve(*args)
            return self._status
        except BaseException:
            self._status = 1   # EXIT_FAILED; the error goes to the caller
            raise
        finally:
            self._done.set()
            self._leave()

    def watch(self, timeout: float) -> int | None:
        """Waits up to ``timeout`` seconds for ``serve`` to end: its status, or None while the worker serves."""
        self._done.wait(timeout)
        return self._status

    def coordinator(self) -> str:
        """``HOST:PORT`` of its slice's JAX coordinator, which this actor (host 0) serves: its node's IP address
        (where the slice's other hosts, on any node, reach it) and a port free there now."""
        import ray

        from runtime.wire.rpc import free_port

        ip = ray.util.get_node_ip_address()
        return f"{ip}:{free_port(ip)}" if ":" not in ip else f"[{ip}]:{free_port(ip)}"

    def group(self) -> str:
        """The id (hex) of the placement group this actor runs in (a slice's: what a client that adopted it
        removes with it)."""
        import ray

        return ray.util.get_current_placement_group().id.hex()

    def leave(self) -> None:
        """Ends this actor once its calls running now (``serve``, ``watch``) returned their answers; a slice's
        placement group (detached: it would hold its CPUs and GPUs for ever) goes with the last of its actors."""
        import ray

        if self._slice is not None:
            _release_group(*self._slice)
        ray.actor.exit_actor()

    def _unclaimed(self, seconds: float) -> None:
        if not self._started.wait(seconds):
            log.warning("no serve call within %.0f s of starting (its client died first?): this actor ends", seconds)
            self._leave()

    @staticmethod
    def _leave() -> None:
        import ray

        try:   # a call of its own: exit_actor in ``serve`` would drop the status it returns
            ray.get_runtime_context().current_actor.leave.remote()
        except Exception:  # noqa: BLE001 - the actor is going anyway (killed, or Ray is shutting down)
            log.exception("the worker actor could not end itself")


def _release_group(run_id: str, slice_id: str, host: int, hosts: int) -> None:
    """Called by host ``host``'s actor of a slice of several as it ends: removes the slice's placement group when
    no actor of a lower host is alive (that one does it), once the others ended (or after
    :data:`RELEASE_SECONDS`, under them). The client removes the groups of the slices it stops or loses; this is
    for actors that end with no client (its grace over)."""
    import ray

    group = ray.util.get_current_placement_group()
    if group is None:
        return
    deadline = time.monotonic() + RELEASE_SECONDS
    while True:
        alive = [k for k in range(hosts) if k != host and _alive(ray, actor_name(run_id, host_id(slice_id, k, hosts)))]
        if any(k < host for k in alive):
            return
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    _remove_group(group)


def _alive(ray, name: str) -> bool:
    """Whether the actor named ``name`` lives (a dead actor's name is free again)."""
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True
