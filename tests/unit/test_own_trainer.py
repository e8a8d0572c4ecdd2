"""Your own model through the command line's factory (``elastic_trainer``), chaos planning, and what reports keep.

Pure or in-process checks: the factory's errors name the key and what to do;
``chaos.harness.plan`` combines scenarios and arguments; a run of the user's model
leaves out the bundled model's keys; the step time is the commit interval.
"""

import pytest

import chaos
from chaos.harness import ChaosResult, plan
from elastic.cli_support import make_trainer
from elastic.config import MODEL_KEYS, ConfigError
from elastic.config_loading import load_config
from elastic.report import build_report

FACTORIES = '''
import elastic
from tests.chaos.own_model import make_job
NOT_CALLABLE = 3
def returns_a_dict(cfg):
    return {}
def other_config(cfg):
    return make_job(cfg.replace(steps=cfg.steps + 1))
'''


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "user_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return lambda spec: make_trainer(load_config("tiny", [f"elastic_trainer={spec}", "ici_fsdp_parallelism=1"]))


def test_a_factory_builds_the_users_job(factories):
    job = factories("tests.chaos.own_model:make_job")
    assert type(job).__name__ == "WrappedStep" and job.reports_model_keys is False
    assert job.config.elastic_trainer == "tests.chaos.own_model:make_job"


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:make", "cannot import 'no_such_module_xyz'"),
    ("user_factories:missing", "has no 'missing'"),
    ("user_factories:NOT_CALLABLE", "is a int, not a function of the config"),
    ("user_factories:returns_a_dict", "returned a dict; it must return elastic.Trainer"),
    ("user_factories:other_config", "another config (keys ['steps'] differ)"),
])
def test_a_bad_factory_is_a_config_error_naming_the_key(factories, spec, message):
    with pytest.raises(ConfigError, match="elastic_trainer") as e:
        factories(spec)
    assert message in str(e.value)


@pytest.mark.parametrize("spec", ["make_job", "a:b:c", "1mod:f", "mod:", "mod.:f", "mod:f g"])
def test_a_malformed_trainer_key_is_refused(spec):
    with pytest.raises(ConfigError, match="'module:function'"):
        load_config("tiny", [f"elastic_trainer={spec}"])


def test_model_keys_are_left_out_for_a_users_model():
    cfg = load_config("tiny")
    assert MODEL_KEYS <= set(cfg.to_dict())
    assert not MODEL_KEYS & set(cfg.to_dict(model_keys=False))
    assert len(cfg.to_dict(model_keys=False)) == len(cfg.to_dict()) - len(MODEL_KEYS)


def test_plan_combines_a_scenario_with_arguments(tmp_path):
    sc = tmp_path / "s.yml"
    sc.write_text("faults: ['kill@step=2']\noverrides: ['steps=9']\nseed: 4\n")
    scenario, overrides, options = plan(scenario=str(sc), faults="hang:slice=1@step=3")
    assert scenario.name == "s" and overrides == ["steps=9"]
    assert [f.kind for f in options.faults] == ["kill", "hang"] and options.seed == 4
    _, _, soak = plan(mtbf="20s", duration=60, seed=1)
    assert (soak.mtbf_seconds, soak.duration_seconds, soak.faults) == (20.0, 60.0, ())


@pytest.mark.parametrize("kwargs, message", [
    ({}, "no faults"),
    ({"duration": "1m", "faults": "kill@step=1"}, "needs an MTBF"),
    ({"faults": "explode@step=1"}, "explode"),
])
def test_plan_refuses_bad_input(kwargs, message):
    with pytest.raises(chaos.FaultSpecError, match=message):
        plan(**kwargs)


def test_chaos_result_asserts_with_the_reasons(tmp_path):
    ok = ChaosResult({"verdict": "pass", "verdict_reasons": []}, tmp_path)
    ok.assert_passed()
    bad = ChaosResult({"verdict": "fail", "verdict_reasons": ["lost step 3"]}, tmp_path)
    assert not bad.passed and bad.reasons == ["lost step 3"]
    with pytest.raises(AssertionError, match="lost step 3"):
        bad.assert_passed()


def _commit(t, step, **kw):
    return {"t": t, "kind": "step_committed", "step": step, "epoch": 0, "loss": 1.0, **kw}


def test_step_time_is_the_commit_interval_and_latency_is_reported_apart():
    events = [{"t": 0.0, "kind": "run_started", "run_id": "r", "slices": 2, "devices_per_slice": 1, "steps": 6},
              _commit(1.0, 0, seconds=1.0), _commit(1.1, 1, seconds=0.2), _commit(1.2, 2, seconds=0.2),
              {"t": 1.3, "kind": "failure_detected", "committed": 3, "error": "WorkerLostError", "detail": ""},
              _commit(5.0, 3, seconds=3.9), _commit(5.1, 4, seconds=0.2), _commit(5.2, 5, seconds=0.2)]
    report = build_report(events)
    assert report["step_seconds_median"] == pytest.approx(0.1)   # the failure's 3.8 s gap is not a step
    assert report["step_latency_seconds_median"] == pytest.approx(0.2)
    reference = build_report([_commit(0.5, 0), _commit(0.6, 1), _commit(0.7, 2)])
    assert reference["step_seconds_median"] == pytest.approx(0.1)
    assert reference["step_latency_seconds_median"] is None


def test_the_python_chaos_api_is_on_the_package():
    import chaos.harness

    assert chaos.run_job is chaos.harness.run_job and chaos.ChaosResult is chaos.harness.ChaosResult
    assert {"run_job", "ChaosResult"} <= set(chaos.__all__) and "plan" not in chaos.__all__   # plan: chaos.harness
