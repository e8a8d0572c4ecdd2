"""Which loader the ``elastic`` command uses for a config file: MaxText's claims only MaxText files."""

import pathlib

import pytest

pytest.importorskip("maxtext")

from elastic.cli_support import config_loader  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
