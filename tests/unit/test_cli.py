"""Bad input to the CLI gives one clear line and exit status 2; a worker that cannot join says why in one line."""

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.control.controller_options import ControllerOptions
from runtime.control.registry import Registry
from runtime.control.run_state import RunLedger
from runtime.control.worker_group import WorkerGroup
from runtime.core.events import EventLog
from runtime.wire import rpc
from tests.conftest import ROOT


@pytest.mark.parametrize("args, needle", [
    (["run", "tiny", "stpes=3"], "unknown config key 'stpes'"),
    (["run", "tiny", "steps=abc"], "'steps' must be an integer"),
    (["run", "tiny", "steps"], "steps"),
    (["run", "no-such-config.yml"], "no-such-config"),
    (["run", "tiny", "elastic_microbatches=3"], "elastic_microbatches"),
    (["run", "tiny", "dcn_data_parallelism=8"], "elastic_microbatches"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line_naming_the_problem(cli, args, needle):
    proc, _ = cli(*args, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("elastic: error:") and needle in lines[0], lines[0]


def test_chaos_is_a_plugged_in_command(cli):
    """`elastic` finds `chaos` through the `elastic.commands` entry points; elastic never imports chaos."""
    from importlib.metadata import entry_points

    assert [ep.value for ep in entry_points(group="elastic.commands") if ep.name == "chaos"] == ["chaos.cli:register"]
    proc, _ = cli("--help")
    assert proc.returncode == 0 and "chaos" in proc.stdout and "run a config under injected faults" in proc.stdout
    proc, _ = cli("chaos", "tiny", "--faults", "kill:slise=1@step=3", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "elastic: error: fault 1 'kill:slise=1@step=3': unknown target 'slise' "
        "(expected slice, stage, worker, role, random, all, everything, client)"]


def test_a_broken_plugin_is_one_warning_and_the_builtin_commands_still_work(monkeypatch, capsys):
    from importlib.metadata import EntryPoint

    import elastic.cli

    broken = [EntryPoint(name="broken", value="no_such_module_for_elastic:register", group="elastic.commands"),
              EntryPoint(name="chaos", value="chaos.cli:register", group="elastic.commands")]
    monkeypatch.setattr(elastic.cli, "entry_points", lambda group: broken if group == "elastic.commands" else [])
    assert elastic.cli.main(["run", "tiny", "stpes=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("elastic: warning: command 'broken'") and "ModuleNotFoundError" in err[0]
    assert err[1].startswith("elastic: error: unknown config key 'stpes'")
    with pytest.raises(SystemExit):
        elastic.cli.main(["--help"])
    out = capsys.readouterr().out
    assert "chaos" in out and "broken" not in out


def test_library_output_is_kept_off_the_terminal_and_shown_only_when_something_crashes(capsys):
    import logging
    import sys

    from elastic.cli_support import kept_library_output
    from elastic.config import ConfigError

    with kept_library_output() as kept:
        print("[NO-OP] a stub")
        handler = logging.StreamHandler()   # bound to the stream of its time, as libraries do at import
        print("a warning", file=sys.stderr)
    assert "".join(kept) == "[NO-OP] a stub\na warning\n"
    handler.stream.write("later\n")   # a handler made while kept reaches the terminal afterwards
    assert capsys.readouterr() == ("", "later\n")
    with pytest.raises(ConfigError), kept_library_output():
        print("noise")
        raise ConfigError("bad input")   # one line says what is wrong: the noise stays kept
    assert capsys.readouterr() == ("", "")
    with pytest.raises(RuntimeError), kept_library_output():
        print("what led to it")
        raise RuntimeError("crash")
    assert capsys.readouterr() == ("", "what led to it\n")


@pytest.mark.parametrize("where, needle", [("nothing", "does not exist"), ("empty", "holds no complete checkpoint"),
                                           ("file", "cannot be read")])
def test_a_bad_load_full_state_path_is_refused_before_any_worker_starts(cli, tmp_path, where, needle):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("not a checkpoint")
    proc, _ = cli("run", "tiny", "run_name=bad", f"load_full_state_path={tmp_path / where}", check=False)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("elastic: error: config key load_full_state_path") and needle in line, line
    written = [p.name for p in (tmp_path / "bad").rglob("*")]
    assert written in ([], [".lock"]), f"no worker started, no event written: {written}"



def _worker(port, *flags, env):
    """A real ``elastic worker`` process joining run ``r`` at ``127.0.0.1:port`` (stderr kept); ``env``: its
    variables beyond this process's (whose TLS files are left out)."""
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("ELASTIC_TLS_")}
    return subprocess.Popen([sys.executable, "-m", "elastic.cli", "worker", "--controller", f"127.0.0.1:{port}",
                             "--run-id", "r", "--devices", "1", *flags], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            env={**base, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), **env})


_ABSL_INFO = re.compile(r"I\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")


def _said(proc) -> tuple[int, list[str]]:
    """Its exit status and what it said beyond its INFO lines (a traceback would be many lines): ours, and gRPC
    core's in absl's form (``I1203 22:44:13.440076 29806 chttp2_transport.cc:1403] ... GOAWAY``, when the server
    goes away as the run ends)."""
    _, err = proc.communicate(timeout=120)
    return proc.returncode, [line for line in err.splitlines() if " INFO " not in line and not _ABSL_INFO.match(line)]


def test_a_worker_that_cannot_join_says_why_in_one_line(tmp_path, pem):
    """A wrong run secret, and no controller at all: exit 1 and one line; a run that already ended: exit 0 and
    one line. The TLS flags of `elastic worker` reach the worker, and win over the environment."""
    registry = Registry("r", EventLog(tmp_path / "events.jsonl"), refuse=lambda w: "")
    registry.end()   # the run is over: a replacement that comes now has nothing to join
    server, port = rpc.make_server(secret="s3cret", tls=pem, refusals=registry.refusals)
    pb_grpc.add_ControllerServicer_to_server(registry, server)
    server.start()
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        nobody = s.getsockname()[1]
    flags = ["--tls-cert", pem.cert_file, "--tls-key", pem.key_file, "--tls-ca", pem.ca_file]
    tls_env = {"ELASTIC_TLS_CERT": pem.cert_file, "ELASTIC_TLS_KEY": pem.key_file, "ELASTIC_TLS_CA": pem.ca_file}
    workers = []
    try:
        workers = [_worker(port, *flags, env={"ELASTIC_RUN_SECRET": "s3cret", "ELASTIC_TLS_CERT": "no-such.pem"}),
                   _worker(port, env={"ELASTIC_RUN_SECRET": "wrong", **tls_env}),
                   _worker(nobody, "--register-timeout", "1", env={"ELASTIC_RUN_SECRET": "s3cret"})]
        (late, [late_line]), (intruder, [intruder_line]), (lost, [lost_line]) = map(_said, workers)
    finally:
        for p in workers:
            if p.poll() is None:
                p.kill()
        server.stop(0)
    assert late == 0 and "run r ended before this worker joined: nothing to do" in late_line, late_line
    assert intruder == 1 and "refused this worker's run secret" in intruder_line, intruder_line
    assert "$ELASTIC_RUN_SECRET" in intruder_line
    assert lost == 1 and f"no controller answered at 127.0.0.1:{nobody} within 1 s" in lost_line, lost_line
    assert "--register-timeout" in lost_line


def test_a_worker_that_registered_too_late_to_be_placed_is_sent_home_when_the_run_ends(tmp_path):
    """It registered after the client's last adoption: the end of the run still reaches it, and it exits 0."""
    opts = ControllerOptions(slices=1, devices_per_slice=1, run_dir=str(tmp_path), run_id="r", launcher="none",
                             secret="s3cret")
    events = EventLog(tmp_path / "events.jsonl")
    group = WorkerGroup("r", "s3cret", None, b"", opts, events, RunLedger(events))
    group.start()
    port = int(group.address.rpartition(":")[2])
    worker = _worker(port, "--worker-id", "pod-late", env={"ELASTIC_RUN_SECRET": "s3cret"})
    try:
        deadline = time.monotonic() + 60
        while "pod-late" not in group.registry.workers and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "pod-late" in group.registry.workers and not group.calls.reaches("pod-late")
    finally:
        group.close()
        if worker.poll() is None:
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
    code, said = _said(worker)
    assert code == 0 and said == [], said


@pytest.mark.parametrize("args, needle", [
    (["--tls-cert", "c.pem"], "missing --tls-key ($ELASTIC_TLS_KEY), --tls-ca ($ELASTIC_TLS_CA)"),
    (["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem"], "TLS file not found: c.pem, k.pem, ca.pem"),
    (["--devices", "0"], "expected a number of devices >= 1"),
    (["--register-timeout", "0"], "expected seconds > 0"),
])
def test_bad_worker_flags_are_one_line_before_jax_starts(tmp_path, args, needle):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_TLS_")}
    proc = subprocess.run([sys.executable, "-m", "elastic.cli", "worker", "--controller", "127.0.0.1:1", "--run-id",
                           "r", *args], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**env, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("elastic: error:") and needle in line, line


def test_elastic_run_help_names_every_bundled_config():
    from elastic.cli import parser

    (run,) = [a for a in parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith(" run")]
    text = " ".join(run.format_help().split())
    assert "or a bundled name (base, rl_tiny, tiny)" in text
