"""The config schema: every key with its type, default, bounds and roles, and the validated :class:`Config`.

Contract:

* A config is a frozen, validated :class:`Config` of flat keys. Every problem (unknown key, wrong type,
  out-of-range or contradictory values; and, loading, a missing file or bad YAML) raises
  :class:`ConfigError` with a one-line message naming the key, and the file or ``overrides`` it came
  from. Nothing is read from the environment.
* Config files (YAML, ``base_config`` inheritance) and ``key=value`` overrides are read by
  :mod:`elastic.config_loading`; the launcher calls its ``load_config`` once, and anything that receives
  ``Config.to_dict()`` rebuilds the same config with :func:`config_from_dict`.
* A value is first coerced to its key's type (:func:`coerce`), then every value is checked at once:
  ranges, forms and keys that contradict in :mod:`elastic.config_checks`, the recovery role's
  contradictions here.
* Each key's roles (math, runtime, output, model, maxtext, recovery; see
  :data:`ROLES`) are declared once, beside its default, and every list of keys
  is derived from them (:func:`keys_with`: :data:`MODEL_KEYS`,
  :data:`MATH_KEYS` and :data:`REFERENCE_NEUTRAL` for the chaos reference, the
  MaxText integration's shared keys, the recovery keys).
* Where each key goes (controller options, the trainer, the bundled model) is
  declared in one place, :mod:`elastic.options`; a key added here without a
  place there fails that module's import.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from elastic.config_checks import config_problem, key_at
from runtime import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MAX_STEPS_AHEAD, MIN_CHUNK_BYTES, UserInputError

__all__ = [
    "MATH",
    "MATH_KEYS",
    "MAXTEXT",
    "MODEL",
    "MODEL_KEYS",
    "OUTPUT",
    "RECOVERY",
    "REFERENCE_NEUTRAL",
    "ROLES",
    "RUNTIME",
    "Config",
    "ConfigError",
    "coerce",
    "config_from_dict",
    "config_from_entries",
    "key_field",
    "keys_with",
    "no_recovery_values",
]


class ConfigError(UserInputError, ValueError):
    """A config file, dict or override is invalid, or what a key names cannot be used (a data file that cannot
    be read, on the client or on a worker); the message names the key and source. A worker's is said in one
    line, its traceback kept in the worker's log (:class:`runtime.UserInputError`)."""


# The roles of a config key, declared once per key in the schema below (``_key(..., role=...)``); every
# list of keys elsewhere is derived from them (:func:`keys_with`).
MATH = "math"          # changes the numbers the run computes: part of the chaos reference's digest
RUNTIME = "runtime"    # steers how the run executes (elastic.options turns it into ControllerOptions)
OUTPUT = "output"      # where the run writes or what it records; never the numbers
MODEL = "model"        # read only by the bundled model and its optimizer (MODEL_KEYS)
MAXTEXT = "maxtext"    # MaxText's config defines it too (integrations.maxtext decides who gets which value)
RECOVERY = "recovery"  # steers only recovery: with elastic_enabled=false, its default or its no-recovery value
ROLES = (MATH, RUNTIME, OUTPUT, MODEL, MAXTEXT, RECOVERY)


def _key(default: Any, *, role: tuple[str, ...], ge: float | None = None, gt: float | None = None,
         le: float | None = None, unit: str = "", choices: tuple = ()) -> Any:
    return field(default=default, metadata={"role": frozenset(role), "ge": ge, "gt": gt, "le": le, "unit": unit,
                                            "choices": choices})


# A chunk is one gRPC message and the runtime caps messages at 64 MiB; below 4 KiB the
# per-message overhead dominates a transfer. Workers refuse chunk sizes outside these
# bounds (runtime.worker.collective), so the config refuses them first, naming the key.


