"""The pool's ledger (runtime/pool/ledger.py), driven as its service drives it, with the time passed in.

Each test feeds the ledger protobuf polls (hosts' ``HostPoll``, runs' clients'
``RunPoll``) and ticks, records every event it decides (checked against its
declared schema) and applies it, looping ``schedule`` until it decides nothing:
exactly :class:`runtime.pool.service.PoolService`'s order. What is proved:
grants (one run, runs sharing the hosts), gangs granted whole or not at all and
the hosts kept for them, the queue's order, give-backs (from whom, how many,
never from an equal priority nor below a run's minimum, counted down as hosts
come back), device counts that must match, clients and hosts gone silent, the
hosts' orders and their reports (serving, wiped, not wiped, restarted), a run
that is done, a log's replay standing where the live ledger stood, and what a
tenant's status shows.
"""

import pytest

from elastic.pool_commands import render
from runtime._proto import elastic_pb2 as pb
from runtime.core.event_kinds import check_event
from runtime.pool.ledger import HOST_SILENT_SECONDS, Ledger


class Pool:
    """A ledger and its log, driven as :class:`runtime.pool.service.PoolService` drives it."""

    def __init__(self, **kw):
        self.ledger = Ledger(**kw)
        self.log: list[dict] = []

    def record(self, events, now):
        for e in events:
            event = {"t": now, **e}
            check_event(event)   # every decision is an event its kind's schema allows
            assert event["kind"].startswith("pool_")
            self.log.append(event)
            self.ledger.apply(event)

    def decide(self, now) -> list[dict]:
        """``schedule`` until it decides nothing (the service's ``_decide``); answers what it decided."""
        decided = []
        for _ in range(1000):
            events = self.ledger.schedule(now)
            if not events:
                return decided
            self.record(events, now)
            decided += events
        raise AssertionError("the schedule did not settle")

    def host(self, host_id, now, *, devices=1, platform="cpu", lease_id="", ended=(), pid=100):
        """A host's poll (the service's ``Host``); answers its orders ``(lease to start, lease to reclaim)``."""
        poll = pb.HostPoll(host_id=host_id, devices=devices, platform=platform, lease_id=lease_id,
                           ended=list(ended), pid=pid, address=f"{host_id}.local")
        self.record(self.ledger.host_polled(poll, now), now)
        self.ledger.host_heard(host_id, now)
        self.decide(now)
        return self.ledger.host_orders(host_id)

    def run(self, run_id, now, *, tenant="alice", priority=0, min_hosts=1, devices=1, platform="", wanted=(),
            returned=(), held=(), done=False, grace=0.0, name=""):
        """A client's poll (the service's ``Run``); answers the events it and the schedule decided."""
        poll = pb.RunPoll(run_id=run_id, priority=priority, min_hosts=min_hosts, devices=devices,
                          controller=f"{run_id}.controller:5000", run_secret=f"secret-of-{run_id}",
                          snapshot_directory=f"/snapshots/{run_id}", platform=platform, grace_seconds=grace,
                          wanted=list(wanted), returned=list(returned), held=list(held), done=done, run_name=name)
        start = len(self.log)
        self.record(self.ledger.run_polled(poll, tenant, now), now)
        self.ledger.take_order(poll, now)
        self.decide(now)
        return self.log[start:]

    def tick(self, now) -> list[dict]:
        return self.decide(now)

    # -- reading it ---------------------------------------------------------------------------------------

    def held(self, run_id) -> dict[str, str]:
        """worker -> host of a run's leases (granted or serving)."""
        return {x.worker_id: x.host_id for x in self.ledger.held(run_id)}

    def lease_of(self, run_id, worker) -> str:
        [lease] = [x.lease_id for x in self.ledger.leases.values() if x.run_id == run_id and x.worker_id == worker]
        return lease

    def kinds(self, events=None) -> list[str]:
        return [e["kind"] for e in (self.log if events is None else events)]


def ended(lease, code=0, wiped=True, leftovers=()):
    return pb.HostEnded(lease_id=lease, exit_code=code, wiped=wiped, leftovers=list(leftovers))


def hosts(pool, names, now=0.0, **kw):
    for h in names:
        pool.host(h, now, **kw)


def grants(events):
    return [(e["run"], e["worker"], e["host"]) for e in events if e["kind"] == "pool_lease_granted"]


def give_backs(events):
    return [(e["run"], e["count"], e["for_run"]) for e in events if e["kind"] == "pool_give_back"]


def serve_all(pool, now):
    """Every host with a granted lease takes it (its next poll reports it)."""
    for h in list(pool.ledger.hosts.values()):
        lease, _ = pool.ledger.host_orders(h.host_id)
        if lease is not None:
            pool.host(h.host_id, now, devices=h.devices, platform=h.platform, lease_id=lease.lease_id, pid=h.pid)


# -- grants --------------------------------------------------------------------------------------------------

def test_a_run_is_granted_one_free_host_for_each_worker_it_wants():
    pool = Pool()
    hosts(pool, ["h0", "h1", "h2"])
    events = pool.run("A", 1.0, wanted=["w0", "w1"])
    assert pool.kinds(events) == ["pool_run_joined", "pool_lease_granted", "pool_lease_granted"]
    assert grants(events) == [("A", "w0", "h0"), ("A", "w1", "h1")]
    assert [e["lease"] for e in events[1:]] == ["lease-0", "lease-1"]
    assert pool.ledger.next_lease_id() == "lease-2"
    assert pool.ledger.runs["A"].wanted == () and pool.ledger.runs["A"].started == 1.0
    assert [h.host_id for h in pool.ledger.free_hosts()] == ["h2"]
    assert pool.ledger.run_status("A", 1.0) == "holds 2 host(s); 1 of 3 free in the pool"
    # the same poll again changes nothing: the run does not join again, nothing more is granted
    assert pool.run("A", 2.0, wanted=[], held=["w0", "w1"]) == []


