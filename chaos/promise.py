"""What each recovery had to work with, and what it therefore promised: the recovery rules of the chaos verdict.

A recovery can be only as good as what the faults leave. Read from the run's
``events.jsonl`` alone (never from what the runtime says it chose), each
recovery gets the promise of the best copy of the committed state that was
left when it ended:

=====================================  ==========================================================
the faults leave                       the promise (``kind``)
=====================================  ==========================================================
an active worker with the state        ``replica``: no step recomputed, no restore
a spare shadowing the state            ``shadow``: no step recomputed, no restore
only in-memory snapshots               ``snapshot``: the newest restored, at most
                                       ``elastic_snapshot_interval`` + in flight recomputed
only checkpoints                       ``checkpoint``: the newest complete, valid one restored,
                                       at most ``checkpoint_period`` + in flight recomputed
nothing                                ``none``: the run cannot recover, and its verdict fails
=====================================  ==========================================================

"In flight" is how far a copy can trail the committed steps while it is
written: the most steps any complete copy of that kind trailed them when it
was reported in place (``snapshot_saved``/``snapshot_copied``,
``checkpoint_saved``), and at least ``elastic_dispatch_depth``. "Newest" is
the newest copy the events show in place at or before the committed step
(a checkpoint found corrupt, ``checkpoint_skipped``, does not count); a
restore may take a newer one (written, not yet reported), never an older one.
A snapshot and a checkpoint of the same step: the snapshot's promise (it is
the cheaper read, as the runtime prefers).

A *recovery* runs from a ``failure_detected`` to the next ``recovered``; a
failure during a recovery (the transfer's source killed) belongs to it.
Steps it recomputed are the ``step_committed`` events of steps committed
before, up to the next recovery. Every promise holds exactly-once and the
reference trajectory too; :func:`chaos.verdict.judge` checks those for the
whole run.

A log may hold several attempts of the run (``job_started`` each, see
``attempts`` in docs/report.md): each starts afresh, with only the
checkpoints of earlier ones left, except one whose restarted client
re-attached the live workers (``client_attached``): that one goes on with
what the dead client had, its open recovery included (the client's loss,
``ClientLostError``, is a failure like any other, and one during a recovery
belongs to it).

Pure: :func:`promises` reads a list of events and the run's config dict.
"""

from __future__ import annotations

import dataclasses
import re

from runtime import Backup, RunState

__all__ = ["KINDS", "Promise", "promises"]

#: The promises, best first.
KINDS = ("replica", "shadow", "snapshot", "checkpoint", "none")
_SKIPPED_STEP = re.compile(r"step (\d+) ")   # the runtime's checkpoint_skipped detail: "step N (path): why"
# What a client may write after job_started before it starts an attempt or re-attaches the live workers
# (client_attached; the workers that did not answer it are declared dead first).
_BEFORE_START = frozenset({"programs_built", "chaos_started", "worker_suspect", "worker_dead", "security_refused"})


@dataclasses.dataclass(frozen=True)
class Promise:
    """One recovery: what was left, what that promised, what the run did (see the module docstring).

    ``failures``: 0-based indices into the report's ``failures`` (one per
    ``failure_detected`` of this recovery); ``step``: the steps committed
    when it began; ``left``: the workers left holding the state (replica,
    shadow) and the newest snapshot and checkpoint steps in place then;
    ``newest``: the newest copy of the promise's kind (snapshot, checkpoint);
    ``allowed_recompute``: the steps the promise lets it recompute (None for
    ``none``), ``in_flight`` the part of those due to copies trailing the
    committed steps; ``restored``: ``{"tier", "step"}`` or None;
    ``recomputed``: committed steps committed again after it; ``kept``: the
    run recovered within the promise; ``reason``: why not (None when kept).
    """

    failures: tuple[int, ...]
    step: int
    kind: str
    left: dict
    newest: int | None
    allowed_recompute: int | None
    in_flight: int | None
    recovered: bool
    restored: dict | None
    recomputed: int
    kept: bool
    reason: str | None

    def as_dict(self) -> dict:
        """The report's form (``report.json``'s ``promises``: docs/report.md)."""
        out = dataclasses.asdict(self)
        out["failures"] = list(self.failures)
        return out


@dataclasses.dataclass
class _Recovery:
    failures: list
    step: int
    committed: int
    had_state: bool
    replicas: frozenset
    shadows: frozenset
    restored: tuple | None = None      # (tier, step)
    recovered: bool = False
    survivors: tuple = ()
    snapshot: int | None = None
    checkpoint: int | None = None
    recomputed: int = 0
    stages: tuple = ()                 # a pipelined run: the active slices of each stage when it failed
    stage_of: dict = dataclasses.field(default_factory=dict)   # ... and the stage each worker's programs are for


