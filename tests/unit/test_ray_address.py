"""An unreachable Ray cluster address fails at once with one line naming the key and the address (Ray itself
retries for about 15 minutes)."""

import socket

import pytest

from runtime.core.errors import ClusterUnreachableError
from runtime.launch.ray_launcher import _host_port, connect
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
