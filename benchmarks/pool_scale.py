"""The shared pool's cost per poll as the pool grows: the pool process's CPU for one host's poll and one run's
poll, with 100 hosts (the baseline) and more, in one sitting.

The pool's service (``runtime.pool.service.PoolService``) and its ledger run in this process, called as gRPC
calls them (a context giving the credential), so what is measured is the pool's own work: deciding, recording
(to a real event log in a temporary directory), answering. The gRPC transport costs the same per call at any size
and is left out. Half the hosts are leased to one run, the other half free, every host has polled once; then each
host polls ``--rounds`` times (steady state: nothing changes) and the run polls as often as the hosts do in all.

Prints, per host count: CPU microseconds per host poll and per run poll (``time.process_time``), each as a ratio
against 100 hosts, and the pool's CPU share at the hosts' 5 polls a second (``runtime.pool.agent.POLL_SECONDS``).
A host's poll should cost the same at any size. A run's poll lists every worker it holds (polls carry state, not
changes), and here the run holds half the hosts, so its cost grows with the run, not with the pool.

    .venv/bin/python benchmarks/pool_scale.py [--hosts 100,1000,4000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime._proto import elastic_pb2 as pb  # noqa: E402
from runtime.core.events import EventLog  # noqa: E402
from runtime.pool import service  # noqa: E402
from runtime.pool.agent import POLL_SECONDS  # noqa: E402
from runtime.pool.ledger import Ledger  # noqa: E402
from runtime.wire.auth import METADATA_KEY  # noqa: E402


class _Context:
    def __init__(self, credential: str):
        self.metadata = [(METADATA_KEY, credential)]

    def invocation_metadata(self):
        return self.metadata

    def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")


def measure(hosts: int, rounds: int, directory: str) -> tuple[float, float]:
    """(CPU seconds per host poll, per run poll) with ``hosts`` hosts, half leased to one run."""
    log = EventLog(os.path.join(directory, f"pool-{hosts}.jsonl"))
    pool = service.PoolService(Ledger(), log, "pool-secret", {"client-token": "bench"})
    as_host, as_client = _Context("pool-secret"), _Context("client-token")
    for k in range(hosts):
        pool.Host(pb.HostPoll(host_id=f"h{k}", devices=1, platform="cpu", pid=1000 + k), as_host)
    wanted = [f"w{k}" for k in range(hosts // 2)]
    run = pb.RunPoll(run_id="r", devices=1, min_hosts=1, controller="127.0.0.1:1", run_secret="s", wanted=wanted,
                     grace_seconds=600.0, run_name="bench")
    pool.Run(run, as_client)
    polls = [pb.HostPoll(host_id=f"h{k}", devices=1, platform="cpu", pid=1000 + k,
                         lease_id=pool.ledger.hosts[f"h{k}"].lease) for k in range(hosts)]
    for p in polls:   # each leased host takes its lease (serving): from now on nothing changes
        pool.Host(p, as_host)
    steady = pb.RunPoll(run_id="r", devices=1, min_hosts=1, controller="127.0.0.1:1", run_secret="s",
                        held=wanted, grace_seconds=600.0, run_name="bench")
    t0 = time.process_time()
    for _ in range(rounds):
        for p in polls:
            pool.Host(p, as_host)
    per_host = (time.process_time() - t0) / (rounds * hosts)
    t0 = time.process_time()
    for _ in range(rounds * 20):
        pool.Run(steady, as_client)
    per_run = (time.process_time() - t0) / (rounds * 20)
    log.close()
    return per_host, per_run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="100,1000,4000", help="host counts, the first is the baseline")
    ap.add_argument("--rounds", type=int, default=5, help="polls of every host per count")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.hosts.split(",")]
    with tempfile.TemporaryDirectory(prefix="pool-scale-") as directory:
        rows = [(n, *measure(n, args.rounds, directory)) for n in counts]
    base_host, base_run = rows[0][1], rows[0][2]
    print(f"{'hosts':>6} {'us/host poll':>13} {'ratio':>6} {'us/run poll':>12} {'ratio':>6} {'pool CPU at 5 polls/s/host':>27}")
    for n, per_host, per_run in rows:
        share = per_host * n / POLL_SECONDS
        print(f"{n:>6} {per_host * 1e6:>13.1f} {per_host / base_host:>6.2f} {per_run * 1e6:>12.1f} "
              f"{per_run / base_run:>6.2f} {share:>26.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
