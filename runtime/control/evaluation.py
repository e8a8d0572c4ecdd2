"""Held-out evaluation as the controller sees it: when an eval is due, which eval microbatches each slice
computes, and the eval loss from the slices' answers, in one fixed order.

An eval rides the step it follows, as a checkpoint order does: after step ``k`` (0-based) applies, when
``k % eval_interval == 0`` (:func:`eval_due`: MaxText's schedule, after the first step and every
``eval_interval`` steps after it), every rank of step ``k`` computes the eval program's loss of
its share of the ``eval_steps x M`` eval microbatches ``(e, m)`` on the new state (:func:`eval_items`: a contiguous,
balanced run in ``(e, m)`` order per rank, as training microbatches are assigned) and answers them with the
step. The client sums them in ``(e, m)`` order alone (:func:`eval_loss`), so the eval loss is the same bits for any
slice count and after any fault, and records it only when the step commits (``eval_completed``).

A step a recovery commits from the survivors' reports lost its replies, and with them its eval losses (a dead
slice's among them). Its eval is then owed (:func:`owed_eval`): the next step dispatched, the first after the
recovery, computes it before its gradient, on the state that step starts from (which is the owed step's when
the owed step is the last committed; ``eval_before``). An owed eval whose state is gone (the recovery committed a
later step too, or the run ended there) is recorded as ``eval_skipped`` with why.

The functions are pure (no I/O, no clock); :class:`Evaluations` is the controller's side, as
:class:`runtime.control.checkpointing.Checkpointing` is for checkpoints: the evals the steps in flight carry,
and the ``eval_completed`` / ``eval_skipped`` events.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from runtime.core.errors import ProtocolError

__all__ = ["EvalOrder", "EvalSum", "Evaluations", "eval_due", "eval_items", "eval_loss", "eval_order", "gather_losses", "lost_evals",
           "owed_eval"]


@dataclasses.dataclass(frozen=True)
class EvalOrder:
    """The evals one step carries: ``after`` (``{worker: [(e, m)]}``) on the state the step applies, for step
    ``step`` itself (None: no eval after it); ``before`` on the state it starts from, for the step ``owed``
    (None: none owed)."""

    step: int | None = None
    after: Mapping[str, Sequence[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    owed: int | None = None
    before: Mapping[str, Sequence[tuple[int, int]]] = dataclasses.field(default_factory=dict)


def eval_order(step: int, workers: Sequence[str], *, interval: int, eval_steps: int, microbatches: int,
               committed: int, evaluated: frozenset, floor: int = 0) -> EvalOrder | None:
    """What step ``step``, dispatched to ``workers`` (its ranks, in rank order), evaluates: after itself when an
    eval is due, and first the eval its previous step owes (:func:`owed_eval`). None: nothing."""
    if interval <= 0:
        return None
    shares = dict(zip(workers, eval_items(eval_steps, microbatches, len(workers))))
    after = eval_due(step, interval)
    owed = owed_eval(step, committed, interval, evaluated, floor)
    if not after and owed is None:
        return None
    return EvalOrder(step if after else None, shares if after else {}, owed, shares if owed is not None else {})


def eval_due(step: int, interval: int) -> bool:
    """Whether an eval follows step ``step`` (0-based): MaxText's rule, ``step % interval == 0`` (after the
    first step, then every ``interval`` steps; ``interval`` <= 0: never), so a MaxText config evaluates after the
    same steps under jax-elastic as under MaxText's trainer."""
    return interval > 0 and step % interval == 0


def eval_items(eval_steps: int, microbatches: int, ranks: int) -> list[list[tuple[int, int]]]:
    """Each rank's eval microbatches ``(e, m)``, rank order: the ``eval_steps * microbatches`` of one eval in
    ``(e, m)`` order, cut into ``ranks`` contiguous runs whose lengths differ by at most one (the first ones
    longer). A rank may get none when there are fewer microbatches than ranks."""
    if eval_steps < 1 or microbatches < 1 or ranks < 1:
        raise ValueError(f"eval_items({eval_steps}, {microbatches}, {ranks}): each must be >= 1")
    total = eval_steps * microbatches
    base, extra = divmod(total, ranks)
    out, start = [], 0
    for r in range(ranks):
        n = base + (1 if r < extra else 0)
        out.append([divmod(i, microbatches) for i in range(start, start + n)])
        start += n
    return out


@dataclasses.dataclass(frozen=True)
class EvalSum:
    """One eval's result: ``loss`` = ``total_loss / total_weights`` (0 when the weights sum to 0)."""

    loss: float
    total_loss: float
    total_weights: float


def eval_loss(losses: Mapping[tuple[int, int], tuple[float, float]], eval_steps: int, microbatches: int) -> EvalSum:
    """The eval loss from every eval microbatch's ``(loss total, weight)``: the sum of the totals over the sum
    of the weights, each summed in ``(e, m)`` order in float64 whoever computed each. With weight 1 each it is
    the mean of the microbatches' training losses (what a step's loss is); with token counts, the loss per
    token over the whole eval (MaxText's ``eval/avg_loss``). ``ValueError`` naming the first missing ``(e, m)``."""
    total = weight = 0.0
    for e in range(eval_steps):
        for m in range(microbatches):
            if (e, m) not in losses:
                raise ValueError(f"eval microbatch (step {e}, microbatch {m}) has no loss")
            t, w = losses[(e, m)]
            total += float(t)
            weight += float(w)
    return EvalSum(total / weight if weight else 0.0, total, weight)


