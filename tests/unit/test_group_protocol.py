"""``WorkerGroup`` and the unit tests' fake group implement one ``runtime.control.group.Group``: every member, with the
same parameters, so a test stepping the controller against the fake steps what production runs; and that fake
(``tests/support/fake_group.py``) is the tests' only one, as ``tests/support/fake_controller.py`` is their only
controller for the fault injector."""

import ast
import inspect
import pathlib

import pytest

from runtime.control.group import Group
from runtime.control.worker_group import WorkerGroup
from tests.support.fake_group import FakeGroup

METHODS = sorted(name for name, value in vars(Group).items() if callable(value) and not name.startswith("_"))
ATTRIBUTES = sorted(Group.__annotations__)


def _parameters(fn):
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty)
            for p in list(inspect.signature(fn).parameters.values())[1:]]


@pytest.mark.parametrize("implementation", [WorkerGroup, FakeGroup])
@pytest.mark.parametrize("name", METHODS)
def test_each_method_of_the_protocol_has_the_same_parameters(implementation, name):
    assert callable(getattr(implementation, name, None)), f"{implementation.__name__} has no {name}"
    assert _parameters(getattr(implementation, name)) == _parameters(getattr(Group, name))


def test_the_controllers_calls_are_all_in_the_protocol():
    """Every ``group.<member>`` the controller's modules use is declared (a new call must be added there)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "runtime" / "control"
    used = set()
    for module in ("controller", "startup", "attach", "plan_executor", "state_copies", "shadows", "snapshotting", "checkpointing", "watchdog"):
        text = (root / f"{module}.py").read_text()
        used |= set(re.findall(r"\b(?:self\.group|ctl\.group|group)\.([a-z_]+)\b", text))
    assert used <= set(METHODS) | set(ATTRIBUTES), sorted(used - set(METHODS) - set(ATTRIBUTES))


def test_the_fake_has_the_protocols_attributes(tmp_path):
    from runtime.control.controller_options import ControllerOptions
    from runtime.core.events import EventLog

    options = ControllerOptions(slices=2, devices_per_slice=2, run_dir=str(tmp_path))
    fake = FakeGroup(options, EventLog(tmp_path / "events.jsonl"))
    for name in ATTRIBUTES:
        assert hasattr(fake, name), name


def _protocol_members(cls: ast.ClassDef) -> list[str]:
    """The members of the group protocol ``cls`` defines: a method of the protocol's name whose parameters are
    the protocol's (some of them, by name), or a class attribute the protocol declares (but ``address``, which
    many things have)."""
    out = []
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in METHODS:
            mine = [a.arg for a in (*node.args.args, *node.args.kwonlyargs)][1:]
            theirs = list(inspect.signature(getattr(Group, node.name)).parameters)[1:]
            if mine and set(mine) <= set(theirs):
                out.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out += [t.id for t in targets if isinstance(t, ast.Name) and t.id in set(ATTRIBUTES) - {"address"}]
    return out


def test_tests_fake_the_group_and_the_injectors_controller_only_in_tests_support():
    """No test module defines its own group (a class with members of the protocol, say ``declare_dead`` and
    ``drain_deaths``, or ``poll``) or its own controller for the injector (``live_spares`` and ``inject_fault``):
    each uses the one of ``tests/support``, and a test that records more subclasses ``FakeGroup``."""
    tests = pathlib.Path(__file__).resolve().parents[1]
    found = []
    for path in sorted(tests.rglob("*.py")):
        if path.relative_to(tests).parts[0] == "support":
            continue
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            methods = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            if "FakeGroup" in {ast.unparse(b).rpartition(".")[2] for b in cls.bases}:
                continue
            if _protocol_members(cls) or {"declare_dead", "drain_deaths"} <= methods or \
                    {"live_spares", "inject_fault"} <= methods:
                found.append(f"{path.relative_to(tests)}: {cls.name}")
    assert found == [], f"fakes of the group or the controller outside tests/support: {found}"
