"""Property-based fuzzing of the event-log fold, the log reader and the renderers (pure, bounded, deterministic).

Contracts under test:

* ``elastic.report.build_report`` over events of the real kinds with fields
  of the right types (any values, any mix and order of kinds, times in
  order) gives a report that validates against ``docs/report.schema.json``,
  and ``render_html`` / ``summary_text`` render it;
* over anything else (random JSON), it gives a report or raises one of the
  errors ``elastic report`` turns into one line, "not a valid event log"
  (``ValueError``, ``KeyError``, ``TypeError``), never another traceback;
  the renderers render whatever report the fold gives;
* ``runtime.read_events`` over arbitrary bytes gives a list of events (dicts)
  or a ``ValueError``.

The ``test_*_found_by_the_fuzzers`` tests keep the exact examples the
fuzzers once found breaking these, with the stronger contract they now
hold: a malformed event or line is a ``ValueError`` naming it.
"""

import json
import math
import pathlib
import tempfile

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from elastic.report import build_report, render_html, summary_text
from runtime import read_events

# Hypothesis caches what it learns about the code under .hypothesis/ in the working directory; keep the
# checkout clean (the examples are derandomized and no database is kept, so nothing is lost).
set_hypothesis_home_dir(pathlib.Path(tempfile.gettempdir()) / "jax-elastic-hypothesis")
FUZZ = settings(deadline=None, derandomize=True, database=None, max_examples=60,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SCHEMA = json.loads((pathlib.Path(__file__).resolve().parents[2] / "docs" / "report.schema.json").read_text())
VALIDATOR = jsonschema.validators.validator_for(SCHEMA)(SCHEMA)   # built once: jsonschema.validate rebuilds it

# --------------------------------------------------------------------------- well-formed events

WORKER = st.sampled_from(["w0", "w1", "w2", "w3", "w4", "w5"])
WORKERS = st.lists(WORKER, unique=True, max_size=4)
NAT = st.integers(0, 50)
BIG = st.integers(0, 2**40)
SECONDS = st.floats(0, 1e4)
TEXT = st.text(max_size=12)
SHA = st.one_of(st.text("0123456789abcdef", min_size=1, max_size=8), st.just("ab" * 32))   # logs before digests
DIGEST = st.sampled_from(["xxh3_128:" + "ab" * 16, "sha256:" + "ab" * 32])              # named their algorithm: SHA
LOSS = st.one_of(st.floats(-1e6, 1e6), st.floats())   # a diverging run can log inf or nan
PATH = st.sampled_from(["replace", "shrink", "retry", "wait", "fail"])

# kind -> (required fields, optional fields): what the runtime, trainer and chaos harness emit.
KINDS = {
    "job_started": ({"mode": st.sampled_from(["distributed", "reference"]),
                     "config": st.one_of(st.none(), st.fixed_dictionaries({"steps": NAT, "seed": NAT,
                                                                           "run_name": TEXT})),
                     "global_batch_size": BIG, "microbatches": NAT}, {}),
    "programs_built": ({"program_bytes": st.dictionaries(st.sampled_from(["grad", "apply", "init"]), BIG),
                        "state_bytes": BIG, "seconds": SECONDS}, {"grad_size": BIG}),
    "run_started": ({"run_id": TEXT, "slices": NAT, "devices_per_slice": NAT, "steps": NAT},
                    {"spares": NAT, "microbatches": NAT, "controller": TEXT}),
    "placement": ({"epoch": NAT, "active": WORKERS, "spares": WORKERS, "seconds": SECONDS}, {}),
    "device_probe": ({"worker": WORKER, "ok": st.booleans(), "devices": NAT, "seconds": SECONDS}, {}),
    "programs_loaded": ({"compile_seconds": st.dictionaries(WORKER, SECONDS), "program_bytes": BIG}, {}),
    "state_initialized": ({"seed": NAT, "state_bytes": BIG}, {}),
    "step_committed": ({"step": NAT, "loss": LOSS},
                       {"epoch": NAT, "seconds": SECONDS, "recovered": st.booleans(),
                        "microbatches": st.dictionaries(WORKER, st.lists(st.integers(-2, 9), max_size=4),
                                                        max_size=3)}),
    "failure_detected": ({"error": st.sampled_from(["WorkerLostError", "StepAbortedError", "WorkerError"]),
                          "detail": TEXT, "committed": NAT}, {"worker": WORKER}),
    "worker_dead": ({"worker": WORKER, "reason": TEXT}, {"cause": st.sampled_from(["crash", "hang", "stuck"])}),
    "recovery_decision": ({"action": PATH, "dead": WORKERS, "active": WORKERS},
                          {"reason": TEXT, "epoch": NAT, "spares": WORKERS}),
    "checkpoint_restored": ({"step": NAT, "tier": st.sampled_from(["memory", "disk"])}, {}),
    "transfer_started": ({"source": WORKER, "dest": WORKER, "step": NAT}, {}),
    "state_transferred": ({"source": WORKER, "dest": WORKER, "step": NAT, "bytes": BIG, "seconds": SECONDS,
                           "digest": DIGEST}, {"sha256": SHA, "transport": st.sampled_from(["shared_memory", "tcp", "grpc"])}),
    "recovered": ({"path": PATH, "resume_step": NAT, "bytes_moved": BIG},
                  {"epoch": NAT, "dead": WORKERS, "seconds": SECONDS}),
    "grown": ({"epoch": NAT, "promoted": WORKERS, "active": WORKERS, "bytes_moved": BIG, "step": NAT}, {}),
    "straggler_replaced": ({"epoch": NAT, "promoted": WORKERS, "active": WORKERS, "bytes_moved": BIG, "step": NAT,
                            "slow": WORKER}, {}),
    "straggler": ({"worker": WORKER, "step": NAT, "seconds": SECONDS, "median_seconds": SECONDS,
                   "action": st.sampled_from(["reported", "replaced"])}, {}),
    "capacity_wait": ({}, {"seconds": SECONDS, "needed": NAT}),
    "capacity_wait_ended": ({}, {"seconds": SECONDS, "found": WORKERS}),
    "step_watchdog": ({"step": NAT, "suspects": WORKERS}, {}),
    "chaos_started": ({"spec": TEXT, "seed": NAT, "mtbf_seconds": st.one_of(st.none(), SECONDS),
                       "duration_seconds": st.one_of(st.none(), SECONDS), "scenario": st.one_of(st.none(), TEXT)},
                      {}),
    "fault_injected": ({"index": NAT, "fault": TEXT, "fault_kind": st.sampled_from(
                           ["kill", "hang", "straggle", "partition", "corrupt"]), "workers": WORKERS, "step": NAT,
                        "errors": st.dictionaries(WORKER, TEXT, max_size=1), "seconds": SECONDS}, {}),
    "fault_skipped": ({"index": NAT, "fault": TEXT, "fault_kind": st.sampled_from(["kill", "hang", "corrupt"]),
                       "reason": TEXT, "step": NAT}, {}),
    "run_truncated": ({"steps": NAT, "reason": TEXT}, {}),
    "security_refused": ({}, {"count": st.integers(1, 10**6), "method": TEXT, "peer": TEXT}),
    "register_refused": ({"worker": WORKER, "reason": TEXT}, {"rejoin": st.booleans()}),
    "events_dropped": ({"count": BIG}, {"error": TEXT}),
    "run_failed": ({"error": TEXT}, {}),
    "verdict": ({"verdict": st.sampled_from(["pass", "fail"]), "verdict_reasons": st.lists(TEXT, max_size=2),
                 "trajectory": st.sampled_from(["identical", "within_tolerance", "diverged", None]),
                 "first_diverging_step": st.one_of(st.none(), NAT), "exactly_once": st.one_of(st.none(), st.booleans()),
                 "exactly_once_detail": st.dictionaries(st.sampled_from(["missing", "duplicated"]),
                                                        st.lists(st.lists(NAT, min_size=2, max_size=2), max_size=2)),
                 "reference": st.one_of(st.none(), st.fixed_dictionaries({
                     "run_dir": TEXT, "losses": st.lists(LOSS, max_size=3), "final_state_digest": DIGEST}))}, {}),
    # final_state_digest today; final_state_sha256 instead in logs from before the digest named its algorithm.
    "run_finished": ({"steps_completed": NAT, "replica_hashes": st.dictionaries(WORKER, DIGEST),
                      "wall_seconds": SECONDS, "client_peak_rss_bytes": BIG},
                     {"final_state_digest": DIGEST, "final_state_sha256": SHA}),
}


@st.composite
def event_logs(draw):
    """A log of real kinds with well-typed fields, times never going back (one clock wrote them)."""
    kinds = draw(st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=25))
    gaps = draw(st.lists(st.floats(0, 100), min_size=len(kinds), max_size=len(kinds)))
    t, events = 1.7e9, []
    for kind, gap in zip(kinds, gaps):
        t += gap
        required, optional = KINDS[kind]
        fields = draw(st.fixed_dictionaries(required, optional=optional))
        events.append({"t": t, "kind": kind, **fields})
    return events


