"""Steady-state step time: jax-elastic runtime vs plain single-process JAX.

Both sides train the bundled transformer with the same global batch on the
same total number of devices, in the same invocation:

- runtime: `slices` worker processes x `devices` devices, via elastic.Trainer;
  step time = median interval between consecutive step commits (after warm-up).
- baseline: one process with slices*devices devices, one `jax.jit` of the whole
  step, batch sharded over all devices; step time = median wall time per step.

Usage: .venv/bin/python benchmarks/step_time.py [--slices 4] [--devices 2] [--steps 30] [key=value ...]
Prints both medians and the ratio runtime/baseline.
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
            f"elastic_microbatches={args.microbatches or 0}", *args.overrides]


def baseline(args) -> None:
    """Runs in a child process with slices*devices host devices; prints JSON."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from elastic.config import load_config
    from elastic.models import make_model

    cfg = load_config("tiny", _overrides(args))
    init, loss, data = make_model(cfg)
    opt = optax.adam(cfg.learning_rate)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    batch_sharding = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(init(jax.random.key(cfg.seed)), replicated)
    state = (params, jax.device_put(opt.init(params), replicated))

    @jax.jit
    def step(state, batch):
        params, opt_state = state
        l, g = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(g, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), l

    times = []
    for s in range(cfg.steps):
        parts = [data.batch(s, m) for m in range(cfg.microbatches)]
        batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        t0 = time.perf_counter()
        batch = jax.device_put(batch, batch_sharding)
        state, l = step(state, batch)
        l.block_until_ready()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"median_step_seconds": statistics.median(times[WARMUP:]), "devices": len(jax.devices()),
                      "global_batch": cfg.global_batch_size}))


def runtime(args) -> dict:
    from elastic.config import load_config
    from elastic.models import make_model
    from elastic.trainer import Trainer
    import optax

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config("tiny", _overrides(args) + [f"base_output_directory={out}", "run_name=bench"])
        init, loss, data = make_model(cfg)
        report = Trainer(init=init, loss=loss, optimizer=optax.adam(cfg.learning_rate), data=data, config=cfg).fit()
        events = [json.loads(line) for line in open(pathlib.Path(out) / "bench" / "events.jsonl")]
    commits = [e["t"] for e in events if e["kind"] == "step_committed"]
    gaps = [b - a for a, b in zip(commits, commits[1:])][WARMUP:]
    return {"median_step_seconds": statistics.median(gaps), "global_batch": report["global_batch_size"],
            "client_peak_rss_bytes": report["client_peak_rss_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slices", type=int, default=4)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--microbatches", type=int, default=0)
    ap.add_argument("--baseline-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.steps <= WARMUP + 2:
        ap.error(f"--steps must exceed {WARMUP + 2}")
    if args.baseline_child:
        baseline(args)
        return
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={args.slices * args.devices}")
    cmd = [sys.executable, __file__, "--baseline-child", *sys.argv[1:]]
    child = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, check=True)
    base = json.loads(child.stdout.strip().splitlines()[-1])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rt = runtime(args)
    assert rt["global_batch"] == base["global_batch"], (rt, base)
    print(f"config: {args.slices} slices x {args.devices} devices, global batch {base['global_batch']}, "
          f"overrides {args.overrides}")
    print(f"baseline (one jit over {base['devices']} devices): {base['median_step_seconds'] * 1e3:.1f} ms/step")
    print(f"jax-elastic runtime:                        {rt['median_step_seconds'] * 1e3:.1f} ms/step")
    print(f"ratio runtime/baseline: {rt['median_step_seconds'] / base['median_step_seconds']:.2f}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