def test_a_run_wanting_more_than_is_free_gets_what_is_free_and_the_rest_as_hosts_join():
    pool = Pool()
    hosts(pool, ["h0"])
    assert grants(pool.run("A", 1.0, wanted=["w0", "w1", "w2"])) == [("A", "w0", "h0")]
    assert pool.ledger.runs["A"].wanted == ("w1", "w2")
    assert pool.ledger.queue() == [pool.ledger.runs["A"]]
    pool.host("h1", 2.0)
    assert pool.held("A") == {"w0": "h0", "w1": "h1"}
    assert pool.ledger.runs["A"].wanted == ("w2",)
    pool.host("h2", 3.0)
    assert pool.held("A") == {"w0": "h0", "w1": "h1", "w2": "h2"}
    assert pool.ledger.queue() == []


def test_two_runs_share_the_hosts_each_on_hosts_of_its_own():
    pool = Pool()
    hosts(pool, ["h0", "h1", "h2", "h3"])
    pool.run("A", 1.0, wanted=["w0", "w1"])
    pool.run("B", 2.0, tenant="bob", wanted=["v0", "v1"])
    assert pool.held("A") == {"w0": "h0", "w1": "h1"}
    assert pool.held("B") == {"v0": "h2", "v1": "h3"}
    assert pool.ledger.free_hosts() == []
    status = pool.ledger.status(2.0)
    assert [(r["run"], r["tenant"], r["held"], r["hosts"]) for r in status["runs"]] == [
        ("A", "alice", ["w0", "w1"], ["h0", "h1"]), ("B", "bob", ["v0", "v1"], ["h2", "h3"])]
    assert [(w["host"], w["state"], w["run"], w["worker"]) for w in status["workers"]] == [
        ("h0", "leased", "A", "w0"), ("h1", "leased", "A", "w1"), ("h2", "leased", "B", "v0"),
        ("h3", "leased", "B", "v1")]
    # a third run finds nothing free and waits
    pool.run("C", 3.0, wanted=["x0"])
    assert pool.held("C") == {} and pool.ledger.runs["C"].wanted == ("x0",)


# -- gangs ---------------------------------------------------------------------------------------------------

def test_a_run_below_its_minimum_is_granted_its_minimum_at_once_or_nothing():
    pool = Pool()
    hosts(pool, ["h0"])
    events = pool.run("A", 1.0, min_hosts=3, wanted=["w0", "w1", "w2"])
    assert pool.kinds(events) == ["pool_run_joined", "pool_run_queued"]
    assert events[1]["hosts"] == 3 and events[1]["free"] == 1
    assert pool.held("A") == {} and pool.ledger.runs["A"].queued_since == 1.0
    pool.host("h1", 2.0)
    assert pool.held("A") == {}   # 2 of 3: still nothing
    assert pool.ledger.runs["A"].started is None
    pool.host("h2", 3.0)
    assert pool.held("A") == {"w0": "h0", "w1": "h1", "w2": "h2"}
    granted = [e for e in pool.log if e["kind"] == "pool_lease_granted"]
    assert len(granted) == 3 and {e["t"] for e in granted} == {3.0}   # all three in the one decision
    run = pool.ledger.runs["A"]
    assert run.started == 3.0 and run.queued_since is None


def test_a_run_holding_its_minimum_is_granted_more_one_at_a_time():
    pool = Pool()
    hosts(pool, ["h0", "h1"])
    pool.run("A", 1.0, min_hosts=2, wanted=["w0", "w1", "w2", "w3"])
    assert pool.held("A") == {"w0": "h0", "w1": "h1"}
    pool.host("h2", 2.0)   # past its minimum, one more host is worth granting
    assert pool.held("A") == {"w0": "h0", "w1": "h1", "w2": "h2"}


def test_while_a_gang_waits_no_lower_priority_run_is_granted_a_host_that_would_fit_it():
    pool = Pool()
    hosts(pool, ["h0", "h1"])
    pool.host("big", 0.0, devices=2)
    pool.run("A", 1.0, priority=5, min_hosts=3, wanted=["w0", "w1", "w2"])
    assert pool.held("A") == {}
    events = pool.run("B", 2.0, priority=0, wanted=["v0"])
    assert grants(events) == [] and pool.held("B") == {}
    assert [h.host_id for h in pool.ledger.free_hosts()] == ["big", "h0", "h1"]
    # a host that would not fit the gang goes to whoever it fits
    assert grants(pool.run("C", 3.0, priority=0, devices=2, wanted=["x0"])) == [("C", "x0", "big")]
    # B asks again, later: still nothing (the gang's hosts stay kept)
    assert grants(pool.run("B", 4.0, priority=0, wanted=["v0"])) == []
    pool.host("h2", 5.0)
    assert pool.held("A") == {"w0": "h0", "w1": "h1", "w2": "h2"}
    assert pool.held("B") == {}


def test_a_gang_waiting_does_not_hold_back_a_run_of_a_higher_priority():
    pool = Pool()
    hosts(pool, ["h0"])
    pool.run("A", 1.0, priority=1, min_hosts=2, wanted=["w0", "w1"])
    assert grants(pool.run("B", 2.0, priority=3, wanted=["v0"])) == [("B", "v0", "h0")]


# -- the queue -----------------------------------------------------------------------------------------------

def test_the_queue_is_served_by_priority_then_by_first_ask():
    pool = Pool()
    pool.run("X", 1.0, priority=0, wanted=["x0"])
    pool.run("Y", 2.0, priority=0, wanted=["y0"])
    pool.run("Z", 3.0, priority=3, wanted=["z0"])
    assert [r.run_id for r in pool.ledger.queue()] == ["Z", "X", "Y"]
    assert pool.ledger.status(3.0)["queue"] == ["Z", "X", "Y"]
    # X joins again with other terms (its grace, which the log keeps): it keeps its place among its equals
    events = pool.run("X", 4.0, priority=0, min_hosts=1, devices=1, wanted=["x0"], grace=60.0)
    assert [(e["kind"], e["grace"]) for e in events] == [("pool_run_joined", 60.0)]
    pool.run("Y", 5.0, priority=0, wanted=["y0"], name="y renamed")
    assert [r.run_id for r in pool.ledger.queue()] == ["Z", "X", "Y"]
    assert pool.ledger.runs["X"].asked == 1.0
    for k, t in enumerate((6.0, 7.0, 8.0)):
        pool.host(f"h{k}", t)
    assert grants(pool.log) == [("Z", "z0", "h0"), ("X", "x0", "h1"), ("Y", "y0", "h2")]


