"""The report's ``rl`` section: an RL run's rewards, weights versions, weight syncs and the two roles' time.

A pure function of the event log (:func:`rl_section`), as the rest of the
report is. Per committed step (``rl_step``): the weights version its rollouts
were made with, their mean reward, how long the samplers took to make them
and the bytes the client carried. Weight syncs (``weights_synced``): count,
bytes and seconds, and the sources passed over (lost mid-transfer, or without
the version). The roles' time, measured on the client's clock:

- over the steady steps (those committed right after the previous commit,
  with no failure or client restart between: a recovery's time is not the
  schedule's), summed:
- ``sampler_seconds``: from the step's first rollout call to its last
  rollout answer (``rollouts_made``);
- ``trainer_seconds``: from the step's dispatch to its commit;
- ``span_seconds``: from the previous commit to the step's commit;
- ``sequential_seconds``: ``sampler_seconds + trainer_seconds``, what the
  same work takes with no overlap, and ``overlap`` = 1 - span / sequential
  (0: none, as on-policy; 0.5: the steps took half the sequential time), at
  least 0 (a span longer than the sequential time holds the client's gaps and
  the weight syncs, which are neither role's).

:func:`sampler_fault` fills a fault that hit samplers: detection when the
sampler was declared dead, recovery when the next step's rollouts were all
made (the lost microbatches made by the others), path ``reassign``.
"""

from __future__ import annotations

import statistics

__all__ = ["rl_section", "sampler_fault", "samplers_in"]


def samplers_in(t) -> set[str]:
    """The samplers among the run state's members after transition ``t`` (a :class:`runtime.Transition`), when
    it changed the members (else none: they were counted before). Their union over a log's transitions is every
    worker that served the run as a sampler, in any attempt."""
    if t.after.members is t.before.members:
        return set()
    return {w for w, m in t.after.members.items() if m.role == "sampler"}


def _sampler_relaunch(e: dict) -> bool:
    return e["kind"] == "sampler_relaunched" or (e["kind"] == "worker_relaunched" and e.get("role") == "sampler")


def rl_section(config: dict | None, events: list[dict], samplers: set[str]) -> dict | None:
    """The ``rl`` section of a run's report; None for a run that is not RL. ``samplers``: every worker that
    served as one (:func:`samplers_in`)."""
    steps = {}
    for e in events:
        if e["kind"] == "rl_step":
            steps[e["step"]] = {**{k: e[k] for k in ("step", "version", "rollout_seconds", "rollout_bytes")},
                                "mean_reward": e.get("mean_reward")}   # None: committed by a restarted client
    if not steps and not (config or {}).get("rl_samplers"):
        return None
    syncs = [e for e in events if e["kind"] == "weights_synced"]
    dispatched, made, last_commit = {}, {}, None
    sampler = trainer = span = 0.0
    steady = 0
    for e in events:
        kind = e["kind"]
        if kind == "step_dispatched":
            dispatched[e["step"]] = e["t"]   # the last dispatch: the one that committed
        elif kind == "rollouts_made":
            made[e["step"]] = e["seconds"]
        elif kind in ("failure_detected", "job_started", "client_attached"):
            last_commit = None   # what follows is a recovery's, or a new client's start
        elif kind == "step_committed":
            k = e["step"]
            if last_commit is not None and k in made and k in dispatched and not e.get("recovered"):
                sampler += made[k]
                trainer += e["t"] - dispatched[k]
                span += e["t"] - last_commit
                steady += 1
            last_commit = e["t"]
    sequential = sampler + trainer
    span = span if steady else None
    rewards = [s["mean_reward"] for _, s in sorted(steps.items()) if s["mean_reward"] is not None]
    head, tail = rewards[:3], rewards[-3:]
    return {
        "samplers": (config or {}).get("rl_samplers"),
        "off_policy_steps": (config or {}).get("rl_off_policy_steps"),
        "steps": [s for _, s in sorted(steps.items())],
        "reward_first": statistics.fmean(head) if head else None,
        "reward_last": statistics.fmean(tail) if tail else None,
        "weight_syncs": len(syncs),
        "weight_sync_bytes": sum(e["bytes"] for e in syncs),
        "weight_sync_seconds": sum(e["seconds"] for e in syncs),
        "weight_sync_seconds_median": statistics.median([e["seconds"] for e in syncs]) if syncs else None,
        "weight_sync_sources_failed": [f for e in syncs for f in e.get("failed", [])],
        "rollout_bytes": sum(s["rollout_bytes"] for s in steps.values()),
        "sampler_seconds": sampler,
        "trainer_seconds": trainer,
        "span_seconds": span,
        "sequential_seconds": sequential,
        # (at least 0: a span longer than the two roles' time is the client's and the weight syncs' gaps, not a
        # negative overlap; span and sequential are kept as they are)
        "overlap": max(1 - span / sequential, 0.0) if span is not None and sequential > 0 else None,
        "steady_steps": steady,
        "samplers_lost": len([e for e in events if e["kind"] == "worker_dead" and e["worker"] in samplers]),
        "samplers_relaunched": len([e for e in events if _sampler_relaunch(e)]),
    }


def sampler_fault(fault: dict, events: list[dict], samplers: set[str], dead_at: dict[str, float],
                  t_first: float) -> bool:
    """Fills ``fault`` (a report's fault) when it hit samplers only (``samplers``: :func:`samplers_in` the
    events): detected when the first was declared dead, recovered when the next step's rollouts were all made
    after that, path ``reassign``. False (nothing filled) for a fault that hit a trainer."""
    if not fault["workers"] or not set(fault["workers"]) <= samplers:
        return False
    seen = [dead_at[w] for w in fault["workers"] if w in dead_at and dead_at[w] >= fault["injected_at"] - 1e-6]
    if not seen:
        return True
    detected = min(seen)
    fault.update(detected_after_s=detected - fault["injected_at"], path="reassign")
    after = [e["t"] - t_first for e in events if e["kind"] == "rollouts_made" and e["t"] - t_first >= detected]
    if after:
        fault["recovered_after_s"] = after[0] - fault["injected_at"]
    return True
