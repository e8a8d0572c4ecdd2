"""One MaxText config file, two validated configs: jax-elastic's and MaxText's.

Contract:

* :func:`load_maxtext_config` reads a MaxText YAML file (``base_config:``
  chain, ``model_name=`` model files) and ``key=value`` overrides, the way
  MaxText's own trainer does, and returns ``(elastic.Config, MaxText config)``.
  MaxText validates its part with its own code (``maxtext.configs.pyconfig``).
* Every key the user sets is one of: a MaxText key, a jax-elastic key that
  MaxText does not define (``elastic_microbatches``, ``elastic_spares``,
  ``seed``...), or a key both define (:data:`SHARED_KEYS`, :data:`MODEL_KEYS`).
  Anything else raises :class:`elastic.ConfigError` naming the key and where it
  was set. Keys of both kinds may sit in one file.
* The user's files and overrides are read, without importing MaxText or JAX, by
  :mod:`integrations.maxtext.config_files` (which also says whether a file is a
  MaxText config at all: its ``claims``); this module translates their keys.
* MaxText is built for ONE virtual slice: ``num_slices=1``,
  ``dcn_data_parallelism=1``, ``ici_fsdp_parallelism`` = devices per slice,
  ``gradient_accumulation_steps=1``. The slices, the microbatches and the
  recovery keys go to jax-elastic (see :data:`SHARED_KEYS`).
* Called by the client, once, before it builds the job. MaxText's config code
  starts JAX's backend (it counts devices), so set ``XLA_FLAGS`` first.
  MaxText's ``M_<KEY>`` override variables are refused (jax-elastic would not
  see them), and ``XLA_FLAGS`` is left as it was (MaxText's config would set it
  to dump HLO).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import pathlib
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

import elastic
from elastic.config import MAXTEXT, MODEL, keys_with
from integrations.maxtext.config_files import check_chain_ends, parse_overrides, read_chain
from integrations.maxtext.pipeline import pipeline_keys

__all__ = ["MAXTEXT_VERSION", "MODEL_KEYS", "RESILIENCE_KEYS", "SHARED_KEYS", "UNSUPPORTED", "check_supported",
           "load_maxtext_config"]

MAXTEXT_VERSION = "0.2.5"

# Keys both configs define that size or train the model: they are MaxText's. jax-elastic's own
# copies shape only its bundled example model, so they keep their defaults there. Derived from the roles
# jax-elastic's schema declares (elastic.config: model and maxtext).
MODEL_KEYS = keys_with(MODEL) & keys_with(MAXTEXT)

# Keys both configs define that steer the run: what each side gets. Exactly the schema's other keys with the
# maxtext role (checked below at import; a test checks the role against MaxText's own schema, so a new
# shared key gets a decision).
SHARED_KEYS: Mapping[str, str] = {
    "steps": "both (MaxText's value; -1 resolved by MaxText from learning_rate_schedule_steps)",
    "per_device_batch_size": "both; must be a whole number >= 1 (examples per device per microbatch)",
    "run_name": "both",
    "base_output_directory": "both (default: jax-elastic's, 'runs')",
    "dcn_data_parallelism": "jax-elastic: virtual slices (-1, MaxText's 'auto', is 1); MaxText: 1",
    "dcn_pipeline_parallelism": "jax-elastic: pipeline stages S, MaxText's decoder cut into S stage programs "
                                "(integrations.maxtext.pipeline; S x dcn_data_parallelism virtual slices); "
                                "MaxText: 1 (and scan_layers=false: the stages are cut between layers)",
    "ici_fsdp_parallelism": "both: devices per slice (-1, MaxText's 'all devices', is 1)",
    "elastic_enabled": "jax-elastic's recovery; MaxText keeps its default (false: its elasticity needs Pathways)",
    "elastic_min_slice_count": "jax-elastic (-1, MaxText's 'all slices', is dcn_data_parallelism); MaxText: default",
    "elastic_timeout_seconds": "jax-elastic; MaxText: default",
    "elastic_max_retries": "jax-elastic; MaxText: default",
    "elastic_backup_kind": "jax-elastic: the backup while no spare shadows the state (snapshot: in-memory snapshots "
                           "every elastic_snapshot_interval steps; checkpoint: the persistent checkpoint only); "
                           "MaxText: default",
    "jax_cache_dir": "jax-elastic's compilation cache; MaxText: '' (it would set the cache process-wide)",
    "enable_goodput_recording": "jax-elastic's goodput events; MaxText: false (its trainer loop does not run)",
    "enable_checkpointing": "jax-elastic's persistent checkpoints, in MaxText's layout (unset: MaxText's default, "
                            "true); MaxText: false (its trainer loop does not run)",
    "checkpoint_period": "jax-elastic (steps between persistent checkpoints; unset: MaxText's default, 10000); "
                         "MaxText: its default",
    "load_full_state_path": "jax-elastic: the run starts from that checkpoint, jax-elastic's or MaxText's "
                            "(<dir>/<step>/items, <dir>/<step> or <dir>); MaxText: its default ''",
    "load_parameters_path": "jax-elastic: a fresh start takes its parameters from that checkpoint (a full one's "
                            "or MaxText's parameter-only <dir>/items), optimizer and step from the seed; "
                            "MaxText: its default ''",
    "enable_tensorboard": "jax-elastic: the client writes TensorBoard event files in MaxText's place from committed "
                          "steps (unset: MaxText's default, true); MaxText: its default",
    "metrics_file": "jax-elastic: the client appends MaxText's JSON line per committed step; MaxText: its default",
    "log_period": "jax-elastic: TensorBoard is flushed every log_period steps, as MaxText does; MaxText: its default",
    "hardware": "both, the user's value: jax-elastic exports its programs for it, MaxText checks its options "
                "against it (unset: jax-elastic's '', MaxText's 'tpu'); gpu_multiprocess is refused",
    "eval_interval": "jax-elastic: the live slices compute the held-out loss of MaxText's eval data after every "
                     "eval_interval steps (-1, MaxText's default: none); MaxText: its default",
    "eval_steps": "jax-elastic: eval steps per eval (-1, MaxText's default: the whole eval data); MaxText: its "
                  "default",
}

# Shared keys that steer only jax-elastic's runtime: the user's value goes to jax-elastic (its default when
# unset, not MaxText's, but for _MAXTEXT_DEFAULTS); MaxText gets the value here, or its own default where there is
# none.
_RUNTIME_KEYS = ("elastic_enabled", "elastic_min_slice_count", "elastic_timeout_seconds", "elastic_max_retries",
                 "elastic_backup_kind", "jax_cache_dir", "enable_goodput_recording", "enable_checkpointing",
                 "checkpoint_period", "load_full_state_path", "load_parameters_path", "enable_tensorboard",
                 "metrics_file", "log_period", "eval_interval", "eval_steps")
_MAXTEXT_GETS = {"jax_cache_dir": "", "enable_goodput_recording": False, "enable_checkpointing": False}
# Runtime keys whose unset value is MaxText's default, not jax-elastic's: a MaxText run checkpoints and writes
# TensorBoard unless told not.
_MAXTEXT_DEFAULTS = ("enable_checkpointing", "checkpoint_period", "enable_tensorboard", "log_period", "eval_interval",
                     "eval_steps")
if set(SHARED_KEYS) != keys_with(MAXTEXT) - MODEL_KEYS or not set(_RUNTIME_KEYS) <= set(SHARED_KEYS):
    raise ImportError(f"integrations.maxtext: SHARED_KEYS {sorted(SHARED_KEYS)} and the schema's maxtext role "
                      f"{sorted(keys_with(MAXTEXT) - MODEL_KEYS)} disagree")

# MaxText features whose train step differs from the one integrations.maxtext.model splits, or that
# need more than a 1-D FSDP mesh per slice: key -> the only value accepted.
UNSUPPORTED: Mapping[str, Any] = {
    "enable_diloco": False,
    "parameter_memory_host_offload": False,
    "optimizer_memory_host_offload": False,
    "shard_optimizer_over_data": False,
    "skip_step_on_spikes": False,
    "use_qk_clip": False,
    "use_multimodal": False,
    "use_audio": False,
    "te_moe_block": False,
    "use_tunix_gradient_accumulation": False,
    "training_objective": "causal_lm",
    "shard_mode": "auto",
    "routed_bias_update_rate": 0.0,
    "moe_dropless_fallback": None,
    "quantization": "",
}

# MaxText's own resilience keys, which jax-elastic carries out with its tiers (MaxText's trainer does not run,
# so it gets their defaults): key -> what jax-elastic does with it (docs/maxtext.md, "MaxText's resilience keys").
RESILIENCE_KEYS: Mapping[str, str] = {
    "enable_emergency_checkpoint": "in-memory snapshots every local_checkpoint_period steps, kept in "
                                   "local_checkpoint_directory on each worker's host with a copy on a peer host "
                                   "(elastic_snapshot_interval, elastic_snapshot_directory); the persistent tier "
                                   "is enable_checkpointing / checkpoint_period, as in MaxText",
    "enable_multi_tier_checkpointing": "the same local tier, and persistent checkpoints every "
                                       "multi_tier_checkpointing_backup_interval_steps steps (enable_checkpointing, "
                                       "checkpoint_period)",
    "local_checkpoint_directory": "where each host keeps its snapshots (an absolute path)",
    "local_checkpoint_period": "steps between snapshots (> 0 with either key above)",
    "multi_tier_checkpointing_backup_interval_steps": "steps between persistent checkpoints (multi-tier)",
    "multi_tier_checkpointing_backup_interval_minutes": "refused: jax-elastic schedules checkpoints by steps",
    "enable_single_replica_ckpt_restoring": "accepted, nothing to do: a restore always has one reader per "
                                            "checkpoint and copies the state to the other replicas peer to peer",
}

# MaxText's (MaxText-only) parallelism keys: a jax-elastic slice is a 1-D FSDP mesh.
_MESH_PREFIXES = ("ici_", "dcn_")
# The parallelism keys jax-elastic takes: slices, pipeline stages, devices per slice.
_SLICE_KEYS = ("dcn_data_parallelism", "dcn_pipeline_parallelism", "ici_fsdp_parallelism")


def load_maxtext_config(path: str | os.PathLike, overrides: Iterable[str] = ()) -> tuple[elastic.Config, Any]:
    """``(elastic_config, maxtext_config)`` from a MaxText YAML file and ``key=value`` overrides.

    ``maxtext_config`` is MaxText's own ``HyperParameters``, validated by
    MaxText and built for one virtual slice. Raises :class:`elastic.ConfigError`
    naming the key for an unknown key, a value either side refuses, two keys
    that contradict, or a MaxText feature jax-elastic cannot split yet.
    """
    from maxtext.configs import pyconfig, types  # heavy (imports jax, transformers): only when asked

    path = pathlib.Path(path)
    if not path.is_file():
        raise elastic.ConfigError(f"MaxText config file not found: {path}")
    items = parse_overrides(overrides)
    elastic_keys = {f.name for f in dataclasses.fields(elastic.Config)}
    verbatim = {f.name for f in dataclasses.fields(elastic.Config) if f.type == "str"}   # as elastic reads them
    chain = read_chain(path)
    user = {**chain.keys,
            **{k: (text if k in verbatim else v, "overrides") for k, (v, text) in items.items()}}
    maxtext_keys = _maxtext_keys(types.MaxTextConfig)
    _refuse_unknown(user, elastic_keys, maxtext_keys)
    check_chain_ends(chain)
    _refuse_environment(maxtext_keys)
    _refuse_mesh(user)

    def user_value(key, default):
        return user[key][0] if key in user else default

    slices = _positive_or_one(user_value("dcn_data_parallelism", -1))
    devices = _positive_or_one(user_value("ici_fsdp_parallelism", -1))
    stages = _positive_or_one(user_value("dcn_pipeline_parallelism", -1))
    pipelined = pipeline_keys(user, stages, slices, path)
    seed = _seed(user)
    output = user_value("base_output_directory", "") or _elastic_default("base_output_directory")
    elastic_only = {k for k in user if k in elastic_keys and k not in maxtext_keys}
    forced = {"dcn_data_parallelism": 1, "num_slices": 1, "ici_fsdp_parallelism": devices,
              "internal_compile": True, "internal_compile_num_devices": devices,  # MaxText counts a slice's devices
              "gradient_accumulation_steps": 1, "skip_jax_distributed_system": True,
              "init_weights_seed": seed, "base_output_directory": output,
              "log_config": bool(user_value("log_config", False)), **_MAXTEXT_GETS, **pipelined.maxtext}
    # MaxText gets these values, its own defaults for the runtime keys, and none of jax-elastic's own keys.
    hidden = elastic_only | set(forced) | set(_RUNTIME_KEYS) | set(RESILIENCE_KEYS)
    cli = [f"{k}={text}" for k, (_, text) in items.items() if k not in hidden]
    cli += [f"{k}={_cli_text(v)}" for k, v in forced.items()]
    mt = _maxtext_validate(pyconfig, path, hidden, cli)
    check_supported(mt, user)

    values = {k: user[k][0] for k in elastic_only}
    values.update(seed=seed, base_output_directory=output, dcn_data_parallelism=slices,
                  ici_fsdp_parallelism=devices, steps=int(mt.steps),
                  per_device_batch_size=_whole(mt.per_device_batch_size, "per_device_batch_size", user),
                  dcn_pipeline_parallelism=stages)
    if "run_name" in user:
        values["run_name"] = str(user["run_name"][0])
    if "hardware" in user:
        values["hardware"] = str(user["hardware"][0])
    for key in _RUNTIME_KEYS:
        if key in user and key in elastic_keys:
            values[key] = user[key][0]
        elif key in _MAXTEXT_DEFAULTS:
            values[key] = types.MaxTextConfig.model_fields[key].default
    if values.get("elastic_min_slice_count") == -1:   # MaxText's "every slice"
        values["elastic_min_slice_count"] = slices
    values["elastic_microbatches"] = pipelined.microbatches or _microbatches(user, slices)
    values.update(_resilience(user))
    for key in (set(user) & elastic_keys & maxtext_keys) - MODEL_KEYS - set(SHARED_KEYS):
        values[key] = user[key][0]   # a shared key not classified yet: both see the user's value
    try:
        cfg = elastic.Config(**values)
    except elastic.ConfigError as e:
        raise elastic.ConfigError(f"{e} (MaxText config {path})") from None
    return cfg, mt


# --------------------------------------------------------------------------- keys


def _maxtext_keys(model) -> set[str]:
    """Every key MaxText's pydantic config accepts, nested models' fields included (as its loader does)."""
    keys = set()
    for name, info in model.model_fields.items():
        keys.add(name)
        annotation = getattr(info, "annotation", None)
        if hasattr(annotation, "model_fields"):
            keys |= _maxtext_keys(annotation)
    return keys


def _elastic_default(key: str) -> Any:
    return {f.name: f.default for f in dataclasses.fields(elastic.Config)}[key]


def _cli_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# --------------------------------------------------------------------------- checks


def _refuse_unknown(user, elastic_keys, maxtext_keys) -> None:
    for key, (_, source) in user.items():
        if key not in elastic_keys and key not in maxtext_keys:
            close = difflib.get_close_matches(key, elastic_keys | maxtext_keys, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise elastic.ConfigError(f"unknown config key {key!r} (in {source}): neither MaxText "
                                      f"{MAXTEXT_VERSION} nor jax-elastic defines it{hint}")


#: Keys only MaxText's RL trainer reads (configs/post_train/rl.yml): its config is recognised by them.
_MAXTEXT_RL_KEYS = ("rl", "trainer_devices_fraction", "sampler_devices_fraction", "num_samplers_slices",
                    "rollout_data_parallelism")


def _refuse_maxtext_rl(merged, path: pathlib.Path) -> None:
    """MaxText's own RL config (``maxtext.trainers.post_train.rl.train_rl``; ``merged``: the keys of its whole
    chain) is refused in one line naming what it needs and what runs RL here instead."""
    found = [k for k in _MAXTEXT_RL_KEYS if k in merged]
    if found:
        raise elastic.ConfigError(
            f"{path.name} is MaxText's RL config ({', '.join(found)}): its trainer "
            "(maxtext.trainers.post_train.rl.train_rl) samples with Tunix and vLLM on Pathways, which jax-elastic does "
            "not run; RL post-training here is jax-elastic's own (rl_samplers > 0 on the bundled policy, e.g. "
            "`elastic run rl_tiny`; docs/rl.md)")


def _refuse_environment(maxtext_keys) -> None:
    """MaxText reads ``M_<KEY>`` variables; jax-elastic would not see them (its half of the key would differ)."""
    for key in sorted(maxtext_keys):
        var = "M_" + key.upper()
        if var in os.environ:
            raise elastic.ConfigError(f"environment variable {var} would override MaxText's {key!r} behind "
                                      f"jax-elastic's back; unset it and pass {key}=... as an override")


def _refuse_mesh(user) -> None:
    for key, (value, source) in user.items():
        if not key.startswith(_MESH_PREFIXES) or key in _SLICE_KEYS:
            continue
        if key.endswith("_parallelism") and value != 1:
            raise elastic.ConfigError(
                f"config key {key!r} ({value!r}, in {source}) is not supported under jax-elastic yet: a virtual "
                "slice is a 1-D FSDP mesh (ici_fsdp_parallelism devices) and slices are data parallel "
                "(dcn_data_parallelism); set it to 1")
    for key in _SLICE_KEYS:
        if key in user and (not isinstance(user[key][0], int) or isinstance(user[key][0], bool)
                            or (user[key][0] < 1 and user[key][0] != -1)):
            raise elastic.ConfigError(f"config key {key!r} must be a whole number >= 1 (or -1 for 1), got "
                                      f"{user[key][0]!r} (in {user[key][1]})")
    if "num_slices" in user and user["num_slices"][0] not in (-1, _positive_or_one(
            user.get("dcn_data_parallelism", (-1, ""))[0])):
        raise elastic.ConfigError(
            f"config key 'num_slices' ({user['num_slices'][0]!r}, in {user['num_slices'][1]}) contradicts "
            "'dcn_data_parallelism': under jax-elastic the slice count is dcn_data_parallelism (virtual slices); "
            "drop num_slices")


def _resilience(user: Mapping[str, tuple[Any, str]]) -> dict[str, Any]:
    """jax-elastic's values for MaxText's resilience keys the user set (:data:`RESILIENCE_KEYS`), checked with
    MaxText's own rules; a ConfigError naming the key otherwise."""
    def get(key, default=None):
        return user[key][0] if key in user else default

    def where(key):
        return f"{key}={user[key][0]!r} (in {user[key][1]})"

    emergency, multi = bool(get("enable_emergency_checkpoint", False)), bool(get("enable_multi_tier_checkpointing",
                                                                                 False))
    out: dict[str, Any] = {}
    if get("multi_tier_checkpointing_backup_interval_minutes") is not None:
        raise elastic.ConfigError(f"config key {where('multi_tier_checkpointing_backup_interval_minutes')}: "
                                  "jax-elastic schedules checkpoints by steps; set "
                                  "multi_tier_checkpointing_backup_interval_steps instead")
    local = [k for k in ("local_checkpoint_directory", "local_checkpoint_period") if get(k)]
    if not (emergency or multi):
        if local:
            raise elastic.ConfigError(f"config key {where(local[0])} has no effect without "
                                      "enable_emergency_checkpoint=true or enable_multi_tier_checkpointing=true")
        return out
    on = "enable_emergency_checkpoint" if emergency else "enable_multi_tier_checkpointing"
    period, directory = get("local_checkpoint_period", 0), get("local_checkpoint_directory", "")
    if not isinstance(period, int) or isinstance(period, bool) or period <= 0:
        raise elastic.ConfigError(f"config key 'local_checkpoint_period' must be a whole number > 0 with {on}=true "
                                  f"(MaxText's rule), got {period!r}")
    if not directory or not str(directory).startswith("/"):
        raise elastic.ConfigError(f"config key 'local_checkpoint_directory' must be an absolute path on every "
                                  f"worker's host with {on}=true, got {directory!r}")
    for key, want in (("elastic_snapshot_interval", period), ("elastic_snapshot_directory", str(directory))):
        if key in user and user[key][0] != want:
            raise elastic.ConfigError(f"config keys {where(key)} and {on}=true contradict: MaxText's "
                                      f"local_checkpoint_* keys set {key}; drop one")
    out.update(elastic_snapshot_interval=period, elastic_snapshot_directory=str(directory))
    if multi:
        backup = get("multi_tier_checkpointing_backup_interval_steps")
        if not isinstance(backup, int) or isinstance(backup, bool) or backup <= 0:
            raise elastic.ConfigError("config key 'multi_tier_checkpointing_backup_interval_steps' must be a whole "
                                      f"number > 0 with enable_multi_tier_checkpointing=true, got {backup!r}")
        if "checkpoint_period" in user and user["checkpoint_period"][0] != backup:
            raise elastic.ConfigError(f"config keys {where('checkpoint_period')} and "
                                      f"{where('multi_tier_checkpointing_backup_interval_steps')} contradict: the "
                                      "backup interval is the persistent checkpoints' period; drop one")
        if get("enable_checkpointing") is False and user["enable_checkpointing"][1] == "overrides":
            raise elastic.ConfigError(f"config keys {where('enable_checkpointing')} and "
                                      "enable_multi_tier_checkpointing=true contradict: its backups are persistent "
                                      "checkpoints")
        out.update(enable_checkpointing=True, checkpoint_period=backup)
    return out


