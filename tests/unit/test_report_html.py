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


# -- RL post-training ---------------------------------------------------------

def rl_events(faults=True):
    """An RL run folded from hand-built events: 2 trainers, 2 samplers, 6 steps one step off-policy (steps 0 and 1
    on version 0), weight syncs (one passing a lost trainer over), and with ``faults`` sampler s3 killed at step 2
    (reassign, relaunched as s4)."""
    events = [ev(0, "job_started", mode="distributed", config={"run_name": "rl", "steps": 6, "rl_samplers": 2,
                                                               "rl_sampler_devices": 1, "rl_off_policy_steps": 1},
                 global_batch_size=8, microbatches=2),
              ev(0.1, "run_started", run_id="r-rl", slices=2, devices_per_slice=1, steps=6),
              ev(0.2, "placement", active=["w0", "w1"]), ev(0.3, "samplers_started", workers=["s2", "s3"]),
              ev(0.4, "state_initialized", state_bytes=1024)]
    rewards = [0.125, 0.25, 0.375, 0.5, 0.625, 0.875]
    for i, r in enumerate(rewards):
        t, version = 1 + i, max(i - 1, 0)
        failed = ["10.0.0.1:7: ConnectionRefusedError"] if i == 4 else []
        events += [ev(t, "weights_synced", worker="s2", version=version, bytes=2048, seconds=0.002 * (i + 1),
                      source="10.0.0.2:7", failed=failed),
                   ev(t + 0.3, "rollouts_made", step=i, version=version, seconds=0.25),
                   ev(t + 0.35, "step_dispatched", step=i, workers=["w0", "w1"]),
                   ev(t + 0.6, "step_committed", step=i, loss=-0.01 * i),
                   ev(t + 0.6, "rl_step", step=i, version=version, mean_reward=r, rollout_seconds=0.25,
                      rollout_bytes=3000)]
        if faults and i == 2:
            events += [ev(t + 0.7, "fault_injected", index=0, fault="kill:role=sampler@step=3", fault_kind="kill",
                          workers=["s3"], step=3),
                       ev(t + 0.75, "worker_dead", worker="s3", cause="crash"),
                       ev(t + 0.8, "sampler_relaunched", replaces="s3", worker="s4")]
    events.append(ev(7, "run_finished", final_state_digest=DIGEST, replica_hashes={"w0": DIGEST},
                     client_peak_rss_bytes=1))
    return events


def rl_card(page):
    start = page.index("<div class='card' id='rl'>")
    return page[start:page.index("<div class='card'>", start)]


def reward_card(page):
    """An RL run's reward curve: the card beside goodput, where a training run has its loss."""
    start = page.index("<div class='card' id='reward-card'>")
    return page[start:page.index("<div class='card'>", start)]


def test_an_rl_run_renders_its_reward_curve_with_each_steps_weights_version_and_its_table():
    from elastic.report import build_report

    events = rl_events()
    report = build_report(events)
    validate(report)
    assert report["rl"]["samplers_lost"] == 1 and report["faults"][0]["path"] == "reassign"
    page = render_html(report, events)
    curve, card = reward_card(page), rl_card(page)
    assert "<h2>Reward</h2>" in curve and "<svg id='reward'" in curve and "<h2>Loss</h2>" not in page
    # the curve: one point per step, each with its reward and weights version; the version row under the steps
    points = re.findall(r"<circle [^>]*><title>([^<]*)</title></circle>", curve)
    assert len(points) == 6 and points[0] == "step 0: mean reward 0.125, weights v0"
    assert points[5] == "step 5: mean reward 0.875, weights v4, 1 behind"
    assert ">version</text>" in curve and "<polyline" in curve
    assert "sampler lost at step 3" in curve   # the reassigned fault's step is marked
    # the loss, about 0 whatever the policy learns, is in the RL card, said so
    assert "<h2>RL post-training</h2>" in card and "<svg id='loss'" in card and "about 0 whatever" in card
    # the table
    for text in ("samplers</td><td>2<", "rl_off_policy_steps</td><td>1<", "0.250 → 0.667",
                 "weight syncs</td><td>6 (12.0 KiB; median 7 ms, total 42 ms)", "10.0.0.1:7: ConnectionRefusedError",
                 "rollout bytes</td><td>17.6 KiB", "steady steps (measured below)</td><td>5<",
                 "sampler seconds</td><td>1.25 s", "trainer seconds</td><td>1.25 s", "samplers lost / relaunched</td><td>1 / 1"):
        assert text in card, text
    rl = report["rl"]
    assert f"overlap (1 - span / sequential)</td><td>{100 * rl['overlap']:.1f} %" in card
    # 1 s apart: a span twice the two roles' time is gaps, not a negative overlap (0)
    assert rl["span_seconds"] == pytest.approx(5.0) and rl["sequential_seconds"] == pytest.approx(2.5)
    assert rl["overlap"] == 0.0
    assert f"span (commit to commit)</td><td>{rl['span_seconds']:.2f} s" in card


