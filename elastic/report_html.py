"""``report.html``: one self-contained page showing a run at a glance.

:func:`render_html` is a pure function of ``report.json`` and
``events.jsonl``: inline CSS and inline SVG drawn here, no JavaScript, no
network, no external fonts or images, every piece of text escaped. It
tolerates fields missing from older reports (``.get`` with defaults), runs
with no failures, reference-mode runs (0 slices) and unfinished runs.

:func:`chromium_screenshot` and :func:`chromium_dom` drive Debian's headless
chromium on a rendered page (used by ``scripts/screenshot.py`` and tests).
"""

from __future__ import annotations

import html
import os
import pathlib
import shutil
import subprocess
import tempfile
import time

import math

from elastic.goodput import BADPUT_LABELS, goodput as compute_goodput, intervals

__all__ = ["CHROMIUM", "ChromiumError", "chromium_dom", "chromium_screenshot", "render_html", "write_html"]

#: Where Debian's ``chromium`` package installs the browser.
CHROMIUM = "/usr/bin/chromium"

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
.big{font-size:28px;font-weight:bold} .muted{color:#8a919c}
svg text{font-family:"DejaVu Sans","Liberation Sans",Arial,sans-serif}
"""


def _esc(x: object) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _t0(events: list[dict]) -> float:
    return min(float(e["t"]) for e in events) if events else 0.0


#: Fill colour of each goodput label (bands, bar, legend).
_COLORS = {"productive": "#43a047", "startup": "#1e88e5", "compile": "#8e24aa", "data": "#00897b",
          "checkpoint_save": "#6d4c41", "checkpoint_restore": "#a1887f", "detection": "#fb8c00",
          "recovery": "#fdd835", "wasted_progress": "#e53935", "other": "#9e9e9e"}
_MARKERS = {"fault_injected": "#d32f2f", "failure_detected": "#ef6c00", "recovered": "#2e7d32", "grown": "#2e7d32"}


def _fmt_s(x: float | None) -> str:
    """Seconds for people: ``—`` for None, ms below one second."""
    if x is None:
        return "—"
    return f"{1000 * x:.0f} ms" if abs(x) < 1 else f"{x:.2f} s"


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "—"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _ticks(lo: float, hi: float, n: int = 8, integer: bool = False) -> list[float]:
    """Round tick values covering [lo, hi], about ``n`` of them (whole numbers only if ``integer``)."""
    if hi <= lo:
        return [lo]
    raw = max((hi - lo) / n, 1.0) if integer else (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in ((1, 2, 5, 10) if integer else (1, 2, 2.5, 5, 10)) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _tick_label(v: float) -> str:
    return f"{v:.0f}" if abs(v - round(v)) < 1e-9 else f"{v:g}"


def _text(x: float, y: float, s: object, size: int = 11, anchor: str = "start", fill: str = "#444",
          extra: str = "") -> str:
    return (f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' text-anchor='{anchor}' fill='{fill}' {extra}>"
            f"{_esc(s)}</text>")


def _marker_label(e: dict) -> str:
    kind = e["kind"]
    if kind == "fault_injected":
        what = str(e.get("fault_kind") or e.get("fault") or "")
        return f"fault #{e.get('index', '?')} {what[:28]}".strip()
    if kind == "failure_detected":
        return f"detected: {e.get('worker') or e.get('error', '')}"
    if kind == "recovered":
        return f"recovered: {e.get('path', '')}"
    return f"grown to {len(e.get('active') or [])}"


def _timeline_svg(events: list[dict], ivs: list, lo: float, hi: float, *, svg_id: str, max_slices: int) -> str:
    """Steps committed over wall time in [lo, hi] s, goodput bands, fault markers and a slices lane."""
    t0 = _t0(events)
    labelled = any(e["kind"] in _MARKERS and lo <= float(e["t"]) - t0 <= hi for e in events)
    W, L, R, top, ph, rib, gap, sh, bot = 1200, 58, 18, 50 if labelled else 16, 170, 10, 14, 50, 30
    H = top + ph + rib + gap + sh + bot
    span = max(hi - lo, 1e-9)

    def x(t: float) -> float:
        return L + (min(max(t, lo), hi) - lo) / span * (W - L - R)

    commits, seen = [], 0
    for e in events:
        if e["kind"] == "step_committed" and int(e.get("step", seen)) >= seen:
            seen = int(e.get("step", seen)) + 1
            commits.append((float(e["t"]) - t0, seen, bool(e.get("recovered"))))
    ymax = max(seen, 1)

    def y(n: float) -> float:
        return top + ph - n / ymax * ph

    out = [f"<svg id='{svg_id}' viewBox='0 0 {W} {H}' width='100%' role='img' "
           f"aria-label='committed steps over wall time'>"]
    for s, e, lab in ivs:
        if e <= lo or s >= hi:
            continue
        out.append(f"<rect x='{x(s):.1f}' y='{top}' width='{max(x(e) - x(s), 0.5):.1f}' height='{ph}' "
                   f"fill='{_COLORS[lab]}' fill-opacity='0.13'><title>{_esc(lab)} {_esc(_fmt_s(e - s))}</title></rect>")
        out.append(f"<rect x='{x(s):.1f}' y='{top + ph}' width='{max(x(e) - x(s), 0.5):.1f}' height='{rib}' "
                   f"fill='{_COLORS[lab]}'/>")
    for v in _ticks(0, ymax, 5, integer=True):
        out.append(f"<line x1='{L}' x2='{W - R}' y1='{y(v):.1f}' y2='{y(v):.1f}' stroke='#e3e6ea'/>")
        out.append(_text(L - 6, y(v) + 4, _tick_label(v), anchor="end"))
    ybase = top + ph + rib + gap + sh
    for v in _ticks(lo, hi, 10):
        out.append(f"<line x1='{x(v):.1f}' x2='{x(v):.1f}' y1='{ybase}' y2='{ybase + 4}' stroke='#888'/>")
        out.append(_text(x(v), ybase + 17, _tick_label(v), anchor="middle"))
    out.append(_text(W - R, H - 2, "seconds since run start", anchor="end", fill="#777"))
    out.append(_text(14, top + ph / 2, "steps committed", anchor="middle",
                     extra=f"transform='rotate(-90 14 {top + ph / 2})'"))
    # the committed-steps staircase
    before = [c for c in commits if c[0] < lo]
    n = before[-1][1] if before else 0
    path = [f"M{x(lo):.1f},{y(n):.1f}"]
    for t, count, _ in commits:
        if lo <= t <= hi:
            path.append(f"H{x(t):.1f}V{y(count):.1f}")
    path.append(f"H{x(min(hi, ivs[-1][1] if ivs else hi)):.1f}")
    out.append(f"<path d='{''.join(path)}' fill='none' stroke='#1a237e' stroke-width='2'/>")
    shown = [c for c in commits if lo <= c[0] <= hi]
    if len(shown) <= 300:
        out += [f"<circle cx='{x(t):.1f}' cy='{y(c):.1f}' r='{3.2 if rec else 2.2}' "
                f"fill='{'#2e7d32' if rec else '#1a237e'}'/>" for t, c, rec in shown]
    # the active-slices lane
    lane_top = top + ph + rib + gap
    smax = max(max_slices, *(len(e.get("active") or []) for e in events
                             if e["kind"] in ("placement", "recovery_decision", "grown")), 1)
    out.append(f"<rect x='{L}' y='{lane_top}' width='{W - L - R}' height='{sh}' fill='#f7f9fb' stroke='#e3e6ea'/>")
    out.append(_text(L - 6, lane_top + sh / 2 + 4, "slices", anchor="end"))
    changes = [(float(e["t"]) - t0, len(e.get("active") or [])) for e in events
               if e["kind"] in ("placement", "recovery_decision", "grown")]
    if changes:
        ys = lambda k: lane_top + sh - 4 - k / smax * (sh - 14)  # noqa: E731
        cur = 0
        pts = [f"{x(lo):.1f},{ys(0):.1f}"]
        for t, k in changes:
            if t > lo:
                pts.append(f"{x(t):.1f},{ys(cur):.1f}")
            pts.append(f"{x(t):.1f},{ys(k):.1f}")
            if lo <= t <= hi:
                out.append(_text(x(t) + 3, ys(k) - 3, k, size=10, fill="#0d47a1"))
            cur = k
        end = x(ivs[-1][1] if ivs else hi)
        pts += [f"{end:.1f},{ys(cur):.1f}", f"{end:.1f},{ys(0):.1f}"]
        out.append(f"<polygon points='{' '.join(pts)}' fill='#90caf9' fill-opacity='0.6' stroke='#1565c0'/>")
    else:
        out.append(_text(L + 8, lane_top + sh / 2 + 4, "no slices (reference mode: one process)", fill="#777"))
    # markers: faults, detections, recoveries; labels in three rows, dropped where they would overlap
    row_end = [-1e9, -1e9, -1e9]
    for e in events:
        color = _MARKERS.get(e["kind"])
        t = float(e["t"]) - t0
        if color is None or not lo <= t <= hi:
            continue
        xm = x(t)
        out.append(f"<line x1='{xm:.1f}' x2='{xm:.1f}' y1='{top - 6}' y2='{lane_top + sh}' stroke='{color}' "
                   f"stroke-width='1.6' stroke-dasharray='5 3'><title>{_esc(_marker_label(e))}</title></line>")
        label = _marker_label(e)
        width = 6.2 * len(label)
        row = next((r for r in range(3) if row_end[r] < xm - 2), None)
        if row is not None:
            anchor, lx = ("end", xm - 3) if xm + width > W - R else ("start", xm + 3)
            out.append(_text(lx, 14 + 14 * row, label, size=11, anchor=anchor, fill=color,
                             extra="font-weight='bold'"))
            row_end[row] = xm + width + 6 if anchor == "start" else xm + 3
    out.append("</svg>")
    return "".join(out)


def _loss_svg(losses: list[float], ref: list[float] | None, fail_steps: list[int], diverge: int | None, *,
              svg_id: str) -> str:
    """Loss per committed step, with the reference run's losses dashed when present."""
    W, H, L, R, T, B = 580, 270, 52, 12, 12, 40
    series = [v for v in list(losses) + list(ref or []) if isinstance(v, (int, float)) and math.isfinite(v)]
    if not series:
        return f"<svg id='{svg_id}' viewBox='0 0 {W} 60' width='100%'>{_text(10, 30, 'no committed steps')}</svg>"
    n = max(len(losses), len(ref or []), 2)
    lo, hi = min(series), max(series)
    pad = (hi - lo) * 0.08 or 0.5
    lo, hi = lo - pad, hi + pad

    def x(i: float) -> float:
        return L + i / (n - 1) * (W - L - R)

    def y(v: float) -> float:
        return T + (hi - v) / (hi - lo) * (H - T - B)

    out = [f"<svg id='{svg_id}' viewBox='0 0 {W} {H}' width='100%' role='img' aria-label='loss per step'>"]
    for v in _ticks(lo, hi, 5):
        out.append(f"<line x1='{L}' x2='{W - R}' y1='{y(v):.1f}' y2='{y(v):.1f}' stroke='#e3e6ea'/>")
        out.append(_text(L - 6, y(v) + 4, f"{v:.3g}", anchor="end"))
    for v in _ticks(0, n - 1, 8, integer=True):
        out.append(_text(x(v), H - B + 16, _tick_label(v), anchor="middle"))
    out.append(_text(W - R, H - 4, "step", anchor="end", fill="#777"))
    for s in fail_steps:
        out.append(f"<line x1='{x(s):.1f}' x2='{x(s):.1f}' y1='{T}' y2='{H - B}' stroke='#ef6c00' "
                   f"stroke-dasharray='4 3'><title>failure at step {_esc(s)}</title></line>")
    if diverge is not None:
        out.append(f"<line x1='{x(diverge):.1f}' x2='{x(diverge):.1f}' y1='{T}' y2='{H - B}' stroke='#c62828' "
                   f"stroke-width='2'/>" + _text(x(diverge) + 4, T + 12, f"diverged at {diverge}", fill="#c62828"))

    def line(vals: list[float], style: str) -> str:
        pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(vals)
                       if isinstance(v, (int, float)) and math.isfinite(v))
        return f"<polyline points='{pts}' fill='none' {style}/>"

    if ref:
        out.append(line(ref, "stroke='#9e9e9e' stroke-width='4' stroke-opacity='0.6'"))
    out.append(line(losses, "stroke='#1a237e' stroke-width='1.6'"))
    legend = ([("#1a237e", "this run")] + ([("#9e9e9e", "reference")] if ref else [])
              + ([("#ef6c00", "failure")] if fail_steps else []))
    for i, (c, name) in enumerate(legend):
        lx = W - R - 90 * len(legend) + i * 90
        out.append(f"<rect x='{lx}' y='{T + 2}' width='14' height='4' fill='{c}'/>" + _text(lx + 18, T + 8, name))
    out.append("</svg>")
    return "".join(out)


