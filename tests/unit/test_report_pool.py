"""The report's ``pool`` section (``elastic/report/pool.py``), folded from hand-built logs of a run leased from a
shared pool: its time in the queue, leases, preemptions and lease timeline; the "Shared pool" card of
``report.html`` and the ``pool`` row of the terminal summary; null, no card and no row for a run without a pool."""

import json
import pathlib
import re

import jsonschema
import pytest

from elastic.report import build_report, render_html, summary_text
from tests.support.events import ev

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())
DIGEST = "xxh3_128:" + "ab" * 16
EVIL = "<script>alert('x')</script>"
POOL_KINDS = {"pool_waiting", "lease_granted", "lease_returned", "lease_preempted", "released"}


def validate(report):
    jsonschema.Draft202012Validator(SCHEMA).validate(report)


def pool_events(ended=True):
    """A run of 3 slices leased from a pool: it waits 4.2 s in the queue (its place changes once), is granted 3
    hosts, is asked for one back after step 3 (gives w2 at step 4), is granted another (w3, grown at step 6), and
    finishes 8 steps; with ``ended`` it gives every host back ("run ended"), without, its client died first."""
    events = [ev(0, "job_started", mode="distributed", global_batch_size=6, microbatches=3,
                 config={"run_name": "pooled", "steps": 8, "elastic_pool": "10.0.0.9:7400",
                         "elastic_pool_priority": 1}),
              ev(0.1, "run_started", run_id="r-pool", slices=3, devices_per_slice=1, steps=8),
              ev(0.2, "pool_waiting", status="queued for 0 s: 3 host(s) asked, 0 held (minimum 2); place 2 in the "
                                             "queue, 0 of 6 host(s) free"),
              ev(2.0, "pool_waiting", status=f"queued for 2 s: 3 host(s) asked, 0 held (minimum 2); place 1 in the "
                                             f"queue, 0 of 6 host(s) free {EVIL}"),
              ev(4.4, "lease_granted", worker="w0", host="host-a", lease="lease-1"),
              ev(4.5, "lease_granted", worker="w1", host="host-b", lease="lease-2"),
              ev(4.6, "lease_granted", worker="w2", host="host-c", lease="lease-3"),
              ev(5.0, "placement", epoch=0, active=["w0", "w1", "w2"], spares=[], seconds=0.1),
              ev(5.1, "state_initialized", seed=0, state_bytes=1024)]
    events += [ev(5.5 + 0.5 * i, "step_committed", step=i, epoch=0, loss=3.0 - 0.1 * i) for i in range(4)]
    events += [ev(7.2, "lease_preempted", count=1, workers=["w2"]),
               ev(7.3, "placement_changed", epoch=1, active=["w0", "w1"], spares=[], why="release"),
               ev(7.3, "released", epoch=1, promoted=[], active=["w0", "w1"], spares=[], bytes_moved=0, step=4,
                  given=["w2"]),
               ev(7.35, "lease_returned", worker="w2", why="preempted")]
    events += [ev(7.5 + 0.5 * i, "step_committed", step=4 + i, epoch=1, loss=2.6 - 0.1 * i) for i in range(2)]
    events += [ev(9.0, "lease_granted", worker="w3", host="host-c", lease="lease-4"),
               ev(9.5, "placement_changed", epoch=2, active=["w0", "w1", "w3"], spares=[], why="grow"),
               ev(9.5, "grown", epoch=2, promoted=["w3"], active=["w0", "w1", "w3"], spares=[], bytes_moved=1024,
                  step=6)]
    events += [ev(10.0 + 0.5 * i, "step_committed", step=6 + i, epoch=2, loss=2.4 - 0.1 * i) for i in range(2)]
    if ended:
        events += [ev(11.0, "run_finished", steps_completed=8, final_state_digest=DIGEST,
                      replica_hashes={"w0": DIGEST}, wall_seconds=11.0, client_peak_rss_bytes=1)]
        events += [ev(11.1, "lease_returned", worker=w, why="run ended") for w in ("w0", "w1", "w3")]
    return events


def plain_events():
    """The same run without a pool: no lease events, no ``elastic_pool`` in its config."""
    events = [e for e in pool_events() if e["kind"] not in POOL_KINDS]
    events[0] = {**events[0], "config": {"run_name": "plain", "steps": 8}}
    return events


