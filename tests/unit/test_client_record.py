"""The run directory's client record and lock, as a restarted client finds them: the record's generation, the
secret kept private, a lock held by a live client refused and one held by a stopped client taken over."""

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from elastic import client_record, run_records
from elastic.config import ConfigError
from elastic.preflight import claim_run_directory
from tests.conftest import ROOT


def test_the_record_round_trips_and_the_secret_is_readable_by_its_owner_only(tmp_path):
    assert client_record.read(tmp_path) is None and client_record.read_secret(tmp_path) == ""
    client_record.write(tmp_path, client_record.ClientRecord(run_id="r1", generation=3, controller="h:1", pid=42),
                        secret="s3cret")
    got = client_record.read(tmp_path)
    assert (got.run_id, got.generation, got.controller, got.pid) == ("r1", 3, "h:1", 42) and got.host and got.t
    assert stat.S_IMODE((tmp_path / ".secret").stat().st_mode) == 0o600
    assert "s3cret" not in (tmp_path / "client.json").read_text()
    assert client_record.read_secret(tmp_path) == "s3cret"
    os.chmod(tmp_path / ".secret", 0o644)   # readable by others: not used
    assert client_record.read_secret(tmp_path) == ""
    (tmp_path / "client.json").write_text("{not json")
    assert client_record.read(tmp_path) is None   # unreadable: the run starts as without one


def _attempt(*kinds, mode="distributed", error=""):
    return [{"kind": "job_started", "mode": mode}] + [{"kind": k, **({"error": error} if k == "run_failed" else {})}
                                                      for k in kinds]


@pytest.mark.parametrize("history,died", [
    ([], False),
    (_attempt("step_committed"), True),                              # the client died mid-run
    (_attempt("step_committed", "run_finished"), False),
    (_attempt("step_committed", "run_failed", error="StateLostError: x"), False),   # failed: workers went home
    (_attempt("step_committed", mode="reference"), False),
    (_attempt("step_committed") + _attempt("run_failed", error="AttachRefusedError: other programs"), True),
])
def test_a_restart_re_attaches_only_after_a_client_that_died(history, died):
    assert run_records.client_died(history) is died


HOLDER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from elastic.preflight import claim_run_directory
claim = claim_run_directory(sys.argv[1], "r")
print("held", flush=True)
time.sleep(60)
"""


def test_a_live_holder_keeps_the_run_and_a_stopped_one_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), str(ROOT)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {holder.pid}\\)"):
            claim_run_directory(str(tmp_path), "r")
        os.kill(holder.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while open(f"/proc/{holder.pid}/stat").read().rpartition(")")[2].split()[0] != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        claim = claim_run_directory(str(tmp_path), "r")   # taken over
        try:
            assert (tmp_path / "r" / f".lock.stale-{holder.pid}").exists()
            assert (tmp_path / "r" / ".lock").read_text().strip() == str(os.getpid())
        finally:
            claim.release()
    finally:
        holder.kill()
        holder.wait()
    claim_run_directory(str(tmp_path), "r").release()   # the stale lock of a holder gone since is removed
    assert not (tmp_path / "r" / f".lock.stale-{holder.pid}").exists()
