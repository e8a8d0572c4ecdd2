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
import io
import os
import pathlib
import signal
import sys

from elastic.config import ConfigError

__all__ = ["CONFIGS_GROUP", "OneLineParser", "Stopped", "bundled_trainer", "config_loader", "factory_job", "finish",
           "kept_library_output", "make_job", "make_trainer", "progress", "set_device_count", "set_platform",
           "stop_on_sigterm", "stopped_by", "usage_error"]

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


class Stopped(KeyboardInterrupt):
    """A run stopped by a signal other than Ctrl-C's: SIGTERM, what schedulers and ``kill`` send.

    Raised in the main thread where Ctrl-C's ``KeyboardInterrupt`` would be, so it takes Ctrl-C's path:
    ``Trainer.fit`` records ``run_stopped`` (with ``signal_name``), the controller sends the workers home on
    its way out, and the command says one line and exits ``exit_status`` (128 + the signal's number)."""

    def __init__(self, signum: int):
        self.signal_name = signal.Signals(signum).name
        self.exit_status = 128 + signum
        super().__init__(self.signal_name)


def stopped_by(interrupt: KeyboardInterrupt) -> tuple[str, str, int]:
    """``(signal name, how the user reads it, exit status)`` of a stop: Ctrl-C's (SIGINT, 130) or a
    :class:`Stopped`'s."""
    if isinstance(interrupt, Stopped):
        return interrupt.signal_name, interrupt.signal_name, interrupt.exit_status
    return "SIGINT", "Ctrl-C", 128 + signal.SIGINT


@contextlib.contextmanager
def stop_on_sigterm():
    """Within: SIGTERM stops the command as Ctrl-C does (it raises :class:`Stopped` in the main thread), once: a
    second SIGTERM while the run sends its workers home is ignored (a scheduler that insists sends SIGKILL).
    For the commands that drive a run (``run``, ``chaos``); the previous handler is put back on the way out."""
    def stop(signum, _frame):
        signal.signal(signum, signal.SIG_IGN)
        raise Stopped(signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


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

    from elastic.metrics import ModelMetrics
    from elastic.models import TransformerConfig, make_model, training_tflops
    from elastic.trainer import Trainer

    init, loss, data = make_model(cfg)
    schedule = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps) if cfg.warmup_steps else cfg.learning_rate
    trainer = Trainer(init=init, loss=loss, optimizer=optax.adam(schedule), data=data, config=cfg,
                      eval_data=data.held_out())   # computed only with eval_interval
    trainer.reports_model_keys = True   # its config's model keys are its own: the report shows them
    rate = schedule if callable(schedule) else lambda step: schedule
    trainer.model_metrics = ModelMetrics(learning_rate=rate,
                                         tokens_per_step=cfg.global_batch_size * cfg.max_target_length,
                                         tflops_per_step=training_tflops(TransformerConfig.from_config(cfg),
                                                                         cfg.global_batch_size))
    return trainer


def make_trainer(cfg):
    """The job the ``elastic`` command runs: ``factory(cfg)`` named by ``elastic_trainer``, else the bundled model.

    ``elastic_trainer`` is ``"module:factory"`` (see :func:`factory_job`).
    Imports JAX (the caller sets the device count first).
    """
    if cfg.rl_samplers and not cfg.elastic_trainer:   # RL post-training of the bundled policy (elastic.rl)
        from elastic.rl.job import RLTrainer

        return RLTrainer(cfg)
    if not cfg.elastic_trainer:
        return bundled_trainer(cfg)
    return factory_job(cfg)


def factory_job(cfg, *more):
    """The job of the factory ``cfg.elastic_trainer`` names: ``factory(cfg, *more)``, or ``factory(cfg)`` when its
    signature takes only one argument.

    ``elastic_trainer`` is ``"module:factory"``; the module is imported with
    the current directory first on the import path (as ``python -m`` does),
    and the factory must return an ``elastic.Trainer`` or ``elastic.wrap``
    job built with ``cfg``. ``more``: what a config format gives besides
    ``cfg`` (the MaxText loader: MaxText's config). Anything else is a
    ``ConfigError`` naming the key. Called in the client, before anything
    starts; imports JAX.
    """
    import inspect

    from elastic.trainer import Trainer, WrappedStep

    spec = cfg.elastic_trainer
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
    args = (cfg, *more)
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):   # a callable Python cannot introspect: call it with everything
        signature = None
    if signature is not None and more and not _binds(signature, args):
        args = (cfg,)
    if signature is not None and not _binds(signature, args):
        also = f" nor (config, {', '.join(type(m).__name__ for m in more)})" if more else ""
        raise ConfigError(f"{where}: {attr}{signature} takes neither (config){also}: the factory is called with "
                          "the run's config")
    job = obj(*args)
    if not isinstance(job, (Trainer, WrappedStep)):
        raise ConfigError(f"{where}: {attr}(config) returned a {type(job).__name__}; it must return "
                          "elastic.Trainer(...) or elastic.wrap(...)")
    if job.config != cfg:
        changed = sorted(k for k, v in job.config.to_dict().items() if cfg.to_dict()[k] != v)
        raise ConfigError(f"{where}: {attr}(config) built its job with another config (keys {changed} differ); "
                          "build it with the config it is given (set keys in the config file or as overrides)")
    return job


def _binds(signature, args) -> bool:
    try:
        signature.bind(*args)
    except TypeError:
        return False
    return True


