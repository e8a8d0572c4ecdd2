"""The user API: ``Trainer`` (loss + optax optimizer) and ``wrap`` (a fused step).

Both turn user code into the runtime's three programs (see
:mod:`elastic._programs`) and run them with :class:`runtime.Controller`
on local workers, or in one process with ``reference=True``. Each run writes a
run directory: ``events.jsonl`` and ``report.json``. What the run takes from
the Config comes from :mod:`elastic.options` only: ``controller_options`` for
the controller, ``run_settings`` for the trainer itself. Before anything
starts, :mod:`elastic.preflight` checks the host's capacity and claims (locks)
the run directory.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import sys
import time
from collections.abc import Callable

import cloudpickle
import jax
import jax.numpy as jnp
import optax

from elastic import _programs, marker, reattach, run_records
from elastic.config import Config, ConfigError
from elastic.data import WithEval, normalize_spec
from elastic.metrics import ModelMetrics, open_metrics
from elastic.options import RunSettings, controller_options, in_config_terms, run_settings
from elastic.preflight import (RunDirectory, check_checkpoint_directory, check_config_capacity, check_data_source,
                               check_load_full_state_path, check_load_parameters_path, check_metrics_file,
                               claim_run_directory)
from elastic.report import build_report
from elastic.run_records import RunRecordsLostError
from elastic.shipping import ship
from runtime import (AttachRefusedError, ClientSupersededError, Controller, ElasticError, ProgramExportError,
                     ProgramSet,
                     enable_compilation_cache, local_platform, peak_rss_bytes, prestart_workers, program_platforms,
                     read_events, run_reference, run_reference_process, stages_digest)

__all__ = ["RunRecordsLostError", "Trainer", "wrap", "WrappedStep"]


class _Job:
    """What Trainer and WrappedStep share: programs, the run directory, ``fit``."""

    config: Config
    data: object
    #: Whether the report lists the bundled model's config keys (only the bundled model reads them).
    reports_model_keys: bool = False
    #: The model's learning rate, tokens and TFLOPs per step for MaxText's scalars (elastic.metrics); unknown
    #: by default, so those scalars are not written.
    model_metrics: ModelMetrics = ModelMetrics()
    #: The held-out data (``eval_interval``): a data source of the training data's microbatch spec; None: none.
    eval_data: object = None

    def _build(self) -> ProgramSet:
        raise NotImplementedError

    def sampler_programs(self):
        """An RL job's samplers' programs (:class:`runtime.SamplerPrograms`); None: a training run, no samplers."""
        return None

    def _platform(self) -> str:
        """The JAX platform to export for: ``hardware``'s, or (JAX chooses) this process's own, as a worker here gets."""
        return self.settings.platform or local_platform()

    def with_config(self, config: Config):
        """This job with another config (its run name, steps, slices, recovery keys...).

        The exported programs are kept when the mesh of a slice, the
        microbatch count and the platform are unchanged (they are all the
        programs depend on besides the user's code). For a different model,
        build a new job.
        """
        job = copy.copy(self)
        job.config = config
        job._run_dir = None
        old, new = self.settings, job.settings
        if ((old.devices_per_slice, old.microbatches, old.platform, old.eval_interval > 0)
                != (new.devices_per_slice, new.microbatches, new.platform, new.eval_interval > 0)):
            job._programs = None
        return job

    @property
    def settings(self) -> RunSettings:
        """What this job reads from ``config`` for itself (steps, seed, microbatches, mesh, run directory)."""
        return run_settings(self.config)

    def programs(self) -> ProgramSet:
        if getattr(self, "_programs", None) is None:
            self._programs = self._build()
        return self._programs

    @property
    def evaluates(self) -> bool:
        """Whether the run computes a held-out loss (``eval_interval`` > 0): its programs then include ``eval``."""
        return self.settings.eval_interval > 0

    def eval_steps(self) -> int:
        """Eval steps per eval: ``eval_steps``, or with -1 the eval source's length. ``ConfigError`` naming the key
        when eval is on without eval data, with eval data of another microbatch spec, or with -1 and a source
        that does not say its length."""
        settings, data = self.settings, self.eval_data
        if data is None:
            raise ConfigError(f"config key 'eval_interval' is {settings.eval_interval}, but the job has no eval "
                              "data: pass eval_data= (a data source like the training data's) to elastic.Trainer "
                              "or elastic.wrap, or set eval_interval=0")
        if not callable(getattr(data, "batch", None)) or not callable(getattr(data, "element_spec", None)):
            raise ConfigError(f"eval_data must be a data source with batch(step, microbatch) and element_spec(), "
                              f"got {type(data).__name__}")
        try:
            spec, want = normalize_spec(data.element_spec()), _spec(self.data)
        except ValueError as e:
            raise ConfigError(f"eval_data's {e}") from None
        if spec != want:
            raise ConfigError(f"eval_data's microbatches {spec} are not the training data's {want}: the eval program "
                              "is the training loss of one microbatch (same keys, shapes and dtypes)")
        if settings.eval_steps > 0:
            return settings.eval_steps
        n = _length(data)
        if n is None:
            raise ConfigError(f"config key 'eval_steps' is -1 (the whole eval source), but {type(data).__name__} "
                              "does not say how many steps it holds (len(source), or its 'steps'; an endless "
                              "source has none); set eval_steps to a count")
        if n < 1:
            raise ConfigError(f"config key 'eval_steps' is -1 (the whole eval source), but the eval source has "
                              f"{n} eval steps")
        return int(n)

    def shipped_data(self):
        """The data source the workers get: the training data, with the eval data beside it when eval is on
        (:class:`elastic.data.WithEval`)."""
        return WithEval(self.data, self.eval_data) if self.evaluates else self.data

    def run_dir(self) -> pathlib.Path:
        """``<base_output_directory>/<run_name>``; an unnamed run is named by its start time, once.

        ``fit`` fixes the name of an unnamed run when it claims the directory
        (another unnamed run started in the same second gets ``-1``, ``-2``...).
        """
        if getattr(self, "_run_dir", None) is None:
            settings = self.settings
            name = settings.run_name or time.strftime("run-%Y%m%d-%H%M%S")
            self._run_dir = pathlib.Path(settings.base_output_directory) / name
        return self._run_dir

    def fit(self, *, reference: bool = False, on_step: Callable[[int, float], None] | None = None,
            observer=None, max_seconds: float | None = None, fresh: bool = False,
            on_event: Callable[[dict], None] | None = None) -> dict:
        """Trains ``config.steps`` steps; writes the run directory; returns the report.

        ``reference=True`` runs the canonical math without workers: in this
        process when it has ``devices_per_slice`` JAX devices of the programs'
        platform (``hardware``), else in a child process given that many
        (simulated CPU devices for CPU programs; so it works from a notebook
        or a test whose JAX started with one device). A distributed run of
        the same job must match it bit for bit (losses and final state
        digest).
        ``observer``: a :class:`runtime.ControllerObserver` (the chaos
        harness) told about commits and transfers. ``on_event(event)``: each
        event of this attempt as the run's log writes it (under the log's
        lock: it must be quick and must not raise; ``elastic run``'s progress
        bar takes an RL run's rewards from it). ``max_seconds``: stop
        dispatching after this long of training and finish at the last
        committed step (soak runs). ``fresh``: the run starts anew whatever
        the run directory's log holds (a chaos run, judged as one attempt
        from step 0): an earlier attempt that failed, stopped or died is
        neither continued nor re-attached, and its log is replaced.

        Before anything starts (programs, workers) the run is checked
        (:mod:`elastic.preflight`): the workers it asks for must fit this
        host, the run directory must be writable and not held by another
        run (it is locked until ``fit`` returns), and a ``load_full_state_path``
        the run would start from must hold a complete checkpoint. Each refusal is a
        ``ConfigError`` naming the key to change.

        The run directory's ``events.jsonl`` holds every attempt of the run:
        when the run directory's last attempt did not finish (its client died
        or it failed), or when this run resumes from a checkpoint an earlier
        attempt recorded in the run's checkpoint directory (a finished run
        extended with more ``steps``), this attempt is appended to it, and
        the report covers every attempt (``attempts``; steps an earlier
        attempt committed and this one recomputes count in ``steps_lost``).
        Otherwise (a finished run without checkpoints run again, a reference
        run) the earlier run's records under the same name (its log, worker
        logs, report, TensorBoard and metrics files) are moved aside to
        ``<run dir>/earlier/<n>``, with one line saying so: never deleted.
        The same command again on a run that finished its ``steps`` and
        checkpointed the last one ends at once (one line, its report
        returned, no worker started, nothing written). The programs
        are built before anything is written: a job
        that cannot be exported, or whose programs differ from those that
        wrote the checkpoint it would resume from (on the same mesh), is
        refused (``ProgramExportError``, ``ConfigError`` naming the config
        keys that changed and how to extend a run) and leaves the run
        directory as it was.

        The run directory gets ``events.jsonl``, ``report.json`` and
        ``report.html`` whether the run finishes or fails; a failed run
        records ``run_failed`` and the error propagates; one stopped by Ctrl-C
        (``KeyboardInterrupt``; a subclass with ``signal_name``, the ``elastic`` command's SIGTERM, names
        its signal) sends its workers home, records ``run_stopped``
        and lets the interrupt propagate (running it again continues it, as
        after a failure). An event log that
        cannot be written (a full disk) does not stop training, but a run
        whose records are incomplete (events the log dropped, report files
        not written) ends with :class:`RunRecordsLostError` instead of
        returning, saying what was lost (its ``report`` holds what was
        recorded).
        """
        cfg, settings = self.config, self.settings
        check_pipeline(self, settings, reference)
        if not reference:
            check_config_capacity(cfg)
        check_data_source(self.data, cfg)   # a spec of the global batch: one line here, not a worker's traceback
        if self.evaluates:
            self.eval_steps()   # no eval data, another spec, an unknown length: one line before anything starts
        check_metrics_file(settings.metrics_file)
        claim = self._claim()
        run_dir = claim.path
        try:
            history = [] if fresh else run_records.read_history(run_dir)
            t0 = time.time()
            opts, again, done = None, None, False
            if not reference:
                opts, again = reattach.client_options(run_dir, history, self._controller_options(run_dir))
                done = again is None and run_records.finished_already(history, opts, settings.steps)
                check_load_full_state_path(opts.load_full_state_path, opts.checkpoint_directory, settings.steps)
                if opts.launcher == "local":   # its workers write this host's file system
                    check_checkpoint_directory(opts.checkpoint_directory)
                if not done:
                    prestart_workers(opts)   # local workers' zygote imports JAX while this process traces
            programs = self.programs()
            check_load_parameters_path(settings.parameters_from, programs, opts.checkpoint_directory if opts else "",
                                       settings.steps)
            built = time.time()
            checkpointed = opts is not None and bool(opts.checkpoint_directory)
            fingerprints = _programs.program_fingerprints(programs) if checkpointed else None
            if opts is not None:
                run_records.refuse_other_programs(history, fingerprints, programs, opts.checkpoint_directory,
                                                  settings.steps, cfg.to_dict(model_keys=self.reports_model_keys),
                                                  run_dir)
            if done:   # the same programs: nothing to compute, no worker started, nothing written
                print(f"elastic: run {run_dir.name} already finished its {settings.steps} steps and checkpointed "
                      "the last one: nothing to do (a larger 'steps' extends it)", file=sys.stderr)
                claim.release()
                return build_report(history)
            append = not reference and run_records.continues(history, opts, settings.steps)
            why = ("a reference run starts from nothing" if reference else "this run starts from nothing" if fresh
                   else f"its last attempt ended, and no checkpoint of it at or before step {settings.steps} is "
                        "left to resume from")
            events = run_records.open_log(run_dir, append=append, take_over=again is not None, why=why,
                                          also=(settings.metrics_file,), since=t0)
        except BaseException:
            claim.release()
            raise
        metrics = open_metrics(run_dir=run_dir, tensorboard=settings.tensorboard, metrics_file=settings.metrics_file,
                               log_period=settings.log_period, model=self.model_metrics,
                               devices_per_slice=settings.devices_per_slice, fresh=not append, history=history)
        if metrics is not None:
            events.subscribe(metrics.observe)
        if on_event is not None:
            events.subscribe(on_event)
        superseded = False
        try:
            events.emit("job_started", t=t0, mode="reference" if reference else "distributed",
                        config=cfg.to_dict(model_keys=self.reports_model_keys),
                        global_batch_size=cfg.global_batch_size, microbatches=settings.microbatches)
            events.emit("programs_built", t=built, seconds=built - t0,
                        program_bytes={k: len(v) for k, v in programs.programs().items()},
                        state_bytes=programs.state_bytes, grad_size=programs.grad_size,
                        **({"fingerprints": fingerprints} if fingerprints else {}))
            if reference:
                self._fit_reference(programs, events, on_step)
            else:
                events.subscribe(reattach.announce)
                shipped = ship(self.shipped_data(), by_value=opts.launcher != "local")   # a pool's hosts: not ours
                with Controller(programs, shipped, opts, events, reattach=again,
                                observer=observer, ownership=reattach.Ownership(run_dir, claim, events, opts),
                                samplers=self.sampler_programs()) as ctl:
                    reattach.record_client(run_dir, ctl, opts)   # before any worker hears of this client
                    ctl.train(settings.steps, settings.seed, on_step=on_step, max_seconds=max_seconds)
        except ClientSupersededError:
            superseded = True   # another client drives the run: its files are that client's now
            raise
        except AttachRefusedError as e:   # not the run's failure: its workers wait on for the right command
            events.emit("attach_refused", error=f"{type(e).__name__}: {in_config_terms(str(e))}")
            raise
        except ElasticError as e:
            events.emit("run_failed", error=f"{type(e).__name__}: {in_config_terms(str(e))}")
            raise
        except KeyboardInterrupt as stop:   # not a crash: the controller sent the workers home on its way out
            # Ctrl-C's, or the command's SIGTERM (elastic.cli_support.Stopped, which names its signal)
            events.emit("run_stopped", signal=getattr(stop, "signal_name", "SIGINT"))
            raise
        finally:
            events.close()
            if metrics is not None:   # after the log: the last goodput is the whole attempt's
                metrics.close(superseded=superseded)
            try:
                if not superseded:
                    report, unwritten = run_records.render(run_dir, events.dropped)
                    if settings.goodput_recording:
                        _record_goodput(run_dir, settings.goodput_cloud_logging)
            finally:
                claim.release()
        lost = run_records.records_lost(run_dir, report, events, unwritten)
        if lost:
            raise RunRecordsLostError(lost, report)
        return report

    def prestart_workers(self) -> None:
        """Starts what this job's local workers are forked from (:mod:`runtime.launch.zygote`) now, so its imports
        overlap whatever the caller does before ``fit`` (``fit`` starts it too, before tracing; nothing for
        other launchers). The chaos harness calls it before its reference run."""
        if self.config.elastic_launcher == "local":
            prestart_workers(self._controller_options(self.run_dir()))

    def _controller_options(self, run_dir):
        """The ``ControllerOptions`` of a distributed run of this job writing to ``run_dir``."""
        opts = controller_options(self.config, run_dir)   # (its eval_interval: the config's, MaxText's -1 as 0)
        return dataclasses.replace(opts, worker_preload=_modules_of(self.data) + _modules_of(self.eval_data),
                                   eval_steps=self.eval_steps() if self.evaluates else 0)   # -1 resolved

    def _claim(self) -> RunDirectory:
        """Claims this run's directory (see :func:`elastic.preflight.claim_run_directory`)."""
        settings = self.settings
        name = settings.run_name
        if not name and getattr(self, "_run_dir", None) is not None:
            name = self._run_dir.name   # run_dir() was asked before fit: keep the name it gave
        claim = claim_run_directory(settings.base_output_directory, name)
        self._run_dir = claim.path
        return claim

    def _fit_reference(self, programs, events, on_step):
        """The fault-free reference run (:meth:`_reference_run`), recorded as a run of its own."""
        settings = self.settings
        t0 = time.time()
        events.emit("run_started", run_id="reference", slices=0, devices_per_slice=settings.devices_per_slice,
                    microbatches=programs.num_microbatches, steps=settings.steps)

        def step_done(step, loss, rl_step=None):
            events.emit("step_committed", step=step, epoch=0, loss=loss)
            if rl_step is not None:   # an RL run's step: its weights version and reward (elastic.rl.job)
                events.emit("rl_step", **rl_step)
            if on_step is not None:
                on_step(step, loss)

        losses, digests = self._reference_run(programs, step_done)
        digest = stages_digest(digests)
        hashes = {f"stage{k}": d for k, d in enumerate(digests)} if programs.pipelined else {"reference": digest}
        events.emit("state_initialized", seed=settings.seed, state_bytes=programs.state_bytes)
        events.emit("run_finished", steps_completed=len(losses), final_state_digest=digest,
                    replica_hashes=hashes, wall_seconds=time.time() - t0,
                    client_peak_rss_bytes=peak_rss_bytes())

    def _reference_run(self, programs, step_done) -> tuple[list[float], list[str]]:
        """This job's math on its programs, in this process, or in child processes with a slice's devices when
        this one has fewer: ``(per-step losses, each stage's final digest)``; ``step_done(step, loss)`` hears each
        step."""
        settings = self.settings
        hosts = settings.hosts_per_slice   # a slice of several hosts: its math is theirs, in as many processes
        if (hosts == 1 and jax.local_device_count() >= programs.devices_per_slice
                and local_platform() in program_platforms(programs.init)):
            enable_compilation_cache(settings.compilation_cache_dir)   # shared with the workers of distributed runs
            return run_reference(programs, self.data, steps=settings.steps, seed=settings.seed,
                                 on_step=step_done, parameters_from=settings.parameters_from,
                                 schedule=settings.pipeline_schedule)
        # this process's JAX has fewer devices than a slice, or another platform: a child process gets them
        return run_reference_process(programs, cloudpickle.dumps(self.data), steps=settings.steps,
                                     seed=settings.seed, on_step=step_done,
                                     compilation_cache_dir=settings.compilation_cache_dir,
                                     parameters_from=settings.parameters_from,
                                     schedule=settings.pipeline_schedule, hosts=hosts)