def test_a_run_that_joins_again_with_new_terms_is_recorded_and_keeps_its_first_ask():
    pool = Pool()
    pool.run("X", 1.0, priority=0, wanted=["x0"])
    pool.run("Y", 2.0, priority=1, wanted=["y0"])
    events = pool.run("X", 3.0, priority=2, wanted=["x0"])
    assert pool.kinds(events) == ["pool_run_joined"] and events[0]["priority"] == 2
    run = pool.ledger.runs["X"]
    assert (run.priority, run.asked) == (2, 1.0)
    assert [r.run_id for r in pool.ledger.queue()] == ["X", "Y"]


def test_a_queued_run_s_status_line_says_queued_and_its_place():
    pool = Pool()
    hosts(pool, ["h0"])
    pool.run("Z", 0.5, priority=3, min_hosts=2, wanted=["z0", "z1"])
    pool.run("X", 1.0, priority=0, wanted=["x0"])
    assert pool.ledger.run_status("Z", 4.0) == (
        "queued for 4 s: 2 host(s) asked, 0 held (minimum 2); place 1 in the queue, 1 of 1 host(s) free")
    assert pool.ledger.run_status("X", 4.0) == (
        "queued for 3 s: 1 host(s) asked, 0 held (minimum 1); place 2 in the queue, behind Z (priority 3)")
    [x] = [r for r in pool.ledger.status(4.0)["runs"] if r["run"] == "X"]
    assert x["status"].startswith("queued") and "place 2 in the queue" in x["status"]
    assert x["waiting_since"] == 1.0 and x["wanted"] == 1
    assert pool.ledger.run_status("nobody", 4.0) == "not known to the pool"


# -- give-backs ----------------------------------------------------------------------------------------------

def test_a_higher_priority_run_asks_the_lowest_priority_latest_started_run_above_its_minimum_to_give_back():
    pool = Pool()
    hosts(pool, [f"h{k}" for k in range(6)])
    pool.run("low-early", 1.0, priority=0, wanted=["a0", "a1"])
    pool.run("low-late", 2.0, priority=0, wanted=["b0", "b1"])
    pool.run("mid", 3.0, priority=1, wanted=["c0", "c1"])
    assert pool.ledger.free_hosts() == []
    events = pool.run("high", 4.0, priority=5, wanted=["d0"])
    assert pool.kinds(events) == ["pool_run_joined", "pool_run_queued", "pool_give_back"]
    assert give_backs(events) == [("low-late", 1, "high")]
    assert {r: run.give_back for r, run in pool.ledger.runs.items()} == {
        "low-early": 0, "low-late": 1, "mid": 0, "high": 0}
    # asked once: the next decisions count that host as on its way
    assert pool.tick(5.0) == [] and pool.run("high", 5.0, priority=5, wanted=["d0"]) == []


def test_give_backs_go_to_the_lower_priorities_first_and_each_no_more_than_it_can_spare():
    pool = Pool()
    hosts(pool, [f"h{k}" for k in range(5)])
    pool.run("low", 1.0, priority=0, wanted=["a0", "a1"])          # spares 1
    pool.run("mid", 2.0, priority=1, wanted=["b0", "b1", "b2"])    # spares 2
    events = pool.run("high", 3.0, priority=5, min_hosts=3, wanted=["d0", "d1", "d2"])
    assert give_backs(events) == [("low", 1, "high"), ("mid", 2, "high")]


def test_a_higher_priority_run_asks_back_all_it_wants_at_once_less_what_is_free_or_on_its_way():
    pool = Pool()
    hosts(pool, [f"h{k}" for k in range(5)])
    pool.run("low", 1.0, priority=0, wanted=["a0", "a1", "a2", "a3", "a4"])
    pool.run("low", 2.0, priority=0, held=["a0", "a1", "a2", "a3"], returned=["a4"])   # h4: being wiped
    events = pool.run("high", 3.0, priority=5, wanted=["d0", "d1", "d2"])
    assert give_backs(events) == [("low", 2, "high")]
    pool.host("h4", 4.0, ended=[ended("lease-4")])
    assert pool.held("high") == {"d0": "h4"}
    assert pool.tick(4.5) == [] and pool.ledger.runs["low"].give_back == 2


def test_runs_of_equal_priority_never_take_hosts_from_each_other():
    pool = Pool()
    hosts(pool, ["h0", "h1", "h2"])
    pool.run("A", 1.0, priority=2, wanted=["w0", "w1", "w2"])
    events = pool.run("B", 2.0, priority=2, wanted=["v0"])
    assert pool.kinds(events) == ["pool_run_joined", "pool_run_queued"]
    assert pool.tick(3.0) == [] and pool.ledger.runs["A"].give_back == 0
    # nor from a higher priority
    events = pool.run("C", 4.0, priority=1, wanted=["x0"])
    assert give_backs(events) == [] and pool.ledger.runs["A"].give_back == 0


def test_no_run_is_asked_to_give_back_below_its_minimum():
    pool = Pool()
    hosts(pool, ["h0", "h1", "h2", "h3", "h4"])
    pool.run("at-min", 1.0, priority=0, min_hosts=2, wanted=["a0", "a1"])
    pool.run("above", 2.0, priority=0, min_hosts=2, wanted=["b0", "b1", "b2"])
    events = pool.run("high", 3.0, priority=5, min_hosts=2, wanted=["d0", "d1"])
    assert give_backs(events) == [("above", 1, "high")]   # its one spare host, and nothing from at-min
    assert pool.ledger.runs["at-min"].give_back == 0
    assert pool.tick(4.0) == []


