"""Every active replica lost at once: the run restores its newest complete checkpoint instead of failing.

One real run (CLI, real workers, real orbax checkpoints on local disk): a
checkpoint every 4 steps written by one replica in the background, then
``kill:all`` kills every active worker. The spare loads the checkpoint, the
lost steps are recomputed, and the run ends bit-identical to the fault-free
reference. The verdict is "fail" by its definition (steps were recomputed and
a checkpoint was restored), with exactly those reasons; nothing else is wrong.
"""

import json
import pathlib

from tests.conftest import run_cli


def test_kill_all_restores_the_newest_checkpoint_and_ends_bit_identical(tmp_path):
    proc, _ = run_cli(["chaos", "tiny", "steps=30", "dcn_data_parallelism=2", "ici_fsdp_parallelism=1",
                       "elastic_microbatches=2", "elastic_spares=1", "enable_checkpointing=true",
                       "checkpoint_period=4", "run_name=ck", "--faults", "kill:all@step=24"], tmp_path, check=False)
    run_dir = pathlib.Path(tmp_path) / "ck"
    report = json.loads((run_dir / "report.json").read_text())
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert proc.returncode == 1, proc.stderr   # the verdict fails: steps were recomputed
    assert report["finished"] and report["steps_completed"] == 30
    assert report["final_state_sha256"] == report["reference"]["final_state_sha256"]
    assert report["losses"] == report["reference"]["losses"]
    restored = [e for e in events if e["kind"] == "checkpoint_restored"]
    assert len(restored) == 1 and report["checkpoint_restores"] == 1
    step = restored[0]["step"]
    assert step in (8, 12, 16, 20, 24) and restored[0]["steps_lost"] == report["steps_lost"] > 0
    assert report["failures"][-1]["restore_tier"] == "checkpoint" and report["failures"][-1]["path"] == "restore"
    reasons = " ".join(report["verdict_reasons"])
    assert "recomputed" in reasons and "checkpoint" in reasons
    assert report["trajectory"] == "identical"
    saved = sorted(e["step"] for e in events if e["kind"] == "checkpoint_saved")
    assert saved[-1] == 30, saved   # the last step is saved too, before the run finishes
    assert (run_dir / "checkpoints").is_dir()
