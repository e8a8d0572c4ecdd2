"""The Ray launcher (``elastic_launcher=ray``) on a real Ray cluster: a head and three worker nodes (raylets) on
this machine, started by the test with Ray's own multi-node test cluster.

``elastic chaos`` runs the tiny model on two actors and a spare. The harness SIGKILLs one active actor's
process (a Ray worker process dying); later the test removes a whole node from the cluster, taking every actor
on it at once. Ray reports both (``worker_dead`` with the reason Ray gave) beside the lease; dead workers are
replaced by new actors that join as spares (on their predecessor's node when it still exists). The run ends with
the usual guarantees: no step lost, every step committed, the final state bit-identical to the fault-free
reference.
"""

import json
import os
import subprocess
import sys
import time

from ray.cluster_utils import Cluster

from tests.conftest import ROOT, live_events

STORE = 80 * 1024 * 1024   # the object store of each node: the runtime moves no tensors through Ray
LOOPBACK = "127.0.0.1"


def _cluster() -> tuple[Cluster, list]:
    """A head and three worker nodes, every one on loopback (``node_ip_address``): no test traffic leaves this
    host's loopback interface. One CPU per worker node, one per actor: each worker on a node of its own, so
    removing a node loses one slice.

    Ray waits a fixed 30 s for a raylet to come up (not configurable); on this 2-core host under the whole suite
    that was once not enough. Starting the cluster, which is not what this test is about, is tried twice."""
    for attempt in range(2):
        cluster = Cluster()
        try:
            cluster.add_node(num_cpus=0, include_dashboard=False, object_store_memory=STORE, node_ip_address=LOOPBACK)
            nodes = [cluster.add_node(num_cpus=1, object_store_memory=STORE, node_ip_address=LOOPBACK)
                     for _ in range(3)]
            cluster.wait_for_nodes()
            return cluster, nodes
        except Exception as e:   # noqa: BLE001 - Ray raises a bare Exception for this
            cluster.shutdown()
            if attempt or "timed out during startup" not in str(e):
                raise
    raise AssertionError("unreachable")


def test_workers_as_ray_actors_survive_an_actor_kill_and_a_node_removal(tmp_path, monkeypatch):
    # Ray waits 30 s for its GCS to bind a port; on this 2-core host under the whole suite it took longer once.
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "120")
    cluster, nodes = _cluster()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), RAY_ADDRESS=cluster.address)
    env.pop("XLA_FLAGS", None)
    run_dir = tmp_path / "ray"
    cmd = [sys.executable, "-m", "elastic.cli", "chaos", "tiny", "steps=600", "dcn_data_parallelism=2",
           "ici_fsdp_parallelism=1", "elastic_microbatches=2", "elastic_spares=1", "elastic_launcher=ray",
           "run_name=ray", f"base_output_directory={tmp_path}", "--faults", "kill:slice=1@step=10", "--quiet"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    removed = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            events = live_events(run_dir)
            relaunched = {e["worker"] for e in events if e["kind"] == "worker_relaunched"}
            if any(e["kind"] == "worker_warmed" and e["worker"] in relaunched for e in events):
                break   # the first kill was recovered and its replacement is a spare now
            time.sleep(0.1)
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the run ended before its first recovery ({proc.returncode}):\n{out}\n{err}")
        hosts = {e["worker"]: e["host"] for e in events if e["kind"] == "worker_registered"}
        active = next(e for e in reversed(events) if e["kind"] in ("placement", "recovery_decision"))["active"]
        # Not the node the client's own Ray connection goes through (all nodes share this host's IP, so Ray may
        # attach the client to any of them): losing it would take the client, not one slice.
        client = next(e for e in events if e["kind"] == "run_started")["controller_host"]
        target = next(hosts[w] for w in active if hosts[w] != client)
        (removed,) = [n for n in nodes if n.node_id == target]
        cluster.remove_node(removed)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        cluster.shutdown()
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-4000:]}"
    report = json.loads((run_dir / "report.json").read_text())
    events = live_events(run_dir)
    assert report["verdict"] == "pass" and report["trajectory"] == "identical", report["verdict_reasons"]
    assert report["steps_completed"] == 600 and report["steps_lost"] == 0
    assert report["final_state_sha256"] == report["reference"]["final_state_sha256"]
    on_node = {w for w, h in hosts.items() if h == removed.node_id}
    dead = {e["worker"]: e["reason"] for e in events if e["kind"] == "worker_dead"}
    assert on_node <= set(dead) and len(report["failures"]) >= 2, (on_node, dead)
    assert any(reason.startswith("ray: ") for reason in dead.values()), dead   # Ray's own signal
    assert all(e["host"] in {n.node_id for n in nodes} for e in events if e["kind"] == "worker_registered")
    # The client listened, and every worker served, on loopback only.
    started = next(e for e in events if e["kind"] == "run_started")
    assert started["controller"].startswith(f"{LOOPBACK}:"), started["controller"]
    addresses = [e["address"] for e in events if e["kind"] == "worker_registered"]
    assert addresses and all(a.startswith(f"{LOOPBACK}:") for a in addresses), addresses
