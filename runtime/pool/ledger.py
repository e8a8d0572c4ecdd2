"""The pool's book of hosts, runs and leases, and every decision about them: pure, rebuilt from its own events.

Contract: the pool's state changes only by :meth:`Ledger.apply` of a pool event
(``pool_*`` kinds of :data:`runtime.core.event_kinds.EVENT_KINDS`). Every
decision is a method that reads the state and a time passed in and answers the
events it decided (:meth:`Ledger.host_polled`, :meth:`Ledger.run_polled`,
:meth:`Ledger.schedule`); the caller (:mod:`runtime.pool.service`) writes them
to the pool's event log and applies them, so a restarted pool that folds its
log (:meth:`Ledger.replay`) stands where the old one stood: the same hosts, the
same leases. What is not an event is not kept across a restart, on purpose:
when each host and client was last heard (a restarted pool gives each a fresh
``silent`` window) and the runs' secrets and addresses (each client's next poll
brings them again; a grant waits for it). A host the log knows is ``unheard``
until it polls the restarted pool: it may have left while the pool was down
(one started by hand, say), so it is neither free nor counted among the
pool's hosts, and is granted nothing until it polls (or is lost once silent
past ``host_silent_seconds``).

Scheduling (:meth:`Ledger.schedule`), each time anything changed:

- a run's requests (``wanted`` worker ids) are served in priority order, then
  in the order the runs first asked; a run that holds fewer hosts than its
  ``min_hosts`` is granted that many at once or none (a gang: two runs never
  each hold half of what they need), and while it waits no run of a lower
  priority is granted a host that would fit it;
- hosts a run cannot get from the free ones it takes from runs of a lower
  priority that hold more than their ``min_hosts``: each is told to give back
  so many (``give_back``), the lowest priority first, then the latest started;
  the victim shrinks at its next step boundary and returns the host, which is
  wiped and then granted. Runs of equal priority never take from each other;
- a client silent past its grace is gone: its leases are reclaimed; a host
  silent past ``host_silent_seconds`` is lost (a free one is removed, a
  leased one ends its lease: its run sees the worker die).
"""

from __future__ import annotations

import dataclasses
import json

from runtime.core.platforms import canonical_platform

__all__ = ["HOST_SILENT_SECONDS", "Host", "Lease", "Ledger", "Run"]

#: A host that has not polled for this long is lost.
HOST_SILENT_SECONDS = 10.0


@dataclasses.dataclass
class Host:
    host_id: str
    devices: int
    platform: str
    address: str = ""
    pid: int = 0
    lease: str = ""          # the lease it serves or wipes ("": free)
    seen: float = 0.0        # for its timeout (a restarted pool counts from its start)
    heard: float | None = None   # when it last polled this pool process (None: not yet)


@dataclasses.dataclass
class Lease:
    lease_id: str
    run_id: str
    worker_id: str
    host_id: str
    granted: float
    state: str = "granted"   # granted (the agent has not taken it yet), serving, reclaimed (being stopped and wiped)
    why: str = ""            # why it was reclaimed


@dataclasses.dataclass
class Run:
    run_id: str
    tenant: str
    priority: int
    min_hosts: int
    devices: int
    platform: str
    name: str
    asked: float             # when it first asked (its place in the queue among equals)
    seen: float = 0.0
    grace: float = 120.0
    wanted: tuple[str, ...] = ()   # worker ids asked for and not granted
    give_back: int = 0       # hosts it was asked to return and has not yet
    started: float | None = None   # when it first held its min_hosts
    order: dict = dataclasses.field(default_factory=dict)   # controller, secret, ... (from its last poll; never logged)
    ended_workers: dict = dataclasses.field(default_factory=dict)   # worker -> exit status, ended before registering
    queued_since: float | None = None


