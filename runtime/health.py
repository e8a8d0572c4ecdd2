"""Health probes: the client's heartbeat lease on every worker.

A :class:`HealthMonitor` holds a standard ``grpc.health.v1`` Watch stream
open to each watched worker (a crash ends it at once and triggers a probe
round) and a thread sends a Check to each every ``interval`` seconds. A worker that has not
answered for half its ``lease`` is suspect; a suspect is re-probed with a
bounded retry (tenacity) spread over the rest of the lease and, if it still
does not answer, declared dead
through ``on_dead(worker, reason, cause)`` (called at most once per worker;
``cause`` is "crash", "hang" or "fenced", from how the last probe failed). A
crashed process is found by the first failed probe (connection refused); a
hung or cut-off one (SIGSTOP, deadlock, partition) by the lease.

Riding on the same poll, every ``refusals_seconds`` the monitor asks each
watched worker for the calls it refused for their run secret since it last
asked (the worker's ``Refusals`` RPC, answered without waiting) and records
them as ``security_refused`` events (``worker``, ``method``, ``peer``,
``count``, ``reason``): counts, not one event per call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import tenacity
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.policy import cause_of, is_suspect, reprobe_wait

__all__ = ["HealthMonitor", "check", "probe"]

_WATCH_SECONDS = 60.0


def probe(stub: health_pb2_grpc.HealthStub, timeout: float) -> bool:
    """One Check; True when the worker answers SERVING within ``timeout``."""
    return check(stub, timeout) is None


def check(stub: health_pb2_grpc.HealthStub, timeout: float) -> str | None:
    """One Check; None when the worker answers SERVING, else how it failed.

    ``"refused"``: the process is gone (connection refused or reset: a crash);
    ``"silent"``: no answer within ``timeout`` (a hang, or a partition);
    ``"not_serving"``: it answered but has fenced itself.
    """
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.RpcError as e:
        return "silent" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "refused"
    return None if reply.status == health_pb2.HealthCheckResponse.SERVING else "not_serving"


def confirm_dead(stub, timeout: float, retries: int, wait: float = 0.0) -> bool:
    """Probes a suspect up to ``retries + 1`` times, ``wait`` seconds apart; True if it never answers."""
    retrying = tenacity.Retrying(stop=tenacity.stop_after_attempt(retries + 1),
                                 wait=tenacity.wait_fixed(wait),
                                 retry=tenacity.retry_if_result(lambda ok: not ok), reraise=False,
                                 retry_error_callback=lambda state: False)
    return not retrying(probe, stub, timeout)


class HealthMonitor:
    def __init__(self, channels: Callable[[str], grpc.Channel], on_dead: Callable[..., None], *,
                 interval: float, lease: float, retries: int, events=None, refusals_seconds: float = 5.0):
        self._channels = channels
        self.on_dead = on_dead
        self.interval, self.lease, self.retries = interval, lease, retries
        self.events = events
        self.refusals_seconds = refusals_seconds
        self._next_refusals = time.monotonic() + refusals_seconds
        self._workers: dict[str, pb_grpc.WorkerStub] = {}   # for the Refusals reports
        self._stubs: dict[str, health_pb2_grpc.HealthStub] = {}
        self._last_ok: dict[str, float] = {}
        self._dead: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()     # a Watch stream broke: probe now, not at the next tick
        self._streams: dict[str, grpc.Future] = {}
        self._thread = threading.Thread(target=self._run, name="health-monitor", daemon=True)

    def watch(self, worker_id: str, address: str) -> None:
        channel = self._channels(address)
        stub = health_pb2_grpc.HealthStub(channel)
        with self._lock:
            self._workers[worker_id] = pb_grpc.WorkerStub(channel)
            self._stubs[worker_id] = stub
            self._last_ok[worker_id] = time.monotonic()
        threading.Thread(target=self._follow, args=(worker_id, stub), name=f"health-watch-{worker_id}",
                         daemon=True).start()

    def unwatch(self, worker_id: str) -> None:
        with self._lock:
            self._stubs.pop(worker_id, None)
            self._workers.pop(worker_id, None)
            self._last_ok.pop(worker_id, None)
            stream = self._streams.pop(worker_id, None)
        if stream is not None:
            stream.cancel()

    def _follow(self, worker_id: str, stub) -> None:
        """Holds a ``grpc.health.v1`` Watch stream open; when it breaks (the process died), probes at once.

        The stream is re-opened every ``_WATCH_SECONDS`` (every call has a
        deadline) and after it broke, as long as the worker is watched.
        """
        while not self._stop.is_set():
            with self._lock:
                if self._stubs.get(worker_id) is not stub:
                    return
                stream = self._streams[worker_id] = stub.Watch(health_pb2.HealthCheckRequest(service=""),
                                                               timeout=_WATCH_SECONDS)
            try:
                for reply in stream:
                    if reply.status != health_pb2.HealthCheckResponse.SERVING:
                        self._wake.set()
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED:
                    return
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    self._wake.set()
                    self._stop.wait(self.interval)   # do not spin on a dead address

    def is_alive(self, worker_id: str, timeout: float | None = None) -> bool:
        """Probe now with the bounded retry: False if the worker is confirmed dead."""
        with self._lock:
            stub = self._stubs.get(worker_id)
            if stub is None or worker_id in self._dead:
                return False
        return not confirm_dead(stub, timeout or self.lease, self.retries, wait=self.interval / 2)

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

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            if time.monotonic() >= self._next_refusals:
                # Answers arrive on gRPC's threads: a hung worker does not hold up the health checks.
                self._next_refusals = time.monotonic() + self.refusals_seconds
                self._ask_refusals(timeout=max(self.refusals_seconds, self.interval))
            with self._lock:
                stubs = dict(self._stubs)
            for wid, stub in stubs.items():
                if self._stop.is_set():
                    return
                now = time.monotonic()
                failure = check(stub, timeout=self.interval)
                if failure is None:
                    with self._lock:
                        if wid in self._last_ok:
                            self._last_ok[wid] = now
                    continue
                with self._lock:
                    last_ok = self._last_ok.get(wid, now)
                silent = now - last_ok
                if not is_suspect(now, last_ok, self.lease, failure):
                    continue
                if self.events is not None:
                    self.events.emit("worker_suspect", worker=wid, silent_seconds=silent)
                spread = reprobe_wait(self.lease, self.retries, self.interval)
                if confirm_dead(stub, self.interval, self.retries, wait=spread):
                    with self._lock:
                        if wid in self._dead:
                            continue
                        self._dead.add(wid)
                        self._stubs.pop(wid, None)
                        self._workers.pop(wid, None)
                    cause = cause_of(failure)
                    self.on_dead(wid, f"no health answer for {silent:.2f} s and {self.retries} re-probes "
                                      f"({failure})", cause)


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
