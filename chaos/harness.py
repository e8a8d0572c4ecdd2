"""``elastic chaos``: a fault-free reference, a faulted run, and the verdict.

:func:`run_chaos` runs the config's fault-free reference in this process
(or reuses a cached one with the same math), then the same config on local
workers with a :class:`chaos.injector.FaultInjector` attached, then judges
the faulted run against the reference (:func:`chaos.verdict.judge`). A plan
with client faults (``kill:client``, ``hang(resume=S):client``) runs its
client in child processes that this one supervises and restarts
(:mod:`chaos.supervisor`); any other plan runs in this process. The
verdict goes into the faulted run's event log (a ``verdict`` event), so
``report.json`` and ``report.html`` -- and ``elastic report`` later -- carry
it. Soak mode (``mtbf_seconds``/``duration_seconds``) draws random faults
from the seed and stops training at the duration; its reference is then run
for exactly the steps the soak committed.

:func:`run_job` is the Python entry point for any job (``elastic.Trainer``
or ``elastic.wrap``): ``chaos.run_job(job, faults="kill@step=3").assert_passed()``.
:func:`plan` turns a scenario file and explicit arguments into the run's
options; the ``elastic chaos`` command and :func:`run_job` share it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import sys

import cloudpickle

from chaos.injector import FaultInjector
from chaos.reach import RunShape, check_reachable
from chaos.scenario import Scenario, load_scenario
from chaos.schedule import random_faults, recovery_budget
from chaos.spec import Fault, FaultSpecError, parse_duration, parse_faults, validate
from chaos.supervisor import job_blob, run_clients, supervision_reasons
from chaos.verdict import judge
from elastic.config import MATH_KEYS, Config, ConfigError
from elastic.config_loading import parse_overrides
from elastic.report import build_report, render_run
from runtime import STATE_DIGEST, ElasticError, EventLog, checkpoint_steps, read_events

__all__ = ["ChaosOptions", "ChaosResult", "fault_plan", "plan", "run_chaos", "run_job", "reference_report"]


@dataclasses.dataclass(frozen=True)
class ChaosOptions:
    faults: tuple[Fault, ...] = ()
    seed: int = 0
    mtbf_seconds: float | None = None
    duration_seconds: float | None = None
    scenario: str | None = None
    rtol: float = 1e-5


@dataclasses.dataclass(frozen=True)
class ChaosResult:
    """What :func:`run_job` returns: the faulted run's final report (verdict included) and its directory."""

    report: dict
    run_dir: pathlib.Path

    @property
    def verdict(self) -> str:
        """``"pass"`` or ``"fail"``."""
        return self.report["verdict"]

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @property
    def reasons(self) -> list[str]:
        """Why the verdict failed (empty when it passed)."""
        return list(self.report["verdict_reasons"])

    def assert_passed(self) -> None:
        """Raises AssertionError listing the verdict's reasons and the report's path unless the verdict is pass."""
        if not self.passed:
            raise AssertionError(f"chaos verdict {self.verdict!r}: " + "; ".join(self.reasons)
                                 + f" (report: {self.run_dir / 'report.html'})")


def plan(*, scenario: str | Scenario | None = None, faults: str | tuple | list | None = None,
         mtbf: str | float | None = None, duration: str | float | None = None,
         seed: int | None = None) -> tuple[Scenario | None, list[str], ChaosOptions]:
    """A scenario (a file or a :class:`Scenario`) and explicit arguments as (scenario, overrides, options).

    Explicit faults add to the scenario's; explicit ``mtbf``/``duration``/
    ``seed`` replace the scenario's. Durations may be strings (``"20s"``).
    Raises FaultSpecError for bad faults or durations, a duration without an
    MTBF, and no faults at all. Reads only the scenario file.
    """
    sc = load_scenario(scenario) if isinstance(scenario, (str, pathlib.Path)) else scenario
    listed = parse_faults(faults) if isinstance(faults, str) else list(faults or ())
    all_faults = list(sc.faults if sc else ()) + listed

    def seconds(value, own):
        if value is None:
            return own
        return parse_duration(value) if isinstance(value, str) else float(value)

    mtbf_s = seconds(mtbf, sc.mtbf_seconds if sc else None)
    duration_s = seconds(duration, sc.duration_seconds if sc else None)
    if duration_s and not mtbf_s:
        raise FaultSpecError("a duration needs an MTBF (soak mode draws random faults): give --mtbf / mtbf=")
    if not all_faults and not mtbf_s:
        raise FaultSpecError("no faults: give faults (e.g. 'kill@step=3'), a scenario, or an MTBF and a duration")
    options = ChaosOptions(faults=tuple(all_faults), seed=seed if seed is not None else (sc.seed if sc else 0),
                           mtbf_seconds=mtbf_s, duration_seconds=duration_s, scenario=sc.name if sc else None)
    return sc, list(sc.overrides if sc else ()), options


