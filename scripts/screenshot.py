"""Screenshot a run's ``report.html`` with Debian's headless chromium.

    python scripts/screenshot.py RUN_DIR [--out PNG]

Renders ``RUN_DIR/report.html`` first when it is missing (from
``events.jsonl``, with ``report.json`` when present), then writes the PNG
(default ``RUN_DIR/report.png``). Exits 1 with a one-line message when
chromium is absent or fails.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from elastic.report import ChromiumError, build_report, chromium_screenshot, write_html  # noqa: E402
from runtime import read_events  # noqa: E402


def ensure_html(run_dir: pathlib.Path) -> pathlib.Path:
    """``run_dir/report.html``, rendered from the run's log when it does not exist yet."""
    html_path = run_dir / "report.html"
    if html_path.exists():
        return html_path
    events = read_events(run_dir / "events.jsonl")
    report_path = run_dir / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else build_report(events)
    return write_html(run_dir, report, events)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=pathlib.Path)
    ap.add_argument("--out", type=pathlib.Path, help="PNG to write (default RUN_DIR/report.png)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds chromium may take")
    args = ap.parse_args(argv)
    if not (args.run_dir / "events.jsonl").exists() and not (args.run_dir / "report.html").exists():
        print(f"screenshot: error: {args.run_dir} has no events.jsonl", file=sys.stderr)
        return 2
    try:
        png = chromium_screenshot(ensure_html(args.run_dir), args.out or args.run_dir / "report.png",
                                  timeout=args.timeout)
    except ChromiumError as e:
        print(f"screenshot: error: {e}", file=sys.stderr)
        return 1
    print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
