"""jax-elastic runtime: controller, workers, scheduling and recovery.

Imports none of ``elastic``, ``integrations`` or ``chaos``; those packages use
the runtime only through the names exported here. The surface is exactly what
they (and the benchmarks, examples and scripts) import, plus the errors a
caller catches (docs/user-guide.md, "Errors"); a name only tests need is
imported from its module (``from runtime.core.microbatch import tree_sum``).
tests/unit/test_layout.py keeps it that way.
"""

import importlib
import os

# gRPC's C core writes its INFO lines (``Got goaway`` when a peer stops, fork notices) to stderr unless told
# otherwise: every process of a run imports this package before gRPC, so each of them (and every process it
# starts, which inherits the variable) keeps only its errors, as gRPC did by default before it logged through absl.
# A GRPC_VERBOSITY the user set wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

# The public names and the submodule each comes from, imported on first use (PEP 562): a worker process
# (and the zygote every local worker is forked from) imports ``runtime.worker.worker_process`` through this
# package and needs none of the controller's modules.
_LAZY = {
    "TlsFiles": ("runtime.wire.auth", "TlsFiles"),
    "Controller": ("runtime.control.controller", "Controller"),
    "ControllerObserver": ("runtime.control.controller_options", "ControllerObserver"),
    "ControllerOptions": ("runtime.control.controller_options", "ControllerOptions"),
    "peak_rss_bytes": ("runtime.control.controller_options", "peak_rss_bytes"),
    "RunState": ("runtime.control.run_state", "RunState"),
    "Backup": ("runtime.control.run_state", "Backup"),
    "transitions": ("runtime.control.run_state", "transitions"),
    "attempts": ("runtime.control.run_state", "attempts"),
    "inspect_run": ("runtime.control.inspect", "inspect_run"),
    "stacks_text": ("runtime.core.stacks", "stacks_text"),
    "pick_processes": ("runtime.core.stacks", "pick_processes"),
    "Reattach": ("runtime.control.attach", "Reattach"),
    "can_attach": ("runtime.control.attach", "can_attach"),
    **{name: ("runtime.core.errors", name) for name in (
        # what a run raises, documented for callers to catch (docs/user-guide.md, "Errors")
        "ElasticError", "WorkerError", "WorkerLostError", "StepAbortedError", "ProtocolError", "StaleEpochError",
        "ProgramExportError", "RegistrationTimeoutError", "PlatformMismatchError", "ElasticTrainingFailedError",
        "CapacityExhaustedError", "StateLostError", "DeviceMismatchError", "ReplicaDivergenceError", "BadInputError",
        # a restarted client's own outcomes (elastic.reattach, elastic.cli, chaos.supervisor)
        "ClientSupersededError", "AttachRefusedError",
        # what the user gave is unusable: said in one line, a worker's without its traceback
        "UserInputError")},
    "positive_seconds": ("runtime.core.arguments", "positive_seconds"),
    "slice_flags_problem": ("runtime.core.arguments", "slice_flags_problem"),
    "checkpoint_directory_problem": ("runtime.state.checkpoint_storage", "directory_problem"),
    "locate_checkpoint": ("runtime.control.checkpointing", "locate_checkpoint"),
    "newest_checkpoint": ("runtime.control.checkpointing", "newest_checkpoint"),
    "checkpoint_steps": ("runtime.control.checkpointing", "checkpoint_steps"),
    "EventLog": ("runtime.core.events", "EventLog"),
    "read_events": ("runtime.core.events", "read_events"),
    "EVENT_KINDS": ("runtime.core.event_kinds", "EVENT_KINDS"),
    "EVENT_COMMON_FIELDS": ("runtime.core.event_kinds", "COMMON_FIELDS"),
    "EventFieldType": ("runtime.core.event_kinds", "FieldType"),
    **{name: ("runtime.wire.parts", name) for name in (
        "DEFAULT_CHUNK_BYTES", "MAX_CHUNK_BYTES", "MAX_STEPS_AHEAD", "MIN_CHUNK_BYTES")},
    "FAULT_ACTIONS": ("runtime.worker.fault_injection", "ACTIONS"),
    "FAULT_PHASES": ("runtime.worker.fault_injection", "PHASES"),
    **{name: ("runtime.core.platforms", name) for name in (
        "default_worker_platform", "local_platform", "program_platforms")},
    "MESH_AXIS": ("runtime.core.programs", "MESH_AXIS"),
    "ProgramSet": ("runtime.core.programs", "ProgramSet"),
    "StagePrograms": ("runtime.core.programs", "StagePrograms"),
    "SamplerPrograms": ("runtime.core.programs", "SamplerPrograms"),
    "run_rl_reference": ("runtime.worker.reference", "run_rl_reference"),
    "run_rl_reference_process": ("runtime.worker.reference", "run_rl_reference_process"),
    "LocalRun": ("runtime.worker.reference", "LocalRun"),
    "theoretical_bubble": ("runtime.pipeline.bubble", "theoretical_bubble"),
    "SIMULATED_STAGE_DELAY_VARIABLE": ("runtime.worker.worker_process", "STAGE_DELAY_VARIABLE"),
    "stages_digest": ("runtime.core.programs", "stages_digest"),
    "CheckpointTree": ("runtime.state.checkpoint_tree", "CheckpointTree"),
    "program_fingerprint": ("runtime.core.fingerprint", "program_fingerprint"),
    "READ_ONLY_PROGRAMS": ("runtime.core.fingerprint", "READ_ONLY_PROGRAMS"),
    "GCS_ENDPOINT_ENV": ("runtime.state.checkpoint_storage", "GCS_ENDPOINT_ENV"),
    "default_snapshot_root": ("runtime.state.snapshot", "default_root"),
    "STATE_DIGEST": ("runtime.state.state_copy", "DIGEST"),
    "ray_available": ("runtime.launch.ray_launcher", "ray_available"),
    "serve_pool": ("runtime.pool.service", "serve"),
    "pool_status": ("runtime.launch.pool_launcher", "pool_status"),
    "pool_secret": ("runtime.pool.service", "pool_secret"),
    "POOL_TOKEN_ENV": ("runtime.launch.pool_launcher", "TOKEN_ENV"),
    "pool_host_main": ("runtime.pool.agent", "main"),
    "ray_cluster_problem": ("runtime.launch.ray_launcher", "cluster_problem"),
    "ray_cluster_room": ("runtime.launch.ray_launcher", "cluster_room"),
}


