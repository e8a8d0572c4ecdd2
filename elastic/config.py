"""MaxText-style configuration: flat YAML keys, ``base_config`` inheritance, overrides.

Contract:

* A config file is a YAML mapping of flat ``key: value`` pairs. ``base_config:
  other.yml`` (a path relative to the file that names it; where no such file
  is, a bundled config's name, ``base``, ``tiny``, ``base.yml``...) is loaded
  first and the file overrides it; chains are allowed, a cycle is an error.
* ``key=value`` overrides (the command line) are applied last. A value is read as a
  YAML scalar and then checked against the type of its key, so ``steps=30`` is an
  int and ``learning_rate=1e-3`` is a float.
* The result is a frozen, validated :class:`Config`. Every problem (missing file,
  bad YAML, unknown key, wrong type, out-of-range or contradictory values) raises
  :class:`ConfigError` with a one-line message naming the key, and the file or
  ``overrides`` it came from. Nothing is read from the environment.
* The launcher calls :func:`load_config` once; anything that receives
  ``Config.to_dict()`` rebuilds the same config with :func:`config_from_dict`.
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
import operator
import pathlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

from runtime import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MAX_STEPS_AHEAD, MIN_CHUNK_BYTES, checkpoint_directory_problem

__all__ = [
    "HARDWARE",
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
    "builtin_config_path",
    "config_from_dict",
    "keys_with",
    "no_recovery_values",
    "load_config",
    "parse_overrides",
    "yaml_problem",
    "read_config_file",
]

_FACTORY = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")
_CONFIG_DIR = pathlib.Path(__file__).resolve().parent / "configs"


class ConfigError(ValueError):
    """A config file, dict or override is invalid; the message names the key and source."""


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
# bounds (runtime.collective), so the config refuses them first, naming the key.

_COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le}


@dataclass(frozen=True)
class Config:
    """Validated run configuration. Construct with :func:`load_config`; change with
    :meth:`replace` (which validates again)."""

    run_name: str = _key("", role=(OUTPUT, MAXTEXT))  # empty: the launcher fills it in
    base_output_directory: str = _key("runs", role=(OUTPUT, MAXTEXT))
    seed: int = _key(0, role=(MATH,))
    steps: int = _key(20, role=(MATH, MAXTEXT), ge=1)
    per_device_batch_size: int = _key(2, role=(MATH, MAXTEXT), ge=1)  # examples per device per microbatch
    dcn_data_parallelism: int = _key(1, role=(RUNTIME, MAXTEXT), ge=1)  # virtual slices
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
    elastic_goodput_cloud_logging: bool = _key(False, role=(OUTPUT,))
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
    # HOST:PORT the controller listens on; "": 127.0.0.1, any free port (the local launcher tells its workers).
    elastic_controller_address: str = _key("", role=(RUNTIME,))
    # The run's id, which every worker names when it joins; "": a fresh random one (the local launcher tells its
    # workers). Letters, digits, '.', '_', '-'.
    elastic_run_id: str = _key("", role=(RUNTIME,))

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name)))
        _validate(self.to_dict(), {})

    @property
    def microbatches(self) -> int:
        """Microbatches per step M (``elastic_microbatches`` with 0 resolved)."""
        return self.elastic_microbatches or _next_power_of_two(self.dcn_data_parallelism)

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
            _field(key, "replace()")
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


#: Values of the key ``hardware`` besides "" (MaxText's names; elastic.options maps them to JAX's platforms).
HARDWARE = ("cpu", "gpu", "tpu")

_FIELDS = {f.name: f for f in fields(Config)}


def load_config(path: str | pathlib.Path, overrides: Iterable[str] = ()) -> Config:
    """Load ``path`` (a YAML file, or the name of a builtin config such as ``"tiny"``
    when no such file exists), its ``base_config`` chain, then ``overrides``."""
    entries: dict[str, tuple[Any, str]] = {}
    for source, layer in _read_chain(_locate(path)):
        for key, value in layer.items():
            entries[key] = (_coerce(key, value, source), source)
    for key, value in parse_overrides(overrides).items():
        entries[key] = (value, "overrides")
    return _build(entries)


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Parse ``key=value`` strings into ``{key: typed value}``; later items win.

    Values of string keys are taken verbatim (so ``run_name=007`` stays ``"007"``);
    other values are read as YAML scalars and checked against the key's type.
    """
    if isinstance(items, (str, bytes)):
        raise ConfigError(f"overrides must be a list of 'key=value' strings, got the string {items!r}")
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = str(item).partition("=")
        key, text = key.strip(), text.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        if _field(key, "overrides").type == "str":
            out[key] = text
            continue
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not a YAML scalar") from e
        except ValueError as e:   # PyYAML's constructors: a date that cannot be (2001-02-30)
            raise ConfigError(f"override {item!r}: value is not a valid YAML scalar ({e})") from None
        except RecursionError:
            raise ConfigError(f"override {item!r}: value is not a YAML scalar (nested too deeply)") from None
        out[key] = _coerce(key, value, "overrides")
    return out


