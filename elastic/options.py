"""Config keys to runtime settings: the one place a :class:`Config` becomes ``ControllerOptions``.

Contract:

* Every key of the :class:`~elastic.config.Config` schema has a place here
  saying where it goes: copied to a ``ControllerOptions`` field
  (``_TO_CONTROLLER``), folded with others into one (``_TLS_KEYS`` -> ``tls``;
  ``elastic_enabled`` -> the recovery fields; ``jax_cache_dir`` with
  ``base_output_directory`` -> ``compilation_cache_dir``), or read elsewhere by name
  (``READ_ELSEWHERE``, which says who reads it). A key may go to the
  controller and be read elsewhere too. Importing this module checks that the
  schema and these tables agree and raises ``ImportError`` naming any key
  without a place, so a key cannot be added and silently dropped.
* The places agree with the roles each key declares in the schema (:mod:`elastic.config`): a key the
  controller gets has the runtime or output role, the bundled model reads exactly the model keys, and
  ``elastic_enabled=false`` gives every recovery key its "no recovery" value
  (:func:`elastic.config.no_recovery_values`); the import check refuses a disagreement.
* The runtime's reasons name its own option fields; :func:`in_config_terms` rewords them with the
  config keys for whatever prints them to a config user (the commands, the run's ``run_failed`` event).
* No key is refused today; a key without an effect is removed from the schema.
* The trainer (client side) calls :func:`controller_options` and
  :func:`run_settings` once per run and builds its options from nothing
  else. Both are pure apart from resolving the TLS paths against the current
  directory (workers run with another one) and reading JAX's variables
  (``JAX_COMPILATION_CACHE_DIR``; ``JAX_PLATFORMS`` when ``hardware`` is
  empty, see :func:`export_platform`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from elastic.config import MODEL_KEYS, OUTPUT, RECOVERY, RUNTIME, Config, ConfigError, keys_with, no_recovery_values
from elastic.config_checks import HARDWARE
from runtime import (POOL_TOKEN_ENV, BadInputError, ControllerOptions, TlsFiles, default_snapshot_root,
                     default_worker_platform, locate_checkpoint, ray_available)

__all__ = ["NOT_FROM_CONFIG", "PLATFORM_OF_HARDWARE", "READ_ELSEWHERE", "RunSettings", "checkpoint_directory",
           "compilation_cache_dir", "controller_options", "export_platform", "in_config_terms", "parameters_path",
           "run_settings"]

# Config key -> ControllerOptions field, copied as is.
_TO_CONTROLLER: Mapping[str, str] = MappingProxyType({
    "dcn_data_parallelism": "slices",
    "dcn_pipeline_parallelism": "pipeline_stages",
    "elastic_pipeline_schedule": "pipeline_schedule",
    "ici_fsdp_parallelism": "devices_per_slice",
    "elastic_rpc_timeout_seconds": "rpc_timeout_seconds",
    "elastic_register_timeout_seconds": "register_timeout_seconds",
    "elastic_dispatch_depth": "dispatch_depth",
    "elastic_chunk_bytes": "chunk_bytes",
    "elastic_spares": "spares",
    "elastic_hosts_per_slice": "hosts_per_slice",
    "elastic_min_slice_count": "min_slices",
    "elastic_timeout_seconds": "capacity_timeout_seconds",
    "elastic_max_retries": "max_retries",
    "elastic_heartbeat_seconds": "heartbeat_seconds",
    "elastic_lease_seconds": "lease_seconds",
    "elastic_probe_retries": "probe_retries",
    "elastic_relaunch": "relaunch",
    "elastic_worker_lease_seconds": "worker_lease_seconds",
    "elastic_client_grace_seconds": "client_grace_seconds",
    "elastic_straggler_factor": "straggler_factor",
    "elastic_straggler_patience": "straggler_patience",
    "elastic_replace_stragglers": "replace_stragglers",
    "elastic_step_watchdog_factor": "watchdog_factor",
    "elastic_step_watchdog_min_seconds": "watchdog_min_seconds",
    "elastic_chaos": "chaos",
    "elastic_data_plane": "data_plane",
    "elastic_shared_memory": "shared_memory",
    "elastic_shadow_spares": "shadow_spares",
    "elastic_snapshot_interval": "snapshot_interval",
    "elastic_backup_kind": "backup_kind",
    "elastic_launcher": "launcher",
    "ray_address": "ray_address",
    "elastic_pool": "pool",
    "elastic_pool_priority": "pool_priority",
    "elastic_run_id": "run_id",
    "eval_interval": "eval_interval",   # -1 (MaxText's off) and the eval source's length: the trainer resolves them
    "eval_steps": "eval_steps",
    "rl_samplers": "rl_samplers",
    "rl_off_policy_steps": "rl_off_policy_steps",
    "rl_sampler_devices": "rl_sampler_devices",
})

_TLS_KEYS = ("elastic_tls_cert_file", "elastic_tls_key_file", "elastic_tls_ca_file")  # -> tls, all or none
_ENABLED_KEY = "elastic_enabled"  # false -> the recovery fields below take their "no recovery" values
_STANDBY_KEY = "elastic_standby_workers"  # -> standby_workers, -1 resolved (Config.standby_workers)
_CACHE_KEY = "jax_cache_dir"      # -> compilation_cache_dir (and RunSettings.compilation_cache_dir)
# -> checkpoint_directory and checkpoint_period, both off unless enable_checkpointing
_CHECKPOINT_KEYS = ("enable_checkpointing", "checkpoint_period", "elastic_checkpoint_directory",
                    "load_full_state_path", "load_parameters_path")
_SNAPSHOT_KEYS = ("elastic_snapshot_directory",)   # -> snapshot_directory (default: default_snapshot_root())
_ADDRESS_KEY = "elastic_controller_address"   # -> host and port ("": 127.0.0.1, any port)
#: Where the run secret comes from when the workers are started by someone else (elastic_launcher=none).
SECRET_ENV = "ELASTIC_RUN_SECRET"

# Config key -> who reads it, for keys that do not (only) configure the controller.
READ_ELSEWHERE: Mapping[str, str] = MappingProxyType({
    "run_name": "RunSettings.run_name: the trainer's run directory <base_output_directory>/<run_name>",
    "base_output_directory": "RunSettings.base_output_directory: the trainer's run directory",
    "steps": "RunSettings.steps: steps the trainer trains",
    "seed": "RunSettings.seed: the init program's key; the bundled data (elastic.models.make_model)",
    "elastic_microbatches": "RunSettings.microbatches: microbatches per step of the trainer's programs",
    "ici_fsdp_parallelism": "RunSettings.devices_per_slice: the mesh of the trainer's programs",
    "per_device_batch_size": "Config.microbatch_size: the bundled data (elastic.models.make_model)",
    "learning_rate": "the bundled model's optimizer (elastic.cli)",
    "warmup_steps": "the bundled model's optimizer (elastic.cli)",
    "vocab_size": "the bundled model (elastic.models.TransformerConfig.from_config)",
    "max_target_length": "the bundled model and data (elastic.models)",
    "base_emb_dim": "the bundled model (elastic.models.TransformerConfig.from_config)",
    "base_num_decoder_layers": "the bundled model (elastic.models.TransformerConfig.from_config)",
    "base_num_query_heads": "the bundled model (elastic.models.TransformerConfig.from_config)",
    "base_mlp_dim": "the bundled model (elastic.models.TransformerConfig.from_config)",
    "enable_goodput_recording": "RunSettings.goodput_recording: the trainer writes goodput_log.jsonl "
                                "(elastic.report.goodput_log)",
    "elastic_goodput_cloud_logging": "RunSettings.goodput_cloud_logging: ...and sends it to Cloud Logging",
    "enable_tensorboard": "RunSettings.tensorboard: the trainer writes TensorBoard event files (elastic.metrics)",
    "metrics_file": "RunSettings.metrics_file: ...and one JSON line per committed step to this file",
    "log_period": "RunSettings.log_period: ...flushing TensorBoard at every step divisible by it",
    "elastic_trainer": "RunSettings.trainer: the elastic command's trainer factory (elastic.cli_support.make_trainer)",
    "elastic_max_local_workers": "RunSettings.max_local_workers: the most worker processes the local launcher "
                                 "may start, checked before any starts (elastic.preflight)",
    "hardware": "RunSettings.platform: the JAX platform the trainer exports the programs for (export_platform)",
    "dcn_pipeline_parallelism": "RunSettings.pipeline_stages: the stages the trainer cuts the loss into; the "
                                "bundled model's marks (elastic.models.TransformerConfig.from_config)",
    "elastic_pipeline_schedule": "RunSettings.pipeline_schedule: the order each stage runs its microbatches in "
                                 "(runtime.pipeline.schedule)",
    "eval_interval": "RunSettings.eval_interval: whether the trainer builds the eval program (elastic.trainer)",
    "eval_steps": "RunSettings.eval_steps: the eval steps per eval, -1 resolved from the eval source's length",
    **{k: "an RL run's algorithm (elastic.rl.reference.RLSettings): the sampler's rollout program and the "
          "trainer's loss" for k in ("rl_prompts_per_microbatch", "rl_samples_per_prompt", "rl_prompt_length",
                                     "rl_max_new_tokens", "rl_temperature", "rl_clip_epsilon", "rl_kl_coef")},
    "rl_sampler_devices": "...and the RL job's sampler mesh: the rollout program's devices (elastic.rl.job)",
    "rl_weights_dtype": "an RL run's weights as they travel and samplers hold them (elastic.rl.job)",
    "rl_off_policy_steps": "...and the RL reference's schedule (elastic.rl.job)",
})

# ControllerOptions fields that no config key sets: the caller's or the launcher's (worker_preload: the
# trainer's data source module; generation: the run directory's client record, elastic.client_record).
NOT_FROM_CONFIG = frozenset({"run_dir", "secret", "worker_preload", "generation"})


@dataclass(frozen=True)
class RunSettings:
    """What the trainer reads from a Config for itself (the controller gets :func:`controller_options`)."""

    steps: int
    seed: int
    microbatches: int          # M, with elastic_microbatches=0 resolved
    devices_per_slice: int
    run_name: str              # empty: the trainer names the run by its start time
    base_output_directory: str
    max_local_workers: int     # 0: derived from this host (elastic.preflight.check_local_capacity)
    compilation_cache_dir: str  # absolute; "": no persistent compilation cache (the reference run's)
    trainer: str               # "module:factory" the elastic command builds the job with; "": the bundled model
    goodput_recording: bool    # write goodput_log.jsonl (ml-goodput-measurement events) at the end of the run
    goodput_cloud_logging: bool  # ... and send them to Cloud Logging
    platform: str              # JAX platform of the programs (cpu, cuda, tpu); "": JAX's choice in this process
    parameters_from: str = ""  # load_parameters_path, absolute (a fresh start's parameters; the reference's too)
    pipeline_stages: int = 1   # dcn_pipeline_parallelism
    pipeline_schedule: str = "1f1b"
    hosts_per_slice: int = 1   # elastic_hosts_per_slice (the reference runs as a slice's hosts do)
    tensorboard: bool = False  # enable_tensorboard
    metrics_file: str = ""     # as given (relative: to the client's directory, as MaxText opens it)
    log_period: int = 100
    eval_interval: int = 0     # held-out loss after every this many steps; 0 or -1: none
    eval_steps: int = -1       # eval steps per eval; -1: the eval source's length


def run_settings(cfg: Config) -> RunSettings:
    """The trainer's own settings of ``cfg``."""
    return RunSettings(steps=cfg.steps, seed=cfg.seed, microbatches=cfg.microbatches,
                       devices_per_slice=cfg.devices_per_slice, run_name=cfg.run_name,
                       base_output_directory=cfg.base_output_directory,
                       max_local_workers=cfg.elastic_max_local_workers,
                       compilation_cache_dir=compilation_cache_dir(cfg), trainer=cfg.elastic_trainer,
                       goodput_recording=cfg.enable_goodput_recording,
                       goodput_cloud_logging=cfg.elastic_goodput_cloud_logging, platform=export_platform(cfg),
                       parameters_from=parameters_path(cfg.load_parameters_path),
                       pipeline_stages=cfg.dcn_pipeline_parallelism, pipeline_schedule=cfg.elastic_pipeline_schedule,
                       hosts_per_slice=cfg.elastic_hosts_per_slice, tensorboard=cfg.enable_tensorboard,
                       metrics_file=cfg.metrics_file, log_period=cfg.log_period,
                       eval_interval=max(cfg.eval_interval, 0), eval_steps=cfg.eval_steps)


