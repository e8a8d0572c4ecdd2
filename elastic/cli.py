"""The ``elastic`` command: ``run``, ``report``, ``worker``, ``status``, ``stacks``, and the subcommands other
packages plug in.

Bad input (config, arguments, fault specs, files) prints one line,
``elastic: error: ...``, and exits with status 2; a run that fails, or a
chaos run whose verdict is "fail", exits with status 1. ``run`` and ``chaos``
stopped by Ctrl-C or SIGTERM (one stop, :func:`elastic.cli_support.stop_on_sigterm`)
say one line and exit 130 or 143.

Plug-in contract: every entry point of the group ``elastic.commands`` (the
``chaos`` package declares ``chaos = "chaos.cli:register"``) names a callable
``register(subparsers)``, called once while the parser is built. It adds its
subparser (``subparsers.add_parser``) and sets its defaults: ``handler``, a
function of the parsed arguments returning the exit status, and, for a command
that takes trailing ``key=value`` config overrides in a positional
``overrides``, ``takes_overrides=True``. A plug-in that fails to load or
register prints one warning line and is left out; the built-in commands still
work. This module imports no plug-in: ``elastic`` never imports ``chaos``.
Shared helpers for subcommands live in :mod:`elastic.cli_support`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
from importlib.metadata import entry_points

from elastic.cli_support import (OneLineParser, config_loader, finish, make_job, progress, set_device_count,
                                 stop_on_sigterm, stopped_by, usage_error)
from elastic.config import ConfigError
from elastic.config_loading import bundled_configs, load_config
from elastic.pool_commands import register as pool_commands
from elastic.status import register as status_commands
from runtime import positive_seconds, slice_flags_problem   # no JAX: the device count is set after parsing

__all__ = ["COMMANDS_GROUP", "main", "parser"]

#: The entry-point group of plug-in subcommands.
COMMANDS_GROUP = "elastic.commands"


def _cmd_run(args) -> int:
    from elastic.preflight import check_config_capacity, check_output_directory

    overrides = args.overrides + ([f"elastic_trainer={args.trainer}"] if args.trainer else [])
    loader, cfg = config_loader(args.config, overrides), None
    if loader is None:
        cfg = load_config(args.config, overrides)
        # Before JAX loads: the run fits this host and its directory is usable (fit checks again, for good).
        if not args.reference:
            check_config_capacity(cfg)
        check_output_directory(cfg.base_output_directory, cfg.run_name)
    try:
        cfg, trainer = make_job(args.config, overrides, reference=args.reference, loader=loader, cfg=cfg)
    except Exception as e:   # runtime imports JAX: only once make_job has set the device count
        from runtime import ElasticError

        if not isinstance(e, ElasticError):
            raise
        print(f"elastic: run failed: {e}", file=sys.stderr)   # a step that cannot be exported, traced here
        return 1
    from runtime import ClientSupersededError, ElasticError

    with progress(cfg.steps, args.quiet) as on_step:
        try:
            report = trainer.fit(reference=args.reference, on_step=on_step,
                                 on_event=getattr(on_step, "observe", None))   # (an RL run's bar: its rewards)
        except ClientSupersededError as e:   # another client drives the run: nothing of it is this one's
            print(f"elastic: this client stops, another one took the run over: {e}", file=sys.stderr)
            return 1
        except ElasticError as e:
            from elastic.options import in_config_terms
            print(f"elastic: run failed: {in_config_terms(str(e))}", file=sys.stderr)
            _report_link(trainer.run_dir())
            return 1
        except KeyboardInterrupt as stop:   # Ctrl-C, or SIGTERM (stop_on_sigterm): the same stop
            _, said, status = stopped_by(stop)
            print(f"elastic: stopped ({said}); the workers were sent home. Run the same command again to continue "
                  f"run {trainer.run_dir().name}"
                  + (" from its newest checkpoint" if cfg.enable_checkpointing else " (from step 0: it has no "
                     "checkpoints)"), file=sys.stderr)
            _report_link(trainer.run_dir())
            return status
    finish(report, trainer.run_dir(), args.quiet)
    return 0


def _report_link(run_dir: pathlib.Path) -> None:
    html = run_dir / "report.html"
    if html.is_file():   # not when writing it is what failed
        print(f"report: {html.resolve().as_uri()}", file=sys.stderr)


def _cmd_report(args) -> int:
    from elastic.report import render_run
    from runtime import read_events

    run_dir = pathlib.Path(args.run_dir)
    path = run_dir / "events.jsonl"
    if not run_dir.is_dir():
        return usage_error(f"nothing to report: {path} not found ({run_dir} is not a directory)")
    if not path.is_file():
        what = "is not a file" if path.exists() else "not found"
        return usage_error(f"nothing to report: {path} {what} (is {run_dir} a run directory?)")
    try:
        if not read_events(path):
            return usage_error(f"nothing to report: {path} has no events")
        report = render_run(run_dir)
    except (ValueError, KeyError, TypeError) as e:
        return usage_error(f"{path} is not a valid event log: {type(e).__name__}: {e}")
    except OSError as e:
        return usage_error(f"cannot re-render the report of {run_dir}: {e.strerror or e}"
                           + (f" ({e.filename})" if e.filename else ""))
    finish(report, run_dir, args.quiet)
    return 0


#: ``elastic worker``'s TLS flags, the variables they default to (what the local launcher sets), and what each is.
_WORKER_TLS = {"tls_cert": "ELASTIC_TLS_CERT", "tls_key": "ELASTIC_TLS_KEY", "tls_ca": "ELASTIC_TLS_CA"}
_TLS_FILE = {"tls_cert": "this worker's certificate", "tls_key": "its private key",
             "tls_ca": "the CA that signed the run's certificates"}


def _cmd_worker(args) -> int:
    """Serves as a worker until the run lets it go; ends the process (never returns) once JAX started. With
    ``--pool``: serves as a pool's host (one lease after another) until the pool closes."""
    if args.pool:
        if args.controller or args.run_id:
            return usage_error("--pool and --controller/--run-id contradict: a pool's host serves the runs the "
                               "pool leases it to")
        from runtime import pool_host_main

        return pool_host_main(["--pool", args.pool, "--devices", str(args.devices or 1),
                               *(["--host-id", args.host_id] if args.host_id else []),
                               *(["--listen", args.host] if args.host != "127.0.0.1" else []),
                               *(["--platform", args.platform] if args.platform else [])])
    if not (args.controller and args.run_id):
        return usage_error("elastic worker needs --controller and --run-id (or --pool)")
    tls = {flag: getattr(args, flag) or os.environ.get(env, "") for flag, env in _WORKER_TLS.items()}
    if any(tls.values()):   # explicit flags win over the environment, each on its own
        if missing := [f"--{f.replace('_', '-')} (${_WORKER_TLS[f]})" for f, v in tls.items() if not v]:
            return usage_error(f"TLS needs a certificate, its key and the CA: missing {', '.join(missing)}")
        if absent := [v for v in tls.values() if not os.path.isfile(v)]:
            return usage_error(f"TLS file not found: {', '.join(absent)}")
    if problem := slice_flags_problem(args.slice_hosts, args.slice_host, args.slice_coordinator):
        return usage_error(problem)
    if args.devices is not None:   # simulated CPU devices; else the devices JAX finds on this machine
        set_device_count(args.devices)
    from runtime import worker_main

    rest = ["--controller", args.controller, "--run-id", args.run_id, "--host", args.host, "--port", str(args.port),
            "--register-timeout", str(args.register_timeout)]
    if args.worker_id:
        rest += ["--worker-id", args.worker_id]
    if args.compilation_cache_dir:
        rest += ["--compilation-cache-dir", args.compilation_cache_dir]
    if args.slice_hosts > 1:
        rest += ["--slice-hosts", str(args.slice_hosts), "--slice-host", str(args.slice_host),
                 "--slice-coordinator", args.slice_coordinator]
    for flag, value in tls.items():
        rest += [f"--{flag.replace('_', '-')}", value] if value else []
    worker_main(rest)
    return 0


