"""MaxText's metrics from committed steps (elastic.metrics): the fold, log_period, restarts, failures; real files,
read back with TensorBoard's own reader."""

import json

import pytest

from elastic import run_records
from elastic.config import ConfigError
from elastic.metrics import (LOSS, ModelMetrics, StepFold, flushes, last_metrics_file_step, last_tensorboard_step,
                             metrics_line, open_metrics, step_scalars, tensorboard_dir)
from elastic.preflight import check_metrics_file
from tests.support.metrics_files import metrics_file_lines, tensorboard_scalars

MODEL = ModelMetrics(learning_rate=lambda step: 0.1 * (step + 1), tokens_per_step=64.0, tflops_per_step=8.0)


def _run(steps, *, t0=100.0, recover_at=None, recommit=()):
    """A run's events: 2 slices; with ``recover_at`` a slice is lost after that step's commit and the run
    shrinks to one, recommitting ``recommit`` (steps already committed) before going on."""
    events = [{"t": t0, "kind": "job_started", "mode": "distributed"},
              {"t": t0 + 1, "kind": "placement", "epoch": 1, "active": ["w0", "w1"], "spares": [], "seconds": 0.1}]
    t = t0 + 2
    for step in steps:
        t += 1.0
        events.append({"t": t, "kind": "step_committed", "step": step, "epoch": 1, "loss": 5.0 - step / 10,
                       "seconds": 0.5})
        if step == recover_at:
            events += [{"t": t + 0.5, "kind": "failure_detected", "error": "WorkerLostError", "detail": "",
                        "worker": "w1", "committed": step},
                       {"t": t + 0.6, "kind": "recovery_decision", "action": "shrink", "reason": "", "dead": ["w1"],
                        "epoch": 2, "active": ["w0"], "spares": []},
                       {"t": t + 1.0, "kind": "recovered", "path": "shrink", "epoch": 2, "resume_step": step + 1,
                        "dead": ["w1"], "bytes_moved": 0, "seconds": 0.4}]
            t += 1.0
            for again in recommit:
                t += 1.0
                events.append({"t": t, "kind": "step_committed", "step": again, "epoch": 2,
                               "loss": 5.0 - again / 10})
    return events


def _fold(events, model=MODEL):
    """``(step, scalars)`` of each commit, on slices of 2 devices."""
    fold = StepFold()
    return [(c.step, step_scalars(c, model, devices_per_slice=2)) for c in map(fold.feed, events) if c is not None]


def test_each_commit_gives_maxtexts_scalars_and_the_elastic_ones():
    (s0, first), (s1, second) = _fold(_run([0, 1]))
    assert (s0, s1) == (0, 1)
    assert first[LOSS] == 5.0 and second[LOSS] == pytest.approx(4.9)
    assert first["learning/current_learning_rate"] == pytest.approx(0.1)
    assert second["learning/current_learning_rate"] == pytest.approx(0.2)
    assert first["perf/step_time_seconds"] == 0.5    # an attempt's first step: its own seconds
    assert second["perf/step_time_seconds"] == 1.0   # then MaxText's: the time since the previous step
    assert second["perf/per_device_tokens"] == 16.0   # 64 tokens over 2 slices x 2 devices
    assert second["perf/per_device_tokens_per_sec"] == 16.0
    assert second["perf/per_device_tflops"] == 2.0 and second["perf/per_device_tflops_per_sec"] == 2.0
    assert second["elastic/slices_live"] == 2.0 and second["elastic/recoveries"] == 0.0


def test_a_recovery_counts_and_the_live_slices_follow_the_placement():
    out = dict(_fold(_run([0, 1, 2], recover_at=0)))
    assert out[0]["elastic/slices_live"] == 2.0 and out[0]["elastic/recoveries"] == 0.0
    assert out[1]["elastic/slices_live"] == 1.0 and out[1]["elastic/recoveries"] == 1.0
    assert out[1]["perf/per_device_tokens"] == 32.0   # the same tokens on half the devices


def test_a_model_that_says_nothing_gets_loss_step_time_and_the_elastic_ones():
    (_, scalars), = _fold(_run([0]), ModelMetrics())
    assert set(scalars) == {LOSS, "perf/step_time_seconds", "elastic/slices_live", "elastic/recoveries"}


@pytest.mark.parametrize("step, period, flushed", [(0, 100, True), (99, 100, False), (100, 100, True),
                                                   (7, 1, True), (3, 2, False)])
def test_tensorboard_is_flushed_at_maxtexts_log_period(step, period, flushed):
    assert flushes(step, period) is flushed