#: The config key ``hardware`` (MaxText's names) -> the JAX platform programs are exported for.
PLATFORM_OF_HARDWARE: Mapping[str, str] = MappingProxyType({"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"})


def export_platform(cfg: Config, environ: Mapping[str, str] | None = None) -> str:
    """The JAX platform the programs of ``cfg`` are exported for: ``hardware`` mapped (gpu is ``cuda``).

    ``hardware: ""``: the platform the local launcher's workers get from the
    environment ``environ`` (default ``os.environ``): the first of
    ``JAX_PLATFORMS``, else ``cpu``; ``""`` when ``JAX_PLATFORMS`` is set
    but empty (JAX chooses: the trainer then takes its own JAX's platform,
    as workers on this host would). ``ConfigError`` when ``JAX_PLATFORMS``
    names no platform programs can be exported for.
    """
    if cfg.hardware:
        return PLATFORM_OF_HARDWARE[cfg.hardware]
    environ = os.environ if environ is None else environ
    try:
        return default_worker_platform(environ)
    except ValueError:
        raise ConfigError(f"config key 'hardware' is empty, so the programs are for the workers' platform, which "
                          f"JAX_PLATFORMS={environ['JAX_PLATFORMS']!r} does not name (cpu, cuda, rocm, tpu); set "
                          "hardware to cpu, gpu or tpu") from None


