"""Property-based fuzzing of the fault grammar, its checks and scenario files (pure, bounded, deterministic).

Contract under test: whatever the text, YAML or hand-built fault, the answer
is a valid result or the grammar's typed error, :class:`chaos.FaultSpecError`
(a ``ValueError``), never another exception. A valid result keeps its own
promises: ``parse_faults(f.spec()) == [f]`` and ``validate`` accepts it.
"""

import math
import pathlib
import tempfile

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from chaos import Fault, FaultSpecError, Scenario, Target, When, load_scenario, parse_faults, validate
from chaos.reach import RunShape, check_reachable
from chaos.spec import KINDS, parse_duration

# Hypothesis caches what it learns about the code under .hypothesis/ in the working directory; keep the
# checkout clean (the examples are derandomized and no database is kept, so nothing is lost).
set_hypothesis_home_dir(pathlib.Path(tempfile.gettempdir()) / "jax-elastic-hypothesis")
FUZZ = settings(deadline=None, derandomize=True, database=None, max_examples=120,
                suppress_health_check=[HealthCheck.too_slow])

# Pieces of the grammar and near misses; a fault spec is a run of these and of a little noise.
TOKENS = [*KINDS, "kil", "straggle ", "(", ")", "()", ",", ":", "@", "=", " ", "step", "time", "transfer",
          "slice", "stage", "replica", ",replica=", "worker", "role", "random", "all", "everything", "active", "spare",
          "source", "dest",
          "factor", "for", "resume", "phase", "grad", "reduce", "apply", "0", "3", "-1", "1.5", "8s", "500ms",
          "2m", "1e999", "nan", "inf", "w2", "w-2.a", "\x00", "é", "1e-320"]
SPEC_TEXT = st.one_of(
    st.lists(st.one_of(st.sampled_from(TOKENS), st.text(max_size=3)), max_size=14).map("".join),
    st.text(max_size=40),
)
# Faults as the grammar writes them: valid more often than not, so the round trip is exercised too.
ONE_FAULT = st.builds(
    lambda kind, options, target, when: f"{kind}{options}{target}@{when}",
    st.sampled_from(KINDS),
    st.sampled_from(["", "(factor=4)", "(for=8s)", "(factor=1.5,for=500ms)", "(resume=3s)", "(phase=grad)",
                     "(phase=apply)", "(for=0)", "(factor=0.5)", "(resume=1e999)"]),
    st.sampled_from(["", ":slice=0", ":slice=2", ":worker=w1", ":role=active", ":role=spare", ":role=source",
                     ":role=dest", ":random", ":all", ":everything", ":stage=0", ":stage=1,replica=1",
                     ":stage=2, replica=0", ":slice=1,replica=0", ":replica=1"]),
    st.one_of(st.integers(0, 10**6).map(lambda n: f"step={n}"),
              st.floats(0, 1e9, allow_nan=False).map(lambda s: f"time={s!r}"),
              st.sampled_from(["time=30s", "time=500ms", "time=2m", "transfer"])),
)
SPEC_LIST = st.lists(ONE_FAULT, min_size=1, max_size=4).map(",".join)
ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**20), st.floats(), st.text(max_size=6),
                st.lists(st.integers(), max_size=2), st.sampled_from(["grad", "spare", "source", "w1", "slice"]))


def check_faults(faults):
    """What every fault list the grammar hands out must satisfy."""
    assert faults and all(isinstance(f, Fault) for f in faults)
    for f in faults:
        assert parse_faults(f.spec()) == [f]
    assert parse_faults(",".join(f.spec() for f in faults)) == faults
    try:
        validate(faults)
    except FaultSpecError:
        assert any(f.kind == "kill_save" for f in faults)


@FUZZ
@given(st.one_of(SPEC_TEXT, SPEC_LIST))
def test_parse_faults_gives_faults_or_a_fault_spec_error(text):
    try:
        faults = parse_faults(text)
    except FaultSpecError as e:
        assert str(e)
        return
    check_faults(faults)


@FUZZ
@given(st.one_of(st.text(max_size=12), st.lists(st.sampled_from(TOKENS + ["e", "E", "+", "."]), max_size=6)
                 .map("".join)))
