"""Steady-state step time: jax-elastic runtime vs the JAX a user would run instead.

All three train the bundled transformer with the same global batch on the
same total number of devices, in the same invocation:

- runtime: `slices` worker processes x `devices` devices, via elastic.Trainer;
  step time = median interval between consecutive step commits (after warm-up).
- one process: slices*devices devices, one `jax.jit` of the whole step, batch
  sharded over all devices; step time = median wall time per step (the limit
  on one machine);
- multi-controller JAX: `slices` processes of `devices` devices joined by
  `jax.distributed.initialize` with CPU collectives (gloo), one `jax.jit` over
  the global mesh, each process feeding its share of the batch: the SPMD setup
  the runtime replaces, so the fair yardstick.

With `--hosts H` each slice is H worker processes of `devices / H` devices
(`elastic_hosts_per_slice`), and the multi-controller baseline has as many
processes (`slices x H`) with as many devices each: the same processes and
devices, one jit over all of them.

Usage: .venv/bin/python benchmarks/step_time.py [--slices 4] [--devices 2] [--hosts 1] [--steps 30] [key=value ...]
Prints the three medians and the ratios runtime/multi-controller and runtime/one-process (last).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
WARMUP = 5


def _overrides(args) -> list[str]:
    return [f"dcn_data_parallelism={args.slices}", f"ici_fsdp_parallelism={args.devices}", f"steps={args.steps}",
            f"elastic_microbatches={args.microbatches or 0}", f"elastic_hosts_per_slice={args.hosts}",
            *args.overrides]


class SpmdJob:
    """The plain-JAX job the runtime replaces: the bundled model, Adam, one ``jit`` of the whole step over
    a mesh of every process's devices, each process feeding its rows of the global batch.

    Built after ``jax.distributed.initialize`` when ``processes > 1``. Shared
    by the baselines here and the checkpoint-restart baseline of
    ``recovery_vs_restart.py``.
    """

    def __init__(self, cfg, processes: int, process_id: int):
        import jax
        import numpy as np
        import optax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        from elastic.models import make_model

        self.cfg, self.processes = cfg, processes
        init, loss, self._data = make_model(cfg)
        opt = optax.adam(cfg.learning_rate)
        mesh = Mesh(np.array(jax.devices()), ("data",))
        self.batch_sharding = NamedSharding(mesh, P("data"))
        self.replicated = NamedSharding(mesh, P())
        # This process's rows of the global batch (all of them with one process): its microbatches, or with more
        # processes than microbatches (slices of several hosts) its share of the rows of every microbatch.
        self.process_id = process_id
        self._mine = [m for m in range(cfg.microbatches)
                      if cfg.microbatches < processes or m * processes // cfg.microbatches == process_id]

        def init_state(key):
            params = init(key)
            return params, opt.init(params)

        def step(state, batch):
            params, opt_state = state
            l, g = jax.value_and_grad(loss)(params, batch)
            updates, opt_state = opt.update(g, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), l

        self.init_state, self.step = init_state, step

    def rows(self, step: int) -> dict:
        """This process's rows of a step's global batch, on the host."""
        import numpy as np

        parts = [self._data.batch(step, m) for m in self._mine]
        rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        if len(self._mine) == self.cfg.microbatches and self.processes > 1:   # every microbatch: this one's share
            n = len(next(iter(rows.values()))) // self.processes
            rows = {k: v[self.process_id * n:(self.process_id + 1) * n] for k, v in rows.items()}
        return rows

    def place(self, rows: dict):
        """The global batch array from every process's :meth:`rows`."""
        import jax

        if self.processes > 1:
            return jax.make_array_from_process_local_data(self.batch_sharding, rows)
        return jax.device_put(rows, self.batch_sharding)

    def batch(self, step: int):
        return self.place(self.rows(step))


def baseline(args) -> None:
    """Runs in a child process (one of ``--processes`` with ``--process-id``); prints JSON from process 0.

    One process: slices*devices host devices. Several: each has ``devices``
    host devices, joined by ``jax.distributed`` (gloo) into one global mesh.
    """
    import jax

    from elastic.config_loading import load_config

    if args.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.processes,
                                   process_id=args.process_id, initialization_timeout=300)
    cfg = load_config("tiny", _overrides(args))
    job = SpmdJob(cfg, args.processes, args.process_id)
    state = jax.jit(job.init_state, out_shardings=job.replicated)(jax.random.key(cfg.seed))
    step = jax.jit(job.step).lower(state, job.batch(0)).compile()
    if args.processes > 1:   # every process compiled before the first collective: gloo gives its peers 30 s to
        from jax._src import distributed   # connect, less than a compile on a loaded host may take

        distributed.global_state.client.wait_at_barrier("step-time-compiled", 600_000)
    times = []
    for s in range(cfg.steps):
        rows = job.rows(s)
        t0 = time.perf_counter()
        state, l = step(state, job.place(rows))
        l.block_until_ready()
        times.append(time.perf_counter() - t0)
    if args.process_id == 0:
        print(json.dumps({"median_step_seconds": statistics.median(times[WARMUP:]), "devices": len(jax.devices()),
                          "global_batch": cfg.global_batch_size}))


