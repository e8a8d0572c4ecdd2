"""Hardening on real runs of the bundled tiny model (reference mode: one process, seconds).

A run holds its directory for the whole of ``fit``; a disk that fills mid-run (a real file-size limit,
``RLIMIT_FSIZE``, in a subprocess) neither stops training nor leaves a torn line in ``events.jsonl``.
"""

import json
import os
import subprocess
import sys
import textwrap

import elastic
from elastic.cli_support import bundled_trainer
from tests.conftest import ROOT

SMALL = ["steps=3", "ici_fsdp_parallelism=1"]   # reference mode on this process's one CPU device


def test_fit_holds_its_run_directory_until_it_returns(tmp_path):
    from elastic.preflight import claim_run_directory

    cfg = elastic.load_config("tiny", SMALL + [f"base_output_directory={tmp_path}"])
    seen = []

    def on_step(step, loss):
        try:
            claim_run_directory(str(tmp_path), "tiny").release()
            seen.append("claimed")
        except elastic.ConfigError as e:
            seen.append(str(e))

    report = bundled_trainer(cfg).fit(reference=True, on_step=on_step)
    assert report["steps_completed"] == 3 and len(seen) == 3
    assert all("in use" in s and str(tmp_path / "tiny") in s for s in seen), seen
    claim_run_directory(str(tmp_path), "tiny").release()   # free again once fit returned


def test_a_disk_that_fills_mid_run_drops_events_finishes_training_and_then_says_what_was_lost(tmp_path):
    """Training goes on to the end; then ``fit`` raises ``RunRecordsLostError`` (``elastic run`` exits 1 on it),
    one line naming the log and what it could not record, and the log stays a clean prefix of the run."""
    script = textwrap.dedent(f"""
        import json, os, resource, signal, sys
        import elastic
        from elastic.cli_support import bundled_trainer

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        cfg = elastic.load_config("tiny", {SMALL + ["steps=4"]!r} + ["base_output_directory=" + os.getcwd()])
        trainer = bundled_trainer(cfg)
        steps = []

        def on_step(step, loss):
            steps.append(step)
            if step == 1:   # the disk is full from here on: no file may grow
                size = os.path.getsize(trainer.run_dir() / "events.jsonl")
                resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

        try:
            trainer.fit(reference=True, on_step=on_step)
        except elastic.RunRecordsLostError as e:
            report, message = e.report, str(e)
        else:
            raise SystemExit("fit returned although its records are incomplete")
        print(json.dumps({{"steps": steps, "events_dropped": report["events_dropped"],
                          "steps_completed": report["steps_completed"], "message": message}}))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["steps"] == [0, 1, 2, 3]                      # training went on to the end
    assert out["events_dropped"] > 0 and out["steps_completed"] == 2
    message = out["message"]
    assert "\n" not in message and "the run finished, but its records are incomplete" in message, message
    assert str(tmp_path / "tiny" / "events.jsonl") in message and "File too large" in message, message
    assert f"{out['events_dropped']} events were not recorded" in message, message
    assert "report.json could not be written" in message, message   # the disk is still full at the end
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len([w for w in warnings if "event log" in w]) == 1, warnings
    assert "events.jsonl" in warnings[0] and "File too large" in warnings[0]
    text = (tmp_path / "tiny" / "events.jsonl").read_text()
    assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())
    assert not list((tmp_path / "tiny").glob("*.tmp"))      # no half-written report files