def compilation_cache_dir(cfg: Config) -> str:
    """Where the run's processes share compiled programs: an absolute path, or "" for none.

    ``jax_cache_dir``: "off" for none; "" for ``$JAX_COMPILATION_CACHE_DIR``
    when set (JAX's own variable), else ``<base_output_directory>/jax_cache``
    (so every run writing there, and its reference, compiles a program once);
    any other value is the directory (``~`` expanded).
    """
    value = getattr(cfg, _CACHE_KEY)
    if value == "off":
        return ""
    if not value:
        value = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(cfg.base_output_directory, "jax_cache")
    return str(pathlib.Path(value).expanduser().resolve())   # workers run elsewhere (cwd)


def checkpoint_directory(cfg: Config, run_dir: str | pathlib.Path) -> str:
    """Where the run's persistent checkpoints go: "" without ``enable_checkpointing``; a gs:// URL as is;
    else an absolute path (``<run_dir>/checkpoints`` by default)."""
    if not cfg.enable_checkpointing:
        return ""
    return _absolute(cfg.elastic_checkpoint_directory or os.path.join(str(run_dir), "checkpoints"))


def parameters_path(value: str) -> str:
    """The checkpoint ``load_parameters_path`` (``value``) names, absolute: one checkpoint as given (``<dir>/<step>``,
    MaxText's ``<dir>/<step>/items``, a parameter-only checkpoint holding ``items``); a checkpoint directory (a run's
    ``checkpoints``): its newest complete checkpoint's ``<dir>/<step>`` when the run starts (MaxText's ``<d>``
    holding step ``d + 1`` for one its trainer wrote). What names neither (or a gs:// URL) is returned as given,
    for the preflight (``elastic.preflight.check_load_parameters_path``) to say what is wrong with it."""
    path = _absolute(value)
    if not path or "://" in path or os.path.isdir(os.path.join(path.removesuffix("/items"), "items")):
        return path
    try:
        directory, step = locate_checkpoint(path)
    except BadInputError:
        return path
    for name in (str(step), str(step - 1)):   # jax-elastic's <step>, else MaxText's <step - 1>
        if os.path.isdir(os.path.join(directory, name)):
            return os.path.join(directory, name)
    return path   # (a slice of several hosts keeps <dir>/host<h>-of-<n>/<step>: no parameters by name there)


