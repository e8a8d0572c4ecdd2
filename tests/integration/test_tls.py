"""Mutual TLS from config keys: a run over TLS, a plaintext caller refused, half a TLS config refused."""

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from runtime.wire import auth, rpc
from tests.conftest import run_cli


def test_a_run_over_mutual_tls_matches_the_plaintext_run(tmp_path, pem):
    keys = [f"elastic_tls_cert_file={pem.cert_file}", f"elastic_tls_key_file={pem.key_file}",
            f"elastic_tls_ca_file={pem.ca_file}"]
    _, tls = run_cli(["run", "tiny", "steps=3", "dcn_data_parallelism=2", "run_name=tls", *keys], tmp_path)
    _, ref = run_cli(["run", "tiny", "steps=3", "--reference", "run_name=ref"], tmp_path)
    assert tls["steps_completed"] == 3 and tls["final_state_digest"] == ref["final_state_digest"]


def test_a_tls_server_refuses_a_plaintext_caller(pem):
    server, port = rpc.make_server(secret="s", tls=pem)
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.start()
    try:
        request = health_pb2.HealthCheckRequest(service="")
        plain = health_pb2_grpc.HealthStub(rpc.channel(f"127.0.0.1:{port}", "s"))
        with pytest.raises(grpc.RpcError) as info:
            plain.Check(request, timeout=3)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        member = health_pb2_grpc.HealthStub(rpc.channel(f"127.0.0.1:{port}", "s", pem))
        assert member.Check(request, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)


def test_half_a_tls_config_is_refused_naming_the_missing_keys(tmp_path, pem):
    proc, _ = run_cli(["run", "tiny", f"elastic_tls_cert_file={pem.cert_file}"], tmp_path, check=False)
    assert proc.returncode == 2
    assert "elastic_tls_key_file" in proc.stderr and "elastic_tls_ca_file" in proc.stderr
    proc, _ = run_cli(["run", "tiny", "elastic_tls_cert_file=nope.pem", "elastic_tls_key_file=nope.pem",
                       "elastic_tls_ca_file=nope.pem"], tmp_path, check=False)
    assert proc.returncode == 2 and "no such file" in proc.stderr
