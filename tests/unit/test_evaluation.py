"""Held-out evaluation (eval_interval): the pure parts. Which eval microbatches each slice computes, the summing
order, what a step owes after a recovery, the config's refusals, the report's fold and the metrics written once
per committed eval. The real-process run (a worker killed inside an eval) is in tests/chaos/test_chaos_faults.py."""

import json

import pytest

import elastic
from elastic.config import ConfigError
from elastic.metrics import EVAL_LOSS, LOSS, ModelMetrics, open_metrics
from elastic.report import build_report
from elastic.report.html import render_html
from elastic.report.summary import summary_text
from runtime.control.evaluation import (eval_due, eval_items, eval_loss, eval_order, gather_losses, lost_evals,
                                        owed_eval)
from tests.support.metrics_files import metrics_file_lines, tensorboard_scalars


def test_an_eval_follows_every_interval_th_step_and_none_when_off():
    assert [s for s in range(10) if eval_due(s, 3)] == [0, 3, 6, 9]   # MaxText's: after step 0, then every 3
    assert not any(eval_due(s, 0) for s in range(10))
    assert not any(eval_due(s, -1) for s in range(10))


@pytest.mark.parametrize("eval_steps, microbatches, ranks, lengths", [
    (3, 2, 1, [6]), (3, 2, 2, [3, 3]), (3, 2, 4, [2, 2, 1, 1]), (1, 2, 3, [1, 1, 0]), (2, 4, 3, [3, 3, 2])])
def test_eval_microbatches_go_to_ranks_in_contiguous_balanced_runs_in_e_m_order(eval_steps, microbatches, ranks,
                                                                                lengths):
    shares = eval_items(eval_steps, microbatches, ranks)
    assert [len(s) for s in shares] == lengths
    flat = [item for share in shares for item in share]
    assert flat == [(e, m) for e in range(eval_steps) for m in range(microbatches)]   # each once, in order


def test_eval_items_refuses_an_empty_eval():
    with pytest.raises(ValueError, match=">= 1"):
        eval_items(0, 2, 1)


def test_the_eval_loss_is_the_same_bits_for_any_slice_count():
    """Each microbatch's answer is the same wherever computed: the sum goes in (e, m) order whoever held it."""
    values = {(e, m): (0.1 * (e + 1) + 1e-7 * m, 1.0) for e in range(5) for m in range(4)}
    results = set()
    for ranks in (1, 2, 3, 4, 7):
        items = {f"w{r}": share for r, share in enumerate(eval_items(5, 4, ranks))}
        answers = {w: [values[i] for i in share] for w, share in items.items()}
        results.add(eval_loss(gather_losses(items, answers), 5, 4))
    (result,) = results
    assert result.total_weights == 20.0
    assert result.loss == result.total_loss / 20


def test_a_loss_weighted_by_tokens_is_the_totals_over_the_weights():
    """MaxText's eval/avg_loss: the cross-entropy sums over the token counts (an all-padding microbatch counts 0)."""
    losses = {(0, 0): (30.0, 10.0), (0, 1): (0.0, 0.0), (1, 0): (12.0, 6.0), (1, 1): (18.0, 4.0)}
    result = eval_loss(losses, 2, 2)
    assert (result.loss, result.total_loss, result.total_weights) == (3.0, 60.0, 20.0)
    assert eval_loss({(0, 0): (0.0, 0.0)}, 1, 1).loss == 0.0


def test_a_missing_or_miscounted_answer_is_named():
    with pytest.raises(ValueError, match=r"step 1, microbatch 0"):
        eval_loss({(0, 0): (1.0, 1.0)}, 2, 1)
    with pytest.raises(ValueError, match="w1 answered 1 eval losses for 2"):
        gather_losses({"w0": [(0, 0)], "w1": [(0, 1), (1, 0)]}, {"w0": [(1.0, 1.0)], "w1": [(1.0, 1.0)]})


