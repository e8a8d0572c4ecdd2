"""The health monitor: on a real process, the Watch stream reports a crash without waiting for a poll;
its schedule (who is probed when, what an answer means) as pure bookkeeping."""

import contextlib
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.control.health import Dialer, HealthMonitor, failure_of
from runtime.control.health_schedule import Schedule, wait_seconds
from runtime.control.health_schedule import reprobe_wait
from runtime.wire import auth, rpc
from tests.conftest import ROOT

SERVER = f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from runtime.wire import rpc
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
        monitor = HealthMonitor(Dialer(), on_dead, interval=60.0, lease=120.0, retries=2)
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


# -- the monitor's I/O on its event loop: in-process servers on port 0 ---------------------------------

SECRET = "health-test-secret"


class RefusalsOnly(pb_grpc.WorkerServicer):
    """The worker's ``Refusals`` RPC, as the worker answers it: the calls refused since the last ask."""

    def __init__(self, refusals: auth.Refusals):
        self.refusals = refusals

    def Refusals(self, request, context):
        return pb.RefusalsReply(refusals=[pb.Refusal(method=m, peer=p, reason=r, count=n)
                                          for m, p, r, n in self.refusals.drain()])


@contextlib.contextmanager
def worker_server():
    """A server built as the worker's (the run secret checked on every call) serving health and Refusals."""
    refusals = auth.Refusals()
    server, port = rpc.make_server(secret=SECRET, refusals=refusals)
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    pb_grpc.add_WorkerServicer_to_server(RefusalsOnly(refusals), server)
    server.start()
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def monitor_of(dialer, on_dead=lambda *args: None, retries=0):
    """A monitor whose polls (every 60 s, spread over the interval) stay out of the way."""
    return HealthMonitor(dialer, on_dead, interval=60.0, lease=120.0, retries=retries)


HEALTH_CALLS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")


def test_calls_carry_the_run_secret_and_the_calls_refused_without_it_are_reported():
    ours, stranger = monitor_of(Dialer(SECRET)), monitor_of(Dialer("not-the-secret"))
    with worker_server() as (_, address):
        ours.start()
        stranger.start()   # two monitors, two event loops, one process
        try:
            ours.watch("w", address)
            stranger.watch("w", address)
            assert ours.is_alive("w", timeout=5.0)
            assert not stranger.is_alive("w", timeout=5.0)   # UNAUTHENTICATED: no answer from that worker
            # The stranger's refused calls reach the worker in their own time (on a loaded host, after the 5 s
            # above): ask for the refusals until one is there. Which call it is depends on timing: its Watch
            # stream, refused, may declare the worker dead before any Check is sent.
            events, deadline = [], time.monotonic() + 30.0
            while not any(e["method"] in HEALTH_CALLS for e in events) and time.monotonic() < deadline:
                events += ours.collect_refusals(timeout=5.0)
        finally:
            ours.stop()
            stranger.stop()
    assert {(e["worker"], e["reason"]) for e in events} == {("w", "wrong run secret")}   # every call it made
    assert any(e["method"] in HEALTH_CALLS for e in events)
    assert all(e["kind"] == "security_refused" and e["count"] >= 1 for e in events)


def test_on_dead_comes_once_on_the_monitors_thread_which_may_unwatch_but_not_wait_for_the_monitor():
    calls, declared = [], threading.Event()

    def on_dead(worker, reason, cause):
        calls.append((worker, cause, threading.current_thread().name))
        monitor.unwatch(worker)   # hands the change to the loop: fine from here
        try:
            monitor.is_alive(worker)
        except RuntimeError as e:
            calls.append(str(e))
        declared.set()

    monitor = monitor_of(Dialer(SECRET), on_dead)
    with worker_server() as (server, address):
        monitor.start()
        try:
            monitor.watch("w", address)
            assert monitor.is_alive("w", timeout=5.0)
            server.stop(0)   # the stream ends, the probe that follows is refused, and the re-probe too
            assert declared.wait(20.0), "the stopped server was not declared dead"
        finally:
            monitor.stop()
    assert calls[0] == ("w", "crash", "health-monitor")
    assert "not from its own thread" in calls[1] and len(calls) == 2


