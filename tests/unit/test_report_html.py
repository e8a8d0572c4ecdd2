"""report.json schema, the HTML report, the terminal summary and the chromium screenshot."""

import copy
import importlib.util
import json
import pathlib
import re

import jsonschema
import pytest

from elastic.report import CHROMIUM, chromium_dom, chromium_screenshot, goodput, render_html, summary_text, write_html
from tests.support.events import ev

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())
EVIL = "<script>alert('x')</script>"
DIGEST = "xxh3_128:" + "ab" * 16


def faulted_events():
    """A run with one injected crash, its detection, a shrink, a later grow, and the finish."""
    events = [ev(0, "job_started", mode="distributed"), ev(0.5, "programs_built"),
              ev(0.6, "run_started", run_id="r1", slices=2), ev(1.5, "placement", active=["w0", "w1"]),
              ev(4, "programs_loaded"), ev(4.1, "state_initialized")]
    events += [ev(4.5 + 0.2 * i, "step_committed", step=i, loss=3.0 - 0.1 * i) for i in range(4)]
    events += [ev(5.2, "fault_injected", index=0, fault="crash w1 @ step 4", workers=["w1"], step=4),
               ev(5.4, "failure_detected", error="WorkerLostError", detail=EVIL, worker="w1", committed=4),
               ev(5.6, "worker_dead", worker="w1"),
               ev(5.9, "recovery_decision", action="shrink", active=["w0"], dead=["w1"]),
               ev(6.0, "recovered", path="shrink", resume_step=4, bytes_moved=0, seconds=0.6)]
    events += [ev(6.3 + 0.2 * i, "step_committed", step=4 + i, loss=2.6 - 0.1 * i) for i in range(3)]
    events += [ev(7.0, "grown", active=["w0", "w2"], promoted=["w2"], bytes_moved=1024, step=7)]
    events += [ev(7.2 + 0.2 * i, "step_committed", step=7 + i, loss=2.3 - 0.1 * i) for i in range(3)]
    events += [ev(7.8, "run_finished", final_state_digest=DIGEST)]
    return events


def full_report(events):
    """A report with every field of the schema filled in, as for a chaos run with a reference."""
    losses = [e["loss"] for e in events if e["kind"] == "step_committed"]
    return {
        "report_version": 2, "mode": "distributed", "run_id": "r1", "seed": 0,
        "config": {"run_name": "tiny", "steps": 10}, "slices": 2, "devices_per_slice": 2, "microbatches": 4,
        "global_batch_size": 16, "steps_requested": 10, "steps_completed": 10, "losses": losses,
        "final_state_digest": DIGEST, "digest_algorithm": "xxh3_128", "replica_hashes": {"w0": DIGEST, "w2": DIGEST},
        "wall_seconds": 7.8,
        "client_peak_rss_bytes": 250_000_000, "state_bytes": 259_972,
        "program_bytes": {"init": 1, "grad": 2, "apply": 3}, "compile_seconds": 3.2, "step_seconds_median": 0.2,
        "finished": True, "failure_reason": None,
        "failures": [{"detected_at": 5.4, "error": "WorkerLostError", "detail": EVIL, "step": 4, "workers": ["w1"],
                      "path": "shrink", "recovered_after_s": 0.6, "bytes_moved": 0, "resume_step": 4,
                      "kind": "crash", "detected_after_s": 0.2}],
        "faults": [{"index": 0, "spec": "crash w1 @ step 4", "kind": "crash", "workers": ["w1"], "injected_at": 5.2,
                    "step": 4, "detected_after_s": 0.2, "recovered_after_s": 0.6, "path": "shrink",
                    "bytes_moved": 0, "skipped": None}],
        "stragglers": [{"worker": "w0", "step": 2, "seconds": 0.9, "median_seconds": 0.2, "action": "reported"}],
        "checkpoint_restores": 0, "steps_lost": 0, "slices_at_end": 2,
        "resumed_from": {"step": 4, "directory": "gs://bucket/run", "tier": "checkpoint", "bytes": 9,
                         "losses_recorded": True, "resharded_from": {"devices_per_slice": 2, "microbatches": 4},
                         "comparison": "within tolerance"},
        "checkpoints_skipped": ["step 8 (gs://bucket/run/8): its leaves hash to 0123..., it recorded 4567..."],
        "goodput": goodput(events),
        "chaos": {"spec": "crash w1 @ step 4", "seed": 7, "mtbf_seconds": None, "duration_seconds": None,
                  "scenario": None},
        "reference": {"run_dir": "ref", "losses": losses, "final_state_digest": DIGEST},
        "verdict": "pass", "verdict_reasons": [f"losses identical to the reference {EVIL}"],
        "trajectory": "identical", "first_diverging_step": None, "exactly_once": True,
        "exactly_once_detail": {"duplicated": [], "missing": []},
    }


def fault_free_report(events):
    r = full_report(events)
    r.update(resumed_from=None, checkpoints_skipped=[], failures=[], faults=[], stragglers=[], chaos=None, reference=None, verdict=None, verdict_reasons=[],
             trajectory=None, exactly_once=None, exactly_once_detail={}, seed=None)
    return r


# -- schema -------------------------------------------------------------------

def validate(report):
    jsonschema.Draft202012Validator(SCHEMA).validate(report)


