"""The health monitor on a real process: the Watch stream reports a crash without waiting for a poll."""

import subprocess
import sys
import threading

from runtime import rpc
from runtime.health import HealthMonitor
from tests.conftest import ROOT

SERVER = f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from runtime import rpc
server, port = rpc.make_server()
servicer = health.HealthServicer()
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
servicer.set("", health_pb2.HealthCheckResponse.SERVING)
server.start()
print(port, flush=True)
time.sleep(120)
"""


def test_a_crash_ends_the_watch_stream_and_is_declared_at_once():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        declared = threading.Event()
        found = []

        def on_dead(worker, reason, cause):
            found.append((worker, cause))
            declared.set()

        # Polls every 60 s with a 120 s lease: only the Watch stream can report within the wait below.
        monitor = HealthMonitor(rpc.channel, on_dead, interval=60.0, lease=120.0, retries=2)
        monitor.start()
        monitor.watch("w", f"127.0.0.1:{port}")
        assert monitor.is_alive("w", timeout=5.0)
        proc.kill()
        assert declared.wait(20.0), "the crash was not reported by the Watch stream"
        assert found == [("w", "crash")]
        monitor.stop()
    finally:
        proc.kill()
        proc.wait()