def test_a_step_carries_its_own_eval_and_an_owed_one_to_its_ranks_only():
    workers = ("w0", "w1")
    order = eval_order(4, workers, interval=2, eval_steps=1, microbatches=2, committed=4, evaluated=frozenset())
    assert order.step == 4 and order.owed is None and order.after == {"w0": [(0, 0)], "w1": [(0, 1)]}
    assert eval_order(3, workers, interval=2, eval_steps=1, microbatches=2, committed=2,
                      evaluated=frozenset()) is None   # step 2 in flight: it carries its own eval
    # Step 2 was committed by a recovery (its eval not recorded): step 3, the next dispatched, computes it first.
    owed = eval_order(3, workers, interval=2, eval_steps=1, microbatches=2, committed=3, evaluated=frozenset())
    assert (owed.step, owed.owed, owed.before) == (None, 2, {"w0": [(0, 0)], "w1": [(0, 1)]})
    both = eval_order(2, workers, interval=1, eval_steps=1, microbatches=2, committed=2, evaluated=frozenset({0}))
    assert (both.step, both.owed) == (2, 1)
    assert eval_order(4, workers, interval=0, eval_steps=1, microbatches=2, committed=4, evaluated=frozenset()) is None


def test_what_a_step_owes_and_what_is_lost():
    assert owed_eval(5, 5, 2, frozenset()) == 4
    assert owed_eval(5, 5, 2, frozenset({4})) is None       # recorded
    assert owed_eval(5, 4, 2, frozenset()) is None           # step 4 not committed: in flight, it carries its own
    assert owed_eval(5, 5, 2, frozenset(), floor=5) is None  # an earlier attempt's step
    assert owed_eval(0, 0, 1, frozenset()) is None
    # A recovery committed steps 3..6 from the survivors' reports: 4 lost its eval and its state.
    assert lost_evals(7, 2, frozenset(), since=3) == [4]
    assert lost_evals(8, 2, frozenset({4}), since=3) == [6]
    assert lost_evals(7, 3, frozenset(), since=2) == [3]
    assert lost_evals(7, 2, frozenset(), since=6) == []      # step 6 is the last committed: owed, not lost


@pytest.mark.parametrize("changes, message", [
    ({"eval_steps": 0}, r"config key 'eval_steps' \(0, in overrides\) must be > 0"),
    ({"eval_interval": -2}, "config key 'eval_interval' must be >= -1"),
    ({"eval_interval": 5, "dcn_pipeline_parallelism": 2, "elastic_microbatches": 4},
     r"config keys 'eval_interval' \(5, in overrides\) and 'dcn_pipeline_parallelism' .* contradict"),
])
def test_bad_eval_keys_are_one_line_naming_the_key(changes, message):
    with pytest.raises(ConfigError, match=message):
        elastic.load_config("tiny", [f"{k}={v}" for k, v in changes.items()])


def test_maxtexts_minus_one_is_off_and_eval_steps_resolves_from_the_eval_source(tmp_path):
    from elastic.models import make_model
    import optax

    def trainer(eval_data, **keys):
        cfg = elastic.load_config("tiny", [f"{k}={v}" for k, v in {"base_output_directory": tmp_path,
                                                                  **keys}.items()])
        init, loss, data = make_model(cfg)
        return elastic.Trainer(init=init, loss=loss, optimizer=optax.sgd(0.1), data=data, config=cfg,
                               eval_data=data.held_out() if eval_data == "held_out" else eval_data), data

    off, _ = trainer(None, eval_interval=-1)
    assert not off.evaluates
    assert off._controller_options(tmp_path).eval_interval == 0
    job, data = trainer("held_out", eval_interval=2, eval_steps=3)
    assert job.evaluates and job.eval_steps() == 3
    with pytest.raises(ConfigError, match="eval_steps' is -1 .* does not say how many steps"):
        trainer("held_out", eval_interval=2)[0].eval_steps()
    with pytest.raises(ConfigError, match="no eval data: pass eval_data="):
        trainer(None, eval_interval=2)[0].eval_steps()

    class Sized:
        def __init__(self, source, n):
            self.source, self.n = source, n

        def element_spec(self):
            return self.source.element_spec()

        def batch(self, step, microbatch):
            return self.source.batch(step, microbatch)

        def __len__(self):
            return self.n

    assert trainer(Sized(data, 7), eval_interval=2)[0].eval_steps() == 7
    wrong = elastic.FunctionSource(lambda s, m: {}, {"x": ((2,), "float32")})
    with pytest.raises(ConfigError, match="eval_data's microbatches .* are not the training data's"):
        trainer(wrong, eval_interval=2, eval_steps=1)[0].eval_steps()


