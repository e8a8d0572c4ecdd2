"""The fault grammar, scenario files, random schedules and target resolution (pure)."""

import pathlib
import random

import pytest

from chaos.harness import ChaosOptions, fault_plan
from chaos.injector import FaultInjector
from chaos.reach import RunShape, check_reachable
from chaos.scenario import Scenario, load_scenario
from chaos.schedule import TargetError, random_faults, recovery_budget, resolve_target
from chaos.spec import Fault, FaultSpecError, Target, When, parse_duration, parse_faults, validate
from elastic.config_loading import load_config
from runtime.control.placement import Placement
from tests.support.fake_controller import Controller

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCENARIOS = sorted((ROOT / "chaos" / "scenarios").glob("*.yml"))
EXAMPLE = "kill@step=10,hang:slice=2@step=20,kill:role=spare@time=30s,kill:all@step=40"


def test_parses_the_example_field_by_field():
    assert parse_faults(EXAMPLE) == [
        Fault("kill", Target("random"), When(step=10)),
        Fault("hang", Target("slice", 2), When(step=20)),
        Fault("kill", Target("role", "spare"), When(time=30.0)),
        Fault("kill", Target("all"), When(step=40)),
    ]


def test_options_targets_and_whens():
    straggle, hang, transfer, dest, everything = parse_faults(
        "straggle(factor=4,for=8s):slice=1@step=5, hang(resume=3s):worker=w2@time=20s,"
        "kill@transfer,hang:role=dest@transfer,partition:everything@time=500ms")
    assert straggle.options == (("factor", 4.0), ("for", 8.0)) and straggle.target == Target("slice", 1)
    assert hang.option("resume") == 3.0 and hang.target == Target("worker", "w2") and hang.when == When(time=20.0)
    assert transfer.target == Target("role", "source") and transfer.when == When(transfer=True)
    assert dest.target == Target("role", "dest")
    assert everything.target == Target("everything") and everything.when.time == 0.5


def test_option_defaults_come_from_the_kind():
    straggle, partition, hang = parse_faults("straggle@step=1,partition@step=1,hang@step=1")
    assert straggle.options == () and straggle.option("factor") == 3.0 and straggle.option("for") == 10.0
    assert partition.option("for") == 5.0 and partition.option("for", 2.0) == 2.0
    assert hang.option("resume") is None  # stays stopped
    with pytest.raises(KeyError, match="resume"):
        straggle.option("resume")


@pytest.mark.parametrize("text,seconds", [("30s", 30.0), ("1.5s", 1.5), ("500ms", 0.5), ("2m", 120.0), ("7", 7.0)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", [
    EXAMPLE,
    "straggle(factor=4.5,for=8s):slice=1@step=5",
    "hang(resume=0.25s):worker=w-2.a@time=1.5s",
    "kill:role=source@transfer,hang:role=dest@transfer",
    "partition(for=1m):everything@time=0s,corrupt:role=active@step=0,kill_save@step=3",
    "kill:stage=1@step=3,kill:stage=1,replica=0@step=3,hang(resume=3s):stage=0,replica=1@step=2,"
    "kill_save:stage=1@checkpoint=4,straggle(factor=2):stage=2,replica=3@time=5s",
])
def test_spec_round_trips(text):
    faults = parse_faults(text)
    for f in faults:
        assert parse_faults(f.spec()) == [f]
    assert parse_faults(",".join(f.spec() for f in faults)) == faults


def test_stage_targets_keep_their_replica_comma_and_the_next_comma_splits():
    one, two, three, four = parse_faults("kill:stage=1@step=3, kill:stage=1 , replica = 0@step=3,"
                                         "hang(resume=3s):stage=0,replica=1@step=2,kill@step=4")
    assert one.target == Target("stage", 1) and one.target.replica is None
    assert two.target == Target("stage", 1, 0) and two.spec() == "kill:stage=1,replica=0@step=3"
    assert three == Fault("hang", Target("stage", 0, 1), When(step=2), (("resume", 3.0),))
    assert four == Fault("kill", Target("random"), When(step=4))
    assert parse_faults("kill_save:stage=1,replica=1@checkpoint=4")[0].target == Target("stage", 1, 1)
    for f in (one, two, three, four):
        validate([f])
        assert parse_faults(f.spec()) == [f]


