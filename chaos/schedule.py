"""Random fault schedules and target resolution: pure functions of their arguments.

Contract:

* :func:`random_faults` draws a schedule from a seed alone, so a failing chaos
  run is replayed by rerunning with the same seed.
* :func:`resolve_target` is called by the injector at the moment a fault fires,
  with the membership it sees then; it returns the worker ids to hit, or raises
  :class:`TargetError` when the target names nobody (the injector records the
  fault as skipped, with the message).
"""

from __future__ import annotations

import random

from chaos.spec import INJECTABLE_KINDS, Fault, FaultSpecError, Target, When, validate

__all__ = ["DEFAULT_KINDS", "RECOVERIES_PER_WORKER", "TargetError", "random_faults", "recovery_budget",
           "resolve_target"]

#: The kinds a random schedule draws from unless told otherwise: every kind the runtime can inject.
#: What a soak draws from unless told: every injectable kind but kill_save (it needs a run that checkpoints).
DEFAULT_KINDS = tuple(k for k in INJECTABLE_KINDS if k != "kill_save")
_HANG_RESUME_SECONDS = 2.0
_FOR_RANGE_SECONDS = {"straggle": (2.0, 6.0), "partition": (2.0, 5.0)}


class TargetError(ValueError):
    """A fault's target names no worker in the current membership."""


def random_faults(seed: int, mtbf_seconds: float, duration_seconds: float,
                  kinds: tuple[str, ...] = DEFAULT_KINDS) -> list[Fault]:
    """Faults at exponentially distributed times (mean gap ``mtbf_seconds``) before
    ``duration_seconds``, each of a kind drawn from ``kinds``, aimed at ``random``
    (``kill_save``: at the checkpoint's writer).

    Deterministic in ``seed``. ``hang`` resumes after 2 s; ``straggle`` and
    ``partition`` last a few seconds (drawn, rounded to 0.1 s); times are rounded
    to milliseconds. Raises FaultSpecError for bad arguments or a kind the runtime
    cannot inject or that needs a transfer.
    """
    if not mtbf_seconds > 0:
        raise FaultSpecError(f"mtbf_seconds must be > 0, got {mtbf_seconds!r}")
    if not duration_seconds >= 0:
        raise FaultSpecError(f"duration_seconds must be >= 0, got {duration_seconds!r}")
    if not kinds:
        raise FaultSpecError("random_faults needs at least one fault kind")
    # Check every kind up front, not only those a short schedule happens to draw.
    validate([Fault(kind, _random_target(kind), When(time=0.0)) for kind in kinds])
    rng = random.Random(seed)
    faults: list[Fault] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_seconds)
        if t >= duration_seconds:
            break
        kind = rng.choice(kinds)
        options: tuple[tuple[str, float], ...] = ()
        if kind == "hang":
            options = (("resume", _HANG_RESUME_SECONDS),)
        elif kind in _FOR_RANGE_SECONDS:
            options = (("for", round(rng.uniform(*_FOR_RANGE_SECONDS[kind]), 1)),)
        faults.append(Fault(kind, _random_target(kind), When(time=round(t, 3)), options))
    return faults


#: The recoveries one worker a fault hits may cost a run: the failure it causes, and one more when it is found again
#: inside that recovery (a hung worker refused by a step, then its lease; the next fault landing mid-recovery).
RECOVERIES_PER_WORKER = 2


def recovery_budget(faults, max_retries: int, workers: int) -> int:
    """The ``elastic_max_retries`` a chaos run of ``faults`` runs with: ``max_retries``, raised to what the faults
    may cost when that is more, so a run that survives every fault it fires never fails for the budget.

    Each fault may cost :data:`RECOVERIES_PER_WORKER` per worker it hits (``all``/``everything``: up to
    ``workers``, the run's slices and spares; any other target, the client's too: one). ``max_retries`` 0
    (recovery off: a negative control) stays 0. Pure; :func:`chaos.harness.run_chaos` applies it.
    """
    if max_retries <= 0:
        return max_retries
    need = sum(RECOVERIES_PER_WORKER * (max(workers, 1) if f.target.kind in ("all", "everything") else 1)
               for f in faults)
    return max(max_retries, need)