def test_a_metrics_file_line_has_maxtexts_fields():
    line = json.loads(metrics_line({LOSS: 2.5, "perf/step_time_seconds": 0.25}, 3, "exp1"))
    assert line == {LOSS: 2.5, "perf/step_time_seconds": 0.25, "step": 3.0, "run_name": "exp1"}


def _write(run_dir, events, *, fresh, history=(), metrics_file=None, log_period=100):
    """The writer of an attempt of ``events``, beside its event log (goodput is read from it)."""
    run_dir.mkdir(exist_ok=True)
    with open(run_dir / "events.jsonl", "w" if fresh else "a") as log:
        log.writelines(json.dumps(e) + "\n" for e in events)
    writer = open_metrics(run_dir=run_dir, tensorboard=True, metrics_file=str(metrics_file or ""),
                          log_period=log_period, model=MODEL, devices_per_slice=2, fresh=fresh, history=history)
    for e in events:
        writer.observe(e)
    writer.close()


def _tensorboard_losses(run_dir) -> list[int]:
    return [step for step, _ in tensorboard_scalars(run_dir)]


def _file_steps(path) -> list[int]:
    return [int(line["step"]) for line in metrics_file_lines(path)]


def test_a_recovery_writes_no_step_twice(tmp_path):
    run_dir, mf = tmp_path / "exp1", tmp_path / "metrics.jsonl"
    _write(run_dir, _run([0, 1, 2, 3], recover_at=2, recommit=[1, 2]), fresh=True, metrics_file=mf)
    assert _tensorboard_losses(run_dir) == [0, 1, 2, 3]
    assert _file_steps(mf) == [0, 1, 2, 3]
    assert [v for _, v in tensorboard_scalars(run_dir, "elastic/recoveries")] == [0, 0, 0, 1]
    # goodput at the flush of step 0 (log_period 100) and at the end of the attempt, each step once
    assert [step for step, _ in tensorboard_scalars(run_dir, "elastic/goodput")] == [0, 3]


def test_a_restarted_client_appends_and_writes_what_its_predecessor_lost(tmp_path):
    run_dir, mf = tmp_path / "exp1", tmp_path / "metrics.jsonl"
    first = _run(range(6))
    _write(run_dir, first, fresh=True, metrics_file=mf)
    # The killed client's last records never reached the files: a torn TensorBoard record, two lines lost.
    (tb_file,) = tensorboard_dir(run_dir).glob("events.out.tfevents.*")
    tb_file.write_bytes(tb_file.read_bytes()[:tb_file.stat().st_size // 2])
    mf.write_text("".join(line + "\n" for line in mf.read_text().splitlines()[:4]) + '{"learning/lo')
    assert last_metrics_file_step(mf) == 3
    assert 0 <= last_tensorboard_step(tensorboard_dir(run_dir)) < 5
    _write(run_dir, _run(range(6, 9), t0=200.0), fresh=False, history=first, metrics_file=mf)
    assert _tensorboard_losses(run_dir) == list(range(9))
    assert _file_steps(mf) == list(range(9))   # the torn line cut off


def test_a_fresh_attempt_starts_the_files_anew_with_the_earlier_ones_kept_aside(tmp_path):
    run_dir, mf = tmp_path / "exp1", tmp_path / "metrics.jsonl"
    _write(run_dir, _run(range(5)), fresh=True, metrics_file=mf)
    aside = run_records.keep_aside(run_dir, "a test", also=(str(mf),))   # as fit does before a fresh attempt
    _write(run_dir, _run(range(3), t0=300.0), fresh=True, metrics_file=mf)
    assert _tensorboard_losses(run_dir) == [0, 1, 2]
    assert _file_steps(mf) == [0, 1, 2]
    assert _file_steps(aside / mf.name) == [0, 1, 2, 3, 4] and list((aside / "tensorboard").rglob("events.out.*"))


def test_a_file_that_cannot_be_written_warns_once_and_the_others_go_on(tmp_path, capsys):
    run_dir, mf = tmp_path / "exp1", tmp_path / "gone" / "metrics.jsonl"
    _write(run_dir, _run(range(3)), fresh=True, metrics_file=mf)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "metrics_file" in warnings[0]
    assert _tensorboard_losses(run_dir) == [0, 1, 2]


def test_an_unwritable_metrics_file_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="config key 'metrics_file'"):
        check_metrics_file(str(tmp_path / "missing" / "m.jsonl"))
    with pytest.raises(ConfigError, match="config key 'metrics_file'"):
        check_metrics_file(str(tmp_path))   # a directory
    check_metrics_file(str(tmp_path / "m.jsonl"))
    check_metrics_file("")