def config_from_dict(d: Mapping[str, Any], source: str = "<dict>") -> Config:
    """Build a Config from flat ``{key: value}``; ``source`` names ``d`` in errors."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: expected a mapping of config keys, got {type(d).__name__}")
    return _build({str(k): (v, source) for k, v in d.items()})


def builtin_config_path(name: str) -> pathlib.Path:
    """Path of the config shipped as ``elastic/configs/<name>.yml``."""
    path = _CONFIG_DIR / (name if name.endswith(".yml") else f"{name}.yml")
    if "/" in name or not path.is_file():
        known = ", ".join(sorted(p.stem for p in _CONFIG_DIR.glob("*.yml")))
        raise ConfigError(f"no builtin config {name!r}; builtin configs: {known}")
    return path


# --------------------------------------------------------------------------- private


def _build(entries: Mapping[str, tuple[Any, str]]) -> Config:
    values = {k: _coerce(k, v, src) for k, (v, src) in entries.items()}
    _validate({**_DEFAULTS, **values}, {k: src for k, (_, src) in entries.items()})
    return Config(**values)


def _field(key: str, source: str) -> dataclasses.Field:
    if key in _FIELDS:
        return _FIELDS[key]
    if key == "base_config":
        raise ConfigError(f"config key 'base_config' (in {source}) is only allowed at the top of a YAML file")
    close = difflib.get_close_matches(key, _FIELDS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"unknown config key {key!r} (in {source}){hint}")


def _coerce(key: str, value: Any, source: str = "") -> Any:
    """``value`` converted to the type of ``key``, or ConfigError."""
    kind = _field(key, source or "<Config>").type  # a string: annotations are postponed

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
    """Range and cross-key checks over a complete set of coerced values."""

    def at(key: str) -> str:
        return f"{key!r} ({values[key]!r}{', in ' + sources[key] if key in sources else ''})"

    problem = _run_name_problem(values["run_name"])
    if problem:
        raise ConfigError(f"config key {at('run_name')} {problem}; a run name is a directory inside "
                          "base_output_directory (e.g. 'exp1', or 'sweep/lr3' to nest)")
    trainer = values["elastic_trainer"]
    if trainer and not _FACTORY.fullmatch(trainer):
        raise ConfigError(f"config key {at('elastic_trainer')} must name a factory as 'module:function' "
                          "(e.g. 'mypkg.train:make_job', with make_job(config) -> elastic.Trainer or elastic.wrap "
                          "job), or be empty for the bundled model")
    hardware = values["hardware"]
    if hardware and hardware not in HARDWARE:
        why = ("; MaxText's gpu_multiprocess (one JAX process per GPU, joined by jax.distributed) is not how "
               "jax-elastic runs: a slice is one worker process owning its GPUs, so use gpu"
               if hardware == "gpu_multiprocess" else "")
        raise ConfigError(f"config key {at('hardware')} must be cpu, gpu or tpu, or empty for the platform the "
                          f"workers get from the environment{why}")
    for name, f in _FIELDS.items():
        value = values[name]
        bounds = [(op, f.metadata[k]) for op, k in ((">=", "ge"), (">", "gt"), ("<=", "le"))
                  if f.metadata[k] is not None]
        if not all(_COMPARE[op](value, limit) for op, limit in bounds):
            limits = " and ".join(f"{op} {limit}{f.metadata['unit']}" for op, limit in bounds)
            where = f" (in {sources[name]})" if name in sources else ""
            raise ConfigError(f"config key {name!r} must be {limits}, got {value!r}{where}")
        if f.metadata["choices"] and value not in f.metadata["choices"]:
            where = f" (in {sources[name]})" if name in sources else ""
            raise ConfigError(f"config key {name!r} must be one of {', '.join(f.metadata['choices'])}, "
                              f"got {value!r}{where}")
    if values["base_emb_dim"] % values["base_num_query_heads"]:
        raise ConfigError(
            f"config keys {at('base_emb_dim')} and {at('base_num_query_heads')} contradict: "
            "base_emb_dim must be divisible by base_num_query_heads"
        )
    m, slices = values["elastic_microbatches"], values["dcn_data_parallelism"]
    if m and m & (m - 1):
        raise ConfigError(f"config key {at('elastic_microbatches')} must be a power of two (or 0 for auto)")
    if m and m < slices:
        raise ConfigError(
            f"config key {at('elastic_microbatches')} must be >= {at('dcn_data_parallelism')}: "
            "every slice needs at least one microbatch per step"
        )
    for key in ("elastic_checkpoint_directory", "load_full_state_path"):
        if values[key] and (problem := checkpoint_directory_problem(values[key])):
            raise ConfigError(f"config key {at(key)} {problem}")
    if values["elastic_controller_address"] and (problem := _address_problem(values["elastic_controller_address"])):
        raise ConfigError(f"config key {at('elastic_controller_address')} {problem}")
    if values["elastic_run_id"] and not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", values["elastic_run_id"]):
        raise ConfigError(f"config key {at('elastic_run_id')} must be 1 to 64 letters, digits, '.', '_' or '-'")
    if values["ray_address"] and values["elastic_launcher"] != "ray":
        raise ConfigError(f"config keys {at('ray_address')} and {at('elastic_launcher')} contradict: "
                          "a Ray cluster serves only elastic_launcher=ray")
    if values["elastic_launcher"] == "none":
        if not values["elastic_controller_address"].rpartition(":")[2].strip("0"):
            raise ConfigError(f"config keys {at('elastic_launcher')} and {at('elastic_controller_address')} "
                              "contradict: workers started by someone else must know where the controller listens "
                              "(set elastic_controller_address=HOST:PORT with a port other than 0)")
        if not values["elastic_run_id"]:
            raise ConfigError(f"config keys {at('elastic_launcher')} and {at('elastic_run_id')} contradict: "
                              "workers started by someone else name the run when they join (set elastic_run_id)")
    if values["elastic_snapshot_interval"] and values["elastic_backup_kind"] != "snapshot":
        raise ConfigError(f"config keys {at('elastic_snapshot_interval')} and {at('elastic_backup_kind')} "
                          "contradict: snapshots are taken only with elastic_backup_kind=snapshot")
    if values["elastic_snapshot_directory"] and not values["elastic_snapshot_directory"].startswith("/"):
        raise ConfigError(f"config key {at('elastic_snapshot_directory')} must be an absolute path (it names a "
                          "directory on every worker's host)")
    tls = [k for k in ("elastic_tls_cert_file", "elastic_tls_key_file", "elastic_tls_ca_file") if values[k]]
    if tls and len(tls) != 3:
        missing = [k for k in ("elastic_tls_cert_file", "elastic_tls_key_file", "elastic_tls_ca_file") if k not in tls]
        raise ConfigError(f"config key {at(tls[0])} needs {', '.join(repr(k) for k in missing)} too: "
                          "TLS takes a certificate, its key and a CA file")
    for key in tls:
        if not pathlib.Path(values[key]).is_file():
            raise ConfigError(f"config key {at(key)}: no such file")
    if values["elastic_min_slice_count"] > slices:
        raise ConfigError(
            f"config keys {at('elastic_min_slice_count')} and {at('dcn_data_parallelism')} contradict: "
            "the minimum slice count cannot exceed the slice count"
        )
    if not values["elastic_enabled"]:
        for key in _RECOVERY_KEYS:
            if values[key] != _DEFAULTS[key] and values[key] != _no_recovery_value(key, values):
                raise ConfigError(f"config keys {at('elastic_enabled')} and {at(key)} contradict: "
                                  f"{key} steers recovery and elastic_enabled=false turns recovery off "
                                  f"(a lost worker fails the run); drop {key} or enable elastic training")


def _address_problem(address: str) -> str:
    """Why ``address`` is not ``HOST:PORT`` ("" if it is); a pure check of the text."""
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        return f"must be HOST:PORT, got {address!r}"
    if not port.isdigit() or int(port) > 65535:
        return f"must end with a port 0..65535, got {address!r}"
    return ""


def _run_name_problem(name: str) -> str:
    """Why ``name`` cannot be a run directory under base_output_directory ("" if it can; "" is "unnamed").

    '/' nests a run (the chaos harness keeps its references in 'references/<digest>'), but no part
    may climb out ('..'), be empty or '.', and the name may not be absolute: the run directory is
    always inside base_output_directory.
    """
    if not name:
        return ""
    if not name.strip():
        return "is blank"
    if "\x00" in name:
        return "contains a NUL character"
    if "\\" in name:
        return "contains a backslash"
    if name.startswith("/"):
        return "is an absolute path"
    parts = name.split("/")
    if ".." in parts:
        return "contains '..' and would escape base_output_directory"
    if "" in parts or "." in parts:
        return "has an empty or '.' path component"
    return ""


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
            "elastic_standby_workers": 0}


def _no_recovery_value(key: str, values: Mapping[str, Any]) -> Any:
    return no_recovery_values(values)[key]


if set(no_recovery_values(Config().to_dict())) != _RECOVERY_KEYS:
    raise ImportError("elastic.config: no_recovery_values and the recovery role disagree")


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _locate(path: str | pathlib.Path) -> pathlib.Path:
    p = pathlib.Path(path)
    if p.is_file() or len(p.parts) != 1 or (p.exists() and not p.is_dir()):
        return p   # a directory named like a builtin (a run directory "tiny" in the cwd) is not a config
    try:
        return builtin_config_path(str(path))
    except ConfigError:
        raise ConfigError(f"config file not found: {path} (not a file, nor a builtin config name)") from None


def _read_chain(path: pathlib.Path, chain: tuple[pathlib.Path, ...] = ()) -> list[tuple[str, dict[str, Any]]]:
    """``[(source, layer), ...]`` for ``path`` and its base_config chain, base first."""
    if "\x00" in str(path):   # the OS refuses the name (ValueError: embedded null byte)
        raise ConfigError(f"config file name {str(path)!r} contains a NUL character")
    real = path.resolve()
    if real in chain:
        raise ConfigError(f"base_config cycle: {' -> '.join(str(p) for p in (*chain, real))}")
    layer = read_config_file(path, referrer=chain[-1] if chain else None)
    base = layer.pop("base_config", None)
    if base is None:
        return [(str(path), layer)]
    if not isinstance(base, str) or not base or "\x00" in base:
        raise ConfigError(f"base_config in {path} must be a file name, got {base!r}")
    return [*_read_chain(_base_path(path, base), (*chain, real)), (str(path), layer)]


def _base_path(path: pathlib.Path, base: str) -> pathlib.Path:
    """The file ``base_config: base`` of ``path`` names: beside ``path``, else the bundled config of that name."""
    beside = path.parent / base
    if beside.exists():
        return beside
    try:
        return builtin_config_path(base)
    except ConfigError:
        bundled = ", ".join(sorted(p.stem for p in _CONFIG_DIR.glob("*.yml")))
        raise ConfigError(f"config file not found: {beside} (base_config of {path}); not beside it, nor a bundled "
                          f"config ({bundled})") from None


def read_config_file(path: str | pathlib.Path, referrer: str | pathlib.Path | None = None) -> dict[str, Any]:
    """The top-level mapping of one YAML config file (``base_config`` not followed), as ``{key: value}``.

    Every problem is a one-line :class:`ConfigError` naming the file (and
    ``referrer``, the file whose ``base_config`` names it): not found,
    unreadable, not UTF-8, invalid YAML (with the line and column), or not a
    mapping. Used for jax-elastic's files and, by other config formats (the
    MaxText integration), for the user's files.
    """
    path = pathlib.Path(path)
    named_by = f" (base_config of {referrer})" if referrer else ""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path}{named_by}") from e
    except IsADirectoryError:
        raise ConfigError(f"config file {path}{named_by} is a directory, not a YAML file") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}{named_by}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}{named_by} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML in {path}{named_by}{yaml_problem(e)}") from None
    except ValueError as e:   # PyYAML's constructors: a date that cannot be (2001-02-30)
        raise ConfigError(f"invalid YAML in {path}{named_by}: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise ConfigError(f"invalid YAML in {path}{named_by}: nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of config keys, got {type(data).__name__}")
    return {str(k): v for k, v in data.items()}


def yaml_problem(e: yaml.YAMLError) -> str:
    """`` line L, column C: problem (while parsing ... at line L', column C')``: PyYAML's error in one line."""
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = " ".join(str(getattr(e, "problem", None) or "syntax error").split())
    context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and context_mark and (context_mark.line, context_mark.column) != (mark and (mark.line, mark.column)):
        problem += f" ({' '.join(context.split())} at line {context_mark.line + 1}, column {context_mark.column + 1})"
    return f"{where}: {problem}"


_DEFAULTS = Config().to_dict()