def test_unwatch_stop_and_start_say_what_they_leave():
    dead = []
    monitor = monitor_of(Dialer(SECRET), lambda *args: dead.append(args))
    with worker_server() as (_, address):
        with pytest.raises(RuntimeError, match="start"):
            monitor.is_alive("w")
        monitor.start()
        monitor.watch("w", address)
        assert monitor.is_alive("w", timeout=5.0)
        monitor.unwatch("w")
        assert not monitor.is_alive("w", timeout=5.0)   # not watched
        monitor.watch("w", address)
        assert monitor.is_alive("w", timeout=5.0)       # watched afresh
        monitor.stop()
        monitor.stop()                                   # idempotent
        assert not monitor.is_alive("w")                 # stopped: nothing is watched
        assert monitor.collect_refusals(timeout=1.0) == []
        monitor.watch("w", address)                      # ignored once stopped
    assert dead == []


def test_the_monitor_takes_a_dialer_and_a_bad_tls_file_is_refused_at_watch(tmp_path):
    with pytest.raises(TypeError, match="Dialer"):
        monitor_of(rpc.channel)
    missing = str(tmp_path / "missing.pem")
    monitor = monitor_of(Dialer(SECRET, auth.TlsFiles(missing, missing, missing)))
    monitor.start()
    try:
        with pytest.raises(FileNotFoundError, match="missing.pem"):
            monitor.watch("w", "127.0.0.1:1")
    finally:
        monitor.stop()


# -- the monitor's schedule: pure bookkeeping, time passed in (nothing here waits) ------------------

@pytest.mark.parametrize("code, status, failure", [
    (None, health_pb2.HealthCheckResponse.SERVING, None),
    (None, health_pb2.HealthCheckResponse.NOT_SERVING, "not_serving"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, None, "silent"),
    (grpc.StatusCode.UNAVAILABLE, None, "refused"),
    (grpc.StatusCode.CANCELLED, None, "refused"),
])
def test_failure_of_a_check(code, status, failure):
    assert failure_of(code, status) == failure


def answer(schedule, probe, sent_at, failure, now=None):
    return schedule.answered(probe, sent_at, failure, sent_at if now is None else now)


def test_a_fleet_added_at_once_is_polled_spread_over_one_interval():
    s = Schedule(interval=1.0, lease=1.5, retries=2, max_in_flight=10_000)
    for i in range(200):
        s.add(f"w{i}", now=0.0)
    first = s.due(0.5)
    assert 50 < len(first) < 150                      # about half the fleet in the first half of the interval
    assert all(p.kind == "poll" for p in first)
    assert len(first) + len(s.due(1.0)) == 200          # and everyone within the interval
    assert s.due(1.0) == []                             # one probe out per worker


def test_a_worker_that_answers_is_polled_every_interval_from_when_the_poll_was_sent():
    s = Schedule(interval=1.0, lease=1.5, retries=2)
    s.add("w", now=0.0)
    [p] = s.due(1.0)
    assert answer(s, p, sent_at=1.0, failure=None, now=1.2) is None
    assert s.due(1.9) == [] and s.next_due(1.9) == 2.0
    assert [q.kind for q in s.due(2.0)] == ["poll"]


def test_at_most_max_in_flight_calls_are_out_and_a_broken_stream_goes_first():
    s = Schedule(interval=1.0, lease=1.5, retries=2, max_in_flight=2)
    for w in "abcd":
        s.add(w, now=0.0)
    out = s.due(1.0)
    assert len(out) == 2 and s.starved(1.0) and s.due(1.0) == []   # every slot taken: wait for an answer
    waiting = sorted(set("abcd") - {p.worker_id for p in out})
    s.broke(waiting[1], now=1.0)
    assert s.due(1.0) == []
    answer(s, out[0], sent_at=1.0, failure=None, now=1.01)
    [nxt] = s.due(1.01)
    assert (nxt.worker_id, nxt.kind) == (waiting[1], "urgent")


def test_a_poll_that_stays_out_gives_its_slot_back_after_slot_seconds():
    s = Schedule(interval=1.0, lease=1.5, retries=2, max_in_flight=1, slot_seconds=0.25)
    s.add("a", now=0.0)
    s.add("b", now=0.0)
    [p] = s.due(1.0)                                     # no answer comes (a hung worker)
    assert s.due(1.2) == [] and s.next_due(1.2) == 1.25  # its slot comes back a quarter second after it was sent
    [q] = s.due(1.25)
    assert q.worker_id != p.worker_id and s.in_flight == 2
    assert answer(s, p, sent_at=1.0, failure="silent", now=2.0).kind == "suspect"   # its answer counts all the same


