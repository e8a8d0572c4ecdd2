"""The pool's gRPC service (runtime/pool/service.py) served for real, in-process, on 127.0.0.1.

What is proved: who may call what (a run's poll takes a client token only, a
host's poll the pool secret only; a refused call is UNAUTHENTICATED and counted
in the status's ``refused``); what each credential sees (a client token: its
own runs and the free capacity; the pool secret: everything) and that a client
cannot poll another's run (PERMISSION_DENIED); a host's poll and a run's poll
meeting in a grant, the host told the run's controller and secret; a pool
stopped and served again from its directory on the same port, standing where
it stood (from its log); and the secret and tokens it creates when the
environment gives none, readable by their owner only.
"""

import json
import os
import stat
import threading
import time

import grpc
import pytest

from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.core.events import read_events
from runtime.pool import service
from runtime.wire import rpc

SECRET = "pool-secret-for-tests"
TOKENS = "alice=tok-a,bob=tok-b"


@pytest.fixture(autouse=True)
def fast_ticks(monkeypatch):
    """The serve loop ticks every 0.05 s rather than 0.25 s, and a stopped pool answers no longer (its 2 s drain is
    for agents to hear it close): these tests stop pools often."""
    monkeypatch.setattr(service, "TICK_SECONDS", 0.05)
    monkeypatch.setattr(service, "DRAIN_SECONDS", 0.0)


@pytest.fixture
def credentials(monkeypatch):
    monkeypatch.setenv(service.SECRET_ENV, SECRET)
    monkeypatch.setenv(service.TOKENS_ENV, TOKENS)


class Served:
    """One ``serve(directory)`` in a thread: its address once it serves; :meth:`stop` ends it and joins."""

    def __init__(self, directory):
        self.directory = str(directory)
        self.stop_event = threading.Event()
        self.ready = threading.Event()
        self.address = ""
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        if not self.ready.wait(10.0):
            self.stop()
            raise AssertionError(f"the pool did not serve: {self.error!r}")

    def _serve(self):
        try:
            service.serve(self.directory, port=0, stop_event=self.stop_event, ready=self._ready)
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def _ready(self, address):
        self.address = address
        self.ready.set()

    def stop(self):
        self.stop_event.set()
        self.thread.join(10.0)
        assert not self.thread.is_alive(), "the pool did not stop"
        assert self.error is None, self.error

    def stub(self, credential=""):
        return pb_grpc.PoolStub(rpc.channel(self.address, credential))

    def status(self, credential=SECRET) -> dict:
        return json.loads(self.stub(credential).Status(pb.PoolStatusRequest(), timeout=5).json)


@pytest.fixture
def pool(tmp_path, credentials):
    served = Served(tmp_path / "pool")
    try:
        yield served
    finally:
        served.stop()


def host_poll(host_id, lease_id="", ended=(), devices=1):
    return pb.HostPoll(host_id=host_id, devices=devices, platform="cpu", lease_id=lease_id, ended=list(ended),
                       pid=os.getpid(), address="127.0.0.1")


def run_poll(run_id, wanted=(), held=(), **kw):
    fields = dict(run_id=run_id, priority=0, min_hosts=1, devices=1, controller="127.0.0.1:6000",
                  run_secret=f"run-secret-of-{run_id}", snapshot_directory=f"/tmp/snapshots/{run_id}",
                  grace_seconds=60.0, run_name=f"name of {run_id}")
    fields.update(kw)
    return pb.RunPoll(wanted=list(wanted), held=list(held), **fields)


def refused_code(call, *args) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=5)
    return info.value.code()