def check_supported(mt, user: Mapping[str, tuple[Any, str]] | None = None) -> None:
    """ConfigError naming the first MaxText feature (:data:`UNSUPPORTED`) the split train step does not do."""
    user = user or {}
    for key, want in UNSUPPORTED.items():
        got = getattr(mt, key, want)
        got = getattr(got, "value", got)   # enums
        if got != want and not (want in (None, "") and got in (None, "None", "none", "")):
            where = f", in {user[key][1]}" if key in user else ""
            raise elastic.ConfigError(f"config key {key!r} ({got!r}{where}) is not supported under jax-elastic "
                                      f"yet; only {want!r} is (see docs/maxtext.md, 'Not supported yet')")
    lora = getattr(mt, "lora", None)
    if getattr(lora, "enable_lora", False):
        raise elastic.ConfigError("config key 'enable_lora' (true) is not supported under jax-elastic yet")


def _seed(user) -> int:
    """jax-elastic's ``seed`` is MaxText's ``init_weights_seed`` (the init program's key)."""
    seed, init = user.get("seed"), user.get("init_weights_seed")
    if seed and init and seed[0] != init[0]:
        raise elastic.ConfigError(f"config keys 'seed' ({seed[0]!r}, in {seed[1]}) and 'init_weights_seed' "
                                  f"({init[0]!r}, in {init[1]}) contradict: both seed the parameters; set one")
    chosen = seed or init
    value = chosen[0] if chosen else 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise elastic.ConfigError(f"config key {'seed' if seed else 'init_weights_seed'!r} must be a whole number "
                                  f">= 0, got {value!r}")
    return value


