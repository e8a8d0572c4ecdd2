"""What a run of the controller is given and what it answers: its options, its observer hooks, its result.

:class:`ControllerOptions` is everything the controller needs (``elastic``
builds it from the config, one tested mapping); :class:`ControllerObserver` the
hooks the chaos harness uses to watch a run; :class:`RunResult` the summary a
finished run answers.
"""

from __future__ import annotations

import dataclasses
import resource

from runtime.wire import auth
from runtime.wire.parts import DEFAULT_CHUNK_BYTES

__all__ = ["ControllerObserver", "ControllerOptions", "RunResult", "peak_rss_bytes"]


def peak_rss_bytes() -> int:
    """Peak resident set of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclasses.dataclass(frozen=True)
class ControllerOptions:
    """Everything the controller needs; built from the config by ``elastic`` (one mapping, tested).

    Each default is the default config's value (tests/unit/test_options.py checks it), except
    ``compilation_cache_dir``, ``platform`` and ``snapshot_directory``, which ``elastic`` derives from the
    environment and the host ("" here: no cache; the launcher's platform; no snapshot directory).
    """

    slices: int
    devices_per_slice: int                 # of one slice, over all its hosts
    run_dir: str
    hosts_per_slice: int = 1               # worker processes (hosts) per slice, joined into one SPMD program
    run_id: str = ""
    host: str = "127.0.0.1"                # the controller listens here...
    port: int = 0                          # ...on this port (0: any free one)
    launcher: str = "local"                # "local": worker subprocesses; "ray": Ray actors; "none": they join
    ray_address: str = ""                  # the Ray cluster (elastic_launcher=ray); "": $RAY_ADDRESS, else a local one
    pool: str = ""                         # a shared pool's HOST:PORT (launcher "pool"): the workers are its hosts
    pool_priority: int = 0                 # the run's priority there (a higher one takes hosts from a lower one)
    rpc_timeout_seconds: float = 120.0
    register_timeout_seconds: float = 120.0
    dispatch_depth: int = 2
    spares: int = 0
    min_slices: int = 1
    max_retries: int = 10
    heartbeat_seconds: float = 0.25
    lease_seconds: float = 1.5
    probe_retries: int = 2
    relaunch: bool = True
    secret: str = ""
    worker_lease_seconds: float = 5.0      # a worker fences itself after this long without the controller
    client_grace_seconds: float = 120.0    # a worker whose client is gone waits this long for a restarted one
    generation: int = 0                    # this client's generation of the run (a restarted client: one more)
    capacity_timeout_seconds: float = 60.0  # below min_slices: wait this long for a worker to join (0: don't)
    straggler_factor: float = 3.0
    straggler_patience: int = 3
    replace_stragglers: bool = False
    watchdog_factor: float = 10.0          # a step this many times slower than the median...
    watchdog_min_seconds: float = 10.0     # ...and at least this long triggers the step watchdog
    chaos: bool = False                    # workers serve fault-injection calls
    tls: auth.TlsFiles | None = None       # mutual TLS on every link
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # tensor chunk size of peer streams (0: the worker's default, 4 MiB)
    compilation_cache_dir: str = ""        # JAX's persistent compilation cache of the workers ("": none)
    standby_workers: int = 1               # processes started ahead of need, for relaunches (local launcher)
    worker_preload: tuple[str, ...] = ()   # modules the local launcher's zygote imports once for every worker
    data_plane: str = "tcp"                # tensors between workers: "tcp" (runtime.wire.dataplane) or "grpc" (Push)
    shared_memory: bool = True             # state copies on one host from memory to memory (runtime.wire.cross_memory)
    pipeline_stages: int = 1               # pipeline stages: the active slices are stage-major (runtime.pipeline)
    pipeline_schedule: str = "1f1b"        # each stage's order of microbatches (runtime.pipeline.schedule)
    checkpoint_directory: str = ""         # persistent checkpoints (runtime.state.checkpoint); "": none
    checkpoint_period: int = 0             # a checkpoint after every this many steps (and the last); 0: none
    eval_interval: int = 0                 # held-out loss after every this many steps; 0: none (control.evaluation)
    eval_steps: int = -1                   # eval steps (of M microbatches each) per eval; -1: unresolved (none)
    rl_samplers: int = 0                   # an RL run's sampler slices (control.sampling); 0: not an RL run
    rl_off_policy_steps: int = 0           # step s trains on rollouts of weights version s - this (0 or 1)
    rl_sampler_devices: int = 1            # devices of one sampler slice (its own processes' device count)
    shadow_spares: bool = False            # spares shadow the state (runtime.control.shadows)
    platform: str = ""                     # the workers' JAX platform ("": JAX_PLATFORMS, else cpu; launcher)
    load_full_state_path: str = ""         # start from this checkpoint (a store, or <store>/<step>) if none to resume
    load_parameters_path: str = ""         # a fresh start takes its parameters from this checkpoint (<dir>[/items])
    snapshot_directory: str = ""           # in-memory snapshots: the directory on each host that keeps them
    snapshot_interval: int = 0             # a snapshot after every this many steps; 0: none (control.snapshotting)
    backup_kind: str = "snapshot"          # the backup while no spare shadows the state (control.tiers.backup_tier)


class ControllerObserver:
    """Hooks for the chaos harness (and anything else that watches a run). Default: no-ops.

    Called on the controller's thread, by the controller only; a hook must
    return quickly. ``attach`` is called once, ``close`` at most once.
    """

    def attach(self, controller) -> None:
        """The controller (a ``runtime.control.controller.Controller``) started; workers are registered, placed
        and loaded."""

    def step_committed(self, step: int) -> None:
        """Step ``step`` was committed (once per commit, in step order)."""

    def before_transfer(self, source: str, dest: str) -> None:
        """A peer-to-peer state transfer from ``source`` to ``dest`` is about to start."""

    def checkpoint_saved(self, step: int) -> None:
        """A worker reported the checkpoint of ``step`` complete (in the order the reports arrive)."""

    def snapshot_saved(self, step: int) -> None:
        """A worker reported the in-memory snapshot of ``step`` complete on its host."""

    def close(self) -> None:
        """The run ended (in any way)."""


@dataclasses.dataclass(frozen=True)
class RunResult:
    steps_completed: int
    losses: list[float]
    final_state_digest: str              # runtime.state.state_copy.state_digest: "<algorithm>:<hex>"
    replica_hashes: dict[str, str]       # each active replica's digest (all equal)
    wall_seconds: float
    client_peak_rss_bytes: int
    state_bytes: int
    recoveries: int = 0
