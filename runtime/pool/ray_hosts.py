"""A pool's hosts as Ray actors (``elastic pool serve DIR --ray-hosts N``): one detached actor per host, each an
:class:`runtime.pool.agent.Agent` polling the pool from its Ray node.

Contract: :func:`start_ray_hosts` connects the pool process to the Ray cluster
(:func:`runtime.launch.ray_launcher.connect`) and makes sure actors
``jax-elastic-pool-<pool>-<k>`` (``k`` = 0..N-1, in the ``jax-elastic``
namespace) run: those alive already (a restarted pool) are left alone, the
others are created. Each actor is detached (it outlives the pool process, which
is its own failure domain), takes one CPU (and its devices as GPUs on the GPU
platform), gets the pool secret and the JAX environment of its devices as its
``runtime_env``, and runs the agent until the pool closes; then it ends itself.
Its workers are forked on its node, listening on the node's IP address, and
its lease directories live in the node's temporary directory. Ray is imported
only here, and only when asked for.
"""

from __future__ import annotations

import logging
import os
import tempfile

__all__ = ["host_actor_name", "start_ray_hosts"]

log = logging.getLogger("jax_elastic.pool.ray")


def host_actor_name(pool: str, k: int) -> str:
    """The name of host ``k``'s actor of pool ``pool`` (its directory's name)."""
    return f"jax-elastic-pool-{pool}-{k}"


class _HostActor:
    """One pool host in a Ray actor (decorated with ``ray.remote`` by :func:`start_ray_hosts`)."""

    def run(self, pool: str, host_id: str, devices: int, platform: str) -> int:
        import ray

        from runtime.pool.agent import SECRET_ENV, Agent

        ip = ray.util.get_node_ip_address()
        directory = os.path.join(tempfile.gettempdir(), "jax-elastic-pool", host_id)
        agent = Agent(pool, os.environ[SECRET_ENV], host_id, devices, directory, platform, address=ip,
                      listen=ip)
        try:
            return agent.run()
        finally:
            ray.get_runtime_context().current_actor.leave.remote()

    def leave(self) -> None:
        import ray

        ray.actor.exit_actor()


def start_ray_hosts(ray_address: str, pool_address: str, secret: str, pool_name: str, count: int, devices: int,
                    platform: str) -> list[str]:
    """Hosts ``0..count-1`` of the pool as Ray actors (see the module's contract); answers their host ids."""
    import ray

    from runtime.core.child_env import jax_child_env
    from runtime.launch.ray_launcher import NAMESPACE, connect
    from runtime.pool.agent import SECRET_ENV

    connect(ray_address)
    env = jax_child_env(devices, platform)
    env_vars = {k: v for k, v in env.items() if k.startswith(("JAX_", "XLA_", "ELASTIC_"))}
    env_vars[SECRET_ENV] = secret
    actor = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=2)(_HostActor)
    hosts = []
    for k in range(count):
        name, host_id = host_actor_name(pool_name, k), f"{pool_name}-ray-{k}"
        hosts.append(host_id)
        try:
            ray.get_actor(name, namespace=NAMESPACE)
            log.info("host %s: Ray actor %s is running already", host_id, name)
            continue   # alive: a restarted pool finds its hosts serving
        except ValueError:
            pass
        options = {"num_cpus": 1, "runtime_env": {"env_vars": env_vars}, "lifetime": "detached", "name": name,
                   "namespace": NAMESPACE}
        if platform in ("gpu", "cuda", "rocm"):
            options["num_gpus"] = devices
        actor.options(**options).remote().run.remote(pool_address, host_id, devices, platform)
        log.info("started host %s as Ray actor %s", host_id, name)
    return hosts