def promises(events: list[dict], config: dict | None) -> list[Promise]:
    """One :class:`Promise` per recovery in ``events``, in order; ``config`` is the report's ``config``.

    The run's facts (placement, the dead, the replicas, the shadows, the
    snapshots and checkpoints held, the committed frontier, each worker's
    pipeline stage) are :class:`runtime.RunState`'s, folded here from the
    events; what is the judge's own is what makes a promise: the recovery
    windows, what each restored, the steps committed again, how far copies
    trailed, the checkpoints found corrupt, and the checkpoints an earlier
    attempt left on disk (a run state is one attempt's).

    Raises nothing for an odd log: events it does not know are ignored, and
    a recovery still open when the log ends is one that did not recover.
    """
    cfg = config or {}
    shadowing = bool(cfg.get("elastic_shadow_spares"))
    started = any(e.get("kind") == "shadows_started" for e in events)
    pipeline = int(cfg.get("dcn_pipeline_parallelism") or 1)
    state = RunState()
    kept: set = set()      # checkpoints left by earlier attempts or resumed from: (None, step), and (stage, step)
    high = 0               # the most steps committed in this attempt: a step below it committed again is recomputed
    trail = {"snapshot": 0, "checkpoint": 0}
    corrupt: set[int] = set()
    found: list[_Recovery] = []
    current: _Recovery | None = None
    failures = 0
    starting = False   # a job_started was seen: a new attempt, unless its client re-attaches the live workers
    for e in events:
        kind = e.get("kind")
        if kind == "job_started":
            starting = True
            continue
        if kind == "client_attached":
            starting = False   # the same attempt goes on: the live workers keep the state (and any open recovery)
        elif starting and kind not in _BEFORE_START:
            # An attempt of the run starts (new processes): only its checkpoints carry over.
            starting = False
            if current is not None:
                _close(current, state, _copies(state, kept, pipeline), corrupt, recovered=False)
                current = None
            kept |= _checkpoints(state)
            state, high = RunState(), 0
        elif kind == "run_started":
            kept |= _checkpoints(state)   # the run state starts afresh; what is on disk stays
        frontier = state.committed
        state = state.apply(e)
        if kind in ("state_initialized", "run_resumed") and shadowing and state.placement and not started:
            # Shadowing spares start with the state (from the seed, or the same checkpoint): a log written
            # before shadows_started said so has no event for it.
            for w in state.placement.spares:
                if w not in state.dead:
                    state = state.apply({"kind": "shadow_synced", "dest": w})
        if kind == "run_resumed":
            high = e.get("step", 0)
            kept |= {(k, high) for k in [None, *range(pipeline if pipeline > 1 else 0)]}   # every stage resumed
        elif kind == "step_committed":
            step = e.get("step", 0)
            if step < high and found:
                found[-1].recomputed += 1
            high = max(high, step + 1)
        elif kind in ("snapshot_saved", "snapshot_copied", "checkpoint_saved"):
            tier = "checkpoint" if kind == "checkpoint_saved" else "snapshot"
            trail[tier] = max(trail[tier], frontier - e.get("step", 0))
        elif kind == "checkpoint_skipped":
            m = _SKIPPED_STEP.match(str(e.get("detail", "")))
            if m:
                corrupt.add(int(m.group(1)))
        elif kind == "failure_detected":
            if current is None:
                active, spares = state.placement.active if state.placement else (), \
                    state.placement.spares if state.placement else ()
                had_state = bool(state.replicas)   # some worker held the state: it exists
                holders = state.replicas if had_state else {*active, *spares}   # no state yet: any member will do
                current = _Recovery(failures=[], step=e.get("committed") or 0, committed=e.get("committed") or 0,
                                    had_state=had_state, replicas=frozenset(w for w in holders if w not in state.dead),
                                    shadows=frozenset(w for w in state.shadows if shadowing and w not in state.dead),
                                    stages=_stages(list(active), pipeline), stage_of=dict(state.stages))
                found.append(current)
            current.failures.append(failures)
            current.committed = e.get("committed") or 0
            failures += 1
        elif kind in ("snapshot_restored", "checkpoint_restored") and current is not None:
            step = e.get("step", 0)
            current.restored = (kind.split("_")[0], step)
            current.committed = step + (e.get("steps_lost") or 0)
        elif kind == "recovered" and current is not None:
            _close(current, state, _copies(state, kept, pipeline), corrupt, recovered=True)
            current = None
    if current is not None:
        _close(current, state, _copies(state, kept, pipeline), corrupt, recovered=False)
    return [_judge(r, cfg, trail) for r in found]


def _checkpoints(state: RunState) -> set:
    """The checkpoints ``state`` holds, as the judge keeps them across attempts: ``(stage, step)`` (stage None: an
    unpipelined run's)."""
    return {(b.stage, b.step) for b in state.backups if b.tier == "checkpoint"}


def _copies(state: RunState, kept: set, pipeline: int) -> dict[str, set]:
    """``{tier: steps}`` of the complete copies of the state in place: those ``state`` holds and the checkpoints
    ``kept`` (from earlier attempts); a pipelined run's step is a copy once every stage holds one."""
    earlier = {Backup("checkpoint", step, k) for k, step in kept}
    whole = dataclasses.replace(state, backups=state.backups | earlier, pipeline_stages=pipeline)
    return {tier: set(whole.complete(tier)) for tier in ("snapshot", "checkpoint")}