def _count(text: str) -> int:
    """A device count >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a number of devices >= 1, got {text!r}")
    return int(text)


def _add_builtins(sub) -> None:
    run = sub.add_parser("run", help="train a config on local workers")
    run.add_argument("config", help="YAML config file (jax-elastic's, or MaxText's with MaxText installed), "
                                    f"or a bundled name ({', '.join(bundled_configs())})")
    run.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="config overrides")
    run.add_argument("--reference", action="store_true", help="the canonical math in this process, no workers")
    run.add_argument("--quiet", action="store_true", help="no per-step lines")
    run.add_argument("--trainer", metavar="MODULE:FACTORY",
                     help="your own model: factory(config) -> elastic.Trainer or elastic.wrap job "
                          "(config key elastic_trainer; default: the bundled model)")
    run.set_defaults(handler=_cmd_run, takes_overrides=True)
    rp = sub.add_parser("report", help="re-render report.json and report.html from a run's events.jsonl")
    rp.add_argument("run_dir")
    rp.add_argument("--quiet", action="store_true", help="plain-text summary")
    rp.set_defaults(handler=_cmd_report)
    w = sub.add_parser("worker", help="serve as a worker of a running controller",
                       description="Join a run's controller as a worker (the run secret in $ELASTIC_RUN_SECRET). "
                                   "Exits 0 when the run ends (or had ended), 1 when it cannot join (one line "
                                   "says why).")
    w.add_argument("--controller", help="HOST:PORT of the controller")
    w.add_argument("--run-id")
    w.add_argument("--pool", metavar="HOST:PORT",
                   help="serve a shared pool instead, one run's lease after another (the pool secret in "
                        "$ELASTIC_POOL_SECRET; docs/pool.md); --host-id names this host there")
    w.add_argument("--host-id", default="", help="with --pool: this host's name in the pool (default: the machine's)")
    w.add_argument("--platform", default="", help="with --pool: this host's JAX platform (default: cpu)")
    w.add_argument("--worker-id", default="", help="default: this host's name and a random suffix; a slice of several "
                                                   "hosts is named by its host 0 (give the others none, or the same)")
    w.add_argument("--devices", type=_count, default=None, metavar="N",
                   help="N simulated CPU devices (XLA's host platform; sets JAX_PLATFORMS=cpu unless set); "
                        "default: the devices JAX finds on this machine")
    w.add_argument("--host", default="127.0.0.1", help="the address this worker listens on and tells its peers")
    w.add_argument("--port", type=int, default=0)
    w.add_argument("--slice-hosts", type=int, default=1, metavar="H",
                   help="this worker is one host of a slice of H processes (the run's elastic_hosts_per_slice)")
    w.add_argument("--slice-host", type=int, default=0, metavar="K", help="which host of its slice, 0..H-1")
    w.add_argument("--slice-coordinator", default="", metavar="HOST0:PORT",
                   help="where host 0 of the slice serves its JAX coordinator (an address and a free port of host "
                        "0's machine that the other hosts reach), the same on every host of the slice")
    w.add_argument("--register-timeout", type=positive_seconds, default=60.0, metavar="SECONDS",
                   help="how long to wait for the controller to answer (default: 60); then exit 1")
    for flag, env in _WORKER_TLS.items():
        w.add_argument(f"--{flag.replace('_', '-')}", default="", metavar="PEM",
                       help=f"mutual TLS: {_TLS_FILE[flag]}, a PEM file (default: ${env})")
    w.add_argument("--compilation-cache-dir", default="",
                   help="JAX's persistent compilation cache on this host (shared with the run's other workers "
                        "when the file system is; default: $ELASTIC_COMPILATION_CACHE_DIR, else none)")
    w.set_defaults(handler=_cmd_worker)
    status_commands(sub)   # status, stacks
    pool_commands(sub)     # pool serve, pool status


def _add_plugins(sub) -> None:
    """Registers every ``elastic.commands`` entry point, in name order; a broken one is one warning line."""
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda ep: ep.name):
        try:
            ep.load()(sub)
        except Exception as e:  # whatever a plug-in raises, the built-in commands must still work
            print(f"elastic: warning: command {ep.name!r} ({ep.value}) is unavailable: {type(e).__name__}: {e}",
                  file=sys.stderr)


def parser() -> OneLineParser:
    """The ``elastic`` command line: the built-in commands and those plugged in."""
    ap = OneLineParser(prog="elastic", description="Fault-tolerant, elastic training for JAX.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    _add_builtins(sub)
    _add_plugins(sub)
    return ap


def main(argv=None) -> int:
    ap = parser()
    args, extra = ap.parse_known_args(argv)
    # Overrides may follow flags (`run tiny --reference steps=3`).
    takes_overrides = getattr(args, "takes_overrides", False)
    unknown = [x for x in extra if not takes_overrides or x.startswith("-") or "=" not in x]
    if unknown:
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    if takes_overrides:
        args.overrides = list(args.overrides) + extra
    drives_a_run = args.command in ("run", "chaos")   # SIGTERM stops them as Ctrl-C does (docs/failure-semantics.md)
    try:
        with stop_on_sigterm() if drives_a_run else contextlib.nullcontext():
            return args.handler(args)
    except ConfigError as e:
        return usage_error(str(e))
    except KeyboardInterrupt as stop:   # before or after a run (a run stopped by Ctrl-C says more where it is caught)
        _, said, status = stopped_by(stop)
        print(f"elastic: stopped ({said})", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
