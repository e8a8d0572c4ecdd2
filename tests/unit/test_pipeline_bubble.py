"""The measured pipeline bubble: its one formula, what a stage's runner measures, what the controller records
per step, and the report's pipeline section folded from a hand-built log (pure, no processes)."""

import dataclasses
import json
import pathlib
import time
import types

import jsonschema
import numpy as np
import pytest

from elastic.report import build_report, render_html, summary_text
from runtime import EventLog, read_events
from runtime.control.controller import Controller
from runtime.control.controller_options import ControllerOptions
from runtime.core.timing import Clock
from runtime.pipeline.bubble import measured_bubble, stage_workers_bubble, theoretical_bubble
from runtime.pipeline.interpreter import LocalWire, StageRunner
from runtime.pipeline.schedule import compile_schedule
from tests.support.events import ev
from tests.support.fake_group import FakeGroup

SCHEMA = json.loads((pathlib.Path(__file__).resolve().parents[2] / "docs" / "report.schema.json").read_text())


# -- the formula ---------------------------------------------------------------------------------------------------

def test_the_bubble_is_the_idle_fraction_of_the_stages_over_the_step():
    assert measured_bubble([3.0, 3.0], 4.0) == pytest.approx(0.25)
    assert measured_bubble([1.0, 2.0, 3.0, 2.0], 3.0) == pytest.approx(1 - 8 / 12)
    assert measured_bubble([2.0, 2.0], 2.0) == 0.0
    with pytest.raises(ValueError, match="no bubble"):
        measured_bubble([1.0], 0.0)


def test_on_stage_workers_each_replica_counts_against_its_slowest_stream_and_replicas_are_averaged():
    # stage k -> replica r: replica 0 streams 4 s at most, replica 1 5 s
    busy = [[3.0, 2.0], [2.0, 3.0]]
    stream = [[4.0, 5.0], [3.5, 4.0]]
    expected = (measured_bubble([3.0, 2.0], 4.0) + measured_bubble([2.0, 3.0], 5.0)) / 2
    assert stage_workers_bubble(busy, stream) == pytest.approx(expected)
    assert stage_workers_bubble([[1.0], [1.0]], [[2.0], [0.0]]) == pytest.approx(0.5)   # the slowest stage counts
    assert stage_workers_bubble([[0.0], [0.0]], [[0.0], [0.0]]) is None   # workers that measured nothing
    assert stage_workers_bubble([], []) is None


def test_equal_stages_on_the_model_of_time_give_the_theoretical_bubble_through_the_same_formula():
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble(2, 2) == pytest.approx(1 / 3)


# -- what a stage's runner measures -----------------------------------------------------------------------------

class _Stage:
    """A stage executor that computes nothing: zeros of one float, each call lapped as the real one laps."""

    def __init__(self, last: bool):
        self.last = last

    def forward(self, step, microbatch, a_in, clock=None):
        if clock is not None:
            clock.lap("forward")
        return [np.zeros(1, np.float32)]

    def backward(self, step, microbatch, a_in, g_out, clock=None):
        if clock is not None:
            clock.lap("backward")
        return np.zeros(2, np.float32), [np.zeros(1, np.float32)]


def test_a_runner_counts_the_delay_as_compute_and_its_stream_from_first_instruction_to_last():
    sched = compile_schedule("gpipe", 2, [0, 1])
    clocks = [Clock(), Clock()]
    runners = [StageRunner(k, _Stage(k == 1), 0, clocks[k], delay=0.01) for k in range(2)]
    wire = LocalWire(runners, timeout=0.0)
    t0 = time.perf_counter()
    for k, instr in sched.order:
        runners[k].run(instr, wire)
    wall = time.perf_counter() - t0
    # stage 0: 2 forwards and 2 backwards; stage 1: 2 lasts, each a forward and a backward
    assert [r.busy >= 0.04 for r in runners] == [True, True]
    for r in runners:
        assert r.busy <= r.stream_seconds <= wall
    assert {"forward", "backward", "pipeline_wait", "pipeline_send"} <= set(clocks[0].seconds)
    assert {"backward", "pipeline_wait", "pipeline_send"} <= set(clocks[1].seconds)
    assert clocks[0].seconds["forward"] >= 0.02   # the delay is lapped with the compute it stands for
    assert StageRunner(0, _Stage(False), 0).stream_seconds == 0.0


