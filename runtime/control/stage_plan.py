"""Pipeline stages in membership decisions: pure rules :mod:`runtime.control.plan` uses.

A pipelined run's placement grid has a row per stage (:class:`runtime.control.placement.Placement`), and each stage
holds its own share of the state, so a change keeps each slice's position (its stage) and asks per stage:

- :func:`fill_slots`: who takes each lost slice (a spare that shadows the slice's stage first), and which
  whole pipeline replicas are dropped when too few workers are left;
- :func:`stage_without_replica`: whether some stage lost every copy of its own;
- :func:`copy_source`: where each stage's copies come from (the tier of the stage that fell back furthest);
- :func:`grow_replicas`: whole pipeline replicas added back, a spare per stage;
- :func:`arrange_stages`: a restore's placement, each stage on a host holding its snapshot, and
  :func:`unmatched_stages`: the stages it could not place so (the restore then waits for their hosts).

For an unpipelined run (one stage) they answer what the data-parallel rules always did. Nothing here reads a
clock, a socket or a file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from runtime.control.placement import Placement
from runtime.control.tiers import TIERS, Holding, TierChoice, choose_source

__all__ = ["arrange_stages", "copy_source", "fill_slots", "grow_replicas", "stage_without_replica",
           "unmatched_stages"]


def fill_slots(placement: Placement, dead: frozenset[str], replicas: frozenset[str],
               spare_stages: Mapping[str, int]) -> tuple[list[str | None], list[str], int]:
    """Who takes each lost slice: ``(the new active slices, the spares left, how many slices were dropped)``.

    Unpipelined: the slices keep their positions, a lost one gets a spare (one that shadows the state first)
    or is dropped (None in its position). Pipelined (several stages, stage-major): a lost slice keeps its
    stage; when too few workers are left for every pipeline replica, whole replicas are dropped (those that
    lost the most first; their survivors become spares: a stage of a dropped replica cannot run without the
    others), and the slices kept are filled by, in order: a survivor of a dropped replica of the same stage
    (it holds that stage's state), a spare that shadows that stage (``spare_stages``: the stage each spare's
    programs are for), a spare that shadows nothing, any other; the new slices are stage-major over the
    replicas kept (None only when not even one replica can be filled)."""
    spares = sorted((s for s in placement.spares if s not in dead), key=lambda s: s not in replicas)   # stable
    stages = placement.stages
    if stages == 1:
        slots: list[str | None] = []
        for w in placement.active:
            slots.append(w if w not in dead else spares.pop(0) if spares else None)
        return slots, spares, slots.count(None)
    per = placement.replicas
    columns = [[row[r] for row in placement.grid] for r in range(per)]
    lost = [sum(w in dead for w in column) for column in columns]
    order = sorted(range(per), key=lambda r: (lost[r], r))
    for keep in range(per, 0, -1):
        kept, gone = sorted(order[:keep]), order[keep:]
        orphans = [(k, w) for r in gone for k, w in enumerate(columns[r]) if w not in dead]
        if len(spares) + len(orphans) >= sum(lost[r] for r in kept):
            break
    else:   # not one replica can be filled: nothing is dropped, the lost slices stay empty
        return [w if w not in dead else None for w in placement.active], spares, sum(lost)
    pool = [w for _, w in orphans] + spares
    home = dict((w, k) for k, w in orphans)

    def pick(k: int) -> str:
        w = next((w for w in pool if home.get(w) == k), None) or \
            next((w for w in pool if w in replicas and spare_stages.get(w) == k), None) or \
            next((w for w in pool if w not in home and w not in replicas), pool[0])
        pool.remove(w)
        return w

    slots = [columns[r][k] if columns[r][k] not in dead else pick(k) for k in range(stages) for r in kept]
    return slots, pool, stages * len(gone)


def stage_without_replica(placement: Placement, dead: frozenset[str], replicas: frozenset[str],
                          spare_stages: Mapping[str, int]) -> str:
    """Why a pipelined run lost its state ("" when it did not): a stage left with no live copy of its own (each
    stage holds its own share of the state: a survivor of that stage, or a spare that shadows it; a replica of
    another stage cannot supply it)."""
    for k, group in enumerate(placement.grid):
        if not any(w in replicas and w not in dead for w in group) and \
                not any(spare_stages.get(w) == k and w in replicas and w not in dead for w in placement.spares):
            return f"pipeline stage {k} lost every replica ({', '.join(group)})"
    return ""


def arrange_stages(placement: Placement, holders, hosts: Mapping[str, str]) -> Placement:
    """A pipelined restore's placement: every active worker gets the restored state, so any worker, a spare
    too, may take any slice; a stage's snapshot is read where it lies, so each stage gets a worker whose host
    holds that stage's snapshot (``holders[k]``: those hosts; ``hosts``: each worker's, a worker missing there
    is a host of its own) where a matching exists. The placement stays when it already matches; else the
    matched workers come first in their stages, the other active workers fill the rest in order, and those
    left over (when spares were matched) become spares."""
    active, groups, stages = placement.active, placement.grid, placement.stages
    members = list(active) + list(placement.spares)
    can = [[w for w in members if hosts.get(w, w) in holders[k]] for k in range(stages)]
    if all(any(w in can[k] for w in group) for k, group in enumerate(groups)):
        return placement
    taken: dict[str, int] = {}   # worker -> the stage it serves (a bipartite matching, by augmenting paths)

    def assign(k: int, seen: set) -> bool:
        for w in can[k]:
            if w not in seen:
                seen.add(w)
                if w not in taken or assign(taken[w], seen):
                    taken[w] = k
                    return True
        return False

    for k in sorted(range(stages), key=lambda k: len(can[k])):
        assign(k, set())
    chosen = {k: w for w, k in taken.items()}
    rest = [w for w in members if w not in taken]
    out = []
    for k in range(stages):
        group = [chosen[k]] if k in chosen else []
        while len(group) < len(active) // stages:
            group.append(rest.pop(0))
        out += group
    return dataclasses.replace(placement, active=tuple(out), spares=tuple(rest))


def unmatched_stages(placement: Placement, holders, hosts: Mapping[str, str]) -> list[int]:
    """The stages of ``placement`` with no worker on a host holding their snapshot (``holders``, ``hosts``: as
    :func:`arrange_stages` takes them): a restore there would go back further, or fail."""
    return [k for k, group in enumerate(placement.grid)
            if not any(hosts.get(w, w) in holders[k] for w in group)]


def copy_source(new: Placement, old: Placement, replicas: frozenset[str], spare_stages: Mapping[str, int],
                committed: int) -> TierChoice:
    """Where the ``new`` placement's copies come from: a survivor of ``old`` (``replica``), else a promoted shadow
    spare (``shadow``). A pipelined run's stages each have their own: the choice of the stage that fell back
    furthest (a stage with only its shadow left makes the recovery a shadow one)."""
    was, stages, old_active = old.stage_of, new.stages, old.active   # a survivor's stage (a spare's: spare_stages)
    choices = []
    for k, group in enumerate(new.grid):
        holders = [w for w in group if w in replicas and (stages == 1 or was.get(w, spare_stages.get(w)) == k)]
        choices.append(choose_source([Holding(w, committed) for w in holders if w in old_active],
                                     [Holding(w, committed) for w in holders if w not in old_active],
                                     (), (), committed))
    return max(choices, key=lambda c: TIERS.index(c.tier) if c.ok else len(TIERS))


def grow_replicas(placement: Placement, missing: int, spare_stages: Mapping[str, int]) -> Placement:
    """A pipelined run grown back by whole pipeline replicas (up to ``missing`` slices), a spare per stage: one
    whose programs are that stage's (``spare_stages``) first."""
    spares, groups, stages = list(placement.spares), [list(g) for g in placement.grid], placement.stages
    for _ in range(min(missing // stages, len(spares) // stages)):
        for k, group in enumerate(groups):
            w = next((w for w in spares if spare_stages.get(w) == k), spares[0])
            spares.remove(w)
            group.append(w)
    return placement.following((w for g in groups for w in g), spares)
