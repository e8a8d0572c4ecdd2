"""The run's goodput as ml-goodput-measurement events, checked with the library's own calculator."""

import datetime
import json

import pytest

from elastic.report import goodput
from elastic.report.goodput_log import recorder_calls, write_goodput_log

gp = pytest.importorskip("ml_goodput_measurement.src.goodput")   # the goodput extra; installed by [dev]


def _log(failure=False):
    ev = [{"t": 100.0, "kind": "job_started", "mode": "distributed", "config": {}, "global_batch_size": 4,
           "microbatches": 2}, {"t": 101.0, "kind": "programs_built"},
          {"t": 102.0, "kind": "placement", "active": [0, 1]}, {"t": 104.0, "kind": "programs_loaded",
                                                              "compile_seconds": {"w": 2.0}},
          {"t": 105.0, "kind": "state_initialized"}]
    t = 105.0
    for step in range(10):
        t += 1.0
        if failure and step == 4:
            ev += [{"t": t, "kind": "fault_injected"},
                   {"t": t + 0.5, "kind": "failure_detected", "committed": 4, "error": "WorkerLostError",
                    "detail": ""},
                   {"t": t + 2.0, "kind": "recovered"}]
            t += 3.0
        ev.append({"t": t, "kind": "step_committed", "step": step, "epoch": 0, "loss": 1.0})
    ev.append({"t": t + 0.5, "kind": "run_finished", "steps_completed": 10, "final_state_digest": "x",
               "replica_hashes": {}, "client_peak_rss_bytes": 0})
    return ev


class _Reader:
    """The library's logger interface over goodput_log.jsonl (what GoodputCalculator reads)."""

    def __init__(self, path, job_name):
        self.job_name, self.entries = job_name, [json.loads(x) for x in path.read_text().splitlines()]
        self.job_start_time = None

    def write_cloud_logging_entry(self, entry):
        raise AssertionError("the calculator only reads")

    def read_cloud_logging_entries(self, start_time=None, end_time=None, last_entry_info=None):
        return list(self.entries), (datetime.datetime.now(datetime.timezone.utc), str(len(self.entries)))


def _library_goodput(tmp_path, events, job="job"):
    path = write_goodput_log(tmp_path, events, job)
    calc = gp.GoodputCalculator(job, f"goodput_{job}", cloud_logger=_Reader(path, job), cache_dir=str(tmp_path))
    return calc.get_job_goodput(include_badput_breakdown=True)


def test_a_steady_run_has_the_same_goodput_by_the_library(tmp_path):
    events = _log()
    ours = goodput(events)["goodput_fraction"] * 100
    percent, badput, last_step = _library_goodput(tmp_path, events)
    assert percent == pytest.approx(ours, abs=5.0)
    assert last_step >= 9
    assert badput[gp.BadputType.TPU_INITIALIZATION] > 0 and badput[gp.BadputType.TRAINING_PREP] > 0


def test_a_disruption_is_badput_for_the_library_too(tmp_path):
    steady, _, _ = _library_goodput(tmp_path, _log())
    percent, badput, _ = _library_goodput(tmp_path, _log(failure=True), job="faulted")
    assert percent < steady - 5
    # No process restarted, so the library sees one anomalously long step, not a job restart: "other" badput.
    assert badput[gp.BadputType.OTHER] > 0


def test_the_interrupted_step_starts_again_at_recovery():
    calls = recorder_calls(_log(failure=True))
    starts = [args for name, args in calls if name == "record_step_start_time"]
    assert [s for s, _ in starts] == [0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 9]
    assert starts[5][1] == 112.0   # recovered
    assert calls[0] == ("record_job_start_time", (100.0,)) and calls[-1] == ("record_job_end_time", (118.5,))
    assert recorder_calls([]) == []


def test_a_run_with_goodput_recording_writes_the_events(tmp_path):
    from elastic.cli_support import bundled_trainer
    from elastic.config_loading import load_config

    cfg = load_config("tiny", ["steps=3", "dcn_data_parallelism=1", "ici_fsdp_parallelism=1",
                               "elastic_microbatches=1", "enable_goodput_recording=true", "run_name=gp",
                               f"base_output_directory={tmp_path}"])
    bundled_trainer(cfg).fit(reference=True)
    entries = [json.loads(x) for x in (tmp_path / "gp" / "goodput_log.jsonl").read_text().splitlines()]
    assert all(e["job_name"] == "gp" for e in entries)
    assert [e["step_count"] for e in entries if "step_count" in e] == [0, 1, 2]
    assert "job_start_time" in entries[0] and "job_end_time" in entries[-1]
