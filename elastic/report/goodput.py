"""Goodput: where a run's wall time went, in the ml-goodput taxonomy.

:func:`goodput` and :func:`intervals` are pure functions of the event log
(``events.jsonl``); :func:`elastic.report.build_report` calls the first, the
HTML report draws the second. Neither reads files or clocks.

The wall time, from the first event to ``run_finished`` (or the last event
when the run did not finish), is partitioned into labelled intervals by
walking the events in time order:

- first event -> ``programs_built``: ``compile`` (the client traces and
  exports the programs); ``programs_built`` -> ``placement``: ``startup``
  (launching and registering workers); ``placement`` -> ``programs_loaded``:
  ``compile`` (workers deserialize and compile); ``programs_loaded`` ->
  ``state_initialized``: ``startup``.
- from ``state_initialized`` (or the previous commit) to a ``step_committed``:
  ``productive``, unless a ``failure_detected`` falls in between. Then
  [previous commit, ``fault_injected``] is ``wasted_progress`` (work on steps
  that were abandoned), [``fault_injected`` or previous commit,
  ``failure_detected``] is ``detection``, [``failure_detected``,
  ``recovered``] is ``recovery`` and [``recovered``, next commit] is
  ``wasted_progress`` (re-running the interrupted step). When recovery
  committed steps the survivors had already applied (``step_committed`` with
  ``recovered: true``), the work before the fault was not lost, so
  [previous commit, ``fault_injected``] stays ``productive``.
- a ``grown`` membership change: [previous commit, ``grown``] is ``recovery``.
- waiting for capacity is ``recovery``, whatever the walk labelled it: the
  ``seconds`` before a ``capacity_wait``/``capacity_wait_ended`` that carries
  ``seconds``, else from ``capacity_wait`` to ``capacity_wait_ended`` (or to
  the end of the run).
- a re-commit of a step already committed (a rewind): [previous commit, it]
  is ``wasted_progress``.
- after the last commit: ``other``.
- a run directory's log holds every attempt of the run (each starts with
  ``job_started``; see ``attempts`` in ``docs/report.md``). After an attempt
  that ended without ``run_finished`` (its client died, or it failed), the
  steps in flight after its last commit are ``wasted_progress`` and the time
  until the next attempt's ``job_started`` is ``recovery`` (the run was
  down); the new attempt walks start-up again, and the steps it recomputes
  (at or below a step already committed) are ``wasted_progress``. The time
  between a *finished* attempt's ``run_finished`` and the next attempt (a
  run extended later, perhaps days later) is idle, not the run's: it belongs
  to no interval and not to the wall time (:func:`idle_gaps` lists it).
- after a resume from a checkpoint (``run_resumed``, in place of
  ``state_initialized``): [``programs_loaded``, ``run_resumed``] is
  ``checkpoint_restore``.

In reference mode there is no placement: ``run_started`` -> first commit
(in-process compile and state init) stays ``startup``. ``data``,
``checkpoint_save`` and ``checkpoint_restore`` are always 0.0: data loading
runs inside the workers' grad phase and is not separable; ``checkpoint_save``
is 0.0 too (checkpoints are written in the background, off the step's path).
"""

from __future__ import annotations

from collections.abc import Iterable

from runtime import attempts

__all__ = ["BADPUT_LABELS", "LABELS", "goodput", "idle_gaps", "intervals"]

#: Every badput label, in display order; ``goodput()["badput_seconds"]`` has exactly these keys.
BADPUT_LABELS: tuple[str, ...] = ("startup", "compile", "data", "checkpoint_save", "checkpoint_restore",
                                  "detection", "recovery", "wasted_progress", "other")
#: Every interval label: ``productive`` then the badput labels.
LABELS: tuple[str, ...] = ("productive",) + BADPUT_LABELS

Interval = tuple[float, float, str]

# Events that move the start-up walk to a new label (label of the time *after* the event).
_PHASE_AFTER = {"programs_built": "startup", "placement": "compile", "programs_loaded": "startup"}


