"""A run directory across attempts, on real runs of the bundled tiny model (one slice of one device).

- Extending a finished checkpointed run (``steps`` 4 -> 6) resumes from its last checkpoint, appends a second
  attempt to the same ``events.jsonl`` and ends bit-identical to an uninterrupted 6-step run: the bundled model's
  programs do not depend on ``steps``.
- A resume whose programs differ from those that wrote the checkpoint (a learning-rate schedule built from
  ``steps``) is refused before anything is written, naming the program and the config key that changed; the
  finished run's ``events.jsonl`` and ``report.json`` stay byte for byte as they were.
"""

import json

import optax
import pytest

import elastic
from elastic.cli_support import bundled_trainer
from elastic.models import make_model
from elastic.report import summary_text

ONE = ["dcn_data_parallelism=1", "ici_fsdp_parallelism=1", "elastic_microbatches=1", "enable_checkpointing=true",
       "checkpoint_period=2", "run_name=ext"]


def cfg(tmp_path, *more):
    return elastic.load_config("tiny", ONE + [f"base_output_directory={tmp_path}", *more])


def test_extending_a_finished_run_appends_an_attempt_and_matches_an_uninterrupted_run(tmp_path):
    first = bundled_trainer(cfg(tmp_path, "steps=4")).fit()
    assert first["finished"] and first["steps_completed"] == 4
    report = bundled_trainer(cfg(tmp_path, "steps=6")).fit()
    events = [json.loads(line) for line in (tmp_path / "ext" / "events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events].count("job_started") == 2   # appended: the first attempt is still there
    assert report["finished"] and report["steps_completed"] == 6 and report["steps_lost"] == 0
    assert report["resumed_from"]["step"] == 4 and report["resumed_from"]["comparison"] == "bit-identical"
    one, two = report["attempts"]
    assert one["end"] == "finished" and one["steps_committed"] == 4
    assert two["after"] == "finished" and two["started_from"]["tier"] == "checkpoint"
    assert (two["started_from"]["step"], two["steps_committed"], two["steps_recomputed"]) == (4, 2, 0)
    assert report["losses"][:4] == first["losses"]
    assert "checkpoint at step 4" in summary_text(report, width=200)

    ref = bundled_trainer(elastic.load_config("tiny", ONE[:3] + ["steps=6", "run_name=ref",
                                                                 f"base_output_directory={tmp_path}"]))
    uninterrupted = ref.fit(reference=True)
    assert report["losses"] == uninterrupted["losses"]
    assert report["final_state_digest"] == uninterrupted["final_state_digest"]


def schedule_trainer(config):
    """A user's own Trainer whose learning-rate schedule is built from ``steps``: other programs per ``steps``."""
    init, loss, data = make_model(config)
    return elastic.Trainer(init=init, loss=loss, data=data, config=config,
                           optimizer=optax.adam(optax.cosine_decay_schedule(1e-3, decay_steps=config.steps)))


def test_a_resume_with_a_schedule_built_from_steps_is_refused_before_anything_is_written(tmp_path):
    from elastic._programs import program_fingerprints

    before = cfg(tmp_path, "steps=4")
    run_dir = tmp_path / "ext"
    (run_dir / "checkpoints" / "4").mkdir(parents=True)
    (run_dir / "checkpoints" / "4" / "commit_success.txt").write_text("")   # complete, as a listing sees it
    # The finished first attempt, as its log recorded it: the real fingerprints of its (steps=4) programs.
    history = [{"t": 1.0, "kind": "job_started", "mode": "distributed", "config": before.to_dict(model_keys=False),
                "global_batch_size": before.global_batch_size, "microbatches": 1},
               {"t": 2.0, "kind": "programs_built", "program_bytes": {}, "state_bytes": 1, "seconds": 1.0,
                "fingerprints": program_fingerprints(schedule_trainer(before).programs())},
               {"t": 3.0, "kind": "run_started", "run_id": "r1", "slices": 1, "devices_per_slice": 1, "steps": 4},
               {"t": 4.0, "kind": "checkpoint_saved", "worker": "w0", "step": 4,
                "directory": str(run_dir / "checkpoints")},
               {"t": 5.0, "kind": "run_finished", "final_state_sha256": "ab", "replica_hashes": {},
                "client_peak_rss_bytes": 1}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in history))
    (run_dir / "report.json").write_text('{"the finished run": "report"}\n')
    def files():   # .lock: the claim every run takes on its directory (it stays; docs/user-guide.md)
        return {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}

    kept = files()

    with pytest.raises(elastic.ConfigError) as refused:
        schedule_trainer(cfg(tmp_path, "steps=6")).fit()
    message = str(refused.value)
    assert "\n" not in message and "step 4" in message and "written by other programs" in message, message
    assert "'apply' program differs" in message and "'init' and 'grad' are the same" in message, message
    assert "steps (4 -> 6)" in message and "learning_rate_schedule_steps" in message, message
    assert "another run_name" in message, message
    assert files() == kept   # nothing written


def test_the_same_command_on_a_finished_checkpointed_run_ends_at_once_and_writes_nothing(tmp_path, capsys):
    """``elastic run`` again with the steps the run finished and checkpointed: nothing to compute, so no worker
    starts, no bar is drawn and the run's files stay as they were."""
    from elastic.cli import main

    args = ["run", "tiny", *ONE, f"base_output_directory={tmp_path}", "steps=2", "--quiet"]
    assert main(args) == 0
    run_dir = tmp_path / "ext"
    kept = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != ".lock"}
    capsys.readouterr()
    assert main(args[:-1]) == 0   # with the progress bar this time
    out, err = capsys.readouterr()
    assert "already finished its 2 steps" in err and "training" not in out + err, (out, err)
    assert "2 / 2" in out   # the finished run's summary
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != ".lock"} == kept


