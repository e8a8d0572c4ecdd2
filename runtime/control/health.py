"""Health probes: the client's heartbeat lease on every worker.

A :class:`HealthMonitor` holds a standard ``grpc.health.v1`` Watch stream
open to each watched worker (a crash ends it at once and that worker is
probed at once, ahead of the poll) and sends a Check to each every
``interval`` seconds. A worker that has not answered for half its ``lease``
is suspect; a suspect is re-probed ``retries + 1`` times, spread over the
rest of the lease and, if it never answers, declared dead through
``on_dead(worker, reason, cause)`` (called at most once per worker;
``cause`` is "crash", "hang" or "fenced", from how the probe that made it
suspect failed). A crashed process is found by the first failed probe
(connection refused); a hung or cut-off one (SIGSTOP, deadlock, partition)
by the lease. A status change on a live worker (NOT_SERVING: it fenced
itself) is seen by its next Check.

Riding on the same poll, every ``refusals_seconds`` the monitor asks each
watched worker for the calls it refused for their run secret since it last
asked (the worker's ``Refusals`` RPC, answered without waiting) and records
them as ``security_refused`` events (``worker``, ``method``, ``peer``,
``count``, ``reason``): counts, not one event per call.

How it scales (one client, thousands of workers; see
``benchmarks/control_plane_scale.py``): every call is a gRPC future, so no
thread waits on a worker, and no thread follows a stream (gRPC's own
thread per channel delivers its end). One thread runs the schedule
(:class:`runtime.control.health_schedule.Schedule`: pure bookkeeping of who is probed when and what an
answer means) and issues the calls; answers and ended streams come back
from gRPC's threads on one queue, and the thread takes in answers that
change nothing in batches, at most every ``interval / 8`` seconds. At most
``max_in_flight`` calls are out at once, re-probes and probes after a
broken stream first (a call gives its slot back once it is out much
longer than answers take, so hung workers do not hold up the others):
when the workers, or this host, cannot answer ``n / interval`` Checks a
second, each worker's Check period stretches, instead of calls queueing
until their deadlines pass, live workers looking silent and their
re-probes adding to the load. The ``Refusals`` asks are spread over their
period and take the slots the polls leave.
"""

from __future__ import annotations

import collections
import functools
import heapq
import random
import threading
import time
from collections.abc import Callable

import grpc
import tenacity
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.control.health_schedule import MAX_IN_FLIGHT, Probe, Schedule, Verdict, wait_seconds

__all__ = ["HealthMonitor", "check", "failure_of", "probe"]

_WATCH_SECONDS = 60.0     # every Watch has a deadline: re-opened after this long (plus up to 10 %, spread)
_CHECK = health_pb2.HealthCheckRequest(service="")


def failure_of(code: grpc.StatusCode | None, status: int | None = None) -> str | None:
    """How a Check failed, from its status code (None: it answered) and the health status it answered.

    None when it answered SERVING; ``"silent"`` when its deadline passed (a
    hang, a partition); ``"not_serving"`` when it answered otherwise (it
    fenced itself); ``"refused"`` for any other error (the process is gone:
    connection refused or reset, a crash). Pure.
    """
    if code is not None:
        return "silent" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "refused"
    return None if status == health_pb2.HealthCheckResponse.SERVING else "not_serving"


def probe(stub: health_pb2_grpc.HealthStub, timeout: float) -> bool:
    """One Check; True when the worker answers SERVING within ``timeout``."""
    return check(stub, timeout) is None


def check(stub: health_pb2_grpc.HealthStub, timeout: float) -> str | None:
    """One blocking Check; None when the worker answers SERVING, else how it failed (see :func:`failure_of`)."""
    try:
        reply = stub.Check(_CHECK, timeout=timeout)
    except grpc.RpcError as e:
        return failure_of(e.code())
    return failure_of(None, reply.status)


def _answer(fut: grpc.Future) -> str | None:
    """The failure of a finished Check future (see :func:`failure_of`); a cancelled one was refused."""
    try:
        reply = fut.result(timeout=0)
    except grpc.RpcError as e:
        return failure_of(e.code())
    except Exception:  # noqa: BLE001 - cancelled (channel closed) or otherwise gone: no answer from the process
        return "refused"
    return failure_of(None, reply.status)


