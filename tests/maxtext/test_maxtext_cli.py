"""Which loader the ``elastic`` command uses for a config file, and what the command does with a MaxText one.

MaxText's loader claims every file MaxText's own loader takes for its own (its base.yml and model files, files
that inherit them, files with MaxText keys) and nothing else; with ``--trainer`` it runs the user's factory on
the loaded configs; bad input is one line.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("maxtext")

from elastic.cli_support import config_loader  # noqa: E402
from elastic.config import ConfigError  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "integrations" / "maxtext" / "configs" / "tiny.yml"
# MaxText's own configs, found the way Python finds the installed package (no path of this machine).
MAXTEXT_CONFIGS = pathlib.Path(next(iter(importlib.util.find_spec("maxtext").submodule_search_locations))) / "configs"
BASE = MAXTEXT_CONFIGS / "base.yml"


def test_maxtext_files_are_claimed_and_jax_elastic_files_are_not(tmp_path):
    assert config_loader(str(ROOT / "integrations" / "maxtext" / "configs" / "tiny.yml")).name == "maxtext"
    assert config_loader("tiny") is None
    assert config_loader(str(ROOT / "elastic" / "configs" / "tiny.yml")) is None
    own = tmp_path / "mine.yml"
    own.write_text("base_config: base.yml\nsteps: 3\n")     # only jax-elastic keys: jax-elastic's format
    assert config_loader(str(own)) is None
    mt = tmp_path / "mt.yml"
    mt.write_text("base_config: base.yml\nsteps: 3\nbase_num_kv_heads: 2\n")   # a MaxText key
    assert config_loader(str(mt)).name == "maxtext"


def test_a_key_neither_side_knows_in_a_maxtext_file_names_it(tmp_path, capsys, monkeypatch):
    import elastic.cli

    monkeypatch.setenv("XLA_FLAGS", "")   # the command sets this process's device count; restored after

    mt = tmp_path / "mt.yml"
    mt.write_text("base_config: base.yml\nbase_num_kv_heads: 2\n")
    assert elastic.cli.main(["run", str(mt), "stpes=3", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "stpes" in err and "did you mean 'steps'" in err


def loader_of(path, *overrides):
    loader = config_loader(str(path), list(overrides))
    return loader.name if loader is not None else None


def test_maxtexts_own_files_and_the_files_that_inherit_them_are_maxtext_configs(tmp_path):
    assert BASE.is_file()
    assert loader_of(BASE) == "maxtext"
    assert loader_of(BASE, "model_name=gpt3-52k") == "maxtext"
    assert loader_of(MAXTEXT_CONFIGS / "models" / "gpt3-52k.yml") == "maxtext"
    by_path = tmp_path / "by_path.yml"
    by_path.write_text(f"base_config: {BASE}\nsteps: 3\n")   # only keys jax-elastic knows, but MaxText's base
    assert loader_of(by_path) == "maxtext"
    chained = tmp_path / "chained.yml"
    chained.write_text("base_config: by_path.yml\nelastic_spares: 1\n")
    assert loader_of(chained) == "maxtext"
    model = tmp_path / "model.yml"
    model.write_text("base_config: base.yml\nmodel_name: gpt3-52k\n")
    assert loader_of(model) == "maxtext"


def test_base_yml_by_name_is_decided_by_the_keys_and_bundled_names_stay_jax_elastics(tmp_path):
    own = tmp_path / "mine.yml"
    own.write_text("base_config: base.yml\nsteps: 3\n")   # jax-elastic's bundled base.yml, or MaxText's
    assert loader_of(own) is None
    assert loader_of(own, "model_name=gpt3-52k") == "maxtext"   # MaxText's canonical override
    assert loader_of(own, "stpes=3") is None                    # a typo: jax-elastic's reader names it
    for name in ("tiny", "tiny.yml", "base"):
        f = tmp_path / f"on_{name}.yml"
        f.write_text(f"base_config: {name}\nsteps: 3\n")
        assert loader_of(f) is None, name
    bad = tmp_path / "bad.yml"
    bad.write_text("steps: 3\nseed: [1, 2\nrun_name: x\n")
    assert loader_of(bad) is None   # not readable as YAML: jax-elastic's reader names the line and column


def test_maxtexts_base_yml_loads_as_maxtext_does(tmp_path):
    from integrations.maxtext import load_maxtext_config

    ec, mt = load_maxtext_config(BASE, ["model_name=gpt3-52k", "steps=2", "elastic_spares=1"])
    assert (mt.model_name, mt.base_emb_dim, mt.base_num_decoder_layers, mt.steps) == ("gpt3-52k", 16, 1, 2)
    assert (ec.steps, ec.elastic_spares) == (2, 1)
    user = tmp_path / "user.yml"   # a user's file that inherits MaxText's base.yml by name, as MaxText resolves it
    user.write_text("base_config: base.yml\nmodel_name: gpt3-52k\nsteps: 4\nmax_target_length: 32\n"
                    "dcn_data_parallelism: 2\n")
    ec, mt = load_maxtext_config(user, [])
    assert (mt.base_emb_dim, mt.max_target_length, mt.steps, mt.dataset_type) == (16, 32, 4, "synthetic")
    assert (ec.steps, ec.slices) == (4, 2)


def test_a_maxtext_file_on_a_jax_elastic_bundled_base_is_one_line(tmp_path):
    from integrations.maxtext import load_maxtext_config

    f = tmp_path / "mixed.yml"
    f.write_text("base_config: tiny\nbase_num_kv_heads: 2\n")
    assert loader_of(f) == "maxtext"
    with pytest.raises(ConfigError) as e:
        load_maxtext_config(f, [])
    assert "\n" not in str(e.value) and "base_config 'tiny'" in str(e.value) and "bundled" in str(e.value)
    typo = tmp_path / "typo.yml"
    typo.write_text("base_config: tiny\nstpes: 2\n")   # the typo is what the user needs to hear about
    with pytest.raises(ConfigError, match="'stpes'.*did you mean 'steps'"):
        load_maxtext_config(typo, [])


def test_bad_yaml_is_one_line_naming_the_file_line_and_column(tmp_path, capsys):
    import elastic.cli

    bad = tmp_path / "bad.yml"
    bad.write_text("steps: 3\nseed: [1, 2\nrun_name: x\n")
    assert elastic.cli.main(["run", str(bad), "--quiet"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"elastic: error: invalid YAML in {bad} line 3, column 9: expected ',' or ']', but got ':' "
        "(while parsing a flow sequence at line 2, column 7)"]
    from integrations.maxtext import load_maxtext_config

    child = tmp_path / "child.yml"
    child.write_text("base_config: bad.yml\nbase_num_kv_heads: 2\n")
    with pytest.raises(ConfigError, match=r"^invalid YAML in .*bad\.yml \(base_config of .*child\.yml\) line 3, "
                                          r"column 9: [^\n]*$"):
        load_maxtext_config(child, [])


FACTORIES = '''
import pathlib
from tests.chaos import own_model

SEEN = []

def two(elastic_config, maxtext_config):
    SEEN.append((elastic_config.steps, maxtext_config.base_emb_dim))
    return own_model.make_job(elastic_config)

def three(a, b, c):
    raise AssertionError("never called")

def wrap_maxtext(elastic_config, maxtext_config):
    from integrations.maxtext import make_job
    out = pathlib.Path(elastic_config.base_output_directory, "factory-called")
    out.write_text(f"{maxtext_config.model_name} {maxtext_config.base_emb_dim}")
    return make_job(elastic_config, maxtext_config)
'''


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "mt_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("XLA_FLAGS", "")   # make_job sets a slice's device count; restored after the test
    monkeypatch.chdir(tmp_path)
    import importlib

    import mt_factories
    return importlib.reload(mt_factories)


def job_of(factory, *overrides):
    from elastic.cli_support import make_job

    args = [f"elastic_trainer={factory}", "steps=3", *overrides]
    return make_job(str(TINY), args, reference=True, loader=config_loader(str(TINY), args))


def test_trainer_gets_the_maxtext_config_and_its_job_is_the_one_run(factories):
    cfg, job = job_of("mt_factories:two")
    assert factories.SEEN == [(3, 32)]   # jax-elastic's config and MaxText's (tiny.yml's base_emb_dim)
    assert type(job).__name__ == "WrappedStep" and job.config is cfg
    assert cfg.elastic_trainer == "mt_factories:two"
    from tests.chaos import own_model

    assert job.train_step is own_model.train_step   # the factory's model, not MaxText's
    cfg, job = job_of("tests.chaos.own_model:make_job")   # a factory of one argument gets jax-elastic's config
    assert job.train_step is own_model.train_step and cfg.steps == 3


def test_a_factory_that_cannot_take_the_configs_is_one_line(factories):
    with pytest.raises(ConfigError) as e:
        job_of("mt_factories:three")
    msg = str(e.value)
    assert "\n" not in msg and "elastic_trainer" in msg and "takes neither (config) nor (config, " in msg


def test_elastic_run_of_maxtexts_base_yml_with_a_model_file_and_a_factory(tmp_path):
    """MaxText's canonical command line (base.yml model_name=...), with --trainer: a real run, two steps."""
    (tmp_path / "mt_factories.py").write_text(FACTORIES)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    out = tmp_path / "runs"
    proc = subprocess.run(
        [sys.executable, "-m", "elastic.cli", "run", str(BASE), "model_name=gpt3-52k", "steps=2",
         "max_target_length=16", "per_device_batch_size=1", "run_name=gpt3", "elastic_standby_workers=0",
         f"base_output_directory={out}", "--trainer", "mt_factories:wrap_maxtext", "--quiet"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "factory-called").read_text() == "gpt3-52k 16"   # the factory ran, on MaxText's model file
    report = json.loads((out / "gpt3" / "report.json").read_text())
    assert report["steps_completed"] == 2 and report["config"]["elastic_trainer"] == "mt_factories:wrap_maxtext"
    # The terminal holds the summary; what MaxText and its libraries printed is in the client's log.
    assert proc.stderr == "", proc.stderr
    assert "PjRt" not in proc.stdout and proc.stdout.rstrip().endswith(f"report: {(out / 'gpt3' / 'report.html').resolve().as_uri()}")
    client_log = out / "gpt3" / "logs" / "client.log"
    kept = client_log.read_text().splitlines() if client_log.exists() else []
    assert not [line for line in kept if line.strip() and line in proc.stdout.splitlines()]