def __getattr__(name: str):
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def run_reference(*args, **kwargs):
    """The same math in one process (ground truth); see :func:`runtime.worker.reference.run_reference`. Imports JAX."""
    from runtime.worker.reference import run_reference as run

    return run(*args, **kwargs)


def run_reference_process(*args, **kwargs):
    """The same math in a child process with the slice's CPU devices; see :mod:`runtime.worker.reference`."""
    from runtime.worker.reference import run_reference_process as run

    return run(*args, **kwargs)


def prestart_workers(options) -> None:
    """Starts the local workers' zygote ahead of a run of ``options`` (a ``ControllerOptions``); see
    :func:`runtime.launch.launcher.prestart_workers`."""
    from runtime.launch.launcher import prestart_workers as prestart

    prestart(options)


def enable_compilation_cache(path: str) -> str:
    """JAX's persistent compilation cache at ``path`` for this process ("": off); see
    :mod:`runtime.core.compile_cache`."""
    from runtime.core.compile_cache import enable

    return enable(path)


def worker_main(argv=None) -> None:
    """The worker process's entry point (``elastic worker``); imports JAX, so set ``XLA_FLAGS`` first."""
    from runtime.worker.worker_process import main

    main(argv)


__all__ = [
    "BadInputError",
    "serve_pool",
    "pool_status",
    "pool_secret",
    "POOL_TOKEN_ENV",
    "pool_host_main",
    "inspect_run",
    "stacks_text",
    "pick_processes",
    "CapacityExhaustedError",
    "UserInputError",
    "DeviceMismatchError",
    "CheckpointTree",
    "Controller",
    "checkpoint_directory_problem",
    "positive_seconds",
    "slice_flags_problem",
    "ControllerObserver",
    "ControllerOptions",
    "ElasticError",
    "ElasticTrainingFailedError",
    "locate_checkpoint",
    "newest_checkpoint",
    "checkpoint_steps",
    "EVENT_COMMON_FIELDS",
    "EVENT_KINDS",
    "EventFieldType",
    "EventLog",
    "DEFAULT_CHUNK_BYTES",
    "FAULT_ACTIONS",
    "FAULT_PHASES",
    "MAX_CHUNK_BYTES",
    "MAX_STEPS_AHEAD",
    "MIN_CHUNK_BYTES",
    "MESH_AXIS",
    "PlatformMismatchError",
    "ProgramExportError",
    "ProgramSet",
    "ProtocolError",
    "RegistrationTimeoutError",
    "ReplicaDivergenceError",
    "RunState",
    "Backup",
    "transitions",
    "attempts",
    "STATE_DIGEST",
    "Reattach",
    "can_attach",
    "StaleEpochError",
    "StateLostError",
    "ClientSupersededError",
    "AttachRefusedError",
    "StepAbortedError",
    "TlsFiles",
    "WorkerError",
    "WorkerLostError",
    "default_snapshot_root",
    "default_worker_platform",
    "enable_compilation_cache",
    "prestart_workers",
    "local_platform",
    "peak_rss_bytes",
    "program_fingerprint",
    "READ_ONLY_PROGRAMS",
    "GCS_ENDPOINT_ENV",
    "program_platforms",
    "ray_available",
    "ray_cluster_problem",
    "ray_cluster_room",
    "read_events",
    "LocalRun",
    "theoretical_bubble",
    "SIMULATED_STAGE_DELAY_VARIABLE",
    "run_reference",
    "run_reference_process",
    "stages_digest",
    "StagePrograms",
    "SamplerPrograms",
    "run_rl_reference",
    "run_rl_reference_process",
    "worker_main",
]
