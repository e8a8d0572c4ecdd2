"""The chaos verdict: did a faulted run train exactly as a fault-free one would?

Pure functions of a run's ``report.json`` dict, its ``events.jsonl`` events and
(optionally) a fault-free reference run's report. The chaos runner calls
:func:`judge` after the run ends and merges the returned dict into the report.

A run passes when it finished every requested step, every recovery kept the
promise of what its faults left (:mod:`chaos.promise`: with a replica or a
shadow left, no step recomputed and no restore; with only snapshots or
checkpoints, a restore of the newest, recomputing at most the interval or
period plus the steps in flight), no committed step was recomputed outside a
recovery, every microbatch of every committed step was applied exactly once,
it was hit by every fault it was given (none ``skipped``, every ``kill_save``
struck), and (given a reference) it followed the reference's loss trajectory
bit for bit or within ``rtol``.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from chaos.promise import promises as recovery_promises
from runtime import RunState

__all__ = ["compare_trajectory", "exactly_once", "judge"]

_DETAIL_LIMIT = 20


def exactly_once(events: list[dict], microbatches: int, steps: int) -> tuple[bool | None, dict]:
    """Check each committed step applied microbatches ``0..microbatches-1`` once each.

    Reads ``step_committed`` events; when a step was committed more than once the
    last event counts. Returns ``(None, {})`` when no such event carries a
    ``"microbatches"`` mapping (reference runs). Otherwise returns ``(ok, detail)``
    where ``detail`` holds (each list truncated to 20 entries):

    * ``missing``, ``duplicated``, ``unexpected``: ``[step, microbatch]`` pairs
      never applied, applied more than once, or outside ``0..microbatches-1``;
    * ``uncommitted_steps``: steps in ``0..steps-1`` with no commit. They are
      listed but do not make ``ok`` False: a run that stopped early fails on
      completion, not on exactly-once;
    * ``unverified_steps``: steps whose last commit carries no ``microbatches``
      (committed from recorded losses during a recovery). They are not counted
      as violations.
    """
    last: dict[int, dict] = {}
    for e in events:
        if e.get("kind") == "step_committed":
            last[e["step"]] = e
    if not any("microbatches" in e for e in last.values()):
        return None, {}
    missing, duplicated, unexpected, uncommitted, unverified = [], [], [], [], []
    for step in range(steps):
        event = last.get(step)
        if event is None:
            uncommitted.append(step)
            continue
        if "microbatches" not in event:
            unverified.append(step)
            continue
        seen: dict[int, int] = {}
        for ids in event["microbatches"].values():
            for mb in ids:
                seen[mb] = seen.get(mb, 0) + 1
        missing += [[step, mb] for mb in range(microbatches) if mb not in seen]
        duplicated += [[step, mb] for mb, n in sorted(seen.items()) if n > 1]
        unexpected += [[step, mb] for mb in sorted(seen) if not 0 <= mb < microbatches]
    ok = not (missing or duplicated or unexpected)
    detail = {"missing": missing, "duplicated": duplicated, "unexpected": unexpected,
              "uncommitted_steps": uncommitted, "unverified_steps": unverified}
    return ok, {k: v[:_DETAIL_LIMIT] for k, v in detail.items()}


def compare_trajectory(losses: list[float], reference_losses: list[float], *, final_digest: str | None,
                       reference_digest: str | None, rtol: float = 1e-5) -> tuple[str, int | None]:
    """Compare per-step losses (and final state digests) with a reference run.

    Returns ``("identical", None)`` when the lists have the same length, every
    loss is bit-equal and both final digests are known and equal (digests of
    two algorithms never are: each names its own);
    ``("within_tolerance", None)`` when the lists have the same length and every
    ``|loss - ref| <= rtol * |ref|``; else ``("diverged", k)`` with ``k`` the first
    step beyond tolerance, or the length of the shorter list when one ends first.
    A step with no recorded loss (None: it came from a checkpoint that recorded
    none) is not compared; it is bit-equal only to another None, so a run
    missing losses the reference has is at best within tolerance.
    """
    for step, (a, b) in enumerate(zip(losses, reference_losses)):
        if not _close(a, b, rtol):
            return "diverged", step
    if len(losses) != len(reference_losses):
        return "diverged", min(len(losses), len(reference_losses))
    bit_equal = all(_bits(a) == _bits(b) for a, b in zip(losses, reference_losses))
    if bit_equal and final_digest is not None and final_digest == reference_digest:
        return "identical", None
    return "within_tolerance", None


def judge(report: dict, reference: dict | None, events: list[dict], *, rtol: float = 1e-5,
          live_state: RunState | None = None) -> dict:
    """The verdict fields for ``report.json``: ``verdict``, ``verdict_reasons``,
    ``trajectory``, ``first_diverging_step``, ``exactly_once``, ``exactly_once_detail``,
    ``promises`` (one per recovery: :meth:`chaos.promise.Promise.as_dict`) and ``run_state_replayed``.

    ``live_state``: the :class:`~runtime.control.run_state.RunState` the run's controller ended with; the run passes
    only if replaying ``events`` alone gives the same state (``run_state_replayed``: None when not given), so
    every chaos run proves its log is enough to rebuild the controller.

    ``verdict_reasons`` is empty on a pass; otherwise one sentence per broken
    requirement, with the numbers. ``reference`` is the report of a fault-free run
    of the same config, or None (then ``trajectory`` is None and not judged).
    """
    reasons: list[str] = []
    requested = report.get("steps_requested")
    if requested is None:
        requested = (report.get("config") or {}).get("steps")
    completed = report.get("steps_completed") or 0
    finished = bool(report.get("finished"))
    stopped_early = not finished or completed != requested
    if stopped_early:
        of = f"of {requested}" if requested is not None else "of an unknown number"
        if report.get("failure_reason"):
            why = f"the run failed ({report['failure_reason']})"
        elif not finished:
            why = "the run did not finish (no run_finished event)"
        else:
            why = f"the run finished with {completed} committed steps instead of {requested}"
        reasons.append(f"stopped at step {completed} {of}: {why}.")

    recoveries = recovery_promises(events, report.get("config"))
    reasons += [p.reason for p in recoveries if p.reason]
    # The events are the record; a report that counts more than they explain (hand-built, say) is judged too.
    outside = (report.get("steps_lost") or 0) - sum(p.recomputed for p in recoveries)
    if outside > 0:
        reasons.append(f"{outside} committed step{_s(outside)} {'was' if outside == 1 else 'were'} recomputed "
                       "outside any recovery (steps_lost); a run never rewinds past a committed step unprompted.")
    for key, tier in (("snapshot_restores", "snapshot"), ("checkpoint_restores", "checkpoint")):
        extra = (report.get(key) or 0) - sum(1 for p in recoveries if (p.restored or {}).get("tier") == tier)
        if extra > 0:
            reasons.append(f"the run restored a {tier} {extra} time{_s(extra)} outside any recovery ({key}).")

    once, once_detail = (None, {})
    if report.get("microbatches") and requested is not None:
        once, once_detail = exactly_once(events, report["microbatches"], requested)
    if once is False:
        reasons.append(_exactly_once_reason(once_detail, report["microbatches"]))

    for fault in report.get("faults") or []:
        if fault.get("skipped"):
            reasons.append(f"fault {fault.get('spec')!r} was not injected ({fault['skipped']}), "
                           "so the run was not tested against it.")
    reasons += _unstruck(events)

    trajectory, first = None, None
    if reference is not None:
        losses, ref_losses = list(report.get("losses") or []), list(reference.get("losses") or [])
        trajectory, first = compare_trajectory(losses, ref_losses, final_digest=report.get("final_state_digest"),
                                               reference_digest=reference.get("final_state_digest"), rtol=rtol)
        if not reference.get("finished"):
            reasons.append(f"the reference run did not finish ({len(ref_losses)} losses), "
                           "so the trajectory cannot be trusted.")
        if trajectory == "diverged":
            reason = _trajectory_reason(first, losses, ref_losses, rtol)
            # A run that stopped early already failed for that; only a real mismatch adds a reason.
            if not (stopped_early and first == len(losses) < len(ref_losses)):
                reasons.append(reason)

    replayed = None
    if live_state is not None:
        differences = RunState.replay(events).differences(live_state)
        replayed = not differences
        if differences:
            reasons.append("the run state replayed from events.jsonl differs from the live controller's in "
                           + "; ".join(f"{k} ({str(a)[:80]} != {str(b)[:80]})" for k, (a, b) in differences.items()))

    return {
        "verdict": "fail" if reasons else "pass",
        "verdict_reasons": reasons,
        "trajectory": trajectory,
        "first_diverging_step": first,
        "exactly_once": once,
        "exactly_once_detail": once_detail,
        "promises": [p.as_dict() for p in recoveries],
        "run_state_replayed": replayed,
    }


def _unstruck(events: list[dict]) -> list[str]:
    """A ``kill_save`` arms its writer to die mid-save: one whose writer never died afterwards was never tested."""
    armed: dict = {}   # fault index -> (its text, the workers armed and not yet dead)
    for e in events:
        if e.get("kind") == "fault_injected" and e.get("fault_kind") == "kill_save":
            workers = set(e.get("workers") or ()) - set(e.get("errors") or {})
            if workers:
                armed[e.get("index")] = (e.get("fault"), workers)
        elif e.get("kind") == "worker_dead":
            armed = {i: (spec, workers) for i, (spec, workers) in armed.items() if e.get("worker") not in workers}
    return [f"fault {spec!r} armed {', '.join(sorted(workers))} to die mid-save, and no save it wrote afterwards "
            "was cut off, so the run was not tested against it." for spec, workers in armed.values()]


def _exactly_once_reason(detail: dict[str, Any], microbatches: int) -> str:
    parts = []
    for key, verb in (("missing", "never applied"), ("duplicated", "applied more than once"),
                      ("unexpected", f"outside 0..{microbatches - 1}")):
        pairs = detail.get(key) or []
        if pairs:
            shown = ", ".join(f"step {s} microbatch {m}" for s, m in pairs[:3])
            more = "" if len(pairs) <= 3 else f" and {len(pairs) - 3} more"
            parts.append(f"{verb}: {shown}{more}")
    return "exactly-once violated: " + "; ".join(parts) + "."


def _trajectory_reason(first: int | None, losses: list[float], ref: list[float], rtol: float) -> str:
    if first is not None and first < len(losses) and first < len(ref):
        return (f"the loss trajectory diverged from the reference at step {first}: "
                f"{losses[first]!r} vs {ref[first]!r} (rtol {rtol:g}).")
    return (f"the loss trajectory diverged from the reference at step {first}: "
            f"the run has {len(losses)} losses, the reference {len(ref)}.")


def _close(a: float | None, b: float | None, rtol: float) -> bool:
    if a is None or b is None or _bits(a) == _bits(b):
        return True   # a step with no recorded loss on either side cannot be compared
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rtol * abs(b)


def _bits(x: float | None) -> bytes:
    return b"none" if x is None else struct.pack("<d", float(x))


def _s(n: int) -> str:
    return "" if n == 1 else "s"