def run_job(job, *, faults: str | tuple | list | None = None, scenario: str | Scenario | None = None,
            seed: int | None = None, mtbf: str | float | None = None, duration: str | float | None = None,
            overrides: tuple | list = (), rtol: float = 1e-5, on_step=None) -> ChaosResult:
    """Runs ``job`` (an ``elastic.Trainer`` or ``elastic.wrap`` job) under faults and judges it; see :func:`run_chaos`.

    ``faults``: the fault grammar (``"kill@step=3,hang:slice=1@step=5"``) or
    parsed :class:`Fault` objects. ``scenario``: a scenario file whose faults,
    overrides, seed and soak settings apply (its ``config`` is ignored: the
    job has one). ``overrides``: more ``key=value`` config changes. The
    reference runs in this process, or in a child process when this one has
    fewer JAX devices than a slice. Bad input raises ``FaultSpecError`` /
    ``ConfigError`` before anything starts; a run that fails is a "fail"
    verdict, not an exception.
    """
    _, scenario_overrides, options = plan(scenario=scenario, faults=faults, mtbf=mtbf, duration=duration, seed=seed)
    options = dataclasses.replace(options, rtol=rtol)
    changes = parse_overrides([*scenario_overrides, *overrides])
    cfg = job.config.replace(**changes) if changes else job.config
    fault_plan(cfg, options)   # bad input is refused before programs are built
    job = job.with_config(cfg)
    job.programs()   # built once; the reference and the faulted run share them
    report, run_dir = run_chaos(job.with_config, cfg, options, on_step=on_step)
    return ChaosResult(report, run_dir)


def reference_report(trainer_for, cfg: Config, steps: int) -> tuple[dict, pathlib.Path]:
    """The fault-free reference of ``cfg``'s math for ``steps`` steps, run in this process or reused.

    Cached under ``<base_output_directory>/references/<digest>``, keyed by
    what determines the math: the exported programs (the model, the
    optimizer, and this version of the runtime's program layout), the data
    source as it is shipped to the workers (pickled), and every config key
    that affects the math (the keys with the ``math`` role in
    :class:`elastic.config.Config`; slice count excluded: the result is bit-identical
    for any slice count, as long as the microbatch count M is the same). So
    an edited model or optimizer never reuses a stale reference, nor one
    whose final state digest is of another algorithm than this runtime's
    (a reference from before the digest changed: it would never compare
    identical). ``trainer_for(cfg)`` builds the trainer.
    """
    math = {k: v for k, v in cfg.to_dict().items() if k in MATH_KEYS}   # the schema's math role
    math.update(steps=steps, elastic_microbatches=cfg.microbatches)
    h = hashlib.sha256(json.dumps(math, sort_keys=True, default=str).encode())
    job = trainer_for(cfg)
    for name, blob in sorted(job.programs().programs().items()):
        h.update(name.encode() + hashlib.sha256(blob).digest())
    h.update(hashlib.sha256(cloudpickle.dumps(job.data)).digest())   # as shipped to the workers
    digest = h.hexdigest()[:16]
    ref_cfg = cfg.replace(run_name=f"references/{digest}", steps=steps, metrics_file="")   # the file is the run's
    trainer = trainer_for(ref_cfg)
    run_dir = trainer.run_dir()
    cached = run_dir / "report.json"
    if cached.exists():
        report = json.loads(cached.read_text())
        if (report.get("finished") and report.get("steps_completed") == steps
                and report.get("digest_algorithm") == STATE_DIGEST):
            return report, run_dir
    return trainer.fit(reference=True), run_dir


def fault_plan(cfg: Config, options: ChaosOptions) -> list[Fault]:
    """The faults a chaos run of ``cfg`` injects: ``options.faults``, then a soak's random ones.

    Raises FaultSpecError for a fault the grammar forbids, the runtime cannot
    inject, or that can never fire in this run (:func:`chaos.reach.check_reachable`).
    Pure; ``elastic chaos`` calls it before starting anything, :func:`run_chaos` again.
    """
    faults = list(options.faults)
    if options.mtbf_seconds:
        faults += random_faults(options.seed, options.mtbf_seconds, options.duration_seconds or 60.0)
    validate(faults)
    check_reachable(faults, RunShape.of(cfg, duration_seconds=options.duration_seconds,
                                        mtbf_seconds=options.mtbf_seconds))
    return faults


