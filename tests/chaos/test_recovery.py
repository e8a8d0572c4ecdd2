"""Membership changes and membership refusal on real worker processes.

Growth after a shrink (a relaunched worker promoted at a step boundary), and
a process without the run secret refused. The per-fault-kind scenarios are in
``test_chaos_faults.py``.
"""

import json
import pathlib
import re
import time

import grpc
import pytest

from runtime.wire import auth
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from tests.conftest import run_cli
from tests.support.events import kinds, run_events


def test_shrink_then_grow_back_when_the_relaunched_worker_joins(tmp_path):
    """No spare: 4 -> 3 slices; the relaunched worker warms up and is promoted: 3 -> 4.

    Every original worker is slowed 10x (about 0.15 s a step here) for the whole run (a straggle fault
    on all of them, so none is slower than its peers), which leaves the
    relaunched worker (a standby process, started beside the run) time to
    take over and load the programs before the last step.
    """
    steps = 40
    proc, _ = run_cli(["chaos", "tiny", f"steps={steps}", "run_name=faulted", "--faults",
                       "straggle(factor=10,for=600s):all@step=0,kill:slice=1@step=2"], tmp_path)
    report = json.loads((tmp_path / "faulted" / "report.json").read_text())
    events = run_events(tmp_path / "faulted")
    assert report["verdict"] == "pass", report["verdict_reasons"]
    assert report["steps_completed"] == steps and report["steps_lost"] == 0 and report["trajectory"] == "identical"
    assert report["failures"][0]["path"] == "shrink"
    [grown] = kinds(events, "grown")
    assert grown["promoted"] == ["w4"] and len(grown["active"]) == 4
    assert report["slices_at_end"] == 4
    assert report["stragglers"] == []
    # The relaunch took over the standby process started beside the run, and a new standby replaced it;
    # the run's end sent the new one home.
    logs = tmp_path / "faulted" / "logs"
    assert "serves as worker w4" in (logs / "worker-w4.log").read_text()
    [standby] = logs.glob("worker-standby-*.log")
    pid = int(re.search(r"standby process (\d+) waiting", standby.read_text()).group(1))
    deadline = time.monotonic() + 10
    while pathlib.Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pathlib.Path(f"/proc/{pid}").exists(), f"standby process {pid} outlived its run"


def test_a_process_without_the_run_secret_is_refused(tmp_path):
    """A fresh worker server (with a secret) refuses callers that lack it."""
    from runtime.wire import rpc
    from runtime.worker.worker import WorkerService

    server, port = rpc.make_server(secret="s3cret")
    pb_grpc.add_WorkerServicer_to_server(WorkerService("run", "w"), server)
    server.start()
    try:
        intruder = pb_grpc.WorkerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        with pytest.raises(grpc.RpcError) as info:
            intruder.StateHash(pb.HashRequest(fence=pb.Fence(run_id="run", epoch=1)), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        member = pb_grpc.WorkerStub(auth.secure_channel(grpc.insecure_channel(f"127.0.0.1:{port}"), "s3cret"))
        with pytest.raises(grpc.RpcError) as info:
            member.StateHash(pb.HashRequest(fence=pb.Fence(run_id="run", epoch=1)), timeout=5)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION   # authenticated; no state yet
    finally:
        server.stop(0)
