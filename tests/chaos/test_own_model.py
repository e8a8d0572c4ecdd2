"""A user's own model under faults: from the pytest fixture and from the command line.

The model (tests/chaos/own_model.py) is not the bundled one: a jitted fused
step, a function data source. Both runs must end with the verdict's full
guarantees, and its report must not carry the bundled model's keys.
"""

import json
import pathlib

import elastic
from tests.chaos import own_model
from tests.conftest import run_cli

SHAPE = ["steps=6", "dcn_data_parallelism=2", "ici_fsdp_parallelism=2", "elastic_microbatches=2",
         "elastic_spares=1"]


def guarantees(report, steps=6):
    assert report["verdict"] == "pass", report["verdict_reasons"]
    assert report["steps_completed"] == steps and report["steps_lost"] == 0
    assert report["checkpoint_restores"] == 0 and report["exactly_once"] is True
    assert report["losses"] == report["reference"]["losses"]
    assert report["final_state_digest"] == report["reference"]["final_state_digest"]
    assert "vocab_size" not in report["config"] and "learning_rate" not in report["config"]


def test_own_model_survives_a_kill_under_the_pytest_fixture(elastic_chaos):
    job = own_model.make_job(elastic.load_config("tiny", SHAPE))
    result = elastic_chaos(job, faults="kill:slice=1@step=3")
    result.assert_passed()
    guarantees(result.report)
    assert [f["kind"] for f in result.report["faults"]] == ["kill"]
    # The reference needed 2 devices; this process's JAX has fewer, so it ran in a child process.
    reference = json.loads((pathlib.Path(result.report["reference"]["run_dir"]) / "report.json").read_text())
    assert reference["mode"] == "reference" and reference["step_seconds_median"] > 0


def test_own_model_under_elastic_chaos_from_the_command_line(tmp_path):
    proc, report = run_cli(["chaos", "tiny", "--trainer", "tests.chaos.own_model:make_job", *SHAPE,
                            "run_name=own", "--faults", "kill@step=2"], tmp_path)
    guarantees(report)
    assert report["config"]["elastic_trainer"] == "tests.chaos.own_model:make_job"
    assert "PASS" in proc.stdout
