"""The health monitor's schedule: who is probed when, and what an answer means. Pure: no I/O, no clock.

:class:`runtime.control.health.HealthMonitor` owns one :class:`Schedule` and does
the calls; every method here takes the time as an argument, so the rules
(polls spread over one period, a worker that answers polled every ``period``
and one whose probe failed every ``interval``, a broken stream probed at
once, at most ``max_in_flight`` calls out with re-probes first, suspicion
after half the lease, ``retries + 1`` re-probes before death) are tested
without threads or sleeps.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import zlib


__all__ = ["cause_of", "is_suspect", "MAX_IN_FLIGHT", "Probe", "reprobe_wait", "Schedule", "Verdict", "wait_seconds"]


_CAUSES = {"refused": "crash", "silent": "hang", "not_serving": "fenced"}


def is_suspect(now: float, last_ok: float, lease: float, failure: str) -> bool:
    """Whether a failed health probe makes a worker suspect.

    ``failure`` is how the probe failed: ``"refused"`` (the process is gone:
    suspect at once), ``"not_serving"`` (it fenced itself: at once) or
    ``"silent"`` (no answer: suspect once silent for half the ``lease``, so
    the re-probes that confirm it fill the other half and a hung worker is
    declared dead about when its lease ends).
    """
    return failure != "silent" or now - last_ok >= lease / 2


def reprobe_wait(lease: float, retries: int, probe_timeout: float) -> float:
    """Seconds between the ``retries`` re-probes of a suspect, spreading them over the second half of the lease."""
    return max(lease / 2 - (retries + 1) * probe_timeout, 0.0) / max(retries, 1)


def cause_of(failure: str) -> str:
    """The recorded cause of a death, from how its last probe failed: crash, hang or fenced."""
    return _CAUSES.get(failure, "unresponsive")


MAX_IN_FLIGHT = 16        # calls out at once (see runtime.control.health and Schedule)


@dataclasses.dataclass(frozen=True)
class Probe:
    """One call to send: a Check, whose ``kind`` is "poll" (every ``interval``), "urgent" (its stream broke)
    or "reprobe"; or ``kind`` "refusals": a ``Refusals`` ask."""

    worker_id: str
    kind: str
    ticket: int    # which watch of ``worker_id`` it belongs to (an answer for an earlier one is ignored)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What an answer means: ``"suspect"`` (record it, re-probes follow) or ``"dead"`` (declare it)."""

    kind: str
    worker_id: str
    silent: float            # seconds without an answer when it became suspect
    failure: str             # how the probe that made it suspect failed
    cause: str = ""          # "dead" only: crash, hang or fenced


class _Slots:
    """At most ``size`` calls out at once; a call gives its slot back when it ends, or ``hold`` seconds after
    it was sent, whichever comes first (a call to a hung worker then no longer holds up the others)."""

    def __init__(self, size: int, hold: float):
        self.size, self.hold = max(1, size), hold
        self._held: dict[int, float] = {}              # call -> when it was sent
        self._order: collections.deque = collections.deque()   # (sent, call), oldest first

    def free(self, now: float) -> bool:
        while self._order and self._order[0][0] + self.hold <= now:
            self._held.pop(self._order.popleft()[1], None)
        return len(self._held) < self.size

    def take(self, call: int, now: float) -> None:
        self._held[call] = now
        self._order.append((now, call))

    def give(self, call: int) -> None:
        self._held.pop(call, None)

    def next_free(self, now: float) -> float:
        """When a slot is free next, as far as is known now (an answer can free one sooner)."""
        if self.free(now):
            return now
        while self._order[0][1] not in self._held:
            self._order.popleft()
        return self._order[0][0] + self.hold

    def __len__(self) -> int:
        return len(self._held)