def test_parse_duration_gives_seconds_or_a_fault_spec_error(text):
    try:
        seconds = parse_duration(text)
    except FaultSpecError:
        return
    assert isinstance(seconds, float) and math.isfinite(seconds) and seconds >= 0


HAND_BUILT = st.builds(
    Fault,
    kind=st.one_of(st.sampled_from(KINDS), ANY),
    target=st.one_of(st.builds(Target, st.sampled_from(["slice", "stage", "worker", "role", "random", "all",
                                                        "everything"]), ANY),
                     st.builds(Target, st.sampled_from(["stage", "slice", "all"]), ANY, ANY),
                     st.builds(Target, ANY, ANY), ANY),
    when=st.one_of(st.builds(When, step=ANY), st.builds(When, time=ANY), st.builds(When, transfer=ANY),
                   st.builds(When, step=ANY, time=ANY, transfer=ANY), ANY),
    options=st.one_of(st.just(()), st.lists(st.tuples(st.sampled_from(["factor", "for", "resume", "phase", "x"]),
                                                      ANY), max_size=2).map(tuple), ANY),
)


@FUZZ
@given(st.lists(st.one_of(HAND_BUILT, ANY), min_size=1, max_size=3))
def test_validate_of_hand_built_faults_accepts_only_what_the_grammar_can_write(faults):
    try:
        validate(faults)
    except FaultSpecError as e:
        assert str(e)
        return
    check_faults(faults)   # a fault validate accepts is one the grammar reads back as itself


SHAPES = st.builds(lambda replicas, stages, **shape: RunShape(slices=replicas * stages, stages=stages, **shape),
                   replicas=st.integers(1, 8), stages=st.integers(1, 3), steps=st.integers(1, 100),
                   spares=st.integers(0, 3),
                   recovery=st.booleans(), relaunch=st.booleans(),
                   duration_seconds=st.one_of(st.none(), st.floats(0.001, 1e4)), random_faults=st.booleans())


@FUZZ
@given(SPEC_LIST, SHAPES)
def test_check_reachable_accepts_or_names_the_fault(text, shape):
    try:
        faults = parse_faults(text)
    except FaultSpecError:
        return
    try:
        check_reachable(faults, shape)
    except FaultSpecError as e:
        assert str(e).startswith("fault ") and any(repr(f.spec()) in str(e) for f in faults)


# --------------------------------------------------------------------------- scenario files

SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**30), st.floats(), st.text(max_size=8),
                   st.sampled_from(["30s", "1m", "tiny", "pass", "fail", "steps=3", "kill@step=1"]))
VALUE = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                     max_leaves=8)
FAULT_ITEM = st.one_of(
    ONE_FAULT, VALUE,
    st.fixed_dictionaries({"kind": st.one_of(st.sampled_from(KINDS), SCALAR),
                           "at": st.one_of(st.sampled_from(["transfer", "step=3", "time=2s"]),
                                           st.dictionaries(st.sampled_from(["step", "time", "transfer"]),
                                                           SCALAR, max_size=2), SCALAR)},
                          optional={"target": st.one_of(st.dictionaries(st.sampled_from(["slice", "role", "worker",
                                                                                          "all"]),
                                                                        SCALAR, max_size=2), SCALAR),
                                    "options": st.one_of(st.dictionaries(st.sampled_from(["factor", "for", "resume",
                                                                                           "phase"]),
                                                                         SCALAR, max_size=2), VALUE),
                                    "when": SCALAR}),
)
SCENARIO_KEYS = ["name", "description", "config", "overrides", "seed", "faults", "mtbf_seconds", "duration_seconds",
                 "expect"]