class _Walk:
    """The fold behind :func:`intervals`; times are absolute until the end."""

    def __init__(self, t0: float):
        self.out: list[Interval] = []
        self.overlays: list[Interval] = []
        self.anchor = t0            # start of the open segment
        self.phase = "compile"      # compile | startup | steps | recovery | rerun
        self.fault_at: float | None = None
        self.pre_fault: int | None = None  # index in ``out`` of the current failure's pre-fault piece
        self.seen_placement = False
        self.wait_start: float | None = None  # an open capacity wait
        self.committed = 0
        self.last_t = t0            # the latest event seen (where a dead attempt's client stopped)
        self.idle: list[Interval] = []   # after a finished attempt, until the next one: nobody's time
        self.done = False           # the current attempt finished: wait for the next job_started

    def attempt_finished(self, t: float) -> None:
        """``run_finished`` of an attempt a later one follows: closes it as the end of a run would."""
        self._close_attempt(t, {"steps": "other", "rerun": "wasted_progress"})
        self.done = True

    def next_attempt(self, t: float) -> None:
        """A later attempt's ``job_started`` at ``t``: the gap before it, then start-up again."""
        if self.done:
            self.idle.append((self.anchor, t))
            self.anchor = t
        else:   # its client died (or the attempt failed): what was in flight is lost, the run was down since
            self._close_attempt(self.last_t, {"steps": "wasted_progress", "rerun": "wasted_progress"})
            self.close(t, "recovery")
        self.phase, self.fault_at, self.pre_fault, self.seen_placement, self.done = "compile", None, None, False, False

    def _close_attempt(self, t: float, tail: dict) -> None:
        if self.wait_start is not None:
            self.overlays.append((self.wait_start, t, "recovery"))
            self.wait_start = None
        self.close(t, tail.get(self.phase, self.phase))

    def close(self, t: float, label: str) -> None:
        if t > self.anchor:
            self.out.append((self.anchor, t, label))
        self.anchor = max(self.anchor, t)

    def event(self, e: dict) -> None:
        t, kind = float(e["t"]), e["kind"]
        if self.done:
            return   # between a finished attempt and the next: nothing of the run's
        self.last_t = max(self.last_t, t)
        if kind in ("capacity_wait", "capacity_wait_ended"):
            if e.get("seconds") is not None:  # a wait reported when it ended
                self.overlays.append((t - float(e["seconds"]), t, "recovery"))
                self.wait_start = None
            elif kind == "capacity_wait":
                self.wait_start = t
            elif self.wait_start is not None:
                self.overlays.append((self.wait_start, t, "recovery"))
                self.wait_start = None
        elif kind == "fault_injected":
            if self.phase in ("steps", "rerun") and self.fault_at is None:
                self.fault_at = t
        elif kind == "failure_detected":
            self._failure(t)
        elif self.phase == "recovery":
            if kind == "step_committed" and e.get("recovered"):
                if self.pre_fault is not None:  # applied before the fault: that work was not lost
                    s, end, _ = self.out[self.pre_fault]
                    self.out[self.pre_fault] = (s, end, "productive")
                self.committed = max(self.committed, int(e.get("step", self.committed)) + 1)
            elif kind == "recovered":
                self.close(t, "recovery")
                self.phase, self.pre_fault = "rerun", None
        elif kind == "step_committed":
            self._commit(t, e)
        elif kind == "grown" and self.phase in ("steps", "rerun"):
            self.close(t, "recovery")
            self.fault_at = None
        elif self.phase in ("compile", "startup"):
            if kind == "placement" and self.seen_placement:
                return
            if kind in _PHASE_AFTER:
                self.close(t, self.phase)
                self.phase = _PHASE_AFTER[kind]
                self.seen_placement |= kind == "placement"
            elif kind == "state_initialized":
                self.close(t, self.phase)
                self.phase = "steps"
            elif kind == "run_resumed":   # the state was read from a checkpoint since the programs loaded
                self.close(t, "checkpoint_restore" if self.seen_placement and self.phase == "startup"
                           else self.phase)
                self.phase = "steps"

    def _failure(self, t: float) -> None:
        if self.phase == "recovery":
            return  # recovery failed again and retries: still recovering
        self.pre_fault = None
        if self.phase in ("compile", "startup"):
            self.close(t, "detection")
        else:
            start = self.fault_at if self.fault_at is not None else self.anchor
            n = len(self.out)
            self.close(start, "wasted_progress")
            if len(self.out) > n and self.phase == "steps":
                self.pre_fault = n
            self.close(t, "detection")
        self.phase, self.fault_at = "recovery", None

    def _commit(self, t: float, e: dict) -> None:
        step = int(e.get("step", self.committed))
        if self.phase in ("compile", "startup"):
            label = self.phase  # reference mode: in-process compile and state init precede the first commit
        elif step < self.committed or self.phase == "rerun":
            label = "wasted_progress"
        else:
            label = "productive"
        self.close(t, label)
        self.committed = max(self.committed, step + 1)
        self.phase, self.fault_at = "steps", None

    def finish(self, t_end: float) -> list[Interval]:
        if self.wait_start is not None:  # the run ended while waiting for capacity
            self.overlays.append((self.wait_start, t_end, "recovery"))
        label = {"steps": "other", "rerun": "wasted_progress"}.get(self.phase, self.phase)
        self.close(t_end, label)
        return self.out