def check_report(report: dict, events: list) -> None:
    VALIDATOR.validate(report)
    json.dumps(report)   # report.json can be written
    assert render_html(report, events).startswith("<!DOCTYPE html>")
    assert summary_text(report)


@FUZZ
@given(event_logs())
def test_the_fold_of_a_well_formed_log_validates_against_the_schema_and_renders(events):
    report = build_report(events)
    check_report(report, events)
    assert report["steps_completed"] + report["steps_lost"] == sum(e["kind"] == "step_committed" for e in events)
    gp = report["goodput"]
    if gp["wall_seconds"] > 0:
        total = gp["productive_seconds"] + sum(gp["badput_seconds"].values())
        assert math.isclose(total, gp["wall_seconds"], rel_tol=1e-6, abs_tol=1e-6)


# --------------------------------------------------------------------------- malformed events

JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30), st.floats(), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=10,
)


@st.composite
def malformed_events(draw):
    """A well-formed event with a field or two given random values or dropped, a real kind with random
    fields, or any JSON at all."""
    choice = draw(st.integers(0, 3))
    if choice == 0:
        return draw(JSON)
    kind = draw(st.sampled_from(sorted(KINDS)))
    required, optional = KINDS[kind]
    event = {"t": draw(st.one_of(st.floats(1.7e9, 1.8e9), st.floats(), JSON)), "kind": kind}
    if choice == 3:
        return {**event, **draw(st.dictionaries(st.text(max_size=6), JSON, max_size=3))}
    event.update(draw(st.fixed_dictionaries(required, optional=optional)))
    for name in draw(st.lists(st.sampled_from(sorted(event)), max_size=2)):
        if draw(st.booleans()):
            event[name] = draw(JSON)
        else:
            event.pop(name, None)
    return event


