"""A pipelined run on worker processes: 2 stages x 2 replicas, activations over the data plane, each stage's
gradients reduced among its replicas; the same losses and final state, bit for bit, as the one-process
pipelined run under the other schedule."""

import json

from tests.conftest import run_cli


def events(run_dir):
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def test_stage_workers_train_the_one_process_pipeline_bit_for_bit(tmp_path):
    common = ["tiny", "steps=3", "dcn_pipeline_parallelism=2", "dcn_data_parallelism=2", "ici_fsdp_parallelism=1",
              "elastic_standby_workers=0"]
    _, workers = run_cli(["run", *common, "elastic_pipeline_schedule=gpipe", "run_name=workers"], tmp_path)
    _, reference = run_cli(["run", *common, "run_name=reference", "--reference"], tmp_path)
    assert workers["steps_completed"] == 3 and workers["losses"] == reference["losses"]
    finished = {run: next(e for e in events(tmp_path / run) if e["kind"] == "run_finished")
                for run in ("workers", "reference")}
    assert finished["workers"]["final_state_digest"] == finished["reference"]["final_state_digest"]
    hashes = finished["workers"]["replica_hashes"]   # w0, w1: stage 0's replicas; w2, w3: stage 1's
    assert hashes["w0"] == hashes["w1"] != hashes["w2"] == hashes["w3"]
    assert sorted(finished["reference"]["replica_hashes"].values()) == sorted({hashes["w0"], hashes["w2"]})
    committed = [e for e in events(tmp_path / "workers") if e["kind"] == "step_committed"]
    assert [sorted(e["microbatches"]) for e in committed] == [["w2", "w3"]] * 3   # the last stage's losses