def test_a_run_without_rl_renders_no_rl_section_and_no_reward_line():
    from elastic.report import build_report

    rl_kinds = {"samplers_started", "weights_synced", "rollouts_made", "rl_step"}
    events = [e for e in rl_events(faults=False) if e["kind"] not in rl_kinds]
    events[0] = {**events[0], "config": {"run_name": "plain", "steps": 6}}
    report = build_report(events)
    assert report["rl"] is None and report["steps_completed"] == 6
    page = render_html(report, events)
    assert "RL post-training" not in page and "id='reward'" not in page
    assert "reward" not in summary_text(report, width=120)
    # a fault-free RL run: the section without the fault marks
    events = rl_events(faults=False)
    page = render_html(build_report(events), events)
    assert "sampler lost" not in reward_card(page) and "samplers lost / relaunched</td><td>0 / 0" in rl_card(page)


def test_the_summary_of_an_rl_run_has_its_reward_line():
    from elastic.report import build_report

    report = build_report(rl_events())
    overlap = report["rl"]["overlap"]
    line = next(line for line in summary_text(report, width=120).splitlines() if " reward " in line)
    assert line.split() == ["│", "reward", "0.250", "→", "0.667", "(6", "steps;", "overlap",
                            f"{100 * overlap:.0f}", "%)", "│"], line
    assert "(reassign)" in summary_text(report, width=160)


def test_an_rl_run_shows_its_reward_not_its_loss_counts_a_lost_sampler_and_names_its_samplers():
    """An RL run's loss is about 0 whatever the policy learns (here -0.00 -> -0.05): the summary has no loss row
    but its reward; a sampler lost is a failure, reassigned (the summary and the key facts said 0, as they count
    the step loop's failures only); the page's header counts the samplers beside the trainer slices."""
    from elastic.report import build_report

    events = rl_events()
    report = build_report(events)
    rows = [line.split()[1] for line in summary_text(report, width=120).splitlines()[1:-1]]
    assert "loss" not in rows and "reward" in rows
    line = next(line for line in summary_text(report, width=120).splitlines() if " failures " in line)
    assert line.split()[1:-1] == ["failures", "1", "(1", "reassign)"], line
    page = render_html(report, events)
    assert "<td>failures</td><td>1 (1 reassign)</td>" in page
    assert "2 trainer slices × 1 device + 2 samplers × 1 device" in page
    plain = [e for e in rl_events(faults=False) if e["kind"] not in {"samplers_started", "weights_synced",
                                                                     "rollouts_made", "rl_step"}]
    plain[0] = {**plain[0], "config": {"run_name": "plain", "steps": 6}}
    assert "2 slices × 1 device ·" in render_html(build_report(plain), plain)


def test_a_fault_line_names_the_hosts_retired_with_the_slice():
    """``w1 host 1 (retired 0)`` read as "0 hosts retired": the retired are named as hosts."""
    from elastic.report.summary import _hit

    fault = {"workers": ["w1", "w2"], "hosts": {"w1": 1, "w2": 0}, "retired": {"w1": [0], "w2": [1, 2]}}
    assert _hit(fault) == "w1 host 1 (host 0 retired with it),w2 host 0 (hosts 1+2 retired with it)"


def test_timeline_marker_labels_near_the_right_edge_do_not_overlap_in_a_row():
    """Two markers close together near the end of the axis: their labels end at their lines, so the second may
    not share a row with the first (it once did, drawn over it)."""
    from elastic.report.charts import timeline_svg

    events = [ev(0, "step_committed", step=0, loss=1.0), ev(9.80, "fault_injected", index=1, fault_kind="kill"),
              ev(9.83, "failure_detected", worker="w1"), ev(9.86, "recovered", path="shrink"),
              ev(10, "step_committed", step=1, loss=1.0)]
    svg = timeline_svg(events, [], 0.0, 10.0, svg_id="t", max_slices=2)
    labels = re.findall(r"<text x='([0-9.]+)' y='([0-9.]+)' font-size='11' text-anchor='(\w+)' fill='#\w+' "
                        r"font-weight='bold'>([^<]*)</text>", svg)
    assert len(labels) == 3 and len({y for _, y, _, _ in labels}) == 3, labels   # one row each
    assert all(anchor == "end" for _, _, anchor, _ in labels)   # near the edge: left of their lines