def test_give_back_counts_down_as_the_run_returns_hosts_and_the_wiped_host_goes_to_the_run_that_asked():
    pool = Pool()
    hosts(pool, ["h0", "h1", "h2"])
    pool.run("low", 1.0, priority=0, wanted=["a0", "a1", "a2"])
    serve_all(pool, 1.5)
    pool.run("high", 2.0, priority=5, wanted=["d0"])
    assert pool.ledger.runs["low"].give_back == 1
    events = pool.run("low", 3.0, priority=0, held=["a0", "a1"], returned=["a2"])
    lease = pool.lease_of("low", "a2")
    assert events == [{"t": 3.0, "kind": "pool_lease_reclaimed", "lease": lease, "why": "returned"}]
    assert pool.ledger.runs["low"].give_back == 0
    assert pool.held("low") == {"a0": "h0", "a1": "h1"}
    assert pool.ledger.status(3.0)["workers"][2]["state"] == "wiping"
    assert pool.ledger.host_orders("h2") == (None, lease)   # stop the worker and wipe
    # returned again on the next poll (the client lists it until the pool stops): nothing more
    assert pool.run("low", 3.5, priority=0, held=["a0", "a1"], returned=["a2"]) == []
    lease_, _ = pool.host("h2", 4.0, lease_id=lease, ended=[ended(lease, code=-9)])
    assert pool.held("high") == {"d0": "h2"} and lease_.run_id == "high"
    assert lease not in pool.ledger.leases


def test_a_give_back_counts_down_to_zero_and_no_further_when_a_run_returns_more_than_asked():
    pool = Pool()
    hosts(pool, ["h0", "h1"])
    pool.run("low", 1.0, priority=0, wanted=["a0", "a1"])
    pool.run("high", 2.0, priority=5, min_hosts=2, wanted=["d0", "d1"])
    assert pool.ledger.runs["low"].give_back == 1
    pool.run("low", 3.0, priority=0, held=["a0"], returned=["a1"])
    assert pool.ledger.runs["low"].give_back == 0
    pool.run("low", 4.0, priority=0, held=[], returned=["a0"])   # below its minimum by its own choice
    assert pool.ledger.runs["low"].give_back == 0


# -- hosts that do not fit -----------------------------------------------------------------------------------

def test_a_host_of_another_device_count_or_platform_is_never_granted():
    pool = Pool()
    pool.host("two", 0.0, devices=2)
    pool.host("gpu", 0.0, devices=1, platform="gpu")
    events = pool.run("A", 1.0, devices=1, platform="cpu", wanted=["w0"])
    assert grants(events) == [] and pool.kinds(events) == ["pool_run_joined", "pool_run_queued"]
    for t in (2.0, 3.0):
        pool.host("two", t, devices=2)
        pool.host("gpu", t, devices=1, platform="gpu")
        assert pool.tick(t) == []
    assert pool.held("A") == {}
    assert grants(pool.run("B", 4.0, devices=2, wanted=["v0"])) == [("B", "v0", "two")]
    pool.host("cpu", 5.0, devices=1, platform="cpu")
    assert pool.held("A") == {"w0": "cpu"}


def test_a_run_that_names_no_platform_takes_a_host_of_its_device_count_on_any():
    pool = Pool()
    pool.host("gpu", 0.0, devices=4, platform="gpu")
    assert grants(pool.run("A", 1.0, devices=4, platform="", wanted=["w0"])) == [("A", "w0", "gpu")]


def test_no_give_back_is_asked_for_hosts_that_would_not_fit():
    pool = Pool()
    hosts(pool, ["h0", "h1"], devices=2)
    pool.run("low", 1.0, priority=0, devices=2, wanted=["a0", "a1"])
    events = pool.run("high", 2.0, priority=5, devices=1, wanted=["d0"])
    assert give_backs(events) == [] and pool.ledger.runs["low"].give_back == 0


# -- silence -------------------------------------------------------------------------------------------------

def test_a_client_silent_past_its_grace_has_its_leases_reclaimed_and_its_run_ended():
    pool = Pool(host_silent_seconds=100.0)
    hosts(pool, ["h0", "h1", "h2"])
    pool.run("A", 1.0, wanted=["w0", "w1"], grace=5.0)
    pool.run("B", 1.0, wanted=["v0"], grace=5.0)
    serve_all(pool, 2.0)
    pool.run("B", 5.5, held=["v0"], grace=5.0)
    assert pool.tick(6.0) == []   # A: exactly its grace, not past it
    events = pool.tick(6.5)
    assert pool.kinds(events) == ["pool_lease_reclaimed", "pool_lease_reclaimed", "pool_run_ended"]
    assert {e["lease"] for e in events[:2]} == {pool.lease_of("A", "w0"), pool.lease_of("A", "w1")}
    assert {e["why"] for e in events[:2]} == {"client gone"}
    assert events[2]["run"] == "A" and events[2]["reason"] == "client silent for 6 s (its grace is 5 s)"
    assert "A" not in pool.ledger.runs and pool.held("B") == {"v0": "h2"}
    assert pool.ledger.host_orders("h0") == (None, "lease-0")
    assert pool.ledger.host_orders("h1") == (None, "lease-1")
    # the hosts report the leases ended and are free again; A's record does not come back
    pool.host("h0", 7.0, lease_id="lease-0", ended=[ended("lease-0", code=-15)])
    pool.host("h1", 7.0, lease_id="lease-1", ended=[ended("lease-1", code=-15)])
    assert [h.host_id for h in pool.ledger.free_hosts()] == ["h0", "h1"] and "A" not in pool.ledger.runs


def test_a_client_s_grace_is_the_one_it_polls_with_else_two_minutes():
    pool = Pool(host_silent_seconds=1000.0)
    pool.run("A", 0.0, wanted=["w0"])
    assert pool.ledger.runs["A"].grace == 120.0
    assert pool.tick(120.0) == []
    assert pool.kinds(pool.tick(120.5)) == ["pool_run_ended"]


