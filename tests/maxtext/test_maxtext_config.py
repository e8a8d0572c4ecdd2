"""integrations.maxtext.config: one MaxText file, two configs, every key accounted for."""

import dataclasses
import os
import pathlib

import pytest

pytest.importorskip("maxtext")   # the MaxText integration's requirements (integrations/maxtext/requirements.txt)

import elastic  # noqa: E402
from integrations.maxtext import config as mtc  # noqa: E402
from integrations.maxtext import load_maxtext_config  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "integrations" / "maxtext" / "configs" / "tiny.yml"


def load(*overrides, path=TINY):
    return load_maxtext_config(path, list(overrides))


def error(*overrides, path=TINY) -> str:
    with pytest.raises(elastic.ConfigError) as e:
        load(*overrides, path=path)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_keys_are_split_and_maxtext_is_built_for_one_slice():
    ec, mt = load("steps=7", "dcn_data_parallelism=2", "elastic_spares=1", "elastic_microbatches=4",
                  "learning_rate=0.01", "run_name=split")
    assert (ec.steps, ec.slices, ec.devices_per_slice, ec.microbatches) == (7, 2, 1, 4)
    assert (ec.elastic_spares, ec.per_device_batch_size, ec.run_name) == (1, 2, "split")
    assert ec.microbatch_size == mt.micro_batch_size_to_train_on == 2
    # Inside a virtual slice MaxText sees one slice, no accumulation, its own (Pathways) elasticity off.
    assert (mt.num_slices, mt.gradient_accumulation_steps, mt.steps, mt.elastic_enabled) == (1, 1, 7, False)
    assert set(mt.dcn_parallelism) == {1}
    assert mt.learning_rate == 0.01 and ec.learning_rate == elastic.Config().learning_rate   # a model key
    assert not mt.jax_cache_dir   # MaxText would set JAX's compilation cache process-wide


def test_devices_per_slice_are_maxtext_fsdp_devices():
    ec, mt = load("ici_fsdp_parallelism=2")
    assert ec.devices_per_slice == 2
    assert dict(zip(mt.mesh_axes, mt.ici_parallelism))["fsdp"] == 2
    assert mt.micro_batch_size_to_train_on == ec.microbatch_size == 4   # counted for a slice, not this process


def test_jax_elastic_keys_in_the_yaml_file_and_base_config_chain(tmp_path):
    user = tmp_path / "mine.yml"
    user.write_text(f"base_config: {TINY}\nelastic_spares: 2\ndcn_data_parallelism: 4\nseed: 3\n"
                    "elastic_min_slice_count: -1\nelastic_timeout_seconds: 5\n")
    ec, mt = load(path=user)
    assert (ec.elastic_spares, ec.slices, ec.seed, mt.init_weights_seed) == (2, 4, 3, 3)
    assert (ec.elastic_min_slice_count, ec.elastic_timeout_seconds) == (4, 5.0)   # -1 is MaxText's "all slices"
    assert mt.elastic_timeout_seconds != 5   # MaxText keeps its own default
    assert mt.max_target_length == 16   # from tiny.yml, through the chain


def test_runtime_keys_maxtext_also_defines_go_to_jax_elastic():
    ec, mt = load("jax_cache_dir=off", "elastic_enabled=false", "elastic_max_retries=0",
                  "enable_checkpointing=true", "checkpoint_period=3")
    assert (ec.jax_cache_dir, ec.elastic_enabled, ec.elastic_max_retries) == ("off", False, 0)
    assert not mt.jax_cache_dir and not mt.elastic_enabled and not mt.enable_checkpointing
    if "checkpoint_period" in {f.name for f in dataclasses.fields(elastic.Config)}:   # jax-elastic's checkpoints
        assert (ec.enable_checkpointing, ec.checkpoint_period) == (True, 3)


