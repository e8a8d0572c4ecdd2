"""MaxText configs reading real files survive worker kills: ``elastic chaos`` on MaxText's config file.

The CLI finds the MaxText config through the ``elastic.configs`` entry point
(``integrations.maxtext.cli``), loads it with MaxText's own config code,
runs the fault-free reference and the faulted run, and judges it. The data
is MaxText's grain pipeline on small real ArrayRecord files on the GCS protocol server (tokenized with the
sentencepiece tokenizer MaxText ships, packed), served by (step, microbatch):
the verdict's exactly-once and identical trajectory hold across a spare
taking a dead slice's place and across the survivors sharing its microbatches.
"""

import pathlib

import pytest

pytest.importorskip("maxtext")   # the MaxText integration's requirements (integrations/maxtext/requirements.txt)

from tests.conftest import run_cli  # noqa: E402
from tests.gcs_emulator import GcsEmulator, emulator_binary  # noqa: E402
from tests.maxtext.text_files import documents, upload, write_arrayrecord  # noqa: E402
from tests.support.metrics_files import metrics_file_lines  # noqa: E402

TINY = pathlib.Path(__file__).resolve().parents[2] / "integrations" / "maxtext" / "configs" / "tiny.yml"
LLAMA2 = pathlib.Path(__import__("maxtext").__file__).parent / "assets" / "tokenizers" / "tokenizer.llama2"
TEXT = ["dataset_type=grain", f"tokenizer_path={LLAMA2}", "vocab_size=32000", "packing=true", "num_epoch=100",
        "elastic_relaunch=false", "elastic_standby_workers=0"]   # no relaunch, no standby: fewer processes on CI


@pytest.mark.skipif(not emulator_binary(), reason="fake-gcs-server is not installed (the dev extra)")
def test_gcs_arrayrecord_packed_worker_kills_a_spare_takes_one_place_then_the_survivor_takes_the_microbatches(
        tmp_path, monkeypatch):
    """One run, both paths: slice 1's worker is killed at step 2 (the spare takes its place), slice 0's at step 3
    (no spare left, no relaunch: the run shrinks to one slice, which takes all four microbatches). The files are
    on the GCS protocol server (gs://, as on a cluster): the client lists and indexes them, each worker fetches
    the shards of its own rows into the host's cache."""
    write_arrayrecord(tmp_path / "part-0.array_record", documents(30))
    write_arrayrecord(tmp_path / "part-1.array_record", documents(30, seed=1))
    with GcsEmulator(tmp_path / "fake-gcs-server.log") as gcs:
        gcs.create_bucket("data")
        upload(gcs.endpoint, "data", {f"text/{p.name}": p for p in tmp_path.glob("*.array_record")})
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)   # the client and its workers reach it
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "host-cache"))
        _, report = run_cli(["chaos", str(TINY), "steps=5", "dcn_data_parallelism=2", "elastic_spares=1",
                             "elastic_microbatches=4", *TEXT, "grain_file_type=arrayrecord",
                             "grain_train_files=gs://data/text/*.array_record", "run_name=kill",
                             f"metrics_file={tmp_path / 'metrics.jsonl'}",
                             "--faults", "kill:slice=1@step=2,kill:slice=0@step=3"], tmp_path)
    fetched = sorted(p.name.split(".g")[0] for p in (tmp_path / "host-cache").rglob("*.array_record.g*"))
    assert fetched == ["part-0.array_record", "part-1.array_record"]
    assert report["verdict"] == "pass", report.get("verdict_reasons")
    assert (report["steps_completed"], report["steps_lost"], report["checkpoint_restores"]) == (5, 0, 0)
    assert report["trajectory"] == "identical" and report["exactly_once"]
    assert [f["path"] for f in report["faults"]] == ["replace", "shrink"]
    assert report["slices_at_end"] == 1
    assert report["config"]["dcn_data_parallelism"] == 2 and "elastic_spares" in report["config"]
    # MaxText's metrics_file: a line per committed step with the scalars MaxText's trainer writes
    lines = metrics_file_lines(tmp_path / "metrics.jsonl")
    assert [line["learning/loss"] for line in lines] == report["losses"]
    assert [line["step"] for line in lines] == [0.0, 1.0, 2.0, 3.0, 4.0] and lines[0]["run_name"] == "kill"
    assert {"learning/current_learning_rate", "perf/step_time_seconds", "perf/per_device_tflops_per_sec",
            "perf/per_device_tokens_per_sec", "elastic/slices_live"} <= lines[-1].keys()
    assert [line["elastic/slices_live"] for line in lines][-1] == 1.0