def test_spec_is_canonical():
    assert parse_faults("straggle( for=8000ms , factor=4 ):slice=1@step=5")[0].spec() == \
        "straggle(factor=4,for=8s):slice=1@step=5"
    assert parse_faults("kill:random@step=3")[0].spec() == "kill@step=3"


@pytest.mark.parametrize("text,message", [
    ("kill@step=10,hang:slise=2@step=20",
     "fault 2 'hang:slise=2@step=20': unknown target 'slise' (expected slice, stage, worker, role, random, all, "
     "everything, client)"),
    ("kil@step=1", "unknown kind 'kil'"),
    ("kill@stp=1", "bad when 'stp=1'"),
    ("kill", "missing '@WHEN'"),
    ("kill@step=-1", "bad when 'step=-1'"),
    ("kill@time=3x", "bad duration '3x'"),
    ("hang(resume=soon)@step=1", "bad duration 'soon'"),
    ("hang(resum=1s)@step=1", "unknown option 'resum' for hang"),
    ("kill(for=1s)@step=1", "unknown option 'for' for kill"),
    ("straggle(factor=0.5)@step=1", "option 'factor' must be >= 1"),
    ("hang(resume=0s)@step=1", "option 'resume' must be > 0"),
    ("corrupt@transfer", "@transfer works only with kill and hang, not 'corrupt'"),
    ("straggle:role=source@transfer", "not 'straggle'"),
    ("kill:slice=1@transfer", "@transfer needs target role=source or role=dest, got 'slice=1'"),
    ("kill:role=source@step=3", "role=source exists only during a transfer"),
    ("kill:role=boss@step=3", "unknown role 'boss'"),
    ("kill:slice=x@step=3", "target slice needs an integer >= 0, got 'x'"),
    ("kill:all=2@step=3", "target 'all' takes no value"),
    ("kill:worker@step=3", "target 'worker' needs a value"),
    ("", "empty fault spec"),
    ("  ", "empty fault spec"),
    ("kill@step=1,", "fault 2: trailing comma"),
    ("kill@step=1,,kill@step=2", "fault 2: empty fault between commas"),
    ("kill(@step=1", "unclosed '('"),
    ("kill:stage=x@step=3", "fault 1 'kill:stage=x@step=3': target stage needs an integer >= 0, got 'x'"),
    ("kill:stage=-1@step=3", "target stage needs an integer >= 0, got '-1'"),
    ("kill:stage@step=3", "target 'stage' needs a value"),
    ("kill:replica=0@step=3", "fault 1 'kill:replica=0@step=3': replica=R is only valid right after a stage=K "
                              "target (e.g. kill:stage=1,replica=0@step=3)"),
    ("kill:stage=1,replica=@step=3", "target replica needs an integer >= 0 (e.g. stage=1,replica=0), got nothing"),
    ("kill:stage=1,replica=one@step=3", "target replica needs an integer >= 0 (e.g. stage=1,replica=0), got 'one'"),
    ("kill:stage=1,replica=0,replica=1@step=3", "replica= given twice"),
    ("kill:slice=1,replica=0@step=3", "replica=R is only valid right after a stage=K target (e.g. "
                                      "kill:stage=1,replica=0@step=3), not after 'slice=1'"),
    ("kill:all,replica=0@step=3", "not after 'all'"),
    ("kill,replica=0@step=3", "fault 1 'kill,replica=0@step=3': replica=R is only valid right after a stage=K"),
    ("kill:stage=1@step=3,replica=0", "fault 1 'kill:stage=1@step=3,replica=0': replica=R is only valid right "
                                      "after a stage=K"),
    ("kill@step=1,replica=0@step=2", "replica=R is only valid right after a stage=K"),
    ("kill:stage=1,replica=0@transfer", "@transfer needs target role=source or role=dest, got 'stage=1,replica=0'"),
])
def test_errors_name_the_bad_piece(text, message):
    with pytest.raises(FaultSpecError) as info:
        parse_faults(text)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_kill_save_aims_at_the_writer_and_hand_built_nonsense_is_rejected():
    faults = parse_faults("kill@step=1,kill_save@step=3,kill_save:slice=1@checkpoint=4,kill:all@snapshot=8")
    validate(faults)
    assert faults[1].target == Target("role", "writer") and faults[2].when == When(checkpoint=4)
    assert faults[3].when == When(snapshot=8) and faults[3].when.spec() == "snapshot=8"
    assert parse_faults(",".join(f.spec() for f in faults)) == faults
    for bad, why in [("kill_save:all@step=1", "not 'all'"), ("kill:role=writer@step=1", "only with kill_save"),
                     ("kill_save:role=spare@step=1", "not 'role=spare'"), ("kill@checkpoint=x", "checkpoint needs"),
                     ("kill@snapshot=-1", "snapshot needs")]:
        with pytest.raises(FaultSpecError, match=why):
            validate(parse_faults(bad))
    with pytest.raises(FaultSpecError, match="exactly one of step, time, transfer, checkpoint"):
        validate([Fault("kill", Target("random"), When(step=1, time=2.0))])
    with pytest.raises(FaultSpecError, match="target slice needs an integer >= 0, got -1"):
        validate([Fault("kill", Target("slice", -1), When(step=1))])