def _microbatches(user, slices: int) -> int:
    """``elastic_microbatches``: as set, else slices x gradient_accumulation_steps (a MaxText run on that many
    slices with that many accumulation steps has the same global batch)."""
    accum = user.get("gradient_accumulation_steps")
    m = user.get("elastic_microbatches")
    if accum is None:
        return m[0] if m else 0
    steps = accum[0]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise elastic.ConfigError(f"config key 'gradient_accumulation_steps' must be a whole number >= 1, got "
                                  f"{steps!r} (in {accum[1]})")
    want = slices * steps
    if m and m[0] != want:
        raise elastic.ConfigError(
            f"config keys 'elastic_microbatches' ({m[0]!r}, in {m[1]}) and 'gradient_accumulation_steps' "
            f"({steps!r}, in {accum[1]}) contradict: with {slices} slice(s) the global batch is "
            f"{want} microbatches; set only one of them")
    if want & (want - 1):
        raise elastic.ConfigError(
            f"config key 'gradient_accumulation_steps' ({steps!r}, in {accum[1]}) times dcn_data_parallelism "
            f"({slices}) is {want} microbatches, not a power of two; set elastic_microbatches instead")
    return want


def _positive_or_one(value: Any) -> int:
    return value if isinstance(value, int) and value >= 1 else 1


