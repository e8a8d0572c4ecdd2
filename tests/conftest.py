import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAXTEXT_TRAINER_CACHE = "ELASTIC_TESTS_MAXTEXT_TRAINER_CACHE_DIR"   # the JAX cache of MaxText's own trainer runs


def pytest_configure(config):
    """One JAX compilation cache for the whole session (every xdist worker, every run, every worker process).

    Runs configured with the default ``jax_cache_dir`` use ``$JAX_COMPILATION_CACHE_DIR``
    when set, so a program is compiled once per session instead of once per
    process. Set in the controlling process before xdist starts its workers,
    which inherit it; a cache the caller set already is kept.
    """
    # Every event every process of the suite writes is checked against its schema, and a bad one fails.
    os.environ.setdefault("ELASTIC_STRICT_EVENTS", "1")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    # MaxText's own trainer (tests/maxtext/trainers.py) gets a cache of its own: it shares compiled programs
    # only with its other runs in the suite, never with jax-elastic's runs it is compared with.
    for variable, prefix in (("JAX_COMPILATION_CACHE_DIR", "jax-elastic-tests-jax-cache-"),
                             (MAXTEXT_TRAINER_CACHE, "jax-elastic-tests-maxtext-trainer-cache-")):
        if not os.environ.get(variable):
            cache = tempfile.mkdtemp(prefix=prefix)
            os.environ[variable] = cache
            config.add_cleanup(lambda cache=cache: shutil.rmtree(cache, ignore_errors=True))


def run_cli(args, tmp_path, *, check=True, timeout=300):
    """Runs ``elastic ARGS`` in a subprocess; returns (CompletedProcess, report dict or None)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    where = [f"base_output_directory={tmp_path}"] if args[0] in ("run", "chaos") else []
    cmd = [sys.executable, "-m", "elastic.cli", *args, *where, "--quiet"]
    pathlib.Path(tmp_path).mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    if check and proc.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in pathlib.Path(tmp_path).rglob("*.log"))
        raise AssertionError(f"elastic {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}\n{logs}")
    reports = sorted(pathlib.Path(tmp_path).rglob("report.json"), key=lambda p: p.stat().st_mtime)
    report = json.loads(reports[-1].read_text()) if reports and proc.returncode == 0 else None
    return proc, report


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line as ``ps`` shows it) of every live process ``/proc`` lists (zombies left
    out)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if fields and fields[0] != "Z":
            found[int(entry)] = (int(fields[1]), cmdline)
    return found


@pytest.fixture
def cli(tmp_path):
    return lambda *args, **kw: run_cli(list(args), tmp_path, **kw)


@pytest.fixture(scope="session")
def pem(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (its own CA), made with the openssl command."""
    if shutil.which("openssl") is None:
        pytest.fail("the openssl command is needed to make a test certificate (Debian package openssl)")
    from runtime.wire import auth
    d = tmp_path_factory.mktemp("pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return auth.TlsFiles(str(d / "cert.pem"), str(d / "key.pem"), str(d / "cert.pem"))
