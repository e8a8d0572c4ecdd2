"""The measured pipeline bubble of GPipe and 1F1B against the theoretical (S - 1) / (M + S - 1), and each
stage's peak activation memory under both.

The bundled transformer cut into S stages runs through the real stage
programs, each stage's instruction stream on its own thread (queues between
them, in one process: not yet worker processes over the data plane), with a
simulated per-microbatch compute delay on every stage (``--delay`` seconds
per forward and per backward; the last stage's fused forward-and-backward
counts both) so that stages are equal and slower than the host's noise.
For each schedule and microbatch count it prints the measured bubble
(1 - compute time / (stages x step time), the median over ``--steps``
steps after one warm-up step), the theoretical one, their ratio, and each
stage's peak bytes of activations held (inputs kept for the backward,
outputs not yet sent, gradients not yet used); last, every ratio on one line.

Usage: .venv/bin/python benchmarks/pipeline_bubble.py [--stages 4] [--microbatches 8 16] [--delay 0.1]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import pathlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--delay", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    import optax

    from elastic._stage_programs import build_stage_programs
    from elastic.models.transformer import SyntheticTokens, TransformerConfig, init_params, loss_fn
    from runtime import LocalPipeline, theoretical_bubble

    s = args.stages
    t = TransformerConfig(vocab_size=64, max_target_length=16, emb_dim=32, num_layers=s, num_heads=2, mlp_dim=64,
                          pipeline_stages=s)
    data = SyntheticTokens(0, 64, 16, 4)
    print(f"stages={s} delay={args.delay}s per forward and per backward; bubble = median over {args.steps} steps")
    print(f"{'schedule':>8} {'M':>3} {'measured':>9} {'theory':>7} {'ratio':>6}  peak activation KiB per stage")
    ratios = []
    for m in args.microbatches:
        programs = build_stage_programs(init_params=functools.partial(init_params, tcfg=t),
                                        loss=functools.partial(loss_fn, tcfg=t), optimizer=optax.adam(1e-3),
                                        batch_spec=data.element_spec(), num_stages=s, devices_per_slice=1,
                                        num_microbatches=m)
        run = LocalPipeline(programs, data)
        run.load()
        for kind in ("gpipe", "1f1b"):
            run.replan(1, kind)
            run.init(0)
            run.step(0, threads=True, delay=args.delay)   # warm-up: first calls of each program
            traces = [run.step(i, threads=True, delay=args.delay)[1] for i in range(1, 1 + args.steps)]
            bubble = statistics.median(tr.bubble for tr in traces)
            theory = theoretical_bubble(s, m)
            peaks = " ".join(f"{b / 1024:7.1f}" for b in traces[-1].peak_bytes)
            print(f"{kind:>8} {m:>3} {bubble:9.3f} {theory:7.3f} {bubble / theory:6.2f}  {peaks}", flush=True)
            ratios.append(f"{kind} M={m} {bubble / theory:.2f}")
    print(f"measured / theoretical bubble: {', '.join(ratios)}")


if __name__ == "__main__":
    main()
