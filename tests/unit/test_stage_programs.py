"""A loss cut into pipeline stages by ``elastic.pipeline_stage``: the programs, their math, and bad cuts."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import elastic
from elastic._programs import build_programs
from elastic.models.transformer import SyntheticTokens, TransformerConfig, init_params, loss_fn
from runtime import ProgramExportError
from runtime.worker.reference import LocalRun, run_reference

SHAPE = dict(vocab_size=32, max_target_length=8, emb_dim=16, num_layers=3, num_heads=2, mlp_dim=32)
DATA = SyntheticTokens(0, 32, 8, 4)
SPEC = DATA.element_spec()
M = 4


@pytest.fixture(scope="module")
def pipeline(three_stages):
    run = LocalRun(three_stages, DATA)
    run.load()
    return run


@pytest.fixture(scope="module")
def three_stages():
    t = TransformerConfig(**SHAPE, pipeline_stages=3)
    return build_programs(init_params=functools.partial(init_params, tcfg=t),
                          loss=functools.partial(loss_fn, tcfg=t), optimizer=optax.adam(1e-2),
                          batch_spec=SPEC, num_stages=3, devices_per_slice=1, num_microbatches=M)


def test_each_stage_owns_its_layers_and_passes_activations_on(three_stages):
    stages = three_stages.by_stage
    assert [sorted(s.blobs) for s in stages] == [["apply", "backward", "forward", "init"]] * 2 + [
        ["apply", "init", "last"]]
    act = [[4, 8, 16], "<f4"]
    assert stages[0].activation_in == [] and stages[0].activation_out == [act]
    assert stages[1].activation_in == [act] == stages[1].activation_out
    assert stages[2].activation_in == [act] and stages[2].activation_out == []
    e, f, v, t = 16, 32, 32, 8
    layer = 2 * e + 4 * e * e + 2 * e * f   # two norms, qkv and out, the MLP
    assert [s.grad_size for s in stages] == [v * e + t * e + layer, layer, layer + e + e * v]
    whole = jax.eval_shape(lambda key: init_params(key, TransformerConfig(**SHAPE)), jax.random.key(0))
    assert sum(s.grad_size for s in stages) == sum(x.size for x in jax.tree.leaves(whole))


def test_losses_are_the_same_bits_for_any_replica_count_schedule_and_order_of_execution(pipeline):
    runs = []
    for r, kind, threads in [(1, "1f1b", False), (2, "1f1b", True), (4, "gpipe", False)]:
        pipeline.replan(r, kind)
        runs.append(pipeline.train(steps=2, seed=3, threads=threads))
    (losses, digests), *others = runs
    assert all(o == (losses, digests) for o in others)
    assert losses[1] < losses[0]


def test_pipelined_losses_match_the_unpipelined_model_within_float_rounding(pipeline):
    t = TransformerConfig(**SHAPE)
    opt = optax.adam(1e-2)

    def apply_fn(state, grads):
        updates, opt_state = opt.update(grads, state[1], state[0])
        return optax.apply_updates(state[0], updates), opt_state

    whole = build_programs(init_state=lambda key: (lambda p: (p, opt.init(p)))(init_params(key, t)),
                           grad_fn=lambda state, b: jax.value_and_grad(functools.partial(loss_fn, tcfg=t))(state[0], b),
                           apply_fn=apply_fn, batch_spec=SPEC, devices_per_slice=1, num_microbatches=M)
    expected, _ = run_reference(whole, DATA, steps=2, seed=3)
    pipeline.replan(1, "1f1b")
    got, _ = pipeline.train(steps=2, seed=3)
    np.testing.assert_allclose(got, expected, rtol=2e-6)


def test_1f1b_holds_fewer_activation_bytes_than_gpipe(pipeline):
    peaks = {}
    for kind in ("gpipe", "1f1b"):
        pipeline.replan(1, kind)
        pipeline.init(0)
        peaks[kind] = pipeline.step(0)[1].peak_bytes
    act = 4 * 8 * 16 * 4
    assert peaks["gpipe"][1] >= M * act
    assert peaks["1f1b"][1] < peaks["gpipe"][1] and peaks["1f1b"][2] < peaks["gpipe"][2]


def cut(loss, params, num_stages=2):
    return build_programs(init_params=lambda key: params, loss=loss, optimizer=optax.sgd(0.1),
                          batch_spec={"x": ((2, 3), np.float32)}, num_stages=num_stages, devices_per_slice=1,
                          num_microbatches=2)


PARAMS = {"a": jnp.ones((3, 3)), "b": jnp.ones((3, 3))}


def test_a_mark_inside_a_scan_is_refused_saying_where():
    def loss(p, batch):
        def body(h, _):
            return elastic.pipeline_stage(jnp.tanh(h @ p["a"])), None
        h, _ = jax.lax.scan(body, batch["x"], None, length=2)
        return jnp.sum(h @ p["b"])
    with pytest.raises(ProgramExportError, match="mark 0 is called inside lax.scan"):
        cut(loss, PARAMS)


def test_the_wrong_number_of_marks_is_refused():
    def loss(p, batch):
        return jnp.sum(elastic.pipeline_stage(batch["x"] @ p["a"]) @ p["b"])
    with pytest.raises(ProgramExportError, match="dcn_pipeline_parallelism=3 needs 2 elastic.pipeline_stage"):
        cut(loss, PARAMS, num_stages=3)


def test_a_parameter_read_by_two_stages_is_refused_by_name():
    def loss(p, batch):   # "a" is tied: read before and after the mark
        h = elastic.pipeline_stage(batch["x"] @ p["a"])
        return jnp.sum(h @ p["a"].T @ p["b"])
    with pytest.raises(ProgramExportError, match=r"parameter \['a'\] is read by pipeline stages \[0, 1\]"):
        cut(loss, PARAMS)


def test_a_mark_that_carries_no_array_is_refused():
    def loss(p, batch):
        elastic.pipeline_stage(())
        return jnp.sum(batch["x"] @ p["a"] @ p["b"])
    with pytest.raises(ProgramExportError, match="mark 0 carries no array"):
        cut(loss, PARAMS)


def test_outside_the_runtime_the_mark_is_the_identity():
    x = jnp.arange(3.0)
    assert elastic.pipeline_stage(x) is x
    assert jax.jit(elastic.pipeline_stage)(x).tolist() == [0.0, 1.0, 2.0]


def test_a_pipelined_job_with_backups_or_through_wrap_is_refused_naming_the_key(tmp_path):
    from elastic.models import make_model

    cfg = elastic.load_config("tiny", ["dcn_pipeline_parallelism=2", "elastic_spares=1", "load_parameters_path=/elsewhere",
                                       f"base_output_directory={tmp_path}"])
    init, loss, data = make_model(cfg)
    trainer = elastic.Trainer(init=init, loss=loss, optimizer=optax.sgd(0.1), data=data, config=cfg)
    with pytest.raises(elastic.ConfigError, match="config key 'load_parameters_path' .'/elsewhere'. is not supported "
                                                  "with dcn_pipeline_parallelism=2 yet"):
        trainer.fit()
    job = elastic.wrap(lambda state, batch: (state, {"loss": 0.0}), init_state=lambda key: {}, data=data, config=cfg)
    with pytest.raises(elastic.ConfigError, match="elastic.wrap.s step takes its own gradients, so it cannot be cut into stages; build an elastic.Trainer"):
        job.fit(reference=True)
    assert not any(tmp_path.iterdir())   # refused before anything was written


def test_more_stages_than_the_bundled_models_layers_is_one_config_error_line():
    from elastic.models import make_model

    cfg = elastic.load_config("tiny", ["dcn_pipeline_parallelism=4"])   # tiny has 2 decoder layers
    with pytest.raises(elastic.ConfigError, match=r"^dcn_pipeline_parallelism=4: the bundled transformer needs at "
                                                  r"least one decoder layer per pipeline stage, and "
                                                  r"base_num_decoder_layers is 2$"):
        make_model(cfg)
