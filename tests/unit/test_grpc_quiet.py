"""gRPC's C core logs at INFO to stderr unless told otherwise (``Got goaway`` reached a run's terminal when its pool
stopped): every process that imports ``runtime`` before gRPC, as each process of a run does, keeps only gRPC's
errors, and passes that on to the processes it starts; a ``GRPC_VERBOSITY`` the user set wins."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
_ABSL_INFO = re.compile(r"^I\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ", re.M)

# a server and a client in one process, the server stopped under the client: gRPC's tracer (GRPC_TRACE=http) has
# an INFO line for everything on the wire, the GOAWAY included; then a child started as a run starts its workers
_CHILD = """
import os, subprocess, sys
import runtime
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
server = grpc.server(futures.ThreadPoolExecutor(2))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}")).Check(health_pb2.HealthCheckRequest(),
                                                                           timeout=10)
server.stop(0)
print(os.environ.get("GRPC_VERBOSITY"))
subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('GRPC_VERBOSITY'))"], check=True)
"""


def _run(**env) -> tuple[list[str], str]:
    base = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**base, "PYTHONPATH": str(ROOT), "GRPC_TRACE": "http", **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split(), proc.stderr


def test_grpc_s_info_lines_stay_off_the_terminal_of_every_process_that_imports_runtime():
    said, err = _run()
    assert said == ["ERROR", "ERROR"]   # this process, and the one it started
    assert not _ABSL_INFO.search(err), err[:2000]


def test_a_grpc_verbosity_the_user_set_wins():
    said, err = _run(GRPC_VERBOSITY="INFO")
    assert said == ["INFO", "INFO"] and _ABSL_INFO.search(err)
