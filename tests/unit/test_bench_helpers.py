"""The pure helpers of benchmarks/recovery_vs_restart.py, benchmarks/rl_overlap.py and benchmarks/run_all.py (no runs,
no clocks)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import recovery_vs_restart as rvr  # noqa: E402
import rl_overlap  # noqa: E402
import run_all  # noqa: E402

from elastic.report import goodput  # noqa: E402


def test_kill_schedule_puts_each_kill_mid_period():
    assert rvr.kill_schedule(3, 60, 10) == ([35, 95, 155], 180)
    assert rvr.kill_schedule(2, 60, 10) == ([35, 95], 120)
    assert rvr.kill_schedule(1, 20, 4) == ([10], 20)


def test_kill_schedule_refuses_kills_that_collide_or_never_fire():
    with pytest.raises(ValueError, match="kill gap"):
        rvr.kill_schedule(3, 10, 50)
    with pytest.raises(ValueError):
        rvr.kill_schedule(0, 60, 10)


def test_parse_step_log_keeps_marked_json_records_only():
    lines = ["WARNING: something\n", rvr.MARK + '{"t": 1.0, "kind": "step", "step": 0}\n',
             rvr.MARK + '{"t": 2.0, "kind": "st', rvr.MARK + '[1, 2]\n', rvr.MARK + '{"kind": "x"}\n',
             rvr.MARK + '{"t": 3.0, "kind": "done"}']
    assert rvr.parse_step_log(lines) == [{"t": 1.0, "kind": "step", "step": 0}, {"t": 3.0, "kind": "done"}]


def _commit(t, step, **kw):
    return {"t": t, "kind": "step_committed", "step": step, **kw}


def test_elastic_kills_reads_next_commit_and_recommits():
    events = [_commit(1.0, 0), _commit(2.0, 1), {"t": 2.5, "kind": "fault_injected"},
              {"t": 2.6, "kind": "failure_detected"}, {"t": 3.0, "kind": "recovered", "path": "replace"},
              _commit(3.5, 2), _commit(4.0, 3), {"t": 5.0, "kind": "fault_injected"},
              {"t": 5.5, "kind": "recovered", "path": "shrink"}, _commit(6.0, 3), _commit(7.0, 4)]
    got = rvr.elastic_kills(events)
    assert [k["path"] for k in got] == ["replace", "shrink"]
    assert got[0]["kill_to_next_commit"] == pytest.approx(1.0) and got[0]["steps_lost"] == 0
    assert got[0]["frontier"] == 1
    # A rewind: step 3 is committed again, and the next step past the frontier is 4.
    assert got[1]["frontier"] == 3 and got[1]["steps_lost"] == 1
    assert got[1]["kill_to_next_commit"] == pytest.approx(2.0)


def _restart_run():
    def rec(t, kind, **kw):
        return {"t": t, "kind": kind, **kw}
    first = {"launched": 0.0, "kill": 10.0, "detected": 10.1, "stopped": 10.3, "records": [
        rec(1.0, "imported"), rec(2.0, "initialized"), rec(3.0, "compiled"), rec(4.0, "restored", step=0),
        *[rec(5.0 + s, "step", step=s) for s in range(5)],    # steps 0..4 at 5..9; a checkpoint after step 1
        rec(10.05, "step", step=5)]}                          # committed while the victim died
    second = {"launched": 10.5, "records": [
        rec(12.0, "imported"), rec(13.0, "initialized"), rec(14.0, "compiled"), rec(15.0, "restored", step=2),
        *[rec(16.0 + i, "step", step=s) for i, s in enumerate(range(2, 8))], rec(22.0, "done")]}
    return [first, second]


def test_restart_kills_measures_from_the_kill_to_the_first_step_past_the_frontier():
    [k] = rvr.restart_kills(_restart_run())
    assert k["frontier"] == 5 and k["restored_step"] == 2 and k["steps_lost"] == 4
    assert k["kill_to_next_commit"] == pytest.approx(20.0 - 10.0)   # step 6, the first past step 5
    assert k["phases"] == pytest.approx({"detect and stop": 0.3, "start and import jax": 1.5, "distributed init": 1.0,
                                         "compile (warm cache)": 1.0, "restore": 1.0, "recompute lost steps": 5.0})


def test_restart_kills_needs_a_relaunch():
    with pytest.raises(ValueError, match="never relaunched"):
        rvr.restart_kills(_restart_run()[:1])


def test_restart_events_fold_into_the_runtime_goodput():
    g = goodput(rvr.restart_events(_restart_run()))
    assert g["wall_seconds"] == pytest.approx(22.0)
    bad = g["badput_seconds"]
    assert bad["startup"] == pytest.approx(2.0 + 1.0)      # launch -> initialized, compiled -> restored
    assert bad["compile"] == pytest.approx(1.0)
    assert bad["detection"] == pytest.approx(10.1 - 10.05)  # from the last commit (step 5 landed after the kill)
    assert bad["recovery"] == pytest.approx(15.0 - 10.1)    # death seen -> state restored
    assert bad["wasted_progress"] == pytest.approx(19.0 - 15.0)   # re-running steps 2..5
    assert bad["other"] == pytest.approx(1.0)               # last commit -> done
    assert g["productive_seconds"] == pytest.approx((10.05 - 4.0) + 2.0)
    assert g["productive_seconds"] + sum(bad.values()) == pytest.approx(g["wall_seconds"])


def test_last_line_is_the_last_non_blank_line():
    assert run_all.last_line("a\nratio 3.0x\n\n  \n") == "ratio 3.0x"
    assert run_all.last_line("") == ""


def _rl_events(made_before_commit: set[int], steps: int = 6) -> list[dict]:
    """An RL run's log: step s dispatched at s + 0.5, committed at s + 1; step s + 1's rollouts made at s + 0.9 when
    s is in ``made_before_commit`` (overlapped), else at s + 1.1; each took 0.3 s."""
    ev = [{"t": 0.4, "kind": "rollouts_made", "step": 0, "seconds": 0.3},
          {"t": 0.0, "kind": "weights_synced", "version": 0, "bytes": 8, "seconds": 0.5}]
    for s in range(steps):
        ev += [{"t": s + 0.5, "kind": "step_dispatched", "step": s},
               {"t": s + 1.0, "kind": "step_committed", "step": s},
               {"t": s + (0.9 if s in made_before_commit else 1.1), "kind": "rollouts_made", "step": s + 1,
                "seconds": 0.3},
               {"t": s + 1.05, "kind": "weights_synced", "version": s + 1, "bytes": 8, "seconds": 0.01}]
    return sorted(ev, key=lambda e: e["t"])


def test_rl_step_timeline_counts_steps_after_the_warmup():
    t = rl_overlap.step_timeline(_rl_events({3, 4}), warmup=2)
    assert t["wall_per_step"] == pytest.approx(1.0) and t["window"] == (2, 5)
    assert (t["early"], t["pairs"]) == (2, 3)   # steps 2, 3, 4 have a next step's rollouts; 3 and 4 before the commit
    assert t["started"] == 3                     # each started 0.3 s before it was made: 2's at 2.8, before 3.0
    assert t["rollout_median"] == pytest.approx(0.3) and t["train_median"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="warm-up"):
        rl_overlap.step_timeline(_rl_events(set(), steps=2), warmup=1)


def test_rl_syncs_leave_the_first_version_out():
    ev = _rl_events(set(), steps=2)
    assert rl_overlap.syncs_of(ev) == [(8, 0.01), (8, 0.01)]
    assert len(rl_overlap.syncs_of(ev, skip_version0=False)) == 3
