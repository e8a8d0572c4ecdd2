"""Where a recovery takes the state from: the state tiers, as pure functions.

A copy of the training state lives in one of four tiers, cheapest first:

1. ``replica``: a live active worker that holds the committed state (the
   normal recovery: peer-to-peer copy, nothing lost);
2. ``shadow``: a shadow spare that mirrored the committed state;
3. ``snapshot``: an in-memory snapshot a worker kept of an older step;
4. ``checkpoint``: a persistent checkpoint (:mod:`runtime.state.checkpoint`).

:func:`choose_source` picks one: a replica at the committed step, else a
shadow at it, else the newest complete snapshot, else the newest complete
checkpoint; training then resumes at that copy's step and redoes the steps
lost (the trajectory is deterministic, so the redone steps are the same
bits). A copy ahead of the committed step is never used: that step was not
committed, and the controller's record of committed steps is the truth.

:func:`backup_tier` is what ``elastic_backup_kind`` means: the run keeps one
extra copy of the committed state beyond the replicas, on a shadow spare
while one exists, else in the kind the configuration names.

Nothing here reads a clock, a socket or a file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["BACKUP_KINDS", "FAIL", "TIERS", "EveryStage", "Holding", "TierChoice", "backup_tier", "choose_source", "stage_snapshot"]

#: The tiers, in the order :func:`choose_source` prefers them.
TIERS = ("replica", "shadow", "snapshot", "checkpoint")
#: The tier of a choice when no copy is usable.
FAIL = "fail"
#: The values of ``elastic_backup_kind``: the tier that keeps the extra copy when no shadow spare exists.
BACKUP_KINDS = ("snapshot", "checkpoint")


@dataclasses.dataclass(frozen=True)
class Holding:
    """A copy of the state: who has it (a worker id, or a checkpoint's path) and after how many applied steps.

    ``complete``: False for a snapshot or checkpoint still being written (or
    a copy still arriving on a shadow); such a copy is never chosen.
    """

    source: str
    step: int
    complete: bool = True


@dataclasses.dataclass(frozen=True)
class TierChoice:
    """Where to take the state from: ``tier`` (one of :data:`TIERS`, or :data:`FAIL`), ``source``
    (the :class:`Holding`'s), the ``step`` it holds and ``steps_lost`` (committed step - ``step``:
    the steps to redo). For :data:`FAIL`, ``source``, ``step`` and ``steps_lost`` are None."""

    tier: str
    source: str | None
    step: int | None
    steps_lost: int | None
    reason: str

    @property
    def ok(self) -> bool:
        return self.tier != FAIL


HoldingsArg = Mapping[str, int] | Iterable[Holding]


def choose_source(live_replicas: HoldingsArg, shadows: HoldingsArg, snapshots: HoldingsArg,
                  checkpoints: HoldingsArg, committed_step: int) -> TierChoice:
    """The copy a recovery restores from (see the module doc for the order).

    Each tier is given as :class:`Holding` objects or as ``{source: step}``
    (complete copies). Replicas and shadows count only at
    ``committed_step``; snapshots and checkpoints at or before it, the
    newest first. Ties go to the smallest source, so the answer does not
    depend on the order of the input. Returns a :data:`FAIL` choice, with
    the reason, when no copy is usable. Malformed holdings raise ValueError.
    """
    if isinstance(committed_step, bool) or not isinstance(committed_step, int) or committed_step < 0:
        raise ValueError(f"committed_step must be a non-negative int, got {committed_step!r}")
    given = dict(zip(TIERS, (_holdings(t, x) for t, x in
                             zip(TIERS, (live_replicas, shadows, snapshots, checkpoints)))))
    for tier in TIERS:
        exact = tier in ("replica", "shadow")
        usable = [h for h in given[tier] if h.complete and
                  (h.step == committed_step if exact else h.step <= committed_step)]
        if not usable:
            continue
        best = min(usable, key=lambda h: (-h.step, h.source))
        lost = committed_step - best.step
        why = (f"{tier} {best.source} holds the committed step {committed_step}" if lost == 0 else
               f"{tier} {best.source} holds step {best.step}: {lost} committed step{'s' * (lost != 1)} to redo")
        skipped = [t for t in TIERS[:TIERS.index(tier)] if given[t]]
        if skipped:
            why += f" (no usable {' or '.join(skipped)}: {_why_not(given, skipped, committed_step)})"
        return TierChoice(tier, best.source, best.step, lost, why)
    held = [h for t in TIERS for h in given[t]]
    if not held:
        return TierChoice(FAIL, None, None, None, "no replica, shadow, snapshot or checkpoint holds the state")
    return TierChoice(FAIL, None, None, None,
                      f"no copy of the committed step {committed_step} or older is usable: "
                      f"{_why_not(given, [t for t in TIERS if given[t]], committed_step)}")


def stage_snapshot(held: Sequence[Mapping[str, Iterable[int]]], at_most: int) -> tuple[int, tuple[str, ...]] | None:
    """A pipelined run's snapshot restore: the newest step at or before ``at_most`` that every stage holds, with the
    worker of each stage that loads it (the smallest id holding it); None when no step is held by every stage.

    ``held[k]``: ``{worker of stage k: the snapshot steps its host holds in stage k's directory}``. Every stage
    must restore the same step: a stage's state of another step does not fit the others'.
    """
    steps = [{s for got in stage.values() for s in got if s <= at_most} for stage in held]
    common = set.intersection(*steps) if steps else set()
    if not common:
        return None
    step = max(common)
    return step, tuple(min(w for w, got in stage.items() if step in got) for stage in held)


class EveryStage:
    """Which steps every pipeline stage saved (a checkpoint or snapshot of a pipelined run is whole only then)."""

    def __init__(self, stages: int):
        self.stages = stages
        self._seen: dict[int, set] = {}

    def saved(self, step: int, stage: int | None) -> bool:
        """Notes that ``stage`` (None: an unpipelined run's only one) saved ``step``; True the first time every
        stage has."""
        if self.stages == 1:
            return True
        seen = self._seen.setdefault(step, set())
        if stage in seen or len(seen) == self.stages:
            return False
        seen.add(stage)
        for old in sorted(self._seen)[:-16]:   # a bounded memory of recent steps
            del self._seen[old]
        return len(seen) == self.stages


def backup_tier(backup_kind: str, *, shadow_spares: int) -> str:
    """The tier that keeps the run's extra copy of the committed state (``elastic_backup_kind``).

    ``"shadow"`` while ``shadow_spares`` > 0 (a shadow spare mirrors every
    step; no snapshot or checkpoint is needed for recovery), else
    ``backup_kind``: ``"snapshot"`` (in memory on a worker: fast, lost with
    that worker) or ``"checkpoint"`` (persistent: survives every worker,
    slower to write and read). Raises ValueError naming the key for any
    other kind.
    """
    if backup_kind not in BACKUP_KINDS:
        raise ValueError(f"elastic_backup_kind must be one of {', '.join(BACKUP_KINDS)}, got {backup_kind!r}")
    if isinstance(shadow_spares, bool) or not isinstance(shadow_spares, int) or shadow_spares < 0:
        raise ValueError(f"shadow_spares must be a non-negative int, got {shadow_spares!r}")
    return "shadow" if shadow_spares else backup_kind


def _holdings(tier: str, given: HoldingsArg) -> tuple[Holding, ...]:
    items = ([Holding(s, n) for s, n in given.items()] if isinstance(given, Mapping) else list(given))
    for h in items:
        if not isinstance(h, Holding):
            raise ValueError(f"{tier}: expected Holding or {{source: step}}, got {h!r}")
        if not isinstance(h.source, str) or not h.source:
            raise ValueError(f"{tier}: a holding's source must be a non-empty str, got {h.source!r}")
        if isinstance(h.step, bool) or not isinstance(h.step, int) or h.step < 0:
            raise ValueError(f"{tier} {h.source}: step must be a non-negative int, got {h.step!r}")
    return tuple(items)


def _why_not(given: dict, tiers, committed: int) -> str:
    """Why the holdings of ``tiers`` are not usable, one clause per tier."""
    out = []
    for tier in tiers:
        hs = given[tier]
        if not any(h.complete for h in hs):
            out.append(f"every {tier} is incomplete")
        elif tier in ("replica", "shadow"):
            out.append(f"{tier}s hold steps {sorted({h.step for h in hs if h.complete})}, not {committed}")
        else:
            out.append(f"{tier}s hold only steps after {committed}")
    return "; ".join(out)
