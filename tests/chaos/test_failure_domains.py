"""Each process of a local run is its own failure domain: SIGKILL of a helper costs only that helper.

One ``elastic chaos`` run, with its helpers killed from outside as an
operator (or the OOM killer) would: during the faulted run, the zygote every
local worker was forked from and the standby process waiting to serve as a
relaunched worker. A worker is killed after both (the chaos fault), so its
replacement has to start without the zygote. The run must finish with the
usual verdict (every step, none lost, bit-identical to the reference), and
when the client exits no process of the run is left. (The reference child
process, which the command line does not use, is killed in
``tests/integration/test_reference_child.py``.)
"""

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT, processes
from tests.support.events import live_events


def _descendants(root: int) -> dict[int, str]:
    procs = processes()
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, cmdline) in procs.items():
            if ppid == parent and pid not in found:
                found[pid] = cmdline
                frontier.append(pid)
    return found


def _find(root: int, title: str, deadline: float) -> int:
    """The pid of the first descendant of ``root`` whose command line starts with ``title``."""
    while time.monotonic() < deadline:
        for pid, cmdline in _descendants(root).items():
            if cmdline.startswith(title):
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no process titled {title!r} under {root}: {_descendants(root)}")


def test_killing_the_zygote_and_a_standby_costs_the_run_nothing(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "elastic.cli", "chaos", "tiny", "steps=40", "dcn_data_parallelism=2",
           "elastic_spares=1", "elastic_standby_workers=1", "run_name=domains", f"base_output_directory={tmp_path}",
           "--faults", "straggle(factor=10,for=600s):all@step=0,kill:slice=1@step=24", "--quiet"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = {}
    try:
        deadline = time.monotonic() + 180
        run_dir = tmp_path / "domains"
        while time.monotonic() < deadline and not any(e["kind"] == "step_committed" for e in live_events(run_dir)):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        # Both helpers of the faulted run, well before the worker kill at step 24.
        killed["zygote"] = _find(proc.pid, "elastic-zygote", deadline)
        killed["standby"] = _find(proc.pid, "elastic-worker standby", deadline)
        workers = {pid for pid, cmdline in _descendants(proc.pid).items()
                   if cmdline.startswith("elastic-worker run=")}
        assert len(workers) == 3, _descendants(proc.pid)   # two active slices and the spare, titled for ps
        os.kill(killed["zygote"], signal.SIGKILL)
        os.kill(killed["standby"], signal.SIGKILL)
        time.sleep(1.0)   # a worker watching its parent would have noticed within 0.2 s
        assert workers <= set(processes()), "a worker died with the zygote it was forked from"
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-4000:]}"
    report = json.loads((tmp_path / "domains" / "report.json").read_text())
    assert report["verdict"] == "pass" and report["trajectory"] == "identical", report["verdict_reasons"]
    assert report["steps_completed"] == 40 and report["steps_lost"] == 0
    events = live_events(tmp_path / "domains")
    relaunched = [e["worker"] for e in events if e["kind"] == "worker_relaunched"]
    assert relaunched, "the killed worker was relaunched"
    assert any(e["kind"] == "worker_registered" and e["worker"] in relaunched for e in events), \
        "the relaunched worker started and joined without the zygote"
    run_id = next(e for e in events if e["kind"] == "run_started")["run_id"]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(f"run={run_id}" in c for _, c in processes().values()):
        time.sleep(0.1)
    left = [c for _, c in processes().values() if f"run={run_id}" in c]
    assert not left, f"processes of the run outlived its client: {left}"