def pool_card(page):
    start = page.index("<div class='card' id='pool'>")
    return page[start:page.index("<div class='card'>", start)]


def test_a_pool_run_folds_its_queue_time_leases_preemption_and_timeline():
    report = build_report(pool_events())
    validate(report)
    pool = report["pool"]
    assert pool["address"] == "10.0.0.9:7400" and pool["priority"] == 1
    assert pool["queue_seconds"] == pytest.approx(4.2)   # first pool_waiting (0.2) to the first grant (4.4)
    assert [(x["worker"], x["host"], x["lease"], x["why"]) for x in pool["leases"]] == [
        ("w0", "host-a", "lease-1", "run ended"), ("w1", "host-b", "lease-2", "run ended"),
        ("w2", "host-c", "lease-3", "preempted"), ("w3", "host-c", "lease-4", "run ended")]
    assert [x["granted_t"] for x in pool["leases"]] == pytest.approx([4.4, 4.5, 4.6, 9.0])
    assert [x["returned_t"] for x in pool["leases"]] == pytest.approx([11.1, 11.1, 7.35, 11.1])
    assert len(pool["preemptions"]) == 1
    p = pool["preemptions"][0]
    assert p["t"] == pytest.approx(7.2) and (p["count"], p["workers"], p["step"]) == (1, ["w2"], 4)
    assert (pool["hosts_max"], pool["hosts_at_end"]) == (3, 0)
    timeline = pool["timeline"]
    assert [x["kind"] for x in timeline] == ["waiting", "waiting", "granted", "granted", "granted", "preempted",
                                             "returned", "granted", "grown", "returned", "returned", "returned"]
    assert [x["t"] for x in timeline] == sorted(x["t"] for x in timeline)
    assert [x["worker"] for x in timeline if x["kind"] in ("granted", "returned")] == [
        "w0", "w1", "w2", "w2", "w3", "w0", "w1", "w3"]
    assert all(x["worker"] is None for x in timeline if x["kind"] in ("waiting", "preempted", "grown"))
    details = {x["kind"]: x["detail"] for x in timeline}   # the last of each kind
    assert timeline[0]["detail"].startswith("queued for 0 s: 3 host(s) asked")   # the pool's status line
    assert details["preempted"] == "1 host(s) asked back; gave w2 at step 4"
    assert details["grown"] == "grew back to 3 slice(s) at step 6: w3 promoted"
    assert details["granted"] == "w3 on host host-c (lease-4)"
    assert details["returned"] == "w3 given back (run ended)"
    assert report["finished"] and report["steps_completed"] == 8


def test_a_run_whose_client_died_holds_its_hosts_at_the_end():
    pool = build_report(pool_events(ended=False))["pool"]
    assert (pool["hosts_max"], pool["hosts_at_end"]) == (3, 3)
    assert [x["returned_t"] is None for x in pool["leases"]] == [True, True, False, True]
    assert [x["why"] for x in pool["leases"]] == [None, None, "preempted", None]


def test_queue_time_of_a_run_never_granted_and_of_one_never_queued():
    events = [e for e in pool_events() if e["kind"] != "lease_granted"]
    pool = build_report(events)["pool"]   # still a pool run: its config says so
    assert pool["queue_seconds"] == pytest.approx(events[-1]["t"] - events[2]["t"])   # waited to the log's end
    assert pool["leases"] == [] and pool["hosts_max"] == 0
    events = [e for e in pool_events() if e["kind"] != "pool_waiting"]
    assert build_report(events)["pool"]["queue_seconds"] == 0.0


def test_a_log_with_leases_is_a_pool_run_when_its_config_does_not_say():
    events = pool_events()
    events[0] = {**events[0], "config": {"run_name": "pooled", "steps": 8}}
    report = build_report(events)
    validate(report)
    assert report["pool"]["address"] is None and report["pool"]["priority"] is None
    assert len(report["pool"]["leases"]) == 4


