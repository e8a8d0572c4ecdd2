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