def test_a_hung_worker_is_suspect_after_half_its_lease_and_dead_after_its_re_probes():
    lease, retries = 1.5, 2
    s = Schedule(interval=0.25, lease=lease, retries=retries)
    s.add("w", now=0.0)
    [p] = s.due(1.0)
    answer(s, p, sent_at=1.0, failure=None)                      # last answer at 1.0
    [p] = s.due(1.25)
    assert answer(s, p, sent_at=1.25, failure="silent", now=1.5) is None   # silent 0.25 s < lease / 2
    [p] = s.due(1.8)
    assert p.kind == "poll"
    v = answer(s, p, sent_at=1.8, failure="silent", now=2.05)  # silent 0.8 s >= lease / 2
    assert (v.kind, v.worker_id, v.failure) == ("suspect", "w", "silent") and v.silent == pytest.approx(0.8)
    verdicts, now = [], 2.05
    for _ in range(retries + 1):
        [p] = s.due(now + reprobe_wait(lease, retries, 0.25))
        assert p.kind == "reprobe"
        now += 0.25
        verdicts.append(answer(s, p, sent_at=now - 0.25, failure="silent", now=now))
    assert verdicts[:-1] == [None] * retries
    assert (verdicts[-1].kind, verdicts[-1].cause) == ("dead", "hang")
    assert "w" not in s and s.in_flight == 0 and s.due(100.0) == []


def test_a_suspect_that_answers_a_re_probe_is_polled_again():
    s = Schedule(interval=0.25, lease=1.5, retries=2)
    s.add("w", now=0.0)
    [p] = s.due(1.0)
    assert answer(s, p, sent_at=1.0, failure="refused").kind == "suspect"   # refused: suspect at once
    [p] = s.due(1.0)
    assert p.kind == "reprobe"
    assert answer(s, p, sent_at=1.0, failure=None, now=1.01) is None
    assert s.suspects() == [] and s.next_due(1.01) == 1.25
    assert [q.kind for q in s.due(1.25)] == ["poll"]


@pytest.mark.parametrize("failure, cause", [("refused", "crash"), ("not_serving", "fenced")])
def test_re_probes_are_spread_over_the_rest_of_the_lease(failure, cause):
    lease, retries, interval = 3.0, 2, 0.25
    wait = reprobe_wait(lease, retries, interval)
    assert wait > 0
    s = Schedule(interval=interval, lease=lease, retries=retries)
    s.add("w", now=0.0)
    [p] = s.due(1.0)
    answer(s, p, sent_at=1.0, failure=failure)
    [p] = s.due(1.0)                                   # the first re-probe at once
    assert answer(s, p, sent_at=1.0, failure=failure) is None
    assert s.due(1.0 + wait * 0.99) == []              # the next one a wait later
    [p] = s.due(1.0 + wait)
    assert answer(s, p, sent_at=1.0 + wait, failure=failure) is None
    [p] = s.due(1.0 + 2 * wait)
    v = answer(s, p, sent_at=1.0 + 2 * wait, failure=failure)
    assert (v.kind, v.cause, v.failure) == ("dead", cause, failure)


def test_a_stream_that_breaks_while_a_poll_is_out_is_probed_again_at_its_answer():
    s = Schedule(interval=1.0, lease=1.5, retries=2)
    s.add("w", now=0.0)
    [p] = s.due(1.0)
    s.broke("w", now=1.01)
    assert s.due(1.01) == []                            # one probe at a time per worker
    answer(s, p, sent_at=1.0, failure=None, now=1.02)
    assert [q.kind for q in s.due(1.02)] == ["urgent"]


def test_answers_for_a_forgotten_or_earlier_watch_are_ignored():
    s = Schedule(interval=1.0, lease=1.5, retries=2)
    s.add("w", now=0.0)
    [p] = s.due(1.0)
    s.remove("w")
    assert answer(s, p, sent_at=1.0, failure="refused") is None and s.in_flight == 0
    s.add("w", now=2.0)                                  # watched again: a new ticket
    assert answer(s, p, sent_at=2.0, failure="refused") is None
    [q] = s.due(3.0)
    assert q.ticket != p.ticket


