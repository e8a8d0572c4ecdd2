"""One slice of jax-elastic reproduces MaxText's own trainer on the same config, loss by loss, to the bit.

MaxText's pre-training trainer (``python -m maxtext.trainers.pre_train.train``)
runs in a subprocess on the tiny config while the same file runs through
jax-elastic's command for MaxText (``python -m integrations.maxtext ...
--reference``: the canonical math of one slice, in this process). One device per slice and one microbatch: the grad and
apply programs then compute exactly what MaxText's fused, jitted train step
does (same initialisation, same synthetic batch, same ops), and XLA gives the
same bits.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("maxtext")   # the MaxText integration's requirements (integrations/maxtext/requirements.txt)

from integrations.maxtext.__main__ import main  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "integrations" / "maxtext" / "configs" / "tiny.yml"
STEPS = 3


def maxtext_trainer(tmp_path) -> subprocess.Popen:
    """MaxText's own trainer on TINY, writing its per-step scalars to metrics.jsonl."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)   # compile from scratch: nothing shared with the run under test
    args = [sys.executable, "-m", "maxtext.trainers.pre_train.train", str(TINY), f"steps={STEPS}",
            f"base_output_directory={tmp_path / 'maxtext'}", "run_name=reference", "jax_cache_dir=",
            f"dump_hlo_local_dir={tmp_path / 'dump'}", f"metrics_file={tmp_path / 'metrics.jsonl'}", "log_config=false"]
    return subprocess.Popen(args, cwd=tmp_path, env=env, stdout=open(tmp_path / "maxtext.log", "w"),
                            stderr=subprocess.STDOUT)


def test_one_slice_reproduces_maxtext_trainer_bit_for_bit(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", "")   # main sets a slice's device count (1 here); restored after the test
    proc = maxtext_trainer(tmp_path)   # runs beside the jax-elastic run below
    try:
        assert main([str(TINY), f"steps={STEPS}", f"base_output_directory={tmp_path}", "run_name=elastic",
                     "--reference"]) == 0
        assert f"{STEPS}/{STEPS} steps" in capsys.readouterr().out
        ours = [json.loads(line)["loss"] for line in (tmp_path / "elastic" / "events.jsonl").read_text().splitlines()
                if '"step_committed"' in line]
        assert proc.wait(timeout=300) == 0, (tmp_path / "maxtext.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    theirs = [json.loads(line)["learning/loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    with capsys.disabled():
        print(f"\nMaxText trainer: {theirs}\njax-elastic:     {ours}")
    assert len(ours) == len(theirs) == STEPS
    assert ours == theirs   # float32 values, compared exactly
