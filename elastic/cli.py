"""The ``elastic`` command: ``run``, ``chaos``, ``report``, ``worker``.

Bad input (config, arguments, fault specs, files) prints one line,
``elastic: error: ...``, and exits with status 2; a run that fails, or a
chaos run whose verdict is "fail", exits with status 1.

This module is the top of the stack: it is the one place in ``elastic``
that may import ``chaos`` (for ``elastic chaos``), which itself builds on
``elastic``.
"""

from __future__ import annotations

import argparse
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

    with _progress(cfg.steps, args.quiet) as on_step:
        try:
            report = trainer.fit(reference=args.reference, on_step=on_step)
        except ElasticError as e:
            print(f"elastic: run failed: {e}", file=sys.stderr)
            print(f"report: {trainer.run_dir() / 'report.html'}", file=sys.stderr)
            return 1
    _finish(report, trainer.run_dir(), args.quiet)
    return 0


def _progress(steps: int, quiet: bool):
    """A context giving an ``on_step`` callback that drives a rich progress bar (or nothing when quiet)."""
    import contextlib

    if quiet:
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    @contextlib.contextmanager
    def bar():
        with Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                      TimeElapsedColumn(), transient=False) as progress:
            task = progress.add_task("train", total=steps, loss="-")

            def on_step(step, loss):
                progress.update(task, completed=step + 1, loss=f"{loss:.4f}")
            yield on_step
    return bar()


def _finish(report: dict, run_dir, quiet: bool) -> None:
    from elastic.summary import print_summary, summary_text

    if quiet:
        print(summary_text(report))
    else:
        print_summary(report)
    print(f"report: {run_dir / 'report.html'}")


def _cmd_chaos(args) -> int:
    from chaos.harness import ChaosOptions, run_chaos
    from chaos.spec import FaultSpecError, load_scenario, parse_faults, parse_duration

    try:
        scenario = load_scenario(args.scenario) if args.scenario else None
        config = args.config or (scenario.config if scenario else None)
        if config is None:
            raise FaultSpecError("give a CONFIG or --scenario FILE")
        overrides = list(scenario.overrides if scenario else ()) + args.overrides
        faults = list(scenario.faults if scenario else ()) + (parse_faults(args.faults) if args.faults else [])
        mtbf = parse_duration(args.mtbf) if args.mtbf else (scenario.mtbf_seconds if scenario else None)
        duration = parse_duration(args.duration) if args.duration else (scenario.duration_seconds if scenario else None)
        if duration and not mtbf:
            raise FaultSpecError("--duration needs --mtbf (soak mode draws random faults)")
        if not faults and not mtbf:
            raise FaultSpecError("no faults: give --faults SPEC, --scenario FILE or --mtbf/--duration")
    except ValueError as e:   # FaultSpecError, bad durations
        print(f"elastic: error: {e}", file=sys.stderr)
        return 2
    cfg = load_config(config, overrides)
    _set_device_count(cfg.devices_per_slice)   # the reference runs in this process
    seed = args.seed if args.seed is not None else (scenario.seed if scenario else 0)
    options = ChaosOptions(faults=tuple(faults), seed=seed, mtbf_seconds=mtbf, duration_seconds=duration,
                           scenario=scenario.name if scenario else None)
    with _progress(cfg.steps, args.quiet) as on_step:
        try:
            report, run_dir = run_chaos(_bundled_trainer, cfg, options, on_step=on_step)
        except ValueError as e:
            print(f"elastic: error: {e}", file=sys.stderr)
            return 2
    _finish(report, run_dir, args.quiet)
    if scenario is not None and scenario.expect != "pass":
        print(f"scenario {scenario.name!r} expects the verdict {scenario.expect!r}: got {report['verdict']!r}")
    return 0 if report["verdict"] == "pass" else 1   # the exit status is the verdict, so it can gate CI


def _cmd_report(args) -> int:
    import pathlib

    from elastic.report import render_run

    run_dir = pathlib.Path(args.run_dir)
    path = run_dir / "events.jsonl"
    if not path.is_file():
        print(f"elastic: error: {path} not found (is {run_dir} a run directory?)", file=sys.stderr)
        return 2
    try:
        report = render_run(run_dir)
    except (ValueError, KeyError, TypeError) as e:
        print(f"elastic: error: {path} is not a valid event log: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    _finish(report, run_dir, args.quiet)
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
    ch = sub.add_parser("chaos", help="run a config under injected faults and judge it against a fault-free run")
    ch.add_argument("config", nargs="?", help="YAML config file or bundled name (or take it from --scenario)")
    ch.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    ch.add_argument("--faults", help="fault list, e.g. 'kill@step=10,hang(resume=3s):slice=2@step=20'")
    ch.add_argument("--scenario", help="scenario YAML file (e.g. chaos/scenarios/kill-three.yml)")
    ch.add_argument("--mtbf", help="soak mode: mean time between random faults (e.g. 20s)")
    ch.add_argument("--duration", help="soak mode: stop training after this long (e.g. 5m)")
    ch.add_argument("--seed", type=int, default=None, help="seed of random targets and schedules")
    ch.add_argument("--quiet", action="store_true", help="no progress bar")
    rp = sub.add_parser("report", help="re-render report.json and report.html from a run's events.jsonl")
    rp.add_argument("run_dir")
    rp.add_argument("--quiet", action="store_true", help="plain-text summary")
    w = sub.add_parser("worker", help="serve as a worker of a running controller")
    w.add_argument("--controller", required=True, help="HOST:PORT of the controller")
    w.add_argument("--run-id", required=True)
    w.add_argument("--worker-id", default="")
    w.add_argument("--devices", type=int, default=1, help="simulated CPU devices (XLA host platform)")
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, default=0)
    args, extra = ap.parse_known_args(argv)
    # Overrides may follow flags (`run tiny --reference steps=3`).
    takes_overrides = args.command in ("run", "chaos")
    unknown = [x for x in extra if not takes_overrides or x.startswith("-") or "=" not in x]
    if unknown:
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    if takes_overrides:
        args.overrides = list(args.overrides) + extra
        if args.command == "chaos" and args.config and "=" in args.config:
            args.overrides.insert(0, args.config)   # `elastic chaos --scenario F steps=9`
            args.config = None
    try:
        return {"run": _cmd_run, "chaos": _cmd_chaos, "report": _cmd_report, "worker": _cmd_worker}[args.command](args)
    except ConfigError as e:
        print(f"elastic: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