def _bar_svg(parts: list[tuple[str, float]], wall: float) -> str:
    """One horizontal bar split by goodput label, widths proportional to seconds."""
    W, H = 580, 34
    out = [f"<svg viewBox='0 0 {W} {H + 6}' width='100%' role='img' aria-label='goodput breakdown'>",
           f"<rect x='0' y='3' width='{W}' height='{H}' fill='#eceef1' rx='4'/>"]
    xpos = 0.0
    for lab, v in parts:
        w = v / wall * W if wall > 0 else 0.0
        if w <= 0:
            continue
        out.append(f"<rect x='{xpos:.1f}' y='3' width='{w:.1f}' height='{H}' fill='{_COLORS[lab]}'>"
                   f"<title>{_esc(lab)} {v:.2f} s</title></rect>")
        if w > 42:
            out.append(_text(xpos + w / 2, H / 2 + 7, f"{100 * v / wall:.0f}%", size=12, anchor="middle",
                             fill="#fff" if lab not in ("recovery", "other") else "#222"))
        xpos += w
    out.append("</svg>")
    return "".join(out)


# -- sections -----------------------------------------------------------------

def _header(report: dict, events: list[dict]) -> str:
    cfg = report.get("config") or {}
    mode = report.get("mode") or "unknown"
    slices = report.get("slices")
    dps = report.get("devices_per_slice")
    where = "one process (reference)" if mode == "reference" or slices == 0 else f"{slices} slices × {dps} devices"
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(_t0(events))) if events else "no events"
    parts = [f"mode <b>{_esc(mode)}</b>", f"config <b>{_esc(cfg.get('run_name', '?'))}</b>", _esc(where),
             f"{_esc(report.get('steps_completed', 0))}/{_esc(report.get('steps_requested'))} steps",
             _esc(started)]
    if report.get("seed") is not None:
        parts.insert(3, f"seed {_esc(report['seed'])}")
    return (f"<h1>jax-elastic run <code style='font-size:20px'>{_esc(report.get('run_id') or '?')}</code></h1>"
            f"<div class='sub'>{' · '.join(parts)}</div>")


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
    items = "".join(f"<li>{_esc(r)}</li>" for r in reasons)
    return f"<div class='banner {cls}' id='verdict'>{title}{f'<ul>{items}</ul>' if items else ''}</div>"


