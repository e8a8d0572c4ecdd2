"""``report.html``: one self-contained page showing a run at a glance.

:func:`render_html` is a pure function of ``report.json`` and
``events.jsonl``: inline CSS and inline SVG (drawn by
:mod:`elastic.report.charts`), no JavaScript, no network, no external fonts or
images, every piece of text escaped. It tolerates fields missing from older
reports (``.get`` with defaults), runs with no failures, reference-mode runs
(0 slices) and unfinished runs. :func:`write_html` writes it atomically.
"""

from __future__ import annotations

import os
import pathlib
import time

from elastic.report.charts import (COLORS, PHASE_COLORS, bar_svg, esc, finite, first_time, fmt_seconds, loss_svg,
                                   phase_color, reward_svg, slice_counts, timeline_svg)
from elastic.report.goodput import BADPUT_LABELS, goodput as compute_goodput, idle_gaps, intervals
from elastic.report.summary import bubble_text, failures_text, pool_text, resumed_text

__all__ = ["render_html", "write_html"]

_CSS = """
*{box-sizing:border-box}
body{margin:0;background:#f4f5f7;color:#1f2329;font:14px/1.45 "DejaVu Sans","Liberation Sans",Arial,sans-serif}
main{max-width:1240px;margin:0 auto;padding:18px 20px 40px}
h1{font-size:22px;margin:0 0 2px} h2{font-size:16px;margin:0 0 10px}
.sub{color:#59606b;font-size:13px}
.card{background:#fff;border:1px solid #dde1e6;border-radius:8px;padding:14px 16px;margin-top:14px}
.row{display:flex;gap:14px} .row>.card{flex:1;min-width:0}
.banner{border-radius:8px;padding:10px 16px;margin-top:14px;color:#fff;font-weight:bold;font-size:16px}
.banner ul{margin:4px 0 0;padding-left:20px;font-weight:normal;font-size:13px}
.pass{background:#2e7d32} .fail{background:#c62828} .warn{background:#8d6e00}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eceef1;vertical-align:top}
th{color:#59606b;font-weight:normal;background:#fafbfc}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
table.facts td:nth-child(odd){color:#59606b;width:16%} table.facts td:nth-child(even){font-weight:bold}
code{font:12px "DejaVu Sans Mono",monospace;word-break:break-all}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;font-size:12px;color:#444;margin-top:6px}
.sw{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:4px;vertical-align:-2px}
.big{font-size:28px;font-weight:bold} .muted{color:#8a919c} .nw{white-space:nowrap}
svg text{font-family:"DejaVu Sans","Liberation Sans",Arial,sans-serif}
.split{display:flex;gap:20px;align-items:flex-start} .split>*{flex:1;min-width:0}
table.kv td:first-child{color:#59606b;width:42%} table.kv td:last-child{font-weight:bold}
table.kv .note{display:block;font-weight:normal;font-size:12px;color:#59606b;word-break:break-all}
ul.events{margin:4px 0 0;padding-left:18px;font-size:13px} ul.events b{font-weight:normal;color:#59606b}
"""