def config_loader(path: str, overrides=()):
    """The ``elastic.configs`` loader that claims the config file ``path``, or None (jax-elastic's own format).

    Loader contract: an object with ``name``; ``claims(path, overrides) ->
    bool`` (cheap, must not start JAX); ``devices_per_slice(path, overrides)
    -> int`` (without JAX); ``make_job(path, overrides)`` -> an
    ``elastic.Trainer`` or ``elastic.wrap`` job whose ``config`` is the run's
    (starts JAX; with ``elastic_trainer`` set, the job of that factory, given
    the loaded config: :func:`factory_job`). A loader that fails to load or to
    answer is one warning line and is skipped.
    """
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group=CONFIGS_GROUP), key=lambda ep: ep.name):
        try:
            loader = ep.load()
            if loader.claims(path, list(overrides)):
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
    client builds on a real mesh); JAX starts here. (``fit`` checks the job's
    data source against the config, :func:`elastic.preflight.check_data_source`,
    before anything starts.)
    """
    from elastic.config_loading import load_config

    if loader is not None:
        set_device_count(loader.devices_per_slice(config, overrides))
        job = loader.make_job(config, overrides)
    else:
        cfg = cfg if cfg is not None else load_config(config, overrides)
        set_platform(cfg.hardware)
        if reference:
            set_device_count(cfg.devices_per_slice)
        job = make_trainer(cfg)
    return job.config, job


class _Kept(io.TextIOBase):
    """A stand-in for sys.stdout or sys.stderr: keeps what is written while ``keeping``, then passes it on.

    Passing on afterwards matters: a library that bound the stream while it was kept (a logging handler made at
    import) must reach the terminal later, not a closed buffer.
    """

    def __init__(self, real, kept: list[str]):
        super().__init__()
        self.real, self.kept, self.keeping = real, kept, True

    def write(self, text: str) -> int:
        if self.keeping:
            self.kept.append(text)
        else:
            self.real.write(text)
        return len(text)

    def flush(self) -> None:
        self.real.flush()

    def fileno(self) -> int:
        return self.real.fileno()

    def isatty(self) -> bool:
        return self.real.isatty()

    @property
    def encoding(self):
        return getattr(self.real, "encoding", "utf-8")

    def __getattr__(self, name):   # what else a stream has (buffer, errors...): the real one's
        if name == "real":   # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.real, name)


@contextlib.contextmanager
def kept_library_output():
    """Within: what Python code writes to ``sys.stdout`` and ``sys.stderr`` (prints, warnings, logging's handlers)
    is kept off the terminal; yields the list it is kept in (the caller writes it to the run's logs).

    For the client's building of a job from libraries that talk as they import and load (MaxText's config and
    model code): the terminal keeps what the user needs. An exception other than ``ConfigError`` (whose one line
    says what is wrong) writes what was kept to the terminal before it propagates, so nothing that explains a
    crash is hidden. Output of C++ code (XLA's own logging) is not Python's and is not kept.
    """
    kept: list[str] = []
    streams = _Kept(sys.stdout, kept), _Kept(sys.stderr, kept)
    before = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = streams
    try:
        yield kept
    except ConfigError:
        raise
    except BaseException:
        _restore(before, streams)
        sys.stderr.write("".join(kept))
        raise
    finally:
        _restore(before, streams)


def _restore(before, streams) -> None:
    for stream in streams:
        stream.keeping = False
    if (sys.stdout, sys.stderr) == streams:
        sys.stdout, sys.stderr = before


def progress(steps: int, quiet: bool):
    """A context giving an ``on_step`` callback that drives a rich progress bar (or nothing when quiet).

    The bar appears with the first committed step, so a run refused or stopped before it (a one-line error, a
    finished run with nothing to do) prints no empty bar. ``on_step.observe`` takes the run's events
    (``Trainer.fit(on_event=...)``): an RL run's bar shows each step's mean reward (its ``rl_step``, written
    before the step's ``on_step``) instead of its loss, which is about 0 whatever the policy learns."""
    if quiet:
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    @contextlib.contextmanager
    def bar():
        shown: list = []   # [(progress, task)] once the first step committed
        rewards: dict = {}   # an RL run's: step -> its mean reward (None: not known to this client)

        def observe(e):
            if e.get("kind") == "rl_step":
                rewards.clear()
                rewards[e.get("step")] = e.get("mean_reward")

        def on_step(step, loss):
            if not shown:
                p = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("{task.fields[metric]}"), TimeElapsedColumn(), transient=False)
                p.start()
                shown.append((p, p.add_task("train", total=steps, metric="")))
            p, task = shown[0]
            if rewards:
                reward = rewards.get(step)
                metric = f"reward {'-' if reward is None else f'{reward:.3f}'}"
            else:
                metric = f"loss {'-' if loss is None else f'{loss:.4f}'}"
            p.update(task, completed=step + 1, metric=metric)

        on_step.observe = observe
        try:
            yield on_step
        finally:
            if shown:
                shown[0][0].stop()
    return bar()


def finish(report: dict, run_dir, quiet: bool) -> None:
    """Prints the run's summary (plain text when ``quiet``), then its ``report.html`` as a ``file://`` link a
    terminal can open."""
    from elastic.report import print_summary, summary_text

    if quiet:
        print(summary_text(report))
    else:
        print_summary(report)
    print(f"report: {(pathlib.Path(run_dir) / 'report.html').resolve().as_uri()}")
