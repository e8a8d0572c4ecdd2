"""Health probes: the client's heartbeat lease on every worker.

A :class:`HealthMonitor` holds a standard ``grpc.health.v1`` Watch stream
open to each watched worker (a crash ends it at once and that worker is
probed at once, ahead of the poll) and sends a Check to each every
``period`` seconds (default: ``interval``; a probe that failed is followed
by the next one ``interval`` after it). A worker that has not answered for
half its ``lease`` is suspect; a suspect is re-probed ``retries + 1`` times,
spread over the rest of the lease and, if it never answers, declared dead through
``on_dead(worker, reason, cause)`` (called at most once per watch of a
worker, on the monitor's thread; ``cause`` is "crash", "hang" or "fenced",
from how the probe that made it suspect failed). A crashed process is found
by the first failed probe (connection refused); a hung or cut-off one
(SIGSTOP, deadlock, partition) by the lease. A status change on a live
worker (NOT_SERVING: it fenced itself) comes on its Watch stream as it
happens and has it probed at once. A worker that answers something else
(a training step: :meth:`HealthMonitor.heard`) is not polled while it does:
that answer renews its lease as a Check's would.

Riding on the same poll, every ``refusals_seconds`` the monitor asks each
watched worker for the calls it refused for their run secret since it last
asked (the worker's ``Refusals`` RPC, answered without waiting) and records
them as ``security_refused`` events (``worker``, ``method``, ``peer``,
``count``, ``reason``): counts, not one event per call.

How it runs (one client, thousands of workers; see
``benchmarks/control_plane_scale.py``): on ``grpc.aio``. The monitor's own
thread runs one asyncio event loop that owns every channel, Watch stream and
call; a watched worker costs no thread, and one that is not being probed (its
stream open, waiting) costs no CPU. Every call has a deadline: a Check the
``interval`` (``is_alive``'s its ``timeout``), a ``Refusals`` call
``max(refusals_seconds, interval)``, a Watch ``_WATCH_SECONDS`` (then it is
opened again). The loop takes each answer in as it comes
(:class:`runtime.control.health_schedule.Schedule`: pure bookkeeping of who
is probed when and what an answer means) and sends what is due in turns, at
most every ``interval / 8`` seconds, sooner after a failed probe, an ended
stream or a new worker. At most ``max_in_flight`` calls are out at once,
re-probes and probes after a broken stream first (a call gives its slot back
once it is out much longer than answers take, so hung workers do not hold up
the others): when the workers, or this host, cannot answer ``n / interval``
Checks a second, each worker's Check period stretches, instead of calls
queueing until their deadlines pass, live workers looking silent and their
re-probes adding to the load. The ``Refusals`` asks are spread over their
period and take the slots the polls leave.

Threads: ``watch``, ``unwatch``, ``is_alive``, ``collect_refusals``, ``start``
and ``stop`` may be called from any thread but the monitor's own (where
``on_dead`` runs: it may call ``watch`` and ``unwatch``, which hand their
change to the loop and return at once, but not the two that wait for the
loop's answer, which then raise ``RuntimeError``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import heapq
import random
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.control.health_schedule import MAX_IN_FLIGHT, Probe, Schedule, Verdict, wait_seconds
from runtime.wire import auth, rpc

__all__ = ["Dialer", "HealthMonitor", "failure_of"]

_WATCH_SECONDS = 60.0     # every Watch has a deadline: re-opened after this long (plus up to 10 %, spread)
_CHECK = health_pb2.HealthCheckRequest(service="")
_SERVING = health_pb2.HealthCheckResponse.SERVING
_CLOSE_GRACE = 0.1        # seconds the loop runs on after closing its channels at stop (see _close_all)
_SLACK = 5.0              # seconds a caller waits for the loop beyond its calls' deadlines (a loaded host)


def failure_of(code: grpc.StatusCode | None, status: int | None = None) -> str | None:
    """How a Check failed, from its status code (None: it answered) and the health status it answered.

    None when it answered SERVING; ``"silent"`` when its deadline passed (a
    hang, a partition); ``"not_serving"`` when it answered otherwise (it
    fenced itself); ``"refused"`` for any other error (the process is gone:
    connection refused or reset, a crash). Pure.
    """
    if code is not None:
        return "silent" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "refused"
    return None if status == _SERVING else "not_serving"


@dataclasses.dataclass(frozen=True)
class Dialer:
    """How the monitor reaches a worker: the run secret, sent with every call, and mutual TLS if given."""

    secret: str = ""
    tls: auth.TlsFiles | None = None

    def credentials(self) -> grpc.ChannelCredentials | None:
        """The TLS credentials (None: plaintext). Reads the TLS files: an error names the one missing or empty."""
        return None if self.tls is None else self.tls.channel_credentials()

    @staticmethod
    def channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
        """A ``grpc.aio`` channel to ``address`` with the runtime's options (``rpc.CHANNEL_OPTIONS``); call it on
        the loop that will use it (a ``grpc.aio`` channel belongs to the loop that made it)."""
        if credentials is not None:
            return grpc.aio.secure_channel(address, credentials, options=rpc.CHANNEL_OPTIONS)
        return grpc.aio.insecure_channel(address, options=rpc.CHANNEL_OPTIONS)

    @property
    def metadata(self) -> tuple | None:
        """Every call's metadata: the run secret (as ``auth.secure_channel`` attaches it), if there is one."""
        return ((auth.METADATA_KEY, self.secret),) if self.secret else None


