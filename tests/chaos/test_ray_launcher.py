"""The Ray launcher (``elastic_launcher=ray``) on a real Ray cluster: a head and three worker nodes (raylets) on
this machine, started by the test with Ray's own multi-node test cluster.

``elastic chaos`` runs the tiny model on two actors and a spare. The harness SIGKILLs one active actor's
process (a Ray worker process dying); later the test removes a whole node from the cluster, taking every actor
on it at once. Ray reports both (``worker_dead`` with the reason Ray gave) beside the lease; dead workers are
replaced by new actors that join as spares (on their predecessor's node when it still exists). The run ends with
the usual guarantees: no step lost, every step committed, the final state bit-identical to the fault-free
reference.

The actors are detached: when the client (the Ray driver) is SIGKILLed mid-run, they live on for the client
grace, and the same command run again finds them and re-attaches them, finishing bit-identical to the reference
with no step lost and nothing restored; a driver killed for good leaves them to exit once their grace ran out.
Either way no actor of the run is left in the cluster.

Both tests share one cluster (its start is slow on this host).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from ray.cluster_utils import Cluster

from tests.conftest import ROOT, live_events, run_cli

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


@pytest.fixture(scope="module")
def ray_cluster():
    """One cluster for the module's tests: ``(cluster, worker nodes)``."""
    with pytest.MonkeyPatch.context() as mp:
        # Ray waits 30 s for its GCS to bind a port; on this 2-core host under the whole suite it took longer once.
        mp.setenv("RAY_gcs_server_port_wait_time_s", "120")
        cluster, nodes = _cluster()
    yield cluster, nodes
    cluster.shutdown()


RUN = ["run", "tiny", "dcn_data_parallelism=2", "ici_fsdp_parallelism=1", "elastic_microbatches=2"]

#: Prints the names of the live worker actors of run ``argv[2]`` in the cluster at ``argv[1]``, as JSON.
_LIST_ACTORS = """
import json, sys
import ray
from runtime.launch.ray_launcher import NAMESPACE, actor_name, connect
connect(sys.argv[1])
prefix = actor_name(sys.argv[2], "")
print(json.dumps(sorted(a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                        if a["namespace"] == NAMESPACE and a["name"].startswith(prefix))))
"""


def _env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    env.pop("RAY_ADDRESS", None)   # the commands name their cluster (ray_address)
    return env


def _actors(address: str, run_id: str) -> list[str]:
    """The worker ids of run ``run_id`` whose actors are alive in the cluster (asked by a Ray driver of its own)."""
    out = subprocess.run([sys.executable, "-c", _LIST_ACTORS, address, run_id], env=_env(), capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return json.loads(out.splitlines()[-1])


def _actors_gone(address: str, run_id: str, within: float) -> list[str]:
    """Waits up to ``within`` seconds for the run's actors to be gone; the worker ids of those still alive."""
    deadline = time.monotonic() + within
    while (left := _actors(address, run_id)) and time.monotonic() < deadline:
        time.sleep(1.0)
    return left


def _start_and_kill(args, tmp_path, run_dir, committed: int) -> str:
    """Starts ``elastic ARGS`` and SIGKILLs it (the Ray driver) once ``committed`` steps are in its log; its run
    id."""
    with open(tmp_path / f"{run_dir.name}-client.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "elastic.cli", *args, f"base_output_directory={tmp_path}",
                                 "--quiet"], env=_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if sum(e["kind"] == "step_committed" for e in live_events(run_dir)) >= committed:
            break
        time.sleep(0.05)
    if proc.poll() is not None or time.monotonic() >= deadline:
        proc.kill()
        said = (tmp_path / f"{run_dir.name}-client.err").read_text()
        raise AssertionError(f"the run did not reach {committed} steps ({proc.returncode}): {said[-3000:]}")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return next(e for e in live_events(run_dir) if e["kind"] == "run_started")["run_id"]


def test_a_killed_driver_leaves_its_actors_to_the_same_command_which_re_attaches_them(ray_cluster, tmp_path):
    cluster, _ = ray_cluster
    on_ray = ["elastic_launcher=ray", f"ray_address={cluster.address}"]
    # A grace long enough for the next client to start on this host: it costs nothing once that one attached.
    args = [*RUN, "steps=60", "run_name=rd", *on_ray, "elastic_client_grace_seconds=60"]
    run_dir = tmp_path / "rd"
    run_id = _start_and_kill(args, tmp_path, run_dir, 10)
    before = len(live_events(run_dir))

    proc, report = run_cli(args, tmp_path)   # the same command again: it finds the live actors
    assert "re-attached 2 live workers" in proc.stderr, proc.stderr[-3000:]
    assert report["finished"] and report["steps_completed"] == 60 and report["steps_lost"] == 0
    assert report["checkpoint_restores"] == report["snapshot_restores"] == 0 and report["client_restarts"] == 1
    after = live_events(run_dir)[before:]
    assert not any(e["kind"] in ("state_transferred", "checkpoint_restored", "snapshot_restored", "worker_dead")
                   for e in after), [e["kind"] for e in after]
    assert not _actors_gone(cluster.address, run_id, 30), "an actor outlived its run"
    _, ref = run_cli([*RUN, "steps=60", "run_name=ref", "--reference"], tmp_path)
    assert report["final_state_digest"] == ref["final_state_digest"] and report["losses"] == ref["losses"]

    # A driver killed for good: its actors live on for their grace (10 s after their 5 s lease), then exit.
    gone = tmp_path / "gone"
    run_id = _start_and_kill([*RUN, "steps=400", "run_name=gone", *on_ray, "elastic_client_grace_seconds=10"],
                             tmp_path, gone, 1)
    assert _actors(cluster.address, run_id) == ["w0", "w1"], "the actors died with their driver"
    assert not _actors_gone(cluster.address, run_id, 60), "an actor outlived its client grace"


def test_workers_as_ray_actors_survive_an_actor_kill_and_a_node_removal(ray_cluster, tmp_path):
    cluster, nodes = ray_cluster
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
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-4000:]}"
    report = json.loads((run_dir / "report.json").read_text())
    events = live_events(run_dir)
    assert report["verdict"] == "pass" and report["trajectory"] == "identical", report["verdict_reasons"]
    assert report["steps_completed"] == 600 and report["steps_lost"] == 0
    assert report["final_state_digest"] == report["reference"]["final_state_digest"]
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
