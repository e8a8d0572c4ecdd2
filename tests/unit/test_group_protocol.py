"""``WorkerGroup`` and the unit tests' fake group implement one ``runtime.control.group.Group``: every member, with the
same parameters, so a test stepping the controller against the fake steps what production runs."""

import inspect

import pytest

from runtime.control.group import Group
from runtime.control.worker_group import WorkerGroup
from tests.unit.fake_group import FakeGroup

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