def check_pipeline(job, settings, reference: bool) -> None:
    """A pipelined job (``dcn_pipeline_parallelism`` > 1) runs where it can today: an ``elastic.Trainer``,
    without another run's parameters to start from (``load_parameters_path``). ``ConfigError`` naming what to change otherwise."""
    if settings.pipeline_stages == 1:
        return
    if not isinstance(job, Trainer):
        raise ConfigError(f"dcn_pipeline_parallelism={settings.pipeline_stages}: elastic.wrap's step takes its own "
                          "gradients, so it cannot be cut into stages; build an elastic.Trainer from its loss and "
                          "optax optimizer (docs/pipeline.md), or set dcn_pipeline_parallelism=1")
    if reference:
        return
    cfg = job.config
    unsupported = {"load_parameters_path": settings.parameters_from}
    for key, value in unsupported.items():
        if value:
            raise ConfigError(f"config key {key!r} ({value!r}) is not supported with dcn_pipeline_parallelism="
                              f"{settings.pipeline_stages} yet: a pipelined run starts from a pipelined run's whole "
                              "state only (load_full_state_path; docs/pipeline.md)")
    if settings.microbatches < settings.pipeline_stages:
        raise ConfigError(f"elastic_microbatches ({settings.microbatches}) must be >= dcn_pipeline_parallelism "
                          f"({settings.pipeline_stages}): each stage works on every microbatch")