def test_maxtexts_metrics_keys_go_to_the_client_with_maxtexts_defaults(tmp_path):
    unset = tmp_path / "tiny.yml"   # tiny.yml without its enable_tensorboard: false
    unset.write_text(TINY.read_text().replace("enable_tensorboard: false\n", ""))
    ec, _ = load(path=unset)
    assert (ec.enable_tensorboard, ec.metrics_file, ec.log_period) == (True, "", 100)   # MaxText's base.yml
    ec, _ = load("enable_tensorboard=false", "metrics_file=m.jsonl", "log_period=5")
    assert (ec.enable_tensorboard, ec.metrics_file, ec.log_period) == (False, "m.jsonl", 5)


def test_unknown_keys_are_named_with_where_they_were_set(tmp_path):
    assert "'stpes' (in overrides)" in error("stpes=3") and "did you mean 'steps'" in error("stpes=3")
    bad = tmp_path / "bad.yml"
    bad.write_text(f"base_config: {TINY}\nelastic_sparez: 1\n")
    msg = error(path=bad)
    assert "'elastic_sparez'" in msg and str(bad) in msg and "'elastic_spares'" in msg


def test_maxtext_validates_its_part():
    msg = error("vocab_size=abc")
    assert "MaxText 0.2.5 rejected" in msg and "vocab_size" in msg


def test_gradient_accumulation_is_microbatches():
    ec, mt = load("dcn_data_parallelism=2", "gradient_accumulation_steps=2")
    assert ec.microbatches == 4 and mt.gradient_accumulation_steps == 1
    assert "contradict" in error("gradient_accumulation_steps=2", "elastic_microbatches=4")
    assert "not a power of two" in error("gradient_accumulation_steps=3")


PIPELINE = ROOT / "integrations" / "maxtext" / "configs" / "tiny_pipeline.yml"


@pytest.mark.parametrize("overrides, want", [
    # (per_device_batch_size, microbatches M, rows per microbatch): MaxText's global batch of pdbs x S x R x d
    # examples, in num_pipeline_microbatches x R microbatches of one pipeline replica each.
    ((), (1, 4, 1)),                                                    # 2 x 2 x 1 x 1 = 4 examples
    (("dcn_data_parallelism=2",), (1, 8, 1)),                           # 8 examples
    (("num_pipeline_microbatches=2",), (2, 2, 2)),
    (("num_pipeline_microbatches=-1", "per_device_batch_size=3"), (3, 2, 3)),   # MaxText's default: one per stage
    (("ici_fsdp_parallelism=2",), (1, 4, 2)),
])
def test_pipeline_stages_keep_maxtexts_global_batch(overrides, want):
    ec, mt = load(*overrides, path=PIPELINE)
    assert ec.dcn_pipeline_parallelism == 2
    assert (ec.per_device_batch_size, ec.microbatches, ec.microbatch_size) == want
    assert mt.micro_batch_size_to_train_on == ec.microbatch_size
    s, r, d = 2, ec.slices, ec.devices_per_slice
    pdbs = {"per_device_batch_size=3": 3}.get(overrides[-1] if overrides else "", 2)
    assert ec.global_batch_size == pdbs * s * r * d
    # MaxText builds each stage's model unscanned, on one slice with no pipeline axis of its own.
    assert (mt.scan_layers, mt.using_pipeline_parallelism, set(mt.dcn_parallelism)) == (False, False, {1})


@pytest.mark.parametrize("overrides, words", [
    (("num_pipeline_microbatches=3",), "(2) x dcn_pipeline_parallelism (2) / num_pipeline_microbatches (3) is 1.33"),
    (("gradient_accumulation_steps=2",), "drop gradient_accumulation_steps"),
    (("elastic_microbatches=8",), "contradicts num_pipeline_microbatches (4) x dcn_data_parallelism (1) = 4"),
    (("num_pipeline_microbatches=0",), "num_pipeline_microbatches=0 (in overrides) must be a whole number >= 1"),
    (("dcn_pipeline_parallelism=1",), "'num_pipeline_microbatches' (4, in "),   # no pipeline to split
])
def test_pipeline_keys_that_cannot_work_are_refused_in_one_line(overrides, words):
    assert words in error(*overrides, path=PIPELINE)


