"""elastic.run_records with the checkpoint layouts other than one host's: a pipelined run's, which each stage
writes into <checkpoint dir>/stage<k>, and a slice of several hosts', each host into <dir>/host<k>-of-<H>: a later
attempt continues the run's log (it does not start a new one over it) and is refused early, in one line, when the
programs changed; a run that does not continue moves the earlier records aside, never deletes them."""

import os
import pathlib
import types

import pytest

import elastic
from elastic import run_records


def history(root, fingerprints):
    return [{"t": 1.0, "kind": "job_started", "mode": "distributed", "config": {"steps": 4}, "microbatches": 4},
            {"t": 2.0, "kind": "programs_built", "fingerprints": fingerprints},
            {"t": 3.0, "kind": "run_started", "devices_per_slice": 1},
            *({"t": 4.0, "kind": "checkpoint_saved", "worker": f"w{k}", "step": 4, "directory": f"{root}/stage{k}"}
              for k in (0, 1)),
            {"t": 5.0, "kind": "run_finished"}]


def committed(directory: pathlib.Path, step: int) -> None:
    """A complete checkpoint of ``step`` in ``directory`` as a listing sees it (its commit marker)."""
    (directory / str(step)).mkdir(parents=True)
    (directory / str(step) / "commit_success.txt").write_text("")


FINGERPRINTS = {"stage0/apply": "a0", "stage0/forward": "f0", "stage1/apply": "a1", "stage1/last": "l1"}
PROGRAMS = types.SimpleNamespace(devices_per_slice=1, num_microbatches=4)


def test_a_stage_directorys_checkpoint_is_the_runs(tmp_path):
    root = str(tmp_path / "checkpoints")
    for k in (0, 1):
        committed(tmp_path / "checkpoints" / f"stage{k}", 4)
    opts = types.SimpleNamespace(checkpoint_directory=root)
    assert run_records.continues(history(root, FINGERPRINTS), opts, 6)
    assert not run_records.continues(history(root, FINGERPRINTS), opts, 3)   # beyond the steps asked for
    # Not a stage directory, or another run's: not this run's checkpoints.
    other = history(root + "/elsewhere", FINGERPRINTS)
    assert not run_records.continues(other, opts, 6)


def test_a_resume_with_another_optimizer_is_refused_naming_each_stages_update(tmp_path):
    root = str(tmp_path / "checkpoints")
    for k in (0, 1):
        committed(tmp_path / "checkpoints" / f"stage{k}", 4)
    now = {**FINGERPRINTS, "stage0/apply": "b0", "stage1/apply": "b1"}
    with pytest.raises(elastic.ConfigError) as e:
        run_records.refuse_other_programs(history(root, FINGERPRINTS), now, PROGRAMS, root, 6, {"steps": 6},
                                          tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "'stage0/apply' and 'stage1/apply' programs differ" in msg
    assert "the stages' other programs are the same: the optimizer's update changed" in msg and "steps (4 -> 6)" in msg
    run_records.refuse_other_programs(history(root, FINGERPRINTS), FINGERPRINTS, PROGRAMS, root, 6, {"steps": 6},
                                      tmp_path)   # the same programs: nothing to refuse


def test_a_run_extended_from_checkpoints_of_two_host_slices_continues_its_log(tmp_path):
    # Each host of a 2-host slice writes <dir>/host<k>-of-2/<step>; <dir>/<step> is never there. The resume logic
    # took such a run for a new one and deleted the earlier attempt's log.
    root = tmp_path / "checkpoints"
    for k in (0, 1):
        committed(root / f"host{k}-of-2", 4)
    saved = [{"t": 1.0, "kind": "job_started", "mode": "distributed", "config": {"steps": 4}, "microbatches": 4},
             {"t": 4.0, "kind": "checkpoint_saved", "worker": "w0", "step": 4, "directory": str(root)},
             {"t": 5.0, "kind": "run_finished"}]
    opts = types.SimpleNamespace(checkpoint_directory=str(root))
    assert run_records.continues(saved, opts, 6)
    assert run_records.finished_already([*saved[:2], {**saved[2], "steps_completed": 4}], opts, 4)
    committed(root / "host0-of-2", 8)   # one host's store alone holds 8: no complete checkpoint of 8
    assert not run_records.continues([*saved[:1], {**saved[1], "step": 8}, saved[2]], opts, 8)


def test_a_run_that_does_not_continue_keeps_the_earlier_records_aside(tmp_path, capsys):
    run_dir = tmp_path / "r"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "events.jsonl").write_text('{"t": 1.0, "kind": "job_started"}\n')
    (run_dir / "logs" / "worker-w0.log").write_text("w0\n")
    (run_dir / "report.json").write_text("{}")
    for own in (".lock", ".secret", "client.json"):
        (run_dir / own).write_text(own)
    committed(run_dir / "checkpoints" / "host0-of-2", 4)
    committed(run_dir / "mine", 4)   # a checkpoint directory of another name stays too
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n')
    log = run_records.open_log(run_dir, append=False, why="a reason", also=(str(metrics),))
    log.close()
    aside = run_dir / "earlier" / "1"
    assert (aside / "events.jsonl").read_text().startswith('{"t": 1.0')
    assert (aside / "logs" / "worker-w0.log").read_text() == "w0\n" and (aside / "report.json").exists()
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n' and not metrics.exists()
    assert all((run_dir / own).exists() for own in (".lock", ".secret", "client.json", "checkpoints", "mine"))
    assert not any((run_dir / "logs").iterdir())   # the logs moved one by one
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "(a reason)" in err and str(aside) in err
    # A log this attempt wrote to already (its zygote's, started before the log opens) stays where it is.
    (run_dir / "logs" / "worker-w0.log").write_text("earlier\n")
    os.utime(run_dir / "logs" / "worker-w0.log", (1.0, 1.0))
    (run_dir / "logs" / "zygote.log").write_text("this attempt's\n")
    (run_dir / "events.jsonl").write_text("{}\n")
    run_records.open_log(run_dir, append=False, since=2.0).close()
    assert (run_dir / "earlier" / "2" / "logs" / "worker-w0.log").read_text() == "earlier\n"
    assert (run_dir / "logs" / "zygote.log").read_text() == "this attempt's\n"
    assert not (run_dir / "earlier" / "2" / "logs" / "zygote.log").exists()
    # Nothing of an earlier run (no event log: a MaxText client's log written before the run): nothing moved.
    (run_dir / "logs" / "client.log").write_text("this attempt's\n")
    os.utime(run_dir / "logs" / "client.log", (1.0, 1.0))
    assert run_records.keep_aside(run_dir, "", since=2.0) is None and not (run_dir / "earlier" / "3").exists()
    (run_dir / "logs" / "client.log").unlink()
    # Again: the next number; a run that continues moves nothing.
    (run_dir / "events.jsonl").write_text("{}\n")
    run_records.open_log(run_dir, append=False).close()
    assert (run_dir / "earlier" / "3" / "events.jsonl").exists() and (aside / "events.jsonl").exists()
    (run_dir / "events.jsonl").write_text("{}\n")
    run_records.open_log(run_dir, append=True).close()
    assert (run_dir / "events.jsonl").read_text() == "{}\n" and not (run_dir / "earlier" / "4").exists()