class Trainer(_Job):
    """Data-parallel training of ``loss(params, batch)`` with an optax optimizer.

    ``init(key) -> params``; ``data`` is a :class:`elastic.data.DataSource`
    whose microbatches have ``config.microbatch_size`` examples.
    """

    def __init__(self, *, init: Callable, loss: Callable, optimizer: optax.GradientTransformation, data,
                 config: Config, eval_data=None):
        self.init, self.loss, self.optimizer, self.data, self.config = init, loss, optimizer, data, config
        self.eval_data = eval_data

    def _build(self) -> ProgramSet:
        settings = self.settings
        return _programs.build_programs(init_params=self.init, loss=self.loss, optimizer=self.optimizer,
                                        num_stages=settings.pipeline_stages, batch_spec=_spec(self.data),
                                        devices_per_slice=settings.devices_per_slice,
                                        num_microbatches=settings.microbatches, platform=self._platform(),
                                        evaluate=self.evaluates)


class WrappedStep(_Job):
    """An existing fused ``train_step(state, batch) -> (state, metrics)`` made elastic.

    The step marks its sync point with ``grads = elastic.cross_slice_mean(grads)``;
    ``metrics[loss_key]`` is the microbatch loss reported per step. Everything
    after the mark may depend only on the state and the reduced gradients.
    ``eval_keys``: ``(total key, weight key)`` of the metrics when the loss is
    normalised by a count (tokens): the eval loss is then the totals' sum over
    the weights' (MaxText's eval); None: the mean of the microbatches' losses.
    """

    def __init__(self, train_step: Callable, *, init_state: Callable, data, config: Config, loss_key: str = "loss",
                 checkpoint_tree=None, eval_data=None, eval_keys: tuple[str, str] | None = None):
        self.train_step, self.init_state, self.data, self.config = train_step, init_state, data, config
        self.loss_key, self.checkpoint_tree, self.eval_data = loss_key, checkpoint_tree, eval_data
        self.eval_keys = eval_keys

    def _build(self) -> ProgramSet:
        step, loss_key = self.train_step, self.loss_key
        spec = _spec(self.data)
        state_shapes, batch_shapes = _abstract_inputs(self.init_state, spec)
        grad_shapes = _probe(step, state_shapes, batch_shapes)

        def grad_fn(state, batch):
            metrics, grads = _run_to_mark(step, state, batch, grad_shapes)
            if not hasattr(metrics, "keys") or loss_key not in metrics:
                keys = sorted(metrics) if hasattr(metrics, "keys") else type(metrics).__name__
                raise ProgramExportError(f"the wrapped train_step's metrics have no {loss_key!r} "
                                         f"(it returned {keys}); return (state, {{{loss_key!r}: loss, ...}}) "
                                         "or pass loss_key=")
            return metrics[loss_key], grads

        eval_fn = None
        if self.eval_keys is not None:
            def eval_fn(state, batch):   # the metrics' (loss total, weight): forward only, the gradients unused
                metrics, _ = _run_to_mark(step, state, batch, grad_shapes)
                missing = [k for k in self.eval_keys if not hasattr(metrics, "keys") or k not in metrics]
                if missing:
                    raise ProgramExportError(f"the wrapped train_step's metrics have no {missing[0]!r} (eval_keys "
                                             f"{self.eval_keys}): return it beside the loss, or drop eval_keys")
                return metrics[self.eval_keys[0]], metrics[self.eval_keys[1]]

        def apply_fn(state, grads):
            zeros = {k: jnp.zeros(shape, dtype) for k, (shape, dtype) in spec.items()}
            with marker.substitute_gradients(grads):
                new_state, _ = step(state, zeros)
            return new_state

        _check_apply_ignores_batch(step, state_shapes, batch_shapes, grad_shapes)
        return _programs.build_programs(init_state=self.init_state, grad_fn=grad_fn, apply_fn=apply_fn,
                                        batch_spec=spec, devices_per_slice=self.settings.devices_per_slice,
                                        num_microbatches=self.settings.microbatches, platform=self._platform(),
                                        checkpoint_tree=self.checkpoint_tree, evaluate=self.evaluates,
                                        eval_fn=eval_fn)


