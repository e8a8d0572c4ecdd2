"""The event log's one schema (``runtime/core/event_kinds.py``) and the code that writes and reads it agree.

* Every kind emitted anywhere (``<log>.emit("kind", ...)`` in ``runtime``,
  ``elastic``, ``chaos``, ``integrations``) is declared, and every declared kind
  is emitted somewhere (or listed in ``LEGACY_EVENT_KINDS``). An emit whose
  kind is not a literal must take it from a parameter whose callers pass
  literals, or from a module-level dict of literal kinds, so a search for the
  kind finds every place that writes it.
* ``EventLog.emit`` refuses an event its schema does not allow.
* The fields the report's fold reads are declared.
"""

import ast
import pathlib

import pytest

from elastic.report.fold import READS
from runtime import EVENT_KINDS, EventLog, read_events
from runtime.core.event_kinds import LEGACY_KINDS as LEGACY_EVENT_KINDS

ROOT = pathlib.Path(__file__).resolve().parents[2]
WRITERS = ("runtime", "elastic", "chaos", "integrations")


def _literal(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _kinds_of(expr, tree: ast.Module, func: ast.FunctionDef | None, where: str) -> set[str]:
    """The literal kinds a non-literal kind expression can take, or a failure saying why it cannot be read."""
    if isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Name):   # TABLE[key]
        for node in tree.body:
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == expr.value.id
                                                     for t in node.targets) and isinstance(node.value, ast.Dict)):
                kinds = {_literal(v) for v in node.value.values}
                assert None not in kinds, f"{where}: {expr.value.id} must map to literal kinds"
                return kinds
    if isinstance(expr, ast.Name) and func is not None:   # a parameter: the literals its callers pass
        params = [a.arg for a in func.args.args]
        assert expr.id in params, f"{where}: kind {expr.id!r} is neither a literal nor a parameter"
        index = params.index(expr.id) - (1 if params and params[0] == "self" else 0)
        kinds = set()
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and getattr(call.func, "attr", getattr(call.func, "id", None)) == func.name:
                arg = (call.args[index] if index < len(call.args)
                       else next((k.value for k in call.keywords if k.arg == expr.id), None))
                if arg is None and any(k.arg is None for k in call.keywords):   # **event: a decider's events
                    kinds |= _decided_kinds(tree, where)
                    continue
                kind = _literal(arg) if arg is not None else None
                assert kind is not None, f"{where}: a call of {func.name} passes a kind that is not a literal"
                kinds.add(kind)
        assert kinds, f"{where}: {func.name} is never called with a kind"
        return kinds
    raise AssertionError(f"{where}: emit a literal kind (or TABLE[key] of a dict of literal kinds), "
                         f"not {ast.unparse(expr)}")


def _decided_kinds(tree: ast.Module, where: str) -> set[str]:
    """An emit of events a pure decider built (``self._emit(**event)``): the module names the decider in
    ``DECIDED_BY`` (a module path), and every kind is a literal ``dict(kind="...", ...)`` there."""
    decider = next((_literal(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "DECIDED_BY" for t in n.targets)), None)
    assert decider, f"{where}: an emit of **event needs a module-level DECIDED_BY naming the module deciding them"
    source = ast.parse((ROOT / (decider.replace(".", "/") + ".py")).read_text())
    kinds = {_literal(k.value) for c in ast.walk(source) if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "dict"
             for k in c.keywords if k.arg == "kind"}
    assert kinds and None not in kinds, f"{where}: {decider} must build its events as dict(kind=<literal>, ...)"
    return kinds


def emitted_kinds() -> dict[str, list[str]]:
    """kind -> the places (file:line) that emit it."""
    found: dict[str, list[str]] = {}
    for package in WRITERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            for call in ast.walk(tree):
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                        and call.func.attr == "emit" and call.args):
                    continue
                where = f"{path.relative_to(ROOT)}:{call.lineno}"
                kind = _literal(call.args[0])
                if kind is not None:
                    kinds = {kind}
                else:
                    inside = [f for f in funcs if f.lineno <= call.lineno <= f.end_lineno]
                    func = max(inside, key=lambda f: f.lineno, default=None)
                    kinds = _kinds_of(call.args[0], tree, func, where)
                for k in kinds:
                    found.setdefault(k, []).append(where)
    return found


