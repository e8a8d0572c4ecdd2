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
boundary (:meth:`Shadows.behind`; ``shadow_synced``).

:class:`Shadows` keeps the shadow steps in flight; which spares shadow is the
run state's (``RunState.shadows``), folded from the events that say so.
"""

from __future__ import annotations

import collections
import time

__all__ = ["Shadows"]


class Shadows:
    """The shadow spares' steps in flight (see the module docstring). Which spares shadow is the run state's
    (``RunState.shadows``: ``shadow_synced``, ``shadows_started`` add one, ``shadow_behind`` drops one); this
    keeps only the calls not yet answered.

    ``group``: the worker group (``poll``); ``events``: the run's log; ``ledger``: the run's
    :class:`~runtime.control.run_state.RunLedger`; ``enabled``: ``elastic_shadow_spares``.
    """

    def __init__(self, group, events, ledger, enabled: bool):
        self.group, self.events, self.ledger, self.enabled = group, events, ledger, enabled
        self._pending: collections.deque = collections.deque()   # (step, {worker: future}), oldest first

    def feeding(self, state) -> list[str]:
        """The spares to send the next step to, in placement order: the live ones that shadow."""
        return [w for w in state.placement.spares if w in state.shadows and w not in state.dead]

    def behind(self, state) -> list[str]:
        """Live spares that should shadow and do not (new, or fell behind): each needs a state copy."""
        if not self.enabled:
            return []
        return [w for w in state.placement.spares if w not in state.shadows and w not in state.dead]

    def dispatched(self, step: int, futs: dict) -> None:
        if futs:
            self._pending.append((step, dict(futs)))

    def poll(self, timeout: float = 0.0, before: int | None = None) -> None:
        """Takes in the shadow steps that ended, oldest first, waiting up to ``timeout`` seconds for those of
        steps before ``before`` (all, when None); later ones are taken only if already done.

        A shadow whose step failed stops shadowing (``shadow_behind``) until it is synced again.
        """
        deadline = time.monotonic() + timeout
        while self._pending:
            step, futs = self._pending[0]
            wait = timeout and (before is None or step < before)
            ended = self.group.poll(futs, deadline if wait else None)
            for w, result in ended.items():
                del futs[w]
                if isinstance(result, Exception):
                    self._behind(w, step, f"{type(result).__name__}: {result}")
            if futs:
                return   # the oldest step is still running on some shadow
            self._pending.popleft()

    def _behind(self, worker: str, step: int, why: str) -> None:
        if worker in self.ledger.state.shadows:
            self.events.emit("shadow_behind", worker=worker, step=step, error=why[:300])

    def holding(self, committed: int, wait_seconds: float) -> set[str]:
        """The live shadows at the committed frontier (or one step past it: the realignment rolls them back),
        after waiting up to ``wait_seconds`` for the committed steps they were sent (a step past the frontier
        may never end: a rank died in it). One that did not confirm a committed step in that time falls
        behind (``shadow_behind``): it cannot be known to hold the state."""
        self.poll(wait_seconds, before=committed)
        for step, futs in self._pending:
            if step < committed:
                for w in futs:
                    self._behind(w, step, f"did not confirm step {step} within {wait_seconds:g} s")
        s = self.ledger.state
        return {w for w in s.shadows if w not in s.dead}

    def abandon(self) -> None:
        """A recovery started: the steps in flight are abandoned (the group cancels their calls)."""
        self._pending.clear()
