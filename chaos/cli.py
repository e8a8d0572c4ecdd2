"""``elastic chaos``: run a config under injected faults and judge it against a fault-free run.

Plugged into the ``elastic`` command through the ``elastic.commands`` entry
point (``chaos = "chaos.cli:register"`` in ``pyproject.toml``); the
contract is in :mod:`elastic.cli`. Exit status: 0 when the verdict is
"pass", 1 when it is "fail" (so it can gate CI), 2 for bad input (one line,
``elastic: error: ...``), including a fault that can never fire in this run
(:func:`chaos.reach.check_reachable`), refused before anything starts.
Loading this module imports neither JAX nor the runtime: the handler sets
the device count first.
"""

from __future__ import annotations

import sys

from elastic.cli_support import config_loader, finish, make_job, progress, usage_error
from elastic.config import ConfigError
from elastic.config_loading import load_config

__all__ = ["register"]


def register(subparsers) -> None:
    """Adds the ``chaos`` subcommand to the ``elastic`` command's subparsers."""
    ch = subparsers.add_parser("chaos", help="run a config under injected faults and judge it against a fault-free run")
    ch.add_argument("config", nargs="?", help="YAML config file (jax-elastic's, or MaxText's with MaxText "
                                               "installed) or bundled name (or take it from --scenario)")
    ch.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    ch.add_argument("--faults", help="fault list, e.g. 'kill@step=10,hang(resume=3s):slice=2@step=20'")
    ch.add_argument("--scenario", help="scenario YAML file (e.g. chaos/scenarios/kill-three.yml)")
    ch.add_argument("--mtbf", help="soak mode: mean time between random faults (e.g. 20s)")
    ch.add_argument("--duration", help="soak mode: stop training after this long (e.g. 5m)")
    ch.add_argument("--seed", type=int, default=None, help="seed of random targets and schedules")
    ch.add_argument("--trainer", metavar="MODULE:FACTORY",
                    help="your own model: factory(config) -> elastic.Trainer or elastic.wrap job "
                         "(config key elastic_trainer; default: the bundled model)")
    ch.add_argument("--quiet", action="store_true", help="no progress bar")
    ch.set_defaults(handler=_cmd_chaos, takes_overrides=True)


def _cmd_chaos(args) -> int:
    from chaos.harness import fault_plan, plan, run_chaos
    from chaos.spec import FaultSpecError
    from elastic.preflight import check_config_capacity

    if args.config and "=" in args.config:
        args.overrides.insert(0, args.config)   # `elastic chaos --scenario F steps=9`
        args.config = None
    try:
        scenario, overrides, options = plan(scenario=args.scenario, faults=args.faults, mtbf=args.mtbf,
                                            duration=args.duration, seed=args.seed)
        config = args.config or (scenario.config if scenario else None)
        if config is None:
            raise FaultSpecError("give a CONFIG or --scenario FILE")
    except ValueError as e:   # FaultSpecError, bad durations
        return usage_error(str(e))
    overrides = overrides + args.overrides + ([f"elastic_trainer={args.trainer}"] if args.trainer else [])
    try:
        loader, cfg = config_loader(config, overrides), None
        if loader is None:   # a fault that can never fire is bad input: refused before JAX starts
            cfg = load_config(config, overrides)
            fault_plan(cfg, options)
            check_config_capacity(cfg)   # and workers this host or the Ray cluster cannot hold: before the reference
        cfg, job = make_job(config, overrides, reference=True, loader=loader, cfg=cfg)   # the reference: in process
        if loader is not None:
            fault_plan(cfg, options)
    except ValueError as e:   # FaultSpecError (ConfigError goes to the caller: one line, exit 2)
        if isinstance(e, ConfigError):
            raise
        return usage_error(str(e))
    from runtime import ElasticError

    with progress(cfg.steps, args.quiet) as on_step:
        try:
            report, run_dir = run_chaos(job.with_config, cfg, options, on_step=on_step)
        except ValueError as e:
            return usage_error(str(e))
        except ElasticError as e:   # the run could not go on (no capacity left, an unreachable cluster, ...)
            from elastic.options import in_config_terms
            print(f"elastic: chaos run failed: {in_config_terms(str(e))}", file=sys.stderr)
            return 1
    finish(report, run_dir, args.quiet)
    if scenario is not None and scenario.expect != "pass":
        print(f"scenario {scenario.name!r} expects the verdict {scenario.expect!r}: got {report['verdict']!r}")
    return 0 if report["verdict"] == "pass" else 1   # the exit status is the verdict, so it can gate CI


