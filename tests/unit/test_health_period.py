"""The health monitor at fleet scale: a Check per worker per ``period`` (a probe in doubt every ``interval``), and a
fenced worker's status from its Watch stream, as it happens (no Check needed). Real gRPC, servers built as the
worker's (``rpc.make_server``)."""

import contextlib
import threading
import time

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from runtime.control.health import Dialer, HealthMonitor
from runtime.control.health_schedule import Schedule
from runtime.wire import rpc

SECRET = "health-period-test-secret"


def test_a_worker_that_answers_is_polled_every_period_and_one_in_doubt_every_interval():
    s = Schedule(interval=0.25, lease=1.5, retries=2, max_in_flight=10_000, period=1.5)
    for i in range(200):
        s.add(f"w{i}", now=0.0)
    first = len(s.due(0.75))
    assert 50 < first < 150 and first + len(s.due(1.5)) == 200          # the fleet's first polls over one period
    s = Schedule(interval=0.25, lease=1.5, retries=2, refusals_seconds=100.0, period=1.5)
    s.add("w", now=0.0)
    [p] = s.due(1.5)
    assert s.answered(p, 1.5, None, 1.51) is None
    assert s.due(2.99) == [] and s.next_due(2.99) == 3.0                # answered: the next one a period later
    s.broke("w", now=2.0)                                               # its Watch stream ended
    [p] = s.due(2.0)
    assert p.kind == "urgent" and s.answered(p, 2.0, "silent", 2.25) is None   # silent 0.5 s < lease / 2: in doubt
    assert s.next_due(2.25) == 2.25                                     # polled again an interval on, not a period
    [p] = s.due(2.25)
    v = s.answered(p, 2.25, "silent", 2.5)                              # silent 0.75 s: suspect, re-probes follow
    assert v.kind == "suspect" and [q.kind for q in s.due(2.5)] == ["reprobe"]


def test_a_worker_answering_steps_is_not_polled_and_its_answers_renew_its_lease():
    s = Schedule(interval=0.25, lease=1.5, retries=2, refusals_seconds=100.0)
    s.add("w", now=0.0)
    s.add("v", now=0.0)
    t = 0.0
    while t < 3.0:                                        # "w" answers a step every 50 ms; "v" answers none
        s.heard("w", t)
        for p in s.due(t):
            assert p.worker_id == "v"                     # only the one not answering steps is checked
            assert s.answered(p, t, None, t + 0.01) is None
        t += 0.05
    s.heard("w", 3.0)                                     # its last step; then it hangs
    assert s.next_due(3.0) <= 3.25
    [p] = [p for p in s.due(3.25) if p.worker_id == "w"]  # a period after its last answer, the polls resume
    assert p.kind == "poll"
    # Sent 0.25 and 0.5 s after its last step, less than half the lease: in doubt, not suspect (the step renewed
    # the lease); polled every interval while in doubt.
    assert s.answered(p, 3.25, "silent", 3.5) is None
    [p] = [p for p in s.due(3.5) if p.worker_id == "w"]
    assert s.answered(p, 3.5, "silent", 3.75) is None
    [p] = [p for p in s.due(3.75) if p.worker_id == "w"]
    v = s.answered(p, 3.75, "silent", 4.0)                # sent 0.75 s after its last answer: suspect
    assert v.kind == "suspect" and v.silent == 0.75
    s.heard("nobody", 4.0)                                # an answer from a worker not watched: ignored
    assert "nobody" not in s


@contextlib.contextmanager
def worker_server(calls: list[str]):
    """A server built as the worker's (the run secret on every call, gRPC's default ping policy); ``calls`` gets
    the method of every call that reaches its handler."""
    server, port = rpc.make_server(secret=SECRET, on_authenticated=calls.append)
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def test_a_worker_that_answers_is_checked_once_a_period_on_one_watch_stream():
    calls: list[str] = []
    monitor = HealthMonitor(Dialer(SECRET), lambda *args: None, interval=0.25, lease=1.0, retries=2, period=1.0)
    assert monitor.period == 1.0
    with worker_server(calls) as (_, address):
        monitor.start()
        try:
            monitor.watch("w", address)
            time.sleep(4.5)
        finally:
            monitor.stop()
    checks = calls.count("/grpc.health.v1.Health/Check")
    assert calls.count("/grpc.health.v1.Health/Watch") == 1
    assert 3 <= checks <= 6, calls                                # every period (1 s), not every interval (0.25 s)


def test_a_worker_that_fences_itself_is_declared_from_its_watch_stream_before_any_poll():
    worker = next(f"w{i}" for i in range(100) if Schedule.spread(f"w{i}") > 0.5)   # polled first 15 s on or later
    declared, found = threading.Event(), []

    def on_dead(worker_id, reason, cause):
        found.append((worker_id, cause))
        declared.set()

    monitor = HealthMonitor(Dialer(SECRET), on_dead, interval=30.0, lease=60.0, retries=0)
    with worker_server([]) as (servicer, address):
        monitor.start()
        try:
            monitor.watch(worker, address)
            assert monitor.is_alive(worker, timeout=5.0)
            time.sleep(0.3)                                        # its Watch stream is open
            servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            assert declared.wait(5.0), "the fenced worker was not declared from its Watch stream"
        finally:
            monitor.stop()
    assert found == [(worker, "fenced")]
