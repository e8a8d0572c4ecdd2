"""What the runs of `recovery_vs_restart.py` log, and what it measures from the logs (pure: no runs, no clocks).

The kill schedule shared by the three runs; the step log that process 0 of
the checkpoint-restart job (c) writes on stdout (lines marked ``MARK``, one
JSON record each); and, per kill, kill -> next committed step, steps lost and
the recovery path, from an elastic run's event log ((a), (b)) or from (c)'s
incarnations, plus (c)'s incarnations as an event log in the runtime's
vocabulary for ``elastic.report.goodput``.
"""

from __future__ import annotations

import json
import math

#: Prefix of the child's step-log lines on stdout (anything else there, e.g. a library's print, is ignored).
MARK = "@restart "


def kill_schedule(kills: int, gap: int, period: int) -> tuple[list[int], int]:
    """``(kill steps, total steps)``: kill ``i`` once ``i * gap + gap // 2`` steps are committed, moved to mid-period.

    A kill step ``N`` fires once ``N`` steps are committed (as `@step=N` in the
    chaos grammar). Each is placed half a checkpoint period after a
    checkpoint. The run has ``kills * gap`` steps.
    """
    if kills < 1 or gap < 2 or period < 1:
        raise ValueError("need kills >= 1, kill gap >= 2, checkpoint period >= 1")
    steps = kills * gap
    out = []
    for i in range(kills):
        base = i * gap + gap // 2
        out.append(max(1, base - base % period + period // 2))
    if any(b <= a for a, b in zip(out, out[1:])) or out[-1] >= steps:
        raise ValueError(f"kills at steps {out} of {steps}: make the kill gap ({gap}) larger than the checkpoint "
                         f"period ({period})")
    return out, steps


def parse_step_log(lines) -> list[dict]:
    """The records of a restart child's stdout: the JSON after ``MARK`` on each marked line, in order.

    Other lines and marked lines that are not one JSON object (a torn last
    line of a killed process) are skipped.
    """
    out = []
    for line in lines:
        if not line.startswith(MARK):
            continue
        try:
            rec = json.loads(line[len(MARK):])
        except ValueError:
            continue
        if isinstance(rec, dict) and "t" in rec and "kind" in rec:
            out.append(rec)
    return out


def elastic_kills(events: list[dict]) -> list[dict]:
    """Per injected fault of an elastic run's event log: kill -> next committed step, steps lost, recovery path.

    The frontier is the highest step committed before the ``recovered`` event
    that follows the fault; the next committed step is the first one past it
    after that event. Steps lost are re-commits (a step committed again)
    between this fault and the next.
    """
    events = sorted(events, key=lambda e: e["t"])
    faults = [e for e in events if e["kind"] == "fault_injected"]
    commits = [e for e in events if e["kind"] == "step_committed"]
    out = []
    for i, f in enumerate(faults):
        t_fault = f["t"]
        t_until = faults[i + 1]["t"] if i + 1 < len(faults) else math.inf
        rec = next((e for e in events if e["kind"] == "recovered" and e["t"] > t_fault), None)
        t_rec = rec["t"] if rec else t_fault
        frontier = max((c["step"] for c in commits if c["t"] <= t_rec), default=-1)
        nxt = next((c for c in commits if c["t"] > t_rec and c["step"] > frontier), None)
        seen, lost = -1, 0
        for c in commits:
            if t_fault < c["t"] < t_until and c["step"] <= seen:
                lost += 1
            seen = max(seen, c["step"])
        out.append({"kill_to_next_commit": (nxt["t"] - t_fault) if nxt else None, "steps_lost": lost,
                    "frontier": frontier, "path": rec.get("path") if rec else None})
    return out


def restart_kills(incarnations: list[dict]) -> list[dict]:
    """Per kill of a checkpoint-restart run: kill -> next committed step, steps lost and where the time went.

    ``incarnations``: one dict per launch, in order: ``launched`` (time),
    ``records`` (process 0's parsed step log), and for a killed one ``kill``
    (SIGKILL time), ``detected`` (death seen) and ``stopped`` (every process
    gone). The frontier is the highest step the killed incarnation committed;
    steps lost are those the next incarnation committed again.
    """
    out = []
    for k, inc in enumerate(incarnations):
        if inc.get("kill") is None:
            continue
        steps = [r["step"] for r in inc["records"] if r["kind"] == "step"]
        frontier = max(steps, default=-1)
        later = incarnations[k + 1:]
        if not later:
            raise ValueError(f"incarnation {k} was killed but never relaunched")
        nxt = _mark(later[0], "restored")
        restored = nxt["step"] if nxt else 0
        first_past = next((r for i in later for r in i["records"] if r["kind"] == "step" and r["step"] > frontier),
                          None)
        t_kill = inc["kill"]
        rec = {"kill_to_next_commit": (first_past["t"] - t_kill) if first_past else None,
               "steps_lost": frontier + 1 - restored, "frontier": frontier, "restored_step": restored,
               "path": "restart"}
        marks = {m: _mark(later[0], m) for m in ("imported", "initialized", "compiled", "restored")}
        if all(marks.values()) and first_past:
            rec["phases"] = {"detect and stop": inc["stopped"] - t_kill,
                             "start and import jax": marks["imported"]["t"] - later[0]["launched"],
                             "distributed init": marks["initialized"]["t"] - marks["imported"]["t"],
                             "compile (warm cache)": marks["compiled"]["t"] - marks["initialized"]["t"],
                             "restore": marks["restored"]["t"] - marks["compiled"]["t"],
                             "recompute lost steps": first_past["t"] - marks["restored"]["t"]}
        out.append(rec)
    return out


def restart_events(incarnations: list[dict]) -> list[dict]:
    """An event log in the runtime's vocabulary for a checkpoint-restart run, for ``elastic.report.goodput``.

    First launch -> distributed init: startup; -> compiled: compile; ->
    state ready: startup; steps: productive. A kill: ``fault_injected`` at the
    SIGKILL, ``failure_detected`` when the death was seen, ``recovered`` when
    the next incarnation has restored its state; recomputed steps are
    re-commits (wasted progress). ``run_finished`` when process 0 is done.
    """
    ev: list[dict] = []
    for k, inc in enumerate(incarnations):
        if k == 0:
            ev += [{"t": inc["launched"], "kind": "job_started"}, {"t": inc["launched"], "kind": "programs_built"}]
            for mark, kind in (("initialized", "placement"), ("compiled", "programs_loaded"),
                               ("restored", "state_initialized")):
                m = _mark(inc, mark)
                if m:
                    ev.append({"t": m["t"], "kind": kind})
        else:
            m = _mark(inc, "restored")
            if m:
                ev.append({"t": m["t"], "kind": "recovered", "path": "restart"})
        ev += [{"t": r["t"], "kind": "step_committed", "step": r["step"]} for r in inc["records"]
               if r["kind"] == "step"]
        if inc.get("kill") is not None:
            ev += [{"t": inc["kill"], "kind": "fault_injected"}, {"t": inc["detected"], "kind": "failure_detected"}]
        done = _mark(inc, "done")
        if done:
            ev.append({"t": done["t"], "kind": "run_finished"})
    return sorted(ev, key=lambda e: e["t"])


def _mark(inc: dict, kind: str) -> dict | None:
    return next((r for r in inc["records"] if r["kind"] == kind), None)
