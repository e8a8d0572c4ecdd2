"""Unit tests for elastic.config: loading, inheritance, overrides and every error class."""

import dataclasses
import json
import pickle

import pytest
import yaml

from elastic.config import Config, ConfigError, config_from_dict
from elastic.config_loading import builtin_config_path, load_config, parse_overrides


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def assert_one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


# --------------------------------------------------------------------------- builtins


def test_base_yml_spells_out_every_default():
    raw = yaml.safe_load(builtin_config_path("base").read_text())
    assert raw == Config().to_dict()
    assert load_config("base") == Config()


def test_tiny_inherits_base_and_overrides():
    cfg = load_config("tiny")
    assert cfg == load_config(builtin_config_path("tiny.yml"))
    assert (cfg.run_name, cfg.steps, cfg.learning_rate) == ("tiny", 30, 0.003)
    assert (cfg.slices, cfg.devices_per_slice, cfg.microbatches) == (4, 2, 4)
    assert cfg.microbatch_size == 4 and cfg.global_batch_size == 16
    assert cfg.elastic_chunk_bytes == 4194304  # from base.yml


def test_unknown_builtin_lists_known_ones():
    with pytest.raises(ConfigError, match="no builtin config 'nope'.*tiny"):
        builtin_config_path("nope")
    with pytest.raises(ConfigError, match="config file not found: nope"):
        load_config("nope")


def test_file_in_cwd_wins_over_builtin(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "tiny", "steps: 7\n")
    assert load_config("tiny").steps == 7


# --------------------------------------------------------------------------- inheritance


def test_base_config_chain_is_relative_to_each_file(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path, "root.yml", "steps: 1\nseed: 1\nwarmup_steps: 1\n")
    write(tmp_path, "sub/mid.yml", "base_config: ../root.yml\nsteps: 2\nseed: 2\n")
    child = write(tmp_path, "child.yml", "base_config: sub/mid.yml\nsteps: 3\n")
    cfg = load_config(child)
    assert (cfg.steps, cfg.seed, cfg.warmup_steps) == (3, 2, 1)


def test_empty_file_is_all_defaults(tmp_path):
    assert load_config(write(tmp_path, "empty.yml", "")) == Config()


@pytest.mark.parametrize(
    "files",
    [
        {"a.yml": "base_config: a.yml\n"},
        {"a.yml": "base_config: b.yml\n", "b.yml": "base_config: a.yml\n"},
    ],
)
def test_base_config_cycle(tmp_path, files):
    for name, text in files.items():
        write(tmp_path, name, text)
    with pytest.raises(ConfigError, match="base_config cycle") as err:
        load_config(tmp_path / "a.yml")
    msg = assert_one_line(err)
    assert all(name in msg for name in files)


def test_missing_base_config_names_both_files(tmp_path):
    child = write(tmp_path, "child.yml", "base_config: gone.yml\n")
    with pytest.raises(ConfigError, match=r"not found: .*gone\.yml \(base_config of .*child\.yml\)"):
        load_config(child)


@pytest.mark.parametrize("name", ["tiny", "tiny.yml", "base", "base.yml"])
def test_base_config_names_a_bundled_config_when_no_file_is_beside(tmp_path, name):
    child = write(tmp_path, "child.yml", f"base_config: {name}\nsteps: 3\n")
    cfg = load_config(child)
    want = load_config(name.removesuffix(".yml"))
    assert cfg == want.replace(steps=3)
    assert cfg.steps == 3 and cfg.run_name == ("tiny" if name.startswith("tiny") else "")


def test_a_file_beside_wins_over_a_bundled_config_of_the_same_name(tmp_path):
    write(tmp_path, "tiny.yml", "steps: 9\n")
    assert load_config(write(tmp_path, "child.yml", "base_config: tiny.yml\n")).steps == 9
    assert load_config(write(tmp_path, "other.yml", "base_config: tiny\n")).steps == 30   # no file 'tiny' beside


