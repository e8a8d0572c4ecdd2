"""elastic.run_records with a pipelined run's checkpoints, which each stage writes into <checkpoint dir>/stage<k>:
a later attempt continues the run's log (it does not start a new one over it) and is refused early, in one line,
when the programs changed."""

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


FINGERPRINTS = {"stage0/apply": "a0", "stage0/forward": "f0", "stage1/apply": "a1", "stage1/last": "l1"}
PROGRAMS = types.SimpleNamespace(devices_per_slice=1, num_microbatches=4)


def test_a_stage_directorys_checkpoint_is_the_runs(tmp_path):
    root = str(tmp_path / "checkpoints")
    for k in (0, 1):
        (tmp_path / "checkpoints" / f"stage{k}" / "4").mkdir(parents=True)
    opts = types.SimpleNamespace(checkpoint_directory=root)
    assert run_records.continues(history(root, FINGERPRINTS), opts, 6)
    assert not run_records.continues(history(root, FINGERPRINTS), opts, 3)   # beyond the steps asked for
    # Not a stage directory, or another run's: not this run's checkpoints.
    other = history(root + "/elsewhere", FINGERPRINTS)
    assert not run_records.continues(other, opts, 6)


def test_a_resume_with_another_optimizer_is_refused_naming_each_stages_update(tmp_path):
    root = str(tmp_path / "checkpoints")
    for k in (0, 1):
        (tmp_path / "checkpoints" / f"stage{k}" / "4").mkdir(parents=True)
    now = {**FINGERPRINTS, "stage0/apply": "b0", "stage1/apply": "b1"}
    with pytest.raises(elastic.ConfigError) as e:
        run_records.refuse_other_programs(history(root, FINGERPRINTS), now, PROGRAMS, root, 6, {"steps": 6},
                                          tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "'stage0/apply' and 'stage1/apply' programs differ" in msg
    assert "the stages' other programs are the same: the optimizer's update changed" in msg and "steps (4 -> 6)" in msg
    run_records.refuse_other_programs(history(root, FINGERPRINTS), FINGERPRINTS, PROGRAMS, root, 6, {"steps": 6},
                                      tmp_path)   # the same programs: nothing to refuse
