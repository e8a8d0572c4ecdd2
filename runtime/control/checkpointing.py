"""The persistent tier as the controller sees it: who writes which checkpoint, what was saved, what to load.

The workers write and read checkpoints (:mod:`runtime.worker.saver`,
:mod:`runtime.state.checkpoint`); the controller only decides and records:

- :meth:`Checkpointing.order_for`: which replica writes after a step
  (:func:`checkpoint_writer`), with the loss sums the
  checkpoint records beside the state (so a resumed run knows its losses);
  :meth:`Checkpointing.next_writer` and :meth:`Checkpointing.unfinished_writer`:
  who writes the next one, or is still writing one (the chaos ``kill_save``);
- :meth:`Checkpointing.note`: ``checkpoint_saved`` / ``checkpoint_failed``
  events for what the workers report, and the observer's hook;
- :meth:`Checkpointing.newest`: the newest complete checkpoint at or before a
  step (listing the store: a network round trip for ``gs://``, so only
  when no replica is left, or at start for auto-resume);
- :meth:`Checkpointing.load`: every given worker loads the same newest valid
  one (a corrupt checkpoint is passed over for an older one, and said so);
- :meth:`Checkpointing.finish`: waits for the saves in flight at the end of
  a run, noting each as it completes, then removes what interrupted saves left.

A slice of several hosts writes each host's blocks into a store of its own
under the directory (:mod:`runtime.state.checkpoint_hosts`); a step is
listed once every host's part is there, and any host count reads it.

A pipelined run's state is one per stage: each stage writes its own
checkpoints, by one of its replicas, into ``<directory>/stage<k>``
(:meth:`Checkpointing.stage_directory`), and a step counts as checkpointed
once every stage's is complete; a restore loads each stage's from its own.

Its only state is the checkpoints ordered and not yet reported complete.
"""

from __future__ import annotations

import dataclasses
import time

from runtime.core.errors import BadInputError

__all__ = ["checkpoint_steps", "checkpoint_writer", "Checkpointing", "Loaded", "locate_checkpoint", "newest_checkpoint",
           "stage_steps"]