def test_a_missing_base_config_says_where_it_was_looked_for(tmp_path):
    child = write(tmp_path, "child.yml", "base_config: tinyy\n")
    with pytest.raises(ConfigError) as err:
        load_config(child)
    assert assert_one_line(err).endswith("not beside it, nor a bundled config (base, rl_tiny, tiny)")


# --------------------------------------------------------------------------- overrides


def test_overrides_are_typed_and_win(tmp_path):
    path = write(tmp_path, "c.yml", "steps: 5\nrun_name: x\n")
    cfg = load_config(
        path,
        ["steps=30", "learning_rate=1e-3", "elastic_enabled=false", "run_name=007", "seed=3.0",
         "elastic_rpc_timeout_seconds=5"],
    )
    assert cfg.steps == 30 and type(cfg.steps) is int
    assert cfg.learning_rate == 1e-3 and type(cfg.learning_rate) is float
    assert cfg.elastic_enabled is False
    assert cfg.run_name == "007"  # string keys are taken verbatim
    assert cfg.seed == 3 and type(cfg.seed) is int
    assert cfg.elastic_rpc_timeout_seconds == 5.0 and type(cfg.elastic_rpc_timeout_seconds) is float


def test_parse_overrides():
    assert parse_overrides(["steps = 4", "learning_rate=2e-2", "run_name="]) == {
        "steps": 4,
        "learning_rate": 0.02,
        "run_name": "",
    }
    assert parse_overrides(["steps=1", "steps=2"]) == {"steps": 2}


@pytest.mark.parametrize(
    "items, pattern",
    [
        (["steps"], r"override 'steps' is not of the form key=value"),
        (["=3"], r"not of the form key=value"),
        ("steps=3", r"must be a list of 'key=value' strings"),
        (["stpes=3"], r"^unknown config key 'stpes' \(in overrides\); did you mean 'steps'\?$"),
        (["zzzzzz=1"], r"^unknown config key 'zzzzzz' \(in overrides\)$"),
        (["base_config=a.yml"], r"'base_config' .* only allowed at the top of a YAML file"),
        (["steps=[1"], r"override 'steps=\[1': value is not a YAML scalar"),
    ],
)
def test_bad_overrides(items, pattern):
    with pytest.raises(ConfigError, match=pattern) as err:
        parse_overrides(items)
    assert_one_line(err)


# --------------------------------------------------------------------------- types


@pytest.mark.parametrize(
    "override, message",
    [
        ("steps=abc", "config key 'steps' must be an integer, got 'abc' (in overrides)"),
        ("steps=true", "config key 'steps' must be an integer, got True (in overrides)"),
        ("steps=2.5", "config key 'steps' must be an integer, got 2.5 (in overrides)"),
        ("steps=[1, 2]", "config key 'steps' must be a scalar, got [1, 2] (in overrides)"),
        ("learning_rate=fast", "config key 'learning_rate' must be a number, got 'fast' (in overrides)"),
        ("learning_rate=true", "config key 'learning_rate' must be a number, got True (in overrides)"),
        ("learning_rate=.inf", "config key 'learning_rate' must be a finite number, got inf (in overrides)"),
        ("elastic_enabled=1", "config key 'elastic_enabled' must be true or false, got 1 (in overrides)"),
    ],
)
def test_wrong_type(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("base", [override])
    assert str(err.value) == message


def test_wrong_type_in_file_names_the_file(tmp_path):
    path = write(tmp_path, "c.yml", "steps: many\n")
    with pytest.raises(ConfigError, match=r"'steps' must be an integer, got 'many' \(in .*c\.yml\)"):
        load_config(path)


def test_unknown_key_in_file_names_the_file(tmp_path):
    path = write(tmp_path, "c.yml", "learning_rte: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"unknown config key 'learning_rte' (in {path}); did you mean 'learning_rate'?"


def test_str_key_accepts_scalars(tmp_path):
    path = write(tmp_path, "c.yml", "run_name: 12\nbase_output_directory:\n")
    cfg = load_config(path)
    assert (cfg.run_name, cfg.base_output_directory) == ("12", "")


# --------------------------------------------------------------------------- ranges


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("steps=0", r"^config key 'steps' must be >= 1, got 0 \(in overrides\)$"),
        ("warmup_steps=-1", r"'warmup_steps' must be >= 0, got -1"),
        ("learning_rate=0", r"'learning_rate' must be > 0, got 0.0"),
        ("elastic_chunk_bytes=4095", r"^config key 'elastic_chunk_bytes' must be >= 4096 bytes and <= 33554432 "
                                     r"bytes, got 4095 \(in overrides\)$"),
        ("elastic_chunk_bytes=0", r"'elastic_chunk_bytes' must be >= 4096 bytes"),
        ("elastic_chunk_bytes=33554433", r"'elastic_chunk_bytes' must be >= 4096 bytes and <= 33554432 bytes"),
        ("elastic_rpc_timeout_seconds=0", r"'elastic_rpc_timeout_seconds' must be > 0"),
        ("elastic_microbatches=-2", r"'elastic_microbatches' must be >= 0"),
    ],
)
def test_out_of_range(override, pattern):
    with pytest.raises(ConfigError, match=pattern) as err:
        load_config("base", [override])
    assert_one_line(err)