def test_a_free_host_silent_past_host_silent_seconds_is_removed():
    pool = Pool()
    pool.host("h0", 0.0)
    pool.host("h1", 0.0)
    pool.host("h1", 5.0)
    assert pool.tick(HOST_SILENT_SECONDS) == []   # exactly the limit: still there
    events = pool.tick(HOST_SILENT_SECONDS + 0.5)
    assert events == [{"kind": "pool_host_lost", "host": "h0", "reason": "silent for 10 s"}]
    assert list(pool.ledger.hosts) == ["h1"]
    # its next poll brings it back, as a new host
    pool.host("h0", 11.0)
    assert sorted(pool.ledger.hosts) == ["h0", "h1"] and pool.kinds()[-1] == "pool_host_joined"


def test_a_leased_host_gone_silent_ends_its_lease_and_the_run_is_told_its_worker_died():
    pool = Pool(host_silent_seconds=3.0)
    hosts(pool, ["h0", "h1"])
    pool.run("A", 0.5, wanted=["w0", "w1"], grace=60.0)
    serve_all(pool, 1.0)
    pool.host("h1", 3.0, lease_id="lease-1")
    events = pool.tick(4.5)
    assert events == [
        {"kind": "pool_lease_ended", "lease": "lease-0", "host": "h0", "exit_code": -1, "wiped": True,
         "leftovers": []},
        {"kind": "pool_host_lost", "host": "h0", "reason": "silent for 4 s"}]
    assert list(pool.ledger.hosts) == ["h1"] and pool.held("A") == {"w1": "h1"}
    assert pool.ledger.runs["A"].ended_workers == {"w0": -1}


def test_a_host_gone_silent_while_wiping_a_reclaimed_lease_is_removed_without_telling_the_run():
    pool = Pool(host_silent_seconds=3.0)
    hosts(pool, ["h0"])
    pool.run("A", 0.5, wanted=["w0"], grace=60.0)
    pool.run("A", 1.0, returned=["w0"], grace=60.0)
    events = pool.tick(3.5)
    assert pool.kinds(events) == ["pool_lease_ended", "pool_host_lost"]
    assert pool.ledger.hosts == {} and pool.ledger.leases == {}
    assert pool.ledger.runs["A"].ended_workers == {}


# -- the hosts' orders and reports ---------------------------------------------------------------------------

def test_a_host_is_ordered_to_serve_its_granted_lease_until_it_reports_serving_it():
    pool = Pool()
    assert pool.host("h0", 0.0) == (None, "")
    pool.run("A", 1.0, wanted=["w0"])
    lease, reclaim = pool.ledger.host_orders("h0")
    assert reclaim == "" and (lease.lease_id, lease.run_id, lease.worker_id, lease.state) == (
        "lease-0", "A", "w0", "granted")
    # a poll that does not report it yet (the order was lost) is told again
    assert pool.host("h0", 1.5)[0].lease_id == "lease-0"
    assert pool.host("h0", 2.0, lease_id="lease-0") == (None, "")
    assert pool.ledger.leases["lease-0"].state == "serving"
    assert pool.kinds()[-1] == "pool_lease_serving"
    assert pool.host("h0", 2.5, lease_id="lease-0") == (None, "")
    assert pool.kinds().count("pool_lease_serving") == 1
    assert pool.ledger.status(2.5)["leases"] == [
        {"lease": "lease-0", "run": "A", "worker": "w0", "host": "h0", "state": "serving"}]
    # the run's order (controller, secret, ...) is what the host's agent starts the worker with
    order = pool.ledger.runs["A"].order
    assert {k: order[k] for k in ("controller", "secret", "snapshot", "chaos", "platform")} == dict(
        controller="A.controller:5000", secret="secret-of-A", snapshot="/snapshots/A", chaos=False, platform="")


def test_a_lease_ended_and_wiped_leaves_its_host_free_for_the_next_run():
    pool = Pool()
    pool.host("h0", 0.0)
    pool.run("A", 1.0, wanted=["w0"])
    pool.host("h0", 2.0, lease_id="lease-0")
    pool.run("B", 2.5, wanted=["v0"])
    assert pool.held("B") == {}
    lease, _ = pool.host("h0", 3.0, ended=[ended("lease-0", code=1)])
    assert pool.log[-2]["kind"] == "pool_lease_ended" and pool.log[-2]["wiped"] is True
    assert "lease-0" not in pool.ledger.leases and "h0" in pool.ledger.hosts
    assert (lease.lease_id, lease.run_id) == ("lease-1", "B")
    # the worker ended by itself: its run is told how
    assert pool.ledger.runs["A"].ended_workers == {"w0": 1}


def test_a_lease_ended_without_its_wipe_removes_its_host_from_the_pool():
    pool = Pool()
    pool.host("h0", 0.0)
    pool.run("A", 1.0, wanted=["w0"])
    pool.host("h0", 2.0, lease_id="lease-0")
    pool.run("A", 2.5, returned=["w0"])
    assert pool.ledger.host_orders("h0") == (None, "lease-0")
    pool.run("B", 2.7, wanted=["v0"])
    order = pool.host("h0", 3.0, ended=[ended("lease-0", code=-9, wiped=False, leftovers=["/leases/lease-0"])])
    assert order == (None, "")
    assert pool.log[-2] == {"t": 3.0, "kind": "pool_lease_ended", "lease": "lease-0", "host": "h0",
                            "exit_code": -9, "wiped": False, "leftovers": ["/leases/lease-0"]}
    assert pool.log[-1]["kind"] == "pool_host_lost" and "could not wipe lease-0" in pool.log[-1]["reason"]
    assert pool.ledger.hosts == {} and pool.ledger.leases == {}
    assert pool.held("B") == {}
    assert pool.ledger.runs["A"].ended_workers == {}   # returned: the run knows


def test_a_host_that_still_serves_a_lease_the_pool_ended_is_told_to_stop_it_and_granted_nothing_meanwhile():
    pool = Pool()
    pool.host("h0", 0.0)
    before = len(pool.log)
    assert pool.host("h0", 1.0, lease_id="lease-7", ended=[ended("lease-6")]) == (None, "lease-7")
    assert pool.log[before:] == []   # nothing recorded: the pool knows neither lease
    pool.run("A", 1.5, wanted=["w0"])
    assert pool.held("A") == {}   # not granted while it serves its stale lease
    pool.host("h0", 2.0, ended=[ended("lease-7")])
    assert pool.held("A") == {"w0": "h0"}