@dataclasses.dataclass(eq=False)
class _Link:
    """One watch of a worker, on the loop: its channel, stubs and Watch stream."""

    ticket: int
    channel: grpc.aio.Channel
    health: health_pb2_grpc.HealthStub
    worker: pb_grpc.WorkerStub
    stream: asyncio.Task | None = None


class HealthMonitor:
    """The client's lease on its workers (see the module docstring for the contract and the threads).

    ``dialer`` says how to reach a worker (its run secret and TLS); ``on_dead``
    is called on the monitor's thread, at most once per watch of a worker.
    """

    def __init__(self, dialer: Dialer, on_dead: Callable[..., None], *, interval: float, lease: float,
                 retries: int, events=None, refusals_seconds: float = 5.0, max_in_flight: int = MAX_IN_FLIGHT,
                 period: float | None = None):
        if not isinstance(dialer, Dialer):
            raise TypeError(f"HealthMonitor takes a Dialer(secret, tls), not {dialer!r}: it makes its own grpc.aio "
                            "channels on its event loop")
        self.dialer = dialer
        self.on_dead = on_dead
        self.interval, self.lease, self.retries = interval, lease, retries
        self.events = events
        self._schedule = Schedule(interval, lease, retries, max_in_flight, refusals_seconds, period=period)
        self._metadata = dialer.metadata
        self._credentials: grpc.ChannelCredentials | None = None   # read from the TLS files at the first watch
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="health-monitor", daemon=True)
        self._stopped = False
        # Everything below is the loop's: touched only on the monitor's thread.
        self._links: dict[str, _Link] = {}
        self._death = asyncio.Event()        # set (and replaced) at each death: is_alive stops waiting
        self._reopen: list[tuple[float, int, str]] = []    # (when, ticket, worker): Watch streams to open again
        self._tasks: set[asyncio.Task] = set()              # calls and streams out (the loop keeps weak references)
        self._timer: asyncio.Handle | None = None           # the next turn
        self._soon = False                                   # the next turn is at once
        self._last = 0.0                                     # when the last turn was
        self._tick = interval / 8
        self._heard: dict[str, float] = {}    # worker -> when a request it answered was sent; any thread writes

    @property
    def period(self) -> float:
        """Seconds between two Checks to a worker that answers."""
        return self._schedule.period

    @property
    def refusals_seconds(self) -> float:
        return self._schedule.refusals_seconds

    @refusals_seconds.setter
    def refusals_seconds(self, seconds: float) -> None:
        self._schedule.refusals_seconds = seconds

    # -- any thread -----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Closes every stream, call and channel and ends the monitor's thread (waits at most ``_SLACK`` s).
        Idempotent; after it nothing is watched and ``on_dead`` is not called again."""
        if self._stopped:
            return
        self._stopped = True
        if not self._thread.is_alive():
            if self._thread.ident is None:   # never started
                self._loop.close()
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=_SLACK)

    def watch(self, worker_id: str, address: str) -> None:
        """Starts watching ``worker_id`` at ``address`` (again, if it was: a fresh watch). Returns at once; a bad
        TLS file raises here."""
        if self._credentials is None and self.dialer.tls is not None:
            self._credentials = self.dialer.credentials()
        self._post(self._watch, worker_id, address, self._credentials)

    def unwatch(self, worker_id: str) -> None:
        """Stops watching ``worker_id`` (its answers that come later are ignored). Returns at once."""
        self._post(self._unwatch, worker_id)

    def heard(self, worker_id: str, sent_at: float) -> None:
        """``worker_id`` answered a request (a training step) sent at ``sent_at`` (``time.monotonic()``): it
        counts as a Check's answer, and the worker's next poll waits a period from it. Cheap, from any thread:
        a dict write the loop reads at its next turn (it does not wake the loop)."""
        self._heard[worker_id] = sent_at

    def heard_seconds(self, worker_id: str, now: float) -> float | None:
        """Seconds from the last request ``worker_id`` answered (a Check or a step) to ``now`` (monotonic); None
        when it is not watched. From any thread: reads what the loop last wrote (a step answered since its last
        turn counts too)."""
        last = self._schedule.last_ok(worker_id)
        if last is None:
            return None
        return max(now - max(last, self._heard.get(worker_id, last)), 0.0)

    def is_alive(self, worker_id: str, timeout: float | None = None) -> bool:
        """Probes now with the bounded retry: False if the worker is confirmed dead (or not watched).

        Up to ``retries + 1`` Checks of ``timeout`` seconds (default: the
        lease), ``interval / 2`` apart, until one answers SERVING; stops
        waiting once the monitor declares it dead. If the loop cannot answer
        within those deadlines plus ``_SLACK`` seconds, nothing is confirmed:
        True (the monitor's own probes decide).
        """
        timeout = timeout or self.lease
        bound = (self.retries + 1) * timeout + self.retries * self.interval / 2 + _SLACK
        return self._ask(self._confirm(worker_id, timeout), bound, late=True, stopped=False)

    def collect_refusals(self, timeout: float) -> list[dict]:
        """Asks every watched worker for its refused calls now; returns the ``security_refused`` events emitted.

        Waits at most ``timeout`` seconds (plus ``_SLACK`` for a loaded host);
        a worker that does not answer in time is skipped (its counts come
        with a later report).
        """
        out: list[dict] = []
        self._ask(self._collect(timeout, out), timeout + _SLACK, late=None, stopped=None)
        return list(out)

    def _post(self, fn, *args) -> None:
        if self._stopped:
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:   # the loop closed meanwhile (stop on another thread)
            pass

    def _ask(self, coro, bound: float, late, stopped):
        """Runs ``coro`` on the loop and waits at most ``bound`` seconds for its result: ``late`` if it takes
        longer, ``stopped`` if the monitor stopped (nothing is watched then)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("is_alive and collect_refusals wait for the monitor's loop: not from its own thread "
                               "(on_dead)")
        if self._thread.ident is None:
            coro.close()
            raise RuntimeError("the health monitor is not started: call start() first")
        try:
            if self._stopped:
                raise RuntimeError("stopped")
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:   # stopped, or the loop closed meanwhile
            coro.close()
            return stopped
        try:
            return fut.result(timeout=bound)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            fut.cancel()
            return late

    # -- the monitor's thread -------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._close_all())
            self._loop.close()

    async def _close_all(self) -> None:
        """After the loop stopped: closes every channel (which cancels its calls and streams), lets what they
        were doing end, and gives gRPC ``_CLOSE_GRACE`` seconds to hand this loop the last events of the calls
        it cancelled (an event for a closed loop is an error logged on another loop of this process)."""
        if self._timer is not None:
            self._timer.cancel()
        links, self._links = list(self._links.values()), {}
        await asyncio.gather(*(link.channel.close() for link in links), return_exceptions=True)
        await asyncio.sleep(_CLOSE_GRACE)
        others = [t for t in asyncio.all_tasks(self._loop) if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def _watch(self, worker_id: str, address: str, credentials) -> None:
        self._drop(worker_id)
        channel = self.dialer.channel(address, credentials)
        ticket = self._schedule.add(worker_id, time.monotonic())
        self._links[worker_id] = _Link(ticket, channel, health_pb2_grpc.HealthStub(channel),
                                       pb_grpc.WorkerStub(channel))
        self._open(worker_id, ticket)
        self._kick()   # a new poll is scheduled

    def _unwatch(self, worker_id: str) -> None:
        self._schedule.remove(worker_id)
        self._drop(worker_id)

    def _drop(self, worker_id: str) -> None:
        """Forgets the worker's link: its stream and calls end with its channel."""
        link = self._links.pop(worker_id, None)
        if link is not None:
            if link.stream is not None:
                link.stream.cancel()
            self._spawn(link.channel.close())

    def _spawn(self, coro) -> asyncio.Task:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _open(self, worker_id: str, ticket: int) -> None:
        """Opens a ``grpc.health.v1`` Watch stream to ``worker_id``; :meth:`_ended` hears its end.

        It is there to end when the process does; a reply other than SERVING
        (the worker fenced itself) has the worker probed at once, and the
        probe's answer says what it is. It has a deadline (``_WATCH_SECONDS``
        plus up to 10 %, so a fleet's streams are not re-opened at once), after
        which it is opened again, as after it broke, as long as the worker is
        watched.
        """
        link = self._links.get(worker_id)
        if link is None or link.ticket != ticket:
            return
        link.stream = self._spawn(self._follow(worker_id, link))

    async def _follow(self, worker_id: str, link: _Link) -> None:
        call = link.health.Watch(_CHECK, timeout=_WATCH_SECONDS * (1 + 0.1 * random.random()),
                                 metadata=self._metadata)
        try:
            async for reply in call:
                if reply.status != _SERVING and self._links.get(worker_id) is link:
                    self._schedule.broke(worker_id, time.monotonic())
                    self._kick()
            code = grpc.StatusCode.OK          # the worker ended it
        except grpc.RpcError as e:
            code = e.code()
        self._ended(worker_id, link, code)

    def _ended(self, worker_id: str, link: _Link, code: grpc.StatusCode) -> None:
        """A Watch stream ended by itself: unless by its deadline, the worker is probed at once."""
        if self._links.get(worker_id) is not link:
            return   # unwatched or watched afresh meanwhile
        now = time.monotonic()
        link.stream = None
        deadline = code == grpc.StatusCode.DEADLINE_EXCEEDED
        if not deadline:
            self._schedule.broke(worker_id, now)
        # Re-open after a deadline at once; after a break, in an interval (not spinning on a dead address).
        heapq.heappush(self._reopen, (now if deadline else now + self.interval, link.ticket, worker_id))
        self._kick()

    def _kick(self) -> None:
        """The next turn at once (once: further kicks before it add nothing)."""
        if self._soon:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._soon = True
        self._timer = self._loop.call_soon(self._turn)

    def _turn(self) -> None:
        """One turn: opens the streams due again, sends what is due (up to half a tick early), sets the next."""
        now = time.monotonic()
        self._soon, self._timer = False, None
        while self._heard:
            try:
                worker_id, sent_at = self._heard.popitem()   # atomic: other threads write meanwhile
            except KeyError:
                break
            self._schedule.heard(worker_id, sent_at)
        while self._reopen and self._reopen[0][0] <= now:
            _, ticket, worker_id = heapq.heappop(self._reopen)
            self._open(worker_id, ticket)
        for p in self._schedule.due(now + self._tick / 2):
            link = self._links.get(p.worker_id)
            if link is None:   # cannot happen: the schedule forgets whom the links forget
                continue
            self._spawn(self._refusals(p, link) if p.kind == "refusals" else self._check(p, link))
        self._last = now
        wake = [t for t in (self._schedule.next_due(now), self._reopen[0][0] if self._reopen else None)
                if t is not None]
        delay = wait_seconds(wake, self._schedule.in_flight + self._schedule.asking, self._last, self._tick, now)
        if delay is not None:
            self._timer = self._loop.call_later(max(delay, 0.0), self._turn)

    async def _check(self, p: Probe, link: _Link) -> None:
        sent_at = time.monotonic()
        try:
            reply = await link.health.Check(_CHECK, timeout=self.interval, metadata=self._metadata)
            failure = failure_of(None, reply.status)
        except grpc.RpcError as e:
            failure = failure_of(e.code())
        now = time.monotonic()
        starved = self._schedule.starved(now)
        v = self._schedule.answered(p, sent_at, failure, now)
        if v is not None:
            self._record(v)
        if failure is not None or starved:
            self._kick()   # a re-probe is due at once, or a slot came free for the polls waiting

    async def _refusals(self, p: Probe, link: _Link) -> None:
        try:
            reply = await link.worker.Refusals(pb.RefusalsRequest(), metadata=self._metadata,
                                               timeout=max(self.refusals_seconds, self.interval))
            self._emit_refusals(p.worker_id, reply)
        except grpc.RpcError:
            pass   # no answer this time: its counts come with a later report
        finally:
            self._schedule.refusals_answered(p.worker_id, p.ticket, time.monotonic())

    def _record(self, v: Verdict) -> None:
        if v.kind == "suspect":
            if self.events is not None:
                self.events.emit("worker_suspect", worker=v.worker_id, silent_seconds=v.silent)
            return
        # Dead: the schedule forgot it already; no longer probed, asked or watched.
        self._drop(v.worker_id)
        self._death.set()
        self._death = asyncio.Event()
        self.on_dead(v.worker_id, f"no health answer for {v.silent:.2f} s and {self.retries} re-probes "
                                  f"({v.failure})", v.cause)

    async def _confirm(self, worker_id: str, timeout: float) -> bool:
        """``is_alive`` on the loop: True once a Check answers SERVING; False if none of ``retries + 1`` does."""
        for attempt in range(self.retries + 1):
            if attempt:
                death = self._death
                try:
                    await asyncio.wait_for(death.wait(), self.interval / 2)
                except TimeoutError:
                    pass
            link = self._links.get(worker_id)
            if link is None:   # unwatched, or declared dead by the loop (its link dropped)
                return False
            try:
                reply = await link.health.Check(_CHECK, timeout=timeout, metadata=self._metadata)
                if reply.status == _SERVING:
                    return True
            except grpc.RpcError:
                pass
            except asyncio.CancelledError:
                if self._links.get(worker_id) is not link:   # unwatched meanwhile: its channel closed
                    return False
                raise
        return False

    async def _collect(self, timeout: float, out: list) -> None:
        """``collect_refusals`` on the loop: one ``Refusals`` call to every watched worker, at once."""
        async def ask(worker_id: str, link: _Link) -> None:
            try:
                reply = await link.worker.Refusals(pb.RefusalsRequest(), timeout=timeout, metadata=self._metadata)
            except (grpc.RpcError, asyncio.CancelledError):
                return   # no answer (or unwatched meanwhile): the health checks deal with that worker
            out.extend(self._emit_refusals(worker_id, reply))

        await asyncio.gather(*(ask(w, link) for w, link in list(self._links.items())))

    def _emit_refusals(self, worker_id: str, reply: pb.RefusalsReply) -> list[dict]:
        events = []
        for r in reply.refusals:
            fields = dict(worker=worker_id, method=r.method, peer=r.peer, count=r.count, reason=r.reason)
            events.append(self.events.emit("security_refused", **fields) if self.events is not None
                          else {"kind": "security_refused", **fields})
        return events