@pytest.mark.parametrize("target,message", [
    (Target("stage", -1), "target stage needs an integer >= 0, got -1"),
    (Target("stage", True), "target stage needs an integer >= 0, got True"),
    (Target("stage", "1"), "target stage needs an integer >= 0, got '1'"),
    (Target("stage", 1, -1), "target replica needs an integer >= 0, got -1"),
    (Target("stage", 1, "0"), "target replica needs an integer >= 0, got '0'"),
    (Target("slice", 1, 0), "replica=R is only valid right after a stage=K target (e.g. kill:stage=1,replica=0@step=3),"
                            " not with target 'slice'"),
    (Target("all", None, 0), "not with target 'all'"),
])
def test_hand_built_stage_targets_are_checked(target, message):
    with pytest.raises(FaultSpecError) as info:
        validate([Fault("kill", target, When(step=1))])
    assert message in str(info.value)
    validate([Fault("kill", Target("stage", 0, 0), When(step=1)), Fault("kill_save", Target("stage", 2), When(step=1))])


def test_one_fault_vocabulary_from_the_grammar_to_the_report():
    """Every kind a run can be faulted with is drawn by random schedules, injected (the injector checks
    its table against the grammar and runtime.FAULT_ACTIONS at import) and folded into a failure kind."""
    import chaos.injector  # noqa: F401  (its import-time check is part of this test)
    from chaos.schedule import DEFAULT_KINDS
    from chaos.spec import INJECTABLE_KINDS, KINDS
    from elastic.report.fold import FAILURE_KIND_OF_FAULT

    assert set(INJECTABLE_KINDS) <= set(KINDS) and set(DEFAULT_KINDS) == set(INJECTABLE_KINDS) - {"kill_save"}
    assert set(FAILURE_KIND_OF_FAULT) == set(INJECTABLE_KINDS)
    for kind in set(KINDS) - set(INJECTABLE_KINDS):
        with pytest.raises(FaultSpecError, match=kind):
            validate(parse_faults(f"{kind}@step=1"))


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_shipped_scenarios_load_and_their_configs_are_valid(path):
    scenario = load_scenario(path)
    assert scenario.name == path.stem and scenario.faults and scenario.expect in ("pass", "fail")
    cfg = load_config(scenario.config, scenario.overrides)  # every override names a real config key
    fault_plan(cfg, ChaosOptions(faults=scenario.faults, seed=scenario.seed, mtbf_seconds=scenario.mtbf_seconds,
                                 duration_seconds=scenario.duration_seconds))   # every fault can fire


def test_shipped_scenarios_cover_the_demo_and_a_negative_control():
    scenarios = {p.stem: load_scenario(p) for p in SCENARIOS}
    assert len(scenarios) >= 4
    demo = scenarios["kill-three"]
    assert [f.kind for f in demo.faults] == ["kill"] * 3
    assert Fault("kill", Target("role", "source"), When(transfer=True)) in demo.faults
    negative = scenarios["no-recovery"]
    cfg = load_config(negative.config, negative.overrides)
    assert negative.expect == "fail" and cfg.elastic_spares == 0 and not cfg.elastic_relaunch
    assert cfg.elastic_min_slice_count == cfg.slices


