"""Unit tests for elastic.options: every config key reaches the runtime, or its declared reader."""

import ast
import dataclasses
import pathlib

import pytest

from elastic import options
from elastic.config import Config, ConfigError
from elastic.config_loading import load_config
from elastic.models import TransformerConfig
from elastic.options import NOT_FROM_CONFIG, READ_ELSEWHERE, controller_options, run_settings
from runtime import ControllerOptions, TlsFiles

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA = [f.name for f in dataclasses.fields(Config)]
ELASTIC_KEYS = [k for k in SCHEMA if k.startswith("elastic_")]
TLS_KEYS = ("elastic_tls_cert_file", "elastic_tls_key_file", "elastic_tls_ca_file")


@pytest.fixture(autouse=True)
def run_secret(monkeypatch):
    """The secret workers started by someone else were given (elastic_launcher=none reads it), and a pool's client
    token (elastic_pool reads it)."""
    monkeypatch.setenv("ELASTIC_RUN_SECRET", "s3cret")
    monkeypatch.setenv("ELASTIC_POOL_TOKEN", "t0ken")


@pytest.fixture
def base():
    return load_config("tiny")  # 4 slices, so slice-count keys have room to move


def changed(cfg: Config, key: str, tmp_path) -> dict:
    """Valid non-default changes of ``cfg`` that move ``key`` (TLS keys move together: all or none)."""
    if key in TLS_KEYS:
        files = {k: tmp_path / f"{k}.pem" for k in TLS_KEYS}
        for path in files.values():
            path.write_text("-----BEGIN-----\n")
        return {k: str(p) for k, p in files.items()}
    value = getattr(cfg, key)
    if key == "dcn_data_parallelism":
        return {key: value // 2}
    if key == "elastic_trainer":
        return {key: "mypkg.train:make_job"}
    if key == "hardware":
        return {key: "gpu"}   # not cpu: the tests run with JAX_PLATFORMS=cpu, which "" resolves to
    if key == "elastic_launcher":   # workers that join by themselves need an address and a run id
        return {key: "none", "elastic_controller_address": "0.0.0.0:50051", "elastic_run_id": "run-1"}
    if key == "ray_address":
        return {key: "127.0.0.1:6379", "elastic_launcher": "ray"}
    if key == "elastic_controller_address":
        return {key: "0.0.0.0:50051"}
    if key == "elastic_run_id":
        return {key: "run-1"}
    if key == "elastic_pool":
        return {key: "127.0.0.1:7000"}
    if key == "elastic_standby_workers":
        return {key: 3}   # -1 (auto) resolves to 1 with recovery on
    if key == "elastic_snapshot_directory":
        return {key: str(tmp_path / "snapshots")}
    if key == "eval_steps":
        return {key: 5}   # -1 (the whole eval source) is the default; 0 is refused
    if key == "elastic_checkpoint_directory":
        return {key: str(tmp_path / "checkpoints")}  # fewer slices: tiny's elastic_microbatches stays >= slices
    if isinstance(value, bool):
        return {key: not value}
    if isinstance(value, (int, float)):
        return {key: value * 2 if value else 1}  # doubling keeps powers of two powers of two
    choices = Config.__dataclass_fields__[key].metadata["choices"]
    if choices:
        return {key: next(c for c in choices if c != value)}
    raise AssertionError(f"no rule to change {key!r} ({value!r}); add one here")


# --------------------------------------------------------------------------- every key has a place


def test_every_schema_key_has_exactly_the_places_declared():
    placed = (set(options._TO_CONTROLLER) | set(options._TLS_KEYS) | {options._ENABLED_KEY, options._CACHE_KEY,
                                                                       options._STANDBY_KEY}
              | set(options._CHECKPOINT_KEYS) | set(options._SNAPSHOT_KEYS) | {options._ADDRESS_KEY}
              | set(READ_ELSEWHERE))
    assert placed == set(SCHEMA)


def test_a_key_without_a_place_fails_the_import_check(monkeypatch):
    monkeypatch.setattr(options, "READ_ELSEWHERE", {k: v for k, v in READ_ELSEWHERE.items() if k != "steps"})
    with pytest.raises(ImportError, match=r"keys without a place here: \['steps'\]"):
        options._check_every_key_has_a_place()


def test_every_controller_option_is_fed_by_a_key_or_declared_not_from_config():
    fed = set(options._TO_CONTROLLER.values()) | {"tls", "compilation_cache_dir", "checkpoint_directory",
                                                  "checkpoint_period", "platform", "load_full_state_path",
                                                  "load_parameters_path", "snapshot_directory", "host", "port", "standby_workers"}
    fields = {f.name for f in dataclasses.fields(ControllerOptions)}
    assert fed <= fields, f"mapped to options that do not exist: {sorted(fed - fields)}"
    assert fields - fed == NOT_FROM_CONFIG, (
        f"ControllerOptions fields no config key sets: {sorted(fields - fed - NOT_FROM_CONFIG)}")


def test_only_elastic_options_builds_controller_options():
    """The trainer (and anything else outside the runtime) gets its options from controller_options."""
    builders = []
    for pkg in ("elastic", "chaos", "integrations"):
        for path in (ROOT / pkg).rglob("*.py"):
            if path == ROOT / "elastic/options.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == \
                        "ControllerOptions":
                    builders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not builders, builders


# --------------------------------------------------------------------------- every elastic_ key has an effect


@pytest.mark.parametrize("key", ELASTIC_KEYS)
def test_every_elastic_key_changes_the_controller_options_or_its_declared_reader(key, base, tmp_path):
    if key in options._CHECKPOINT_KEYS:
        base = base.replace(enable_checkpointing=True)   # the checkpoint keys act only with checkpoints on
    changes = changed(base, key, tmp_path)
    cfg = base.replace(**changes)
    opts_moved = controller_options(cfg, "run") != controller_options(base, "run")
    settings_moved = run_settings(cfg) != run_settings(base)
    if key in READ_ELSEWHERE:
        assert settings_moved, f"{key} is declared read by {READ_ELSEWHERE[key]!r} but run settings ignore it"
    else:
        assert opts_moved, f"{key} changes nothing in ControllerOptions and is not declared read elsewhere"
    assert opts_moved or settings_moved


@pytest.mark.parametrize("key", sorted(options._TO_CONTROLLER))
def test_mapped_keys_arrive_in_their_field(key, base, tmp_path):
    changes = changed(base, key, tmp_path)
    opts = controller_options(base.replace(**changes), "run")
    assert getattr(opts, options._TO_CONTROLLER[key]) == changes[key]


def test_chunk_bytes_reaches_the_controller(base):
    assert controller_options(base, "run").chunk_bytes == 4 << 20
    assert controller_options(base.replace(elastic_chunk_bytes=65536), "run").chunk_bytes == 65536


def test_tls_paths_are_resolved_for_workers_that_run_elsewhere(base, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("c.pem", "k.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    cfg = base.replace(elastic_tls_cert_file="c.pem", elastic_tls_key_file="k.pem", elastic_tls_ca_file="ca.pem")
    assert controller_options(cfg, "run").tls == TlsFiles(*(str(tmp_path.resolve() / n)
                                                           for n in ("c.pem", "k.pem", "ca.pem")))
    assert controller_options(base, "run").tls is None


def test_the_compilation_cache_is_shared_under_the_output_directory_unless_told(base, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    cfg = base.replace(base_output_directory="out")
    assert controller_options(cfg, "run").compilation_cache_dir == str(tmp_path.resolve() / "out" / "jax_cache")
    assert run_settings(cfg).compilation_cache_dir == controller_options(cfg, "run").compilation_cache_dir
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "envcache")   # JAX's own variable, when set
    assert controller_options(cfg, "run").compilation_cache_dir == str(tmp_path.resolve() / "envcache")
    assert controller_options(cfg.replace(jax_cache_dir="mine"), "run").compilation_cache_dir == str(
        tmp_path.resolve() / "mine")
    assert controller_options(cfg.replace(jax_cache_dir="off"), "run").compilation_cache_dir == ""
    assert run_settings(cfg.replace(jax_cache_dir="off")).compilation_cache_dir == ""


def test_run_dir_is_the_callers(base, tmp_path):
    assert controller_options(base, tmp_path / "r").run_dir == str(tmp_path / "r")


# --------------------------------------------------------------------------- elastic_enabled


def test_elastic_disabled_means_no_recovery(base):
    on = controller_options(base, "run")
    off = controller_options(base.replace(elastic_enabled=False), "run")
    assert (off.max_retries, off.spares, off.relaunch, off.min_slices, off.capacity_timeout_seconds,
            off.replace_stragglers, off.standby_workers, off.client_grace_seconds) == (0, 0, False, base.slices, 0.0,
                                                                                       False, 0, 0.0)
    recovery = {"max_retries", "spares", "relaunch", "min_slices", "capacity_timeout_seconds", "replace_stragglers",
                "standby_workers", "client_grace_seconds"}
    same = {f.name for f in dataclasses.fields(ControllerOptions)} - recovery
    assert {k: getattr(off, k) for k in same} == {k: getattr(on, k) for k in same}  # detection stays on


def test_elastic_disabled_keeps_what_already_means_no_recovery(base):
    cfg = base.replace(elastic_enabled=False, elastic_max_retries=0, elastic_relaunch=False, elastic_min_slice_count=4)
    assert controller_options(cfg, "run") == controller_options(base.replace(elastic_enabled=False), "run")


# --------------------------------------------------------------------------- keys read elsewhere


@pytest.mark.parametrize("key", sorted(k for k, who in READ_ELSEWHERE.items() if who.startswith("RunSettings.")))
def test_run_settings_keys_reach_their_attribute(key, base, tmp_path):
    changes = changed(base, key, tmp_path) if not isinstance(getattr(base, key), str) \
        or key in ("elastic_trainer", "hardware", "elastic_pipeline_schedule") else {key: "other"}
    attr = READ_ELSEWHERE[key].split(":")[0].removeprefix("RunSettings.")
    assert getattr(run_settings(base.replace(**changes)), attr) != getattr(run_settings(base), attr)


@pytest.mark.parametrize("key", sorted(k for k, who in READ_ELSEWHERE.items() if "TransformerConfig" in who
                                       or k == "max_target_length"))
def test_model_keys_reach_the_bundled_model(key, base):
    cfg = base.replace(**{key: getattr(base, key) * 2})
    assert TransformerConfig.from_config(cfg) != TransformerConfig.from_config(base)


def test_per_device_batch_size_reaches_the_microbatch_size(base):
    assert base.replace(per_device_batch_size=3).microbatch_size == 3 * base.devices_per_slice


def test_chunk_bytes_bounds_match_what_workers_accept():
    """A value the config accepts must not be refused by a worker's Load (INVALID_ARGUMENT mid-setup)."""
    import runtime
    from elastic import ConfigError

    assert Config().elastic_chunk_bytes == runtime.DEFAULT_CHUNK_BYTES
    for ok in (runtime.MIN_CHUNK_BYTES, runtime.MAX_CHUNK_BYTES):
        assert Config().replace(elastic_chunk_bytes=ok).elastic_chunk_bytes == ok
    for bad in (runtime.MIN_CHUNK_BYTES - 1, runtime.MAX_CHUNK_BYTES + 1):
        with pytest.raises(ConfigError, match="elastic_chunk_bytes"):
            Config().replace(elastic_chunk_bytes=bad)


def test_checkpoint_keys_reach_the_controller_only_when_checkpointing(base, tmp_path):
    assert (controller_options(base, tmp_path).checkpoint_directory, controller_options(base, tmp_path).checkpoint_period) \
        == ("", 0)
    on = controller_options(base.replace(enable_checkpointing=True, checkpoint_period=7), tmp_path)
    assert (on.checkpoint_directory, on.checkpoint_period) == (str(tmp_path.resolve() / "checkpoints"), 7)
    gcs = controller_options(base.replace(enable_checkpointing=True, elastic_checkpoint_directory="gs://bucket/run"), tmp_path)
    assert gcs.checkpoint_directory == "gs://bucket/run"


def test_workers_that_join_by_themselves_get_the_address_run_id_and_secret_they_were_given(base, monkeypatch):
    cfg = base.replace(elastic_launcher="none", elastic_controller_address="0.0.0.0:50051", elastic_run_id="exp-1")
    opts = controller_options(cfg, "run")
    assert (opts.launcher, opts.host, opts.port, opts.run_id, opts.secret) == ("none", "0.0.0.0", 50051, "exp-1",
                                                                                "s3cret")
    assert controller_options(base, "run").secret == ""   # local workers: the controller makes one
    monkeypatch.delenv("ELASTIC_RUN_SECRET")
    with pytest.raises(ConfigError, match="ELASTIC_RUN_SECRET"):
        controller_options(cfg, "run")


def test_the_ray_launcher_without_ray_stops_before_anything_starts_and_says_how_to_install_it(base, monkeypatch):
    monkeypatch.setattr(options, "ray_available", lambda: "Ray is not installed; pip install 'jax-elastic[ray]'")
    with pytest.raises(ConfigError, match=r"elastic_launcher=ray: Ray is not installed; pip install"):
        controller_options(base.replace(elastic_launcher="ray"), "run")
    assert controller_options(base, "run").launcher == "local"   # nothing else needs Ray


# --------------------------------------------------------------------------- defaults and vocabulary (issue 24)

# ControllerOptions fields whose default is not the default config's: the caller's own (NOT_FROM_CONFIG and the
# required ones), and those elastic derives from the environment and the host rather than from a key's value.
DERIVED = {"compilation_cache_dir", "platform", "snapshot_directory"}


def test_controller_option_defaults_are_the_default_configs(tmp_path):
    # Issue 24: standby_workers defaulted to 0 (the config: 1) and capacity_timeout_seconds to 0 (the config: 60 s).
    from_config = controller_options(Config(), tmp_path)
    differ = {f.name: (f.default, getattr(from_config, f.name)) for f in dataclasses.fields(ControllerOptions)
              if f.default is not dataclasses.MISSING and f.name not in NOT_FROM_CONFIG | DERIVED
              and f.default != getattr(from_config, f.name)}
    assert differ == {}


def test_the_runtimes_reasons_are_printed_in_config_terms():
    from runtime.control.plan import capacity_timed_out, decide_recovery
    from runtime.control.placement import Placement
    p = Placement(epoch=1, active=("a", "b"), spares=())
    wait = decide_recovery(p, ("a",), {"a", "b"}, min_slices=2, recoveries=1, max_retries=5, may_wait=True)
    register = capacity_timed_out(wait, 120.0, "register_timeout_seconds")
    assert options.in_config_terms(register.reason) == ("1 slices left, elastic_min_slice_count is 2: no capacity "
                                                        "arrived within elastic_register_timeout_seconds=120")
    assert options.in_config_terms(capacity_timed_out(wait, 60.0).reason).endswith("elastic_timeout_seconds=60")
    off = decide_recovery(p, ("a",), {"a", "b"}, min_slices=1, recoveries=1, max_retries=0)
    assert "(elastic_max_retries=0, or elastic_enabled=false)" in options.in_config_terms(off.reason)
    # config keys and plain words are left alone
    assert options.in_config_terms("elastic_min_slice_count; spares replace the lost slices") == \
        "elastic_min_slice_count; spares replace the lost slices"


def test_every_role_list_is_derived_from_the_schema():
    from elastic.config import MATH_KEYS, MODEL_KEYS, REFERENCE_NEUTRAL, ROLES, keys_with
    roles = {f.name: f.metadata["role"] for f in dataclasses.fields(Config)}
    assert all(r and r <= set(ROLES) for r in roles.values())
    assert MODEL_KEYS == keys_with("model") <= MATH_KEYS
    assert MATH_KEYS | REFERENCE_NEUTRAL == set(SCHEMA) and not MATH_KEYS & REFERENCE_NEUTRAL
    assert {"jax_cache_dir", "run_name", "base_output_directory", "dcn_data_parallelism"} <= REFERENCE_NEUTRAL
    assert {"learning_rate", "seed", "elastic_microbatches", "per_device_batch_size"} <= MATH_KEYS


def test_a_run_on_a_shared_pool_leases_its_workers_there_and_needs_the_pools_client_token(base, monkeypatch):
    cfg = base.replace(elastic_pool="127.0.0.1:7000", elastic_pool_priority=3)
    opts = controller_options(cfg, "run")
    assert (opts.launcher, opts.pool, opts.pool_priority) == ("pool", "127.0.0.1:7000", 3)
    assert controller_options(base, "run").launcher == "local"
    monkeypatch.delenv("ELASTIC_POOL_TOKEN")
    with pytest.raises(ConfigError, match="ELASTIC_POOL_TOKEN"):
        controller_options(cfg, "run")
    for bad, why in ((dict(elastic_launcher="ray"), "elastic_launcher"), (dict(elastic_hosts_per_slice=2), "one host"),
                     (dict(elastic_pool="nowhere"), "elastic_pool"),
                     (dict(rl_samplers=2, rl_sampler_devices=2, ici_fsdp_parallelism=1), "rl_sampler_devices")):
        with pytest.raises(ConfigError, match=why):
            base.replace(elastic_pool="127.0.0.1:7000", **bad) if "elastic_pool" not in bad else base.replace(**bad)
