"""runtime.launch.zygote: workers forked from one process that imported JAX once (real processes, no controller)."""

import os
import signal
import subprocess
import time

import pytest

from runtime.core.child_env import jax_child_env
from runtime.launch.launcher import _tell
from runtime.launch.zygote import Zygote, ZygoteError

UNREACHABLE = ["--controller", "127.0.0.1:1", "--run-id", "r"]


@pytest.fixture
def zygote(tmp_path):
    z = Zygote(jax_child_env(2, "cpu"), str(tmp_path / "zygote.log"))
    yield z
    z.close()


def test_a_forked_worker_runs_the_worker_entry_point_with_its_own_log_and_exit_status(zygote, tmp_path):
    child = zygote.start(["--help"], str(tmp_path / "help.log"))
    assert child.wait(60) == 0
    assert "usage: elastic worker" in (tmp_path / "help.log").read_text()
    bad = zygote.start(["--no-such-flag"], str(tmp_path / "bad.log"))
    assert bad.wait(60) == 2 and "arguments are required" in (tmp_path / "bad.log").read_text()


def _standby(zygote, tmp_path, name, owner=None):
    fifo = tmp_path / f"{name}.fifo"
    os.mkfifo(fifo)
    child = zygote.start([*UNREACHABLE, "--standby", "--identity-fifo", str(fifo),
                          "--owner-pid", str(owner or os.getpid())], str(tmp_path / f"{name}.log"))
    return child, str(fifo)


def _wait_for_log(path, text, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path}")


def test_a_standby_waits_for_its_identity_and_is_killed_like_a_process(zygote, tmp_path):
    standby, fifo = _standby(zygote, tmp_path, "s")
    assert standby.poll() is None and standby.pid != os.getpid()
    with open(f"/proc/{standby.pid}/status") as f:
        ppid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
    assert ppid != os.getpid(), "a worker is the zygote's child, not the launcher's"
    with pytest.raises(subprocess.TimeoutExpired):
        standby.wait(0.2)
    _wait_for_log(tmp_path / "s.log", "waiting for its worker id")
    assert _tell(fifo, "\n")   # no identity: a standby that is not needed exits 0
    assert standby.wait(60) == 0
    assert not os.path.exists(fifo), "a standby removes its named pipe once it read it"
    victim, fifo = _standby(zygote, tmp_path, "v")
    victim.kill()
    assert victim.wait(60) == -signal.SIGKILL
    assert not _tell(fifo, "w9\n"), "a dead standby's pipe is refused at once, not written into"


def test_a_standby_whose_owner_dies_exits_with_status_4(zygote, tmp_path):
    owner = subprocess.Popen(["sleep", "600"])
    try:
        standby, _ = _standby(zygote, tmp_path, "s", owner=owner.pid)
        _wait_for_log(tmp_path / "s.log", "waiting for its worker id")
        assert standby.poll() is None
    finally:
        owner.kill()
        owner.wait()
    assert standby.wait(60) == 4
    assert "owner (process" in (tmp_path / "s.log").read_text()


def test_the_zygotes_death_costs_only_itself(zygote, tmp_path):
    """SIGKILL of the zygote: its children live on (they answer to the run's owner), a later start says the
    zygote is gone (the launcher then starts a process of its own) and never hangs, and a child's end is still
    seen once no zygote reports it."""
    standby, fifo = _standby(zygote, tmp_path, "s")
    _wait_for_log(tmp_path / "s.log", "waiting for its worker id")
    os.kill(zygote._proc.pid, signal.SIGKILL)
    zygote._proc.wait(10)
    time.sleep(1.0)   # a child that watched its parent would be gone by now (it looked every 0.2 s)
    assert standby.poll() is None and os.path.exists(f"/proc/{standby.pid}")
    with pytest.raises(ZygoteError):
        zygote.start(["--help"], str(tmp_path / "late.log"))
    assert _tell(fifo, "\n")   # the orphan still reads its pipe and exits as asked
    deadline = time.monotonic() + 60
    while standby.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert standby.poll() is not None


def test_a_child_gets_the_environment_it_is_started_with_and_the_zygote_serves_the_next_run(tmp_path):
    from runtime.launch import zygote as zygotes

    env = jax_child_env(2, "cpu")
    first = zygotes.acquire(env, str(tmp_path / "zygote.log"))
    try:
        cache = tmp_path / "cache-of-run-2"   # the worker reads ELASTIC_COMPILATION_CACHE_DIR and logs it
        child = first.start([*UNREACHABLE, "--standby"], str(tmp_path / "s.log"),
                            env={**env, "ELASTIC_COMPILATION_CACHE_DIR": str(cache)})
        assert child.wait(60) == 0   # its stdin is /dev/null: end-of-file, not needed
        assert f"compilation cache {cache}" in (tmp_path / "s.log").read_text()
        with pytest.raises(ZygoteError, match="platform or import path"):
            first.start(["--help"], str(tmp_path / "x.log"), env={**env, "JAX_PLATFORMS": "cuda"})
        zygotes.release(first)
        again = zygotes.acquire(env, str(tmp_path / "other.log"), preload=("json",))
        assert again is first and "json" in again.imported   # the next run forks from the same process
        assert again.start(["--help"], str(tmp_path / "h.log"), env=env).wait(60) == 0
    finally:
        first.close()
