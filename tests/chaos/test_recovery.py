"""Real faults on real worker processes: training continues from live state.

Every faulted run must end at the final step with no checkpoint restore, no
lost step and the same final state hash as the fault-free reference.
"""

import json
import signal

import grpc
import pytest

from runtime import auth
from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from tests.chaos.faults import run_with_faults
from tests.conftest import run_cli

STEPS = 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    _, report = run_cli(["run", "tiny", f"steps={STEPS}", "--reference"], tmp_path_factory.mktemp("ref"))
    return report


def check_survived(report, reference):
    assert report["steps_completed"] == STEPS
    assert report["steps_lost"] == 0 and report["checkpoint_restores"] == 0
    assert report["losses"] == reference["losses"]
    assert report["final_state_sha256"] == reference["final_state_sha256"]


def kinds(events, kind):
    return [e for e in events if e["kind"] == kind]


def test_sigkill_with_a_spare_replaces_the_slice_from_a_live_replica(tmp_path, reference):
    report, events, _ = run_with_faults(tmp_path, [f"steps={STEPS}", "elastic_spares=1"], [(3, "w1", signal.SIGKILL)])
    check_survived(report, reference)
    [failure] = report["failures"]
    assert failure["path"] == "replace" and failure["workers"] == ["w1"]
    assert failure["bytes_moved"] == report["state_bytes"]
    assert report["slices_at_end"] == 4


def test_sigkill_without_a_spare_shrinks_onto_the_survivors(tmp_path, reference):
    report, events, _ = run_with_faults(tmp_path, [f"steps={STEPS}", "elastic_relaunch=false"],
                                        [(2, "w2", signal.SIGKILL)])
    check_survived(report, reference)
    assert [f["path"] for f in report["failures"]] == ["shrink"]
    assert report["slices_at_end"] == 3


def test_two_workers_killed_at_once(tmp_path, reference):
    report, events, _ = run_with_faults(tmp_path, [f"steps={STEPS}", "elastic_spares=1", "elastic_relaunch=false"],
                                        [(4, "w0", signal.SIGKILL), (4, "w3", signal.SIGKILL)])
    check_survived(report, reference)
    dead = sorted(w for f in report["failures"] for w in f["workers"])
    assert dead == ["w0", "w3"]
    assert report["slices_at_end"] == 3   # one spare replaced one slice, the other shrank


def test_a_hung_worker_is_found_by_the_lease_and_replaced(tmp_path, reference):
    report, events, injected = run_with_faults(tmp_path, [f"steps={STEPS}", "elastic_spares=1"],
                                               [(3, "w2", signal.SIGSTOP)])
    check_survived(report, reference)
    dead = kinds(events, "worker_dead")
    assert [e["worker"] for e in dead] == ["w2"]
    assert report["failures"][0]["path"] == "replace"


def test_shrink_then_grow_back_when_the_relaunched_worker_joins(tmp_path):
    """No spare: 4 -> 3 slices; the relaunched worker warms up and is promoted: 3 -> 4.

    Every original worker is slowed 20x (about 0.25 s a step here) for the whole run (a straggle fault
    on all of them, so none is slower than its peers), which leaves the
    relaunched worker ample time to start and compile before the last step.
    """
    steps = 80
    proc, _ = run_cli(["chaos", "tiny", f"steps={steps}", "run_name=faulted", "--faults",
                       "straggle(factor=20,for=600s):all@step=0,kill:slice=1@step=2"], tmp_path)
    report = json.loads((tmp_path / "faulted" / "report.json").read_text())
    events = [json.loads(line) for line in (tmp_path / "faulted" / "events.jsonl").read_text().splitlines()]
    assert report["verdict"] == "pass", report["verdict_reasons"]
    assert report["steps_completed"] == steps and report["steps_lost"] == 0 and report["trajectory"] == "identical"
    assert report["failures"][0]["path"] == "shrink"
    [grown] = kinds(events, "grown")
    assert grown["promoted"] == ["w4"] and len(grown["active"]) == 4
    assert report["slices_at_end"] == 4
    assert report["stragglers"] == []


def test_a_process_without_the_run_secret_is_refused(tmp_path):
    """A fresh worker server (with a secret) refuses callers that lack it."""
    from runtime import rpc
    from runtime.worker import WorkerService

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