# -- what the controller records ------------------------------------------------------------------------------

def _committed(tmp_path, stages: int, slices: int, reply=None) -> list[dict]:
    options = ControllerOptions(slices=slices, devices_per_slice=2, run_dir=str(tmp_path), spares=0,
                                watchdog_min_seconds=0.0, pipeline_stages=stages)
    events = EventLog(tmp_path / "events.jsonl")
    group = FakeGroup(options, events, None)
    if reply is not None:
        wait = group.wait
        group.wait = lambda futs, deadline=None: {w: reply(w, r) for w, r in wait(futs, deadline).items()}
    with Controller(types.SimpleNamespace(num_microbatches=4), b"", options, events, group=group) as ctl:
        ctl.train(2, seed=0)
    events.close()
    return [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "step_committed"]


def test_a_pipelined_step_records_each_stage_s_slowest_phases_and_the_measured_bubble(tmp_path):
    # 2 stages x 2 replicas, stage-major: w0, w1 are stage 0's replicas 0 and 1; w2, w3 stage 1's
    times = {"w0": (3.0, 4.0, 0.5), "w1": (2.0, 5.0, 0.7), "w2": (2.0, 3.5, 0.2), "w3": (3.0, 4.0, 0.1)}

    def reply(w, r):
        busy, stream, wait = times[w]
        return dataclasses.replace(r, phases={"backward": busy, "pipeline_wait": wait}, stage_busy_seconds=busy,
                                   stage_stream_seconds=stream)
    committed = _committed(tmp_path, 2, 4, reply)
    assert len(committed) == 2
    for e in committed:
        assert e["stage_phases"] == {"0": {"backward": 3.0, "pipeline_wait": 0.7},
                                     "1": {"backward": 3.0, "pipeline_wait": 0.2}}
        assert e["bubble"] == pytest.approx((measured_bubble([3.0, 2.0], 4.0) + measured_bubble([2.0, 3.0], 5.0)) / 2)


def test_an_unpipelined_step_records_no_stage_fields(tmp_path):
    for e in _committed(tmp_path, 1, 2):
        assert "stage_phases" not in e and "bubble" not in e
        assert set(e) == {"t", "kind", "step", "epoch", "loss", "loss_sum", "grad_seconds", "reduce_seconds",
                          "apply_seconds", "bytes_sent", "phases", "microbatches", "seconds"}


# -- the report ----------------------------------------------------------------------------------------------

def _log(config, bubbles, stage_phases=True):
    events = [ev(0, "job_started", mode="distributed", config=config, global_batch_size=8, microbatches=8),
              ev(0.1, "run_started", run_id="r", slices=4, devices_per_slice=1, steps=len(bubbles))]
    for i, b in enumerate(bubbles):
        fields = {} if b is None else {"bubble": b}
        if stage_phases:
            fields["stage_phases"] = {**{str(k): {"forward": 0.1 * (k + 1) + 0.01 * i, "pipeline_wait": 0.05}
                                         for k in range(3)}, "3": {"backward": 0.4 + 0.01 * i}}
        events.append(ev(1 + i, "step_committed", step=i, epoch=1, loss=1.0, **fields))
    return events