def test_an_agent_restarted_while_serving_ends_its_lease_and_its_host_is_free():
    pool = Pool()
    pool.host("h0", 0.0, pid=100)
    pool.run("A", 1.0, wanted=["w0"])
    pool.host("h0", 2.0, lease_id="lease-0", pid=100)
    pool.run("B", 2.5, wanted=["v0"])
    start = len(pool.log)
    lease, _ = pool.host("h0", 3.0, pid=200)   # a new agent: it serves nothing
    assert pool.kinds(pool.log[start:]) == ["pool_host_joined", "pool_lease_ended", "pool_lease_granted"]
    assert pool.log[start + 1]["exit_code"] == -1 and pool.log[start + 1]["lease"] == "lease-0"
    assert pool.ledger.runs["A"].ended_workers == {"w0": -1}
    assert (lease.lease_id, lease.run_id, lease.host_id) == ("lease-1", "B", "h0")
    assert pool.ledger.hosts["h0"].pid == 200


def test_an_agent_restarted_before_it_took_its_lease_is_ordered_to_serve_it_again():
    pool = Pool()
    pool.host("h0", 0.0, pid=100)
    pool.run("A", 1.0, wanted=["w0"])
    lease, _ = pool.host("h0", 2.0, pid=200)
    assert lease.lease_id == "lease-0" and pool.ledger.leases["lease-0"].state == "granted"


def test_a_lease_returned_before_its_host_took_it_ends_at_the_host_s_next_poll():
    pool = Pool()
    pool.host("h0", 0.0)
    pool.run("A", 1.0, wanted=["w0"])
    pool.run("A", 1.5, returned=["w0"])
    assert pool.ledger.host_orders("h0") == (None, "lease-0")
    pool.host("h0", 2.0)   # it never served it
    assert pool.kinds()[-1] == "pool_lease_ended" and pool.ledger.leases == {}
    assert [h.host_id for h in pool.ledger.free_hosts()] == ["h0"]
    assert pool.ledger.runs["A"].ended_workers == {}


# -- runs that end -------------------------------------------------------------------------------------------

def test_a_run_that_is_done_gives_back_everything_it_holds_and_leaves():
    pool = Pool()
    hosts(pool, ["h0", "h1", "h2"])
    pool.run("A", 1.0, wanted=["w0", "w1", "w2"])
    serve_all(pool, 1.5)
    pool.run("A", 2.0, held=["w0", "w1"], returned=["w2"])
    events = pool.run("A", 3.0, held=["w0", "w1"], returned=["w2"], done=True)
    assert events == [
        {"t": 3.0, "kind": "pool_lease_reclaimed", "lease": "lease-0", "why": "run ended"},
        {"t": 3.0, "kind": "pool_lease_reclaimed", "lease": "lease-1", "why": "run ended"},
        {"t": 3.0, "kind": "pool_run_ended", "run": "A", "reason": "finished"}]
    assert pool.ledger.runs == {}
    assert [pool.ledger.host_orders(h) for h in ("h0", "h1", "h2")] == [
        (None, "lease-0"), (None, "lease-1"), (None, "lease-2")]
    for k in range(3):
        pool.host(f"h{k}", 4.0, ended=[ended(f"lease-{k}", code=-15)])
    assert pool.ledger.leases == {} and len(pool.ledger.free_hosts()) == 3
    assert pool.ledger.status(4.0)["runs"] == []


# -- replay --------------------------------------------------------------------------------------------------

def _history() -> Pool:
    """A pool that saw a bit of everything; it ends with hosts free, leased and wiping, runs holding, a run
    asked to give back two hosts that returned one, a queued gang and refused calls."""
    pool = Pool(host_silent_seconds=5.0)
    hosts(pool, ["h0", "h1", "h2", "h3"])
    pool.host("big", 0.0, devices=2)
    pool.host("lost", 0.0)
    pool.run("low", 1.0, priority=0, wanted=["a0", "a1", "a2"], grace=30.0, name="low run")
    pool.run("gone", 1.0, priority=0, wanted=["g0"], grace=2.0)
    pool.run("mid", 1.5, tenant="bob", priority=1, devices=2, wanted=["m0"], grace=30.0)
    for t in (2.0, 4.0):
        serve_all(pool, t)
        for h in ("h0", "h1", "h2", "h3", "big"):
            lease = pool.ledger.hosts[h].lease
            state = pool.ledger.leases[lease].state if lease else ""
            pool.host(h, t, devices=pool.ledger.hosts[h].devices, lease_id=lease if state == "serving" else "")
        pool.run("low", t, priority=0, held=["a0", "a1", "a2"], grace=30.0, name="low run")
        pool.run("mid", t, tenant="bob", priority=1, devices=2, held=["m0"], grace=30.0)
    pool.run("high", 5.2, priority=5, min_hosts=3, wanted=["d0", "d1", "d2"], grace=30.0)   # "lost" is gone
    pool.record([dict(kind="pool_calls_refused", method="/jax_elastic.Pool/Run", peer="127.0.0.1",
                      reason="wrong run secret", count=3)], 5.0)
    for h in ("h0", "h1", "h2", "h3", "big"):
        lease = pool.ledger.hosts[h].lease
        pool.host(h, 5.5, devices=pool.ledger.hosts[h].devices, lease_id=lease)
    pool.run("low", 6.0, priority=0, held=["a0", "a1"], returned=["a2"], grace=30.0, name="low run")
    pool.run("mid", 6.0, tenant="bob", priority=1, devices=2, held=["m0"], grace=30.0)
    assert pool.ledger.runs["low"].give_back == 1 and pool.ledger.leases["lease-2"].state == "reclaimed"
    kinds = set(pool.kinds())
    assert {"pool_host_lost", "pool_run_ended", "pool_lease_granted", "pool_lease_serving", "pool_give_back",
            "pool_lease_reclaimed", "pool_lease_ended", "pool_run_queued", "pool_calls_refused"} <= kinds
    return pool