def _facts(report: dict, gp: dict) -> str:
    exactly = report.get("exactly_once")
    restores = report.get("checkpoint_restores", 0)
    rows = [
        ("steps", f"{report.get('steps_completed', 0)} / {report.get('steps_requested', '—')}"),
        ("wall time", _fmt_s(report.get("wall_seconds") if report.get("wall_seconds") is not None
                            else gp["wall_seconds"])),
        ("goodput", f"{100 * gp['goodput_fraction']:.1f} %"),
        ("failures", str(len(report.get("failures") or []))),
        ("steps lost", str(report.get("steps_lost", 0))),
        ("checkpoint restores", str(restores)),
        ("exactly once", "—" if exactly is None else ("yes" if exactly else "NO")),
        ("trajectory", report.get("trajectory") or "—"),
        ("slices at end", "—" if report.get("slices_at_end") is None else str(report["slices_at_end"])),
        ("state bytes", _fmt_bytes(report.get("state_bytes"))),
        ("compile (slowest worker)", _fmt_s(report.get("compile_seconds"))),
        ("step time (median)", _fmt_s(report.get("step_seconds_median"))),
    ]
    cells = [f"<td>{_esc(k)}</td><td>{_esc(v)}</td>" for k, v in rows]
    body = "".join("<tr>" + "".join(cells[i:i + 3]) + "</tr>" for i in range(0, len(cells), 3))
    sha = report.get("final_state_sha256")
    body += (f"<tr><td>final state sha256</td><td colspan='5'><code>{_esc(sha or '— (not finished)')}</code>"
             "</td></tr>")
    return f"<div class='card'><h2>Key facts</h2><table class='facts'>{body}</table></div>"