def _fmt_bytes(n: object) -> str:
    if n is None:
        return "—"
    if not finite(n):
        return str(n)   # a value the fold copied verbatim: shown as it is
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _date(t: float) -> str:
    """Unix seconds as a UTC date; a time the C library cannot convert is shown as it is."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))
    except (OverflowError, OSError, ValueError):
        return f"t={t!r} (not a date)"


# -- sections -----------------------------------------------------------------

def _header(report: dict, events: list[dict]) -> str:
    cfg = report.get("config") or {}
    mode = report.get("mode") or "unknown"
    slices = report.get("slices")
    dps = report.get("devices_per_slice")
    rl = report.get("rl") if isinstance(report.get("rl"), dict) else None
    where = ("one process (reference)" if mode == "reference" or slices == 0
             else f"{_count(slices, 'trainer slice' if rl else 'slice')} × {_count(dps, 'device')}")
    if rl is not None and mode != "reference" and slices != 0:   # the samplers are slices of their own
        sampler_devices = cfg.get("rl_sampler_devices")
        where += f" + {_count(rl.get('samplers'), 'sampler')}" + (
            f" × {_count(sampler_devices, 'device')}" if sampler_devices is not None else "")
    started = _date(first_time(events)) if events else "no events"
    parts = [f"mode <b>{esc(mode)}</b>", f"run name <b>{esc(cfg.get('run_name') or '?')}</b>", esc(where),
             f"{esc(report.get('steps_completed', 0))}/{esc(report.get('steps_requested'))} steps",
             esc(started)]
    if report.get("seed") is not None:
        parts.insert(3, f"seed {esc(report['seed'])}")
    attempts = report.get("attempts") or []
    if len(attempts) > 1:
        parts.insert(-1, f"{esc(len(attempts))} attempts")
    return (f"<h1>jax-elastic run <code style='font-size:20px'>{esc(report.get('run_id') or '?')}</code></h1>"
            f"<div class='sub'>{' · '.join(parts)}</div>")


def _count(n: object, word: str) -> str:
    """``n`` and ``word``, plural unless ``n`` is 1 ("?" for a count the report does not have)."""
    return f"{'?' if n is None else n} {word}{'' if n == 1 else 's'}"


def _banner(report: dict) -> str:
    verdict = report.get("verdict")
    reasons = report.get("verdict_reasons") or []
    if verdict in ("pass", "fail"):
        cls, title = verdict, ("PASS" if verdict == "pass" else "FAIL")
    elif not report.get("finished", False):
        cls, title = "fail", "Run did not finish"
        reasons = [report["failure_reason"]] if report.get("failure_reason") else reasons
    else:
        return ""
    items = "".join(f"<li>{esc(r)}</li>" for r in reasons)
    return f"<div class='banner {cls}' id='verdict'>{title}{f'<ul>{items}</ul>' if items else ''}</div>"


def _dropped(report: dict) -> str:
    n = report.get("events_dropped") or 0
    if not n:
        return ""
    return (f"<div class='banner warn' id='events-dropped'>{esc(n)} events dropped<ul><li>the event log could not "
            "be written (see the run's stderr); this report is incomplete</li></ul></div>")


def _security(report: dict) -> str:
    security = report.get("security") or {}
    calls, registrations = security.get("refused_calls") or 0, security.get("refused_registrations") or 0
    if not calls and not registrations:
        return ""
    rows = sorted((security.get("by_method") or {}).items(), key=lambda kv: (-kv[1], kv[0]))
    body = "".join(f"<tr><td><code>{esc(m)}</code></td><td class='num'>{esc(n)}</td></tr>" for m, n in rows)
    table = f"<table><tr><th>method</th><th class='num'>refused calls</th></tr>{body}</table>" if rows else ""
    return (f"<div class='card' id='security'><h2>Security</h2><p>{esc(calls)} unauthenticated calls refused by "
            f"workers; {esc(registrations)} registrations refused by the controller.</p>{table}</div>")


def _facts(report: dict, gp: dict) -> str:
    exactly = report.get("exactly_once")
    restores = f"{report.get('snapshot_restores') or 0} / {report.get('checkpoint_restores', 0)}"
    rows = [
        ("steps", f"{report.get('steps_completed', 0)} / {report.get('steps_requested', '—')}"),
        ("wall time", fmt_seconds(report.get("wall_seconds") if report.get("wall_seconds") is not None
                            else gp["wall_seconds"])),
        ("goodput", f"{100 * gp['goodput_fraction']:.1f} %"),
        ("failures", failures_text(report)),
        ("steps lost", str(report.get("steps_lost", 0))),
        ("snapshot / checkpoint restores", restores),
        ("exactly once", "—" if exactly is None else ("yes" if exactly else "NO")),
        ("trajectory", report.get("trajectory") or "—"),
        ("slices at end", "—" if report.get("slices_at_end") is None else str(report["slices_at_end"])),
        ("state bytes", _fmt_bytes(report.get("state_bytes"))),
        ("compile (slowest worker)", fmt_seconds(report.get("compile_seconds"))),
        ("step time (median)", fmt_seconds(report.get("step_seconds_median"))),
    ]
    resumed = resumed_text(report)
    if resumed:
        rows.append(("resumed from", resumed))
    attempts = report.get("attempts") or []
    if len(attempts) > 1:
        rows.append(("attempts", str(len(attempts))))
    cells = [f"<td>{esc(k)}</td><td>{esc(v)}</td>" for k, v in rows]
    body = "".join("<tr>" + "".join(cells[i:i + 3]) + "</tr>" for i in range(0, len(cells), 3))
    digest = report.get("final_state_digest")   # "<algorithm>:<hex>"
    body += (f"<tr><td>final state digest</td><td colspan='5'><code>{esc(digest or '— (not finished)')}</code>"
             "</td></tr>")
    return f"<div class='card'><h2>Key facts</h2><table class='facts'>{body}</table></div>"


def _legend(labels: list[str], released: bool = False) -> str:
    items = "".join(f"<span><span class='sw' style='background:{COLORS[lab]}'></span>{esc(lab)}</span>"
                    for lab in labels)
    marks = ("<span><span class='sw' style='background:#d32f2f'></span>fault injected</span>"
             "<span><span class='sw' style='background:#ef6c00'></span>failure detected</span>"
             "<span><span class='sw' style='background:#2e7d32'></span>recovered / grown</span>"
             + ("<span><span class='sw' style='background:#0277bd'></span>gave back to the pool</span>" if released
                else "") +
             "<span><span class='sw' style='background:#6a1b9a'></span>attempt / resume</span>")
    return f"<div class='legend'>{items}{marks}</div>"


def _attempt_marks(report: dict, events: list[dict]) -> list[dict]:
    """``events`` with each later attempt's ``job_started`` as an ``attempt_started`` marker (its number, how
    the one before ended, the gap), for the timeline."""
    later = iter((report.get("attempts") or [])[1:])
    out, seen = [], False
    for e in events:
        if e["kind"] == "job_started":
            if seen:
                a = next(later, {})
                e = {"t": e["t"], "kind": "attempt_started", "attempt": a.get("attempt"), "after": a.get("after"),
                     "gap_before_s": a.get("gap_before_s")}
            seen = True
        out.append(e)
    return out


def _squeeze(events: list[dict], ivs: list, gaps: list) -> tuple[list[dict], list]:
    """Events and intervals with each idle gap (a finished attempt, extended later) cut out of the time axis."""
    if not gaps:
        return events, ivs
    t0 = first_time(events)

    def shift(t: float) -> float:
        return t - sum(min(e, max(t, s)) - s for s, e in gaps)

    return ([{**e, "t": t0 + shift(float(e["t"]) - t0)} for e in events],
            [(shift(s), shift(e), lab) for s, e, lab in ivs])


def _timelines(report: dict, events: list[dict], ivs: list) -> str:
    if not events:
        return "<div class='card'><h2>Timeline</h2><p class='muted'>No events.</p></div>"
    events, ivs = _squeeze(_attempt_marks(report, events), ivs, idle_gaps(events))
    wall = ivs[-1][1] if ivs else 0.0
    slices = report.get("slices")
    max_slices = max(slices if finite(slices) else 0, 1)
    counts = slice_counts(events)   # (the run state's placement: folded once for both charts)
    out = ["<div class='card'><h2>Timeline: committed steps over wall time</h2>",
           timeline_svg(events, ivs, 0.0, wall, svg_id="timeline", max_slices=max_slices, slices=counts)]
    # Start-up and compile often dominate a short run: also show the training window alone.
    t0 = first_time(events)
    commits = [float(e["t"]) - t0 for e in events if e["kind"] == "step_committed"]
    if commits and wall > 0 and (wall - commits[0]) < 0.5 * wall:
        lo = max(0.0, commits[0] - 0.05 * (wall - commits[0]))
        out.append("<h2 style='margin-top:12px'>Training window</h2>")
        out.append(timeline_svg(events, ivs, lo, wall, svg_id="timeline-training", max_slices=max_slices,
                                slices=counts))
    present = [lab for lab in ("productive",) + BADPUT_LABELS if any(i[2] == lab for i in ivs)]
    out.append(_legend(present, released=any(e["kind"] == "released" for e in events)) + "</div>")
    return "".join(out)


def _loss_chart(report: dict) -> str:
    reference = report.get("reference")
    ref = reference.get("losses") if isinstance(reference, dict) else None
    ref = ref if isinstance(ref, list) else None   # the fold copies the verdict's reference verbatim
    fail_steps = [f.get("step") for f in report.get("failures") or [] if f.get("step") is not None]
    return loss_svg(report.get("losses") or [], ref, fail_steps, report.get("first_diverging_step"), svg_id="loss")


def _loss(report: dict) -> str:
    """The card beside goodput: the loss curve; for an RL run its reward curve instead (its loss is in the RL
    card: about 0 whatever the policy learns)."""
    rl = report.get("rl")
    if isinstance(rl, dict):
        return _reward(report, rl)
    return f"<div class='card'><h2>Loss</h2>{_loss_chart(report)}</div>"


def _reward(report: dict, rl: dict) -> str:
    """An RL run's mean reward per step, each step's weights version under it, faults marked."""
    steps = [s for s in rl.get("steps") or [] if isinstance(s, dict)]
    fail_steps = [f.get("step") for f in report.get("failures") or [] if isinstance(f, dict)]
    sampler_steps = [f.get("step") for f in report.get("faults") or [] if isinstance(f, dict)
                     and f.get("path") == "reassign"]
    return (f"<div class='card' id='reward-card'><h2>Reward</h2><div class='sub'>Mean reward per step; under each "
            f"step the weights version its rollouts were made with (hover a point for its own)</div>"
            f"{reward_svg(steps, fail_steps, sampler_steps, svg_id='reward')}</div>")


def _goodput(gp: dict) -> str:
    parts = [("productive", gp["productive_seconds"])] + [(k, v) for k, v in gp["badput_seconds"].items()]
    wall = gp["wall_seconds"]
    rows = "".join(
        f"<tr><td><span class='sw' style='background:{COLORS[k]}'></span>{esc(k)}</td>"
        f"<td class='num'>{v:.2f}</td><td class='num'>{(100 * v / wall if wall > 0 else 0):.1f}</td></tr>"
        for k, v in parts if v > 0)
    zero = [k for k, v in parts if v <= 0]
    if zero:
        rows += (f"<tr class='muted'><td colspan='3'>0 s: {esc(', '.join(zero))}</td></tr>")
    return (f"<div class='card'><h2>Goodput</h2><div><span class='big'>{100 * gp['goodput_fraction']:.1f}%</span>"
            f" <span class='muted'>productive of {wall:.2f} s wall</span></div>{bar_svg(parts, wall)}"
            f"<table><tr><th>label</th><th class='num'>seconds</th><th class='num'>%</th></tr>{rows}</table></div>")


class _Markup(str):
    """A table cell that is HTML already (built from escaped parts), not text to escape."""


def _stacks_links(stacks: dict) -> _Markup | str:
    """Links to the stacks files kept of a failure's workers (paths relative to the run directory, where the
    page lies); "—" when none was kept."""
    return _Markup(", ".join(f"<a href='{esc(path)}'>{esc(w)}</a>" for w, path in sorted(stacks.items()))) \
        if stacks else "—"


def _table(title: str, headers: list[str], rows: list[list[object]], empty: str) -> str:
    if not rows:
        return f"<div class='card'><h2>{esc(title)}</h2><p class='muted'>{esc(empty)}</p></div>"
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c if isinstance(c, _Markup) else esc(c)}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<div class='card'><h2>{esc(title)}</h2><table><tr>{head}</tr>{body}</table></div>"


def _failures(report: dict) -> str:
    rows = [[i, f.get("kind", "—"), f.get("error", ""), ", ".join(f.get("workers") or []) or "—", f.get("step"),
             fmt_seconds(f.get("detected_at")), fmt_seconds(f.get("detected_after_s")), fmt_seconds(f.get("recovered_after_s")),
             f.get("path") or "—", _fmt_bytes(f.get("bytes_moved")), f.get("resume_step", "—"),
             _stacks_links(f.get("stacks") or {})]
            for i, f in enumerate(report.get("failures") or [])]
    return _table("Failures", ["#", "kind", "error", "workers", "at step", "detected at", "detected after",
                               "recovered after", "path", "bytes moved", "resumed at", "stacks"], rows, "No failures.")


def _attempts(report: dict) -> str:
    attempts = report.get("attempts") or []
    if len(attempts) < 2:
        return ""
    rows = []
    for a in attempts:
        start = a.get("started_from") or {}
        rows.append([a.get("attempt"), a.get("after") or "—", fmt_seconds(a.get("gap_before_s")),
                     fmt_seconds(a.get("started_at")),
                     f"{start.get('tier') or 'unrecorded'} step {start.get('step')}" if start else "—",
                     a.get("steps_committed"), a.get("steps_recomputed"), a.get("end"),
                     a.get("failure_reason") or "—"])
    return _table("Attempts", ["#", "after", "gap before", "started at", "started from", "steps committed",
                               "steps recomputed", "end", "why it ended"], rows, "")


def _faults(report: dict) -> str:
    faults = report.get("faults") or []
    rows = [[f.get("index"), f.get("spec"), f.get("kind"), ", ".join(f.get("workers") or []) or "—",
             fmt_seconds(f.get("injected_at")), f.get("step", "—"), fmt_seconds(f.get("detected_after_s")),
             fmt_seconds(f.get("recovered_after_s")), f.get("path") or "—", _fmt_bytes(f.get("bytes_moved")),
             f.get("skipped") or "—"] for f in faults]
    chaos = report.get("chaos")
    title = "Injected faults" + (f" (chaos seed {chaos.get('seed')})" if chaos else "")
    return _table(title, ["#", "spec", "kind", "workers", "injected at", "at step", "detected after",
                          "recovered after", "path", "bytes moved", "skipped"], rows, "No faults injected.")


def _pipeline(report: dict) -> str:
    """A pipelined run: its bubble, measured against the theory, and a bar of each stage's phase medians."""
    pl = report.get("pipeline")
    if not isinstance(pl, dict):
        return ""
    stages = pl.get("stage_phases_median") if isinstance(pl.get("stage_phases_median"), dict) else {}
    order = {name: i for i, name in enumerate(PHASE_COLORS)}   # computing first, then waiting, reducing, updating
    rows = {k: sorted(((name, v) for name, v in phases.items() if finite(v) and v > 0),
                      key=lambda nv: (order.get(nv[0], len(order)), nv[0]))
            for k, phases in stages.items() if isinstance(phases, dict)}
    longest = max((sum(v for _, v in parts) for parts in rows.values()), default=0.0)
    body = "".join(f"<tr><td class='nw'>stage {esc(k)}</td>"
                   f"<td class='num nw'>{fmt_seconds(sum(v for _, v in parts))}</td>"
                   f"<td style='width:60%'>{bar_svg(parts, longest, color=phase_color, what=f'stage {k} phases')}</td>"
                   f"<td>{esc(', '.join(f'{n} {fmt_seconds(v)}' for n, v in parts))}</td></tr>"
                   for k, parts in rows.items())
    names = list(dict.fromkeys(name for parts in rows.values() for name, _ in parts))
    legend = "".join(f"<span><span class='sw' style='background:{phase_color(n)}'></span>{esc(n)}</span>"
                     for n in names)
    table = (f"<table><tr><th>stage</th><th class='num'>total</th><th>phases (median seconds of its slowest "
             f"replica)</th><th></th></tr>{body}</table><div class='legend'>{legend}</div>" if body else
             "<p class='muted'>No step recorded its stages' phases (a run in one process).</p>")
    return f"<div class='card' id='pipeline'><h2>Pipeline</h2><p>{esc(bubble_text(pl))}</p>{table}</div>"