SCENARIO = st.dictionaries(
    st.one_of(st.sampled_from(SCENARIO_KEYS), st.text(max_size=5)),
    st.one_of(VALUE, st.lists(FAULT_ITEM, max_size=3), st.dictionaries(st.sampled_from(["steps", "seed", "x"]),
                                                                       SCALAR, max_size=2)),
    max_size=6,
).map(lambda d: yaml.safe_dump(d, allow_unicode=True))
# YAML a person (or a corrupted file) might write, that safe_dump would never produce.
RAW_YAML_LINES = ["seed: 2001-02-30", "seed: 2001-02-03", "seed: 0x1F", "name: &a [*a]", "faults: !!binary aGk=",
                  "faults: [kill@step=1", "? [1, 2]\n: 3", "overrides: {steps: 1e400}", "mtbf_seconds: .nan",
                  "duration_seconds: 1e999", "faults:\n  - kill(@step=1)", "expect: !!python/none ''", "\t", "%YAML 9",
                  "faults: [{kind: kill, at: {step: 2001-13-01}}]", "faults: " + "[" * 200 + "]" * 200]
RAW_YAML = st.lists(st.sampled_from(RAW_YAML_LINES), min_size=1, max_size=3).map("\n".join)
SCENARIO_BYTES = st.one_of(SCENARIO.map(str.encode), RAW_YAML.map(str.encode), st.text(max_size=60).map(str.encode),
                           st.binary(max_size=60))

@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One directory for every example of a test (hypothesis runs examples inside one test call)."""
    return tmp_path_factory.mktemp("fuzz-scenario")


@settings(FUZZ, max_examples=100)
@given(SCENARIO_BYTES)
def test_load_scenario_gives_a_scenario_or_a_fault_spec_error(scratch, data):
    path = scratch / "scenario.yml"
    path.write_bytes(data)
    try:
        scenario = load_scenario(path)
    except FaultSpecError as e:
        assert str(path) in str(e)
        return
    assert isinstance(scenario, Scenario) and scenario.expect in ("pass", "fail")
    assert isinstance(scenario.seed, int) and all(isinstance(o, str) and "=" in o for o in scenario.overrides)
    if scenario.faults:
        check_faults(list(scenario.faults))
    for seconds in (scenario.mtbf_seconds, scenario.duration_seconds):
        assert seconds is None or (math.isfinite(seconds) and seconds > 0)


@pytest.mark.parametrize("text", ["kill(@step=1)", "kill(phase=grad@step=1)", "hang(resume=3s@transfer)"])
def test_an_option_list_cut_by_the_at_sign_is_a_fault_spec_error(text):
    """Found by the fuzzer: the grammar raised a bare ValueError ('substring not found')."""
    with pytest.raises(FaultSpecError, match="unclosed '\\('"):
        parse_faults(text)


@pytest.mark.parametrize("body,message", [
    (b"\xff\xfe", "not UTF-8"),
    (b"seed: 2001-02-30\n", "invalid YAML"),
    (b"faults: " + b"[" * 800 + b"]" * 800, "nested too deeply"),
])
def test_unreadable_scenario_files_are_a_fault_spec_error(tmp_path, body, message):
    """Found by the fuzzer: UnicodeDecodeError, PyYAML's ValueError for an impossible date, RecursionError."""
    path = tmp_path / "bad.yml"
    path.write_bytes(body)
    with pytest.raises(FaultSpecError, match=message) as info:
        load_scenario(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("fault,message", [
    (Fault("kill", Target("random"), When(time="3s")), "time must be a finite number of seconds"),
    (Fault("kill", Target("random"), When(transfer="yes")), "when.transfer must be True or False"),
    (Fault("straggle", Target("random"), When(step=1), (("factor", "4"),)), "option 'factor' must be a number"),
    (Fault("kill", Target("random"), When(step=1), (("phase",),)), "options must be (name, value) pairs"),
    (Fault("hang", Target("random"), When(time=10**400)), "time must be a finite number of seconds"),
    (Fault("hang", Target("random"), When(step=1), (("resume", 2**60 + 1),)), "option 'resume' must be a number"),
    (Fault(["kill"], Target("random"), When(step=1)), "unknown kind"),
    (Fault("kill", None, When(step=1)), "target must be a Target"),
    ("kill@step=1", "not a Fault"),
])
def test_validate_types_every_field_of_a_hand_built_fault(fault, message):
    """Found by the fuzzer: TypeError/ValueError/AttributeError from validate, or a fault accepted that
    the grammar cannot write."""
    with pytest.raises(FaultSpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate([fault])
