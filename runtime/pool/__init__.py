"""The shared pool: one long-lived set of hosts serving many runs (``elastic pool serve``; docs/pool.md).

- :mod:`runtime.pool.ledger`: hosts, runs, leases and every decision about them (pure, folded from the
  pool's own event log);
- :mod:`runtime.pool.service`: the pool process, its gRPC polls and its record;
- :mod:`runtime.pool.agent`: a host (``elastic worker --pool``): serves one lease at a time, wipes it after;
- the run's side, its launcher when its workers are a pool's hosts, is :mod:`runtime.launch.pool_launcher`.
"""
