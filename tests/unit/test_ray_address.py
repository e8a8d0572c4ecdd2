"""An unreachable Ray cluster address fails at once with one line naming the key and the address (Ray itself
retries for about 15 minutes); the pure rules that pick the node a client's Ray driver joins, count the actors a
cluster holds and explain actors that never registered (their real cluster: tests/chaos/test_ray_launcher.py)."""

import socket

import pytest

from runtime.core.errors import ClusterUnreachableError
from runtime.launch.ray_launcher import (ClusterNode, ClusterRoom, _host_port, connect, driver_node,
                                         room_for_actors, unregistered_reason)
from tests.conftest import run_cli


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]   # closed again when the socket is: nothing listens there


@pytest.mark.timeout(60)   # Ray's own retries would take about 15 minutes
def test_an_address_where_nothing_listens_fails_within_the_timeout_naming_the_key_and_address():
    address = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(ClusterUnreachableError, match=f"ray_address={address}: no Ray cluster answers") as e:
        connect(address, timeout=1.0)
    assert "\n" not in str(e.value)


@pytest.mark.timeout(60)
def test_a_listener_that_is_not_a_ray_cluster_fails_the_same_way_from_the_environment(monkeypatch):
    with socket.socket() as s:   # accepts connections but speaks no gRPC
        s.bind(("127.0.0.1", 0))
        s.listen()
        address = f"127.0.0.1:{s.getsockname()[1]}"
        monkeypatch.setenv("RAY_ADDRESS", address)
        with pytest.raises(ClusterUnreachableError, match=rf"\$RAY_ADDRESS={address}"):
            connect("", timeout=1.0)


@pytest.mark.parametrize("address, expected", [
    ("127.0.0.1:6379", ("127.0.0.1", 6379)), ("ray://10.0.0.2:10001", ("10.0.0.2", 10001)),
    ("[::1]:6379", ("::1", 6379)), ("auto", None), ("", None), ("local", None), ("host:notaport", None)])
def test_host_and_port_of_a_cluster_address(address, expected):
    assert _host_port(address) == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["run", "chaos"])
def test_the_command_line_refuses_an_unreachable_cluster_in_one_line_before_anything_starts(tmp_path, command):
    address = f"127.0.0.1:{_closed_port()}"
    faults = ["--faults", "kill@step=1"] if command == "chaos" else []
    proc, _ = run_cli([command, "tiny", "steps=3", "elastic_launcher=ray", f"ray_address={address}",
                       "elastic_register_timeout_seconds=2", "run_name=r", *faults], tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"elastic: error: ray_address={address}: no Ray cluster answers there within "
                                   "2 s (start one with `ray start --head`, or give the address it prints)")
    assert not (tmp_path / "r").exists(), "nothing is written for a run that cannot start"


def _node(address, cpus=0.0, gpus=0.0, head=False):
    return ClusterNode(address, {"CPU": cpus, **({"GPU": gpus} if gpus else {})}, head)


@pytest.mark.parametrize("host, nodes, mine, expected", [
    # A head kept on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0): joined on loopback.
    ("127.0.0.1", [_node("127.0.0.1", head=True)], {"127.0.0.1", "192.0.2.2"}, "127.0.0.1"),
    # Asked for loopback, but Ray registered the head at the host's interface address: joined there.
    ("127.0.0.1", [_node("192.0.2.2", head=True)], {"127.0.0.1", "192.0.2.2"}, "192.0.2.2"),
    # The client on a worker node of a cluster whose head is elsewhere: its own node, not the head.
    ("10.0.0.1", [_node("10.0.0.1", head=True), _node("10.0.0.2")], {"10.0.0.2"}, "10.0.0.2"),
    # Several nodes of this machine: the head first, as Ray does.
    ("localhost", [_node("127.0.0.1"), _node("127.0.0.1", head=True)], {"127.0.0.1"}, "127.0.0.1"),
    # No node on this machine (a tunnel to a remote head): none to join.
    ("127.0.0.1", [_node("10.0.0.1", head=True)], {"127.0.0.1"}, None),
])
def test_the_driver_joins_the_node_ray_registered_on_this_machine(host, nodes, mine, expected):
    assert driver_node(host, nodes, lambda ip: ip in mine) == expected


def test_room_counts_whole_actors_per_node():
    nodes = [_node("a", 0, head=True), _node("b", 2.5), _node("c", 1)]
    assert room_for_actors(nodes) == ClusterRoom(actors=3, cpus=3.5, gpus=0.0, nodes=3)
    # GPU actors: a node holds as many as its CPUs and its GPUs both allow.
    gpu = [_node("a", 8, 4), _node("b", 1, 8), _node("c", 4)]
    assert room_for_actors(gpu, gpus_per_actor=2) == ClusterRoom(actors=3, cpus=13.0, gpus=12.0, nodes=3)


def test_workers_that_did_not_register_are_explained_by_what_ray_has_free():
    needs = {"CPU": 1.0}
    no_cpu = unregistered_reason(["w2", "w3"], [], needs, {"CPU": 0.0}, {"CPU": 2.0})
    assert no_cpu == ("the actors of w2, w3 did not start: no node has what each one needs free (1 CPU; the "
                      "cluster has 0 of 2 CPUs free): free some or add nodes; `ray status` lists them under its "
                      "pending demands")
    mixed = unregistered_reason(["w2"], ["w1"], needs, {"CPU": 1.0}, {"CPU": 3.0})
    assert mixed.startswith("the actors of w2 did not start: Ray has not placed or started them yet")
    assert "; the actors of w1 run but their workers did not register: see their logs" in mixed
    assert "\n" not in no_cpu + mixed