@dataclass(frozen=True)
class Config:
    """Validated run configuration. Construct with :func:`elastic.config_loading.load_config`; change with
    :meth:`replace` (which validates again)."""

    run_name: str = _key("", role=(OUTPUT, MAXTEXT))  # empty: the launcher fills it in
    base_output_directory: str = _key("runs", role=(OUTPUT, MAXTEXT))
    seed: int = _key(0, role=(MATH,))
    steps: int = _key(20, role=(MATH, MAXTEXT), ge=1)
    per_device_batch_size: int = _key(2, role=(MATH, MAXTEXT), ge=1)  # examples per device per microbatch
    dcn_data_parallelism: int = _key(1, role=(RUNTIME, MAXTEXT), ge=1)  # virtual slices (per pipeline stage)
    # Pipeline stages S: the loss's forward pass carries S - 1 elastic.pipeline_stage marks (docs/pipeline.md)
    dcn_pipeline_parallelism: int = _key(1, role=(MATH, RUNTIME, MAXTEXT), ge=1)
    # The order each pipeline stage runs its microbatches in: the same math either way (docs/pipeline.md)
    elastic_pipeline_schedule: str = _key("1f1b", role=(RUNTIME,), choices=("1f1b", "gpipe"))
    ici_fsdp_parallelism: int = _key(1, role=(MATH, RUNTIME, MAXTEXT), ge=1)  # devices per slice
    learning_rate: float = _key(1e-3, role=(MATH, MODEL, MAXTEXT), gt=0)
    warmup_steps: int = _key(0, role=(MATH, MODEL), ge=0)
    vocab_size: int = _key(64, role=(MATH, MODEL, MAXTEXT), ge=1)
    max_target_length: int = _key(32, role=(MATH, MODEL, MAXTEXT), ge=1)
    base_emb_dim: int = _key(32, role=(MATH, MODEL, MAXTEXT), ge=1)
    base_num_decoder_layers: int = _key(2, role=(MATH, MODEL, MAXTEXT), ge=1)
    base_num_query_heads: int = _key(2, role=(MATH, MODEL, MAXTEXT), ge=1)
    base_mlp_dim: int = _key(64, role=(MATH, MODEL, MAXTEXT), ge=1)
    elastic_microbatches: int = _key(0, role=(MATH,), ge=0)  # 0: next power of two >= slices
    # steps in flight (workers refuse more)
    elastic_dispatch_depth: int = _key(2, role=(RUNTIME,), ge=1, le=MAX_STEPS_AHEAD)
    elastic_rpc_timeout_seconds: float = _key(120.0, role=(RUNTIME,), gt=0)
    elastic_register_timeout_seconds: float = _key(120.0, role=(RUNTIME,), gt=0)
    elastic_chunk_bytes: int = _key(DEFAULT_CHUNK_BYTES, role=(RUNTIME,), ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES,
                                    unit=" bytes")
    # false: no recovery, a lost worker fails the run (plain SPMD)
    elastic_enabled: bool = _key(True, role=(RUNTIME, MAXTEXT))
    elastic_spares: int = _key(0, role=(RUNTIME, RECOVERY), ge=0)  # warmed spare slices launched beside the active ones
    # Hosts (worker processes) per slice: the slice's devices are spread over them, the same number on each, and
    # they run its programs together (one JAX distributed system). One host lost is the slice lost.
    elastic_hosts_per_slice: int = _key(1, role=(RUNTIME, MATH), ge=1)
    # Spares shadow the state: every step's reduced gradient also goes to each spare, which
    # applies it, so a spare holds the committed state and replaces even every active slice at once with no
    # step lost and no transfer. Costs each rank one more push of its reduced chunk per spare per step.
    elastic_shadow_spares: bool = _key(False, role=(RUNTIME, RECOVERY))
    elastic_min_slice_count: int = _key(1, role=(RUNTIME, MAXTEXT, RECOVERY), ge=1)  # shrink no further than this
    # wait for capacity below the minimum
    elastic_timeout_seconds: float = _key(60.0, role=(RUNTIME, MAXTEXT, RECOVERY), gt=0)
    elastic_max_retries: int = _key(10, role=(RUNTIME, MAXTEXT, RECOVERY), ge=0)  # recoveries before the run fails
    elastic_heartbeat_seconds: float = _key(0.25, role=(RUNTIME,), gt=0)  # health probe interval
    elastic_lease_seconds: float = _key(1.5, role=(RUNTIME,), gt=0)  # silence before a worker is suspect
    elastic_probe_retries: int = _key(2, role=(RUNTIME,), ge=0)  # re-probes confirming a suspect is dead
    elastic_relaunch: bool = _key(True, role=(RUNTIME, RECOVERY))  # local launcher restarts dead workers as spares
    # a worker cut off from the controller this long fences itself
    elastic_worker_lease_seconds: float = _key(5.0, role=(RUNTIME,), gt=0)
    # a worker whose client is gone keeps its state this long for a restarted client of the run to re-attach
    # it (the same command, the same run_name), then exits; 0: it exits at once (a client restart then resumes
    # from the newest checkpoint)
    elastic_client_grace_seconds: float = _key(120.0, role=(RUNTIME, RECOVERY), ge=0)
    # grad phase slower than factor x median of the others
    elastic_straggler_factor: float = _key(3.0, role=(RUNTIME,), gt=1)
    # consecutive slow steps before a straggler is reported
    elastic_straggler_patience: int = _key(3, role=(RUNTIME,), ge=1)
    # move a reported straggler's slice onto a spare
    elastic_replace_stragglers: bool = _key(False, role=(RUNTIME, RECOVERY))
    # a step this many x the median step time...
    elastic_step_watchdog_factor: float = _key(10.0, role=(RUNTIME,), gt=1)
    # ...and at least this long: find who holds it up
    elastic_step_watchdog_min_seconds: float = _key(10.0, role=(RUNTIME,), gt=0)
    elastic_chaos: bool = _key(False, role=(RUNTIME,))  # workers accept fault injection from the chaos harness
    elastic_tls_cert_file: str = _key("", role=(RUNTIME,))  # PEM certificate: mutual TLS on every link when set
    elastic_tls_key_file: str = _key("", role=(RUNTIME,))  # its private key
    elastic_tls_ca_file: str = _key("", role=(RUNTIME,))  # CA that signed every process's certificate
    elastic_max_local_workers: int = _key(0, role=(RUNTIME,), ge=0)  # 0: derived from this host's cores and memory
    # Processes started ahead of need for relaunches; -1: one with recovery on, none with elastic_enabled=false
    # (asking for standby processes with recovery off is a contradiction).
    elastic_standby_workers: int = _key(-1, role=(RUNTIME, RECOVERY), ge=-1, le=64)
    # How gradients and states travel between workers: "tcp" (the data plane: sockets, no copies)
    # or "grpc" (Push/GetState streams; for networks that let only the gRPC port through).
    elastic_data_plane: str = _key("tcp", role=(RUNTIME,), choices=("tcp", "grpc"))
    # A state copied between two workers on one host goes straight from the source's memory into the reader's
    # (one copy, by the kernel: runtime.wire.cross_memory) where the host allows it; false: always the data plane.
    elastic_shared_memory: bool = _key(True, role=(RUNTIME,))
    # MaxText's key: the platform the programs are exported for and the workers run on: cpu, gpu (CUDA) or tpu.
    # "": the platform the workers get from the environment (JAX_PLATFORMS, else cpu). See HARDWARE.
    hardware: str = _key("", role=(MATH, RUNTIME, MAXTEXT))
    # JAX's persistent compilation cache, shared by the workers and the reference run (MaxText's key).
    # "": $JAX_COMPILATION_CACHE_DIR if set, else <base_output_directory>/jax_cache; "off": none.
    jax_cache_dir: str = _key("", role=(OUTPUT, MAXTEXT))
    # The trainer to run, "module:factory" with factory(config) -> elastic.Trainer or elastic.wrap job
    # (elastic run/chaos --trainer); "": the bundled model.
    elastic_trainer: str = _key("", role=(MATH,))
    # MaxText's key: the run's goodput as ml-goodput-measurement events in <run dir>/goodput_log.jsonl
    # (needs jax-elastic[goodput]); with elastic_goodput_cloud_logging also to Cloud Logging, goodput_<run_name>.
    enable_goodput_recording: bool = _key(False, role=(OUTPUT, MAXTEXT))
    # Persistent checkpoints (MaxText's keys): one replica writes its state every checkpoint_period steps
    # (and after the last), in the background; when every replica is lost the run restores the newest
    # complete one instead of failing. elastic_checkpoint_directory: a local path or gs://bucket/path;
    # "": <base_output_directory>/<run_name>/checkpoints.
    enable_checkpointing: bool = _key(False, role=(RUNTIME, OUTPUT, MAXTEXT))
    checkpoint_period: int = _key(10, role=(RUNTIME, OUTPUT, MAXTEXT), ge=1)
    elastic_checkpoint_directory: str = _key("", role=(RUNTIME, OUTPUT))
    # MaxText's key: start from this jax-elastic checkpoint (a checkpoint directory: its newest complete one; or
    # one step's directory, <dir>/<step>) when the run's own directory holds none to resume from. "": fresh.
    load_full_state_path: str = _key("", role=(MATH, RUNTIME, MAXTEXT))
    # MaxText's key: a fresh start (nothing to resume) takes its parameters from this checkpoint, a step's
    # directory (<dir>/<step>[/items]) or a parameter-only checkpoint (<dir>[/items]): the leaves the model's
    # checkpoint tree places under "params" (MaxText's models name theirs); the optimizer state and the step
    # are the seed's (fine-tuning). Not with load_full_state_path. "": the seed's parameters.
    load_parameters_path: str = _key("", role=(MATH, RUNTIME, MAXTEXT))
    elastic_goodput_cloud_logging: bool = _key(False, role=(OUTPUT,))
    # MaxText's metrics keys, written by the client from committed steps (elastic.metrics): TensorBoard event files
    # in <base_output_directory>/<run_name>/tensorboard/<run_name> (a MaxText config: on unless set, as in MaxText);
    # metrics_file: one JSON line of the step's scalars per step ("": none); log_period: TensorBoard is flushed
    # at every step divisible by it.
    enable_tensorboard: bool = _key(False, role=(OUTPUT, MAXTEXT))
    metrics_file: str = _key("", role=(OUTPUT, MAXTEXT))
    log_period: int = _key(100, role=(OUTPUT, MAXTEXT), ge=1)
    # Held-out evaluation (MaxText's keys): after step k (0-based) with k % eval_interval == 0 (MaxText's schedule:
    # after the first step, then every eval_interval steps) the live slices compute the loss of eval_steps eval
    # steps (each of elastic_microbatches microbatches of the eval data) on the new state; it never changes the
    # training bits. 0 or -1 (MaxText's "off"): none. eval_steps -1: the whole eval source, when it says its
    # length (len(source), or its steps).
    eval_interval: int = _key(0, role=(RUNTIME, OUTPUT, MAXTEXT), ge=-1)
    eval_steps: int = _key(-1, role=(RUNTIME, OUTPUT, MAXTEXT), ge=-1)
    # RL post-training (runtime.control.sampling, elastic.rl; docs/rl.md): rl_samplers sampler slices (0: a
    # training run) make each step's rollouts with the policy's weights version of rl_off_policy_steps steps
    # before (0: sequential; 1: the samplers make step s+1's while the trainers train step s); the rest is the
    # algorithm (elastic.rl.reference.RLSettings reads and checks them).
    rl_samplers: int = _key(0, role=(RUNTIME,), ge=0)
    rl_sampler_devices: int = _key(1, role=(RUNTIME, MATH), ge=1)
    rl_off_policy_steps: int = _key(0, role=(RUNTIME, MATH), ge=0, le=1)
    rl_prompts_per_microbatch: int = _key(4, role=(MATH,), ge=1)
    rl_samples_per_prompt: int = _key(8, role=(MATH,), ge=2)
    rl_prompt_length: int = _key(4, role=(MATH,), ge=1)
    rl_max_new_tokens: int = _key(4, role=(MATH,), ge=1)
    rl_temperature: float = _key(1.0, role=(MATH,), gt=0)
    rl_clip_epsilon: float = _key(0.2, role=(MATH,), gt=0, le=1)
    rl_kl_coef: float = _key(0.0, role=(MATH,), ge=0)
    rl_weights_dtype: str = _key("", role=(RUNTIME, MATH), choices=("", "float32", "bfloat16"))
    # In-memory snapshots (MaxText's elastic_backup_kind): while no spare shadows the state, one replica writes
    # its state to its host's memory (/dev/shm) every elastic_snapshot_interval steps (0: never), and a copy
    # goes to a worker on another host; when every replica is lost, a worker on a host that holds one restores
    # it (steps lost: at most about the interval). elastic_backup_kind=checkpoint: no snapshots, the
    # persistent checkpoint is the backup. elastic_snapshot_directory: an absolute path on every worker's host;
    # "": /dev/shm/jax-elastic-snapshots (else the temporary directory).
    elastic_snapshot_interval: int = _key(0, role=(RUNTIME, RECOVERY), ge=0)
    elastic_backup_kind: str = _key("snapshot", role=(RUNTIME, MAXTEXT), choices=("snapshot", "checkpoint"))
    elastic_snapshot_directory: str = _key("", role=(RUNTIME,))
    # Who starts the workers: "local" (subprocesses of this client, relaunched when they die), "ray" (Ray actors
    # on the Ray cluster at ray_address: pip install jax-elastic[ray]) or "none" (someone else starts them --
    # Kubernetes, any scheduler, by hand -- and each joins with `elastic worker`; a replacement joins the same
    # way, as a spare). "none" needs elastic_controller_address with a port, elastic_run_id, and the run secret
    # in ELASTIC_RUN_SECRET for the client and every worker. See docs/deploy.md.
    elastic_launcher: str = _key("local", role=(RUNTIME,), choices=("local", "ray", "none"))
    # The Ray cluster of elastic_launcher=ray ("ray://..." or "HOST:PORT"); "": $RAY_ADDRESS, else a local one.
    ray_address: str = _key("", role=(RUNTIME,))
    # A shared pool's address (HOST:PORT; `elastic pool serve`, docs/pool.md): the run leases its workers there
    # instead of starting them, and gives them back when it ends, shrinks or is preempted. The pool's client
    # token in ELASTIC_POOL_TOKEN. "": no pool.
    elastic_pool: str = _key("", role=(RUNTIME,))
    # The run's priority in its pool: a run of a higher priority takes hosts from runs of a lower one, which
    # shrink (down to elastic_min_slice_count) and grow back when hosts are free again.
    elastic_pool_priority: int = _key(0, role=(RUNTIME,))
    # HOST:PORT the controller listens on; "": 127.0.0.1, any free port (the local launcher tells its workers).
    elastic_controller_address: str = _key("", role=(RUNTIME,))
    # The run's id, which every worker names when it joins; "": a fresh random one (the local launcher tells its
    # workers). Letters, digits, '.', '_', '-'.
    elastic_run_id: str = _key("", role=(RUNTIME,))

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, coerce(f.name, getattr(self, f.name)))
        _validate(self.to_dict(), {})

    @property
    def microbatches(self) -> int:
        """Microbatches per step M (``elastic_microbatches`` with 0 resolved: enough for every slice, and twice
        the pipeline stages, so a pipeline is busy more than half the time)."""
        stages = self.dcn_pipeline_parallelism
        return self.elastic_microbatches or _next_power_of_two(max(self.dcn_data_parallelism,
                                                                   2 * stages if stages > 1 else 1))

    @property
    def standby_workers(self) -> int:
        """Standby processes (``elastic_standby_workers`` with -1 resolved: 1 with recovery on, else 0)."""
        if self.elastic_standby_workers >= 0:
            return self.elastic_standby_workers
        return 1 if self.elastic_enabled else 0

    @property
    def slices(self) -> int:
        return self.dcn_data_parallelism

    @property
    def devices_per_slice(self) -> int:
        return self.ici_fsdp_parallelism

    @property
    def microbatch_size(self) -> int:
        """Examples in one microbatch (one slice's share of work per dispatch)."""
        return self.per_device_batch_size * self.ici_fsdp_parallelism

    @property
    def global_batch_size(self) -> int:
        return self.microbatches * self.microbatch_size

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied; raises ConfigError like load_config."""
        for key in changes:
            key_field(key, "replace()")
        return dataclasses.replace(self, **changes)

    def to_dict(self, *, model_keys: bool = True) -> dict[str, Any]:
        """The fields as a plain JSON-able dict; ``config_from_dict`` inverts it.

        ``model_keys=False`` leaves out the bundled model's keys (:data:`MODEL_KEYS`):
        what a run of the user's own model records.
        """
        return {f.name: getattr(self, f.name) for f in fields(self) if model_keys or f.name not in MODEL_KEYS}


def keys_with(role: str) -> frozenset[str]:
    """The config keys declared with ``role`` (one of :data:`ROLES`)."""
    if role not in ROLES:
        raise ValueError(f"unknown config key role {role!r}; roles: {', '.join(ROLES)}")
    return frozenset(f.name for f in fields(Config) if role in f.metadata["role"])


def _check_roles() -> None:
    """Import-time: every key has known roles, and at least one saying what it does (math, runtime or output)."""
    for f in fields(Config):
        unknown = f.metadata["role"] - set(ROLES)
        if unknown or not f.metadata["role"] & {MATH, RUNTIME, OUTPUT}:
            raise ImportError(f"config key {f.name!r}: roles {sorted(f.metadata['role'])} must be among {ROLES} and "
                              f"include {MATH}, {RUNTIME} or {OUTPUT}")
        if MODEL in f.metadata["role"] and MATH not in f.metadata["role"]:
            raise ImportError(f"config key {f.name!r}: a model key is a math key")
        if RECOVERY in f.metadata["role"] and RUNTIME not in f.metadata["role"]:
            raise ImportError(f"config key {f.name!r}: a recovery key is a runtime key")


_check_roles()

#: Keys read only by the bundled model and its optimizer (elastic.models, elastic.cli_support.bundled_trainer).
MODEL_KEYS = keys_with(MODEL)
#: Keys that change the run's numbers; the others (:data:`REFERENCE_NEUTRAL`) leave a chaos reference valid.
MATH_KEYS = keys_with(MATH)
REFERENCE_NEUTRAL = frozenset(f.name for f in fields(Config)) - MATH_KEYS

_FIELDS = {f.name: f for f in fields(Config)}


def config_from_dict(d: Mapping[str, Any], source: str = "<dict>") -> Config:
    """Build a Config from flat ``{key: value}``; ``source`` names ``d`` in errors."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: expected a mapping of config keys, got {type(d).__name__}")
    return config_from_entries({str(k): (v, source) for k, v in d.items()})