def test_the_report_of_a_pipelined_run_has_its_schedule_median_bubble_against_theory_and_stage_phases():
    config = {"dcn_pipeline_parallelism": 4, "elastic_pipeline_schedule": "gpipe"}
    report = build_report(_log(config, [0.40, 0.30, 0.28, 0.29]))
    jsonschema.validate(report, SCHEMA)
    pl = report["pipeline"]
    assert (pl["schedule"], pl["stages"], pl["microbatches"], pl["steps_measured"]) == ("gpipe", 4, 8, 4)
    assert pl["bubble_theoretical"] == pytest.approx(3 / 11)
    assert pl["bubble_median"] == pytest.approx(0.295)
    assert pl["bubble_ratio"] == pytest.approx(0.295 / (3 / 11))
    assert list(pl["stage_phases_median"]) == ["0", "1", "2", "3"]
    assert pl["stage_phases_median"]["1"] == pytest.approx({"forward": 0.215, "pipeline_wait": 0.05})
    assert pl["stage_phases_median"]["3"] == pytest.approx({"backward": 0.415})
    assert "bubble 0.295 measured (median of 4 steps), 0.273 in theory, ratio 1.08" in summary_text(report, 140)
    page = render_html(report, _log(config, [0.40, 0.30, 0.28, 0.29]))
    assert "id='pipeline'" in page and "stage 3" in page and "pipeline_wait" in page


def test_the_theory_is_of_one_pipeline_replica_running_its_share_of_the_microbatches():
    """4 replicas share M = 8: each runs 2, so the theory is (S - 1) / (2 + S - 1), not (S - 1) / (8 + S - 1)."""
    events = _log({"dcn_pipeline_parallelism": 2, "elastic_pipeline_schedule": "1f1b"}, [0.4, 0.3, 0.35])
    for e in events:
        if e["kind"] == "step_committed":
            e["microbatches"] = {f"w{4 + r}": [2 * r, 2 * r + 1] for r in range(4)}
    report = build_report(events)
    jsonschema.validate(report, SCHEMA)
    pl = report["pipeline"]
    assert (pl["microbatches"], pl["microbatches_per_replica"]) == (8, 2)
    assert pl["bubble_theoretical"] == pytest.approx(1 / 3) and pl["bubble_ratio"] == pytest.approx(0.35 * 3)
    assert "2 stages x 8 microbatches (2 per replica)" in summary_text(report, 140)


def test_a_pipelined_run_in_one_process_reports_the_theory_alone_and_an_unpipelined_run_no_section():
    report = build_report(_log({"dcn_pipeline_parallelism": 2, "elastic_pipeline_schedule": "1f1b"}, [None] * 3,
                               stage_phases=False))
    jsonschema.validate(report, SCHEMA)
    pl = report["pipeline"]
    assert pl["bubble_median"] is None and pl["bubble_ratio"] is None and pl["steps_measured"] == 0
    assert pl["bubble_theoretical"] == pytest.approx(1 / 9) and pl["stage_phases_median"] == {}
    assert "none measured" in summary_text(report, 140)
    assert "No step recorded its stages" in render_html(report, [])
    plain = build_report(_log({"dcn_pipeline_parallelism": 1}, [None] * 2, stage_phases=False))
    assert plain["pipeline"] is None and "id='pipeline'" not in render_html(plain, [])
    # a log without a config still has its stages from the steps
    assert build_report(_log(None, [0.3, 0.3]))["pipeline"]["stages"] == 4


def test_the_fold_refuses_stage_fields_of_the_wrong_type():
    for bad in ({"bubble": "0.3"}, {"stage_phases": {"0": {"forward": "x"}}}, {"stage_phases": [1]}):
        with pytest.raises(ValueError, match="step_committed"):
            build_report([ev(0, "step_committed", step=0, loss=1.0, **bad)])


def test_the_simulated_stage_delay_is_a_worker_process_option_of_seconds_never_a_config_key():
    import argparse

    from elastic.config import Config
    from runtime.worker.worker_process import STAGE_DELAY_VARIABLE, _delay

    assert STAGE_DELAY_VARIABLE == "ELASTIC_SIMULATED_STAGE_DELAY"
    assert (_delay("0.15"), _delay("0"), _delay("")) == (0.15, 0.0, 0.0)
    for bad in ("-0.1", "inf", "nan", "fast"):
        with pytest.raises(argparse.ArgumentTypeError, match=STAGE_DELAY_VARIABLE):
            _delay(bad)
    assert not [f.name for f in dataclasses.fields(Config) if "delay" in f.name]
