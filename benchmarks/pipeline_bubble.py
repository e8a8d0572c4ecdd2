"""The measured pipeline bubble of GPipe and 1F1B against the theoretical (S - 1) / (M + S - 1), and each
stage's peak activation memory under both.

In one process (the default): the bundled transformer cut into S stages runs
through the real stage programs, each stage's instruction stream on its own
thread (queues between them), with a simulated per-microbatch compute delay
on every stage (``--delay`` seconds per forward and per backward; the last
stage's fused forward-and-backward counts both) so that stages are equal and
slower than the host's noise. For each schedule and microbatch count it
prints the measured bubble (1 - compute time / (stages x step time),
``runtime/pipeline/bubble.py``, the median over ``--steps`` steps after one
warm-up step), the theoretical one, their ratio, and each stage's peak bytes
of activations held (inputs kept for the backward, outputs not yet sent,
gradients not yet used); last, every ratio on one line.

With ``--workers``: the same on stage worker processes. Each schedule and M
is one ``elastic run tiny`` of S stages x 1 replica (``ici_fsdp_parallelism=1``,
S decoder layers, 1 + ``--steps`` steps), activations over the data plane,
with the delay set for its workers (``ELASTIC_SIMULATED_STAGE_DELAY``, a
benchmark-only variable each worker process reads; never a config key). Each
committed step records the bubble its workers measured (each stage's compute
seconds against the slowest stage's stream, ``step_committed.bubble``); this
prints their median after the first step (the warm-up), against the theory;
last, every ratio on one line.

Usage: .venv/bin/python benchmarks/pipeline_bubble.py [--workers] [--stages 4] [--microbatches 8 16] [--delay 0.1]
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import sys
import pathlib
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

SCHEDULES = ("gpipe", "1f1b")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", action="store_true",
                    help="stage worker processes (elastic run tiny) instead of threads in this process")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--delay", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    print(f"stages={args.stages} delay={args.delay}s per forward and per backward; bubble = median over "
          f"{args.steps} steps after one warm-up step, {'on stage worker processes' if args.workers else 'threads'}")
    ratios = (on_workers if args.workers else in_one_process)(args)
    print(f"measured / theoretical bubble: {', '.join(ratios)}")


def in_one_process(args) -> list[str]:
    """Each stage's stream on a thread of this process; prints a line per schedule and M, returns the ratios."""
    import optax

    from elastic._programs import build_programs
    from elastic.models.transformer import SyntheticTokens, TransformerConfig, init_params, loss_fn
    from runtime import LocalRun, theoretical_bubble

    s = args.stages
    t = TransformerConfig(vocab_size=64, max_target_length=16, emb_dim=32, num_layers=s, num_heads=2, mlp_dim=64,
                          pipeline_stages=s)
    data = SyntheticTokens(0, 64, 16, 4)
    print(f"{'schedule':>8} {'M':>3} {'measured':>9} {'theory':>7} {'ratio':>6}  peak activation KiB per stage")
    ratios = []
    for m in args.microbatches:
        programs = build_programs(init_params=functools.partial(init_params, tcfg=t),
                                  loss=functools.partial(loss_fn, tcfg=t), optimizer=optax.adam(1e-3),
                                  batch_spec=data.element_spec(), num_stages=s, devices_per_slice=1,
                                  num_microbatches=m)
        run = LocalRun(programs, data)
        run.load()
        for kind in SCHEDULES:
            run.replan(1, kind)
            run.init(0)
            run.step(0, threads=True, delay=args.delay)   # warm-up: first calls of each program
            traces = [run.step(i, threads=True, delay=args.delay)[1] for i in range(1, 1 + args.steps)]
            bubble = statistics.median(tr.bubble for tr in traces)
            theory = theoretical_bubble(s, m)
            peaks = " ".join(f"{b / 1024:7.1f}" for b in traces[-1].peak_bytes)
            print(f"{kind:>8} {m:>3} {bubble:9.3f} {theory:7.3f} {bubble / theory:6.2f}  {peaks}", flush=True)
            ratios.append(f"{kind} M={m} {bubble / theory:.2f}")
    return ratios


def on_workers(args) -> list[str]:
    """One pipelined ``elastic run tiny`` per schedule and M on worker processes; prints a line each (with each
    measured step's bubble), returns the ratios."""
    from _cli import run_elastic
    from runtime import SIMULATED_STAGE_DELAY_VARIABLE, theoretical_bubble

    s = args.stages
    base = pathlib.Path(tempfile.mkdtemp(prefix="pipeline-bubble-"))
    print(f"{'schedule':>8} {'M':>3} {'measured':>9} {'theory':>7} {'ratio':>6}  each step's (the first: warm-up)")
    ratios = []
    try:
        for m in args.microbatches:
            for kind in SCHEDULES:
                _, events = run_elastic(base, f"{kind}-m{m}", [
                    "run", "tiny", f"dcn_pipeline_parallelism={s}", "dcn_data_parallelism=1", "ici_fsdp_parallelism=1",
                    f"base_num_decoder_layers={s}", f"steps={1 + args.steps}", f"elastic_microbatches={m}",
                    f"elastic_pipeline_schedule={kind}", "elastic_standby_workers=0"],
                    env={SIMULATED_STAGE_DELAY_VARIABLE: str(args.delay)})
                steps = [e["bubble"] for e in events if e["kind"] == "step_committed"]
                bubble = statistics.median(steps[1:])
                theory = theoretical_bubble(s, m)
                each = " ".join(f"{b:.3f}" for b in steps)
                print(f"{kind:>8} {m:>3} {bubble:9.3f} {theory:7.3f} {bubble / theory:6.2f}  {each}", flush=True)
                ratios.append(f"{kind} M={m} {bubble / theory:.2f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return ratios


if __name__ == "__main__":
    main()