class Ledger:
    """The pool's state: hosts, runs, leases (see the module's contract)."""

    def __init__(self, host_silent_seconds: float = HOST_SILENT_SECONDS):
        self.hosts: dict[str, Host] = {}
        self.runs: dict[str, Run] = {}
        self.leases: dict[str, Lease] = {}
        self._of_run: dict[str, dict[str, Lease]] = {}   # run -> worker -> its lease (an index of ``leases``)
        self.refused: dict[str, int] = {}   # why -> calls refused
        self.lease_seq = 0
        self.host_silent_seconds = host_silent_seconds
        self.stale: dict[str, str] = {}     # host -> a lease it still serves that had ended here (it is told to stop)

    # -- folding --------------------------------------------------------------

    @classmethod
    def replay(cls, events, now: float, **kw) -> "Ledger":
        """The ledger a pool's log leaves (hosts and clients counted as heard ``now``)."""
        ledger = cls(**kw)
        for e in events:
            if e.get("kind", "").startswith("pool_"):
                ledger.apply(e)
        for h in ledger.hosts.values():
            h.seen = now
        for r in ledger.runs.values():
            r.seen = now
        return ledger

    def apply(self, e: dict) -> None:
        """One pool event, as decided (or read back from the log)."""
        kind, t = e["kind"], e.get("t", 0.0)
        if kind == "pool_host_joined":
            old = self.hosts.get(e["host"])
            self.hosts[e["host"]] = Host(e["host"], e["devices"], e["platform"], e.get("address", ""),
                                         e.get("pid", 0), old.lease if old else "", t)
        elif kind == "pool_host_lost":
            self.hosts.pop(e["host"], None)
        elif kind == "pool_run_joined":
            old = self.runs.get(e["run"])
            run = Run(e["run"], e["tenant"], e["priority"], e["min_hosts"], e["devices"], e.get("platform", ""),
                      e.get("name", ""), old.asked if old else t, t)
            if old is not None:
                run.started, run.give_back, run.queued_since = old.started, old.give_back, old.queued_since
                run.order, run.wanted = old.order, old.wanted
            run.grace = e.get("grace", Run.grace)   # (a restarted pool keeps waiting for a silent client this long)
            self.runs[e["run"]] = run
        elif kind == "pool_run_queued":
            if e["run"] in self.runs:
                self.runs[e["run"]].queued_since = t
        elif kind == "pool_run_ended":
            self.runs.pop(e["run"], None)
        elif kind == "pool_lease_granted":
            self.lease_seq = max(self.lease_seq, int(e["lease"].rsplit("-", 1)[-1]) + 1)
            lease = self.leases[e["lease"]] = Lease(e["lease"], e["run"], e["worker"], e["host"], t)
            self._of_run.setdefault(e["run"], {})[e["worker"]] = lease
            if e["host"] in self.hosts:
                self.hosts[e["host"]].lease = e["lease"]
            run = self.runs.get(e["run"])
            if run is not None:
                run.wanted = tuple(w for w in run.wanted if w != e["worker"])
                if run.started is None and len(self.held(run.run_id)) >= run.min_hosts:
                    run.started, run.queued_since = t, None
        elif kind == "pool_lease_serving":
            if e["lease"] in self.leases:
                self.leases[e["lease"]].state = "serving"
        elif kind == "pool_lease_reclaimed":
            lease = self.leases.get(e["lease"])
            if lease is not None:
                lease.state, lease.why = "reclaimed", e["why"]
                run = self.runs.get(lease.run_id)
                if run is not None and e["why"] in ("returned", "preempted") and run.give_back:
                    run.give_back -= 1
        elif kind == "pool_lease_ended":
            lease = self.leases.pop(e["lease"], None)
            if lease is not None:
                mine = self._of_run.get(lease.run_id, {})
                if mine.get(lease.worker_id) is lease:
                    del mine[lease.worker_id]
                    if not mine:
                        del self._of_run[lease.run_id]
                host = self.hosts.get(lease.host_id)
                if host is not None and host.lease == lease.lease_id:
                    host.lease = ""
                run = self.runs.get(lease.run_id)
                if run is not None and lease.state != "reclaimed":   # it ended by itself: the client should know
                    run.ended_workers[lease.worker_id] = e["exit_code"]
            if not e.get("wiped", True) and e.get("host") in self.hosts:   # a host that could not wipe serves no one
                self.hosts.pop(e["host"])
        elif kind == "pool_give_back":
            if e["run"] in self.runs:
                self.runs[e["run"]].give_back = max(self.runs[e["run"]].give_back + e["count"], 0)
        elif kind == "pool_calls_refused":
            self.refused[e["reason"]] = self.refused.get(e["reason"], 0) + e["count"]

    # -- what is known ---------------------------------------------------------

    def held(self, run_id: str) -> list[Lease]:
        """The leases a run holds (granted or serving; not those being reclaimed)."""
        return [x for x in self._of_run.get(run_id, {}).values() if x.state != "reclaimed"]

    def free_hosts(self) -> list[Host]:
        """The hosts a run may be granted: free, and heard by this pool process (see the module's contract)."""
        return sorted((h for h in self.hosts.values()
                       if not h.lease and h.host_id not in self.stale and h.heard is not None),
                      key=lambda h: h.host_id)

    def heard_hosts(self) -> int:
        """How many hosts have polled this pool process: the pool's hosts (a restarted pool's others may be gone)."""
        return sum(1 for h in self.hosts.values() if h.heard is not None)

    def queue(self) -> list[Run]:
        """The runs waiting for hosts, in the order they are served."""
        return sorted((r for r in self.runs.values() if r.wanted), key=lambda r: (-r.priority, r.asked, r.run_id))

    def next_lease_id(self) -> str:
        return f"lease-{self.lease_seq}"

    # -- decisions (each answers the events it decided) -------------------------

    def host_polled(self, poll, now: float) -> list[dict]:
        """A host's poll: it joins (or joins again, after either side restarted), and reports what it serves
        and what ended."""
        events = []
        host = self.hosts.get(poll.host_id)
        if host is None or (host.devices, host.platform, host.pid) != (poll.devices, poll.platform, poll.pid):
            events.append(dict(kind="pool_host_joined", host=poll.host_id, devices=poll.devices,
                               platform=poll.platform, address=poll.address, pid=poll.pid))
        for ended in poll.ended:
            if ended.lease_id in self.leases:
                events.append(dict(kind="pool_lease_ended", lease=ended.lease_id, host=poll.host_id,
                                   exit_code=ended.exit_code, wiped=ended.wiped, leftovers=list(ended.leftovers)))
        ending = {x.lease_id for x in poll.ended}
        current = host.lease if host is not None else ""
        if current and current not in ending and poll.lease_id != current:
            lease = self.leases.get(current)
            if lease is not None and lease.state != "granted":   # it served it, and now does not: the agent restarted
                events.append(dict(kind="pool_lease_ended", lease=current, host=poll.host_id, exit_code=-1,
                                   wiped=True, leftovers=[]))
        if poll.lease_id and poll.lease_id in self.leases and self.leases[poll.lease_id].state == "granted":
            events.append(dict(kind="pool_lease_serving", lease=poll.lease_id))
        if poll.lease_id and poll.lease_id not in self.leases:   # ended here (the host was lost): it stops it first
            self.stale[poll.host_id] = poll.lease_id
        else:
            self.stale.pop(poll.host_id, None)
        for ended in poll.ended:
            if not ended.wiped:   # it could not wipe: it leaves (and its agent exits)
                events.append(dict(kind="pool_host_lost", host=poll.host_id,
                                   reason=f"could not wipe {ended.lease_id}: {', '.join(ended.leftovers)} left"))
        return events

    def host_orders(self, host_id: str) -> tuple[Lease | None, str]:
        """What a host is told now: the lease to start (granted, not yet taken), or the lease to reclaim."""
        if host_id in self.stale:
            return None, self.stale[host_id]
        host = self.hosts.get(host_id)
        lease = self.leases.get(host.lease) if host is not None and host.lease else None
        if lease is None:
            return None, ""
        if lease.state == "granted":
            return lease, ""
        if lease.state == "reclaimed":
            return None, lease.lease_id
        return None, ""

    def run_polled(self, poll, tenant: str, now: float) -> list[dict]:
        """A client's poll: it joins (or joins again), returns what it gives back, asks for what it wants."""
        events = []
        run = self.runs.get(poll.run_id)
        grace = poll.grace_seconds or (run.grace if run is not None else Run.grace)
        fields = dict(run=poll.run_id, tenant=tenant, priority=poll.priority, min_hosts=max(poll.min_hosts, 1),
                      devices=poll.devices, platform=poll.platform, name=poll.run_name, grace=grace)
        if run is None or any(getattr(run, k) != fields[k] for k in
                              ("tenant", "priority", "min_hosts", "devices", "grace")):
            events.append(dict(kind="pool_run_joined", **fields))
        mine = self._of_run.get(poll.run_id, {})
        gone = set(poll.returned) | (set(mine) if poll.done else set())
        for w in sorted(gone):
            if w in mine and mine[w].state != "reclaimed":
                events.append(dict(kind="pool_lease_reclaimed", lease=mine[w].lease_id,
                                   why="run ended" if poll.done else "returned"))
        if poll.done:
            events.append(dict(kind="pool_run_ended", run=poll.run_id, reason="finished"))
        return events

    def take_order(self, poll, now: float) -> bool:
        """What the client's poll says that is not an event: its address and secret, its requests, when heard.
        Answers whether that changes what may be decided (its requests, or its address first known)."""
        run = self.runs.get(poll.run_id)
        if run is None:
            return False
        before = (run.wanted, bool(run.order))
        run.seen = now
        run.order = dict(controller=poll.controller, secret=poll.run_secret, snapshot=poll.snapshot_directory,
                         chaos=poll.chaos, platform=poll.platform, cache=poll.compilation_cache_dir)
        mine = self._of_run.get(poll.run_id, {})
        run.wanted = tuple(w for w in poll.wanted if w not in mine and w not in run.ended_workers)
        named = set(poll.held) | set(poll.wanted)
        for w in [w for w in run.ended_workers if w not in named]:   # the client knows: it names it no more
            del run.ended_workers[w]
        return (run.wanted, True) != before

    def host_heard(self, host_id: str, now: float) -> bool:
        """A host polled at ``now``; answers whether that is its first poll of this pool process (a free host
        becomes grantable then: the caller decides)."""
        host = self.hosts.get(host_id)
        if host is None:
            return False
        first = host.heard is None
        host.seen = host.heard = now
        return first

    def schedule(self, now: float) -> list[dict]:
        """Timeouts, grants and give-backs, decided from the state as it stands (see the module's contract).
        Call :meth:`apply` on each event answered, in order; then call again until it answers none."""
        for h in sorted(self.hosts.values(), key=lambda h: h.host_id):
            if now - h.seen > self.host_silent_seconds:
                events = []
                if h.lease and h.lease in self.leases:
                    events.append(dict(kind="pool_lease_ended", lease=h.lease, host=h.host_id, exit_code=-1,
                                       wiped=True, leftovers=[]))
                return events + [dict(kind="pool_host_lost", host=h.host_id,
                                      reason=f"silent for {now - h.seen:.0f} s")]
        for r in sorted(self.runs.values(), key=lambda r: r.run_id):
            if now - r.seen > r.grace:
                return [dict(kind="pool_lease_reclaimed", lease=x.lease_id, why="client gone")
                        for x in self.held(r.run_id)] + \
                       [dict(kind="pool_run_ended", run=r.run_id, reason=f"client silent for {now - r.seen:.0f} s "
                                                                          f"(its grace is {r.grace:g} s)")]
        for r in sorted(self.runs.values(), key=lambda r: r.run_id):
            if r.give_back and not any(q.wanted and q.priority > r.priority for q in self.runs.values()):
                return [dict(kind="pool_give_back", run=r.run_id, count=-r.give_back, for_run="")]   # no one waits
        free = self.free_hosts()
        blocked: set[str] = set()   # hosts held for a run that waits for a gang
        for run in self.queue():
            if not run.order:   # a restarted pool: wait for the client's next poll (its address and secret)
                continue
            fits = [h for h in free if h.host_id not in blocked and _fits(h, run)]
            held = len(self.held(run.run_id))
            gang = max(run.min_hosts - held, 0)
            if gang > len(run.wanted):   # it has not asked for its whole minimum yet (its next poll will)
                continue
            if fits and len(fits) >= gang:
                take = fits[:len(run.wanted)]
                return [dict(kind="pool_lease_granted", lease=f"lease-{self.lease_seq + k}", run=run.run_id,
                             worker=w, host=h.host_id) for k, (w, h) in enumerate(zip(run.wanted, take))]
            if run.queued_since is None and held < run.min_hosts:
                return [dict(kind="pool_run_queued", run=run.run_id, hosts=gang, free=len(fits))]
            missing = len(run.wanted) - len(fits) - self._incoming(run)   # all it asks for, at once
            if missing > 0:
                victims = self._victims(run)
                if victims:
                    victim, surplus = victims[0]
                    return [dict(kind="pool_give_back", run=victim.run_id, count=min(surplus, missing),
                                 for_run=run.run_id)]
            if gang:
                blocked |= {h.host_id for h in fits}   # a gang waits: lower priorities may not take these
        return []

    def _incoming(self, run: Run) -> int:
        """Hosts on their way to the free list that ``run`` would get first: being wiped, or asked back from
        runs of a lower priority."""
        wiping = sum(1 for x in self.leases.values() if x.state == "reclaimed" and _fits(self.hosts.get(x.host_id), run))
        asked = sum(r.give_back for r in self.runs.values() if r.priority < run.priority)
        return wiping + asked

    def _victims(self, run: Run) -> list[tuple[Run, int]]:
        """The runs ``run`` may take hosts from, with how many each can spare: a lower priority, holding more
        than its minimum; the lowest priority first, then the latest started."""
        out = []
        for r in self.runs.values():
            if r.priority >= run.priority:
                continue
            surplus = sum(1 for x in self.held(r.run_id) if _fits(self.hosts.get(x.host_id), run)) \
                - r.min_hosts - r.give_back
            if surplus > 0:
                out.append((r, surplus))
        out.sort(key=lambda v: (v[0].priority, -(v[0].started or 0.0), v[0].run_id))
        return out

    # -- what is shown ---------------------------------------------------------

    def run_status(self, run_id: str, now: float) -> str:
        """One line: where a run stands (naming only runs of its own client: others are counted)."""
        run = self.runs.get(run_id)
        if run is None:
            return "not known to the pool"
        held, free, hosts = len(self.held(run_id)), len(self.free_hosts()), self.heard_hosts()
        if not run.wanted:
            return f"holds {held} host(s); {free} of {hosts} free in the pool"
        queue = self.queue()
        ahead = [r for r in queue[:queue.index(run)]]
        waiting = f" for {max(now - run.queued_since, 0.0):.0f} s" if run.queued_since is not None else ""
        own = [f"{r.run_id} (priority {r.priority})" for r in ahead if r.tenant == run.tenant]
        others = len(ahead) - len(own)
        names = own + ([f"{others} run(s) of other clients"] if others else [])
        why = f"behind {', '.join(names)}" if ahead else f"{free} of {hosts} host(s) free"
        if self.hosts and not any(_fits(h, run) for h in self.hosts.values()):
            kinds = sorted({f"{h.devices} {h.platform}" for h in self.hosts.values()})
            why += (f"; no host of the pool fits it: its slices need {run.devices} {run.platform or 'any'} "
                    f"device(s), the pool's hosts have {', '.join(kinds)}")
        return (f"queued{waiting}: {len(run.wanted)} host(s) asked, {held} held (minimum {run.min_hosts}); "
                f"place {queue.index(run) + 1} in the queue, {why}")

    def status(self, now: float, tenant: str | None = None) -> dict:
        """Everything, or (``tenant``) that client's runs and the pool's free capacity only."""
        runs = [r for r in self.runs.values() if tenant is None or r.tenant == tenant]
        queue = [r.run_id for r in self.queue() if tenant is None or r.tenant == tenant]
        out = {"hosts": self.heard_hosts(), "free": len(self.free_hosts()),
               "free_devices": sum(h.devices for h in self.free_hosts()),
               "runs": [{"run": r.run_id, "name": r.name, "priority": r.priority, "min_hosts": r.min_hosts,
                         "held": sorted(x.worker_id for x in self.held(r.run_id)),
                         "hosts": sorted(x.host_id for x in self.held(r.run_id)),
                         "wanted": len(r.wanted), "give_back": r.give_back,
                         "waiting_since": r.queued_since, "status": self.run_status(r.run_id, now),
                         **({"tenant": r.tenant} if tenant is None else {})}
                        for r in sorted(runs, key=lambda r: r.run_id)],
               "queue": queue}
        if tenant is None:
            out["workers"] = [{"host": h.host_id, "devices": h.devices, "platform": h.platform,
                               "address": h.address, "state": self._host_state(h),
                               "heard_seconds": None if h.heard is None else round(max(now - h.heard, 0.0), 3),
                               **self._lease_of(h)} for h in sorted(self.hosts.values(), key=lambda h: h.host_id)]
            out["leases"] = sorted(({"lease": x.lease_id, "run": x.run_id, "worker": x.worker_id, "host": x.host_id,
                                     "state": x.state} for x in self.leases.values()), key=lambda x: x["lease"])
            out["refused"] = dict(self.refused)
            out["unheard"] = len(self.hosts) - out["hosts"]
        return out

    def _host_state(self, h: Host) -> str:
        lease = self.leases.get(h.lease) if h.lease else None
        if lease is None:
            return "free" if h.heard is not None else "unheard"
        return "wiping" if lease.state == "reclaimed" else "leased"

    def _lease_of(self, h: Host) -> dict:
        lease = self.leases.get(h.lease) if h.lease else None
        return {"run": lease.run_id, "worker": lease.worker_id, "lease": lease.lease_id} if lease else {}


def _fits(host: Host | None, run: Run) -> bool:
    """A host a run's workers can use: its device count and platform (by ``jax.export``'s name: a ``gpu`` host serves a run
    exported for ``cuda``)."""
    return host is not None and host.devices == run.devices and \
        (not run.platform or _family(host.platform) == _family(run.platform))


def _family(platform: str) -> str:
    """A platform by ``jax.export``'s name (``gpu`` is ``cuda``); an unknown name as it is."""
    try:
        return canonical_platform(platform)
    except ValueError:
        return platform


def status_json(status: dict) -> str:
    return json.dumps(status, sort_keys=True)
