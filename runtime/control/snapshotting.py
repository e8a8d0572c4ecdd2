"""The in-memory snapshot tier as the controller sees it: who snapshots when, what exists, what to restore.

The workers write, copy and read snapshots (:mod:`runtime.state.snapshot`, in the
background writer of :mod:`runtime.worker.saver`); the controller only decides
and records:

- :meth:`Snapshotting.order_for`: after which steps a snapshot is taken, by
  which replica, and which worker on another host keeps its copy
  (:func:`snapshot_order`). Snapshots are the run's backup
  while no spare shadows the state (:func:`runtime.control.tiers.backup_tier`).
  A pipelined run's state is one per stage: each stage snapshots its own, by
  one of its replicas, into that stage's directory of the host, its copy kept
  by any worker on another host (in that stage's directory of its host);
- :meth:`Snapshotting.note`: ``snapshot_saved`` / ``snapshot_copied`` /
  ``snapshot_failed`` events for what the workers report (the run state
  folds where each snapshot lies: ``RunState.backups``), and the
  observer's hook;
- :meth:`Snapshotting.holdings`: which members' hosts hold which snapshot
  (their own answer, from ``Abort``), for :func:`runtime.control.tiers.choose_source`.

It keeps no record of what is held: the run state does (``RunState.backups``); only the orders it gave that
no report answered yet.
"""

from __future__ import annotations

from collections.abc import Mapping

from runtime.control.placement import Placement
from runtime.state.snapshot import KEEP
from runtime.control.tiers import EveryStage, backup_tier

__all__ = ["snapshot_order", "Snapshotting"]


def snapshot_order(step: int, steps: int, interval: int, active, spares, hosts: Mapping[str, str],
                   others=()) -> tuple[str, str | None] | None:
    """``(writer, peer)`` of the in-memory snapshot after step ``step`` (0-based), or None (no snapshot then).

    A snapshot follows every ``interval``-th step but the last of ``steps``
    (the run ends there; ``interval`` 0: never). The writer rotates over
    ``active`` (the step's slices, in rank order) as checkpoint writers do;
    the peer, which keeps the second copy, is the first worker on another
    host (``hosts``: worker -> host; a worker missing there is a host of its
    own): a spare first (it takes over when the active slices die), else the
    next active slice after the writer, else one of ``others`` (a pipelined
    run's other stages' slices, when ``active`` is one stage's). None when
    every worker shares the writer's host.
    """
    n = step + 1
    if interval <= 0 or not active or n % interval or n >= steps:
        return None
    i = (n // interval) % len(active)
    writer = active[i]
    home = hosts.get(writer, writer)
    peer = next((w for w in (*spares, *active[i + 1:], *active[:i], *others) if hosts.get(w, w) != home), None)
    return writer, peer


class Snapshotting:
    """The controller's side of in-memory snapshots (see the module docstring).

    ``opts``: the run's ``ControllerOptions`` (``snapshot_interval``,
    ``backup_kind``); ``notify(step)``: called for each snapshot reported
    in place (written, and copied to its peer when one was asked; the
    controller's observer).
    """

    def __init__(self, group, opts, events, ledger, notify=None):
        self.group, self.opts, self.events, self.ledger = group, opts, events, ledger
        self.notify = notify or (lambda step: None)
        self._ordered: dict[int, dict[str, str | None]] = {}   # snapshot step -> {writer: the worker keeping its copy}
        self._in_place = EveryStage(opts.pipeline_stages)   # a pipelined run's snapshot is in place once every stage's

    @property
    def enabled(self) -> bool:
        """The run takes snapshots (an interval, and somewhere to keep them)."""
        return bool(self.group.snapshot_root)

    def order_for(self, step: int, steps: int, placement: Placement, shadows: int) -> dict[str, str | None]:
        """``{writer: peer or None}`` of the snapshot that follows step ``step`` (a pipelined run: one writer per
        stage), else {}; none while ``shadows`` spares shadow the state (they are the backup then)."""
        if not self.enabled or backup_tier(self.opts.backup_kind, shadow_spares=shadows) != "snapshot":
            return {}
        hosts = {w: self.group.host_of(w) for w in placement.members}
        groups = placement.grid
        ordered = {}
        for group in groups:   # a pipelined run's: each stage's own, its copy kept by any worker on another host
            order = snapshot_order(step, steps, self.opts.snapshot_interval, group, placement.spares, hosts,
                                   others=[w for w in placement.active if w not in group])
            if order:
                ordered[order[0]] = order[1]
        if ordered:
            self._ordered[step + 1] = ordered
            for old in sorted(self._ordered)[:-2 * KEEP]:
                del self._ordered[old]
        return ordered

    def note(self, reports) -> None:
        """Events for ``{worker: (snapshots written on its host, snapshots copied to their peer, error or "")}``."""
        for w, (saved, copied, error) in reports.items():
            stage = self.group.loaded_stage(w)
            where = {"stage": stage} if stage is not None else {}
            for step in saved:
                self.events.emit("snapshot_saved", worker=w, host=self.group.host_of(w), step=step, **where)
                if self._ordered.get(step, {}).get(w) is None and self._in_place.saved(step, stage):
                    self.notify(step)   # no copy asked: in place now (a pipelined run's: every stage's)
            for step in copied:
                peer = self._ordered.get(step, {}).get(w)
                self.events.emit("snapshot_copied", worker=w, peer=peer, host=peer and self.group.host_of(peer),
                                 step=step, **where)
                if self._in_place.saved(step, stage):
                    self.notify(step)
            if error:
                self.events.emit("snapshot_failed", worker=w, error=error[:500])

    def newest(self, at_most: int, reported: bool = False) -> int | None:
        """The newest snapshot step at or before ``at_most`` that may be held on some host: reported written or
        copied, or ordered after a step since committed (its writer applied that step and began the write; the
        report may not have arrived before the writer died). None without one. The hosts' own answers
        (:meth:`holdings`) decide what is restored. A pipelined run's: a step every stage may hold. ``reported``:
        only snapshots reported written or copied count."""
        ordered = {s for s in self._ordered if s <= at_most} if not reported else set()
        steps = self.ledger.state.complete("snapshot", at_most) | ordered   # (an order is every stage's)
        return max(steps) if steps else None

    def stage_hosts(self, step: int) -> tuple[frozenset[str], ...]:
        """A pipelined run's: for each stage, the hosts its snapshot of ``step`` was reported written or copied
        to (an ordered one not reported may never have been written: its writer died)."""
        out = [set() for _ in range(self.opts.pipeline_stages)]
        for b in self.ledger.state.backups:
            if b.tier == "snapshot" and b.stage is not None and b.step == step:
                out[b.stage].add(b.host)
        return tuple(frozenset(hosts) for hosts in out)

    @staticmethod
    def holdings(statuses, at_most: int) -> dict[str, int]:
        """``{worker: newest snapshot step at or before at_most on its host}`` from ``WorkerGroup.abort``'s
        answer (workers whose host holds none are left out)."""
        out = {}
        for w, status in statuses.items():
            steps = [s for s in status.snapshots if s <= at_most]
            if steps:
                out[w] = max(steps)
        return out
