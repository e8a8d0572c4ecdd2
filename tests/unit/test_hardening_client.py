"""Hardening of the client side: output directories, the event log on a failing disk, resource limits,
run-directory locks and names, `elastic report` with nothing to report, refused access in the report.

Real files and real failures where this machine has them: ``/dev/full`` for a full disk (every write
fails with ENOSPC) and ``RLIMIT_FSIZE`` in a subprocess for a write the kernel cuts short.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jsonschema
import pytest

from elastic.config import Config, ConfigError
from elastic.config_loading import load_config
from elastic.report import build_report, render_html, summary_text
from runtime import EventLog, read_events
from tests.support.events import ev

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("elastic: error: "), err[0]
    return err[0]


# --------------------------------------------------------------------------- the event log on a failing disk


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device whose writes fail ENOSPC)")
def test_event_log_on_a_full_disk_keeps_going_warns_once_and_counts_what_it_dropped(capsys):
    log = EventLog("/dev/full", checked=False)
    for i in range(3):
        assert log.emit("step_committed", step=i)["step"] == i   # no OSError reaches the caller
    log.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "/dev/full" in err[0] and "No space left on device" in err[0] and "warning" in err[0]
    assert log.dropped == 3 and log.error is not None


def _run_limited(tmp_path, body: str) -> subprocess.CompletedProcess:
    """Runs ``body`` in a Python whose file-size limit is settable (``limit(n)``); SIGXFSZ ignored."""
    script = textwrap.dedent("""
        import json, os, resource, signal, sys
        from runtime import EventLog, read_events
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        def limit(n):
            resource.setrlimit(resource.RLIMIT_FSIZE, (n, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    """) + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env,
                          cwd=tmp_path)


def test_a_write_cut_short_is_truncated_and_the_log_stops_so_no_torn_line_is_followed(tmp_path):
    """The kernel writes only part of a line (file-size limit); the log cuts it off and writes nothing more."""
    proc = _run_limited(tmp_path, """
        log = EventLog("events.jsonl", checked=False)
        log.emit("a", pad="x" * 40)
        limit(os.path.getsize("events.jsonl") + 30)        # the next line fits only in part
        log.emit("b", pad="y" * 40)
        log.emit("c")
        limit(resource.RLIM_INFINITY)                      # space again: the log stays stopped...
        log.emit("d")
        log.close()                                        # ...but its last line says what it dropped
        print(json.dumps({"dropped": log.dropped, "events": read_events("events.jsonl")}))
    """)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    text = (tmp_path / "events.jsonl").read_text()
    assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())   # no torn line anywhere
    assert [e["kind"] for e in out["events"]] == ["a", "events_dropped"]
    assert out["dropped"] == 3 and out["events"][-1]["count"] == 3
    assert proc.stderr.count("warning") == 1 and "events.jsonl" in proc.stderr


def test_a_last_line_cut_short_at_close_takes_only_its_own_bytes_back(tmp_path):
    """``close`` appends ``events_dropped``; when the kernel writes only part of it, the truncation removes
    exactly those bytes: the events before (the last complete one included) stay whole."""
    proc = _run_limited(tmp_path, """
        log = EventLog("events.jsonl", checked=False)
        log.emit("step_committed", step=0, loss=1.5)
        log.emit("step_dispatched", step=1)
        whole = open("events.jsonl", "rb").read()
        limit(len(whole))                                  # full: the next write fails, the log stops
        log.emit("step_committed", step=1, loss=1.25)
        limit(len(whole) + 20)                             # room for 20 bytes of the events_dropped line
        log.close()
        limit(resource.RLIM_INFINITY)
        print(json.dumps({"same": open("events.jsonl", "rb").read() == whole, "dropped": log.dropped,
                          "events": read_events("events.jsonl")}))
    """)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["same"], (tmp_path / "events.jsonl").read_text()[-200:]
    assert [e["kind"] for e in out["events"]] == ["step_committed", "step_dispatched"] and out["dropped"] == 1


def test_a_cut_write_that_cannot_be_truncated_stays_the_last_line(tmp_path):
    """Where even the truncation fails, nothing is written after the torn line (readers skip it)."""
    proc = _run_limited(tmp_path, """
        def refuse(fd, size):
            raise OSError(5, "Input/output error")
        os.ftruncate = refuse
        log = EventLog("events.jsonl", checked=False)
        log.emit("a")
        limit(os.path.getsize("events.jsonl") + 10)
        log.emit("b", pad="y" * 40)
        limit(resource.RLIM_INFINITY)
        log.emit("c")
        log.close()
        print(json.dumps({"dropped": log.dropped, "events": read_events("events.jsonl")}))
    """)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    lines = (tmp_path / "events.jsonl").read_text().split("\n")
    assert len(lines) == 2 and lines[1].startswith('{"t"')   # one good line, then the torn one, last
    assert [e["kind"] for e in out["events"]] == ["a"] and out["dropped"] == 2


def test_opening_a_log_with_a_torn_last_line_cuts_it_so_new_lines_do_not_follow_it(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"t": 1, "kind": "a"}\n{"t": 2, "kind": "b", "pa')   # a writer died mid-line
    log = EventLog(path, checked=False)
    log.emit("verdict")
    log.close()
    assert [e["kind"] for e in read_events(path)] == ["a", "verdict"]


# --------------------------------------------------------------------------- the report: dropped events, security


def security_events():
    return [ev(0, "job_started", mode="distributed", config={"run_name": "x"}, global_batch_size=8, microbatches=4),
            ev(1, "run_started", run_id="r1", slices=2, devices_per_slice=1, steps=2),
            ev(2, "security_refused", worker="w0", method="/elastic.Worker/Load", peer="ipv4:127.0.0.1:5", count=3,
               reason="bad run secret"),
            ev(3, "security_refused", worker="w1", method="/elastic.Worker/Grad", peer="ipv4:127.0.0.1:6", count=1,
               reason="bad run secret"),
            ev(4, "register_refused", worker="w9", rejoin=False, reason="this controller runs 'r1', not 'r2'"),
            ev(5, "events_dropped", count=7, error="No space left on device (errno 28)")]


def test_refused_calls_registrations_and_dropped_events_are_folded_shown_and_valid():
    events = security_events()
    report = build_report(events)
    assert report["security"] == {"refused_calls": 4, "refused_registrations": 1,
                                  "by_method": {"/elastic.Worker/Load": 3, "/elastic.Worker/Grad": 1}}
    assert report["events_dropped"] == 7
    jsonschema.Draft202012Validator(SCHEMA).validate(report)
    text = summary_text(report, width=140)
    assert "refused calls" in text and "/elastic.Worker/Load: 3" in text and "refused registrations" in text
    assert "events dropped" in text and "7" in text
    page = render_html(report, events)
    assert "id='security'" in page and "id='events-dropped'" in page and "/elastic.Worker/Load" in page


def test_a_quiet_run_shows_no_security_or_dropped_rows():
    events = security_events()[:2]
    report = build_report(events)
    assert report["security"] == {"refused_calls": 0, "by_method": {}, "refused_registrations": 0}
    assert report["events_dropped"] == 0
    assert "refused" not in summary_text(report) and "dropped" not in summary_text(report)
    page = render_html(report, events)
    assert "id='security'" not in page and "id='events-dropped'" not in page


def test_render_run_keeps_the_dropped_count_the_writer_passes(tmp_path):
    from elastic.report import render_run

    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in security_events()[:2]))
    assert render_run(tmp_path, events_dropped=5)["events_dropped"] == 5
    assert json.loads((tmp_path / "report.json").read_text())["events_dropped"] == 5


# --------------------------------------------------------------------------- run names


@pytest.mark.parametrize("name, needle", [
    ("../x", "'..'"), ("a/../../b", "'..'"), ("/tmp/x", "absolute"), ("a//b", "empty"), ("a/", "empty"),
    ("./a", "'.'"), ("..", "'..'"), ("a\\b", "backslash"), ("   ", "blank"),
])
def test_run_names_that_escape_the_output_directory_are_refused(name, needle):
    with pytest.raises(ConfigError, match="run_name") as err:
        Config(run_name=name)
    assert needle in str(err.value)
    if name.strip():   # an override's value is stripped: `run_name=   ` is the empty (unnamed) run
        with pytest.raises(ConfigError, match="run_name"):
            load_config("tiny", [f"run_name={name}"])


@pytest.mark.parametrize("name", ["", "tiny", "exp-1.2", "references/0123abcd", "sweep/lr3/seed0"])
def test_plain_and_nested_run_names_are_allowed(name):
    assert Config(run_name=name).run_name == name   # the chaos harness keeps references in references/<digest>


# --------------------------------------------------------------------------- run directories: writable and locked


def unusable_outputs(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    cases = {"under /proc": "/proc/jax-elastic-no-such-dir/runs", "a file": str(tmp_path / "a-file"),
             "under a file": str(tmp_path / "a-file" / "runs")}
    return cases


@pytest.mark.parametrize("case", ["under /proc", "a file", "under a file"])
def test_an_unusable_output_directory_is_a_config_error(tmp_path, case):
    from elastic.preflight import check_output_directory, claim_run_directory

    base = unusable_outputs(tmp_path)[case]
    for name in ("", "r"):
        with pytest.raises(ConfigError, match="base_output_directory"):
            check_output_directory(base, name)
        with pytest.raises(ConfigError, match="base_output_directory"):
            claim_run_directory(base, name)


@pytest.mark.skipif(IS_ROOT, reason="running as root: root ignores permission bits, so a 0555 directory is "
                                    "writable; the /proc and file-in-the-way cases cover unwritable output here")
def test_a_read_only_output_directory_is_a_config_error(tmp_path):
    from elastic.preflight import claim_run_directory

    base = tmp_path / "ro"
    base.mkdir()
    base.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match="Permission denied"):
            claim_run_directory(str(base), "r")
    finally:
        base.chmod(0o755)


def test_a_run_directory_is_locked_while_a_run_owns_it(tmp_path):
    from elastic.preflight import check_output_directory, claim_run_directory

    claim = claim_run_directory(str(tmp_path), "tiny")
    assert claim.path == tmp_path / "tiny" and claim.path.is_dir()
    assert sorted(p.name for p in claim.path.iterdir()) == [".lock"]   # the probe file is gone
    with pytest.raises(ConfigError) as err:
        claim_run_directory(str(tmp_path), "tiny")
    msg = str(err.value)
    assert str(tmp_path / "tiny") in msg and "in use" in msg and "run_name" in msg and f"pid {os.getpid()}" in msg
    with pytest.raises(ConfigError, match="in use"):
        check_output_directory(str(tmp_path), "tiny")
    claim_run_directory(str(tmp_path), "other").release()      # another name is free
    claim.release()
    with claim_run_directory(str(tmp_path), "tiny") as again:  # free once released
        assert again.path == claim.path


def test_unnamed_runs_started_in_the_same_second_get_their_own_directories(tmp_path):
    from elastic.preflight import claim_run_directory

    claims = [claim_run_directory(str(tmp_path), "") for _ in range(3)]
    try:
        assert len({c.path for c in claims}) == 3
        assert all(c.path.parent == tmp_path and c.path.name.startswith("run-") for c in claims)
    finally:
        for c in claims:
            c.release()


# --------------------------------------------------------------------------- resource limits


def test_spares_beyond_what_the_host_can_start_are_refused_naming_the_keys_and_the_override():
    from elastic.preflight import HostCapacity, check_local_capacity

    host = HostCapacity(cpu_count=2, memory_bytes=64 << 30)
    with pytest.raises(ConfigError) as err:
        check_local_capacity(4, 10000, 2, 0, host)
    msg = str(err.value)
    assert "'elastic_spares' (10000)" in msg and "10004" in msg and "elastic_max_local_workers" in msg
    check_local_capacity(4, 60, 1, 0, host)                       # max(64, 4 x 2) = 64 is fine
    with pytest.raises(ConfigError, match="elastic_max_local_workers"):
        check_local_capacity(4, 61, 1, 0, host)
    check_local_capacity(4, 96, 1, 100, host)                     # the override raises the limit...
    with pytest.raises(ConfigError, match="raise elastic_max_local_workers"):
        check_local_capacity(4, 1, 1, 4, host)                    # ...and lowers it


def test_memory_and_simulated_devices_bound_the_workers_too():
    from elastic.preflight import PER_WORKER_BYTES, HostCapacity, check_local_capacity

    small = HostCapacity(cpu_count=64, memory_bytes=3 * PER_WORKER_BYTES)
    check_local_capacity(2, 1, 1, 0, small)
    with pytest.raises(ConfigError, match="memory"):
        check_local_capacity(4, 0, 1, 0, small)
    with pytest.raises(ConfigError, match="'ici_fsdp_parallelism' \\(10000\\)"):
        check_local_capacity(1, 0, 10000, 0, HostCapacity(cpu_count=2, memory_bytes=None))


@pytest.mark.parametrize("overrides, key", [
    (["elastic_spares=10000"], "elastic_spares"),
    (["dcn_data_parallelism=10000", "elastic_microbatches=0"], "dcn_data_parallelism"),
])
def test_configs_asking_for_thousands_of_workers_are_refused_on_this_host(overrides, key):
    from elastic.preflight import check_config_capacity

    with pytest.raises(ConfigError, match=key):
        check_config_capacity(load_config("tiny", overrides))
    check_config_capacity(load_config("tiny"))


def test_elastic_disabled_counts_no_spares():
    from elastic.preflight import HostCapacity, check_config_capacity

    cfg = load_config("tiny", ["elastic_max_local_workers=4"])
    check_config_capacity(cfg, HostCapacity(2, None))
    with pytest.raises(ConfigError):
        check_config_capacity(cfg.replace(elastic_spares=1), HostCapacity(2, None))


def test_worker_starts_are_paced_past_the_burst():
    """The token bucket's decisions, on a fake clock: a burst at once, then one start per 1/rate seconds."""
    from runtime.launch.launcher import LAUNCH_BURST, LAUNCH_RATE, _TokenBucket

    now = [0.0]
    slept = []

    def sleep(s):
        slept.append(s)
        now[0] += s

    bucket = _TokenBucket(LAUNCH_RATE, LAUNCH_BURST, clock=lambda: now[0], sleep=sleep)
    assert [bucket.take() for _ in range(LAUNCH_BURST)] == [0.0] * LAUNCH_BURST   # a normal start is not slowed
    assert [bucket.take() for _ in range(3)] == [pytest.approx(1 / LAUNCH_RATE)] * 3
    now[0] += 10.0   # idle: the bucket refills, up to the burst
    assert [bucket.take() for _ in range(LAUNCH_BURST)] == [0.0] * LAUNCH_BURST
    assert bucket.take() == pytest.approx(1 / LAUNCH_RATE)
    assert max(slept) <= 1 / LAUNCH_RATE + 1e-9


# --------------------------------------------------------------------------- the CLI and Trainer.fit


@pytest.mark.parametrize("case", ["under /proc", "a file", "under a file"])
def test_elastic_run_into_an_unusable_output_directory_is_one_line_and_status_2(tmp_path, capsys, case):
    from elastic.cli import main

    base = unusable_outputs(tmp_path)[case]
    assert main(["run", "tiny", f"base_output_directory={base}", "steps=2", "--quiet"]) == 2
    assert "base_output_directory" in one_error_line(capsys)


@pytest.mark.parametrize("overrides, needle", [
    (["elastic_spares=10000"], "elastic_spares"),
    (["dcn_data_parallelism=10000", "elastic_microbatches=0"], "dcn_data_parallelism"),
    (["run_name=../x"], "run_name"),
])
def test_elastic_run_refuses_before_starting_anything(tmp_path, capsys, overrides, needle):
    from elastic.cli import main

    assert main(["run", "tiny", f"base_output_directory={tmp_path}", *overrides, "--quiet"]) == 2
    assert needle in one_error_line(capsys)
    assert not (tmp_path.parent / "x").exists() and list(tmp_path.iterdir()) == []


def test_elastic_run_into_a_directory_another_run_holds_is_one_line_and_status_2(tmp_path, capsys):
    from elastic.cli import main
    from elastic.preflight import claim_run_directory

    with claim_run_directory(str(tmp_path), "tiny"):
        assert main(["run", "tiny", f"base_output_directory={tmp_path}", "steps=2", "--quiet"]) == 2
    line = one_error_line(capsys)
    assert str(tmp_path / "tiny") in line and "run_name" in line


def test_trainer_fit_checks_the_output_directory_and_the_host_before_anything_starts(tmp_path):
    from elastic.cli_support import bundled_trainer
    from elastic.preflight import claim_run_directory

    (tmp_path / "a-file").write_text("")
    cases = [(["base_output_directory=/proc/jax-elastic-no-such-dir"], "base_output_directory"),
             ([f"base_output_directory={tmp_path / 'a-file'}"], "base_output_directory"),
             ([f"base_output_directory={tmp_path}", "elastic_spares=10000"], "elastic_spares")]
    for overrides, key in cases:
        trainer = bundled_trainer(load_config("tiny", overrides + ["steps=2"]))
        with pytest.raises(ConfigError, match=key):
            trainer.fit()
        assert getattr(trainer, "_programs", None) is None   # refused before the programs were even built
    with claim_run_directory(str(tmp_path), "tiny"):
        trainer = bundled_trainer(load_config("tiny", [f"base_output_directory={tmp_path}", "steps=2"]))
        with pytest.raises(ConfigError, match="in use"):
            trainer.fit()


# --------------------------------------------------------------------------- elastic report: nothing to report


@pytest.mark.parametrize("setup", ["empty log", "blank lines", "no log", "no directory", "a file"])
def test_elastic_report_with_nothing_to_report_is_one_line_and_status_2(tmp_path, capsys, setup):
    from elastic.cli import main

    run_dir = tmp_path / "run"
    if setup in ("empty log", "blank lines", "no log"):
        run_dir.mkdir()
    if setup == "empty log":
        (run_dir / "events.jsonl").write_text("")
    if setup == "blank lines":
        (run_dir / "events.jsonl").write_text("\n\n")
    if setup == "a file":
        run_dir.write_text("")
    assert main(["report", str(run_dir), "--quiet"]) == 2
    line = one_error_line(capsys)
    assert "nothing to report" in line and "events.jsonl" in line
    assert not (run_dir / "report.json").exists() if run_dir.is_dir() else True