def _rl(report: dict) -> str:
    """An RL run (the ``rl`` section): the mean reward per step with each step's weights version, and a table of
    the samplers, the weight syncs, the rollouts and the two roles' time; absent for a run that is not RL."""
    rl = report.get("rl")
    if not isinstance(rl, dict):
        return ""

    def secs(x: object) -> str:
        return fmt_seconds(x) if finite(x) else "—"

    def num(x: object, fmt: str = ".3f") -> str:
        return format(x, fmt) if finite(x) else "—"

    failed = [str(x) for x in rl.get("weight_sync_sources_failed") or []]
    distinct = list(dict.fromkeys(failed))
    passed_over = _Markup(esc(len(failed)) + "".join(
        f"<span class='note'>{esc(why)}" + (f" (×{failed.count(why)})" if failed.count(why) > 1 else "") + "</span>"
        for why in distinct[:3]) + (f"<span class='note'>… {len(distinct) - 3} more</span>" if len(distinct) > 3
                                    else ""))
    overlap = rl.get("overlap")
    kl = (" plus the KL penalty (rl_kl_coef)" if finite((report.get("config") or {}).get("rl_kl_coef"))
          and (report.get("config") or {}).get("rl_kl_coef") > 0 else "")
    rows = [
        ("samplers", rl.get("samplers") if rl.get("samplers") is not None else "—"),
        ("rl_off_policy_steps", rl.get("off_policy_steps") if rl.get("off_policy_steps") is not None else "—"),
        ("reward (first 3 → last 3 steps)", f"{num(rl.get('reward_first'))} → {num(rl.get('reward_last'))}"),
        ("weight syncs", f"{rl.get('weight_syncs')} ({_fmt_bytes(rl.get('weight_sync_bytes'))}; median "
                         f"{secs(rl.get('weight_sync_seconds_median'))}, total {secs(rl.get('weight_sync_seconds'))})"
                         if rl.get("weight_syncs") else "0"),
        ("sources passed over", passed_over),
        ("rollout bytes", _fmt_bytes(rl.get("rollout_bytes"))),
        ("steady steps (measured below)", rl.get("steady_steps") if rl.get("steady_steps") is not None else "—"),
        ("sampler seconds", secs(rl.get("sampler_seconds"))),
        ("trainer seconds", secs(rl.get("trainer_seconds"))),
        ("span (commit to commit)", secs(rl.get("span_seconds"))),
        ("sequential (sampler + trainer)", secs(rl.get("sequential_seconds"))),
        ("overlap (1 - span / sequential)", f"{100 * overlap:.1f} %" if finite(overlap) else "—"),
        ("samplers lost / relaunched", f"{rl.get('samplers_lost', 0)} / {rl.get('samplers_relaunched', 0)}"),
    ]
    body = "".join(f"<tr><td>{esc(k)}</td><td>{v if isinstance(v, _Markup) else esc(v)}</td></tr>" for k, v in rows)
    return (f"<div class='card' id='rl'><h2>RL post-training</h2><div class='split'><div>"
            f"<div class='sub'>The trainers' loss: the clipped policy-gradient loss, about 0 whatever the policy "
            f"learns (the advantages are zero-mean within each prompt's group){kl}; the reward above is what "
            f"training improves</div>{_loss_chart(report)}</div><table class='kv'>{body}</table></div></div>")


