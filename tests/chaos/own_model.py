"""A user's own model, as the chaos tests of a user's suite would have it: not the bundled one.

A two-layer MLP regression with optax, its fused train step under ``@jax.jit``
(as existing loops write it), made elastic by one mark and ``elastic.wrap``.
``make_job(config)`` is the factory the CLI takes (``--trainer
tests.chaos.own_model:make_job``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import elastic

FEATURES = 8


def init_params(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (FEATURES, 16)) * 0.3, "w2": jax.random.normal(k2, (16, 1)) * 0.3}


def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


OPT = optax.sgd(0.05, momentum=0.9)


@jax.jit
def train_step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    grads = elastic.cross_slice_mean(grads)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": loss}


def make_batch(step, microbatch, size):
    rng = np.random.default_rng([step, microbatch])
    x = rng.normal(size=(size, FEATURES)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)}


def make_job(config):
    size = config.microbatch_size
    data = elastic.FunctionSource(lambda step, m: make_batch(step, m, size),
                                  {"x": ((size, FEATURES), np.float32), "y": ((size, 1), np.float32)})
    return elastic.wrap(train_step, init_state=lambda key: (init_params(key), OPT.init(init_params(key))),
                        data=data, config=config)
