"""Shadow spares: spares that hold the committed state without computing a gradient.

With ``elastic_shadow_spares``, every spare starts with the state (it
initializes from the seed like the active slices, or loads the checkpoint a
run resumes from) and then gets every step as a *shadow*: the ranks push it
their reduced chunks in the all-gather (a rank answers once its pushes landed, waiting at most
``runtime.worker.collective.SHADOW_HANDOFF_SECONDS``), it applies the
full vector with the same apply program, so it holds the same bits. When
every active slice is lost at once, a shadow is promoted with no state
transfer and no step lost (``restore_tier`` "shadow").

A shadow never fails a step: the controller commits on the active slices
alone and looks at the shadows' replies as they come (:meth:`Shadows.poll`).
One that missed a step (a rank died mid-step, a push failed) falls behind:
it stops getting steps and is caught up by a state copy at the next step
boundary (:meth:`Shadows.behind`, :meth:`Shadows.synced`).

:class:`Shadows` keeps the bookkeeping; the controller does the calls.
"""

from __future__ import annotations

import collections
import time

__all__ = ["Shadows"]


class Shadows:
    """Which spares shadow the state and how far each is known to be (see the module docstring).

    ``group``: the worker group (``poll``); ``events``: the run's log;
    ``enabled``: ``elastic_shadow_spares``.
    """

    def __init__(self, group, events, enabled: bool):
        self.group, self.events, self.enabled = group, events, enabled
        self.at: dict[str, int] = {}     # shadowing spare -> applied steps it confirmed
        self._pending: collections.deque = collections.deque()   # (step, {worker: future}), oldest first

    def __contains__(self, worker: str) -> bool:
        return worker in self.at

    def synced(self, worker: str, applied: int) -> None:
        """``worker`` (a spare) holds the state after ``applied`` steps: it shadows from now on."""
        if self.enabled:
            self.at[worker] = applied

    def feeding(self, spares, dead) -> list[str]:
        """The spares to send the next step to, in placement order."""
        return [w for w in spares if w in self.at and w not in dead]

    def dispatched(self, step: int, futs: dict) -> None:
        if futs:
            self._pending.append((step, dict(futs)))

    def poll(self, timeout: float = 0.0, before: int | None = None) -> None:
        """Takes in the shadow steps that ended, oldest first, waiting up to ``timeout`` seconds for those of
        steps before ``before`` (all, when None); later ones are taken only if already done.

        A shadow whose step failed stops shadowing (``shadow_behind``) until
        :meth:`synced` again.
        """
        deadline = time.monotonic() + timeout
        while self._pending:
            step, futs = self._pending[0]
            wait = timeout and (before is None or step < before)
            ended = self.group.poll(futs, deadline if wait else None)
            for w, result in ended.items():
                del futs[w]
                if w not in self.at:
                    continue
                if isinstance(result, Exception):
                    del self.at[w]
                    self.events.emit("shadow_behind", worker=w, step=step,
                                     error=f"{type(result).__name__}: {result}"[:300])
                else:
                    self.at[w] = max(self.at[w], step + 1)
            if futs:
                return   # the oldest step is still running on some shadow
            self._pending.popleft()

    def holding(self, committed: int, dead, wait_seconds: float) -> set[str]:
        """The live shadows at the committed frontier (or one step past it: the realignment rolls them back),
        after waiting up to ``wait_seconds`` for the committed steps they were sent (a step past the frontier
        may never end: a rank died in it)."""
        self.poll(wait_seconds, before=committed)
        return {w for w, at in self.at.items() if w not in dead and committed <= at <= committed + 1}

    def forget(self, workers) -> None:
        """``workers`` no longer shadow (promoted to active, dead, or of unknown state after a recovery)."""
        for w in workers:
            self.at.pop(w, None)

    def abandon(self) -> None:
        """A recovery started: the steps in flight are abandoned (the group cancels their calls)."""
        self._pending.clear()

    def behind(self, spares, dead) -> list[str]:
        """Live spares that should shadow and do not (new, or fell behind): each needs a state copy."""
        if not self.enabled:
            return []
        return [w for w in spares if w not in self.at and w not in dead]
