"""The environment of a JAX child process of the client: a worker, a standby, the zygote, the reference run.

One function, :func:`jax_child_env`, used by every launcher (local, Ray) and
by the reference's child process: the device count, the platform, the
allocator and thread settings, and the import path a child needs.
"""

from __future__ import annotations

import os
import sys

from runtime.core.platforms import canonical_platform, default_worker_platform

__all__ = ["jax_child_env"]


def jax_child_env(devices: int, platform: str = "") -> dict[str, str]:
    """The environment of a JAX child process of this one (a worker, the reference run) with ``devices`` devices.

    ``platform`` (``jax.export``'s name, see :mod:`runtime.core.platforms`) is the
    platform the child is to run programs on:

    * ``cpu``: ``JAX_PLATFORMS=cpu``.
    * ``cuda``, ``rocm``, ``tpu``: ``JAX_PLATFORMS`` unset, so JAX takes the
      best platform it finds: the accelerator on a host that has one. A host
      without one gives a CPU worker, which refuses the programs by name when
      it loads them (``runtime.core.platforms.check_runnable``) rather than failing
      to start with JAX's own error in its log.
    * ``""``: ``JAX_PLATFORMS`` as this process has it (an empty value: JAX's
      own choice, as for an accelerator), else ``cpu``; see
      ``runtime.core.platforms.default_worker_platform``.

    Always ``devices`` simulated host devices (``XLA_FLAGS``): the CPU
    platform's devices; on an accelerator a slice's devices are real ones and
    the flag changes nothing. Unless the platform is the CPU, several processes
    may share one GPU, so each allocates memory as it needs it
    (``XLA_PYTHON_CLIENT_PREALLOCATE=false``) instead of taking 75% of it at
    start, unless this process set one of JAX's allocator variables itself.
    Always one OpenMP thread (so the XLA/Eigen pools of several processes do
    not oversubscribe a small host), and this process's import path, so data
    sources pickled by reference (classes of the user's modules) load there.
    """
    env = dict(os.environ)
    if platform:
        canonical_platform(platform)   # ValueError for a name programs cannot be exported for
        env.pop("JAX_PLATFORMS", None)
        if platform == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
    else:
        env.setdefault("JAX_PLATFORMS", "cpu")
        platform = default_worker_platform(env)   # "" when JAX chooses
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    if platform != "cpu" and not any(k in env for k in _ALLOCATOR_VARIABLES):
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env.setdefault("OMP_NUM_THREADS", "1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [root] + [p for p in sys.path if p and os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


# JAX's GPU memory settings: a user who set one chose how the processes share the device.
_ALLOCATOR_VARIABLES = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")