def test_schema_is_valid_draft_2020_12_and_documents_every_field():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["additionalProperties"] is False

    def walk(node, where):
        for name, sub in node.get("properties", {}).items():
            assert sub.get("description"), f"{where}.{name} has no description"
            walk(sub, f"{where}.{name}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{where}[]")

    walk(SCHEMA, "report")


def test_faulted_and_fault_free_reports_validate():
    events = faulted_events()
    validate(full_report(events))
    validate(fault_free_report(events))


def test_a_report_of_version_1_with_its_sha256_still_validates():
    report = full_report(faulted_events())
    del report["final_state_digest"], report["digest_algorithm"], report["reference"]["final_state_digest"]
    old = "ab" * 32
    report.update(report_version=1, final_state_sha256=old, replica_hashes={"w0": old, "w2": old})
    report["reference"]["final_state_sha256"] = old
    validate(report)
    report["report_version"] = 2   # from version 2 the digest must name its algorithm
    with pytest.raises(jsonschema.ValidationError, match="final_state_digest"):
        validate(report)


def test_unknown_top_level_key_fails_validation():
    report = full_report(faulted_events())
    report["surprise"] = 1
    with pytest.raises(jsonschema.ValidationError, match="surprise"):
        validate(report)


@pytest.mark.parametrize("mutate", [
    lambda r: r.pop("goodput"),
    lambda r: r["failures"][0].update(path="teleport"),
    lambda r: r["goodput"]["badput_seconds"].pop("compile"),
    lambda r: r.update(verdict="maybe"),
    lambda r: r["stragglers"][0].update(action="ignored"),
    lambda r: r.pop("digest_algorithm"),
    lambda r: r.update(digest_algorithm="md5"),
])
def test_schema_rejects_missing_and_out_of_vocabulary_fields(mutate):
    report = copy.deepcopy(full_report(faulted_events()))
    mutate(report)
    with pytest.raises(jsonschema.ValidationError):
        validate(report)


# -- HTML ---------------------------------------------------------------------

def test_html_is_self_contained_and_escaped():
    events = faulted_events()
    page = render_html(full_report(events), events)
    assert page.startswith("<!DOCTYPE html>")
    for svg_id in ("timeline", "loss"):
        assert re.search(rf"<svg id='{svg_id}'", page)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "<script" not in page.lower() and "<link" not in page.lower() and "@import" not in page
    assert "&lt;script&gt;" in page
    for text in ("PASS", "crash w1 @ step 4", "recovered: shrink", "detected: w1", "WorkerLostError", DIGEST,
                 "Stragglers", "reference"):
        assert text in page, text


def test_html_renders_fault_free_reference_mode_and_unfinished_runs():
    events = faulted_events()
    page = render_html(fault_free_report(events), events)
    assert "No failures." in page and "No faults injected." in page and "class='banner" not in page

    ref_events = [ev(0, "job_started", mode="reference"), ev(1, "programs_built"),
                  ev(1.1, "run_started", run_id="reference", slices=0)]
    ref_events += [ev(2 + 0.1 * i, "step_committed", step=i, loss=1.0) for i in range(5)]
    ref_events += [ev(2.6, "state_initialized"), ev(2.7, "run_finished")]
    ref = fault_free_report(ref_events)
    ref.update(mode="reference", run_id="reference", slices=0, slices_at_end=None, goodput=goodput(ref_events))
    assert "reference mode" in render_html(ref, ref_events)

    cut = events[:12]
    unfinished = fault_free_report(cut)
    unfinished.update(finished=False, final_state_digest=None, wall_seconds=None, failure_reason=EVIL,
                      goodput=goodput(cut))
    page = render_html(unfinished, cut)
    assert "did not finish" in page and "&lt;script&gt;" in page and "<script" not in page

    bare = {"run_id": None, "losses": []}  # an old or half-built report: tolerated
    assert "<svg id='timeline'" in render_html(bare, events[:3])


def test_write_html_is_atomic(tmp_path):
    events = faulted_events()
    path = write_html(tmp_path, full_report(events), events)
    assert path == tmp_path / "report.html" and path.read_text().startswith("<!DOCTYPE html>")
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]


def test_summary_text_is_short_plain_and_markup_safe():
    events = faulted_events()
    report = full_report(events)
    report["verdict_reasons"] = ["losses [bold]differ[/]"]
    text = summary_text(report)
    assert "PASS" in text and "10 / 10" in text and "1 shrink" in text and "[bold]differ[/]" in text
    assert "\x1b" not in text and len(text.splitlines()) < 25
    assert "4" in summary_text({"steps_completed": 4})


# -- chromium -----------------------------------------------------------------

def require_chromium():
    if not pathlib.Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium) "
                    "to run the report screenshot tests")


def test_chromium_renders_the_report(tmp_path):
    require_chromium()
    events = faulted_events()
    html_path = write_html(tmp_path, full_report(events), events)
    dom = chromium_dom(html_path)
    assert 'id="timeline"' in dom and 'id="loss"' in dom
    png = chromium_screenshot(html_path, tmp_path / "shot.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_screenshot_script_renders_a_run_directory(tmp_path):
    require_chromium()
    spec = importlib.util.spec_from_file_location("screenshot", ROOT / "scripts" / "screenshot.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    events = faulted_events()
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "report.json").write_text(json.dumps(full_report(events)))
    assert script.main([str(tmp_path), "--out", str(tmp_path / "out.png")]) == 0
    assert (tmp_path / "report.html").exists() and (tmp_path / "out.png").stat().st_size > 10_000