def _absolute(value: str) -> str:
    """A gs:// URL as is; a local path made absolute ("" stays "")."""
    if not value or value.startswith("gs://"):
        return value
    return str(pathlib.Path(value).expanduser().resolve())   # workers run elsewhere (cwd)


def controller_options(cfg: Config, run_dir: str | pathlib.Path) -> ControllerOptions:
    """The ``ControllerOptions`` of ``cfg`` for a run writing to ``run_dir``.

    ``elastic_enabled=false`` means no recovery: a lost worker fails the run
    as plain SPMD would (no retries, no spares, no relaunch, no shrinking, no
    waiting for capacity, no straggler replacement). The Config has already
    refused recovery keys that contradict it, so this only replaces defaults.
    """
    _check_launcher(cfg)
    _check_pool(cfg)
    opts = ControllerOptions(run_dir=str(run_dir), tls=_tls(cfg), compilation_cache_dir=compilation_cache_dir(cfg),
                             checkpoint_directory=checkpoint_directory(cfg, run_dir),
                             checkpoint_period=cfg.checkpoint_period if cfg.enable_checkpointing else 0,
                             platform=export_platform(cfg), load_full_state_path=_absolute(cfg.load_full_state_path),
                             load_parameters_path=parameters_path(cfg.load_parameters_path),
                             snapshot_directory=cfg.elastic_snapshot_directory or default_snapshot_root(),
                             secret=_secret(cfg), standby_workers=cfg.standby_workers, **_address(cfg),
                             **{option: getattr(cfg, key) for key, option in _TO_CONTROLLER.items()})
    opts = dataclasses.replace(opts, eval_interval=max(cfg.eval_interval, 0),   # MaxText's -1: off
                               launcher="pool" if cfg.elastic_pool else opts.launcher)
    if cfg.dcn_pipeline_parallelism > 1:   # every stage of every replica is a virtual slice; whole replicas shrink
        stages = cfg.dcn_pipeline_parallelism
        opts = dataclasses.replace(opts, slices=cfg.dcn_data_parallelism * stages,
                                   min_slices=min(opts.min_slices, cfg.dcn_data_parallelism) * stages)
    if getattr(cfg, _ENABLED_KEY):
        return opts
    # every key with the recovery role takes its "no recovery" value (elastic.config.no_recovery_values)
    return dataclasses.replace(opts, **{_TO_CONTROLLER.get(key, "standby_workers"): value
                                        for key, value in no_recovery_values(cfg.to_dict()).items()})