def eventually(check, seconds=3.0):
    """``check()``'s first truthy answer, polled until ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


# -- credentials ---------------------------------------------------------------------------------------------

def test_a_run_s_poll_without_a_client_token_is_refused_and_counted(pool):
    poll = run_poll("run-a", wanted=["w0"])
    assert refused_code(pool.stub("").Run, poll) == grpc.StatusCode.UNAUTHENTICATED
    assert refused_code(pool.stub("tok-wrong").Run, poll) == grpc.StatusCode.UNAUTHENTICATED
    assert refused_code(pool.stub(SECRET).Run, poll) == grpc.StatusCode.UNAUTHENTICATED   # a host's credential
    expected = {"missing client token": 1, "wrong client token": 2}   # (not the run secret: no run's is asked)
    assert eventually(lambda: pool.status()["refused"] == expected), pool.status()["refused"]
    assert pool.status()["runs"] == []   # none of them reached the ledger
    refused = [e for e in read_events(os.path.join(pool.directory, "events.jsonl"))
               if e["kind"] == "pool_calls_refused"]
    assert {e["method"] for e in refused} == {"/jax_elastic.Pool/Run"}
    assert sum(e["count"] for e in refused) == 3


def test_elastic_pool_status_with_a_wrong_token_says_the_pool_refused_it_naming_the_credential(pool, monkeypatch,
                                                                                               capsys):
    from argparse import Namespace

    from elastic.pool_commands import _cmd_status
    from runtime import POOL_TOKEN_ENV

    monkeypatch.setenv(POOL_TOKEN_ENV, "tok-wrong")
    assert _cmd_status(Namespace(pool=pool.address, timeout=5.0, json=False)) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"elastic: error: the pool at {pool.address} refused this credential (missing or wrong "
                           "pool secret or client token for /jax_elastic.Pool/Status)"), line


def test_a_host_s_poll_with_a_client_token_is_refused(pool):
    with pytest.raises(grpc.RpcError) as info:
        pool.stub("tok-a").Host(host_poll("h0"), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert info.value.details() == "missing or wrong pool secret for /jax_elastic.Pool/Host"
    assert refused_code(pool.stub("").Host, host_poll("h0")) == grpc.StatusCode.UNAUTHENTICATED
    assert eventually(lambda: pool.status()["refused"] == {"wrong pool secret": 1, "missing pool secret": 1})
    assert pool.status()["hosts"] == 0
    # the status needs a credential too
    assert refused_code(pool.stub("").Status, pb.PoolStatusRequest()) == grpc.StatusCode.UNAUTHENTICATED
    # and with the pool secret, the host is heard
    assert pool.stub(SECRET).Host(host_poll("h0"), timeout=5).lease.lease_id == ""
    assert pool.status()["hosts"] == 1


def test_a_client_sees_its_own_runs_and_the_free_capacity_and_the_pool_secret_sees_everything(pool):
    host = pool.stub(SECRET)
    for h in ("h0", "h1", "h2"):
        host.Host(host_poll(h), timeout=5)
    alice, bob = pool.stub("tok-a"), pool.stub("tok-b")
    orders = alice.Run(run_poll("run-a", wanted=["w0"]), timeout=5)
    assert [(g.worker_id, g.host_id) for g in orders.granted] == [("w0", "h0")]
    assert orders.status == "holds 1 host(s); 2 of 3 free in the pool" and not orders.queued
    bob.Run(run_poll("run-b", priority=2), timeout=5)

    mine = pool.status("tok-a")
    assert [r["run"] for r in mine["runs"]] == ["run-a"] and mine["runs"][0]["hosts"] == ["h0"]
    assert (mine["hosts"], mine["free"], mine["free_devices"]) == (3, 2, 2)
    assert "workers" not in mine and "leases" not in mine and "refused" not in mine
    assert "run-b" not in json.dumps(mine) and "tenant" not in mine["runs"][0]
    theirs = pool.status("tok-b")
    assert [r["run"] for r in theirs["runs"]] == ["run-b"] and "run-a" not in json.dumps(theirs)

    everything = pool.status(SECRET)
    assert [(r["run"], r["tenant"]) for r in everything["runs"]] == [("run-a", "alice"), ("run-b", "bob")]
    assert [(w["host"], w["state"]) for w in everything["workers"]] == [
        ("h0", "leased"), ("h1", "free"), ("h2", "free")]
    assert everything["leases"] == [{"lease": "lease-0", "run": "run-a", "worker": "w0", "host": "h0",
                                     "state": "granted"}]


def test_a_client_polling_another_client_s_run_is_denied(pool):
    pool.stub("tok-a").Run(run_poll("run-a", wanted=["w0"]), timeout=5)
    bob = pool.stub("tok-b")
    assert refused_code(bob.Run, run_poll("run-a", done=True)) == grpc.StatusCode.PERMISSION_DENIED
    [run] = pool.status()["runs"]
    assert (run["run"], run["tenant"], run["wanted"]) == ("run-a", "alice", 1)   # untouched


def test_a_run_s_poll_naming_no_run_is_refused_as_invalid(pool):
    assert refused_code(pool.stub("tok-a").Run, run_poll("")) == grpc.StatusCode.INVALID_ARGUMENT


# -- a grant, end to end -------------------------------------------------------------------------------------

def _grant(pool) -> pb.HostOrder:
    """h0 joins, run-a asks for one worker: the host's next poll is the order to serve it."""
    host = pool.stub(SECRET)
    first = host.Host(host_poll("h0"), timeout=5)
    assert first.lease.lease_id == "" and first.reclaim == "" and not first.stop
    orders = pool.stub("tok-a").Run(run_poll("run-a", wanted=["w0"]), timeout=5)
    assert [(g.worker_id, g.host_id, g.lease_id) for g in orders.granted] == [("w0", "h0", "lease-0")]
    return host.Host(host_poll("h0"), timeout=5)