def _random_target(kind: str) -> Target:
    return Target("role", "writer") if kind == "kill_save" else Target("random")


def resolve_target(target: Target, placement, spares: tuple[str, ...], rng: random.Random, *,
                   source: str | None = None, dest: str | None = None, writer: str | None = None,
                   samplers: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The worker ids ``target`` names now in ``placement`` (the run's placement grid,
    :class:`runtime.control.placement.Placement`: ``active[v]`` runs virtual slice ``v``, and
    ``stage=K,replica=R`` is ``grid[K][R]``); ``spares``: the live spares.

    ``source``/``dest`` are the two ends of the state transfer in progress, if any;
    ``writer`` the worker that writes the run's next checkpoint (None: the run writes none); ``samplers`` an RL
    run's live samplers (``role=sampler``; ``role=trainer`` is an active slice).
    Random choices use ``rng`` only. Raises TargetError when nobody matches.
    """
    kind, value, active = target.kind, target.value, placement.active
    if kind == "slice":
        if not isinstance(value, int) or not 0 <= value < len(active):
            raise TargetError(f"slice {value} is out of range: {_count(active, 'active slice')}")
        return (active[value],)
    if kind == "stage":
        return (_stage_worker(target, placement),)
    if kind == "worker":
        if value not in active and value not in spares:
            raise TargetError(f"unknown worker {value!r} (active: {_ids(active)}; spares: {_ids(spares)})")
        return (str(value),)
    if kind == "role" and value == "sampler":
        if not samplers:
            raise TargetError("role=sampler names nobody: no sampler is live (an RL run's, rl_samplers > 0)")
        return (rng.choice(samplers),)
    if kind == "random" or (kind == "role" and value in ("active", "trainer")):
        if not active:
            raise TargetError("no active slice to hit")
        return (rng.choice(active),)
    if kind == "role" and value == "spare":
        if not spares:
            raise TargetError(f"no spare left (active: {_ids(active)})")
        return (rng.choice(spares),)
    if kind == "role" and value in ("source", "dest"):
        who = source if value == "source" else dest
        if who is None:
            raise TargetError(f"role={value} names nobody: no state transfer is in progress")
        return (who,)
    if kind == "role" and value == "writer":
        if writer is None:
            raise TargetError("role=writer names nobody: no checkpoint save is left in the run (every one "
                              "ordered was written, and none follows)")
        return (writer,)
    if kind == "all":
        if not active:
            raise TargetError("no active slice to hit")
        return tuple(active)
    if kind == "everything":
        if not active and not spares:
            raise TargetError("no worker to hit")
        return (*active, *spares)
    if kind == "client":
        raise TargetError("target client names no worker: the client is the process driving the run (the "
                          "injector strikes it itself, under the chaos supervisor)")
    raise TargetError(f"cannot resolve target {target.spec()!r}")


def _stage_worker(target: Target, placement) -> str:
    """The worker running stage ``target.value`` of pipeline replica ``target.replica`` (None: replica 0)."""
    stage, replica, stages = target.value, target.replica or 0, placement.stages
    if stages <= 1:
        raise TargetError(f"target {target.spec()} names nobody: the run has no pipeline stages "
                          "(dcn_pipeline_parallelism=1); use slice=N")
    if not 0 <= stage < stages:
        raise TargetError(f"stage {stage} is out of range: the run has {stages} pipeline stages (0..{stages - 1})")
    try:
        groups = placement.grid
    except ValueError as e:
        raise TargetError(f"target {target.spec()} names nobody now: {e}") from None
    if not 0 <= replica < len(groups[stage]):
        raise TargetError(f"replica {replica} of stage {stage} is out of range: "
                          f"{_count(groups[stage], 'pipeline replica')}")
    return groups[stage][replica]


def _ids(ids: tuple[str, ...]) -> str:
    return ", ".join(ids) if ids else "none"


def _count(items: tuple[str, ...], noun: str) -> str:
    n = len(items)
    if n == 0:
        return f"no {noun}s"
    return f"{n} {noun}{'s' if n != 1 else ''} (0..{n - 1})"
