"""Fault injection and the chaos verdict. Imports ``elastic`` (to run jobs) and ``runtime``'s public surface.

- :mod:`chaos.spec`: the fault grammar (``kill:slice=1@step=3``) and the fault kinds.
- :mod:`chaos.scenario`: scenario YAML files.
- :mod:`chaos.schedule`: random schedules and target resolution.
- :mod:`chaos.reach`: can each fault ever fire in this run? (checked before a run starts)
- :mod:`chaos.promise`: what each recovery's faults left, and what that promised (for the verdict).
- :mod:`chaos.verdict`: did a faulted run train exactly like a fault-free one?
- :mod:`chaos.injector`: fires faults at a live run (a ``runtime.ControllerObserver``).
- :mod:`chaos.harness`: reference run, faulted run and verdict (``elastic chaos``, :func:`run_job` for any job).
- :mod:`chaos.supervisor`: a faulted run with client faults: its clients as child processes, restarted.
- :mod:`chaos.pytest_plugin`: the ``elastic_chaos`` fixture (a ``pytest11`` entry point).
- :mod:`chaos.cli`: the ``elastic chaos`` subcommand, found through the ``elastic.commands`` entry point.

The pure modules load eagerly; the harness and the injector (which pull in the
runtime and the report) load on first use, so the ``elastic`` command line
stays quick to start.
"""

from __future__ import annotations

import importlib

from chaos.promise import Promise, promises
from chaos.reach import RunShape, check_reachable
from chaos.scenario import Scenario, load_scenario
from chaos.schedule import TargetError, random_faults, resolve_target
from chaos.spec import (INJECTABLE_KINDS, KINDS, Fault, FaultSpecError, Target, When, format_duration,
                        parse_duration, parse_faults, validate)
from chaos.verdict import compare_trajectory, exactly_once, judge

__all__ = [
    "INJECTABLE_KINDS",
    "KINDS",
    "ChaosOptions",
    "ChaosResult",
    "Fault",
    "FaultInjector",
    "FaultSpecError",
    "Promise",
    "RunShape",
    "Scenario",
    "Target",
    "TargetError",
    "When",
    "check_reachable",
    "compare_trajectory",
    "exactly_once",
    "fault_plan",
    "format_duration",
    "judge",
    "load_scenario",
    "parse_duration",
    "parse_faults",
    "plan",
    "promises",
    "random_faults",
    "reference_report",
    "resolve_target",
    "run_chaos",
    "run_job",
    "validate",
]

_LAZY = {"ChaosOptions": "chaos.harness", "ChaosResult": "chaos.harness", "fault_plan": "chaos.harness",
         "plan": "chaos.harness", "run_chaos": "chaos.harness", "run_job": "chaos.harness",
         "reference_report": "chaos.harness", "FaultInjector": "chaos.injector"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'chaos' has no attribute {name!r}")