def _events(evals):
    events = [{"t": 1.0, "kind": "job_started", "mode": "distributed", "config": {}, "global_batch_size": 4,
               "microbatches": 2},
              {"t": 2.0, "kind": "placement", "epoch": 1, "active": ["w0", "w1"], "spares": [], "seconds": 0.1}]
    t = 3.0
    for step in range(6):
        t += 1
        events.append({"t": t, "kind": "step_committed", "step": step, "epoch": 1, "loss": 5.0 - step / 10,
                       "seconds": 0.5})
        events += [{"t": t + 0.1, **e} for e in evals if e["step"] == step]
    return events


EVALS = [{"kind": "eval_completed", "step": 1, "loss": 4.5, "total_loss": 9.0, "total_weights": 2.0, "batches": 2,
          "seconds": 0.01},
         {"kind": "eval_skipped", "step": 3, "reason": "a recovery committed it"},
         {"kind": "eval_completed", "step": 5, "loss": 4.0, "total_loss": 8.0, "total_weights": 2.0, "batches": 2,
          "seconds": 0.02, "before_step": 6}]


def test_the_report_lists_each_eval_once_by_step_the_last_kept():
    report = build_report(_events(EVALS + [{**EVALS[0], "loss": 4.25}]))   # step 1 evaluated again (a rewind)
    assert report["evals"] == [
        {"step": 1, "loss": 4.25, "total_loss": 9.0, "total_weights": 2.0, "batches": 2, "seconds": 0.01},
        {"step": 3, "loss": None, "skipped": "a recovery committed it"},
        {"step": 5, "loss": 4.0, "total_loss": 8.0, "total_weights": 2.0, "batches": 2, "seconds": 0.02,
         "before_step": 6}]
    assert build_report(_events([]))["evals"] == []
    html = render_html(report, _events(EVALS))
    assert "<h2>Eval</h2>" in html and "owed, computed before step 6" in html and "a recovery committed it" in html
    assert "<h2>Eval</h2>" not in render_html(build_report(_events([])), _events([]))
    summary = " ".join(summary_text(report, width=200).split())
    assert "eval loss 4.2500 → 4.0000 (after steps 1-5, 2 evals), 1 skipped" in summary


def test_each_committed_eval_is_written_once_under_maxtexts_names(tmp_path):
    run_dir, mf = tmp_path / "exp1", tmp_path / "metrics.jsonl"
    run_dir.mkdir()
    events = _events(EVALS)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))

    def write(evs, fresh, history=()):
        writer = open_metrics(run_dir=run_dir, tensorboard=True, metrics_file=str(mf), log_period=100,
                              model=ModelMetrics(), devices_per_slice=1, fresh=fresh, history=history)
        for e in evs:
            writer.observe(e)
        writer.close()

    write(events, fresh=True)
    write(events[:6], fresh=False, history=events)   # a restarted client: nothing written twice
    lines = metrics_file_lines(mf)
    evals = [line for line in lines if EVAL_LOSS in line]
    assert [(line["step"], line[EVAL_LOSS]) for line in evals] == [(1.0, 4.5), (5.0, 4.0)]
    assert evals[0]["eval/total_loss"] == 9.0 and evals[0]["eval/total_weights"] == 2.0
    assert evals[0]["eval/avg_perplexity"] == pytest.approx(2.718281828 ** 4.5)
    assert [int(line["step"]) for line in lines if LOSS in line] == list(range(6))
    assert tensorboard_scalars(run_dir, EVAL_LOSS) == [(1, 4.5), (5, 4.0)]