def runtime(args) -> dict:
    from elastic.config_loading import load_config
    from elastic.models import make_model
    from elastic.trainer import Trainer
    import optax

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config("tiny", _overrides(args) + [f"base_output_directory={out}", "run_name=bench"])
        init, loss, data = make_model(cfg)
        report = Trainer(init=init, loss=loss, optimizer=optax.adam(cfg.learning_rate), data=data, config=cfg).fit()
        events = [json.loads(line) for line in open(pathlib.Path(out) / "bench" / "events.jsonl")]
    committed = [e for e in events if e["kind"] == "step_committed"]
    commits = [e["t"] for e in committed]
    gaps = [b - a for a, b in zip(commits, commits[1:])][WARMUP:]
    # Where a step goes, from the workers' own timings (the slowest worker's, per step).
    phases = {k: statistics.median(e[f"{k}_seconds"] for e in committed[WARMUP + 1:]) for k in ("grad", "reduce", "apply")}
    # Finer (runtime.core.timing.Clock in the worker): median over steps of the slowest worker's time in each.
    names = sorted({k for e in committed for k in e.get("phases", {})})
    fine = {k: statistics.median(e.get("phases", {}).get(k, 0.0) for e in committed[WARMUP + 1:]) for k in names}
    return {"median_step_seconds": statistics.median(gaps), "global_batch": report["global_batch_size"],
            "client_peak_rss_bytes": report["client_peak_rss_bytes"], "phases": phases, "fine": fine}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slices", type=int, default=4)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--microbatches", type=int, default=0)
    ap.add_argument("--hosts", type=int, default=1, help="worker processes per slice (elastic_hosts_per_slice)")
    ap.add_argument("--baseline-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.steps <= WARMUP + 2:
        ap.error(f"--steps must exceed {WARMUP + 2}")
    if args.hosts < 1 or args.devices % args.hosts:
        ap.error(f"--hosts {args.hosts} must divide --devices {args.devices}")
    if args.baseline_child:
        baseline(args)
        return
    base = _baseline(args, processes=1, devices=args.slices * args.devices)
    multi = _baseline(args, processes=args.slices * args.hosts, devices=args.devices // args.hosts)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rt = runtime(args)
    assert rt["global_batch"] == base["global_batch"] == multi["global_batch"], (rt, base, multi)
    print(f"config: {args.slices} slices x {args.devices} devices ({args.hosts} host(s) a slice), global batch "
          f"{base['global_batch']}, overrides {args.overrides}")
    print(f"one process (one jit over {base['devices']} devices):      {base['median_step_seconds'] * 1e3:7.1f} ms/step")
    n = args.slices * args.hosts
    print(f"multi-controller JAX ({n} processes, gloo):       {multi['median_step_seconds'] * 1e3:7.1f} ms/step")
    print(f"jax-elastic runtime ({n} workers):                {rt['median_step_seconds'] * 1e3:7.1f} ms/step")
    ph = rt["phases"]
    print(f"  runtime phases (median over steps of the slowest worker's): grad {ph['grad'] * 1e3:.1f} ms   "
          f"reduce, waiting for peers included {ph['reduce'] * 1e3:.1f} ms   apply {ph['apply'] * 1e3:.1f} ms")
    print("  finer (median over steps of the slowest worker's time in each): " +
          "   ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(rt["fine"].items(), key=lambda kv: -kv[1])))
    print(f"ratio runtime/multi-controller: {rt['median_step_seconds'] / multi['median_step_seconds']:.2f}   "
          f"ratio runtime/one-process: {rt['median_step_seconds'] / base['median_step_seconds']:.2f}")


def _baseline(args, processes: int, devices: int) -> dict:
    """Runs the plain-JAX baseline in ``processes`` child processes of ``devices`` devices; process 0's JSON."""
    import socket

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    procs = [subprocess.Popen([sys.executable, __file__, "--baseline-child", "--processes", str(processes),
                               "--process-id", str(i), "--coordinator", coordinator, *sys.argv[1:]],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for i in range(processes)]
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"baseline with {processes} process(es) failed:\n{err[-3000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
