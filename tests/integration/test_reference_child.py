"""The reference run's child process is a helper: killed by a signal, it is run again and costs only a retry."""

import os
import signal
import threading
import time

import cloudpickle
import numpy as np

from runtime.worker.reference import run_reference, run_reference_process
from tests.conftest import processes
from tests.support.worker_harness import tiny_programs


class SlowData:
    """A data source that takes 0.1 s a batch: the child is still at work when it is killed."""

    def batch(self, step, microbatch):
        time.sleep(0.1)
        rng = np.random.default_rng(step * 1000 + microbatch)
        return {"x": rng.standard_normal((4, 8)).astype(np.float32), "y": rng.standard_normal(4).astype(np.float32)}


def _children_titled(title: str) -> list[int]:
    return [pid for pid, (ppid, cmdline) in processes().items() if ppid == os.getpid() and cmdline.startswith(title)]


def test_a_killed_reference_child_is_run_again_and_each_step_is_heard_once():
    programs, steps = tiny_programs(), 6
    expected = run_reference(programs, SlowData(), steps=steps, seed=0)
    heard, killed = [], []

    def kill_first_child():   # the child, once it has told its first step (it titles itself for ps)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not heard:
            time.sleep(0.01)
        for pid in _children_titled("elastic-reference"):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    def on_step(step, loss):
        heard.append((step, loss))

    killer = threading.Thread(target=kill_first_child, daemon=True)
    killer.start()
    losses, digest = run_reference_process(programs, cloudpickle.dumps(SlowData()), steps=steps, seed=0,
                                           on_step=on_step)
    killer.join(10)
    assert killed, "the reference child was never seen"
    assert (losses, digest) == expected
    assert [s for s, _ in heard] == list(range(steps)), heard   # each step once, though the child ran twice
    assert [loss for _, loss in heard] == expected[0]