def wrap(train_step: Callable, *, init_state: Callable, data, config: Config, loss_key: str = "loss",
         checkpoint_tree=None, eval_data=None, eval_keys: tuple[str, str] | None = None) -> WrappedStep:
    """Makes a fused step elastic; see :class:`WrappedStep`. ``init_state(key) -> state``. ``checkpoint_tree``:
    how persistent checkpoints name the state's leaves (a ``runtime.state.checkpoint_tree.CheckpointTree``, one
    entry per leaf of ``init_state``'s tree; default a flat list), e.g. so another trainer can read them.
    ``eval_data``: the held-out data source (``eval_interval``), of ``data``'s microbatch spec; ``eval_keys``: see
    :class:`WrappedStep`."""
    return WrappedStep(train_step, init_state=init_state, data=data, config=config, loss_key=loss_key,
                       checkpoint_tree=checkpoint_tree, eval_data=eval_data, eval_keys=eval_keys)


def _length(source) -> int | None:
    """The steps a finite data source holds: ``len(source)``, else its ``steps`` attribute (MaxText's eval data,
    ``integrations.maxtext.text_data.TextSource``); None when it says neither (an endless source)."""
    try:
        return int(len(source))
    except TypeError:
        pass
    steps = getattr(source, "steps", None)
    return int(steps) if isinstance(steps, int) and not isinstance(steps, bool) else None


