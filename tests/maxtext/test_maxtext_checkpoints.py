"""A run moves from MaxText's trainer onto jax-elastic and back, through checkpoints, without changing a bit.

MaxText's own trainer (``python -m maxtext.trainers.pre_train.train``) trains
the tiny config for 6 steps, checkpointing after each; jax-elastic (local
workers) starts from its checkpoint after 2 steps (``load_full_state_path`` in MaxText's
``<step>/items`` form) and trains steps 2-3, writing its checkpoint in
MaxText's layout; MaxText's trainer then auto-resumes from jax-elastic's run
directory and trains steps 4-5. The six losses equal MaxText's own six,
float for float: the whole train state (weights,
AdamW moments, step count, RNG streams) crossed both ways exactly. One
jax-elastic slice from the seed equals that run too (the same
initialisation, synthetic batches and step: one device per slice and one
microbatch compute exactly what MaxText's fused train step does). And
``load_parameters_path`` fine-tunes from the weights of MaxText's checkpoint
exactly as MaxText's trainer does.
"""

import json
import pathlib
import subprocess

import pytest

pytest.importorskip("maxtext")   # the MaxText integration's requirements (integrations/maxtext/requirements.txt)

from elastic.cli import main as elastic_main  # noqa: E402
from integrations.maxtext.__main__ import main  # noqa: E402
from tests.maxtext.trainers import elastic_losses, finished, maxtext_trainer, stop  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "integrations" / "maxtext" / "configs" / "tiny.yml"
SCHEDULE = ["learning_rate_schedule_steps=6"]   # every link keeps the 6-step run's learning-rate schedule


def trainer(tmp_path, name: str, run_dir: pathlib.Path, steps: int, checkpoints: bool,
            extra=(), period: int = 2) -> subprocess.Popen:
    """MaxText's trainer on TINY in ``run_dir``, synchronous checkpoints every ``period`` steps when
    ``checkpoints``."""
    return maxtext_trainer(TINY, tmp_path, f"steps={steps}", *SCHEDULE,
                           f"enable_checkpointing={str(checkpoints).lower()}", f"checkpoint_period={period}",
                           "async_checkpointing=false", "skip_jax_distributed_system=true", *extra,
                           name=name, run_dir=run_dir)


def losses(proc: subprocess.Popen, tmp_path, name: str) -> list[float]:
    return [m["learning/loss"] for m in finished(proc, tmp_path, name)]


@pytest.fixture(scope="module")
def maxtext_run(tmp_path_factory):
    """MaxText's trainer, 6 steps with a checkpoint after each: ``(its checkpoint <1>/items, its 6 losses)``."""
    tmp_path = tmp_path_factory.mktemp("maxtext")
    run = losses(trainer(tmp_path, "first", tmp_path / "maxtext" / "r", 6, checkpoints=True, period=1), tmp_path,
                 "first")
    theirs = tmp_path / "maxtext" / "r" / "checkpoints" / "1" / "items"   # MaxText's: the state after step 1
    assert theirs.is_dir() and len(run) == 6
    return theirs, run


def test_maxtext_to_jax_elastic_to_maxtext_equals_maxtexts_own_run(maxtext_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", "")   # main sets a slice's device count (1 here); restored after the test
    theirs, reference = maxtext_run   # MaxText's own 6 steps; the chain starts from its state after 2
    first_losses = reference[:2]
    elastic_dir = tmp_path / "elastic" / "r"
    # The command line a user types; MaxText's checkpoint recorded no losses, so steps 0-1 have none.
    assert elastic_main(["run", str(TINY), "steps=4", *SCHEDULE, f"base_output_directory={elastic_dir.parent}",
                         "run_name=r", "enable_checkpointing=true", "checkpoint_period=4",
                         f"load_full_state_path={theirs}", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "4 / 4" in out and "(steps 0-1: no loss recorded)" in out, out
    report = json.loads((elastic_dir / "report.json").read_text())
    assert report["losses"][:2] == [None, None] and report["resumed_from"]["losses_recorded"] is False
    assert elastic_main(["report", str(elastic_dir), "--quiet"]) == 0   # re-rendered from the log alike
    assert "(steps 0-1: no loss recorded)" in capsys.readouterr().out
    events = [json.loads(line) for line in (elastic_dir / "events.jsonl").read_text().splitlines()]
    resumed = next(e for e in events if e["kind"] == "run_resumed")
    assert (resumed["step"], resumed["tier"]) == (2, "checkpoint")
    assert [e["step"] for e in events if e["kind"] == "checkpoint_saved"] == [4]
    ours = elastic_losses(elastic_dir)
    last = losses(trainer(tmp_path, "last", elastic_dir, 6, checkpoints=True), tmp_path, "last")
    assert "restoring from this run's directory step 4" in (tmp_path / "last.log").read_text()
    # One slice from the seed (jax-elastic's canonical math, python -m integrations.maxtext --reference) is
    # MaxText's own 6-step run too: the same initialisation, batches and step, to the bit.
    assert main([str(TINY), "steps=6", *SCHEDULE, f"base_output_directory={tmp_path}", "run_name=seed",
                 "--reference"]) == 0
    seed = elastic_losses(tmp_path / "seed")
    chain = first_losses + ours + last
    with capsys.disabled():
        print(f"\nMaxText 6 steps:                 {reference}\nMaxText 2 -> jax-elastic 2 -> MaxText 2: {chain}"
              f"\njax-elastic 6 steps, one slice:  {seed}")
    assert [len(first_losses), len(ours), len(last)] == [2, 2, 2]
    assert chain == reference   # float32 values, compared exactly
    assert seed == reference


def test_load_parameters_path_starts_from_maxtexts_weights_with_a_fresh_optimizer(maxtext_run, tmp_path,
                                                                                  monkeypatch, capsys):
    """MaxText's trainer and jax-elastic (workers, and the one-process reference) both fine-tune from the
    weights of MaxText's checkpoint: step 0, AdamW's moments from scratch; the same losses, exactly."""
    monkeypatch.setenv("XLA_FLAGS", "")
    theirs, _ = maxtext_run
    maxtext = trainer(tmp_path, "tune", tmp_path / "tune" / "r", 3, checkpoints=False,
                              extra=[f"load_parameters_path={theirs}"])
    try:
        common = [str(TINY), "steps=3", *SCHEDULE, f"base_output_directory={tmp_path}",
                  f"load_parameters_path={theirs}"]
        assert main([*common, "run_name=workers"]) == 0
        assert main([*common, "run_name=reference", "--reference"]) == 0
        tuned = losses(maxtext, tmp_path, "tune")
    finally:
        stop(maxtext)
    events = [json.loads(line) for line in (tmp_path / "workers" / "events.jsonl").read_text().splitlines()]
    assert [e.get("parameters_from") for e in events if e["kind"] == "state_initialized"] == [str(theirs)]
    with capsys.disabled():
        print(f"\nMaxText from its weights: {tuned}\njax-elastic from them:    {elastic_losses(tmp_path / 'workers')}")
    assert len(tuned) == 3
    assert elastic_losses(tmp_path / "workers") == elastic_losses(tmp_path / "reference") == tuned
    fresh = [5.3839030265808105, 5.376120567321777]   # MaxText's first losses from the seed: not these weights'
    assert tuned[:2] != fresh