def test_contradictory_heads_and_width_names_both_keys():
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["base_emb_dim=33"])
    msg = assert_one_line(err)
    assert "'base_emb_dim' (33, in overrides)" in msg
    assert "'base_num_query_heads' (2, in " in msg and "tiny.yml" in msg


@pytest.mark.parametrize("overrides,message", [
    (["elastic_snapshot_interval=4", "elastic_backup_kind=checkpoint"],
     "'elastic_snapshot_interval' (4, in overrides) and 'elastic_backup_kind' ('checkpoint', in overrides) contradict"),
    (["elastic_snapshot_directory=shm/snaps"], "'elastic_snapshot_directory' ('shm/snaps', in overrides) must be "
                                               "an absolute path"),
    (["elastic_backup_kind=memory"], "'elastic_backup_kind' must be one of snapshot, checkpoint"),
    (["elastic_enabled=false", "elastic_snapshot_interval=4"], "contradict"),
])
def test_snapshot_keys_that_cannot_work_are_refused_naming_them(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides)
    assert message in assert_one_line(err)


@pytest.mark.parametrize("overrides,message", [
    (["elastic_launcher=none", "elastic_run_id=r1"], "workers started by someone else must know where the controller"),
    (["elastic_launcher=none", "elastic_controller_address=0.0.0.0:0", "elastic_run_id=r1"], "a port other than 0"),
    (["elastic_launcher=none", "elastic_controller_address=0.0.0.0:50051"], "set elastic_run_id"),
    (["elastic_controller_address=50051"], "must be HOST:PORT"),
    (["elastic_controller_address=host:99999"], "must end with a port 0..65535"),
    (["elastic_run_id=a b"], "letters, digits"),
    (["elastic_launcher=kubernetes"], "must be one of local, ray, none"),
    (["ray_address=127.0.0.1:6379"], "a Ray cluster serves only elastic_launcher=ray"),
])
def test_launch_keys_that_cannot_work_are_refused_naming_them(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides)
    assert message in assert_one_line(err)


def test_chunk_bytes_bounds_are_inclusive():
    assert load_config("base", ["elastic_chunk_bytes=4096"]).elastic_chunk_bytes == 4096
    assert load_config("base", ["elastic_chunk_bytes=33554432"]).elastic_chunk_bytes == 33554432


# --------------------------------------------------------------------------- elastic_enabled


@pytest.mark.parametrize(
    "override",
    ["elastic_spares=1", "elastic_max_retries=3", "elastic_min_slice_count=2", "elastic_timeout_seconds=5",
     "elastic_replace_stragglers=true", "elastic_standby_workers=1", "elastic_standby_workers=3"],
)
def test_recovery_keys_contradict_elastic_disabled(override):
    key = override.partition("=")[0]
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["elastic_enabled=false", override])
    msg = assert_one_line(err)
    assert msg.startswith(f"config keys 'elastic_enabled' (False, in overrides) and '{key}' (")
    assert "contradict" in msg and "turns recovery off" in msg


