"""jax-elastic runtime: controller, workers, scheduling and recovery.

Imports none of ``elastic``, ``integrations`` or ``chaos``; those packages use
the runtime only through the names exported here.
"""

from runtime.auth import TlsFiles
from runtime.controller import Controller, ControllerObserver, ControllerOptions, RunResult, peak_rss_bytes
from runtime.errors import (
    ElasticError,
    ElasticTrainingFailedError,
    PlatformMismatchError,
    ProgramExportError,
    ProtocolError,
    RegistrationTimeoutError,
    StaleEpochError,
    StepAbortedError,
    WorkerError,
    WorkerLostError,
)
from runtime.checkpoint import directory_problem as checkpoint_directory_problem
from runtime.events import EventLog, read_events
from runtime.collective import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MAX_STEPS_AHEAD, MIN_CHUNK_BYTES
from runtime.fault_injection import ACTIONS as FAULT_ACTIONS, PHASES as FAULT_PHASES
from runtime.microbatch import Node, assign_microbatches, tree_reduce, tree_sum
from runtime.platforms import default_worker_platform, local_platform, program_platforms
from runtime.programs import MESH_AXIS, ProgramSet
from runtime.snapshot import default_root as default_snapshot_root
from runtime.ray_launcher import ray_available


def run_reference(*args, **kwargs):
    """The same math in one process (ground truth); see :func:`runtime.reference.run_reference`. Imports JAX."""
    from runtime.reference import run_reference as run

    return run(*args, **kwargs)


def run_reference_process(*args, **kwargs):
    """The same math in a child process with the slice's CPU devices; see :mod:`runtime.reference`."""
    from runtime.reference import run_reference_process as run

    return run(*args, **kwargs)


def enable_compilation_cache(path: str) -> str:
    """JAX's persistent compilation cache at ``path`` for this process ("": off); see :mod:`runtime.compile_cache`."""
    from runtime.compile_cache import enable

    return enable(path)


def worker_main(argv=None) -> None:
    """The worker process's entry point (``elastic worker``); imports JAX, so set ``XLA_FLAGS`` first."""
    from runtime.worker_process import main

    main(argv)


__all__ = [
    "Controller",
    "checkpoint_directory_problem",
    "ControllerObserver",
    "ControllerOptions",
    "ElasticError",
    "ElasticTrainingFailedError",
    "EventLog",
    "DEFAULT_CHUNK_BYTES",
    "FAULT_ACTIONS",
    "FAULT_PHASES",
    "MAX_CHUNK_BYTES",
    "MAX_STEPS_AHEAD",
    "MIN_CHUNK_BYTES",
    "MESH_AXIS",
    "Node",
    "PlatformMismatchError",
    "ProgramExportError",
    "ProgramSet",
    "ProtocolError",
    "RegistrationTimeoutError",
    "RunResult",
    "StaleEpochError",
    "StepAbortedError",
    "TlsFiles",
    "WorkerError",
    "WorkerLostError",
    "assign_microbatches",
    "default_snapshot_root",
    "default_worker_platform",
    "enable_compilation_cache",
    "local_platform",
    "peak_rss_bytes",
    "program_platforms",
    "ray_available",
    "read_events",
    "run_reference",
    "run_reference_process",
    "tree_reduce",
    "tree_sum",
    "worker_main",
]
