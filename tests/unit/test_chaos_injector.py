"""The fault injector against a controller that offers only the observer surface.

The controller here (``tests/support/fake_controller.py``) has exactly what ``runtime.ControllerObserver.attach``
promises (``placement``, ``live_spares()``, ``pid()``, ``inject_fault()``,
``events.emit``) and nothing else, so an injector reaching for anything more
fails. Signals go to a real ``sleep`` process.
"""

import signal
import subprocess
import time

import pytest

from chaos import parse_faults
from chaos.injector import FaultInjector
from runtime import WorkerLostError
from tests.support.fake_controller import Controller


def fire(spec, ctl, *, transfer=None):
    injector = FaultInjector(parse_faults(spec), seed=0)
    injector.attach(ctl)
    try:
        if transfer:
            injector.before_transfer(*transfer)
        injector.step_committed(0)
    finally:
        injector.close()
    return [e for e in ctl.events.emitted if e["kind"] in ("fault_injected", "fault_skipped")]


@pytest.mark.parametrize("spec, transfer, armed", [
    ("straggle(factor=4,for=8s):slice=1@step=1", None, ("w1", "straggle", 4.0, 8.0, "")),
    ("partition:slice=2@step=1", None, ("w2", "partition", 0.0, 5.0, "")),
    ("corrupt:worker=w0@step=1", None, ("w0", "corrupt", 0.0, 0.0, "")),
    ("kill(phase=reduce):role=spare@step=1", None, ("w3", "kill_in_phase", 0.0, 0.0, "reduce")),
    ("kill:role=source@transfer", ("w0", "w3"), ("w0", "kill_on_send_state", 0.0, 0.0, "")),
    ("kill:role=dest@transfer", ("w0", "w3"), ("w3", "kill_on_receive_state", 0.0, 0.0, "")),
    ("hang:role=source@transfer", ("w2", "w3"), ("w2", "hang_on_send_state", 0.0, 0.0, "")),
])
def test_worker_side_faults_are_armed_through_the_controller(spec, transfer, armed):
    ctl = Controller()
    [event] = fire(spec, ctl, transfer=transfer)
    assert ctl.armed == [armed]
    assert event["kind"] == "fault_injected" and event["workers"] == [armed[0]] and event["errors"] == {}
    assert event["fault"] == spec and event["fault_kind"] == spec.split("(")[0].split(":")[0]


def state(pid):
    """The process state letter from /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def wait_for(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_kill_and_hang_signal_the_worker_process():
    proc = subprocess.Popen(["sleep", "60"])
    try:
        pids = {"w1": proc.pid}
        ctl = Controller(pids)
        injector = FaultInjector(parse_faults("hang(resume=2s):slice=1@step=1"))
        injector.attach(ctl)
        try:
            injector.step_committed(0)
            [event] = [e for e in ctl.events.emitted if e["kind"] == "fault_injected"]
            assert event["errors"] == {}
            assert wait_for(lambda: state(proc.pid) == "T"), "SIGSTOP never took effect"
            assert wait_for(lambda: state(proc.pid) != "T"), "the injector's timer never resumed the process"
            assert proc.poll() is None
        finally:
            injector.close()
        ctl = Controller(pids)
        [event] = fire("kill:slice=1@step=1", ctl)
        assert event["errors"] == {} and ctl.armed == []
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_failed_injection_is_recorded_not_raised():
    ctl = Controller(fail=WorkerLostError("w1", "UNAVAILABLE: gone"))
    [event] = fire("corrupt:slice=1@step=1", ctl)
    assert event["kind"] == "fault_injected" and list(event["errors"]) == ["w1"]
    assert event["errors"]["w1"].startswith("WorkerLostError")
    [event] = fire("kill:slice=0@step=1", Controller())   # no pid known for w0: KeyError, recorded
    assert event["errors"]["w0"].startswith("KeyError")


def test_a_target_that_names_nobody_is_skipped():
    [event] = fire("kill:slice=7@step=1", Controller())
    assert event["kind"] == "fault_skipped" and "out of range" in event["reason"] and event["fault_kind"] == "kill"