def run_chaos(trainer_for, cfg: Config, options: ChaosOptions, *, on_step=None) -> tuple[dict, pathlib.Path]:
    """Reference, faulted run, verdict; returns the faulted run's final report and its run directory.

    A faulted run that fails (the runtime gave up) still gets a report and a
    verdict ("fail", with the error among the reasons); only bad input
    raises (FaultSpecError from :func:`fault_plan`, before anything starts).
    A fault that did not fire by the end of the run is recorded as skipped
    by the injector, and the verdict fails. The run's ``elastic_max_retries``
    is raised to what its faults may cost (:func:`chaos.schedule.recovery_budget`,
    said in one line), so a run that survived every fault never fails for the budget.
    """
    faults = fault_plan(cfg, options)
    cfg = _fresh_run(cfg).replace(elastic_chaos=True)
    budget = recovery_budget(faults, cfg.elastic_max_retries, cfg.slices + cfg.elastic_spares)
    if budget != cfg.elastic_max_retries:   # a soak's random faults would use up the default before they all fired
        print(f"elastic: chaos: elastic_max_retries={budget} for this run (it was {cfg.elastic_max_retries}): its "
              f"{len(faults)} faults may cost up to {budget} recoveries", file=sys.stderr)
        cfg = cfg.replace(elastic_max_retries=budget)
    supervised = any(f.hits_client for f in faults)   # the client is killed or stopped: it runs in a child
    if supervised and not cfg.run_name:   # every client of the run must find the same run directory
        cfg = cfg.replace(run_name=trainer_for(cfg).run_dir().name)
    job = trainer_for(cfg)
    if not supervised:
        job.prestart_workers()   # the workers' imports overlap the reference and the tracing (a client's own)
    job.programs()           # traced once: the reference's digest and the faulted run share them
    if supervised:
        job_blob(job)        # its clients get it pickled: a job that cannot be is refused before the reference
    trainer_for = job.with_config
    soak = options.duration_seconds if options.mtbf_seconds else None
    reference = None
    if not soak:
        reference, ref_dir = reference_report(trainer_for, cfg, cfg.steps)
    trainer = trainer_for(cfg)
    info = {"spec": ",".join(f.spec() for f in faults), "seed": options.seed, "mtbf_seconds": options.mtbf_seconds,
            "duration_seconds": options.duration_seconds, "scenario": options.scenario}
    ends = []
    if supervised:
        live, ends = run_clients(trainer, faults, seed=options.seed, info=info, run_dir=trainer.run_dir(),
                                 on_step=on_step)
    else:
        injector = FaultInjector(faults, seed=options.seed, info=info)
        try:
            trainer.fit(on_step=on_step, observer=injector, max_seconds=soak, fresh=True,
                        on_event=getattr(on_step, "observe", None))   # (an RL run's bar: its rewards)
        except ElasticError:
            pass   # recorded as run_failed; the verdict says why
        live = injector.ctl.state if injector.ctl is not None else None   # the controller is closed: its final state
    run_dir = trainer.run_dir()
    events = read_events(run_dir / "events.jsonl")
    report = build_report(events)
    if soak:
        reference, ref_dir = reference_report(trainer_for, cfg, max(report["steps_completed"], 1))
    verdict = judge(report, reference, events, rtol=options.rtol, live_state=live)
    supervision = supervision_reasons(ends, [f.spec() for f in faults])
    if supervision:   # what the clients did that the log cannot show (a stale client not refused, ...)
        verdict.update(verdict="fail", verdict_reasons=verdict["verdict_reasons"] + supervision)
    verdict["reference"] = {"run_dir": str(ref_dir), "losses": reference["losses"],
                            "final_state_digest": reference["final_state_digest"]}
    log = EventLog(run_dir / "events.jsonl")
    try:
        log.emit("verdict", **verdict)
    finally:
        log.close()
    return render_run(run_dir), run_dir


def _holds_checkpoints(directory: str) -> bool:
    """Whether ``directory`` (local or ``gs://``) holds a checkpoint's step folder, complete or not, in any layout
    (a slice of several hosts' ``host<k>-of-<H>``, a pipeline's ``stage<k>``: :func:`runtime.checkpoint_steps`)."""
    from etils import epath

    try:
        return bool(checkpoint_steps(directory)) or any(p.name.isdigit() for p in epath.Path(directory).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return False


def _fresh_run(cfg: Config) -> Config:
    """``cfg`` for a faulted run that starts from nothing.

    A chaos run is judged against a reference from step 0, and its faults are
    set at steps and saves of that run: resumed from an earlier run's
    checkpoints it would skip them. When the run directory's checkpoints
    hold an earlier run's, the faulted run takes the next free name
    (``<run_name>-2``, ...), said in one line, and the earlier run is left
    as it is; checkpoints in an ``elastic_checkpoint_directory`` of the
    user's are refused (``ConfigError``): it is not ours to pick another.
    """
    if not cfg.enable_checkpointing or not cfg.run_name:
        return cfg   # nothing to resume from; an unnamed run is named afresh anyway
    base = pathlib.Path(cfg.base_output_directory)
    if cfg.elastic_checkpoint_directory:
        if _holds_checkpoints(cfg.elastic_checkpoint_directory):
            raise ConfigError(f"elastic_checkpoint_directory {cfg.elastic_checkpoint_directory} holds an earlier "
                              "run's checkpoints: a chaos run starts from nothing (its faults are set at its own "
                              "steps); give it an empty directory")
        return cfg
    name, n = cfg.run_name, 1
    while _holds_checkpoints(str(base / name / "checkpoints")):
        n += 1
        name = f"{cfg.run_name}-{n}"
    if name != cfg.run_name:
        print(f"elastic: {base / cfg.run_name} holds an earlier run's checkpoints, which a chaos run must not resume "
              f"from: this one is run_name={name}", file=sys.stderr)
    return cfg.replace(run_name=name)
