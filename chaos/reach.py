"""Can a fault ever fire in this run? Pure checks of a fault list against the run's shape.

A fault that can never fire is bad input: the run would pass without having
been tested against it. The chaos runner calls :func:`check_reachable` before
anything starts (``elastic chaos`` exits 2). What cannot be known up front
(a random target, a time fault without a soak duration, a transfer that
depends on how recovery goes) is left to the run: the injector records a
fault that did not fire by the end as ``fault_skipped``, and the verdict
fails (``chaos.verdict.judge``).

The rules, with the reason each error gives (``docs/chaos-guide.md``):

* ``@step=N`` needs ``N < steps``: a step fault fires once N steps are
  committed, and the run commits ``steps``.
* ``@time=T`` in a soak run needs ``T < duration``: training stops
  dispatching at the duration.
* ``slice=N`` needs ``N < dcn_data_parallelism`` (times
  ``dcn_pipeline_parallelism`` in a pipelined run, whose every stage of every
  replica is a slice): the active slices never outnumber the configured ones.
* ``stage=K[,replica=R]`` needs a pipelined run (``dcn_pipeline_parallelism``
  S > 1), ``K < S`` and ``R < dcn_data_parallelism`` (the pipeline replicas).
* ``role=spare`` needs ``elastic_spares > 0``: without warmed spares, a
  relaunched worker is promoted as soon as it is ready, so no spare is ever
  there to hit.
* ``kill_save`` and ``@checkpoint=N`` need checkpoints (``enable_checkpointing``);
  ``@checkpoint=N`` needs ``N <= steps`` (checkpoints hold 1..steps applied steps);
  ``kill_save@checkpoint=N`` needs a checkpoint after the first one of step N
  or later (the last step's is the run's last save).
* ``@snapshot=N`` needs in-memory snapshots (``elastic_snapshot_interval``) and
  ``N < steps`` (no snapshot follows the last step).
* ``@transfer`` needs a worker that can join (recovery enabled, and a spare or
  ``elastic_relaunch``) and something that can lose a worker first: another
  fault that is not itself ``@transfer`` and hits workers (a client fault
  loses none), or a soak's random faults.
* A fault on the ``client`` needs workers that outlive their client
  (``elastic_client_grace_seconds`` > 0) and a run with a state they keep
  and steps left: not ``@step=0`` (before the first state), not
  ``@checkpoint=N`` when the first checkpoint of step N or later is the run's
  last (saved once every step is committed), not in soak mode (the soak's
  duration is one client's). ``hang(resume=S):client`` needs ``S`` clear of
  the workers' lease (``elastic_worker_lease_seconds``, L): ``S <= L - 1`` s
  (the client goes on) or ``S > L`` (its workers fence themselves; a new
  client takes the run over), not in between, where the workers may or may
  not have fenced themselves when it wakes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from chaos.spec import Fault, FaultSpecError, format_duration

__all__ = ["RunShape", "check_reachable", "unreachable_reason"]


@dataclasses.dataclass(frozen=True)
class RunShape:
    """The facts about a run that decide whether a fault can fire in it."""

    steps: int                              # steps the run commits (``steps``)
    slices: int                             # active slices at most (``dcn_data_parallelism`` x ``stages``)
    spares: int                             # warmed spares at the start (``elastic_spares``)
    recovery: bool = True                   # ``elastic_enabled``: a lost worker is replaced, not fatal
    relaunch: bool = True                   # ``elastic_relaunch``: dead workers come back as newcomers
    duration_seconds: float | None = None   # soak runs: training stops dispatching after this long
    random_faults: bool = False             # soak runs: random faults are drawn besides the listed ones
    checkpoints: bool = False               # ``enable_checkpointing``: the run writes persistent checkpoints
    checkpoint_period: int = 0              # ``checkpoint_period``: a checkpoint after every N steps (and the last)
    snapshot_interval: int = 0              # ``elastic_snapshot_interval``: in-memory snapshots every N steps
    client_grace_seconds: float = 120.0     # ``elastic_client_grace_seconds``: workers outlive their client so long
    worker_lease_seconds: float = 5.0       # ``elastic_worker_lease_seconds``: a silent client's workers fence then
    stages: int = 1                         # ``dcn_pipeline_parallelism``: the slices are stage-major, S x R
    samplers: int = 0                       # ``rl_samplers``: an RL run's sampler slices

    @property
    def replicas(self) -> int:
        """The pipeline replicas R (``dcn_data_parallelism``): the slices of each stage."""
        return self.slices // max(self.stages, 1)

    @classmethod
    def of(cls, cfg, *, duration_seconds: float | None = None, mtbf_seconds: float | None = None) -> RunShape:
        """The shape of a chaos run of ``cfg`` (an ``elastic.Config``); a duration counts only with an MTBF
        (soak mode), as in :func:`chaos.harness.run_chaos`."""
        soak = bool(mtbf_seconds)
        stages = cfg.dcn_pipeline_parallelism
        return cls(steps=cfg.steps, slices=cfg.dcn_data_parallelism * stages, stages=stages, spares=cfg.elastic_spares,
                   samplers=getattr(cfg, "rl_samplers", 0),
                   recovery=cfg.elastic_enabled, relaunch=cfg.elastic_relaunch,
                   duration_seconds=duration_seconds if soak else None, random_faults=soak,
                   checkpoints=cfg.enable_checkpointing, checkpoint_period=cfg.checkpoint_period,
                   snapshot_interval=cfg.elastic_snapshot_interval,
                   client_grace_seconds=cfg.elastic_client_grace_seconds,
                   worker_lease_seconds=cfg.elastic_worker_lease_seconds)


def check_reachable(faults: Sequence[Fault], shape: RunShape) -> None:
    """Raise FaultSpecError naming the first fault (1-based, with its text) that can never fire, and why."""
    for i, fault in enumerate(faults, 1):
        reason = unreachable_reason(fault, shape, faults)
        if reason:
            raise FaultSpecError(f"fault {i} {fault.spec()!r}: {reason}")


def unreachable_reason(fault: Fault, shape: RunShape, faults: Sequence[Fault] = ()) -> str | None:
    """Why ``fault`` (one of ``faults``) can never fire in a run of ``shape``; None when it may."""
    when, target = fault.when, fault.target
    if when.step is not None and when.step >= shape.steps:
        return (f"step={when.step} is never reached: the run commits {shape.steps} steps "
                f"(a fault @step=N fires once N steps are committed, so N must be below {shape.steps})")
    if when.time is not None and shape.duration_seconds is not None and when.time >= shape.duration_seconds:
        return (f"time={format_duration(when.time)} is at or after the soak duration "
                f"({format_duration(shape.duration_seconds)}): training stops dispatching then")
    if (fault.kind == "kill_save" or when.checkpoint is not None) and not shape.checkpoints:
        what = "kill_save hits a checkpoint being written" if fault.kind == "kill_save" else \
            f"checkpoint={when.checkpoint} waits for a checkpoint"
        return f"{what}, and the run writes no checkpoints (set enable_checkpointing=true, with a checkpoint_period)"
    if when.checkpoint is not None and when.checkpoint > shape.steps:
        return (f"checkpoint={when.checkpoint} is never reached: the run's newest checkpoint holds at most "
                f"{shape.steps} steps")
    if fault.kind == "kill_save" and when.checkpoint is not None and shape.checkpoint_period > 0:
        if _first_checkpoint(when.checkpoint, shape) >= shape.steps:
            return (f"kill_save cuts off a save that follows checkpoint={when.checkpoint}, and none does: the first "
                    f"checkpoint of step {when.checkpoint} or later is the run's last (step {shape.steps}; "
                    f"checkpoint_period={shape.checkpoint_period})")
    if when.snapshot is not None and not shape.snapshot_interval:
        return (f"snapshot={when.snapshot} waits for an in-memory snapshot, and the run takes none "
                "(set elastic_snapshot_interval)")
    if when.snapshot is not None and when.snapshot >= shape.steps:
        return (f"snapshot={when.snapshot} is never reached: snapshots follow steps before the last, so they hold "
                f"at most {shape.steps - 1} steps")
    if target.kind == "slice" and target.value >= shape.slices:
        keys = f"dcn_data_parallelism={shape.replicas} x dcn_pipeline_parallelism={shape.stages}" \
            if shape.stages > 1 else f"dcn_data_parallelism={shape.slices}"
        return (f"slice {target.value} does not exist: the run has {shape.slices} slices "
                f"({keys}, slices 0..{shape.slices - 1})")
    if target.kind == "stage":
        reason = _stage_unreachable(fault, shape)
        if reason:
            return reason
    if target.kind == "role" and target.value == "spare" and shape.spares == 0:
        return "role=spare names nobody: the run has no spares (elastic_spares=0)"
    if target.kind == "role" and target.value == "sampler" and shape.samplers == 0:
        return "role=sampler names nobody: the run has no samplers (an RL run's, rl_samplers > 0)"
    phase = fault.option("phase") if fault.kind == "kill" else None
    if phase == "rollout" and not (target.kind == "role" and target.value == "sampler"):
        return "phase=rollout is a sampler's: target role=sampler (e.g. kill(phase=rollout):role=sampler@step=3)"
    if phase == "weights" and not shape.samplers:
        return ("phase=weights strikes a trainer while it sends a weights version to a sampler, and the run has no "
                "samplers (an RL run's, rl_samplers > 0)")
    if phase in ("grad", "reduce", "apply", "save", "eval", "weights") and target.kind == "role" \
            and target.value == "sampler":
        return f"phase={phase} is a trainer's: a sampler runs only phase=rollout"
    if target.kind == "client":
        reason = _client_unreachable(fault, shape)
        if reason:
            return reason
    if when.transfer:
        if not shape.recovery:
            return "no state transfer can happen: no worker can ever join the run (elastic_enabled=false)"
        if shape.spares == 0 and not shape.relaunch:
            return ("no state transfer can happen: no worker can ever join the run "
                    "(elastic_spares=0 and elastic_relaunch=false)")
        if not shape.random_faults and all(f.when.transfer or f.hits_client for f in (faults or (fault,))):
            return ("no state transfer can happen: a transfer follows a lost worker, and no other fault "
                    "in the list can lose one (add e.g. kill:slice=1@step=3 before it; a client fault loses none)")
    return None


def _stage_unreachable(fault: Fault, shape: RunShape) -> str | None:
    stage, replica = fault.target.value, fault.target.replica
    if shape.stages <= 1:
        return (f"target {fault.target.spec()} names nobody: the run has no pipeline stages "
                "(dcn_pipeline_parallelism=1); use slice=N, or set dcn_pipeline_parallelism")
    if stage >= shape.stages:
        return (f"stage {stage} does not exist: the run has {shape.stages} stages "
                f"(dcn_pipeline_parallelism={shape.stages}, stages 0..{shape.stages - 1})")
    if replica is not None and replica >= shape.replicas:
        return (f"replica {replica} of stage {stage} does not exist: each stage has {shape.replicas} replicas "
                f"(dcn_data_parallelism={shape.replicas}, replicas 0..{shape.replicas - 1})")
    return None


#: ``hang(resume=S):client`` with ``S`` in (lease - this, lease]: the workers may or may not fence themselves.
CLIENT_HANG_MARGIN_SECONDS = 1.0


def _client_unreachable(fault: Fault, shape: RunShape) -> str | None:
    when = fault.when
    what = fault.spec().partition("@")[0]
    if shape.random_faults:
        return f"{what} does not run in soak mode (--mtbf): a restarted client would start a new soak duration"
    if not shape.client_grace_seconds:
        return (f"{what} needs workers that outlive their client, and elastic_client_grace_seconds=0 sends them "
                "home with it (set it above 0: the seconds they wait for a new client)")
    if when.step == 0:
        return (f"{what}@step=0 strikes before the run has a state its workers could keep for a new client: use "
                "step=1 or later")
    if when.checkpoint is not None and shape.checkpoint_period > 0 \
            and _first_checkpoint(when.checkpoint, shape) >= shape.steps:
        return (f"checkpoint={when.checkpoint}: the first checkpoint of step {when.checkpoint} or later is the "
                f"run's last (step {shape.steps}), saved once every step is committed: nothing is left for a new "
                "client to take over (use a smaller step, or @step=N)")
    if fault.kind == "hang":
        seconds, lease = fault.option("resume"), shape.worker_lease_seconds
        below = max(lease - CLIENT_HANG_MARGIN_SECONDS, 0.0)
        if below < seconds <= lease:
            return (f"resume={format_duration(seconds)} is too close to the workers' lease "
                    f"(elastic_worker_lease_seconds={format_duration(lease)}): they may or may not fence themselves "
                    f"before the client wakes; use at most {format_duration(below)} (the client goes on) or more "
                    f"than {format_duration(lease)} (a new client takes the run over)")
    return None


def _first_checkpoint(step: int, shape: RunShape) -> int:
    """The step of the first checkpoint the run saves of step ``step`` or later (the last step's at most)."""
    return min(-(-max(step, 1) // shape.checkpoint_period) * shape.checkpoint_period, shape.steps)
