"""``hardware=gpu`` on a host without a GPU: the client exports CUDA programs, its real worker process (JAX's
own choice of platform: the CPU here) refuses them when it loads them, and the run fails with one line that
names both platforms and the config key."""

import os
import pathlib
import subprocess
import sys

from tests.support.events import run_events

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_gpu_programs_on_a_cpu_worker_fail_the_run_at_load_naming_the_key(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for k in ("JAX_PLATFORMS", "XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE"):
        env.pop(k, None)   # as a user runs it: the hardware key alone chooses the platform
    cmd = [sys.executable, "-m", "elastic.cli", "run", "tiny", "hardware=gpu", "steps=2", "dcn_data_parallelism=1",
           "ici_fsdp_parallelism=1", "elastic_microbatches=1", "elastic_standby_workers=0",
           f"base_output_directory={tmp_path}", "run_name=gpu", "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in tmp_path.rglob("*.log"))
    assert proc.returncode == 1, f"{proc.stdout}\n{proc.stderr}\n{logs}"
    failed = [line for line in proc.stderr.splitlines() if line.startswith("elastic: run failed:")]
    assert len(failed) == 1, proc.stderr
    assert "INVALID_ARGUMENT: the 'init' program: exported for cuda (config key hardware: gpu), but this " \
           "worker's JAX runs on cpu. Set the config key 'hardware' to cpu" in failed[0]
    events = run_events(tmp_path / "gpu")
    registered = [e for e in events if e["kind"] == "worker_registered"]
    assert [e["platform"] for e in registered] == ["cpu"]   # JAX's own choice on this host
    assert not any(e["kind"] == "programs_loaded" for e in events)
    assert any(e["kind"] == "run_failed" and "exported for cuda" in e["error"] for e in events)