def _modules_of(data) -> tuple[str, ...]:
    """The module a worker imports to unpickle ``data`` (by reference), for the zygote to import once; none
    for a class of ``__main__`` (the worker cannot import it: cloudpickle sends it by value) or no data."""
    if data is None:
        return ()
    module = type(data).__module__
    return () if module in ("__main__", "builtins") else (module,)


def _record_goodput(run_dir: pathlib.Path, cloud_logging: bool) -> None:
    """``goodput_log.jsonl`` (and Cloud Logging): the run as ml-goodput-measurement events; a failure is one warning."""
    from elastic.report.goodput_log import write_goodput_log

    try:
        write_goodput_log(run_dir, read_events(run_dir / "events.jsonl"), run_dir.name, cloud_logging=cloud_logging)
    except Exception as e:  # noqa: BLE001 - recording goodput must never fail a finished run
        print(f"elastic: warning: goodput recording (enable_goodput_recording) failed: {type(e).__name__}: {e}",
              file=sys.stderr)


def _spec(data) -> dict:
    """The data source's per-microbatch spec, checked (a clear ProgramExportError if it is not one)."""
    if not callable(getattr(data, "element_spec", None)) or not callable(getattr(data, "batch", None)):
        raise ProgramExportError(f"data must be a data source with batch(step, microbatch) and element_spec(), "
                                 f"got {type(data).__name__}; see elastic.FunctionSource")
    try:
        return normalize_spec(data.element_spec())
    except ValueError as e:
        raise ProgramExportError(f"the data source's {e}") from None