def gather_losses(items: Mapping[str, Sequence[tuple[int, int]]],
                  answers: Mapping[str, Sequence[tuple[float, float]]]) -> dict[tuple[int, int], tuple[float, float]]:
    """``{(e, m): (loss total, weight)}`` from each worker's items and its answer (the same length, in
    order). ``ValueError`` when a worker answered another count of losses than it was given items."""
    out = {}
    for w, mine in items.items():
        got = list(answers.get(w, ()))
        if len(got) != len(mine):
            raise ValueError(f"worker {w} answered {len(got)} eval losses for {len(mine)} eval microbatches")
        out.update(zip((tuple(i) for i in mine), got))
    return out


def owed_eval(next_step: int, committed: int, interval: int, evaluated: frozenset, floor: int = 0) -> int | None:
    """The step whose eval the step ``next_step`` about to be dispatched must compute first (None: none): its
    previous step, when an eval was due after it, it is committed (``committed``: steps committed so far) and its
    eval is not recorded (``evaluated``: steps with ``eval_completed`` or ``eval_skipped``); none before
    ``floor`` (the steps an earlier attempt committed and evaluated)."""
    prev = next_step - 1
    if prev < floor or not eval_due(prev, interval) or prev >= committed or prev in evaluated:
        return None
    return prev


def lost_evals(committed: int, interval: int, evaluated: frozenset, since: int) -> list[int]:
    """Steps from ``since`` whose eval was due and is not recorded, and whose state is gone: every such step
    before the last committed one (``committed - 1``; its eval may still be owed to the next step)."""
    return [s for s in range(max(since, 0), committed - 1) if eval_due(s, interval) and s not in evaluated]


class Evaluations:
    """The controller's side of held-out evaluation (see the module docstring).

    ``opts``: the run's ``ControllerOptions`` (``eval_interval``, ``eval_steps``, ``pipeline_stages``);
    ``programs``: its program set (``evaluates``, ``num_microbatches``); ``events``: the run's event log. Its state:
    the evals of the steps dispatched and not yet committed, and :attr:`floor`.
    """

    def __init__(self, opts, programs, events):
        self.opts, self.programs, self.events = opts, programs, events
        self._carried: dict[int, EvalOrder] = {}   # step -> the evals it carries (dispatched, not committed)
        self.floor = 0   # no eval is owed by a step before this one (an earlier attempt's, which recorded its own)

    @property
    def enabled(self) -> bool:
        """Whether the run evaluates: an interval, eval steps, and the programs' ``eval`` (never a pipeline's)."""
        o = self.opts
        return o.eval_interval > 0 and o.eval_steps > 0 and o.pipeline_stages == 1 and bool(self.programs.evaluates)

    def order_for(self, plan, state) -> EvalOrder | None:
        """What step ``plan.step`` evaluates on its ranks (:func:`eval_order`; None: nothing), remembered until
        the step's answers come (:meth:`results`). ``state``: the run's ``RunState``."""
        order = None
        if self.enabled:
            order = eval_order(plan.step, plan.workers, interval=self.opts.eval_interval,
                               eval_steps=self.opts.eval_steps, microbatches=self.programs.num_microbatches,
                               committed=state.committed, evaluated=state.evaluated, floor=self.floor)
        if order is None:
            self._carried.pop(plan.step, None)
        else:
            self._carried[plan.step] = order
        return order

    def results(self, step: int, results) -> list[dict]:
        """The ``eval_completed`` fields of the evals step ``step`` carried (none: []), from its ranks' answers
        (``{worker: StepReply}``), summed in (eval step, microbatch) order; :meth:`record` them once the step
        committed. ``ProtocolError`` when a rank answered another count."""
        order = self._carried.pop(step, None)
        if order is None:
            return []
        eval_steps, m = self.opts.eval_steps, self.programs.num_microbatches
        seconds = max((r.phases.get("eval", 0.0) for r in results.values()), default=0.0)
        out = []
        for evaluated, items, field, extra in ((order.owed, order.before, "eval_before_losses", {"before_step": step}),
                                               (order.step, order.after, "eval_losses", {})):
            if evaluated is None:
                continue
            try:
                losses = gather_losses(items, {w: getattr(results[w], field) for w in items})
            except ValueError as e:
                raise ProtocolError(f"step {step}'s eval: {e}") from None
            result = eval_loss(losses, eval_steps, m)
            out.append({"step": evaluated, "loss": result.loss, "total_loss": result.total_loss,
                        "total_weights": result.total_weights, "batches": eval_steps * m, "seconds": seconds,
                        **extra})
        return out

    def record(self, evals: list[dict]) -> None:
        """``eval_completed`` for each of :meth:`results`, its step committed (a step done again evaluates
        again, and is recorded once)."""
        for fields in evals:
            self.events.emit("eval_completed", **fields)

    def lost(self, state, since: int) -> None:
        """A recovery committed steps from the survivors' reports: ``eval_skipped`` for each eval due from step
        ``since`` whose state is gone (:func:`lost_evals`; the last committed one's is owed to the next step)."""
        if not self.enabled:
            return
        for step in lost_evals(state.committed, self.opts.eval_interval, state.evaluated, max(since, self.floor)):
            self.events.emit("eval_skipped", step=step, reason="a recovery committed it from the survivors' "
                                                               "reports, whose evals it lost, and a later step with it")

    def at_end(self, state) -> None:
        """Every step committed: ``eval_skipped`` for the last step's eval when it is owed (a recovery committed
        the last step from the survivors' reports): no step follows to compute it."""
        last = state.committed - 1
        if self.enabled and eval_due(last, self.opts.eval_interval) and last not in state.evaluated \
                and last >= self.floor:
            self.events.emit("eval_skipped", step=last, reason="a recovery committed the run's last step from the "
                                                               "survivors' reports, whose evals it lost")

    def forget(self) -> None:
        """The steps in flight were abandoned (a recovery, a new client generation): their evals with them."""
        self._carried.clear()