def _legend(labels: list[str]) -> str:
    items = "".join(f"<span><span class='sw' style='background:{_COLORS[lab]}'></span>{_esc(lab)}</span>"
                    for lab in labels)
    marks = ("<span><span class='sw' style='background:#d32f2f'></span>fault injected</span>"
             "<span><span class='sw' style='background:#ef6c00'></span>failure detected</span>"
             "<span><span class='sw' style='background:#2e7d32'></span>recovered / grown</span>")
    return f"<div class='legend'>{items}{marks}</div>"


def _timelines(report: dict, events: list[dict], ivs: list) -> str:
    if not events:
        return "<div class='card'><h2>Timeline</h2><p class='muted'>No events.</p></div>"
    wall = ivs[-1][1] if ivs else 0.0
    max_slices = max(int(report.get("slices") or 0), 1)
    out = ["<div class='card'><h2>Timeline: committed steps over wall time</h2>",
           _timeline_svg(events, ivs, 0.0, wall, svg_id="timeline", max_slices=max_slices)]
    # Start-up and compile often dominate a short run: also show the training window alone.
    t0 = _t0(events)
    commits = [float(e["t"]) - t0 for e in events if e["kind"] == "step_committed"]
    if commits and wall > 0 and (wall - commits[0]) < 0.5 * wall:
        lo = max(0.0, commits[0] - 0.05 * (wall - commits[0]))
        out.append("<h2 style='margin-top:12px'>Training window</h2>")
        out.append(_timeline_svg(events, ivs, lo, wall, svg_id="timeline-training", max_slices=max_slices))
    present = [lab for lab in ("productive",) + BADPUT_LABELS if any(i[2] == lab for i in ivs)]
    out.append(_legend(present) + "</div>")
    return "".join(out)