def _abstract_inputs(init_state, spec):
    """The state and one microbatch as trees of ``jax.ShapeDtypeStruct`` (nothing materialized)."""
    try:
        state = jax.eval_shape(init_state, jax.ShapeDtypeStruct((), jax.random.key(0).dtype))
    except Exception as e:  # noqa: BLE001 - user code: one typed error naming the function
        raise ProgramExportError(f"could not trace init_state(key): {type(e).__name__}: {e}") from e
    batch = {k: jax.ShapeDtypeStruct(shape, dtype) for k, (shape, dtype) in spec.items()}
    return state, batch


def _probe(step, state, batch):
    """The gradients at the mark, as a tree of ``jax.ShapeDtypeStruct`` (one abstract trace of the step)."""
    try:
        with marker.probe_gradients() as m:
            jax.eval_shape(lambda s, b: step(s, b), state, batch)
    except marker.MarkerError as e:
        raise ProgramExportError(f"the wrapped train_step: {e}") from e
    except Exception as e:  # noqa: BLE001
        raise ProgramExportError(f"could not trace the wrapped train_step(state, batch) with the data source's "
                                 f"element_spec: {type(e).__name__}: {e}") from e
    if m.calls == 0:
        raise ProgramExportError("the wrapped train_step never called elastic.cross_slice_mean(grads); mark the "
                                 "gradients once, before the optimizer update")
    return m.shapes


