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

The surface is what a user writes (README.md, docs/chaos-guide.md): ``run_job``
and the ``ChaosResult`` it returns, the fault grammar (``parse_faults``,
``validate``, ``Fault``, ``Target``, ``When``, ``FaultSpecError``), random
schedules (``random_faults``) and scenario files (``load_scenario``,
``Scenario``); the ``elastic_chaos`` fixture comes through the ``pytest11``
entry point (``chaos.pytest_plugin``). The judge's parts (reach, promise,
verdict, target resolution) and the harness's steps stay importable from
their modules (``from chaos.reach import check_reachable``) but are not
exported; tests/unit/test_layout.py keeps the surface from growing back.

The grammar, schedule and scenario modules (pure) load eagerly; the harness
(which pulls in the runtime and the report) loads on first use, so the
``elastic`` command line stays quick to start.
"""

from __future__ import annotations

import importlib

from chaos.scenario import Scenario, load_scenario
from chaos.schedule import random_faults
from chaos.spec import Fault, FaultSpecError, Target, When, parse_faults, validate

__all__ = [
    "ChaosResult",
    "Fault",
    "FaultSpecError",
    "Scenario",
    "Target",
    "When",
    "load_scenario",
    "parse_faults",
    "random_faults",
    "run_job",
    "validate",
]

_LAZY = {"ChaosResult": "chaos.harness", "run_job": "chaos.harness"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'chaos' has no attribute {name!r}")
