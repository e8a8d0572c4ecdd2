"""Which JAX platform a program is for, and whether this process can run it.

Platform names are ``jax.export``'s: ``cpu``, ``cuda``, ``rocm``, ``tpu``
(JAX names a CUDA device's platform ``gpu``; :func:`canonical_platform` maps
it). The config key ``hardware`` (MaxText's names: ``cpu``, ``gpu``,
``tpu``) is mapped to these names by ``elastic``; the runtime sees only them.

Contract:

* :func:`check_runnable` is pure: a process whose JAX runs on ``local``
  refuses programs exported for other platforms with
  :class:`PlatformMismatchError`, naming both and the ``hardware`` key.
  The worker calls it when it loads programs (``runtime.wire.requests``), before
  anything compiles; :class:`runtime.worker.executor.SliceExecutor` calls it too,
  so the reference run refuses them the same way.
* :func:`default_worker_platform` is pure: the platform the local launcher's
  workers get when it is given none (the first of ``JAX_PLATFORMS`` as this
  process has it, else ``cpu``; ``""`` when JAX is to choose).
* :func:`local_platform` and :func:`program_platforms` import JAX (lazily:
  importing this module does not start it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from runtime.core.errors import PlatformMismatchError

__all__ = ["EXPORT_PLATFORMS", "PlatformMismatchError", "canonical_platform", "check_runnable",
           "default_worker_platform", "join_slice", "local_platform", "program_platforms"]

#: The platforms programs can be exported for (``jax.export``'s names).
EXPORT_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

# What the config key `hardware` says for each platform (for messages that tell the user what to set).
_HARDWARE_OF = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def canonical_platform(name: str) -> str:
    """``jax.export``'s name of a JAX platform name or alias (``gpu`` is ``cuda``); ``ValueError`` if unknown."""
    p = name.strip().lower()
    p = "cuda" if p == "gpu" else p
    if p not in EXPORT_PLATFORMS:
        raise ValueError(f"unknown JAX platform {name!r}; known: {', '.join(EXPORT_PLATFORMS)} (or gpu for cuda)")
    return p


def default_worker_platform(environ: Mapping[str, str]) -> str:
    """The platform of a worker started from a process with environment ``environ``, when none is asked for.

    The local launcher passes ``JAX_PLATFORMS`` on: its first entry; ``cpu``
    when it is unset (what the launcher then sets); ``""`` when it is set but
    empty (JAX chooses when the worker starts: the accelerator of a host that
    has one, else the CPU). An entry that names no platform programs can be
    exported for (``JAX_PLATFORMS=foo``) is ``ValueError``.
    """
    if "JAX_PLATFORMS" not in environ:
        return "cpu"
    first = environ["JAX_PLATFORMS"].split(",")[0].strip()
    return canonical_platform(first) if first else ""


def check_runnable(program_platforms: Sequence[str], local: str, what: str = "the programs") -> None:
    """Refuses (:class:`PlatformMismatchError`) programs this process cannot run: ``local`` not among theirs.

    ``program_platforms``: what ``jax.export`` recorded (``Exported.platforms``);
    ``local``: this process's platform (:func:`local_platform`); ``what``
    names the programs in the message.
    """
    if local in program_platforms:
        return
    theirs = ", ".join(program_platforms) or "no platform"
    hardware = " or ".join(sorted({_HARDWARE_OF.get(p, p) for p in program_platforms}))
    fix = f"to {_HARDWARE_OF[local]}" if local in _HARDWARE_OF else "to the workers' platform"
    raise PlatformMismatchError(
        f"{what}: exported for {theirs} (config key hardware: {hardware or '?'}), but this worker's JAX runs "
        f"on {local}. Set the config key 'hardware' {fix}, or run the workers where JAX finds a {theirs} device "
        f"(a worker's log lists the devices its JAX found)")


def local_platform(devices=None) -> str:
    """The ``jax.export`` platform of ``devices`` (default: JAX's default backend in this process). Imports JAX."""
    import jax

    if devices is None:
        return jax.export.default_export_platform()
    device = list(devices)[0]
    name = (getattr(getattr(device, "client", None), "platform", "") or device.platform).lower()
    return "cuda" if name == "gpu" else name   # another platform (metal, neuron...) keeps its name: it runs nothing here


def program_platforms(blob: bytes) -> tuple[str, ...]:
    """The platforms one serialized ``jax.export`` program is for. Imports JAX."""
    import jax

    return tuple(jax.export.deserialize(bytearray(blob)).platforms)


def join_slice(coordinator: str, hosts: int, host: int, timeout: float) -> None:
    """Joins this process, host ``host`` of ``hosts``, to its slice's JAX distributed system (coordinator
    ``HOST:PORT`` on the slice's host 0), before JAX starts a backend: the slice's programs then run over every
    host's devices (:mod:`runtime.core.hosts`; a worker, or a reference run's process). Collectives across
    hosts on the CPU go over gloo (NCCL and ICI are the accelerators' own). ``ElasticError`` in one line when
    the slice does not form within ``timeout``."""
    import jax

    from runtime.core.errors import ElasticError

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator, num_processes=hosts, process_id=host,
                                   initialization_timeout=max(1, int(timeout)),
                                   coordinator_bind_address=_bind_address(coordinator))
    except Exception as e:  # noqa: BLE001 - JAX raises several kinds; one line says what failed
        raise ElasticError(f"host {host} of {hosts} could not join its slice at {coordinator} within "
                           f"{timeout:g} s: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def _bind_address(coordinator: str) -> str | None:
    """Where host 0 serves its slice's coordinator: the coordinator's own address when it is an IP address (a
    loopback one stays on loopback), else every interface (JAX's default: a name such as a Kubernetes pod's
    resolves to the host's own address)."""
    import ipaddress

    host, _, port = coordinator.rpartition(":")
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return f"{host}:{port}"