def _run_to_mark(step, state, batch, grad_shapes):
    """Traces ``step``; returns (metrics, the gradients passed to the mark, read back from refs)."""
    leaves, treedef = jax.tree.flatten(grad_shapes)
    refs = [jax.new_ref(jnp.zeros(s.shape, s.dtype)) for s in leaves]
    with marker.capture_gradients(treedef, refs) as m:
        _, metrics = step(state, batch)
    if m.calls != 1:
        raise ProgramExportError("the wrapped train_step never called elastic.cross_slice_mean(grads)")
    return metrics, jax.tree.unflatten(treedef, [r[...] for r in refs])


def _check_apply_ignores_batch(step, state, batch, grads) -> None:
    """Refuses a step whose state update after the mark reads the batch.

    The apply program runs without the batch, so such a step would silently
    train on zeros. Checked by tracing: the new state must not depend on it.
    """
    def after_mark(state, grads, batch):
        with marker.substitute_gradients(grads):
            return step(state, batch)[0]

    closed = jax.make_jaxpr(after_mark)(state, grads, batch)
    n_batch = len(jax.tree.leaves(batch))
    used = _programs.used_inputs(closed.jaxpr)
    if any(used[-n_batch:]):
        raise ProgramExportError("the wrapped train_step's update after elastic.cross_slice_mean reads the "
                                 "batch; compute everything batch-dependent before the mark")