def test_contradiction_with_elastic_disabled_names_the_file(tmp_path):
    path = write(tmp_path, "c.yml", "base_config: " + str(builtin_config_path("tiny")) + "\nelastic_spares: 2\n")
    with pytest.raises(ConfigError, match=r"'elastic_spares' \(2, in .*c\.yml\)"):
        load_config(path, ["elastic_enabled=false"])


@pytest.mark.parametrize(
    "overrides",
    [[], ["elastic_max_retries=0"], ["elastic_relaunch=false"], ["elastic_min_slice_count=4"],
     ["elastic_max_retries=0", "elastic_relaunch=false", "elastic_min_slice_count=4", "elastic_spares=0"]],
)
def test_defaults_and_no_recovery_values_agree_with_elastic_disabled(overrides):
    assert load_config("tiny", ["elastic_enabled=false", *overrides]).elastic_enabled is False


def test_replace_checks_the_contradiction_too():
    cfg = load_config("tiny", ["elastic_spares=1"])
    with pytest.raises(ConfigError, match="'elastic_enabled' .* and 'elastic_spares' .* contradict"):
        cfg.replace(elastic_enabled=False)


# --------------------------------------------------------------------------- microbatches


@pytest.mark.parametrize("slices, expected", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)])
def test_auto_microbatches_is_next_power_of_two(slices, expected):
    cfg = Config(dcn_data_parallelism=slices, ici_fsdp_parallelism=2, per_device_batch_size=3)
    assert cfg.elastic_microbatches == 0
    assert cfg.microbatches == expected
    assert cfg.global_batch_size == expected * 6


def test_explicit_microbatches_may_exceed_slices():
    assert Config(dcn_data_parallelism=3, elastic_microbatches=16).microbatches == 16


def test_microbatches_not_power_of_two():
    with pytest.raises(ConfigError, match=r"'elastic_microbatches' \(6, in overrides\) must be a power of two"):
        load_config("tiny", ["elastic_microbatches=6"])


def test_microbatches_fewer_than_slices():
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["elastic_microbatches=2"])
    msg = assert_one_line(err)
    assert "'elastic_microbatches' (2, in overrides)" in msg
    assert "'dcn_data_parallelism' (4, in " in msg


# --------------------------------------------------------------------------- files


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"^config file not found: .*nothere\.yml$"):
        load_config(tmp_path / "nothere.yml")


def test_bad_yaml_is_one_line_naming_file_line_and_column(tmp_path):
    path = write(tmp_path, "bad.yml", "steps: 3\nseed: [1, 2\nrun_name: x\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert assert_one_line(err) == (f"invalid YAML in {path} line 3, column 9: expected ',' or ']', but got ':' "
                                    "(while parsing a flow sequence at line 2, column 7)")
    child = write(tmp_path, "child.yml", "base_config: bad.yml\n")   # in a base: names the file that names it
    with pytest.raises(ConfigError, match=r"^invalid YAML in .*bad\.yml \(base_config of .*child\.yml\) line 3, "
                                          r"column 9: ") as err:
        load_config(child)
    assert_one_line(err)
    tab = write(tmp_path, "tab.yml", "steps: 3\n\tseed: 1\n")
    with pytest.raises(ConfigError, match=r"^invalid YAML in .*tab\.yml line 2, column 1: ") as err:
        load_config(tab)
    assert_one_line(err)


@pytest.mark.parametrize("text, kind", [("- steps\n", "list"), ("3\n", "int")])
def test_top_level_must_be_mapping(tmp_path, text, kind):
    path = write(tmp_path, "c.yml", text)
    with pytest.raises(ConfigError, match=rf"c\.yml: top level must be a mapping of config keys, got {kind}$"):
        load_config(path)


