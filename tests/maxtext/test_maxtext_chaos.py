"""MaxText configs reading real files survive worker kills: ``elastic chaos`` on MaxText's config file.

The CLI finds the MaxText config through the ``elastic.configs`` entry point
(``integrations.maxtext.cli``), loads it with MaxText's own config code,
runs the fault-free reference and the faulted run, and judges it. The data
is MaxText's grain pipeline on small real files (tokenized with the
sentencepiece tokenizer MaxText ships, packed), served by (step, microbatch):
the verdict's exactly-once and identical trajectory hold across a spare
taking a dead slice's place and across the survivors sharing its microbatches.
"""

import pathlib

import pytest

pytest.importorskip("maxtext")   # the MaxText integration's requirements (integrations/maxtext/requirements.txt)

from tests.conftest import run_cli  # noqa: E402
from tests.maxtext.text_files import documents, write_arrayrecord, write_parquet  # noqa: E402

TINY = pathlib.Path(__file__).resolve().parents[2] / "integrations" / "maxtext" / "configs" / "tiny.yml"
LLAMA2 = pathlib.Path(__import__("maxtext").__file__).parent / "assets" / "tokenizers" / "tokenizer.llama2"
TEXT = ["dataset_type=grain", f"tokenizer_path={LLAMA2}", "vocab_size=32000", "packing=true", "num_epoch=100",
        "elastic_relaunch=false", "elastic_standby_workers=0"]   # no relaunch, no standby: fewer processes on CI


def test_arrayrecord_packed_worker_kill_on_two_slices_and_a_spare_passes(tmp_path):
    write_arrayrecord(tmp_path / "part-0.array_record", documents(30))
    write_arrayrecord(tmp_path / "part-1.array_record", documents(30, seed=1))
    _, report = run_cli(["chaos", str(TINY), "steps=5", "dcn_data_parallelism=2", "elastic_spares=1", *TEXT,
                         "grain_file_type=arrayrecord", f"grain_train_files={tmp_path}/*.array_record",
                         "run_name=kill", "--faults", "kill@step=3"], tmp_path)
    assert report["verdict"] == "pass", report.get("verdict_reasons")
    assert (report["steps_completed"], report["steps_lost"], report["checkpoint_restores"]) == (5, 0, 0)
    assert report["trajectory"] == "identical" and report["exactly_once"]
    assert [f["path"] for f in report["faults"]] == ["replace"]
    assert report["config"]["dcn_data_parallelism"] == 2 and "elastic_spares" in report["config"]


def test_parquet_worker_kill_shrinks_and_the_survivor_takes_its_microbatches(tmp_path):
    write_parquet(tmp_path / "docs.parquet", documents(60))
    _, report = run_cli(["chaos", str(TINY), "steps=4", "dcn_data_parallelism=2", "elastic_microbatches=4", *TEXT,
                         "grain_file_type=parquet", f"grain_train_files={tmp_path}/*.parquet",
                         "run_name=shrink", "--faults", "kill@step=2"], tmp_path)
    assert report["verdict"] == "pass", report.get("verdict_reasons")
    assert (report["steps_completed"], report["steps_lost"]) == (4, 0)
    assert report["trajectory"] == "identical" and report["exactly_once"]
    assert [f["path"] for f in report["faults"]] == ["shrink"]