def config_from_entries(entries: Mapping[str, tuple[Any, str]]) -> Config:
    """Build a Config from ``{key: (value, source)}``; each error names the source of the key it is about."""
    values = {k: coerce(k, v, src) for k, (v, src) in entries.items()}
    _validate({**_DEFAULTS, **values}, {k: src for k, (_, src) in entries.items()})
    return Config(**values)


def key_field(key: str, source: str) -> dataclasses.Field:
    """The schema's field of ``key`` (its ``type`` is the annotation's text: ``"int"``, ``"str"``...), or a
    ConfigError naming ``source`` for an unknown key, with the closest known one."""
    if key in _FIELDS:
        return _FIELDS[key]
    if key == "base_config":
        raise ConfigError(f"config key 'base_config' (in {source}) is only allowed at the top of a YAML file")
    close = difflib.get_close_matches(key, _FIELDS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"unknown config key {key!r} (in {source}){hint}")


def coerce(key: str, value: Any, source: str = "") -> Any:
    """``value`` converted to the type of ``key``, or ConfigError (naming ``source`` where given)."""
    kind = key_field(key, source or "<Config>").type  # a string: annotations are postponed

    def fail(want: str) -> ConfigError:
        where = f" (in {source})" if source else ""
        return ConfigError(f"config key {key!r} must be {want}, got {value!r}{where}")

    if isinstance(value, (Mapping, list, tuple, set)):
        raise fail("a scalar")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise fail("true or false")
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise fail("an integer")
    if kind == "float":
        # YAML 1.1 reads '1e-3' (no dot in the mantissa) as a string, so accept that.
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise fail("a number")
        try:
            number = float(value)
        except ValueError:
            raise fail("a number") from None
        except OverflowError:   # an int beyond the float range (10**400)
            raise fail("a finite number") from None
        if not math.isfinite(number):
            raise fail("a finite number")
        return number
    return "" if value is None else str(value)