# Exceptions `elastic report` turns into "elastic: error: ... is not a valid event log" (elastic/cli.py).
REPORTED = (ValueError, KeyError, TypeError)


@settings(FUZZ, max_examples=70)
@given(st.lists(st.one_of(malformed_events(), event_logs().map(lambda es: es[0] if es else {})), max_size=6))
def test_the_fold_of_anything_gives_a_report_or_an_error_elastic_report_can_name(events):
    try:
        report = build_report(events)
        check_report(report, events)
    except REPORTED:
        return
    except jsonschema.ValidationError:
        return   # random values that the fold copies verbatim; it promises nothing about those


# Every field of every kind, in turn, given each of these (or dropped): exhaustive where random draws would
# seldom hit one field of one kind with one wrong type.
WRONG = [[1], {"a": 1}, "x", float("inf"), float("nan"), None, -1, 10**30, True]
_DROP = object()
# Enough of a run before the mutated event that every branch of the fold can be reached.
_PREFIX = [("job_started", {"mode": "distributed", "config": {"steps": 3, "seed": 0}, "global_batch_size": 8,
                            "microbatches": 4}),
           ("run_started", {"run_id": "r", "slices": 2, "devices_per_slice": 1, "steps": 3}),
           ("placement", {"epoch": 1, "active": ["w0", "w1"], "spares": ["w2"], "seconds": 0.1}),
           ("state_initialized", {"seed": 0, "state_bytes": 10}),
           ("step_committed", {"step": 0, "loss": 2.0, "seconds": 0.1}),
           ("fault_injected", {"index": 0, "fault": "kill:slice=1@step=1", "fault_kind": "kill", "workers": ["w1"],
                               "step": 1, "errors": {}, "seconds": 0.2}),
           ("worker_dead", {"worker": "w1", "reason": "gone", "cause": "crash"}),
           ("failure_detected", {"error": "WorkerLostError", "detail": "w1", "committed": 1}),
           ("recovery_decision", {"action": "replace", "dead": ["w1"], "active": ["w0", "w2"]})]