class _Worker:
    __slots__ = ("ticket", "last_ok", "heard", "out", "urgent", "suspect", "pending", "refusals_due", "asking")

    def __init__(self, ticket: int, now: float, refusals_due: float):
        self.ticket = ticket
        self.last_ok = now
        self.heard = float("-inf")      # when the last request it answered otherwise was sent (see Schedule.heard)
        self.out = 0                    # the probe out (one at a time per worker; 0: none)
        self.urgent = False             # its stream broke while a probe was out: probe again at its answer
        self.suspect: list | None = None    # [failure, silent, probes left]
        self.pending = 0                # the heap entry of its next probe (0: none, one is out)
        self.refusals_due = refusals_due
        self.asking = 0                 # the Refusals call out (0: none)


class Schedule:
    """Who is probed when, and what each answer means: the health monitor's decisions, without any I/O.

    Time is passed in (``now``), nothing here reads a clock or a socket.
    Each watched worker that answers is polled every ``period`` seconds
    (default: ``interval``), counted from when its last poll was sent (the
    first one at a fixed fraction of the period after :meth:`add`, by worker
    id, so a fleet added at once is not polled in one burst); one whose
    probe failed without making it suspect (silent for less than half the
    lease) is polled again ``interval`` after that probe: while in doubt, at
    the probe rate. :meth:`due` hands out the calls to send now,
    one probe per worker at a time and at most ``max_in_flight`` calls out:
    re-probes and probes of a broken stream (:meth:`broke`) first, then
    polls, then ``Refusals`` asks (a host that cannot keep up with the
    polls keeps the leases first; the refused calls are counted on the
    workers until they are asked). A call out for
    longer than ``slot_seconds`` no longer holds its slot (a hung worker
    does not hold up the others); unless ``slot_seconds`` is given, it
    follows the answers: four times their recent mean latency, between
    ``interval / 16`` and ``interval``, so that on a loaded host, where
    every answer is slow, a slow call keeps its slot and the load does not
    grow. When the slots cannot keep up, every worker's period stretches
    alike. :meth:`answered` turns each answer into ``None`` or a
    :class:`Verdict`:

    - an answer renews the worker's lease (``last_ok``: when that probe was sent)
      and its next poll comes ``period`` after that probe;
    - a failed probe makes it suspect when :func:`is_suspect`
      says so, and then it is re-probed ``retries + 1`` times,
      :func:`reprobe_wait` apart, the first at once;
    - a suspect that answers one of them is no longer suspect; one that
      answers none is dead (and forgotten).

    A worker's answer to another call (a training step's, :meth:`heard`)
    renews its lease as a poll's answer would, and a poll that comes due
    within ``period`` of that call is not sent but planned ``period`` after
    it: while a worker answers steps, it is not polled.

    ``Refusals`` asks (calls of kind "refusals", answered through
    :meth:`refusals_answered`) come every ``refusals_seconds`` per worker,
    spread the same way.
    """

    def __init__(self, interval: float, lease: float, retries: int, max_in_flight: int = MAX_IN_FLIGHT,
                 refusals_seconds: float = 5.0, slot_seconds: float | None = None, period: float | None = None):
        self.interval, self.lease, self.retries = interval, lease, retries
        self.period = interval if period is None else period
        self.refusals_seconds = refusals_seconds
        self._adaptive = slot_seconds is None
        hold = interval / 4 if slot_seconds is None else slot_seconds
        self._slots = _Slots(max_in_flight, hold)
        self._latency: float | None = None                 # recent mean seconds from a probe to its answer
        self._workers: dict[str, _Worker] = {}
        self._tickets = itertools.count(1)
        self._seq = itertools.count(1)
        self._polls: list[tuple[float, int, str]] = []     # (due, entry, worker); stale entries are skipped
        self._first: list[tuple[float, int, str]] = []     # re-probes and probes of a broken stream
        self._refusals: list[tuple[float, int, str]] = []  # (due, ticket, worker)
        self.in_flight = 0                                 # probes out
        self.asking = 0                                    # Refusals calls out

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    @staticmethod
    def spread(worker_id: str) -> float:
        """A fixed fraction in [0, 1) per worker id: where in each period its calls fall."""
        return (zlib.crc32(worker_id.encode()) & 0xFFFF) / 0x10000

    def add(self, worker_id: str, now: float) -> int:
        """Starts watching ``worker_id`` (again, if it was: a new ticket); returns its ticket."""
        self.remove(worker_id)
        ticket = next(self._tickets)
        f = self.spread(worker_id)
        w = self._workers[worker_id] = _Worker(ticket, now, now + self.refusals_seconds * (0.5 + f))
        self._plan(w, worker_id, now + self.period * f, first=False)
        heapq.heappush(self._refusals, (w.refusals_due, ticket, worker_id))
        return ticket

    def remove(self, worker_id: str) -> None:
        """Forgets ``worker_id``; answers for it that come later are ignored."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return
        if w.out:
            self._slots.give(w.out)
            self.in_flight -= 1
        if w.asking:
            self._slots.give(w.asking)
            self.asking -= 1

    def ticket(self, worker_id: str) -> int | None:
        """The ticket of the current watch of ``worker_id`` (None: not watched)."""
        w = self._workers.get(worker_id)
        return None if w is None else w.ticket

    def suspects(self) -> list[str]:
        return sorted(wid for wid, w in self._workers.items() if w.suspect is not None)

    def _plan(self, w: _Worker, worker_id: str, at: float, first: bool) -> None:
        """Schedules the worker's next probe (replacing the one it had)."""
        w.pending = next(self._seq)
        heapq.heappush(self._first if first else self._polls, (at, w.pending, worker_id))

    def _head(self, heap: list) -> tuple[float, int, str] | None:
        """The heap's first entry that is still a worker's next probe (stale ones are dropped)."""
        while heap:
            w = self._workers.get(heap[0][2])
            if w is not None and w.pending == heap[0][1]:
                return heap[0]
            heapq.heappop(heap)
        return None

    def broke(self, worker_id: str, now: float) -> None:
        """Its Watch stream ended (not by its deadline): probe it now, ahead of the poll."""
        w = self._workers.get(worker_id)
        if w is None or w.suspect is not None:
            return   # not watched, or already being re-probed
        if w.out:
            w.urgent = True
        else:
            self._plan(w, worker_id, now, first=True)

    def due(self, now: float) -> list[Probe]:
        """The calls to send now, while a slot is free (each out until answered): re-probes and probes of a
        broken stream first, then polls, then ``Refusals`` asks."""
        out = []
        while self._slots.free(now):
            first, poll, ask = self._head(self._first), self._head(self._polls), self._ask_head()
            if first is not None and first[0] <= now:
                heapq.heappop(self._first)
                self._slots.take(first[1], now)
                out.append(self._send(first, "reprobe" if self._workers[first[2]].suspect is not None else "urgent"))
            elif ask is not None and ask[0] <= now and (poll is None or poll[0] > now):
                heapq.heappop(self._refusals)
                w = self._workers[ask[2]]
                w.asking = next(self._seq)
                self._slots.take(w.asking, now)
                self.asking += 1
                out.append(Probe(ask[2], "refusals", ask[1]))
            elif poll is not None and poll[0] <= now:
                heapq.heappop(self._polls)
                w = self._workers[poll[2]]
                if w.heard + self.period > poll[0]:   # it answered a step since that poll was planned: not due yet
                    self._plan(w, poll[2], w.heard + self.period, first=False)
                    continue
                self._slots.take(poll[1], now)
                out.append(self._send(poll, "poll"))
            else:
                break
        return out

    def _ask_head(self) -> tuple[float, int, str] | None:
        """The first ``Refusals`` ask due that is still wanted (stale ones are dropped)."""
        while self._refusals:
            w = self._workers.get(self._refusals[0][2])
            if w is not None and w.ticket == self._refusals[0][1] and not w.asking:
                return self._refusals[0]
            heapq.heappop(self._refusals)
        return None

    def _send(self, entry: tuple[float, int, str], kind: str) -> Probe:
        w = self._workers[entry[2]]
        w.pending, w.out = 0, entry[1]
        self.in_flight += 1
        return Probe(entry[2], kind, w.ticket)

    def heard(self, worker_id: str, sent_at: float) -> None:
        """``worker_id`` answered a request sent at ``sent_at`` that was not a probe (a training step): that
        renews its lease as a probe's answer would, and its next poll waits until ``period`` after it."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        w.heard = max(w.heard, sent_at)
        w.last_ok = max(w.last_ok, sent_at)

    def last_ok(self, worker_id: str) -> float | None:
        """When the last request ``worker_id`` answered was sent (a probe or a step); None when not watched."""
        w = self._workers.get(worker_id)
        return None if w is None else w.last_ok

    def starved(self, now: float) -> bool:
        """Every poll slot is taken: the next poll waits for an answer (or for a slot to time out)."""
        return not self._slots.free(now)

    def next_due(self, now: float) -> float | None:
        """When :meth:`due` has something next, as far as is known now (None: nothing scheduled)."""
        due = [e[0] for e in (self._head(self._first), self._head(self._polls), self._ask_head()) if e is not None]
        return max(min(due), self._slots.next_free(now)) if due else None

    def answered(self, probe: Probe, sent_at: float, failure: str | None, now: float) -> Verdict | None:
        """What the answer to ``probe`` (sent at ``sent_at``, failed as ``failure``, None if it answered) means."""
        w = self._workers.get(probe.worker_id)
        if w is None or w.ticket != probe.ticket or not w.out:
            return None
        self._slots.give(w.out)
        w.out = 0
        self.in_flight -= 1
        if failure != "silent":
            self._observe(now - sent_at)
        if failure is None:
            w.last_ok = max(w.last_ok, sent_at)
            w.suspect = None
        elif w.suspect is not None:
            w.suspect[2] -= 1
            if w.suspect[2] <= 0:
                failure0, silent, _ = w.suspect
                self.remove(probe.worker_id)
                return Verdict("dead", probe.worker_id, silent, failure0, cause_of(failure0))
            self._plan(w, probe.worker_id, now + reprobe_wait(self.lease, self.retries, self.interval), first=True)
            return None
        elif is_suspect(sent_at, w.last_ok, self.lease, failure):
            w.suspect = [failure, sent_at - w.last_ok, self.retries + 1]
            w.urgent = False
            self._plan(w, probe.worker_id, now, first=True)
            return Verdict("suspect", probe.worker_id, sent_at - w.last_ok, failure)
        if w.urgent:
            w.urgent = False
            self._plan(w, probe.worker_id, now, first=True)
        else:
            gap = self.period if failure is None else self.interval
            self._plan(w, probe.worker_id, max(sent_at + gap, now), first=False)
        return None

    def _observe(self, latency: float) -> None:
        """One answer's latency: the slots' hold follows their recent mean (see the class docstring)."""
        self._latency = latency if self._latency is None else 0.9 * self._latency + 0.1 * latency
        if self._adaptive:
            hold = min(max(4 * self._latency, self.interval / 16), self.interval)
            self._slots.hold = hold

    @property
    def slot_seconds(self) -> float:
        """How long a call out holds its slot now."""
        return self._slots.hold

    def refusals_answered(self, worker_id: str, ticket: int, now: float) -> None:
        """A ``Refusals`` call ended (answered or not): the next one is due ``refusals_seconds`` later."""
        w = self._workers.get(worker_id)
        if w is None or w.ticket != ticket or not w.asking:
            return
        self._slots.give(w.asking)
        w.asking = 0
        self.asking -= 1
        w.refusals_due = max(w.refusals_due + self.refusals_seconds, now)
        heapq.heappush(self._refusals, (w.refusals_due, ticket, worker_id))


def wait_seconds(due: list[float], out: int, last: float, tick: float, now: float) -> float | None:
    """How long the monitor's thread may sleep (None: until woken) before its next turn. Pure.

    ``due``: when the schedule has something to send next; ``out``: calls
    whose answers it has not taken in yet; ``last``: when its last turn
    was. It sends what is due up to half a tick early, takes turns at most
    every ``tick`` (answers wait for the next one, unless they wake it),
    and with nothing due but calls out, looks at their answers every tick.
    """
    if due:
        return max(min(due) - tick / 2, last + tick) - now
    return tick if out else None


# -- the monitor: the schedule's I/O ------------------------------------------------