def test_scenario_mapping_faults_and_defaults(tmp_path):
    path = tmp_path / "s.yml"
    path.write_text(
        "description: two forms\n"
        "overrides: {steps: 12, elastic_relaunch: false, learning_rate: 0.01}\n"
        "seed: 3\nmtbf_seconds: 20\nduration_seconds: 1m\n"
        "faults:\n"
        "  - kill@step=5\n"
        "  - {kind: hang, target: {slice: 2}, at: {step: 10}, options: {resume: 3s}}\n"
        "  - {kind: kill, target: {role: source}, at: transfer}\n"
        "  - {kind: partition, at: {time: 2.5}}\n"
        "  - {kind: kill, target: {stage: 1, replica: 0}, at: {step: 3}}\n")
    assert load_scenario(path) == Scenario(
        name="s", description="two forms", config="tiny", seed=3, mtbf_seconds=20.0, duration_seconds=60.0,
        overrides=("steps=12", "elastic_relaunch=false", "learning_rate=0.01"),
        faults=tuple(parse_faults("kill@step=5,hang(resume=3s):slice=2@step=10,kill@transfer,partition@time=2.5s,"
                                  "kill:stage=1,replica=0@step=3")))


@pytest.mark.parametrize("body,message", [
    ("name: x\nfault: [kill@step=1]\n", "unknown scenario key 'fault'"),
    ("faults: [{kind: kill, at: {step: 1}, when: 3}]\n", "faults[1]: unknown fault key 'when'"),
    ("faults: [kill@step=1, 'hang:slise=2@step=20']\n", "faults[2]: fault 1 'hang:slise=2@step=20': unknown target"),
    ("faults: ['kill@step=1,kill@step=2']\n", "faults[1]: expected exactly one fault"),
    ("expect: maybe\n", "'expect' must be 'pass' or 'fail'"),
    ("seed: true\n", "'seed' has the wrong type"),
    ("mtbf_seconds: 10\n", "mtbf_seconds needs duration_seconds"),
    ("- kill@step=1\n", "a scenario must be a YAML mapping"),
])
def test_scenario_errors_name_the_key_and_the_file(tmp_path, body, message):
    path = tmp_path / "bad.yml"
    path.write_text(body)
    with pytest.raises(FaultSpecError) as info:
        load_scenario(path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_random_faults_are_deterministic_in_the_seed():
    a = random_faults(7, mtbf_seconds=5.0, duration_seconds=120.0)
    assert a == random_faults(7, mtbf_seconds=5.0, duration_seconds=120.0)
    assert a != random_faults(8, mtbf_seconds=5.0, duration_seconds=120.0)
    assert len(a) > 5
    times = [f.when.time for f in a]
    assert times == sorted(times) and all(0 < t < 120.0 for t in times)
    assert all(f.target == Target("random") for f in a)
    validate(a)
    assert parse_faults(",".join(f.spec() for f in a)) == a
    for f in a:
        if f.kind == "hang":
            assert f.option("resume") == 2.0
        if f.kind in ("straggle", "partition"):
            assert 1.0 < f.option("for") < 10.0 and f.options  # drawn explicitly


def test_a_chaos_runs_recovery_budget_fits_every_fault_it_schedules():
    soak = random_faults(7, mtbf_seconds=20.0, duration_seconds=300.0)   # the README's soak: 20 faults, 10 allowed
    assert recovery_budget(soak, 10, workers=4) == 2 * len(soak) > 10
    assert recovery_budget(soak[:3], 10, workers=4) == 10   # the configured budget, when it is more
    assert recovery_budget(parse_faults("kill:all@step=3,kill:everything@step=5"), 1, workers=5) == 20
    assert recovery_budget(soak, 0, workers=4) == 0   # recovery off (a negative control) stays off


def test_random_faults_honours_kinds_and_arguments():
    assert {f.kind for f in random_faults(1, 1.0, 60.0, kinds=("kill",))} == {"kill"}
    assert random_faults(1, 1000.0, 0.0) == []
    assert "kill_save" not in {f.kind for f in random_faults(1, 1.0, 200.0)}   # a soak needs no checkpoints
    drawn = random_faults(1, 1.0, 60.0, kinds=("kill_save",))
    assert drawn and all(f.target == Target("role", "writer") for f in drawn)
    with pytest.raises(FaultSpecError, match="mtbf_seconds must be > 0"):
        random_faults(1, 0.0, 10.0)


ACTIVE, SPARES = ("w0", "w1", "w2", "w3"), ("w4",)


@pytest.mark.parametrize("target,expected", [
    (Target("slice", 2), ("w2",)),
    (Target("worker", "w4"), ("w4",)),
    (Target("role", "spare"), ("w4",)),
    (Target("all"), ACTIVE),
    (Target("everything"), ACTIVE + SPARES),
])
def test_resolve_fixed_targets(target, expected):
    assert resolve_target(target, Placement(1, ACTIVE), SPARES, random.Random(0)) == expected


def test_resolve_random_targets_use_the_rng_and_active_slices_only():
    picks = [resolve_target(Target("random"), Placement(1, ACTIVE), SPARES, random.Random(s)) for s in range(40)]
    assert {p for (p,) in picks} == set(ACTIVE)
    again = [resolve_target(Target("random"), Placement(1, ACTIVE), SPARES, random.Random(s)) for s in range(40)]
    assert picks == again
    assert resolve_target(Target("role", "active"), Placement(1, ("w9",)), (), random.Random(0)) == ("w9",)


def test_resolve_transfer_roles():
    rng = random.Random(0)
    grid = Placement(1, ACTIVE)
    assert resolve_target(Target("role", "source"), grid, SPARES, rng, source="w1", dest="w4") == ("w1",)
    assert resolve_target(Target("role", "dest"), grid, SPARES, rng, source="w1", dest="w4") == ("w4",)
    with pytest.raises(TargetError, match="no state transfer is in progress"):
        resolve_target(Target("role", "source"), Placement(1, ACTIVE), SPARES, rng)


@pytest.mark.parametrize("target,active,spares,message", [
    (Target("slice", 4), ACTIVE, SPARES, "slice 4 is out of range: 4 active slices (0..3)"),
    (Target("worker", "w9"), ACTIVE, SPARES, "unknown worker 'w9'"),
    (Target("role", "spare"), ACTIVE, (), "no spare left"),
    (Target("random"), (), SPARES, "no active slice"),
    (Target("all"), (), SPARES, "no active slice"),
])
def test_resolve_errors(target, active, spares, message):
    with pytest.raises(TargetError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        resolve_target(target, Placement(1, active), spares, random.Random(0))
    assert isinstance(info.value, ValueError)


# A pipelined run of S=2 stages x R=2 replicas: stage-major, so stage k replica r runs active[k * 2 + r].
PIPELINED = ("s0r0", "s0r1", "s1r0", "s1r1")


@pytest.mark.parametrize("target,expected", [
    (Target("stage", 1), ("s1r0",)),                   # no replica: the stage's first
    (Target("stage", 1, 0), ("s1r0",)),
    (Target("stage", 1, 1), ("s1r1",)),
    (Target("stage", 0, 1), ("s0r1",)),
    (Target("slice", 3), ("s1r1",)),
])
def test_resolve_stage_targets_stage_major(target, expected):
    assert resolve_target(target, Placement(1, PIPELINED, stages=2), (), random.Random(0)) == expected


@pytest.mark.parametrize("target,active,stages,message", [
    (Target("stage", 2), PIPELINED, 2, "stage 2 is out of range: the run has 2 pipeline stages (0..1)"),
    (Target("stage", 1, 2), PIPELINED, 2, "replica 2 of stage 1 is out of range: 2 pipeline replicas (0..1)"),
    (Target("stage", 0, 3), PIPELINED[:2] + ("x", "y", "z", "v"), 3, "replica 3 of stage 0 is out of range"),
    (Target("stage", 0), PIPELINED, 1, "target stage=0 names nobody: the run has no pipeline stages "
                                       "(dcn_pipeline_parallelism=1); use slice=N"),
    (Target("stage", 1, 0), PIPELINED[:3], 2, "target stage=1,replica=0 names nobody now: 3 active slices do not "
                                              "split into 2 pipeline stages"),
])
def test_resolve_stage_errors(target, active, stages, message):
    with pytest.raises(TargetError) as info:
        resolve_target(target, Placement(1, active, stages=stages), (), random.Random(0))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_injector_hits_the_stage_through_the_controllers_placement_grid():
    ctl = Controller(active=PIPELINED, spares=(), stages=2)
    injector = FaultInjector(parse_faults("corrupt:stage=1@step=1,corrupt:stage=0,replica=1@step=1,"
                                          "corrupt:stage=2@step=1"))
    injector.attach(ctl)
    injector.step_committed(1)
    injector.close()
    assert ctl.armed == [("s1r0", "corrupt", 0.0, 0.0, ""), ("s0r1", "corrupt", 0.0, 0.0, "")]
    [skipped] = [e for e in ctl.events.emitted if e["kind"] == "fault_skipped"]
    assert skipped["fault"] == "corrupt:stage=2@step=1" and "stage 2 is out of range" in skipped["reason"]


# --------------------------------------------------------------------------- faults that can never fire (or did not)

def shape(*overrides, duration=None, mtbf=None):
    return RunShape.of(load_config("tiny", list(overrides)), duration_seconds=duration, mtbf_seconds=mtbf)


@pytest.mark.parametrize("spec,overrides,soak,message", [
    ("kill@step=500", ["steps=20"], {}, "fault 1 'kill@step=500': step=500 is never reached: the run commits "
                                        "20 steps"),
    ("kill@step=3,hang@step=20", ["steps=20"], {}, "fault 2 'hang@step=20': step=20 is never reached"),
    ("kill@time=90s", ["steps=100000"], {"mtbf": 20.0, "duration": 60.0},
     "fault 1 'kill@time=90s': time=90s is at or after the soak duration (60s)"),
    ("kill:slice=4@step=1", ["dcn_data_parallelism=4"], {}, "fault 1 'kill:slice=4@step=1': slice 4 does not "
                                                           "exist: the run has 4 slices (dcn_data_parallelism=4, "
                                                           "slices 0..3)"),
    ("kill:role=spare@step=1", ["elastic_spares=0"], {}, "role=spare names nobody: the run has no spares "
                                                        "(elastic_spares=0)"),
    ("kill:role=source@transfer", ["elastic_spares=1"], {}, "no state transfer can happen: a transfer follows "
                                                           "a lost worker, and no other fault"),
    ("kill@step=2,hang:role=dest@transfer", ["elastic_spares=0", "elastic_relaunch=false"], {},
     "no state transfer can happen: no worker can ever join the run (elastic_spares=0 and elastic_relaunch=false)"),
    ("kill@step=2,kill@transfer", ["elastic_enabled=false"], {}, "no state transfer can happen: no worker can ever "
                                                                "join the run (elastic_enabled=false)"),
    ("kill_save@step=3", [], {}, "kill_save hits a checkpoint being written, and the run writes no checkpoints"),
    ("kill:all@checkpoint=8", [], {}, "checkpoint=8 waits for a checkpoint, and the run writes no checkpoints"),
    ("kill:all@checkpoint=30", ["steps=20", "enable_checkpointing=true"], {},
     "checkpoint=30 is never reached: the run's newest checkpoint holds at most 20 steps"),
    ("kill_save@checkpoint=9", ["steps=10", "enable_checkpointing=true", "checkpoint_period=4"], {},
     "kill_save cuts off a save that follows checkpoint=9, and none does: the first checkpoint of step 9 or later "
     "is the run's last (step 10; checkpoint_period=4)"),
    ("kill_save@checkpoint=10", ["steps=10", "enable_checkpointing=true", "checkpoint_period=2"], {},
     "the first checkpoint of step 10 or later is the run's last"),
    ("kill:all@snapshot=8", [], {}, "snapshot=8 waits for an in-memory snapshot, and the run takes none"),
    ("kill:all@snapshot=20", ["steps=20", "elastic_snapshot_interval=4"], {},
     "snapshot=20 is never reached: snapshots follow steps before the last, so they hold at most 19 steps"),
    ("kill:slice=4@step=1", ["dcn_data_parallelism=2", "dcn_pipeline_parallelism=2"], {},
     "slice 4 does not exist: the run has 4 slices (dcn_data_parallelism=2 x dcn_pipeline_parallelism=2, "
     "slices 0..3)"),
    ("kill:stage=2@step=1", ["dcn_data_parallelism=2", "dcn_pipeline_parallelism=2"], {},
     "fault 1 'kill:stage=2@step=1': stage 2 does not exist: the run has 2 stages (dcn_pipeline_parallelism=2, "
     "stages 0..1)"),
    ("hang(resume=3s):stage=1,replica=2@step=1", ["dcn_data_parallelism=2", "dcn_pipeline_parallelism=2"], {},
     "replica 2 of stage 1 does not exist: each stage has 2 replicas (dcn_data_parallelism=2, replicas 0..1)"),
    ("kill:stage=0@step=1", ["dcn_data_parallelism=4"], {},
     "target stage=0 names nobody: the run has no pipeline stages (dcn_pipeline_parallelism=1); use slice=N"),
])
def test_a_fault_that_can_never_fire_is_refused_naming_it_and_why(spec, overrides, soak, message):
    with pytest.raises(FaultSpecError) as info:
        check_reachable(parse_faults(spec), shape(*overrides, **soak))
    assert message in str(info.value)


@pytest.mark.parametrize("spec,overrides,soak", [
    ("kill@step=19,kill@step=0", ["steps=20"], {}),
    ("kill@time=10m", ["steps=20"], {}),                          # no duration: cannot be known up front
    ("kill@time=59s", ["steps=100000"], {"mtbf": 20.0, "duration": 60.0}),
    ("kill:slice=3@step=1,kill:worker=w9@step=2", ["dcn_data_parallelism=4"], {}),
    ("kill:role=spare@step=1", ["elastic_spares=1"], {}),
    ("kill@step=2,kill:role=source@transfer", ["elastic_spares=0"], {}),   # relaunched workers join
    ("kill:role=dest@transfer", ["elastic_spares=1", "steps=100000"], {"mtbf": 20.0, "duration": 60.0}),
    ("kill_save@step=3,kill:everything@checkpoint=20", ["steps=20", "enable_checkpointing=true"], {}),
    ("kill_save@checkpoint=8", ["steps=10", "enable_checkpointing=true", "checkpoint_period=2"], {}),  # 10 follows
    ("kill_save@checkpoint=5", ["steps=10", "enable_checkpointing=true", "checkpoint_period=4"], {}),  # 8, then 10
    ("kill:all@snapshot=16", ["steps=20", "elastic_snapshot_interval=4"], {}),
    ("kill:slice=3@step=1,kill:stage=1,replica=1@step=2,hang(resume=3s):stage=0@step=3",
     ["dcn_data_parallelism=2", "dcn_pipeline_parallelism=2"], {}),
])
def test_a_fault_that_can_fire_is_accepted(spec, overrides, soak):
    check_reachable(parse_faults(spec), shape(*overrides, **soak))


def test_elastic_chaos_refuses_a_fault_that_can_never_fire_before_anything_starts(monkeypatch, capsys):
    import chaos.cli
    import elastic.cli

    def no_run(*args, **kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr(chaos.cli, "make_job", no_run)
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert elastic.cli.main(["chaos", "tiny", "steps=20", "--faults", "kill@step=500", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["elastic: error: fault 1 'kill@step=500': step=500 is never reached: the run commits 20 steps "
                   "(a fault @step=N fires once N steps are committed, so N must be below 20)"]


def test_faults_that_never_fired_are_recorded_as_skipped_when_the_run_ends():
    ctl = Controller(active=("w0", "w1"), spares=())
    injector = FaultInjector(parse_faults("corrupt:slice=1@step=1,corrupt@step=500,partition@time=10m,kill@transfer"))
    injector.attach(ctl)
    injector.step_committed(0)
    injector.step_committed(1)
    injector.close()
    injector.close()   # at most once
    injector.step_committed(600)   # too late: nothing fires after the end
    assert ctl.armed == [("w1", "corrupt", 0.0, 0.0, "")]
    done = [e for e in ctl.events.emitted if e["kind"] in ("fault_injected", "fault_skipped")]
    assert [(e["kind"], e["index"], e["fault"]) for e in done] == [
        ("fault_injected", 0, "corrupt:slice=1@step=1"), ("fault_skipped", 1, "corrupt@step=500"),
        ("fault_skipped", 2, "partition@time=600s"), ("fault_skipped", 3, "kill:role=source@transfer")]
    step, time_, transfer = (e["reason"] for e in done[1:])
    assert step == "never fired: the run ended with 2 steps committed, before step=500"
    assert time_.startswith("never fired: the run ended") and "before time=600s" in time_
    assert transfer == "never fired: no state transfer happened"
    assert [e["fault_kind"] for e in done[1:]] == ["corrupt", "partition", "kill"]
    assert all(e["step"] == 2 for e in done[1:])