def _loss(report: dict) -> str:
    ref = (report.get("reference") or {}).get("losses")
    fail_steps = [f.get("step") for f in report.get("failures") or [] if f.get("step") is not None]
    svg = _loss_svg(report.get("losses") or [], ref, fail_steps, report.get("first_diverging_step"),
                          svg_id="loss")
    return f"<div class='card'><h2>Loss</h2>{svg}</div>"


def _goodput(gp: dict) -> str:
    parts = [("productive", gp["productive_seconds"])] + [(k, v) for k, v in gp["badput_seconds"].items()]
    wall = gp["wall_seconds"]
    rows = "".join(
        f"<tr><td><span class='sw' style='background:{_COLORS[k]}'></span>{_esc(k)}</td>"
        f"<td class='num'>{v:.2f}</td><td class='num'>{(100 * v / wall if wall > 0 else 0):.1f}</td></tr>"
        for k, v in parts if v > 0)
    zero = [k for k, v in parts if v <= 0]
    if zero:
        rows += (f"<tr class='muted'><td colspan='3'>0 s: {_esc(', '.join(zero))}</td></tr>")
    return (f"<div class='card'><h2>Goodput</h2><div><span class='big'>{100 * gp['goodput_fraction']:.1f}%</span>"
            f" <span class='muted'>productive of {wall:.2f} s wall</span></div>{_bar_svg(parts, wall)}"
            f"<table><tr><th>label</th><th class='num'>seconds</th><th class='num'>%</th></tr>{rows}</table></div>")


def _table(title: str, headers: list[str], rows: list[list[object]], empty: str) -> str:
    if not rows:
        return f"<div class='card'><h2>{_esc(title)}</h2><p class='muted'>{_esc(empty)}</p></div>"
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<div class='card'><h2>{_esc(title)}</h2><table><tr>{head}</tr>{body}</table></div>"


