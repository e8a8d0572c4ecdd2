"""The unit tests' one controller as the fault injector sees it, and nothing more.

``Controller`` has exactly what ``runtime.ControllerObserver.attach`` promises (``placement``, ``live_spares()``,
``live_samplers()``,
``pid()``, ``inject_fault()``, ``events.emit``; the placement grid names the stage targets) and nothing else (``__slots__``), so an injector reaching for anything more fails. It records the worker faults it was
asked to arm in ``armed`` and the events emitted in ``events.emitted``; signals go to the processes of ``pids``.
Used by the injector's tests, the fault grammar's and the client faults' (also in a subprocess of theirs).
"""

import time

from runtime import FAULT_ACTIONS
from runtime.control.placement import Placement


class Events:
    """Keeps what is emitted, in order, in ``emitted``; with ``timed``, each event carries its ``time.time()``
    as ``t``, as the events of a real log do."""

    def __init__(self, timed: bool = False):
        self.emitted = []
        self.timed = timed

    def emit(self, kind, **fields):
        self.emitted.append({"kind": kind, "t": time.time(), **fields} if self.timed else {"kind": kind, **fields})


class Controller:
    """A run of ``active`` slices (stage-major over ``stages`` pipeline stages) and live ``spares``; ``pids``: the
    workers' processes (``pid`` of another raises ``KeyError``); ``fail``: what ``inject_fault`` raises."""

    __slots__ = ("placement", "events", "pids", "armed", "fail", "samplers")

    def __init__(self, pids=None, fail=None, *, active=("w0", "w1", "w2"), spares=("w3",), stages=1, samplers=()):
        self.placement = Placement(1, tuple(active), tuple(spares), stages)
        self.samplers = tuple(samplers)
        self.events = Events()
        self.pids = pids or {}
        self.armed = []
        self.fail = fail

    def live_spares(self):
        return self.placement.spares

    def live_samplers(self):
        return self.samplers

    def pid(self, worker_id, host=0):
        return self.pids[worker_id]

    def hosts_of(self, worker_id):
        return 1

    def inject_fault(self, worker_id, action, *, factor=0.0, seconds=0.0, phase="", after_step=0, host=None):
        assert action in FAULT_ACTIONS
        assert after_step == 0 or (action, phase) == ("kill_in_phase", "save")
        if self.fail:
            raise self.fail
        self.armed.append((worker_id, action, factor, seconds, phase))


def timed_controller() -> Controller:
    """A ``Controller`` whose events carry their time (``Events(timed=True)``), as a client's real log does."""
    ctl = Controller()
    ctl.events = Events(timed=True)
    return ctl