def test_base_config_must_be_a_name(tmp_path):
    path = write(tmp_path, "c.yml", "base_config: 3\n")
    with pytest.raises(ConfigError, match=r"base_config in .*c\.yml must be a file name, got 3"):
        load_config(path)


# --------------------------------------------------------------------------- Config object


def test_config_is_frozen_and_replace_revalidates():
    cfg = load_config("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3  # type: ignore[misc]
    assert cfg.replace(steps=3).steps == 3 and cfg.steps == 30
    with pytest.raises(ConfigError, match="'steps' must be >= 1"):
        cfg.replace(steps=0)
    with pytest.raises(ConfigError, match="did you mean 'steps'"):
        cfg.replace(step=3)
    with pytest.raises(ConfigError, match="power of two"):
        cfg.replace(dcn_data_parallelism=5, elastic_microbatches=6)


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError, match="must be an integer"):
        Config(steps="3")  # type: ignore[arg-type]
    assert Config(learning_rate=1).learning_rate == 1.0


def test_to_dict_round_trips_through_json_and_pickle():
    cfg = load_config("tiny", ["learning_rate=1e-4"])
    d = json.loads(json.dumps(cfg.to_dict()))
    assert config_from_dict(d) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_config_from_dict_errors_name_source():
    with pytest.raises(ConfigError, match=r"unknown config key 'x' \(in worker\)"):
        config_from_dict({"x": 1}, source="worker")
    with pytest.raises(ConfigError, match=r"^<dict>: expected a mapping"):
        config_from_dict([("steps", 1)])  # type: ignore[arg-type]


def test_config_error_is_a_value_error_and_picklable():
    err = ConfigError("unknown config key 'x'")
    assert isinstance(err, ValueError)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


def test_a_directory_named_like_a_builtin_does_not_shadow_it(tmp_path, monkeypatch):
    (tmp_path / "tiny").mkdir()   # a run directory of a run named "tiny", in the current directory
    monkeypatch.chdir(tmp_path)
    assert load_config("tiny").run_name == "tiny"


@pytest.mark.parametrize("directory", ["gs://ck/run", "gs://Bucket/run", "gs://", "gs:///x"])
def test_a_gs_checkpoint_directory_without_a_valid_bucket_is_refused_when_read(directory):
    """Not at the first save, minutes later: the config names the key and what a bucket name may be."""
    with pytest.raises(ConfigError, match="elastic_checkpoint_directory.*valid bucket name"):
        load_config("tiny", [f"elastic_checkpoint_directory={directory}", "enable_checkpointing=true"])
    assert load_config("tiny", ["elastic_checkpoint_directory=gs://my-bucket/run"]).elastic_checkpoint_directory


# Issue 24: elastic_enabled=false once silently zeroed elastic_standby_workers. Its default (-1) now means
# "one with recovery on, none with it off", so any standby process asked for with recovery off is refused.
@pytest.mark.parametrize("overrides, standby", [([], 1), (["elastic_enabled=false"], 0),
                                                (["elastic_enabled=false", "elastic_standby_workers=0"], 0),
                                                (["elastic_standby_workers=0"], 0), (["elastic_standby_workers=3"], 3)])
def test_standby_workers_follow_recovery_unless_set(overrides, standby):
    assert load_config("tiny", overrides).standby_workers == standby


def test_standby_workers_asked_for_with_recovery_off_is_one_line_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["elastic_enabled=false", "elastic_standby_workers=2"])
    assert assert_one_line(err).startswith("config keys 'elastic_enabled' (False, in overrides) and "
                                           "'elastic_standby_workers' (2, in overrides) contradict")
    with pytest.raises(ConfigError, match="'elastic_standby_workers'"):
        load_config("tiny", ["elastic_standby_workers=1"]).replace(elastic_enabled=False)
    cfg = load_config("tiny", ["elastic_enabled=false"])
    assert config_from_dict(cfg.to_dict()) == cfg   # the round trip keeps the unresolved default
