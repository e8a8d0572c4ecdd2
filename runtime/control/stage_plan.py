"""Pipeline stages in membership decisions: pure rules :mod:`runtime.control.plan` uses.

A pipelined run's active slices are stage-major (:func:`runtime.control.policy.stage_groups`), and each stage
holds its own share of the state, so a change keeps each slice's position (its stage) and asks per stage:

- :func:`fill_slots`: who takes each lost slice (a spare that shadows the slice's stage first);
- :func:`stage_without_replica`: whether some stage lost every copy of its own;
- :func:`arrange_stages`: a restore's placement, each stage on a host holding its snapshot.

For an unpipelined run (one stage) they answer what the data-parallel rules always did. Nothing here reads a
clock, a socket or a file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from runtime.control.policy import Placement, stage_groups

__all__ = ["arrange_stages", "fill_slots", "stage_without_replica"]


def fill_slots(placement: Placement, dead: frozenset[str], replicas: frozenset[str], stages: int,
          spare_stages: Mapping[str, int]) -> tuple[list[str | None], list[str]]:
    """The new active slices by position (None: no spare left for it) and the spares left. A lost slice gets a
    spare that shadows the state first. In a pipelined run a slice keeps its position, so its stage, and gets
    a spare that shadows its stage first (``spare_stages``: the stage each spare's programs are for), else a
    spare that shadows nothing, else one that shadows another stage (it then needs a copy like any newcomer)."""
    spares = sorted((s for s in placement.spares if s not in dead), key=lambda s: s not in replicas)   # stable
    per_stage = max(len(placement.active) // stages, 1)
    slots: list[str | None] = []
    for v, w in enumerate(placement.active):
        if w not in dead:
            slots.append(w)
            continue
        pick = spares[0] if spares else None
        if stages > 1 and spares:
            k = v // per_stage
            pick = next((s for s in spares if s in replicas and spare_stages.get(s) == k), None) or \
                next((s for s in spares if s not in replicas), spares[0])
        if pick is not None:
            spares.remove(pick)
        slots.append(pick)
    return slots, spares



def stage_without_replica(active: tuple[str, ...], slots: list[str | None], replicas: frozenset[str], stages: int,
                           spare_stages: Mapping[str, int]) -> str:
    """Why a pipelined run lost its state ("" when it did not): a stage left with no replica of its own (each
    stage holds its own share of the state: a survivor of that stage, or a spare that shadows it; a replica of
    another stage cannot supply it). ``slots``: the new active slices by position (:func:`fill_slots`)."""
    per_stage = len(active) // stages
    for k in range(stages):
        now = slots[k * per_stage:(k + 1) * per_stage]
        if not any(w is not None and w in replicas and (w in active or spare_stages.get(w) == k) for w in now):
            return f"pipeline stage {k} lost every replica ({', '.join(active[k * per_stage:(k + 1) * per_stage])})"
    return ""



def arrange_stages(placement: Placement, stages: int, holders, hosts: Mapping[str, str]) -> Placement:
    """A pipelined restore's placement: every active worker gets the restored state, so any worker, a spare
    too, may take any slice; a stage's snapshot is read where it lies, so each stage gets a worker whose host
    holds that stage's snapshot (``holders[k]``: those hosts; ``hosts``: each worker's, a worker missing there
    is a host of its own) where a matching exists. The placement stays when it already matches; else the
    matched workers come first in their stages, the other active workers fill the rest in order, and those
    left over (when spares were matched) become spares."""
    active = placement.active
    groups = stage_groups(active, stages)
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
