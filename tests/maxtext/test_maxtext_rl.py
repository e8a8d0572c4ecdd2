"""MaxText's model as an RL policy (integrations/maxtext/rl.py): ``elastic chaos`` on a MaxText config with
``rl_samplers``. A sampler and then a trainer are killed; the run ends bit-identical to its one-process
reference, every step's rollouts made with the weights of the step before it was trained on (on-policy)."""

import pathlib

import pytest

pytest.importorskip("maxtext")   # the MaxText integration's requirements (integrations/maxtext/requirements.txt)

from tests.conftest import run_cli  # noqa: E402

TINY_RL = pathlib.Path(__file__).resolve().parents[2] / "integrations" / "maxtext" / "configs" / "tiny_rl.yml"


def test_maxtexts_decoder_as_the_policy_survives_a_sampler_and_a_trainer_kill_bit_identically(tmp_path):
    _, report = run_cli(["chaos", str(TINY_RL), "steps=6", "--faults",
                         "kill:role=sampler@step=2,kill:role=trainer@step=4"], tmp_path, timeout=600)
    assert report["verdict"] == "pass" and report["trajectory"] == "identical", report["verdict_reasons"]
    assert report["steps_lost"] == 0 and [f["path"] for f in report["faults"]] == ["reassign", "shrink"]
    assert [s["version"] for s in report["rl"]["steps"]] == list(range(6))
