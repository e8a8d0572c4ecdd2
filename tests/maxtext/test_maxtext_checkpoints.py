"""A run moves from MaxText's trainer onto jax-elastic and back, through checkpoints, without changing a bit.

MaxText's own trainer (``python -m maxtext.trainers.pre_train.train``) trains
the tiny config for 2 steps and checkpoints; jax-elastic (local workers)
starts from that checkpoint (``load_full_state_path`` in MaxText's
``<step>/items`` form) and trains steps 2-3, writing its checkpoint in
MaxText's layout; MaxText's trainer then auto-resumes from jax-elastic's run
directory and trains steps 4-5. The six losses equal MaxText's trainer
running all six steps, float for float: the whole train state (weights,
AdamW moments, step count, RNG streams) crossed both ways exactly.
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
SCHEDULE = ["learning_rate_schedule_steps=6"]   # every link keeps the 6-step run's learning-rate schedule


def maxtext_trainer(tmp_path, name: str, run_dir: pathlib.Path, steps: int, checkpoints: bool) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    args = [sys.executable, "-m", "maxtext.trainers.pre_train.train", str(TINY), f"steps={steps}", *SCHEDULE,
            f"base_output_directory={run_dir.parent}", f"run_name={run_dir.name}", "jax_cache_dir=",
            f"dump_hlo_local_dir={tmp_path / 'dump'}", f"metrics_file={tmp_path / f'{name}.jsonl'}",
            "log_config=false", f"enable_checkpointing={str(checkpoints).lower()}", "checkpoint_period=2",
            "async_checkpointing=false", "skip_jax_distributed_system=true"]
    return subprocess.Popen(args, cwd=tmp_path, env=env, stdout=open(tmp_path / f"{name}.log", "w"),
                            stderr=subprocess.STDOUT)


def finished(proc: subprocess.Popen, tmp_path, name: str) -> list[float]:
    assert proc.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    return [json.loads(line)["learning/loss"] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]


def test_maxtext_to_jax_elastic_to_maxtext_equals_maxtexts_own_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", "")   # main sets a slice's device count (1 here); restored after the test
    straight = maxtext_trainer(tmp_path, "straight", tmp_path / "straight" / "r", 6, checkpoints=False)
    first = maxtext_trainer(tmp_path, "first", tmp_path / "maxtext" / "r", 2, checkpoints=True)
    try:
        first_losses = finished(first, tmp_path, "first")
        theirs = tmp_path / "maxtext" / "r" / "checkpoints" / "1" / "items"   # MaxText's: the state after step 1
        assert theirs.is_dir()
        elastic_dir = tmp_path / "elastic" / "r"
        assert main([str(TINY), "steps=4", *SCHEDULE, f"base_output_directory={elastic_dir.parent}", "run_name=r",
                     "enable_checkpointing=true", "checkpoint_period=4", f"load_full_state_path={theirs}"]) == 0
        assert "4/4 steps" in capsys.readouterr().out
        events = [json.loads(line) for line in (elastic_dir / "events.jsonl").read_text().splitlines()]
        resumed = next(e for e in events if e["kind"] == "run_resumed")
        assert (resumed["step"], resumed["tier"]) == (2, "checkpoint")
        assert [e["step"] for e in events if e["kind"] == "checkpoint_saved"] == [4]
        ours = [e["loss"] for e in events if e["kind"] == "step_committed"]
        last = finished(maxtext_trainer(tmp_path, "last", elastic_dir, 6, checkpoints=True), tmp_path, "last")
        assert "restoring from this run's directory step 4" in (tmp_path / "last.log").read_text()
        reference = finished(straight, tmp_path, "straight")
    finally:
        for proc in (straight, first):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    chain = first_losses + ours + last
    with capsys.disabled():
        print(f"\nMaxText 6 steps:                 {reference}\nMaxText 2 -> jax-elastic 2 -> MaxText 2: {chain}")
    assert [len(first_losses), len(ours), len(last)] == [2, 2, 2]
    assert chain == reference   # float32 values, compared exactly