# ControllerOptions field -> how a config user says it, for the runtime's reasons (which name only its own
# options: runtime knows nothing of config keys). Folded fields say the keys behind them.
_CONFIG_TERMS: Mapping[str, str] = MappingProxyType({
    **{option: key for key, option in _TO_CONTROLLER.items() if "_" in option},   # plain words stay words
    "max_retries=0": "elastic_max_retries=0, or elastic_enabled=false",
    "standby_workers": _STANDBY_KEY,
    "checkpoint_period": "checkpoint_period (with enable_checkpointing=true)",
    "checkpoint_directory": "elastic_checkpoint_directory",
    "snapshot_directory": "elastic_snapshot_directory",
})
_OPTION_NAME = re.compile(r"(?<![\w.])(" + "|".join(sorted(map(re.escape, _CONFIG_TERMS), key=len, reverse=True))
                          + r")(?![\w])")


def in_config_terms(text: str) -> str:
    """``text`` (a runtime reason or error) with each ``ControllerOptions`` field it names replaced by the
    config key that sets it (``min_slices`` -> ``elastic_min_slice_count``); for printing to a config user.
    The runtime's decisions carry the field as data too (``runtime.control.plan.Plan.limit``); this only rewords."""
    return _OPTION_NAME.sub(lambda m: _CONFIG_TERMS[m.group(1)], text)