def test_a_preemption_the_run_could_not_answer_has_no_step():
    """The run gave nothing (no spare, at its minimum): no ``released`` follows, and a later one is not its."""
    events = pool_events()
    at = next(i for i, e in enumerate(events) if e["kind"] == "lease_preempted")
    events.insert(at, ev(6.9, "lease_preempted", count=2, workers=[]))
    pool = build_report(events)["pool"]
    assert [(p["count"], p["workers"], p["step"]) for p in pool["preemptions"]] == [(2, [], None), (1, ["w2"], 4)]
    assert pool["timeline"][5]["detail"] == "2 host(s) asked back; gave none"


def test_a_run_without_a_pool_has_pool_null_no_card_and_no_pool_row():
    events = plain_events()
    report = build_report(events)
    validate(report)
    assert report["pool"] is None and report["steps_completed"] == 8
    page = render_html(report, events)
    assert "Shared pool" not in page and "id='pool'" not in page
    assert not any(line.split()[1:2] == ["pool"] for line in summary_text(report, width=120).splitlines())


def test_the_html_of_a_pool_run_has_its_shared_pool_card():
    events = pool_events()
    report = build_report(events)
    page = render_html(report, events)
    assert page.count("<h2>Shared pool</h2>") == 1
    card = pool_card(page)
    for text in ("address</td><td>10.0.0.9:7400<", "priority</td><td>1<", "time in queue</td><td>4.20 s<",
                 "leases</td><td>4 lease(s), 1 preempted, 4.2 s queued<", "preemptions (hosts asked back)</td><td>1 (1)<",
                 "hosts held (most / at end)</td><td>3 / 0<"):
        assert text in card, text
    rows = re.findall(r"<tr><td>(w\d)</td><td><code>([^<]*)</code></td><td><code>([^<]*)</code></td>"
                      r"<td class='nw'>([^<]*)</td><td class='nw'>([^<]*)</td><td>([^<]*)</td></tr>", card)
    assert rows == [("w0", "host-a", "lease-1", "4.40 s", "11.10 s", "run ended"),
                    ("w1", "host-b", "lease-2", "4.50 s", "11.10 s", "run ended"),
                    ("w2", "host-c", "lease-3", "4.60 s", "7.35 s", "preempted"),
                    ("w3", "host-c", "lease-4", "9.00 s", "11.10 s", "run ended")]
    items = re.findall(r"<li><span class='nw'>([^<]*)</span> <b>([^<]*)</b> ([^<]*)</li>", card)
    assert len(items) == 12 and items[5] == ("7.20 s", "preempted", "1 host(s) asked back; gave w2 at step 4")
    assert EVIL not in page and "&lt;script&gt;" in card   # the pool's status line is text, escaped


def test_the_timeline_s_slices_lane_drops_when_the_run_gives_hosts_back_and_rises_when_it_grows():
    """The lane follows the run's placement as its state folds it: 3 slices, 2 from the release at step 4 (the
    lane stayed at 3 across it), 3 again from the grow; the release has a marker of its own."""
    page = render_html(build_report(pool_events()), pool_events())
    lane = page[page.index("<svg id='timeline'"):page.index("</svg>", page.index("<svg id='timeline'"))]
    assert re.findall(r"font-size='10' text-anchor='start' fill='#0d47a1' >(\d+)</text>", lane) == ["3", "2", "3"]
    assert "gave back to the pool: 2 left" in lane and "grown to 3" in lane


def test_the_summary_of_a_pool_run_has_its_pool_row():
    line = next(line for line in summary_text(build_report(pool_events()), width=120).splitlines()
                if line.split()[1:2] == ["pool"])
    assert line.split()[1:-1] == ["pool", "4", "lease(s),", "1", "preempted,", "4.2", "s", "queued"], line


def test_the_schema_refuses_a_pool_section_out_of_its_vocabulary():
    report = build_report(pool_events())
    report["pool"]["timeline"][0]["kind"] = "evicted"
    with pytest.raises(jsonschema.ValidationError):
        validate(report)
    report = build_report(pool_events())
    del report["pool"]["leases"][0]["why"]
    with pytest.raises(jsonschema.ValidationError):
        validate(report)


def test_a_malformed_lease_event_is_one_error_naming_it():
    events = pool_events()
    events[4] = {k: v for k, v in events[4].items() if k != "host"}
    with pytest.raises(ValueError, match=r"^event 5 \('lease_granted'\) has no 'host'$"):
        build_report(events)