def test_every_kind_emitted_anywhere_is_declared_and_every_declared_kind_is_emitted():
    emitted = emitted_kinds()
    undeclared = {k: v for k, v in emitted.items() if k not in EVENT_KINDS}
    assert not undeclared, f"emitted but not declared in runtime/core/event_kinds.py: {undeclared}"
    # events_dropped is written by EventLog.close itself, not through emit.
    unused = set(EVENT_KINDS) - set(emitted) - set(LEGACY_EVENT_KINDS) - {"events_dropped"}
    assert not unused, f"declared but emitted nowhere (emit them, or list them in LEGACY_KINDS): {sorted(unused)}"
    assert not set(LEGACY_EVENT_KINDS) & set(emitted), "a legacy kind is still emitted"
    assert "checkpoint_restored" in emitted and "snapshot_restored" in emitted   # through RESTORED_EVENT


def test_a_membership_changes_three_events_are_each_emitted_from_one_place():
    """Every start, recovery and restore is carried out by runtime.control.plan_executor.PlanExecutor, which alone
    writes what a recovery records (one method each)."""
    emitted = emitted_kinds()
    for kind in ("failure_detected", "recovery_decision", "recovered"):
        assert len(emitted[kind]) == 1 and emitted[kind][0].startswith("runtime/control/plan_executor.py"), (
            kind, emitted[kind])


def test_every_field_the_report_reads_is_declared():
    for kind, (need, may) in READS.items():
        assert kind in EVENT_KINDS, kind
        assert set(need) | set(may) <= set(EVENT_KINDS[kind].fields()), kind


@pytest.mark.parametrize("kind, fields, message", [
    ("no_such_kind", {}, "unknown event kind 'no_such_kind'"),
    ("step_committed", {"step": 1, "epoch": 1}, "'step_committed' has no 'loss'"),
    ("step_committed", {"step": -1, "epoch": 1, "loss": 0.5}, "'step' must be a whole number >= 0, got -1"),
    ("step_committed", {"step": 1, "epoch": 1, "loss": "low"}, "'loss' must be a number"),
    ("step_committed", {"step": 1, "epoch": 1, "loss": 0.5, "los": 1}, "undeclared fields 'los'"),
    ("worker_dead", {"worker": 3, "reason": "x", "cause": None}, "'worker' must be a string"),
])
def test_emit_refuses_an_event_its_schema_does_not_allow_and_writes_nothing(tmp_path, kind, fields, message):
    path = tmp_path / "events.jsonl"
    log = EventLog(path, checked="strict")
    with pytest.raises(ValueError, match=message):
        log.emit(kind, **fields)
    log.close()
    assert path.read_text() == ""


def test_outside_the_test_suite_a_bad_event_is_written_after_one_warning(tmp_path, caplog):
    """A bookkeeping bug must never end a training run: the event is kept, and said once per kind."""
    path = tmp_path / "events.jsonl"
    log = EventLog(path, checked="warn")
    for step in (1, 2):
        log.emit("step_committed", step=step, epoch=1, loss=0.5, los=1)
    log.close()
    assert len(read_events(path)) == 2
    assert [r.getMessage().count("written anyway") for r in caplog.records] == [1]


def test_emit_judges_an_event_as_written_tuples_and_numpy_scalars_included(tmp_path):
    np = pytest.importorskip("numpy")
    log = EventLog(None)
    event = log.emit("step_dispatched", step=np.int64(3), epoch=1, workers=("w0", "w1"))
    assert event["workers"] == ("w0", "w1")
    log.emit("step_committed", step=3, epoch=1, loss=np.float32(float("nan")))   # a diverging run logs nan


def test_every_kind_has_a_description_and_no_field_is_both_required_and_optional():
    for name, kind in EVENT_KINDS.items():
        assert kind.name == name and kind.doc
        assert not set(kind.required) & set(kind.optional), name
