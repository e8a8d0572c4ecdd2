"""runtime.zygote: workers forked from one process that imported JAX once (real processes, no controller)."""

import os
import signal
import subprocess

import pytest

from runtime.launcher import jax_child_env
from runtime.zygote import Zygote, ZygoteError

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


def test_a_standby_waits_for_its_identity_and_is_killed_like_a_process(zygote, tmp_path):
    standby = zygote.start([*UNREACHABLE, "--standby"], str(tmp_path / "s.log"), standby=True)
    assert standby.poll() is None and standby.pid != os.getpid()
    with open(f"/proc/{standby.pid}/status") as f:
        ppid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
    assert ppid != os.getpid(), "a worker is the zygote's child, not the launcher's"
    with pytest.raises(subprocess.TimeoutExpired):
        standby.wait(0.2)
    standby.stdin.write(b"")
    standby.stdin.close()   # no identity: a standby that is not needed exits 0
    assert standby.wait(60) == 0
    victim = zygote.start([*UNREACHABLE, "--standby"], str(tmp_path / "v.log"), standby=True)
    victim.kill()
    assert victim.wait(60) == -signal.SIGKILL


def test_when_the_zygote_ends_its_waiting_standby_ends_too_and_no_start_hangs(zygote, tmp_path):
    standby = zygote.start([*UNREACHABLE, "--standby"], str(tmp_path / "s.log"), standby=True)
    zygote.close()
    assert standby.wait(60) is not None
    with pytest.raises(ZygoteError):
        zygote.start(["--help"], str(tmp_path / "late.log"))


def test_a_child_gets_the_environment_it_is_started_with_and_the_zygote_serves_the_next_run(tmp_path):
    from runtime import zygote as zygotes

    env = jax_child_env(2, "cpu")
    first = zygotes.acquire(env, str(tmp_path / "zygote.log"))
    try:
        cache = tmp_path / "cache-of-run-2"   # the worker reads ELASTIC_COMPILATION_CACHE_DIR and logs it
        child = first.start([*UNREACHABLE, "--standby"], str(tmp_path / "s.log"), standby=True,
                            env={**env, "ELASTIC_COMPILATION_CACHE_DIR": str(cache)})
        child.stdin.close()
        assert child.wait(60) == 0
        assert f"compilation cache {cache}" in (tmp_path / "s.log").read_text()
        with pytest.raises(ZygoteError, match="platform or import path"):
            first.start(["--help"], str(tmp_path / "x.log"), env={**env, "JAX_PLATFORMS": "cuda"})
        zygotes.release(first)
        again = zygotes.acquire(env, str(tmp_path / "other.log"), preload=("json",))
        assert again is first and "json" in again.imported   # the next run forks from the same process
        assert again.start(["--help"], str(tmp_path / "h.log"), env=env).wait(60) == 0
    finally:
        first.close()
