"""Helpers shared by the ``elastic`` subcommands: the built-in ones (:mod:`elastic.cli`) and the
ones other packages plug in through the ``elastic.commands`` entry points (``chaos``).

The conventions they keep: bad input prints one line, ``elastic: error: ...``,
and exits with status 2; the platform (``hardware``) and simulated CPU devices
are set before JAX starts;
a finished run prints its summary and the path of its ``report.html``.
Nothing here imports JAX at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

from elastic.config import ConfigError

__all__ = ["CONFIGS_GROUP", "OneLineParser", "bundled_trainer", "config_loader", "finish", "make_job",
           "make_trainer", "progress", "set_device_count", "set_platform", "usage_error"]

#: The entry-point group of loaders of other config formats (MaxText's: ``integrations.maxtext.cli``).
CONFIGS_GROUP = "elastic.configs"


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr, ``elastic: error: ...``, and exit status 2."""

    def error(self, message):
        print(f"elastic: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def usage_error(message: str) -> int:
    """Prints ``elastic: error: MESSAGE`` to stderr; returns 2, the exit status of bad input."""
    print(f"elastic: error: {message}", file=sys.stderr)
    return 2


def set_device_count(n: int) -> None:
    """Simulated host devices for this process; must run before JAX starts."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def set_platform(hardware: str) -> None:
    """This process's JAX platform for a run on ``hardware`` (the config key); must run before JAX starts.

    ``JAX_PLATFORMS`` set by the user is kept (a worker that cannot run the
    programs then says so when it loads them). Otherwise ``cpu`` and ``""``
    mean the CPU (``JAX_PLATFORMS=cpu``: simulated devices, as before), and
    ``gpu`` and ``tpu`` mean JAX's own choice (``JAX_PLATFORMS=""``): the
    host's accelerator. The local launcher's workers inherit it, and so does
    a reference run. On a GPU the workers and this process share the device,
    so each allocates memory as it needs it (``XLA_PYTHON_CLIENT_PREALLOCATE=false``)
    unless one of JAX's allocator variables is set.
    """
    accelerator = hardware in ("gpu", "tpu")
    os.environ.setdefault("JAX_PLATFORMS", "" if accelerator else "cpu")
    allocator = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")
    if accelerator and not any(k in os.environ for k in allocator):
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"


def bundled_trainer(cfg):
    """A :class:`elastic.Trainer` for the bundled model of ``cfg`` (Adam, linear warm-up). Imports JAX."""
    import optax

    from elastic.models import make_model
    from elastic.trainer import Trainer

    init, loss, data = make_model(cfg)
    schedule = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps) if cfg.warmup_steps else cfg.learning_rate
    trainer = Trainer(init=init, loss=loss, optimizer=optax.adam(schedule), data=data, config=cfg)
    trainer.reports_model_keys = True   # its config's model keys are its own: the report shows them
    return trainer


def make_trainer(cfg):
    """The job the ``elastic`` command runs: ``factory(cfg)`` named by ``elastic_trainer``, else the bundled model.

    ``elastic_trainer`` is ``"module:factory"``; the module is imported with
    the current directory first on the import path (as ``python -m`` does),
    and ``factory(cfg)`` must return an ``elastic.Trainer`` or ``elastic.wrap``
    job built with ``cfg``. Anything else is a ``ConfigError`` naming the key.
    Imports JAX (the caller sets the device count first).
    """
    spec = cfg.elastic_trainer
    if not spec:
        return bundled_trainer(cfg)
    from elastic.trainer import Trainer, WrappedStep

    where = f"config key 'elastic_trainer' ({spec!r})"
    module_name, attr = spec.split(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import {module_name!r} ({e}); run from the directory that holds it, "
                          "or install it") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{where}: {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{where}: {attr!r} is a {type(obj).__name__}, not a function of the config")
    job = obj(cfg)
    if not isinstance(job, (Trainer, WrappedStep)):
        raise ConfigError(f"{where}: {attr}(config) returned a {type(job).__name__}; it must return "
                          "elastic.Trainer(...) or elastic.wrap(...)")
    if job.config != cfg:
        changed = sorted(k for k, v in job.config.to_dict().items() if cfg.to_dict()[k] != v)
        raise ConfigError(f"{where}: {attr}(config) built its job with another config (keys {changed} differ); "
                          "build it with the config it is given (set keys in the config file or as overrides)")
    return job


def config_loader(path: str):
    """The ``elastic.configs`` loader that claims the config file ``path``, or None (jax-elastic's own format).

    Loader contract: an object with ``name``; ``claims(path) -> bool``
    (cheap, must not start JAX); ``devices_per_slice(path, overrides) -> int``
    (without JAX); ``make_job(path, overrides)`` -> an ``elastic.Trainer`` or
    ``elastic.wrap`` job whose ``config`` is the run's (starts JAX). A loader
    that fails to load or to answer is one warning line and is skipped.
    """
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group=CONFIGS_GROUP), key=lambda ep: ep.name):
        try:
            loader = ep.load()
            if loader.claims(path):
                return loader
        except Exception as e:  # noqa: BLE001 - a broken plug-in must not take the built-in formats down
            print(f"elastic: warning: config loader {ep.name!r} ({ep.value}) is unavailable: {type(e).__name__}: "
                  f"{e}", file=sys.stderr)
    return None


def make_job(config: str, overrides: list[str], *, reference: bool, loader=None, cfg=None):
    """``(config, job)`` for a config file (or bundled name) and overrides, whatever its format.

    ``loader``: the file's :func:`config_loader` (None: jax-elastic's own
    format, already loaded as ``cfg`` when given). Sets this process's
    platform (:func:`set_platform`; a loader's client stays on the CPU) and
    simulated CPU devices first (for ``reference``, and for a loader whose
    client builds on a real mesh); JAX starts here.
    """
    from elastic.config import load_config

    if loader is not None:
        set_device_count(loader.devices_per_slice(config, overrides))
        job = loader.make_job(config, overrides)
        return job.config, job
    cfg = cfg if cfg is not None else load_config(config, overrides)
    set_platform(cfg.hardware)
    if reference:
        set_device_count(cfg.devices_per_slice)
    return cfg, make_trainer(cfg)


def progress(steps: int, quiet: bool):
    """A context giving an ``on_step`` callback that drives a rich progress bar (or nothing when quiet)."""
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


def finish(report: dict, run_dir, quiet: bool) -> None:
    """Prints the run's summary (plain text when ``quiet``) and the path of its ``report.html``."""
    from elastic.report import print_summary, summary_text

    if quiet:
        print(summary_text(report))
    else:
        print_summary(report)
    print(f"report: {run_dir / 'report.html'}")
