"""A chaos run starts from nothing: it never resumes an earlier run's checkpoints (its faults would not fire)."""

import pytest

import elastic
from chaos.harness import _fresh_run
from elastic.config import ConfigError


def _cfg(tmp_path, *overrides):
    return elastic.load_config("tiny", [f"base_output_directory={tmp_path}", "run_name=exp", *overrides])


def test_a_run_directory_with_an_earlier_runs_checkpoints_gives_the_next_free_name(tmp_path, capsys):
    cfg = _cfg(tmp_path, "enable_checkpointing=true")
    assert _fresh_run(cfg).run_name == "exp"   # nothing there yet
    (tmp_path / "exp" / "checkpoints" / "8").mkdir(parents=True)
    (tmp_path / "exp-2" / "checkpoints" / "4").mkdir(parents=True)
    assert _fresh_run(cfg).run_name == "exp-3"
    assert "holds an earlier run's checkpoints" in capsys.readouterr().err
    assert (tmp_path / "exp" / "checkpoints" / "8").is_dir(), "the earlier run is left as it is"


def test_without_checkpoints_the_name_is_kept_and_a_users_own_directory_is_refused(tmp_path):
    (tmp_path / "exp" / "checkpoints" / "8").mkdir(parents=True)
    assert _fresh_run(_cfg(tmp_path)).run_name == "exp"   # this run neither writes nor resumes checkpoints
    mine = tmp_path / "mine"
    (mine / "12").mkdir(parents=True)
    with pytest.raises(ConfigError, match="elastic_checkpoint_directory .* holds an earlier run's checkpoints"):
        _fresh_run(_cfg(tmp_path, "enable_checkpointing=true", f"elastic_checkpoint_directory={mine}"))
