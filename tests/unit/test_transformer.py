"""Unit tests for the bundled transformer and its synthetic data."""

import math
import pickle
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from elastic.models import (SyntheticTokens, TransformerConfig, forward, init_params, loss_fn, make_model,
                            training_tflops)

TINY = TransformerConfig(vocab_size=64, max_target_length=32, emb_dim=32, num_layers=2, num_heads=2, mlp_dim=64)


def _maxtext_like(**overrides):
    keys = dict(
        vocab_size=64, max_target_length=32, base_emb_dim=32, base_num_decoder_layers=2,
        base_num_query_heads=2, base_mlp_dim=64, seed=3, per_device_batch_size=2, ici_fsdp_parallelism=4,
    )
    return types.SimpleNamespace(**{**keys, **overrides})


def test_from_config_and_validation():
    assert TransformerConfig.from_config(_maxtext_like()) == TINY
    with pytest.raises(ValueError, match="num_heads"):
        TransformerConfig(64, 32, 30, 1, 4, 64)


def test_init_is_deterministic_float32_with_expected_shapes():
    a, b = init_params(jax.random.key(0), TINY), init_params(jax.random.key(0), TINY)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == jnp.float32 and np.array_equal(x, y)
    assert a["embed"].shape == (64, 32) and a["unembed"].shape == (32, 64)
    assert a["layer_1"]["qkv"].shape == (32, 96) and a["layer_1"]["mlp_in"].shape == (32, 64)
    assert "layer_2" not in a
    c = init_params(jax.random.key(1), TINY)
    assert not np.array_equal(a["embed"], c["embed"])


def test_forward_shape_and_initial_loss_near_log_vocab():
    params = init_params(jax.random.key(0), TINY)
    batch = SyntheticTokens(0, 64, 32, 4).batch(0, 0)
    assert forward(params, batch["inputs"], TINY).shape == (4, 32, 64)
    loss = jax.jit(loss_fn, static_argnums=2)(params, batch, TINY)
    assert loss.shape == () and loss.dtype == jnp.float32
    assert abs(float(loss) - math.log(64)) < 0.2


def test_attention_is_causal():
    params = init_params(jax.random.key(0), TINY)
    inputs = SyntheticTokens(0, 64, 32, 2).batch(0, 0)["inputs"]
    changed = inputs.copy()
    changed[:, 20] = (changed[:, 20] + 7) % 64
    a, b = forward(params, inputs, TINY), forward(params, changed, TINY)
    np.testing.assert_array_equal(a[:, :20], b[:, :20])
    assert not np.allclose(a[:, 20:], b[:, 20:])


def test_synthetic_tokens_are_shifted_progressions():
    src = SyntheticTokens(seed=1, vocab_size=64, seq_len=32, microbatch_size=8)
    b = src.batch(2, 3)
    assert b["inputs"].dtype == np.int32 and b["inputs"].shape == (8, 32)
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    stride = (b["targets"] - b["inputs"]) % 64
    assert np.all(stride == stride[:, :1]) and set(stride[:, 0]) <= set(SyntheticTokens.STRIDES)
    assert not np.array_equal(b["inputs"], SyntheticTokens(2, 64, 32, 8).batch(2, 3)["inputs"])


def test_adam_reduces_loss():
    init, loss, data = make_model(_maxtext_like(per_device_batch_size=2, ici_fsdp_parallelism=4))
    assert data.microbatch_size == 8
    opt = optax.adam(3e-3)
    params = init(jax.random.key(0))
    state = opt.init(params)

    @jax.jit
    def step(params, state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for s in range(30):
        params, state, value = step(params, state, data.batch(s, 0))
        losses.append(float(value))
    assert np.isfinite(losses).all()
    assert np.mean(losses[-3:]) < 0.8 * losses[0], losses


def test_make_model_pickles_and_rejects_fractional_batch():
    init, _, _ = pickle.loads(pickle.dumps(make_model(_maxtext_like())))
    assert jax.tree.structure(init(jax.random.key(0))) == jax.tree.structure(init_params(jax.random.key(0), TINY))
    with pytest.raises(ValueError, match="positive integer"):
        make_model(_maxtext_like(per_device_batch_size=0.5, ici_fsdp_parallelism=1))


def test_training_tflops_is_what_xla_counts_for_a_step_and_the_bundled_run_writes_it():
    # perf/per_device_tflops of the bundled model: its estimate, against XLA's count of the compiled grad step
    # (a shape where the matrix products dominate, as in any model worth measuring).
    import elastic
    from elastic.cli_support import bundled_trainer

    t = TransformerConfig(vocab_size=256, max_target_length=64, emb_dim=128, num_layers=2, num_heads=4, mlp_dim=512)
    params = jax.eval_shape(lambda: init_params(jax.random.key(0), t))
    batch = {k: jax.ShapeDtypeStruct((4, 64), jnp.int32) for k in ("inputs", "targets")}
    cost = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, t))).lower(params, batch).compile().cost_analysis()
    counted = (cost[0] if isinstance(cost, list) else cost)["flops"] / 1e12
    assert 0.9 < counted / training_tflops(t, 4) < 1.1
    cfg = elastic.load_config("tiny", [])
    assert bundled_trainer(cfg).model_metrics.tflops_per_step == training_tflops(
        TransformerConfig.from_config(cfg), cfg.global_batch_size) > 0