def confirm_dead(stub, timeout: float, retries: int, wait: float = 0.0, known_dead: Callable[[], bool] = bool) -> bool:
    """Probes a suspect up to ``retries + 1`` times, ``wait`` seconds apart; True if it never answers.

    ``known_dead()`` is asked while waiting and before each re-probe: once
    another path has confirmed the death (the monitor's own re-probes), stop
    waiting.
    """
    def sleep(seconds: float) -> None:
        end = time.monotonic() + seconds
        while not known_dead() and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.005))

    retrying = tenacity.Retrying(stop=tenacity.stop_any(tenacity.stop_after_attempt(retries + 1),
                                                        lambda _state: known_dead()),
                                 wait=tenacity.wait_fixed(wait), sleep=sleep,
                                 retry=tenacity.retry_if_result(lambda ok: not ok), reraise=False,
                                 retry_error_callback=lambda state: False)
    return not retrying(probe, stub, timeout)


# -- the schedule: pure bookkeeping -------------------------------------------------


class HealthMonitor:
    """The client's lease on its workers (see the module docstring). Thread-safe: ``watch``, ``unwatch``,
    ``is_alive`` and ``collect_refusals`` may be called from any thread; ``on_dead`` is called on the
    monitor's thread."""

    def __init__(self, channels: Callable[[str], grpc.Channel], on_dead: Callable[..., None], *,
                 interval: float, lease: float, retries: int, events=None, refusals_seconds: float = 5.0,
                 max_in_flight: int = MAX_IN_FLIGHT):
        self._channels = channels
        self.on_dead = on_dead
        self.interval, self.lease, self.retries = interval, lease, retries
        self.events = events
        self._schedule = Schedule(interval, lease, retries, max_in_flight, refusals_seconds)
        self._workers: dict[str, pb_grpc.WorkerStub] = {}   # for the Refusals reports
        self._stubs: dict[str, health_pb2_grpc.HealthStub] = {}
        self._streams: dict[str, grpc.Future] = {}
        self._reopen: list[tuple[float, int, str]] = []     # (when, ticket, worker): Watch streams to open again
        self._dead: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._inbox: collections.deque = collections.deque()   # answers and ended streams, from gRPC's threads
        self._wake = threading.Event()     # something in the inbox cannot wait for the next tick
        self._starved = False              # every probe slot is taken: any answer wakes the monitor
        self._tick = interval / 8          # answers that need nothing at once are taken in at most this often
        self._thread = threading.Thread(target=self._run, name="health-monitor", daemon=True)

    @property
    def refusals_seconds(self) -> float:
        return self._schedule.refusals_seconds

    @refusals_seconds.setter
    def refusals_seconds(self, seconds: float) -> None:
        self._schedule.refusals_seconds = seconds

    def watch(self, worker_id: str, address: str) -> None:
        channel = self._channels(address)
        stub = health_pb2_grpc.HealthStub(channel)
        with self._lock:
            old = self._streams.pop(worker_id, None)
            self._workers[worker_id] = pb_grpc.WorkerStub(channel)
            self._stubs[worker_id] = stub
            self._dead.discard(worker_id)
            ticket = self._schedule.add(worker_id, time.monotonic())
        if old is not None:
            old.cancel()
        self._open(worker_id, ticket)
        self._wake.set()   # a new poll is scheduled

    def unwatch(self, worker_id: str) -> None:
        with self._lock:
            self._stubs.pop(worker_id, None)
            self._workers.pop(worker_id, None)
            self._schedule.remove(worker_id)
            stream = self._streams.pop(worker_id, None)
        if stream is not None:
            stream.cancel()

    def _open(self, worker_id: str, ticket: int) -> None:
        """Opens a ``grpc.health.v1`` Watch stream to ``worker_id``; its end comes back through the inbox.

        Its replies are not read: the stream is there to end when the
        process does. It has a deadline (``_WATCH_SECONDS`` plus up to 10 %,
        so a fleet's streams are not re-opened at once), after which it is
        re-opened, as after it broke, as long as the worker is watched.
        """
        with self._lock:
            stub = self._stubs.get(worker_id)
            if stub is None or self._schedule.ticket(worker_id) != ticket or self._stop.is_set():
                return
            try:
                stream = stub.Watch(_CHECK, timeout=_WATCH_SECONDS * (1 + 0.1 * random.random()))
            except Exception:  # noqa: BLE001 - a closed channel: the polls find out what happened
                return
            self._streams[worker_id] = stream
        stream.add_done_callback(functools.partial(self._ended, worker_id, ticket, stream))

    def _ended(self, worker_id: str, ticket: int, stream, _call=None) -> None:
        self._post(("ended", worker_id, ticket, stream), urgent=True)

    def _post(self, item: tuple, urgent: bool) -> None:
        """From gRPC's threads: an answer or an ended stream for the monitor; ``urgent`` ones wake it at once."""
        self._inbox.append(item)
        if urgent or self._starved:
            self._wake.set()

    def is_alive(self, worker_id: str, timeout: float | None = None) -> bool:
        """Probe now with the bounded retry: False if the worker is confirmed dead."""
        with self._lock:
            stub = self._stubs.get(worker_id)
            if stub is None or worker_id in self._dead:
                return False
        def known_dead():
            with self._lock:
                return worker_id in self._dead

        return not confirm_dead(stub, timeout or self.lease, self.retries, wait=self.interval / 2,
                                known_dead=known_dead)

    # -- security events ---------------------------------------------------------

    def collect_refusals(self, timeout: float) -> list[dict]:
        """Asks every watched worker for its refused calls now; returns the ``security_refused`` events emitted.

        Waits at most ``timeout`` seconds; a worker that does not answer in
        time is skipped (its counts come with a later report). Thread-safe.
        """
        futs = self._ask_refusals(timeout)
        out = []
        for fut in futs:
            try:
                out += fut.result(timeout=timeout)
            except Exception:  # noqa: BLE001 - no answer: the health checks deal with that worker
                pass
        return out

    def _ask_refusals(self, timeout: float) -> list:
        """Sends one ``Refusals`` call to every watched worker; each future answers its emitted events."""
        with self._lock:
            workers = dict(self._workers)
        return [_Report(wid, stub.Refusals.future(pb.RefusalsRequest(), timeout=timeout), self._emit_refusals)
                for wid, stub in workers.items()]

    def _emit_refusals(self, worker_id: str, reply: pb.RefusalsReply) -> list[dict]:
        events = []
        for r in reply.refusals:
            fields = dict(worker=worker_id, method=r.method, peer=r.peer, count=r.count, reason=r.reason)
            events.append(self.events.emit("security_refused", **fields) if self.events is not None
                          else {"kind": "security_refused", **fields})
        return events

    # -- the monitor's thread ------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            stream.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        """The monitor's thread: takes in what came back and sends what is due, in batches.

        It wakes at once for a failed probe, an ended stream or a new
        worker, and when every probe slot is taken for any answer; otherwise
        at most every ``interval / 8`` seconds (sending every probe due within
        half of that), so answers that change nothing cost no wake-up each.
        """
        last = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                wake = [t for t in (self._schedule.next_due(now), self._reopen[0][0] if self._reopen else None)
                        if t is not None]
                self._starved = self._schedule.starved(now)
                out = self._schedule.in_flight + self._schedule.asking
            if not self._inbox:
                timeout = wait_seconds(wake, out, last, self._tick, now)
                if timeout is None or timeout > 0:
                    self._wake.wait(timeout)
            self._wake.clear()
            if self._stop.is_set():
                return
            items = []
            while self._inbox:
                items.append(self._inbox.popleft())
            last = time.monotonic()
            self._step(items, last)

    def _step(self, items: list, now: float) -> None:
        """Takes in the answers and ended streams, then sends what is due: one turn of the monitor's thread."""
        verdicts, reports, reopen = [], [], []
        with self._lock:
            for item in items:
                if item[0] == "answer":
                    _, p, sent_at, failure = item
                    v = self._schedule.answered(p, sent_at, failure, now)
                    if v is not None:
                        verdicts.append(v)
                        if v.kind == "dead":
                            self._forget_dead(v.worker_id)
                elif item[0] == "refusals":
                    _, wid, ticket, fut = item
                    self._schedule.refusals_answered(wid, ticket, now)
                    reports.append((wid, fut))
                else:   # "ended": a Watch stream ended
                    _, wid, ticket, stream = item
                    if self._streams.get(wid) is not stream:
                        continue   # cancelled by unwatch or stop, or replaced
                    del self._streams[wid]
                    code = stream.code()
                    if code != grpc.StatusCode.DEADLINE_EXCEEDED:
                        self._schedule.broke(wid, now)
                    # Re-open after a deadline at once; after a break, in an interval (not spinning on a dead address).
                    heapq.heappush(self._reopen, (now if code == grpc.StatusCode.DEADLINE_EXCEEDED
                                                  else now + self.interval, ticket, wid))
            while self._reopen and self._reopen[0][0] <= now:
                _, ticket, wid = heapq.heappop(self._reopen)
                reopen.append((wid, ticket))
            soon = now + self._tick / 2
            probes = [(p, (self._workers if p.kind == "refusals" else self._stubs).get(p.worker_id))
                      for p in self._schedule.due(soon)]
        for v in verdicts:
            self._record(v)
        for wid, fut in reports:
            try:
                self._emit_refusals(wid, fut.result(timeout=0))
            except Exception:  # noqa: BLE001 - no answer this time: its counts come with a later report
                pass
        for wid, ticket in reopen:
            self._open(wid, ticket)
        for p, stub in probes:
            if p.kind == "refusals":
                self._ask(p.worker_id, p.ticket, stub)
            else:
                self._send(p, stub)

    def _send(self, p: Probe, stub) -> None:
        sent_at = time.monotonic()
        try:
            fut = stub.Check.future(_CHECK, timeout=self.interval)
        except Exception:  # noqa: BLE001 - a closed channel: no answer from the process
            self._post(("answer", p, sent_at, "refused"), urgent=True)
            return
        fut.add_done_callback(lambda f: self._answered(p, sent_at, f))

    def _answered(self, p: Probe, sent_at: float, fut: grpc.Future) -> None:
        failure = _answer(fut)
        self._post(("answer", p, sent_at, failure), urgent=failure is not None)

    def _ask(self, wid: str, ticket: int, stub) -> None:
        try:
            fut = stub.Refusals.future(pb.RefusalsRequest(), timeout=max(self.refusals_seconds, self.interval))
        except Exception:  # noqa: BLE001 - a closed channel: nothing to report
            with self._lock:
                self._schedule.refusals_answered(wid, ticket, time.monotonic())
            return
        fut.add_done_callback(lambda f: self._post(("refusals", wid, ticket, f), urgent=False))

    def _forget_dead(self, worker_id: str) -> None:
        """Under the lock: a dead worker is no longer probed, asked or watched."""
        self._dead.add(worker_id)
        self._stubs.pop(worker_id, None)
        self._workers.pop(worker_id, None)
        stream = self._streams.pop(worker_id, None)
        if stream is not None:
            stream.cancel()

    def _record(self, v: Verdict) -> None:
        if v.kind == "suspect":
            if self.events is not None:
                self.events.emit("worker_suspect", worker=v.worker_id, silent_seconds=v.silent)
            return
        self.on_dead(v.worker_id, f"no health answer for {v.silent:.2f} s and {self.retries} re-probes "
                                  f"({v.failure})", v.cause)


class _Report:
    """One ``Refusals`` call in flight: emits its events when the answer comes; ``result`` waits for them."""

    def __init__(self, worker_id: str, fut: grpc.Future, emit):
        self._done = threading.Event()
        self._events: list[dict] | None = None
        self._worker_id, self._emit = worker_id, emit
        fut.add_done_callback(self._answered)

    def _answered(self, fut: grpc.Future) -> None:
        try:
            self._events = self._emit(self._worker_id, fut.result())
        except Exception:  # noqa: BLE001 - a worker that does not answer reports nothing this time
            self._events = None
        finally:
            self._done.set()

    def result(self, timeout: float) -> list[dict]:
        if not self._done.wait(timeout) or self._events is None:
            raise TimeoutError(f"no refusals report from {self._worker_id}")
        return self._events