def _controller_run(tmp_path, slices, faults=None):
    """A run of 8 steps over the fake worker group, an eval of 2 eval steps after every second step."""
    import types

    from runtime import EventLog, RunState, read_events
    from runtime.control.controller import Controller
    from runtime.control.controller_options import ControllerOptions
    from tests.support.controller_run import M
    from tests.support.fake_group import FakeGroup

    tmp_path.mkdir(parents=True, exist_ok=True)
    options = ControllerOptions(slices=slices, devices_per_slice=2, run_dir=str(tmp_path), spares=1,
                                watchdog_min_seconds=0.0, eval_interval=2, eval_steps=2)
    events = EventLog(tmp_path / "events.jsonl")
    group = FakeGroup(options, events, faults)
    programs = types.SimpleNamespace(num_microbatches=M, evaluates=True)
    with Controller(programs, b"", options, events, group=group) as ctl:
        ctl.train(8, seed=0)
    events.close()
    log = read_events(tmp_path / "events.jsonl")
    assert RunState.replay(log) == ctl.state
    return log


def test_the_controller_records_each_eval_once_after_its_step_commits_the_same_for_any_slice_count(tmp_path):
    from tests.support.controller_run import M
    from tests.support.fake_group import eval_answer

    logs = {n: _controller_run(tmp_path / str(n), n) for n in (1, 2, 3)}
    for log in logs.values():
        evals = [e for e in log if e["kind"] == "eval_completed"]
        assert [e["step"] for e in evals] == [0, 2, 4, 6]
        for e in evals:   # after its step's commit, on the state that step applied
            committed = [i for i, x in enumerate(log) if x["kind"] == "step_committed" and x["step"] == e["step"]]
            assert committed and committed[-1] < log.index(e)
            want = eval_loss({(s, m): eval_answer(e["step"] + 1, s, m) for s in range(2) for m in range(M)}, 2, M)
            assert (e["loss"], e["total_weights"], e["batches"]) == (want.loss, 2.0 * M, 2 * M)
    assert len({tuple(e["loss"] for e in log if e["kind"] == "eval_completed") for log in logs.values()}) == 1


def test_a_step_lost_with_its_eval_evaluates_again_and_is_recorded_once(tmp_path):
    log = _controller_run(tmp_path, 2, faults={4: ("kill", "w1")})
    assert [e["kind"] for e in log].count("failure_detected") == 1
    assert [e["step"] for e in log if e["kind"] == "eval_completed"] == [0, 2, 4, 6]
    assert not [e for e in log if e["kind"] == "eval_skipped"]


def test_an_eval_whose_replies_a_recovery_lost_is_computed_by_the_next_step_on_the_same_state(tmp_path):
    fault_free = _controller_run(tmp_path / "ref", 2)
    # w1 dies after w0 applied step 4 (an eval step): the recovery commits step 4 from w0's report, and step 5
    # computes step 4's eval first, on the state step 4 left.
    log = _controller_run(tmp_path / "run", 2, faults={4: ("kill_after_apply", "w1")})
    assert [e for e in log if e["kind"] == "step_committed" and e["step"] == 4][0].get("recovered")
    evals = {e["step"]: e for e in log if e["kind"] == "eval_completed"}
    assert sorted(evals) == [0, 2, 4, 6] and evals[4]["before_step"] == 5
    assert [evals[s]["loss"] for s in sorted(evals)] == [e["loss"] for e in fault_free if e["kind"] == "eval_completed"]


def test_the_eval_program_is_no_part_of_which_math_a_checkpoint_belongs_to():
    """A run with eval resumes one without, and the other way round: eval only reads the state."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh

    from elastic._programs import export_program
    from runtime.core.fingerprint import legacy_programs_fingerprint, programs_fingerprint

    mesh = AbstractMesh((1,), ("fsdp",))
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    grad = export_program("grad", lambda v: v * 2, (x,), [None], None, mesh)
    other = export_program("eval", lambda v: v.sum(), (x,), [None], None, mesh)
    for fingerprint in (programs_fingerprint, legacy_programs_fingerprint):
        assert fingerprint({"grad": grad, "eval": other}) == fingerprint({"grad": grad})
        assert fingerprint({"grad": grad, "apply": other}) != fingerprint({"grad": grad})