def test_ctrl_c_on_elastic_run_stops_it_in_one_line_sends_the_workers_home_and_records_it(tmp_path):
    """SIGINT to the command's process group (a terminal's Ctrl-C): exit 130 with one line and no traceback;
    the log says the user stopped the attempt (not that its client died), and no worker outlives it. The same
    command again continues the run, and SIGTERM to its process alone (a scheduler's stop, ``kill``) stops
    that attempt the same way, exit 143. The child gets SIGINT's default disposition: started from a shell's
    background job the suite's own SIGINT is ignored, and so would the child's be."""
    import os
    import signal
    import subprocess
    import sys

    from tests.support.signals import default_sigint

    run_dir = tmp_path / "stop"
    command = [sys.executable, "-m", "elastic.cli", "run", "tiny", "dcn_data_parallelism=2", "ici_fsdp_parallelism=1",
               "elastic_microbatches=2", "steps=100000", "run_name=stop", f"base_output_directory={tmp_path}",
               "--quiet"]
    stops = [(signal.SIGINT, os.killpg, 130, "Ctrl-C"), (signal.SIGTERM, os.kill, 143, "SIGTERM")]
    for attempt, (sig, send, status, said) in enumerate(stops):
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, preexec_fn=default_sigint)
        try:
            _wait_for(lambda: _committed_in_attempt(run_dir, attempt), proc)   # this attempt trains
            send(proc.pid, sig)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == status, (sig, out, err)
        assert "Traceback" not in err and f"elastic: stopped ({said}); the workers were sent home" in err, err
        assert len(err.strip().splitlines()) == 2 and err.strip().splitlines()[1].startswith("report: "), err
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        assert events[-1]["kind"] == "run_stopped" and events[-1]["signal"] == sig.name
        report = json.loads((run_dir / "report.json").read_text())
        assert len(report["attempts"]) == attempt + 1 and report["attempts"][-1]["end"] == "stopped"
        assert f"({sig.name})" in report["failure_reason"]
        started = max(i for i, e in enumerate(events) if e["kind"] == "job_started")
        workers = [e["pid"] for e in events[started:] if e["kind"] == "worker_registered" and e.get("pid")]
        assert workers, "the log names the workers' pids"
        _wait_for(lambda: not any(_alive(pid) for pid in workers), None, seconds=30)
        assert not any(_alive(pid) for pid in workers), f"a worker outlived the run stopped by {sig.name}"


def _committed_in_attempt(run_dir, attempt: int) -> bool:
    """Whether attempt ``attempt`` (0: the first) of the run's log committed a step."""
    attempts = _read(run_dir / "events.jsonl").split('"job_started"')[1:]
    return len(attempts) == attempt + 1 and '"step_committed"' in attempts[-1]


def _wait_for(condition, proc, seconds: float = 240) -> None:
    """Polls ``condition`` until it holds or ``seconds`` pass; ``proc`` (when given) must run meanwhile."""
    import time

    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, proc.communicate()
        time.sleep(0.2)


def _read(path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