@pytest.mark.parametrize("overrides, words", [
    (("base_num_decoder_layers=3",), "must divide base_num_decoder_layers (3)"),
    (("logits_via_embedding=true",), "logits_via_embedding=true ties the first stage's embedding"),
    (("dropout_rate=0.1",), "set dropout_rate=0"),
])
def test_models_that_cannot_be_cut_are_refused_in_one_line(overrides, words):
    from integrations.maxtext.pipeline import check_pipelined

    _, mt = load(*overrides, path=PIPELINE)
    with pytest.raises(elastic.ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
        check_pipelined(mt, 2)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override, words", [
    ("ici_tensor_parallelism=2", "1-D FSDP mesh"),
    ("dcn_fsdp_parallelism=2", "1-D FSDP mesh"),
    ("num_slices=4", "'num_slices'"),
    ("per_device_batch_size=0.5", "whole number"),
    ("skip_step_on_spikes=true", "not supported under jax-elastic"),
    ("seed=1", None),
])
def test_what_jax_elastic_cannot_do_is_refused(override, words):
    if words is None:   # seed and init_weights_seed are one key: both set, they must agree
        assert "contradict" in error(override, "init_weights_seed=2")
        return
    assert words in error(override)


def test_environment_is_not_read_and_xla_flags_are_kept(monkeypatch):
    monkeypatch.setenv("M_STEPS", "9")
    assert "M_STEPS" in error()
    monkeypatch.delenv("M_STEPS")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    load()
    assert "XLA_FLAGS" not in os.environ   # MaxText's config would set it to dump HLO into /tmp


def test_model_name_loads_maxtext_model_file():
    _, mt = load("model_name=llama2-7b", "override_model_config=true", "base_num_decoder_layers=1")
    assert (mt.base_emb_dim, mt.base_num_decoder_layers) == (4096, 1)


def test_every_key_both_schemas_define_has_a_decision():
    from maxtext.configs import types

    shared = {f.name for f in dataclasses.fields(elastic.Config)} & mtc._maxtext_keys(types.MaxTextConfig)
    assert shared <= set(mtc.SHARED_KEYS) | mtc.MODEL_KEYS, sorted(shared - set(mtc.SHARED_KEYS) - mtc.MODEL_KEYS)
    # the schema's maxtext role (elastic.config), which both lists are derived from, is exactly the shared keys
    assert elastic.config.keys_with(elastic.config.MAXTEXT) == shared



