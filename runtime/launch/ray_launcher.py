"""Workers as Ray actors on an existing Ray cluster (``elastic_launcher=ray``).

Ray places, starts and stops the processes; everything else is the runtime's
usual protocol. Each worker is one actor (``max_restarts=0``: a dead worker
is replaced by a new actor, with a new worker id, that joins as a spare),
which serves the same gRPC worker as a local subprocess
(:func:`runtime.worker.worker_process.serve`), bound to its node's IP address. Its
JAX environment (device count, platform) is the actor's ``runtime_env``, so
it is set before the actor imports JAX; its resources are one CPU, plus
its devices as GPUs when the platform is ``gpu``.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["NAMESPACE", "ClusterNode", "ClusterRoom", "RayLauncher", "actor_name", "cluster_problem", "cluster_room",
           "connect", "driver_node", "ray_available", "room_for_actors", "unregistered_reason"]

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
    """The name of the actor serving as ``worker_id`` in run ``run_id`` (in :data:`NAMESPACE`)."""
    return f"jax-elastic-{run_id}-{worker_id}"


class _Handle:
    """A worker actor and the call that ends with its worker, polled like a process (``poll()``: None while
    it serves). ``ref``: its ``serve`` call; for an actor an earlier client launched (``adopted``), its latest
    ``watch`` call, which answers None while the worker still serves (the watcher then asks again)."""

    def __init__(self, ray, actor, ref, adopted: bool = False):
        self.ray, self.actor, self.ref, self.adopted = ray, actor, ref, adopted

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


def _serve(controller: str, run_id: str, worker_id: str, secret: str, chaos: bool,
           tls: tuple[str, str, str] | None, cache_dir: str) -> int:
    """The body of a worker actor's ``serve`` call: one worker, bound to this node's IP address."""
    import ray

    from runtime.core import compile_cache
    from runtime.wire import auth
    from runtime.worker.worker_process import serve

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {worker_id} %(levelname)s %(message)s")
    compile_cache.enable(cache_dir)
    # The worker's host, where its in-memory snapshots live, is its Ray node.
    return serve(controller, run_id, worker_id, host=ray.util.get_node_ip_address(), secret=secret, chaos=chaos,
                 tls=auth.TlsFiles(*tls) if tls else None, host_name=ray.get_runtime_context().get_node_id())


class RayLauncher:
    """Starts each worker as a Ray actor (see the module docstring); the interface of ``LocalLauncher``.

    ``on_lost(worker_id, reason)``: called from the watcher thread when Ray
    reports a worker's actor dead or its call ended with a failure status.
    """

    external = False   # it starts (and relaunches) the workers itself
    host = ""          # set on connecting: the Ray node this client runs on

    def __init__(self, run_id: str, controller_address: str, devices_per_worker: int, *, address: str = "",
                 secret: str = "", chaos: bool = False, tls=None, compilation_cache_dir: str = "",
                 platform: str = "", on_lost=None):
        import ray

        from runtime.core.child_env import jax_child_env

        self.ray = ray
        connect(address)
        self.host = ray.get_runtime_context().get_node_id()   # a worker's ``host`` names its node the same way
        self.run_id, self.controller_address = run_id, controller_address
        self.devices, self.platform = devices_per_worker, platform
        self.secret, self.chaos, self.tls = secret, chaos, tls
        self.cache_dir = compilation_cache_dir
        env = jax_child_env(devices_per_worker, platform)
        env["ELASTIC_CHAOS"] = "1" if chaos else "0"
        env["ELASTIC_COMPILATION_CACHE_DIR"] = compilation_cache_dir
        self._env = {k: env[k] for k in _ENV if k in env}
        self.on_lost = on_lost or (lambda worker_id, reason: None)
        self.procs: dict[str, _Handle] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._actor = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=_CONCURRENCY)(_WorkerActor)
        self._watcher = threading.Thread(target=self._watch, name="ray-watcher", daemon=True)
        self._watcher.start()

    def launch(self, worker_id: str, host_name: str = "") -> _Handle:
        """Asks Ray for an actor serving as ``worker_id`` (detached, named: see the module docstring).
        ``host_name``: a Ray node id (the host a dead predecessor registered) is asked for first (soft
        affinity: elsewhere when that node is gone)."""
        ray = self.ray
        needs = self._needs()
        options = {"num_cpus": needs["CPU"], "runtime_env": {"env_vars": self._env}, "lifetime": "detached",
                   "name": actor_name(self.run_id, worker_id), "namespace": NAMESPACE}
        if "GPU" in needs:
            options["num_gpus"] = needs["GPU"]
        if re.fullmatch(r"[0-9a-f]{56}", host_name):
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=host_name, soft=True)
        actor = self._actor.options(**options).remote()
        tls = (self.tls.cert_file, self.tls.key_file, self.tls.ca_file) if self.tls is not None else None
        ref = actor.serve.remote(self.controller_address, self.run_id, worker_id, self.secret, self.chaos, tls,
                                 self.cache_dir)
        handle = _Handle(ray, actor, ref)
        with self._lock:
            self.procs[worker_id] = handle
        return handle

    def prepare_standby(self) -> None:
        """Ray keeps its own pool of worker processes; no standby here."""

    def explain_unregistered(self, workers: Sequence[str]) -> str:
        """Why the actors of ``workers`` (launched, not registered when the worker group gave up waiting) have no
        worker serving, as far as Ray tells: those Ray has not started (no node with the CPU or GPUs free that
        each one needs), those it started whose worker did not register. Called by the worker group."""
        ray = self.ray
        handles = {w: self.procs[w] for w in workers if w in self.procs}
        probes = {h.actor.__ray_ready__.remote(): w for w, h in handles.items()}   # answers once it was created
        ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=2.0) if probes else ([], [])
        started = sorted(probes[r] for r in ready)
        return unregistered_reason(sorted(set(handles) - set(started)), started, self._needs(),
                                   ray.available_resources(), ray.cluster_resources())

    def _needs(self) -> dict[str, float]:
        """The resources of one worker actor."""
        return {"CPU": 1.0, **({"GPU": float(self.devices)} if self.platform == "gpu" else {})}

    def adopt(self, worker_id: str, pid: int) -> None:
        """A worker an earlier client of the run launched, attached by this one: its actor, found by name, is
        killed and stopped like this launcher's own, and watched through its ``watch`` call (the ``serve``
        call's result would go to the dead driver). ``pid`` is not needed: the name is the run's and the
        worker's. An actor not found (gone since it answered) is left to the health monitor."""
        if worker_id in self.procs:
            return
        try:
            actor = self.ray.get_actor(actor_name(self.run_id, worker_id), namespace=NAMESPACE)
        except ValueError as e:
            log.warning("worker %s (process %d) has no actor of run %s in the Ray cluster: %s", worker_id, pid,
                        self.run_id, str(e).splitlines()[0][:200])
            return
        handle = _Handle(self.ray, actor, actor.watch.remote(WATCH_SECONDS), adopted=True)
        with self._lock:
            self.procs[worker_id] = handle

    def kill(self, worker_id: str) -> None:
        """Kills a worker declared dead (its actor; a hung one too)."""
        handle = self.procs.get(worker_id)
        if handle is not None:
            self.ray.kill(handle.actor, no_restart=True)

    def stop_all(self, timeout: float = 10.0) -> None:
        """Kills every actor left (live workers were told to shut down first), stops the watcher."""
        self._stop.set()
        for handle in list(self.procs.values()):
            try:
                self.ray.kill(handle.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._watcher.join(timeout)

    def _watch(self) -> None:
        """Reports each actor whose ``serve`` (or, adopted, ``watch``) call ended badly: Ray's failure signal
        for that worker."""
        ray = self.ray
        reported: set[str] = set()
        while not self._stop.is_set():
            with self._lock:
                refs = {h.ref: (w, h) for w, h in self.procs.items() if w not in reported}
            if not refs:
                self._stop.wait(0.2)
                continue
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=0.5)
            for ref in ready:
                worker, handle = refs[ref]
                try:
                    status = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - actor died, node removed, ...
                    reported.add(worker)
                    if not self._stop.is_set():
                        self.on_lost(worker, f"ray: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    continue
                if status is None and handle.adopted:   # it still serves: watch on
                    handle.ref = handle.actor.watch.remote(WATCH_SECONDS)
                    continue
                reported.add(worker)
                if status not in (0, None) and not self._stop.is_set():
                    self.on_lost(worker, f"ray: its worker exited with status {status}")


class _WorkerActor:
    """A jax-elastic worker inside a Ray actor (decorated with ``ray.remote`` by :class:`RayLauncher`): one
    ``serve`` call for its life, then the actor ends itself; ``watch`` calls meanwhile from the clients that
    adopted it."""

    def __init__(self, claim_seconds: float = CLAIM_SECONDS):
        self._started, self._done = threading.Event(), threading.Event()
        self._status: int | None = None
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

    def leave(self) -> None:
        """Ends this actor once its calls running now (``serve``, ``watch``) returned their answers."""
        import ray

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