def _mutations(kind):
    required, optional = KINDS[kind]
    base = {"t": 1.7e9 + 100, "kind": kind,
            **find(st.fixed_dictionaries({**required, **optional}), lambda _: True,
                   settings=settings(database=None, derandomize=True, max_examples=1, phases=[Phase.generate]))}
    for name in base:
        for value in [*WRONG, _DROP]:
            event = dict(base)
            if value is _DROP:
                del event[name]
            else:
                event[name] = value
            yield name, value, event


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_field_of_every_kind_with_a_wrong_value_gives_a_report_or_an_error_elastic_report_can_name(kind):
    prefix = [{"t": 1.7e9 + i, "kind": k, **fields} for i, (k, fields) in enumerate(_PREFIX)]
    unexpected = []
    for name, value, event in _mutations(kind):
        events = [*prefix, event]
        try:
            report = build_report(events)
            json.dumps(report)
            render_html(report, events)   # (summary_text is slow enough to be left to the random tests)
        except REPORTED:
            pass
        except Exception as e:
            unexpected.append(f"{name}={'<dropped>' if value is _DROP else repr(value)}: {type(e).__name__}: {e}")
    assert not unexpected, f"{kind}: " + "; ".join(unexpected)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One directory for every example of a test (hypothesis runs examples inside one test call)."""
    return tmp_path_factory.mktemp("fuzz-events")


@FUZZ
@given(st.one_of(st.binary(max_size=80),
                 st.lists(st.one_of(JSON.map(json.dumps), st.text(max_size=10),
                                    event_logs().map(lambda es: json.dumps(es[0]) if es else "")), max_size=4)
                 .map(lambda lines: "\n".join(lines).encode())))
def test_read_events_gives_events_or_a_value_error(scratch, data):
    path = scratch / "events.jsonl"
    path.write_bytes(data)
    try:
        events = read_events(path)
    except ValueError:
        return
    assert isinstance(events, list)


# --------------------------------------------------------------------------- found by the fuzzers, exact examples

_VERDICT = {"verdict": "pass", "verdict_reasons": [], "trajectory": None, "first_diverging_step": None,
            "exactly_once": None, "exactly_once_detail": {}}


@pytest.mark.parametrize("events", [
    pytest.param([{}], id="an-empty-event"),
    pytest.param([1], id="an-event-that-is-not-an-object"),
    pytest.param([{"t": 0.0, "kind": "step_committed"}], id="an-event-missing-its-fields"),
    pytest.param([{"t": "noon", "kind": "run_failed", "error": "x"}], id="a-time-that-is-not-a-number"),
    pytest.param([{"t": 0.0, "kind": "job_started", "mode": "distributed", "config": [1], "global_batch_size": 0,
                   "microbatches": 0}], id="a-config-that-is-not-an-object"),
    pytest.param([{"t": 0.0, "kind": "programs_loaded", "compile_seconds": [1], "program_bytes": 0}],
                 id="compile-seconds-that-are-not-an-object"),
    pytest.param([{"t": 0.0, "kind": "security_refused", "count": float("inf")}], id="an-infinite-refusal-count"),
    pytest.param([{"t": 0.0, "kind": "events_dropped", "count": float("inf")}], id="an-infinite-dropped-count"),
])
def test_malformed_events_found_by_the_fuzzers_are_a_value_error_naming_the_event(events):
    """The fold once indexed and converted fields unchecked: KeyError, TypeError, AttributeError,
    OverflowError, or a ValueError naming no event."""
    with pytest.raises(ValueError, match=r"(event|line) 1\b"):
        build_report(events)


@pytest.mark.parametrize("events", [
    pytest.param([{"t": 0.0, "kind": "step_committed", "step": 0, "loss": 0.0},
                  {"t": 1.0, "kind": "step_committed", "step": 1, "loss": 1.6e308}], id="a-loss-near-the-float-max"),
    pytest.param([{"t": 0.0, "kind": "step_committed", "step": 0, "loss": 1e308}], id="one-loss-near-the-float-max"),
    pytest.param([{"t": 1e20, "kind": "run_failed", "error": "x"}], id="a-time-beyond-time-t"),
    pytest.param([{"t": 0.0, "kind": "verdict", **_VERDICT, "reference": [1]}], id="a-reference-that-is-not-an-object"),
])
def test_reports_found_by_the_fuzzers_render(events):
    """Once: the loss range overflowed in charts._ticks (OverflowError) or padded to zero width
    (ZeroDivisionError); time.gmtime of the first event's time raised; a reference that is not an object
    raised AttributeError in html._loss."""
    report = build_report(events)
    assert render_html(report, events).startswith("<!DOCTYPE html>")
    assert summary_text(report)


def test_the_fold_of_an_empty_log_validates_against_the_schema():
    """Once goodput=None, which the schema refuses: a report of nothing is still a report (goodput all zeros)."""
    report = build_report([])
    VALIDATOR.validate(report)
    assert report["goodput"]["wall_seconds"] == 0.0 and report["steps_completed"] == 0


@pytest.mark.parametrize("data", [
    pytest.param(b"\xff\n", id="bytes-that-are-not-utf8"),
    pytest.param(b"1\n", id="a-line-that-is-not-an-object"),
])
def test_lines_found_by_the_fuzzers_are_a_value_error_naming_the_line(tmp_path, data):
    """Once: UnicodeDecodeError naming no line; [1] returned as an event."""
    path = tmp_path / "events.jsonl"
    path.write_bytes(data)
    with pytest.raises(ValueError) as info:
        read_events(path)
    assert "line 1" in str(info.value)


@pytest.mark.parametrize("data", [
    pytest.param(b'{"t": 1, "kind": "a"}\n{"t": 2, "kind": "b", "x": "\xe2\x82', id="cut-inside-a-character"),
    pytest.param(b'{"t": 1, "kind": "a"}\n{"t": 2, "ki', id="cut-inside-the-json"),
])
def test_a_torn_last_line_is_skipped(tmp_path, data):
    """A line without its newline is a write cut short (each event is written with its newline at once)."""
    path = tmp_path / "events.jsonl"
    path.write_bytes(data)
    assert read_events(path) == [{"t": 1, "kind": "a"}]
