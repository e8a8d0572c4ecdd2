"""One slice of jax-elastic reproduces MaxText's own trainer on the same config, loss by loss, to the bit.

MaxText's pre-training trainer (``python -m maxtext.trainers.pre_train.train``)
runs in a subprocess on the tiny config while the same file runs through
jax-elastic's command for MaxText (``python -m integrations.maxtext ...
--reference``: the canonical math of one slice, in this process). One device per slice and one microbatch: the grad and
apply programs then compute exactly what MaxText's fused, jitted train step
does (same initialisation, same synthetic batch, same ops), and XLA gives the
same bits.
"""

import pathlib

import pytest

pytest.importorskip("maxtext")   # the MaxText integration's requirements (integrations/maxtext/requirements.txt)

from integrations.maxtext.__main__ import main  # noqa: E402
from tests.maxtext.trainers import elastic_losses, finished, maxtext_trainer, stop  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "integrations" / "maxtext" / "configs" / "tiny.yml"
STEPS = 3


def test_one_slice_reproduces_maxtext_trainer_bit_for_bit(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", "")   # main sets a slice's device count (1 here); restored after the test
    proc = maxtext_trainer(TINY, tmp_path, f"steps={STEPS}")   # runs beside the jax-elastic run below
    try:
        assert main([str(TINY), f"steps={STEPS}", f"base_output_directory={tmp_path}", "run_name=elastic",
                     "--reference"]) == 0
        assert f"{STEPS}/{STEPS} steps" in capsys.readouterr().out
        ours = elastic_losses(tmp_path / "elastic")
        theirs = [m["learning/loss"] for m in finished(proc, tmp_path)]
    finally:
        stop(proc)
    with capsys.disabled():
        print(f"\nMaxText trainer: {theirs}\njax-elastic:     {ours}")
    assert len(ours) == len(theirs) == STEPS
    assert ours == theirs   # float32 values, compared exactly