def _validate(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """Range and cross-key checks over a complete set of coerced values (:mod:`elastic.config_checks`),
    then the recovery role's."""
    problem = config_problem(values, sources, _FIELDS) or _recovery_problem(values, sources)
    if problem:
        raise ConfigError(problem)


# Keys that only steer recovery (the recovery role). With elastic_enabled=false each keeps its default
# (ignored) or the value that already means "no recovery"; anything else is a contradiction.
_RECOVERY_KEYS = keys_with(RECOVERY)


def no_recovery_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """``{key: value}`` for every key with the recovery role: the value that means "no recovery" given the
    other ``values`` (elastic.options applies them with ``elastic_enabled=false``). The capacity wait's 0 is
    out of the key's range, so with recovery off that key may only keep its default."""
    return {"elastic_spares": 0, "elastic_min_slice_count": values["dcn_data_parallelism"],
            "elastic_timeout_seconds": 0.0, "elastic_max_retries": 0, "elastic_relaunch": False,
            "elastic_replace_stragglers": False, "elastic_shadow_spares": False, "elastic_snapshot_interval": 0,
            "elastic_standby_workers": 0, "elastic_client_grace_seconds": 0.0}


def _no_recovery_value(key: str, values: Mapping[str, Any]) -> Any:
    return no_recovery_values(values)[key]


def _recovery_problem(values: Mapping[str, Any], sources: Mapping[str, str]) -> str:
    """With ``elastic_enabled=false``, a key of the recovery role that keeps neither its default nor its
    no-recovery value, as the contradiction's message ("" if none)."""
    if not values["elastic_enabled"]:
        for key in _RECOVERY_KEYS:
            if values[key] != _DEFAULTS[key] and values[key] != _no_recovery_value(key, values):
                enabled, at = key_at("elastic_enabled", values, sources), key_at(key, values, sources)
                return (f"config keys {enabled} and {at} contradict: "
                        f"{key} steers recovery and elastic_enabled=false turns recovery off "
                        f"(a lost worker fails the run); drop {key} or enable elastic training")
    return ""


if set(no_recovery_values(Config().to_dict())) != _RECOVERY_KEYS:
    raise ImportError("elastic.config: no_recovery_values and the recovery role disagree")


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


_DEFAULTS = Config().to_dict()