def _standing(ledger: Ledger, now: float) -> dict:
    """What a ledger shows, less what is not an event on purpose (the module's contract): the runs' wanted
    workers (each client's next poll brings them again), hence the queue and the status lines."""
    status = ledger.status(now)
    for r in status["runs"]:
        del r["status"], r["wanted"]
    for w in status["workers"]:
        del w["heard_seconds"]   # when it last polled this pool process: a restarted one has not heard it yet
    del status["queue"]
    return status


def test_a_replay_of_the_recorded_events_stands_where_the_live_ledger_stood():
    live = _history()
    replayed = Ledger.replay(live.log, 6.0, host_silent_seconds=5.0)
    for h in replayed.hosts:   # once its hosts poll it again (until then each is unheard: the next test)
        replayed.host_heard(h, 6.0)
    assert _standing(replayed, 6.0) == _standing(live.ledger, 6.0)
    assert replayed.leases == live.ledger.leases
    assert {h: (x.devices, x.platform, x.address, x.pid, x.lease) for h, x in replayed.hosts.items()} == {
        h: (x.devices, x.platform, x.address, x.pid, x.lease) for h, x in live.ledger.hosts.items()}
    assert {r: (x.tenant, x.priority, x.min_hosts, x.devices, x.name, x.asked, x.started, x.give_back,
                x.queued_since) for r, x in replayed.runs.items()} == {
        r: (x.tenant, x.priority, x.min_hosts, x.devices, x.name, x.asked, x.started, x.give_back,
            x.queued_since) for r, x in live.ledger.runs.items()}
    assert replayed.next_lease_id() == live.ledger.next_lease_id()
    assert replayed.refused == {"wrong run secret": 3}
    # hosts and clients count as heard at the replay
    assert {x.seen for x in replayed.hosts.values()} | {x.seen for x in replayed.runs.values()} == {6.0}
    # what the live pool shows (the non-pool events of a log are skipped)
    assert Ledger.replay([{"t": 0.0, "kind": "run_started"}, *live.log], 6.0).status(6.0)["leases"] == \
        live.ledger.status(6.0)["leases"]


def test_a_restarted_pool_neither_counts_nor_grants_a_host_until_it_polls_and_loses_one_that_never_does():
    """h1, a host started by hand, left while the pool was down: the restarted pool listed it free and counted it
    until its silence ran out (and could grant it). A host known from the log is unheard until it polls: neither
    free nor counted nor granted; h0 polls and is granted; h1 is lost once silent past host_silent_seconds."""
    pool = Pool(host_silent_seconds=5.0)
    hosts(pool, ["h0", "h1"])
    pool.run("A", 1.0, wanted=["a0"])
    pool.run("A", 2.0, returned=["a0"])
    pool.host("h0", 2.5, ended=[ended("lease-0")])
    restarted = Pool(host_silent_seconds=5.0)
    restarted.ledger = Ledger.replay(pool.log, 10.0, host_silent_seconds=5.0)
    status = restarted.ledger.status(10.0)
    assert (status["hosts"], status["free"], status["unheard"]) == (0, 0, 2)
    assert [(w["host"], w["state"]) for w in status["workers"]] == [("h0", "unheard"), ("h1", "unheard")]
    assert render(status, now=10.0)[0] == ("pool: 0 host(s), 0 free (0 device(s)); 2 more not heard since the pool "
                                           "started (gone, or about to poll)")   # elastic pool status
    assert grants(restarted.run("B", 10.5, wanted=["b0", "b1"])) == []
    assert restarted.ledger.run_status("B", 10.5).endswith("0 of 0 host(s) free")
    restarted.host("h0", 11.0)
    assert restarted.held("B") == {"b0": "h0"}
    status = restarted.ledger.status(11.0)
    assert (status["hosts"], status["free"], status["unheard"]) == (1, 0, 1)
    assert [e["host"] for e in restarted.tick(15.5) if e["kind"] == "pool_host_lost"] == ["h1"]
    assert restarted.ledger.status(15.5)["unheard"] == 0 and "b1" not in restarted.held("B")


def test_a_replayed_pool_grants_nothing_to_a_run_until_its_client_polls_again():
    pool = Pool()
    pool.run("A", 1.0, wanted=["w0"])
    pool.host("h0", 2.0)   # granted at once
    pool.run("B", 2.5, wanted=["v0"])
    pool.host("h0", 3.0, ended=[ended("lease-0")])   # free again, granted to B at once
    assert pool.held("B") == {"v0": "h0"}
    pool.run("B", 3.5, returned=["v0"])
    pool.host("h0", 4.0, ended=[ended("lease-1")])
    pool.run("C", 4.5, wanted=["x0"])
    assert pool.held("C") == {"x0": "h0"}
    pool.run("C", 5.0, returned=["x0"], wanted=["x1"])   # x1 waits
    restarted = Pool()
    restarted.ledger = Ledger.replay(pool.log, 6.0)
    restarted.host("h0", 6.0, ended=[ended("lease-2")])
    assert restarted.ledger.free_hosts()[0].host_id == "h0" and restarted.tick(6.5) == []
    assert restarted.ledger.next_lease_id() == "lease-3"
    events = restarted.run("C", 7.0, wanted=["x1"])
    assert grants(events) == [("C", "x1", "h0")] and events[-1]["lease"] == "lease-3"


# -- what is shown -------------------------------------------------------------------------------------------