def _close(r: _Recovery, state: RunState, copies: dict, corrupt: set, *, recovered: bool) -> None:
    r.recovered = recovered
    r.survivors = tuple(sorted(w for w in r.replicas | r.shadows if w not in state.dead))
    if any(not (set(stage) & set(r.survivors)
                or any(r.stage_of.get(w) == k for w in r.shadows if w not in state.dead))
           for k, stage in enumerate(r.stages)):
        r.survivors = ()   # a stage lost every replica and shadow of its own: the others' cannot supply it
    at_most = r.committed
    r.snapshot = max((s for s in copies["snapshot"] if s <= at_most), default=None)
    r.checkpoint = max((s for s in copies["checkpoint"] if s <= at_most and s not in corrupt), default=None)


def _stages(active: list, stages: int) -> tuple:
    """A pipelined run's active slices by stage (stage-major); () for an unpipelined run."""
    if stages <= 1 or not active or len(active) % stages:
        return ()
    r = len(active) // stages
    return tuple(tuple(active[k * r:(k + 1) * r]) for k in range(stages))


def _judge(r: _Recovery, cfg: dict, trail: dict) -> Promise:
    depth = int(cfg.get("elastic_dispatch_depth") or 2)
    periods = {"snapshot": ("elastic_snapshot_interval", int(cfg.get("elastic_snapshot_interval") or 0)),
               "checkpoint": ("checkpoint_period", int(cfg.get("checkpoint_period") or 0))}
    replicas = [w for w in r.survivors if w in r.replicas]
    shadows = [w for w in r.survivors if w not in r.replicas]
    left = {"replicas": replicas, "shadows": shadows, "snapshot": r.snapshot, "checkpoint": r.checkpoint}
    restored = {"tier": r.restored[0], "step": r.restored[1]} if r.restored else None
    at = f"the failure at step {r.step}"
    newest = allowed = in_flight = None
    reason = None
    if replicas or shadows or not r.had_state:
        kind = "replica" if replicas or not r.had_state else "shadow"
        allowed = 0
        who = f"{'replica' if replicas else 'shadow spare'}{'s' * (len(replicas or shadows) > 1)} " \
              f"{', '.join(replicas or shadows)}"
        if restored:
            reason = (f"{at} left {who} holding the committed state, yet the run restored the {restored['tier']} "
                      f"of step {restored['step']}: a surviving {kind} should have supplied the state.")
        elif r.recomputed:
            reason = (f"{at} left {who} holding the committed state, yet {_steps(r.recomputed)} committed before "
                      f"{'was' if r.recomputed == 1 else 'were'} recomputed: with a {kind} left, no committed step "
                      "is lost.")
    elif r.snapshot is not None or r.checkpoint is not None or restored:
        if r.snapshot is not None and (r.checkpoint is None or r.snapshot >= r.checkpoint):
            kind, newest = "snapshot", r.snapshot
        elif r.checkpoint is not None:
            kind, newest = "checkpoint", r.checkpoint
        else:   # a copy written but not yet reported when the faults struck
            kind = restored["tier"]
        key, period = periods[kind]
        in_flight = max(depth, trail[kind])
        allowed = period + in_flight
        if restored and newest is not None and restored["step"] < newest:
            reason = (f"{at} left no replica, and the newest {kind} in place was of step {newest}, yet the run "
                      f"restored the {restored['tier']} of step {restored['step']}: a restore takes the newest "
                      "valid copy.")
        elif r.recomputed > allowed:
            what = f"the {restored['tier']} of step {restored['step']}" if restored else "what was left"
            reason = (f"{at} left no replica, only {kind}s; the run recomputed {_steps(r.recomputed)} from {what}, "
                      f"more than the {allowed} promised ({key} {period} + {in_flight} in flight).")
    else:
        kind = "none"
        if not r.recovered:
            reason = (f"{at} left no replica, shadow, snapshot or checkpoint of the state: nothing could recover "
                      "it (keep a spare, or set elastic_snapshot_interval or enable_checkpointing).")
        elif r.recomputed:
            reason = (f"{at}: the run recomputed {_steps(r.recomputed)} committed before, and the events show no "
                      "copy of the state it could have restored them from.")
    if not r.recovered and kind != "none":
        reason = None   # the run stopped: the verdict's first rule says why, once
    kept = r.recovered and reason is None
    return Promise(failures=tuple(r.failures), step=r.step, kind=kind, left=left, newest=newest,
                   allowed_recompute=allowed, in_flight=in_flight, recovered=r.recovered, restored=restored,
                   recomputed=r.recomputed, kept=kept, reason=reason)


def _steps(n: int) -> str:
    return f"{n} step{'s' * (n != 1)}"