#: At most this many entries of a pool run's lease timeline are listed (a long wait in the queue adds one a move).
_POOL_TIMELINE_SHOWN = 100


def _pool(report: dict) -> str:
    """A run leased from a shared pool (the ``pool`` section): its address, priority and time in the queue, its
    leases and the lease timeline; absent for a run that is not a pool's."""
    pool = report.get("pool")
    if not isinstance(pool, dict):
        return ""

    def secs(x: object) -> str:
        return fmt_seconds(x) if finite(x) else "—"

    leases = [x for x in pool.get("leases") or [] if isinstance(x, dict)]
    timeline = [x for x in pool.get("timeline") or [] if isinstance(x, dict)]
    preemptions = [x for x in pool.get("preemptions") or [] if isinstance(x, dict)]
    rows = [
        ("address", pool.get("address") or "—"),
        ("priority", pool.get("priority") if pool.get("priority") is not None else "—"),
        ("time in queue", secs(pool.get("queue_seconds"))),
        ("leases", pool_text(pool)),
        ("preemptions (hosts asked back)", f"{len(preemptions)} ("
         f"{sum(p.get('count') for p in preemptions if finite(p.get('count')))})" if preemptions else "0"),
        ("hosts held (most / at end)", f"{pool.get('hosts_max', '—')} / {pool.get('hosts_at_end', '—')}"),
    ]
    facts = "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in rows)
    items = "".join(f"<li><span class='nw'>{secs(x.get('t'))}</span> <b>{esc(x.get('kind'))}</b> "
                    f"{esc(x.get('detail'))}</li>" for x in timeline[:_POOL_TIMELINE_SHOWN])
    if len(timeline) > _POOL_TIMELINE_SHOWN:
        items += f"<li class='muted'>… {len(timeline) - _POOL_TIMELINE_SHOWN} more (report.json has them all)</li>"
    listing = (f"<ul class='events' id='pool-timeline'>{items}</ul>" if items
               else "<p class='muted'>No lease events.</p>")
    head = "".join(f"<th>{h}</th>" for h in ("worker", "host", "lease", "granted at", "returned at", "why"))
    body = "".join(f"<tr><td>{esc(x.get('worker'))}</td><td><code>{esc(x.get('host'))}</code></td>"
                   f"<td><code>{esc(x.get('lease'))}</code></td><td class='nw'>{secs(x.get('granted_t'))}</td>"
                   f"<td class='nw'>{secs(x.get('returned_t'))}</td><td>{esc(x.get('why') or '—')}</td></tr>"
                   for x in leases)
    table = (f"<table id='pool-leases'><tr>{head}</tr>{body}</table>" if body
             else "<p class='muted'>No host was leased.</p>")
    return (f"<div class='card' id='pool'><h2>Shared pool</h2><div class='split'><table class='kv'>{facts}</table>"
            f"<div><div class='sub'>Lease timeline (seconds since the run's first event)</div>{listing}</div></div>"
            f"<h2 style='margin-top:12px'>Leases</h2>{table}</div>")