def test_a_tenant_s_status_shows_its_runs_and_the_free_capacity_only():
    pool = Pool()
    hosts(pool, ["h0", "h1", "h2"])
    pool.host("big", 0.0, devices=4)
    pool.run("a1", 1.0, tenant="alice", wanted=["w0"], name="alice's")
    pool.run("b1", 1.0, tenant="bob", wanted=["v0"])
    pool.run("b2", 1.0, tenant="bob", devices=8, wanted=["u0"])
    mine = pool.ledger.status(2.0, tenant="alice")
    assert set(mine) == {"hosts", "free", "free_devices", "runs", "queue"}
    assert (mine["hosts"], mine["free"], mine["free_devices"]) == (4, 2, 5)
    assert [r["run"] for r in mine["runs"]] == ["a1"] and mine["queue"] == []
    assert mine["runs"][0] == {"run": "a1", "name": "alice's", "priority": 0, "min_hosts": 1, "held": ["w0"],
                               "hosts": ["h0"], "wanted": 0, "give_back": 0, "waiting_since": None,
                               "status": "holds 1 host(s); 2 of 4 free in the pool"}
    theirs = pool.ledger.status(2.0, tenant="bob")
    assert [r["run"] for r in theirs["runs"]] == ["b1", "b2"] and theirs["queue"] == ["b2"]
    assert "workers" not in theirs and "leases" not in theirs and "refused" not in theirs
    assert pool.ledger.status(2.0, tenant="carol")["runs"] == []
    everything = pool.ledger.status(2.0)
    assert [r["tenant"] for r in everything["runs"]] == ["alice", "bob", "bob"]
    assert [w["host"] for w in everything["workers"]] == ["big", "h0", "h1", "h2"]
    assert everything["workers"][0] == {"host": "big", "devices": 4, "platform": "cpu", "address": "big.local",
                                        "state": "free", "heard_seconds": 2.0}
    assert everything["refused"] == {}


@pytest.mark.parametrize("count", [1, 2])
def test_refused_calls_are_counted_by_reason(count):
    pool = Pool()
    for _ in range(count):
        pool.record([dict(kind="pool_calls_refused", method="/jax_elastic.Pool/Run", peer="10.0.0.1",
                          reason="missing run secret", count=2),
                     dict(kind="pool_calls_refused", method="/jax_elastic.Pool/Host", peer="10.0.0.2",
                          reason="wrong run secret", count=1)], 1.0)
    assert pool.ledger.status(1.0)["refused"] == {"missing run secret": 2 * count, "wrong run secret": count}


# -- what a first review of the ledger found -----------------------------------------------------------------


def test_a_gang_that_has_asked_for_part_of_its_minimum_is_granted_nothing_until_it_asks_for_all():
    pool = Pool()
    for h in ("h0", "h1", "h2"):
        pool.host(h, 0.0)
    pool.run("A", 1.0, min_hosts=2, wanted=["w0"])   # (a client's launches reach the pool over several polls)
    pool.run("B", 1.0, min_hosts=2, wanted=["v0"])
    assert pool.held("A") == {} and pool.held("B") == {}   # never half each
    pool.run("A", 1.1, min_hosts=2, wanted=["w0", "w1"])
    assert sorted(pool.held("A")) == ["w0", "w1"] and pool.held("B") == {}


def test_a_queued_runs_status_names_only_its_own_clients_runs_ahead_of_it():
    pool = Pool()
    pool.run("A", 1.0, tenant="alice", priority=5, wanted=["x"])
    pool.run("B", 1.0, tenant="bob", wanted=["x"])
    line = pool.ledger.run_status("B", 2.0)
    assert "A" not in line.replace("asked", "") and "1 run(s) of other clients" in line, line


def test_a_worker_that_ended_is_told_to_its_client_until_the_client_names_it_no_more():
    pool = Pool()
    pool.host("h0", 0.0)
    pool.host("h1", 0.0)
    pool.run("A", 1.0, wanted=["w0", "w1"])
    pool.host("h0", 1.5, lease_id=pool.lease_of("A", "w0"))
    pool.host("h0", 2.0, ended=[ended(pool.lease_of("A", "w0"), code=3)])
    pool.run("A", 2.5, held=["w0", "w1"])   # this poll's reply is built after it: the end must survive it
    assert pool.ledger.runs["A"].ended_workers == {"w0": 3}
    pool.run("A", 3.0, held=["w1"])   # the client took it in
    assert pool.ledger.runs["A"].ended_workers == {}


def test_a_give_back_no_run_waits_for_any_more_is_withdrawn():
    pool = Pool()
    for h in ("h0", "h1"):
        pool.host(h, 0.0)
    pool.run("low", 1.0, wanted=["w0", "w1"])
    pool.run("high", 2.0, priority=5, wanted=["v0"])
    assert pool.ledger.runs["low"].give_back == 1
    pool.run("high", 3.0, done=True)   # it gave up before low gave anything back
    assert pool.ledger.runs["low"].give_back == 0
    assert pool.log[-1]["kind"] == "pool_give_back" and pool.log[-1]["count"] == -1


def test_a_run_no_host_of_the_pool_fits_is_told_so_in_its_status_line():
    pool = Pool()
    pool.host("h0", 0.0, devices=1)
    pool.run("A", 1.0, devices=2, wanted=["w0"])
    assert pool.held("A") == {}
    line = pool.ledger.run_status("A", 2.0)
    assert "no host of the pool fits it: its slices need 2 any device(s), the pool's hosts have 1 cpu" in line, line


def test_a_gpu_host_serves_a_run_exported_for_cuda():
    pool = Pool()
    pool.host("h0", 0.0, platform="gpu")
    pool.run("A", 1.0, platform="cuda", wanted=["w0"])
    assert pool.held("A") == {"w0": "h0"}


def test_a_restarted_pool_keeps_each_clients_grace_and_reclaims_a_client_silent_since_before_it_restarted():
    """The grace is in the log: a client that died while the pool was down (so never polled the new one) is gone
    after its own grace, not after the default 120 s."""
    pool = Pool()
    pool.host("h0", 0.0)
    pool.run("A", 1.0, wanted=["w0"], grace=3.0)
    replayed = Ledger.replay(pool.log, now=10.0)
    assert replayed.runs["A"].grace == 3.0
    replayed.host_heard("h0", 13.5)
    events = replayed.schedule(13.5)
    assert [e["kind"] for e in events] == ["pool_lease_reclaimed", "pool_run_ended"]
    assert events[0]["why"] == "client gone"