def test_command_line_refuses_bad_keys_in_one_line(capsys, monkeypatch):
    from integrations.maxtext.__main__ import main

    monkeypatch.setenv("XLA_FLAGS", "")   # main sets a slice's device count; restored after the test
    assert main([str(TINY), "stpes=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'stpes'" in err and "did you mean 'steps'" in err
    assert main([str(TINY / "missing.yml")]) == 2


def test_maxtexts_emergency_checkpoint_keys_mean_in_memory_snapshots_on_each_host(tmp_path):
    ec, mt = load("enable_emergency_checkpoint=true", f"local_checkpoint_directory={tmp_path}",
                  "local_checkpoint_period=3", "dcn_data_parallelism=2")
    assert (ec.elastic_snapshot_interval, ec.elastic_snapshot_directory) == (3, str(tmp_path))
    assert not mt.enable_emergency_checkpoint   # MaxText's trainer does not run: jax-elastic keeps the tier
    assert "local_checkpoint_period" in error("enable_emergency_checkpoint=true",
                                              f"local_checkpoint_directory={tmp_path}")
    assert "absolute path" in error("enable_emergency_checkpoint=true", "local_checkpoint_period=2")
    assert "has no effect" in error("local_checkpoint_period=2")
    assert "contradict" in error("enable_emergency_checkpoint=true", f"local_checkpoint_directory={tmp_path}",
                                 "local_checkpoint_period=2", "elastic_snapshot_interval=5")


def test_maxtexts_multi_tier_keys_add_persistent_checkpoints_at_the_backup_interval(tmp_path):
    ec, _ = load("enable_multi_tier_checkpointing=true", f"local_checkpoint_directory={tmp_path}",
                 "local_checkpoint_period=2", "multi_tier_checkpointing_backup_interval_steps=6")
    assert (ec.elastic_snapshot_interval, ec.enable_checkpointing, ec.checkpoint_period) == (2, True, 6)
    assert "by steps" in error("enable_multi_tier_checkpointing=true", f"local_checkpoint_directory={tmp_path}",
                               "local_checkpoint_period=2", "multi_tier_checkpointing_backup_interval_minutes=5")
    assert "backup_interval_steps" in error("enable_multi_tier_checkpointing=true",
                                            f"local_checkpoint_directory={tmp_path}", "local_checkpoint_period=2")
    ec, _ = load("enable_single_replica_ckpt_restoring=true")   # what jax-elastic always does
    assert ec.elastic_snapshot_interval == 0


def test_a_dataset_other_than_synthetic_is_refused_in_one_line_naming_the_routes():
    from integrations.maxtext import make_job

    ec, mt = load("dataset_type=tfds")   # grain and hf (local files) are built in: integrations.maxtext.text_data
    with pytest.raises(elastic.ConfigError) as e:
        make_job(ec, mt)
    msg = str(e.value)
    assert "\n" not in msg and "'dataset_type' is 'tfds'" in msg and "<" not in msg   # no enum repr
    assert "elastic_trainer=MODULE:FUNCTION" in msg and "data=SOURCE" in msg


@pytest.mark.parametrize("path", [TINY, PIPELINE])
def test_a_jobs_maxtext_pieces_pickle_as_how_to_rebuild_them(path):
    """A client-fault chaos run hands the job to a child process (cloudpickle); MaxText's model definition holds
    this process's JAX devices, so the pieces travel as their config and are rebuilt there."""
    import cloudpickle
    import jax

    from integrations.maxtext.model import _Pieces
    from integrations.maxtext.pipeline import StagePieces

    ec, mt = load(path=path)
    pieces = (StagePieces(mt, 1, 2) if ec.dcn_pipeline_parallelism > 1 else _Pieces(mt, 1, ec.microbatches))
    again = cloudpickle.loads(cloudpickle.dumps(pieces))
    assert type(again) is type(pieces) and again.devices == 1
    assert again.mesh.devices.tolist() == pieces.mesh.devices.tolist()
    shapes = (lambda p: jax.tree.map(lambda x: (x.shape, str(x.dtype)), p.abstract if hasattr(p, "abstract")
                                     else p.shapes))
    assert jax.tree.leaves(shapes(again)) == jax.tree.leaves(shapes(pieces))


def test_the_docs_reference_command_is_the_same_math_as_the_run_above_it():
    """docs/maxtext.md shows a run, then "the same math in one process" with ``--reference``: the two command
    lines must give the same global batch, microbatches and steps, or the ground truth is of another run."""
    import re
    import shlex

    block = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "maxtext.md").read_text(), flags=re.S)
    lines = [x for b in block for x in b.replace("\\\n", " ").splitlines() if x.startswith(".venv/bin/elastic run")]
    pairs = [(lines[i - 1], line) for i, line in enumerate(lines) if "--reference" in line and i]
    assert pairs, "docs/maxtext.md shows a --reference command after a run"
    for run, reference in pairs:
        def loaded(command):
            words = [w for w in shlex.split(command, comments=True)[2:] if not w.startswith("--")]
            return load(*words[1:], path=ROOT / words[0])[0]
        a, b = loaded(run), loaded(reference)
        assert (a.global_batch_size, a.microbatches, a.steps) == (b.global_batch_size, b.microbatches, b.steps), \
            (run, reference)


def test_maxtexts_own_rl_config_is_refused_naming_what_it_needs_and_what_runs_rl_here():
    from integrations.maxtext.config_files import maxtext_configs_dir

    with pytest.raises(elastic.ConfigError) as err:
        load_maxtext_config(maxtext_configs_dir() / "post_train" / "rl.yml")
    line = str(err.value)
    assert "\n" not in line and "MaxText's RL config" in line
    assert "Tunix and vLLM" in line and "rl_samplers" in line and "elastic run rl_tiny" in line