def _whole(value: Any, key: str, user) -> int:
    if float(value) < 1 or not float(value).is_integer():
        where = f" (in {user[key][1]})" if key in user else ""
        raise elastic.ConfigError(f"config key {key!r} must be a whole number >= 1 under jax-elastic (each device "
                                  f"trains on whole examples), got {value!r}{where}")
    return int(value)


# --------------------------------------------------------------------------- MaxText


def _maxtext_validate(pyconfig, path: pathlib.Path, hidden: set[str], cli: list[str]):
    """MaxText's own loader on the chain of ``path`` without the ``hidden`` keys, then ``cli`` overrides."""
    merged = pyconfig._load_config(str(path))   # MaxText's base_config resolution, unchanged
    _refuse_maxtext_rl(merged, path)
    for key in hidden | {"base_config"}:
        if key in merged:
            del merged[key]
    from omegaconf import OmegaConf

    with tempfile.TemporaryDirectory(prefix="maxtext-config-") as tmp, _xla_flags_kept():
        # Two levels down, so MaxText's model-file lookup (next to the file, then one level up) stays in here
        # and finds its own bundled models/<model_name>.yml.
        file = pathlib.Path(tmp, "a", "b", "config.yml")
        file.parent.mkdir(parents=True)
        OmegaConf.save(merged, file)
        try:
            pydantic_config = pyconfig._initialize_pydantic(["", str(file), *cli])
            return pyconfig.HyperParameters(pydantic_config)
        except Exception as e:  # noqa: BLE001 - MaxText's validation raises ValueError, pydantic errors, asserts
            raise elastic.ConfigError(f"MaxText {MAXTEXT_VERSION} rejected the config {path}: "
                                      f"{_one_line(e)}") from e


@contextlib.contextmanager
def _xla_flags_kept():
    """MaxText's config sets ``XLA_FLAGS`` (to dump HLO) when it is unset; workers would inherit that."""
    before = os.environ.get("XLA_FLAGS")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = before


def _one_line(e: Exception) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):   # pydantic.ValidationError: name the key
        try:
            first = errors()[0]
            where = ".".join(map(str, first["loc"]))
            return f"config key {where!r}: {first['msg']}" if where else str(first["msg"])
        except Exception:  # noqa: BLE001 - fall back to the message
            pass
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:500]}"
