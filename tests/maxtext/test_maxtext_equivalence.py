"""A pipelined MaxText config on jax-elastic's workers against MaxText's own trainer on the same file.

MaxText's pre-training trainer (``python -m maxtext.trainers.pre_train.train``)
runs in a subprocess while the same file runs through jax-elastic's command for
MaxText (``python -m integrations.maxtext``, in this process). One slice of the
dense tiny config reproducing MaxText's trainer to the bit is checked beside
the checkpoint round trip (``test_maxtext_checkpoints.py``, which runs that
trainer anyway); the MoE model's in ``test_maxtext_models.py``.
"""

import pathlib

import pytest

pytest.importorskip("maxtext")   # the MaxText integration's requirements (integrations/maxtext/requirements.txt)

from integrations.maxtext.__main__ import main  # noqa: E402
from tests.maxtext.trainers import elastic_losses, finished, maxtext_trainer, stop  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


def both_sides(config, tmp_path, capsys, steps, trainer_overrides=(), elastic_args=()):
    """(jax-elastic's losses, MaxText's trainer's losses) on ``config``: MaxText's trainer runs in a subprocess
    beside the jax-elastic run (``python -m integrations.maxtext``, in this process)."""
    proc = maxtext_trainer(config, tmp_path, f"steps={steps}", *trainer_overrides)
    try:
        assert main([str(config), f"steps={steps}", f"base_output_directory={tmp_path}", "run_name=elastic",
                     *elastic_args]) == 0
        assert f"{steps}/{steps} steps" in capsys.readouterr().out
        ours = elastic_losses(tmp_path / "elastic")
        theirs = [m["learning/loss"] for m in finished(proc, tmp_path)]
    finally:
        stop(proc)
    return ours, theirs


PIPELINE = ROOT / "integrations" / "maxtext" / "configs" / "tiny_pipeline.yml"


def test_pipelined_run_on_workers_matches_maxtext_trainer_on_the_same_model_and_batch(tmp_path, monkeypatch,
                                                                                       capsys):
    """tiny_pipeline.yml (2 stages, 4 microbatches) on worker processes against MaxText's own trainer on the same
    file with its pipeline folded onto one CPU device (MaxText's SPMD pipeline needs a slice per dcn stage, and
    0.2.5's unscanned pipeline does not run): the same model, initial weights, global batch (2 x 2 = 4 examples a
    step) and optimizer. The math differs only in order: MaxText takes the mean loss of the whole batch in one
    program, jax-elastic the mean of four microbatch means, and each stage clips its own gradients (Adam's update
    is nearly blind to that scale). Tolerance: 1e-5 relative; docs/maxtext.md#pipeline-stages."""
    monkeypatch.setenv("XLA_FLAGS", "")
    steps = 4
    ours, theirs = both_sides(PIPELINE, tmp_path, capsys, steps,
                              trainer_overrides=["dcn_pipeline_parallelism=1", "num_pipeline_microbatches=-1",
                                                 "per_device_batch_size=4", "scan_layers=false"],
                              elastic_args=["elastic_enabled=false"])
    with capsys.disabled():
        print(f"\nMaxText trainer (one device): {theirs}\njax-elastic, 2 stages:        {ours}")
    assert len(ours) == len(theirs) == steps
    assert theirs[0] != theirs[-1]   # it trained
    assert ours == pytest.approx(theirs, rel=1e-5, abs=0)
