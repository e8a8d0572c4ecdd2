"""The ``elastic`` command: ``elastic run``, ``elastic worker``.

Bad input (config, arguments) prints one line, ``elastic: error: ...``, and
exits with status 2; a run that fails exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from elastic.config import ConfigError, load_config

__all__ = ["main"]


def _set_device_count(n: int) -> None:
    """Simulated host devices for this process; must run before JAX starts."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"elastic: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _bundled_trainer(cfg):
    import optax

    from elastic.models import make_model
    from elastic.trainer import Trainer

    init, loss, data = make_model(cfg)
    schedule = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps) if cfg.warmup_steps else cfg.learning_rate
    return Trainer(init=init, loss=loss, optimizer=optax.adam(schedule), data=data, config=cfg)


def _cmd_run(args) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.reference:
        _set_device_count(cfg.devices_per_slice)
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from runtime import ElasticError

    trainer = _bundled_trainer(cfg)

    def on_step(step, loss):
        if not args.quiet:
            print(f"step {step:5d}  loss {loss:.6f}", flush=True)

    try:
        report = trainer.fit(reference=args.reference, on_step=on_step)
    except ElasticError as e:
        print(f"elastic: run failed: {e}", file=sys.stderr)
        return 1
    run_dir = trainer.run_dir()
    summary = {k: report[k] for k in ("mode", "steps_completed", "slices", "devices_per_slice",
                                      "final_state_sha256", "wall_seconds", "client_peak_rss_bytes", "state_bytes")}
    summary["first_loss"], summary["last_loss"] = report["losses"][0], report["losses"][-1]
    print(json.dumps(summary, indent=1))
    print(f"run directory: {run_dir}")
    return 0


def _cmd_worker(args) -> int:
    _set_device_count(args.devices)
    from runtime import worker

    rest = ["--controller", args.controller, "--run-id", args.run_id, "--host", args.host, "--port", str(args.port)]
    if args.worker_id:
        rest += ["--worker-id", args.worker_id]
    worker.main(rest)
    return 0


def main(argv=None) -> int:
    ap = _Parser(prog="elastic", description="Fault-tolerant, elastic training for JAX.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="train a config on local workers")
    run.add_argument("config", help="YAML config file, or a bundled name (tiny, base)")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    run.add_argument("--reference", action="store_true", help="the canonical math in this process, no workers")
    run.add_argument("--quiet", action="store_true", help="no per-step lines")
    w = sub.add_parser("worker", help="serve as a worker of a running controller")
    w.add_argument("--controller", required=True, help="HOST:PORT of the controller")
    w.add_argument("--run-id", required=True)
    w.add_argument("--worker-id", default="")
    w.add_argument("--devices", type=int, default=1, help="simulated CPU devices (XLA host platform)")
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, default=0)
    args, extra = ap.parse_known_args(argv)
    # Overrides may follow flags (`run tiny --reference steps=3`).
    unknown = [x for x in extra if args.command != "run" or x.startswith("-") or "=" not in x]
    if unknown:
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "run":
        args.overrides = list(args.overrides) + extra
    try:
        return {"run": _cmd_run, "worker": _cmd_worker}[args.command](args)
    except ConfigError as e:
        print(f"elastic: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
