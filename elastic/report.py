"""The run report: ``report.json`` folded from ``events.jsonl``.

:func:`build_report` is a pure function of the event log, so a report can
always be re-rendered from the log alone. Field meanings are documented in
``docs/report.md``.
"""

from __future__ import annotations

import json
import os
import pathlib

from runtime.events import read_events

__all__ = ["build_report", "write_report", "REPORT_VERSION"]

REPORT_VERSION = 1


def build_report(events_or_path) -> dict:
    events = events_or_path
    if isinstance(events_or_path, (str, os.PathLike)):
        events = read_events(events_or_path)
    report = {
        "report_version": REPORT_VERSION,
        "mode": None,
        "run_id": None,
        "config": None,
        "slices": None,
        "devices_per_slice": None,
        "microbatches": None,
        "global_batch_size": None,
        "steps_requested": None,
        "steps_completed": 0,
        "losses": [],
        "final_state_sha256": None,
        "replica_hashes": {},
        "wall_seconds": None,
        "client_peak_rss_bytes": None,
        "state_bytes": None,
        "program_bytes": None,
        "compile_seconds": None,
        "step_seconds_median": None,
        "finished": False,
        "failures": [],
        "checkpoint_restores": 0,
        "steps_lost": 0,
        "slices_at_end": None,
    }
    step_seconds = []
    t_first = events[0]["t"] if events else None
    for e in events:
        kind = e["kind"]
        if kind == "job_started":
            report.update(mode=e["mode"], config=e["config"], global_batch_size=e["global_batch_size"],
                          microbatches=e["microbatches"])
        elif kind == "programs_built":
            report.update(program_bytes=e["program_bytes"], state_bytes=e["state_bytes"])
        elif kind == "run_started":
            report.update(run_id=e["run_id"], slices=e["slices"], devices_per_slice=e["devices_per_slice"],
                          steps_requested=e["steps"])
        elif kind == "programs_loaded":
            report["compile_seconds"] = max(e["compile_seconds"].values(), default=0.0)
        elif kind == "state_initialized":
            report["state_bytes"] = e["state_bytes"]
        elif kind == "step_committed":
            if e["step"] < report["steps_completed"]:
                # A step committed again: the run had rewound past committed work.
                report["steps_lost"] += 1
                continue
            report["losses"].append(e["loss"])
            report["steps_completed"] += 1
            if "seconds" in e:
                step_seconds.append(e["seconds"])
        elif kind == "placement":
            report["slices_at_end"] = len(e["active"])
        elif kind == "failure_detected":
            current = {"detected_at": e["t"] - t_first, "error": e["error"], "detail": e["detail"],
                       "step": e["committed"], "workers": [], "path": None, "recovered_after_s": None,
                       "bytes_moved": 0}
            report["failures"].append(current)
        elif kind == "worker_dead" and report["failures"] and report["failures"][-1]["path"] is None:
            report["failures"][-1]["workers"].append(e["worker"])
        elif kind == "recovery_decision" and report["failures"]:
            report["failures"][-1]["path"] = e["action"]
            report["slices_at_end"] = len(e["active"])
        elif kind == "recovered" and report["failures"]:
            report["failures"][-1].update(recovered_after_s=e["seconds"], bytes_moved=e["bytes_moved"],
                                          resume_step=e["resume_step"])
        elif kind == "grown":
            report["slices_at_end"] = len(e["active"])
        elif kind == "run_finished":
            report.update(final_state_sha256=e["final_state_sha256"], replica_hashes=e["replica_hashes"],
                          client_peak_rss_bytes=e["client_peak_rss_bytes"], finished=True)
            report["wall_seconds"] = e["t"] - t_first
    if step_seconds:
        report["step_seconds_median"] = sorted(step_seconds)[len(step_seconds) // 2]
    if report["mode"] == "reference":
        report["slices"] = 0
    return report


def write_report(run_dir, report: dict) -> pathlib.Path:
    """Writes ``report.json`` atomically (temp file + rename)."""
    path = pathlib.Path(run_dir) / "report.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path
