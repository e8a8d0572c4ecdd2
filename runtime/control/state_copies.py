"""State copies between workers: a plan's copies (:class:`runtime.control.plan.Copy`), the pipeline stage
programs a newcomer loads first, the spares that shadow, and the check of every replica's hash after.

:class:`runtime.control.plan_executor.PlanExecutor` carries out the copies a plan lists; the controller catches
shadows up at a step boundary; the start checks the hashes of a resumed run. A pipelined run's state is one per
stage, and each stage's replicas must agree.
"""

from __future__ import annotations

import time

from runtime.core.errors import DeviceMismatchError, ReplicaDivergenceError, WorkerLostError
from collections.abc import Mapping


__all__ = ["shadow_stage", "StateCopies"]


def shadow_stage(shadows: Mapping[str, int | None], stages: int) -> int:
    """The pipeline stage a new shadow spare shadows: the one with the fewest shadows (``shadows``: each
    shadowing spare's stage), the first of those tied."""
    count = [0] * stages
    for k in shadows.values():
        if k is not None and 0 <= k < stages:
            count[k] += 1
    return count.index(min(count))


class StateCopies:
    """The copies of a run's state (see the module docstring). ``ledger``: the run's
    :class:`~runtime.control.run_state.RunLedger` (who is dead); ``before_transfer(source, dest)``: the observer's
    hook; ``shadows``: the run's :class:`runtime.control.shadows.Shadows`."""

    def __init__(self, group, opts, events, ledger, *, shadows, before_transfer):
        self.group, self.opts, self.events, self.ledger = group, opts, events, ledger
        self.shadows, self.before_transfer = shadows, before_transfer

    def carry_out(self, copies, step: int) -> int:
        """Carries out a plan's ``copies`` (:class:`runtime.control.plan.Copy`, in order: each destination pulls the
        source's state of ``step`` applied steps); returns the bytes moved. A copy whose source or destination is
        lost raises ``WorkerLostError`` (the controller plans again from the new facts)."""
        moved = 0
        for c in copies:
            if c.reshards:   # (the planner places only slices of the run's one shape: never yet)
                raise DeviceMismatchError(f"the state of {c.source} ({c.source_layout}) cannot be copied to "
                                          f"{c.dest} ({c.dest_layout}): this runtime copies the state between "
                                          "slices of one shape only")
            t0 = time.time()
            self.before_transfer(c.source, c.dest)
            self.events.emit("transfer_started", source=c.source, dest=c.dest, step=step)
            nbytes, digest, transport = self.group.transfer(c.source, c.dest, step)
            self.events.emit("state_transferred", source=c.source, dest=c.dest, step=step, bytes=nbytes,
                             seconds=time.time() - t0, digest=digest, transport=transport)
            moved += nbytes
        return moved

    def check_replicas(self, placement, step: int) -> None:
        """Every active slice of ``placement`` holds ``step`` applied steps and the same bits as the other
        replicas of its stage; ``ReplicaDivergenceError`` otherwise."""
        groups = placement.grid
        hashes = self.group.hashes([w for group in groups for w in group])
        for group in groups:
            held = [hashes[w] for w in group]
            if {s for s, _ in held} != {step} or len({d for _, d in held}) != 1:
                raise ReplicaDivergenceError("replicas disagree after recovery", step=step,
                                             cause=str({w: (s, d[:21]) for w, (s, d) in hashes.items()}))

    def take_stage(self, worker: str, stage: int) -> None:
        """A pipelined run's ``worker`` takes a slice of ``stage``: it loads that stage's programs unless it has
        them (a spare warms with stage 0's)."""
        if self.group.loaded_stage(worker) == stage:
            return
        t0 = time.time()
        loaded = self.group.load([worker], spares=[worker], stages={worker: stage})
        if worker not in loaded:
            raise WorkerLostError(worker, f"lost while loading pipeline stage {stage}'s programs")
        self.events.emit("stage_loaded", worker=worker, stage=stage, compile_seconds=loaded[worker].compile_seconds,
                         seconds=time.time() - t0)

    def sync_shadows(self, s) -> None:
        """Spares that should shadow and do not (new, or fell behind) get a copy of the committed state (``s``:
        the run's ``RunState``)."""
        behind = self.shadows.behind(s)
        if not behind:
            return
        stages, groups = s.placement.stages, s.placement.grid
        for dest in behind:
            k = 0
            if stages > 1:   # it shadows the stage with the fewest shadows: that stage's programs, then its state
                now = self.ledger.state   # (with the shadows synced in this loop)
                k = shadow_stage({w: self.group.loaded_stage(w) for w in now.shadows if w not in now.dead}, stages)
                self.take_stage(dest, k)
            source = next(w for w in groups[k] if w in s.replicas)
            t0 = time.time()
            nbytes, digest, transport = self.group.transfer(source, dest, s.committed)
            self.events.emit("shadow_synced", source=source, dest=dest, step=s.committed, bytes=nbytes,
                             seconds=time.time() - t0, digest=digest, transport=transport,
                             **({"stage": k} if stages > 1 else {}))

    def recheck_shadows(self, placement, source: str) -> None:
        """After a recovery to ``placement``: the promoted shadows are active now; a spare that still shadows keeps
        doing so only when it holds the same step and bits as ``source`` (else a copy catches it up at the next
        boundary)."""
        s = self.ledger.state
        spares = [w for w in placement.spares if w in s.shadows and w not in s.dead]
        if not spares:
            return
        groups = placement.grid
        like = {w: source if len(groups) == 1 else groups[self.group.loaded_stage(w) or 0][0] for w in spares}
        hashes = self.group.hashes([*set(like.values()), *spares])   # (a stage's replicas agree: checked)
        for w in spares:
            if hashes[w] != hashes[like[w]]:
                self.events.emit("shadow_behind", worker=w, step=hashes[w][0],
                                 error=f"holds other bits than {like[w]} after the recovery")