def _address(cfg: Config) -> dict:
    """``host`` and ``port`` the controller listens on (``elastic_controller_address``; checked by the Config)."""
    if not cfg.elastic_controller_address:
        return {}
    host, _, port = cfg.elastic_controller_address.rpartition(":")
    return {"host": host.strip("[]"), "port": int(port)}


def _check_launcher(cfg: Config) -> None:
    if cfg.elastic_launcher == "ray" and (why := ray_available()):
        raise ConfigError(f"elastic_launcher=ray: {why}")


def _check_pool(cfg: Config) -> None:
    if cfg.elastic_pool and not os.environ.get(POOL_TOKEN_ENV):
        raise ConfigError(f"elastic_pool={cfg.elastic_pool}: set the pool's client token in ${POOL_TOKEN_ENV} (the "
                          "pool's directory lists its tokens, one name=token a line)")


def _secret(cfg: Config) -> str:
    """The run secret: for workers started by someone else, the one they were given (``$ELASTIC_RUN_SECRET``);
    "" for local workers (the controller makes a fresh one and hands it to the processes it starts)."""
    if cfg.elastic_launcher != "none":
        return ""
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise ConfigError(f"elastic_launcher=none: set the run secret in ${SECRET_ENV} for this client and for "
                          "every worker (workers started by someone else must prove they belong to the run)")
    return secret


def _tls(cfg: Config) -> TlsFiles | None:
    files = [getattr(cfg, k) for k in _TLS_KEYS]
    if not files[0]:
        return None  # the Config allows all three or none
    return TlsFiles(*(str(pathlib.Path(f).resolve()) for f in files))  # workers run elsewhere (cwd)


def _check_every_key_has_a_place() -> None:
    schema = {f.name for f in dataclasses.fields(Config)}
    to_controller = (set(_TO_CONTROLLER) | set(_TLS_KEYS) | {_ENABLED_KEY, _STANDBY_KEY, _CACHE_KEY, _ADDRESS_KEY}
                     | set(_CHECKPOINT_KEYS) | set(_SNAPSHOT_KEYS))
    placed = to_controller | set(READ_ELSEWHERE)
    # The places agree with the roles the schema declares (elastic.config): a key the controller gets steers
    # how the run executes or where it writes; the bundled model's keys are the ones read by the bundled model.
    if stray := sorted(keys_with(RECOVERY) - set(_TO_CONTROLLER) - {_STANDBY_KEY}):
        raise ImportError(f"elastic.options cannot turn recovery off for {stray}: not copied to the controller")
    if stray := sorted(to_controller - keys_with(RUNTIME) - keys_with(OUTPUT)):
        raise ImportError(f"elastic.options gives the controller keys without the runtime or output role: {stray}")
    bundled = {k for k, who in READ_ELSEWHERE.items() if who.startswith("the bundled model")}
    if bundled != MODEL_KEYS:
        raise ImportError(f"elastic.options reads {sorted(bundled)} in the bundled model, the schema's model role "
                          f"is {sorted(MODEL_KEYS)}")
    if set(PLATFORM_OF_HARDWARE) != set(HARDWARE):
        raise ImportError(f"elastic.options maps hardware {sorted(PLATFORM_OF_HARDWARE)}, the Config allows "
                          f"{sorted(HARDWARE)}")
    if placed != schema:
        raise ImportError(f"elastic.options and the Config schema disagree: keys without a place here: "
                          f"{sorted(schema - placed)}; keys here that are not in the schema: "
                          f"{sorted(placed - schema)}")


_check_every_key_has_a_place()