def _failures(report: dict) -> str:
    rows = [[i, f.get("kind", "—"), f.get("error", ""), ", ".join(f.get("workers") or []) or "—", f.get("step"),
             _fmt_s(f.get("detected_at")), _fmt_s(f.get("detected_after_s")), _fmt_s(f.get("recovered_after_s")),
             f.get("path") or "—", _fmt_bytes(f.get("bytes_moved")), f.get("resume_step", "—")]
            for i, f in enumerate(report.get("failures") or [])]
    return _table("Failures", ["#", "kind", "error", "workers", "at step", "detected at", "detected after",
                               "recovered after", "path", "bytes moved", "resumed at"], rows, "No failures.")


def _faults(report: dict) -> str:
    faults = report.get("faults") or []
    rows = [[f.get("index"), f.get("spec"), f.get("kind"), ", ".join(f.get("workers") or []) or "—",
             _fmt_s(f.get("injected_at")), f.get("step", "—"), _fmt_s(f.get("detected_after_s")),
             _fmt_s(f.get("recovered_after_s")), f.get("path") or "—", _fmt_bytes(f.get("bytes_moved")),
             f.get("skipped") or "—"] for f in faults]
    chaos = report.get("chaos")
    title = "Injected faults" + (f" (chaos seed {chaos.get('seed')})" if chaos else "")
    return _table(title, ["#", "spec", "kind", "workers", "injected at", "at step", "detected after",
                          "recovered after", "path", "bytes moved", "skipped"], rows, "No faults injected.")


def _stragglers(report: dict) -> str:
    rows = [[s.get("worker"), s.get("step"), _fmt_s(s.get("seconds")), _fmt_s(s.get("median_seconds")),
             s.get("action")] for s in report.get("stragglers") or []]
    return _table("Stragglers", ["worker", "step", "step time", "median", "action"], rows, "No stragglers.") \
        if rows else ""


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
        _header(report, events), _banner(report), _facts(report, gp), _timelines(report, events, ivs),
        f"<div class='row'>{_loss(report)}{_goodput(gp)}</div>",
        _failures(report), _faults(report), _stragglers(report),
    ])
    title = f"jax-elastic run {report.get('run_id') or ''}"
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{_esc(title)}</title>"
            f"<style>{_CSS}</style></head><body><main>{body}</main></body></html>\n")


def write_html(run_dir: str | os.PathLike, report: dict, events: list[dict]) -> pathlib.Path:
    """Writes ``run_dir/report.html`` atomically (temp file + ``os.replace``); returns its path."""
    path = pathlib.Path(run_dir) / "report.html"
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render_html(report, events), encoding="utf-8")
    os.replace(tmp, path)
    return path


class ChromiumError(RuntimeError):
    """Headless chromium is missing, failed, or timed out."""


def _chromium(html_path: str | os.PathLike, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    if not os.access(CHROMIUM, os.X_OK):
        raise ChromiumError(f"{CHROMIUM} not found: install Debian's chromium (`apt-get install chromium`)")
    url = pathlib.Path(html_path).resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="elastic-chromium-") as profile:
        cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", "--hide-scrollbars", *args, url]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise ChromiumError(f"chromium did not finish within {timeout} s: {' '.join(cmd)}") from e
        finally:
            shutil.rmtree(profile, ignore_errors=True)
    if proc.returncode != 0:
        raise ChromiumError(f"chromium exited with {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


def chromium_screenshot(html_path: str | os.PathLike, png_path: str | os.PathLike, timeout: float = 60,
                        window: tuple[int, int] = (1280, 1600)) -> pathlib.Path:
    """Renders ``html_path`` in headless chromium into the PNG ``png_path``; returns its path.

    Raises :class:`ChromiumError` when chromium is absent, fails, times out,
    or writes no file.
    """
    png = pathlib.Path(png_path).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    if png.exists():
        png.unlink()
    _chromium(html_path, [f"--window-size={window[0]},{window[1]}", f"--screenshot={png}"], timeout)
    if not png.exists():
        raise ChromiumError(f"chromium wrote no screenshot at {png}")
    return png


def chromium_dom(html_path: str | os.PathLike, timeout: float = 60) -> str:
    """The DOM chromium builds from ``html_path`` (``--dump-dom``), as HTML text."""
    return _chromium(html_path, ["--dump-dom"], timeout).stdout