def checkpoint_writer(step: int, steps: int, period: int, workers) -> str | None:
    """Which worker writes a persistent checkpoint after step ``step`` (0-based), or None.

    A checkpoint follows every ``period``-th step and the last of ``steps``
    (``period`` 0: never); the writer rotates over ``workers`` (the step's
    slices, in rank order) from one checkpoint to the next, so no one
    replica carries every write.
    """
    n = step + 1
    if period <= 0 or not workers or (n % period and n != steps):
        return None
    return workers[(n // period) % len(workers)]

# At the end of a run the saves in flight are waited for in rounds this long, each noting what completed: an
# observer waiting for one checkpoint hears of it while the next is still being written.
_FLUSH_ROUND_SECONDS = 0.05


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What :meth:`Checkpointing.load` loaded: the ``step``, ``{worker: bytes read}`` (the workers that loaded
    it), the ``loss_sums`` of steps 0..step-1 recorded with it ([] when it recorded none) and, when the same
    model wrote it on another mesh, that mesh as ``(devices per slice, microbatches)`` (else None)."""

    step: int
    bytes: dict
    loss_sums: list
    written_on: tuple[int, int] | None = None


class Checkpointing:
    """The controller's side of persistent checkpoints (see the module docstring).

    ``opts``: the run's ``ControllerOptions`` (``checkpoint_directory``,
    ``checkpoint_period``, ``rpc_timeout_seconds``); ``ledger``: the run's
    :class:`~runtime.control.run_state.RunLedger`, whose ``RunState.backups``
    is the one record of the checkpoints saved; ``notify(step)``: called once
    a step's checkpoint is complete there (a pipelined run's: every stage's;
    the controller's observer).
    """

    def __init__(self, group, opts, events, ledger, notify=None):
        self.group, self.opts, self.events, self.ledger = group, opts, events, ledger
        self.notify = notify or (lambda step: None)
        # (checkpoint step, pipeline stage: 0 when unpipelined) -> its writer: ordered, not reported complete
        self._ordered: dict[tuple[int, int], str] = {}

    @property
    def directory(self) -> str:
        return self.opts.checkpoint_directory

    @property
    def stages(self) -> int:
        return self.opts.pipeline_stages

    def stage_directory(self, stage: int | None, directory: str | None = None) -> str:
        """Where a stage's checkpoints are (of ``directory``, default the run's): the directory itself, or
        ``<directory>/stage<k>`` in a pipelined run."""
        directory = directory or self.directory
        return directory if self.stages == 1 or stage is None else f"{directory.rstrip('/')}/stage{stage}"

    @property
    def enabled(self) -> bool:
        """The run writes checkpoints (a directory and a period)."""
        return bool(self.opts.checkpoint_directory and self.opts.checkpoint_period > 0)

    def writer(self, step: int, steps: int, workers) -> str | None:
        """The worker of ``workers`` (a step's slices, in rank order) that writes after ``step``, or None."""
        return checkpoint_writer(step, steps, self.opts.checkpoint_period if self.enabled else 0, workers)

    def next_writer(self, first_step: int, steps: int, grid) -> str | None:
        """The worker that writes the first checkpoint from step ``first_step`` on, if the placement ``grid``
        (:attr:`runtime.control.placement.Placement.grid`) stays; None when the run writes no more."""
        if not self.enabled:
            return None
        first = grid[0]   # (a pipelined run: stage 0's writer)
        return next((w for s in range(first_step, steps) if (w := self.writer(s, steps, first))), None)

    def unfinished_writer(self, workers) -> str | None:
        """The worker of ``workers`` that writes the newest checkpoint ordered and not yet reported complete
        (its save waits, or is being written); None when there is none."""
        pending = [key for key, w in self._ordered.items() if w in workers]
        return self._ordered[max(pending)] if pending else None

    def order_for(self, step: int, steps: int, grid, loss_sums) -> dict[str, tuple[str, list[float]]]:
        """``{writer: (directory, committed loss sums)}`` when step ``step`` ends a checkpoint period (or the
        run), else {}: what ``WorkerGroup.dispatch`` sends the writers (one of the ``grid``'s rows, a step's
        workers by stage; a pipelined run: one per stage)."""
        out = {}
        for k, group in enumerate(grid):
            writer = self.writer(step, steps, group)
            if writer:
                self._ordered[step + 1, k] = writer   # a step dispatched again (after a recovery) is ordered again
                out[writer] = (self.stage_directory(k), list(loss_sums))
        return out

    def note(self, reports) -> None:
        """Events for ``{worker: (steps whose checkpoints it finished, error or "")}``."""
        for w, (saved, error) in reports.items():
            for step in saved:
                # Its older orders are done too, or were replaced while they waited (the writer keeps the newest).
                for done in [key for key, writer in self._ordered.items() if writer == w and key[0] <= step]:
                    del self._ordered[done]
                stage = self.group.loaded_stage(w)
                was = step in self.ledger.state.complete("checkpoint")
                self.events.emit("checkpoint_saved", worker=w, step=step, directory=self.stage_directory(stage),
                                 **({"stage": stage} if stage is not None else {}))
                if not was and step in self.ledger.state.complete("checkpoint"):
                    self.notify(step)
            if error:
                self.events.emit("checkpoint_failed", worker=w, error=error[:500])

    def finish(self, grid, loss_sums) -> None:
        """End of a run: waits (up to ``rpc_timeout_seconds``) for the saves ``workers`` have in flight, noting
        each as it completes, then, when every one ended well (nobody writes now), removes the leftovers of
        interrupted saves. ``grid``: the active workers by stage; ``loss_sums``: every committed step's. When the
        last step's checkpoint was ordered from a worker no longer among them and never reported (its writer died, the save cut off), the
        first of ``workers`` (of that stage) saves it again first. A worker lost meanwhile raises its typed
        error (``WorkerLostError``: the controller recovers and calls again)."""
        if not self.enabled:
            return
        workers, last = [w for row in grid for w in row], len(loss_sums)
        save = {}
        for k, group in enumerate(grid if workers else ()):
            if (last, k) in self._ordered and self._ordered[last, k] not in workers:
                save[group[0]] = (self.stage_directory(k), list(loss_sums))
                self._ordered[last, k] = group[0]
        deadline, failed = time.monotonic() + self.opts.rpc_timeout_seconds, False
        while workers:
            left = max(deadline - time.monotonic(), 0.0)
            flushed = self.group.flush_checkpoints(workers, min(_FLUSH_ROUND_SECONDS, left), save=save)
            save = {}
            self.note({w: (saved, error) for w, (saved, error, _) in flushed.items()})
            failed = failed or any(error for _, error, _ in flushed.values())
            workers = [w for w, (_, _, idle) in flushed.items() if not idle]
            if workers and left <= 0:
                self.note({w: ([], f"still writing after {self.opts.rpc_timeout_seconds:g} s") for w in workers})
                return   # what looks partial may be in flight; left for next time
        if failed:
            return   # a save failed: its leftovers are kept for whoever looks into it; removed next time
        try:
            removed = [path for store in self._stores() for path in store.cleanup()]   # every host's too
        except Exception as e:  # noqa: BLE001 - leftovers are never restored; removing them is housekeeping
            self._unavailable(e)
            return
        if removed:
            self.events.emit("checkpoint_leftovers_removed", directory=self.directory, paths=removed)

    def newest(self, at_most: int) -> int | None:
        """The newest complete checkpoint at or before step ``at_most``; None without one (or checkpoints). A
        pipelined run's: the newest step every stage's checkpoints hold.

        An unreadable store counts as none, with a ``checkpoint_unavailable`` event.
        """
        if not self.directory:
            return None
        try:
            steps = set.intersection(*({s for s in held if s <= at_most} for held in self._steps()))
        except Exception as e:  # noqa: BLE001 - an unreadable store is no backup; the decision says so
            self._unavailable(e)
            return None
        return max(steps) if steps else None

    def locate(self, path: str) -> tuple[str, int]:
        """``(directory, step)`` of what ``load_full_state_path`` names; see :func:`locate_checkpoint`. A
        pipelined run's must hold one directory per stage (``stage<k>``), as many as the run has; raises
        ``BadInputError`` naming the path otherwise."""
        directory, step = locate_checkpoint(path)
        held = len(stage_steps(directory))
        if held != (self.stages if self.stages > 1 else 0):
            what = f"checkpoints of {held} pipeline stages" if held else "an unpipelined run's checkpoints"
            raise BadInputError(f"load_full_state_path {path!r} holds {what}, and this run has "
                                f"{self.stages if self.stages > 1 else 'no'} pipeline stages "
                                f"(dcn_pipeline_parallelism={self.stages})")
        return directory, step

    def load(self, workers, step: int, directory: str | None = None) -> Loaded:
        """``workers`` load the newest valid checkpoint at or before ``step`` (of ``directory``, default the
        run's own), all the same one.

        A corrupt checkpoint is passed over for an older one
        (``checkpoint_skipped`` events); members that ended on different
        steps all load the oldest of them again. A worker lost meanwhile is
        declared dead and left out of the answer; a checkpoint that cannot be
        read at all raises the worker's error (``WorkerError``, naming it).
        """
        replies = self._load(workers, step, directory)   # concurrently: each its copy
        for w, r in replies.items():
            for why in r.skipped:
                self.events.emit("checkpoint_skipped", worker=w, detail=why[:500])
        restored = min((r.applied_steps for r in replies.values()), default=step)
        if any(r.applied_steps != restored or not r.digest for r in replies.values()):   # ("": a slice's hosts did)
            replies = self._load(list(replies), restored, directory)
        last = None if self.stages == 1 else self.stages - 1   # the loss sums are the last stage's (the others'
        sums = next((list(r.loss_sums) for w, r in replies.items()   # recorded none for the steps they wrote)
                     if r.loss_sums and self.group.loaded_stage(w) == last), [])
        other = next(((r.written_devices_per_slice, r.written_microbatches) for r in replies.values()
                      if r.written_devices_per_slice), None)
        return Loaded(restored, {w: r.bytes for w, r in replies.items()}, sums, other)

    def _load(self, workers, step: int, directory: str | None) -> dict:
        """``workers`` load the newest valid checkpoint at or before ``step``: each from its stage's directory."""
        if self.stages == 1:
            return self.group.load_checkpoints(workers, directory or self.directory, step)
        replies = {}
        for k in sorted({self.group.loaded_stage(w) for w in workers}):
            replies.update(self.group.load_checkpoints([w for w in workers if self.group.loaded_stage(w) == k],
                                                       self.stage_directory(k, directory), step))
        return replies

    def _directories(self) -> list[str]:
        """Each stage's checkpoint directory (the run's own, unpipelined)."""
        return [self.stage_directory(k) for k in ([None] if self.stages == 1 else range(self.stages))]

    def _steps(self) -> list[list[int]]:
        """Each stage's complete steps, of any host count (:func:`runtime.state.checkpoint_hosts.steps`)."""
        from runtime.state import checkpoint_hosts   # orbax and tensorstore load only when checkpoints are on

        return [checkpoint_hosts.steps(d) for d in self._directories()]

    def _stores(self) -> list:
        """Every checkpoint store of every stage: its own, and each host's of a slice of several."""
        from runtime.state import checkpoint_hosts

        return [store for d in self._directories() for store in checkpoint_hosts.stores(d)]

    def _unavailable(self, e: Exception) -> None:
        self.events.emit("checkpoint_unavailable", directory=self.directory, error=f"{type(e).__name__}: {e}"[:300])


def locate_checkpoint(path: str) -> tuple[str, int]:
    """``(directory, step)`` of what ``load_full_state_path`` names: a checkpoint directory (its newest complete
    checkpoint; a pipelined run's: the newest step every ``stage<k>`` directory holds) or one step's directory
    (``<directory>/<step>``, or MaxText's ``<directory>/<step>/items``, which must be complete).

    Called by the controller before it launches anything, and by the client's
    preflight (``elastic.preflight``) before the run starts. Reads the
    storage (a listing); imports no JAX. Raises ``BadInputError`` naming the
    path when it cannot be read or holds no such checkpoint.
    """
    import os

    from runtime.state.checkpoint import CheckpointStore

    if "://" not in path and not os.path.exists(os.path.expanduser(path)):
        raise BadInputError(f"load_full_state_path {path!r} does not exist")
    path = path.rstrip("/").removesuffix("/items")   # MaxText's form of one step's checkpoint: <step>/items
    head, _, tail = path.rpartition("/")
    try:
        if tail.isdigit() and head and (step := CheckpointStore(head).step_held(tail)) is not None:
            return head, step   # MaxText's <d> holds step d + 1
        steps = checkpoint_steps(path)   # a pipelined run's: its stages'
    except Exception as e:  # noqa: BLE001 - an unreadable path is bad input; the error says why
        raise BadInputError(f"load_full_state_path {path!r} cannot be read", cause=f"{type(e).__name__}: {e}") from None
    if not steps:
        raise BadInputError(f"load_full_state_path {path!r} holds no complete checkpoint")
    return path, max(steps)


def stage_steps(directory: str) -> list[list[int]]:
    """A pipelined run's checkpoint directory: the complete steps of each stage's (``stage0``, ``stage1``, ...,
    up to the first that holds none); [] for any other directory. Imports no JAX."""
    from runtime.state import checkpoint_hosts

    out = []
    while steps := checkpoint_hosts.steps(f"{directory.rstrip('/')}/stage{len(out)}"):
        out.append(steps)
    return out


def _common(per_stage: list[list[int]]) -> list[int]:
    """The steps every stage holds."""
    return sorted(set.intersection(*map(set, per_stage))) if per_stage else []


def checkpoint_steps(directory: str) -> list[int]:
    """The complete steps of the checkpoint directory ``directory``, ascending, whatever layout wrote them: a
    one-host slice's ``<step>`` (or MaxText's trainer's), a slice of H hosts' ``host<k>-of-<H>/<step>`` (a step
    every host holds), a pipelined run's ``stage<k>/...`` (a step every stage holds). The one listing of a
    checkpoint directory outside the controller's own (the resume logic, the chaos harness and the preflight
    read it); reads the storage each call, imports no JAX. Raises what the storage raises."""
    from runtime.state import checkpoint_hosts

    return checkpoint_hosts.steps(directory) or _common(stage_steps(directory))


def newest_checkpoint(directory: str, at_most: int) -> int | None:
    """The newest complete checkpoint in ``directory`` at or before step ``at_most`` (a pipelined run's: the
    newest step every stage holds); None without one, or when the store cannot be read (the controller then
    counts it as none too). Imports no JAX."""
    if not directory:
        return None
    try:
        steps = [s for s in checkpoint_steps(directory) if s <= at_most]
    except Exception:  # noqa: BLE001 - an unreadable store holds nothing to resume from
        return None
    return max(steps) if steps else None