def _stragglers(report: dict) -> str:
    rows = [[s.get("worker"), s.get("step"), fmt_seconds(s.get("seconds")), fmt_seconds(s.get("median_seconds")),
             s.get("action"), _stacks_links({s["worker"]: s["stacks"]} if s.get("stacks") else {})]
            for s in report.get("stragglers") or []]
    return _table("Stragglers", ["worker", "step", "step time", "median", "action", "stacks"], rows, "No stragglers.") \
        if rows else ""


def _evals(report: dict) -> str:
    """The held-out loss per eval (``evals``): a table, absent for a run without eval."""
    rows = [[e.get("step"), "—" if e.get("loss") is None else f"{e['loss']:.6g}", e.get("batches", "—"),
             fmt_seconds(e.get("seconds")), e.get("skipped") or (f"owed, computed before step {e['before_step']}"
                                                                 if "before_step" in e else "")]
            for e in report.get("evals") or []]
    return _table("Eval", ["after step", "loss", "microbatches", "seconds", "note"], rows, "") if rows else ""


# -- public -------------------------------------------------------------------

def render_html(report: dict, events: list[dict]) -> str:
    """The whole page for one run, as a string; pure (no I/O, no clock).

    ``report`` is ``report.json`` as a dict, ``events`` the parsed
    ``events.jsonl``. Goodput comes from ``report["goodput"]`` when present,
    else it is computed from ``events``.
    """
    events = sorted(events, key=lambda e: e["t"])
    ivs = intervals(events)
    gp = report.get("goodput") or compute_goodput(events)
    body = "".join([
        _header(report, events), _banner(report), _dropped(report), _facts(report, gp),
        _timelines(report, events, ivs), f"<div class='row'>{_loss(report)}{_goodput(gp)}</div>", _evals(report),
        _pipeline(report), _rl(report), _pool(report),
        _attempts(report), _failures(report), _faults(report), _stragglers(report), _security(report),
    ])
    title = f"jax-elastic run {report.get('run_id') or ''}"
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{esc(title)}</title>"
            f"<style>{_CSS}</style></head><body><main>{body}</main></body></html>\n")


def write_html(run_dir: str | os.PathLike, report: dict, events: list[dict]) -> pathlib.Path:
    """Writes ``run_dir/report.html`` atomically (temp file + ``os.replace``); returns its path."""
    path = pathlib.Path(run_dir) / "report.html"
    tmp = path.with_suffix(".html.tmp")
    try:
        tmp.write_text(render_html(report, events), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)   # a full disk leaves no half-written temp file behind
        e.filename = e.filename or str(path)   # a failed write() names no file: say which one was lost
        raise
    return path