def _paint(base: list[Interval], overlays: Iterable[Interval]) -> list[Interval]:
    """Relabels the parts of ``base`` covered by each overlay; the partition stays a partition."""
    out = base
    for os_, oe, olab in overlays:
        painted: list[Interval] = []
        for s, e, lab in out:
            if oe <= s or os_ >= e:
                painted.append((s, e, lab))
                continue
            if s < os_:
                painted.append((s, os_, lab))
            painted.append((max(s, os_), min(e, oe), olab))
            if oe < e:
                painted.append((oe, e, lab))
        out = painted
    return out


def _merge(ivs: list[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for s, e, lab in ivs:
        if e <= s:
            continue
        if merged and merged[-1][2] == lab and abs(merged[-1][1] - s) < 1e-9:
            merged[-1] = (merged[-1][0], e, lab)
        else:
            merged.append((s, e, lab))
    return merged


def _last_attempt(events: list[dict]) -> int:
    """Index of the last attempt's first event (:func:`runtime.attempts`)."""
    return len(events) - len(attempts(events)[-1]) if events else 0


def _end_time(events: list[dict]) -> float:
    """The last attempt's ``run_finished``, else (it did not finish) the last event."""
    for e in events[_last_attempt(events):]:
        if e["kind"] == "run_finished":
            return float(e["t"])
    return float(events[-1]["t"])


def _walk(events: list[dict]) -> tuple[float, _Walk, list[Interval]]:
    """``(t0, the walk, its merged intervals in absolute seconds)`` over ``events`` sorted by time."""
    t0, t_end = float(events[0]["t"]), _end_time(events)
    walk = _Walk(t0)
    for i, e in enumerate(events):
        if float(e["t"]) > t_end:
            break
        if e["kind"] == "job_started" and i > 0:
            walk.next_attempt(float(e["t"]))
        elif e["kind"] == "run_finished":
            if float(e["t"]) >= t_end:
                break
            walk.attempt_finished(float(e["t"]))
            continue
        walk.event(e)
    raw = walk.finish(t_end)
    raw = _paint(raw, [(max(s, t0), min(e, t_end), lab) for s, e, lab in walk.overlays if e > s])
    return t0, walk, _merge(raw)


def intervals(events: list[dict]) -> list[Interval]:
    """Labelled intervals ``(start, end, label)`` partitioning the run's wall time.

    Times are seconds since the first event; intervals are sorted, non-empty,
    and adjacent ones never share a label; they are contiguous except across
    :func:`idle_gaps` (after a finished attempt, until the next). ``label`` is
    one of :data:`LABELS`. An empty log gives ``[]``. Events after the last
    attempt's ``run_finished`` are ignored.
    """
    if not events:
        return []
    t0, _, ivs = _walk(sorted(events, key=lambda e: e["t"]))  # stable: equal times keep log order
    return [(s - t0, e - t0, lab) for s, e, lab in ivs]


def idle_gaps(events: list[dict]) -> list[tuple[float, float]]:
    """``(start, end)`` seconds since the first event of each gap between a finished attempt's ``run_finished``
    and the next attempt's ``job_started``: time outside the run (no interval covers it)."""
    if not events:
        return []
    t0, walk, _ = _walk(sorted(events, key=lambda e: e["t"]))
    return [(s - t0, e - t0) for s, e in walk.idle if e > s]


def goodput(events: list[dict]) -> dict:
    """The run's goodput: seconds per label of :func:`intervals`.

    Returns ``{"wall_seconds", "productive_seconds", "goodput_fraction",
    "badput_seconds": {label: seconds for every label in BADPUT_LABELS}}``;
    ``productive_seconds`` plus every badput value sums to ``wall_seconds``
    (within float error). ``goodput_fraction`` is productive / wall, 0.0 for
    an empty log or a zero wall time.
    """
    ivs = intervals(events)
    totals = {lab: 0.0 for lab in LABELS}
    for s, e, lab in ivs:
        totals[lab] += e - s
    wall = 0.0
    if events:
        ordered = sorted(events, key=lambda e: e["t"])
        wall = _end_time(ordered) - float(ordered[0]["t"]) - sum(e - s for s, e in idle_gaps(ordered))
    return {
        "wall_seconds": wall,
        "productive_seconds": totals["productive"],
        "goodput_fraction": totals["productive"] / wall if wall > 0 else 0.0,
        "badput_seconds": {lab: totals[lab] for lab in BADPUT_LABELS},
    }