def test_a_worker_asked_for_is_granted_and_the_host_is_told_the_run_s_controller_and_secret(pool):
    order = _grant(pool)
    lease = order.lease
    assert (lease.lease_id, lease.run_id, lease.worker_id) == ("lease-0", "run-a", "w0")
    assert (lease.controller, lease.run_secret, lease.snapshot_directory) == (
        "127.0.0.1:6000", "run-secret-of-run-a", "/tmp/snapshots/run-a")
    assert order.reclaim == "" and not order.stop
    # the host reports it serves it: no new order; the pool shows it serving
    host = pool.stub(SECRET)
    assert host.Host(host_poll("h0", lease_id="lease-0"), timeout=5).lease.lease_id == ""
    assert pool.status()["leases"][0]["state"] == "serving"
    # the run gives it back: the host is told to reclaim it, reports it wiped, is free
    pool.stub("tok-a").Run(run_poll("run-a", returned=["w0"]), timeout=5)
    assert host.Host(host_poll("h0", lease_id="lease-0"), timeout=5).reclaim == "lease-0"
    ended = pb.HostEnded(lease_id="lease-0", exit_code=-15, wiped=True)
    assert host.Host(host_poll("h0", ended=[ended]), timeout=5).reclaim == ""
    status = pool.status()
    assert status["leases"] == [] and status["free"] == 1
    # the run ends: it is told so, and the pool forgets it
    assert pool.stub("tok-a").Run(run_poll("run-a", done=True), timeout=5).status == "ended"
    assert pool.status()["runs"] == []


def test_a_run_waiting_for_hosts_is_told_it_is_queued_and_where(pool):
    orders = pool.stub("tok-a").Run(run_poll("run-a", wanted=["w0", "w1"], min_hosts=2), timeout=5)
    assert orders.queued and list(orders.granted) == []
    assert orders.status.startswith("queued") and "place 1 in the queue" in orders.status


# -- a restart -----------------------------------------------------------------------------------------------

def test_a_pool_served_again_from_its_directory_binds_the_same_port_and_stands_where_it_stood(tmp_path, credentials):
    first = Served(tmp_path / "pool")
    try:
        _grant(first)
        first.stub(SECRET).Host(host_poll("h0", lease_id="lease-0"), timeout=5)
        first.stub(SECRET).Host(host_poll("h1"), timeout=5)
        before = first.status()
    finally:
        first.stop()
    assert before["leases"] == [{"lease": "lease-0", "run": "run-a", "worker": "w0", "host": "h0",
                                 "state": "serving"}]
    again = Served(tmp_path / "pool")
    try:
        assert again.address == first.address
        after = again.status()
        assert after["leases"] == before["leases"]
        same = lambda workers: [{k: v for k, v in w.items() if k not in ("heard_seconds", "state")} for w in workers]
        assert same(after["workers"]) == same(before["workers"])
        assert all(w["heard_seconds"] is None for w in after["workers"])   # (not polled this pool process yet)
        # h1 may have left while the pool was down: not free, not counted, until it polls
        assert [w["state"] for w in after["workers"]] == ["leased", "unheard"]
        assert (after["hosts"], after["free"], after["unheard"]) == (0, 0, 2)
        assert [(r["run"], r["tenant"], r["held"], r["hosts"]) for r in after["runs"]] == [
            ("run-a", "alice", ["w0"], ["h0"])]
        # the host's next poll changes nothing: it serves its lease on
        assert again.stub(SECRET).Host(host_poll("h0", lease_id="lease-0"), timeout=5).reclaim == ""
        assert again.status()["leases"] == before["leases"]
        orders = again.stub("tok-a").Run(run_poll("run-a", wanted=["w1"], held=["w0"]), timeout=5)
        assert [g.worker_id for g in orders.granted] == ["w0"]   # not h1: it may be gone
        # h1's first poll of this pool process makes it free, and it is granted at once
        assert again.stub(SECRET).Host(host_poll("h1"), timeout=5).lease.worker_id == "w1"
        assert [w["state"] for w in again.status()["workers"]] == ["leased", "leased"]
    finally:
        again.stop()
    events = read_events(tmp_path / "pool" / "events.jsonl")
    started = [e for e in events if e["kind"] == "pool_started"]
    assert [(e["restarted"], e["hosts"], e["leases"]) for e in started] == [(False, 0, 0), (True, 2, 1)]
    assert [e["kind"] for e in events].count("pool_stopped") == 2


# -- credentials created on first start ----------------------------------------------------------------------

def test_a_pool_given_no_credentials_creates_its_secret_and_a_token_readable_by_its_owner_only(tmp_path, monkeypatch):
    monkeypatch.delenv(service.SECRET_ENV, raising=False)
    monkeypatch.delenv(service.TOKENS_ENV, raising=False)
    directory = tmp_path / "pool"
    served = Served(directory)
    try:
        for name in ("secret", "tokens"):
            assert stat.S_IMODE(os.stat(directory / name).st_mode) == 0o600, name
        secret = (directory / "secret").read_text().strip()
        name, _, token = (directory / "tokens").read_text().strip().partition("=")
        assert name == "default" and secret and token and token != secret
        assert served.status(secret)["hosts"] == 0
        served.stub(token).Run(run_poll("run-d", wanted=[]), timeout=5)
        assert [r["run"] for r in served.status(token)["runs"]] == ["run-d"]
        assert refused_code(served.stub(token).Host, host_poll("h0")) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        served.stop()
    # served again, it keeps them
    assert service.pool_credentials(str(directory)) == (secret, {token: "default"})


def test_a_second_pool_on_the_same_directory_is_refused_while_the_first_serves(pool):
    with pytest.raises(service.PoolBusyError, match="another pool"):
        service.serve(pool.directory, port=0, stop_event=threading.Event())
    assert pool.status()["hosts"] == 0   # the first serves on, its log untouched
