"""The ``pipeline`` section of ``report.json``: a pipelined run's schedule, its measured bubble against the
theory, and each stage's phases (pure, over the events :func:`elastic.report.fold.build_report` checked).

Each committed step of a pipelined run on workers records ``stage_phases`` (per stage, its slowest replica's
seconds in each phase) and ``bubble`` (the step's idle fraction, ``runtime/pipeline/bubble.py``); this takes
their medians over the steps. The theory is of one pipeline replica: (S - 1) / (m + S - 1) with m its share
of the step's M microbatches (M / R with R replicas; the median share over the steps, as a shrink changes it). A run without stages has no section (null).
"""

from __future__ import annotations

import statistics

from runtime import theoretical_bubble

__all__ = ["pipeline_section"]


def pipeline_section(config: object, microbatches: object, events: list[dict]) -> dict | None:
    """The section (``docs/report.md``, "pipeline"), or None for an unpipelined run.

    ``config``: the run's resolved config (``dcn_pipeline_parallelism``, ``elastic_pipeline_schedule``; a log
    without one takes the stage count from the steps' ``stage_phases``); ``microbatches``: M.
    """
    bubbles, per_replica, phases = [], [], {}   # phases: stage -> phase -> seconds per step
    for e in events:
        if e["kind"] == "step_committed":
            if "bubble" in e:
                bubbles.append(e["bubble"])
                # each pipeline replica runs its own share of the step's microbatches (the loss workers' ids)
                shares = [len(ids) for ids in (e.get("microbatches") or {}).values() if isinstance(ids, list)]
                if shares:
                    per_replica.append(max(shares))
            for stage, seconds in e.get("stage_phases", {}).items():
                for name, s in seconds.items():
                    phases.setdefault(stage, {}).setdefault(name, []).append(s)
    cfg = config if isinstance(config, dict) else {}
    stages = _count(cfg.get("dcn_pipeline_parallelism")) or len(phases)
    if stages < 2:
        return None
    m = _count(microbatches)
    share = int(statistics.median_low(per_replica)) if per_replica else m   # one process: one replica, all M
    theory = theoretical_bubble(stages, share) if share else None
    measured = statistics.median(bubbles) if bubbles else None
    return {
        "schedule": cfg.get("elastic_pipeline_schedule"),
        "stages": stages,
        "microbatches": m,
        "microbatches_per_replica": share,
        "bubble_theoretical": theory,
        "bubble_median": measured,
        "bubble_ratio": measured / theory if measured is not None and theory else None,
        "steps_measured": len(bubbles),
        "stage_phases_median": {stage: {name: statistics.median(s) for name, s in by_name.items()}
                                for stage, by_name in sorted(phases.items(), key=lambda kv: _stage_key(kv[0]))},
    }


def _count(v: object) -> int | None:
    """``v`` if it is a whole number > 0 (a count the config or the log gave), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _stage_key(stage: str) -> tuple[int, str]:
    """Stages in numeric order ("2" before "10"), any other name after them."""
    return (int(stage), "") if stage.isdigit() else (1 << 62, stage)
