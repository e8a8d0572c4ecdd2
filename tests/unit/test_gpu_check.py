"""The prepared GPU check (scripts/gpu_check.py): its comparison of final states, and that on a host without a
GPU it says so and runs nothing. (``--cpu-dry-run`` runs the whole check on the CPU; too slow for here.)"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_final_states_compare_within_the_stated_tolerance():
    g = _module()
    cpu = [np.array([1.0, -2.0, 0.0], np.float32), np.array(7, np.int32)]
    near = [cpu[0] * np.float32(1 + g.STATE_RTOL / 2) + np.float32(g.STATE_ATOL / 2), np.array(7, np.int32)]
    assert g.compare_states(near, cpu)["bad"] == []
    far = [cpu[0] + np.float32(0.01), np.array(7, np.int32)]
    assert g.compare_states(far, cpu)["bad"] == ["leaf 0 (3,): max |diff| 0.01"]
    assert g.compare_states([cpu[0], np.array(8, np.int32)], cpu)["bad"] == ["leaf 1 (int32) differs"]
    assert g.max_rel([1.0, 2.0001], [1.0, 2.0]) == (2.0001 - 2.0) / 2.0


def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("JAX_PLATFORMS", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("NO GPU: JAX found no GPU on this host") and last.endswith("VERDICT: NO GPU")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["summary.json"]
