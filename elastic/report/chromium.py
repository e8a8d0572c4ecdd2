"""Headless Chromium on a rendered page: a PNG screenshot or the DOM it builds.

Used by ``scripts/screenshot.py`` and the report tests. Drives Debian's
``chromium`` package as a subprocess with a deadline and a throwaway profile;
every failure (missing browser, non-zero exit, timeout, no file written) is a
:class:`ChromiumError`.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile

__all__ = ["CHROMIUM", "ChromiumError", "chromium_dom", "chromium_screenshot"]

#: Where Debian's ``chromium`` package installs the browser.
CHROMIUM = "/usr/bin/chromium"


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