def test_refusals_are_asked_every_refusals_seconds_in_the_slots_the_polls_leave():
    s = Schedule(interval=4.0, lease=100.0, retries=2, max_in_flight=1, refusals_seconds=2.0)
    s.add("a", now=0.0)   # spread 0.74: asked first at 2 x (0.5 + 0.74) = 2.49, polled first at 2.97
    s.add("b", now=0.0)   # spread 0.94: asked first at 2.87, polled first at 3.75
    assert s.due(2.4) == [] and s.next_due(2.4) == pytest.approx(2.486, abs=1e-3)
    order = []
    for now in (10.0, 10.1, 10.2, 10.3):                  # one slot, everything overdue: polls first
        [p] = s.due(now)
        order.append((p.worker_id, p.kind))
        assert s.starved(now)
        if p.kind == "refusals":
            s.refusals_answered(p.worker_id, p.ticket, now=now + 0.05)
        else:
            s.answered(p, sent_at=now, failure=None, now=now + 0.05)
    assert order == [("a", "poll"), ("b", "poll"), ("a", "refusals"), ("b", "refusals")]
    assert s.asking == 0 and s.in_flight == 0
    for now, worker in ((10.35, "a"), (10.4, "b")):     # the next asks were due during the backlog: at once
        [p] = s.due(now)
        assert (p.worker_id, p.kind) == (worker, "refusals")
        s.refusals_answered(worker, p.ticket, now=now)
    assert s.next_due(10.4) == pytest.approx(12.25)      # a's next: refusals_seconds after the last one was due


def test_slots_are_held_longer_when_answers_are_slow():
    s = Schedule(interval=1.0, lease=1.5, retries=2, max_in_flight=1000)
    assert s.slot_seconds == 0.25
    for i in range(100):
        s.add(f"w{i}", now=0.0)
    out = s.due(1.0)
    fast, slow = out[:50], out[50:]
    for p in fast:
        answer(s, p, sent_at=1.0, failure=None, now=1.001)
    assert s.slot_seconds == 1.0 / 16                    # fast answers: a silent poll soon stops counting
    for p in slow[:40]:
        answer(s, p, sent_at=1.0, failure=None, now=1.5)
    assert s.slot_seconds == 1.0                          # slow answers (a loaded host): it keeps its slot
    for p in slow[40:]:
        answer(s, p, sent_at=1.0, failure="silent", now=2.0)
    assert s.slot_seconds == 1.0                          # silence says nothing about latency


@pytest.mark.parametrize("due, out, last, now, seconds", [
    ([], 0, 0.0, 5.0, None),          # nothing to send, nothing out: sleep until woken
    ([], 3, 0.0, 5.0, 0.125),         # calls out: look at their answers every tick
    ([6.0], 0, 0.0, 5.0, 0.9375),     # the next poll, up to half a tick early
    ([5.01], 3, 4.95, 5.0, 0.075),    # due at once, but the last turn was less than a tick ago
    ([4.0, 7.0], 0, 0.0, 5.0, -1.0625),   # overdue: at once
])
def test_the_monitor_sleeps_until_the_next_send_at_most_a_tick_at_a_time(due, out, last, now, seconds):
    got = wait_seconds(due, out, last, tick=0.125, now=now)
    assert got == seconds if seconds is None else got == pytest.approx(seconds)


def test_re_probes_take_slots_too_and_go_before_polls():
    s = Schedule(interval=1.0, lease=1.5, retries=2, max_in_flight=2, slot_seconds=10.0)
    for w in "abc":
        s.add(w, now=0.0)
    polled = s.due(1.0)
    assert len(polled) == 2
    for p in polled:
        assert answer(s, p, sent_at=1.0, failure="refused").kind == "suspect"
    kinds = []
    for now in (1.01, 1.02, 1.03):                      # three re-probes each, two at a time
        out = s.due(now)
        assert len(out) == 2 and s.due(now) == []        # never more than two calls out
        kinds += [p.kind for p in out]
        verdicts = [answer(s, p, sent_at=now, failure="refused") for p in out]
    assert kinds == ["reprobe"] * 6 and [v.kind for v in verdicts] == ["dead", "dead"]
    [last] = s.due(1.04)                                 # only then the third worker's poll
    assert last.kind == "poll" and last.worker_id not in {p.worker_id for p in polled}
