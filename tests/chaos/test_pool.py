"""A shared pool serves many runs, with real processes: the pool (``elastic pool serve``), its local hosts (each a
real agent process that forks a real worker for each lease), and each run's client (``elastic run ...
elastic_pool=ADDRESS``), all on loopback.

1. Two runs of 2 slices and a spare each hold the pool's 6 hosts; a third run waits in the queue and starts on
   the first's hosts once it finishes. The pool is killed and started again meanwhile: it shows the same leases
   and every run goes on. A call without the client token, and a call to one run's worker with another run's
   secret, are refused and counted. The second run's client is killed: after its grace its hosts are back in
   the pool, wiped (no lease directory, no snapshot left). Each run that finishes is bit-identical to its
   reference.
2. A run of a higher priority takes hosts from a lower one, which shrinks at a step boundary and grows back
   once they are free: no step lost, bit-identical.

Each pool's workers sleep a simulated 40 ms per step ($ELASTIC_SIMULATED_STAGE_DELAY), so a run lasts long
enough for these things to happen to it while it trains, without keeping the cores busy.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
import pytest

from tests.conftest import ROOT, processes, run_cli
from tests.support.events import kinds, live_events

pytestmark = pytest.mark.timeout(400)

TINY = ["tiny", "dcn_data_parallelism=2", "ici_fsdp_parallelism=1"]


def _env(**extra) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **extra)
    env.pop("XLA_FLAGS", None)
    return env


def _wait(what: str, check, within: float, every: float = 0.3):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"not within {within:.0f} s: {what}")


class Pool:
    """``elastic pool serve DIR --local-hosts N`` in a subprocess; its hosts outlive it (as they should)."""

    def __init__(self, directory: pathlib.Path, hosts: int):
        self.dir, self.hosts = directory, hosts
        self.proc = None
        self.start()

    def start(self) -> None:
        log = open(self.dir.parent / f"{self.dir.name}.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "elastic.cli", "pool", "serve", str(self.dir),
                                      "--local-hosts", str(self.hosts)], stdout=log, stderr=subprocess.STDOUT,
                                     env=_env(ELASTIC_SIMULATED_STAGE_DELAY="0.04"), cwd=self.dir.parent)
        _wait("the pool serves", lambda: (self.dir / "pool.json").exists() and
              json.loads((self.dir / "pool.json").read_text())["pid"] == self.proc.pid, 60)

    @property
    def address(self) -> str:
        return json.loads((self.dir / "pool.json").read_text())["address"]

    @property
    def token(self) -> str:
        return (self.dir / "tokens").read_text().split("=", 1)[1].strip()

    def status(self, credential: str | None = None) -> dict:
        from runtime import pool_status

        return pool_status(self.address, credential or (self.dir / "secret").read_text().strip())

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        hosts = self.dir / "hosts.json"
        for pid in (json.loads(hosts.read_text()).values() if hosts.exists() else ()):
            try:
                os.killpg(pid, signal.SIGKILL)   # an agent's session: its zygote and workers too
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture
def pools(tmp_path):
    made = []
    yield lambda name, hosts: made.append(Pool(tmp_path / name, hosts)) or made[-1]
    for p in made:
        p.close()


def _run(tmp_path, pool: Pool, name: str, *overrides: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.out", "wb")
    return subprocess.Popen([sys.executable, "-m", "elastic.cli", "run", *TINY, *overrides, f"run_name={name}",
                             f"base_output_directory={tmp_path}", f"elastic_pool={pool.address}", "--quiet"],
                            stdout=log, stderr=subprocess.STDOUT, env=_env(ELASTIC_POOL_TOKEN=pool.token),
                            cwd=tmp_path)


def _finished(tmp_path, proc: subprocess.Popen, name: str, within: float = 240) -> dict:
    proc.wait(within)
    out = (tmp_path / f"{name}.out").read_text()
    assert proc.returncode == 0, f"run {name} failed ({proc.returncode}):\n{out[-3000:]}"
    return json.loads((tmp_path / name / "report.json").read_text())


def _reference(tmp_path, *overrides: str) -> str:
    _, report = run_cli(["run", *TINY, *overrides, f"run_name=ref-{abs(hash(overrides))}", "--reference"],
                        tmp_path / "refs")
    return report["final_state_digest"]


def _committing(tmp_path, name: str, steps: int = 1):
    return lambda: len(kinds(live_events(tmp_path / name), "step_committed")) >= steps


def test_a_pool_serves_two_runs_at_once_queues_a_third_survives_its_own_restart_and_wipes_a_dead_clients_hosts(
        tmp_path, pools):
    pool = pools("pool", 6)
    a_keys, c_keys = ("steps=300", "seed=1", "elastic_spares=1"), ("steps=60", "seed=3", "elastic_min_slice_count=2")
    a = _run(tmp_path, pool, "a", *a_keys)
    b = _run(tmp_path, pool, "b", "steps=5000", "seed=2", "elastic_spares=1", "elastic_snapshot_interval=4",
             "elastic_client_grace_seconds=3")
    references = {"a": _reference(tmp_path, *a_keys), "c": _reference(tmp_path, *c_keys)}
    _wait("a and b train", lambda: _committing(tmp_path, "a")() and _committing(tmp_path, "b")(), 120)
    c = _run(tmp_path, pool, "c", *c_keys)
    _wait("c waits in the queue", lambda: kinds(live_events(tmp_path / "c"), "pool_waiting"), 60)
    before = pool.status()
    assert before["free"] == 0 and len(before["leases"]) == 6 and before["queue"], before

    # The pool dies and comes back: the same leases; nothing of the runs noticed.
    pool.kill()
    time.sleep(1.0)
    pool.start()
    after = pool.status()
    assert [(x["run"], x["worker"], x["host"]) for x in after["leases"]] == \
        [(x["run"], x["worker"], x["host"]) for x in before["leases"]]

    # No token, a wrong one: refused and counted. Another run's secret: refused by the worker, counted in a's log.
    from runtime._proto import elastic_pb2 as pb
    from runtime._proto import elastic_pb2_grpc as pb_grpc
    from runtime.wire import rpc

    for credential in ("", "not-a-token"):
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.PoolStub(rpc.channel(pool.address, credential)).Run(pb.RunPoll(run_id="intruder"), timeout=5)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    mine = pool.status(pool.token)
    assert "workers" not in mine and {r["run"] for r in mine["runs"]} == {r["run"] for r in before["runs"]}
    worker = next(e for e in live_events(tmp_path / "a") if e["kind"] == "worker_registered")
    with pytest.raises(grpc.RpcError) as refused:
        pb_grpc.WorkerStub(rpc.channel(worker["address"], (tmp_path / "c" / ".secret").read_text().strip())) \
            .Progress(pb.ProgressRequest(), timeout=5)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    _wait("the pool counted the refused calls", lambda: sum(pool.status().get("refused", {}).values()) >= 2, 10)

    # a finishes: c, queued, starts on its hosts.
    report_a = _finished(tmp_path, a, "a")
    assert report_a["final_state_digest"] == references["a"]
    a_events = live_events(tmp_path / "a")
    assert any(e["kind"] == "security_refused" for e in a_events), "a's worker did not count the refused call"
    c_events = _wait("c is granted hosts", lambda: kinds(live_events(tmp_path / "c"), "lease_granted"), 60)
    assert c_events[0]["t"] >= kinds(a_events, "run_finished")[0]["t"]

    # b's client is killed: after its grace its hosts are wiped and back in the pool.
    _wait("b took a snapshot", lambda: kinds(live_events(tmp_path / "b"), "snapshot_saved") or
          kinds(live_events(tmp_path / "b"), "snapshots_saved"), 60)
    b_run = kinds(live_events(tmp_path / "b"), "run_started")[0]["run_id"]
    b_leases = [x for x in pool.status()["leases"] if x["run"] == b_run]
    assert len(b_leases) == 3, b_leases
    from runtime import default_snapshot_root

    b_snapshots = pathlib.Path(default_snapshot_root(), b_run)
    assert [p for p in b_snapshots.glob("*") if p.name.startswith("pool-")], "b kept no snapshot on its hosts"
    b.kill()
    b.wait()
    _wait("b's hosts are back in the pool", lambda: not [x for x in pool.status()["leases"] if x["run"] == b_run], 40)
    pool_log = [json.loads(line) for line in (pool.dir / "events.jsonl").read_text().splitlines()]
    ended = {e["lease"]: e for e in kinds(pool_log, "pool_lease_ended")}
    reclaimed = {e["lease"]: e["why"] for e in kinds(pool_log, "pool_lease_reclaimed")}
    for x in b_leases:
        assert reclaimed[x["lease"]] == "client gone" and ended[x["lease"]]["wiped"], (x, ended.get(x["lease"]))
        assert not (pool.dir / "hosts" / x["host"] / "leases" / x["lease"]).exists()
    snapshots = [p for p in b_snapshots.glob("*") if p.name.startswith("pool-")]
    assert not snapshots, f"b's snapshots were left on its hosts: {snapshots}"
    b_pids = {e["pid"] for e in kinds(live_events(tmp_path / "b"), "worker_registered")}
    assert not b_pids & set(processes()), "a worker of b outlived its lease"

    report_c = _finished(tmp_path, c, "c")
    assert report_c["final_state_digest"] == references["c"]
    assert _wait("every host free again", lambda: pool.status()["free"] == 6, 30)


def test_a_run_of_a_higher_priority_takes_hosts_from_a_lower_one_which_shrinks_and_grows_back(tmp_path, pools):
    pool = pools("pool", 4)
    low_keys, high_keys = ("dcn_data_parallelism=4", "steps=500", "seed=4"), ("steps=40", "seed=5")
    low = _run(tmp_path, pool, "low", *low_keys)
    references = {"low": _reference(tmp_path, *low_keys), "high": _reference(tmp_path, *high_keys)}
    _wait("low trains on every host", _committing(tmp_path, "low", 5), 120)
    high = _run(tmp_path, pool, "high", *high_keys, "elastic_pool_priority=5")
    report_high = _finished(tmp_path, high, "high")
    assert report_high["final_state_digest"] == references["high"]
    report_low = _finished(tmp_path, low, "low")
    events = live_events(tmp_path / "low")
    preempted = kinds(events, "lease_preempted")
    assert preempted and sum(len(e["workers"]) for e in preempted) == 2, preempted
    released = kinds(events, "released")
    assert released and len(released[0]["active"]) == 2
    grown = [e for e in kinds(events, "grown") if e["t"] > released[-1]["t"]]
    assert grown and len(grown[-1]["active"]) == 4, "low did not grow back once high had finished"
    assert report_low["steps_lost"] == 0 and not report_low["failures"]
    assert report_low["final_state_digest"] == references["low"]


def test_an_rl_runs_samplers_lease_hosts_too_and_a_lost_one_is_relaunched_on_the_pool(tmp_path, pools, monkeypatch):
    pool = pools("pool", 5)
    monkeypatch.setenv("ELASTIC_POOL_TOKEN", pool.token)
    _, report = run_cli(["chaos", "rl_tiny", f"elastic_pool={pool.address}", "steps=12",
                         "--faults", "kill:role=sampler@step=5"], tmp_path)
    assert report["verdict"] == "pass", report["verdict_reasons"]
    leased = {x["worker"] for x in report["pool"]["leases"]}
    assert {"w0", "w1", "s2", "s3"} <= leased and len(leased) == 5, leased   # the lost sampler's successor too
    assert report["rl"]["samplers_lost"] and report["steps_lost"] == 0
