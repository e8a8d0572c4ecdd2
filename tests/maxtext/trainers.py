"""MaxText's own trainer as the tests run it beside jax-elastic, and the losses each side wrote."""

import json
import os
import pathlib
import subprocess
import sys

from tests.conftest import MAXTEXT_TRAINER_CACHE


def maxtext_trainer(config, tmp_path: pathlib.Path, *overrides: str, name: str = "maxtext",
                    run_dir: pathlib.Path | None = None) -> subprocess.Popen:
    """``python -m maxtext.trainers.pre_train.train CONFIG OVERRIDES`` on one CPU device, in ``run_dir``
    (default ``<tmp_path>/maxtext/reference``); its per-step scalars go to ``<tmp_path>/<name>.jsonl``, its
    output to ``<name>.log``. Its JAX compilation cache is the suite's cache of MaxText's trainer runs alone
    (``tests/conftest.py``): nothing is shared with the jax-elastic runs it is compared with, and a program
    compiled by an earlier trainer run is the same executable."""
    run_dir = run_dir or tmp_path / "maxtext" / "reference"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")   # every program, however quick to compile
    env.pop("JAX_COMPILATION_CACHE_DIR", None)   # not jax-elastic's cache: nothing shared with the run under test
    cache = os.environ.get(MAXTEXT_TRAINER_CACHE, "")
    args = [sys.executable, "-m", "maxtext.trainers.pre_train.train", str(config), *overrides,
            f"base_output_directory={run_dir.parent}", f"run_name={run_dir.name}", f"jax_cache_dir={cache}",
            f"dump_hlo_local_dir={tmp_path / 'dump'}", f"metrics_file={tmp_path / f'{name}.jsonl'}", "log_config=false"]
    return subprocess.Popen(args, cwd=tmp_path, env=env, stdout=open(tmp_path / f"{name}.log", "w"),
                            stderr=subprocess.STDOUT)


def finished(proc: subprocess.Popen, tmp_path: pathlib.Path, name: str = "maxtext") -> list[dict]:
    """The per-step scalars of the trainer ``proc`` once it exited 0 (else its log's tail as the failure)."""
    assert proc.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    return [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]


def stop(proc: subprocess.Popen) -> None:
    """Kills the trainer ``proc`` if it still runs (a test that failed before waiting for it)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def elastic_losses(run_dir: pathlib.Path) -> list[float]:
    """The losses of the steps a jax-elastic run committed, from its event log."""
    return [json.loads(line)["loss"] for line in (run_dir / "events.jsonl").read_text().splitlines()
            if '"step_committed"' in line]
