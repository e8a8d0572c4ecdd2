"""A tiny next-token language model whose ``jax.jit`` step accumulates gradients over sub-batches.

The step splits its batch into ``ACCUM_STEPS`` sub-batches, sums their
gradients with ``lax.scan`` (peak memory of one sub-batch) and makes one
optimizer update. ``original.py`` is the loop before jax-elastic,
``elastic_version.py`` the same file made elastic; examples/README.md shows
the diff and how to run both.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

BATCH_SIZE = 16
ACCUM_STEPS = 4
VOCAB, SEQ_LEN, EMBED, HIDDEN = 32, 16, 16, 64
optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))


def init_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"embed": jax.random.normal(k1, (VOCAB, EMBED)) * 0.1,
            "w1": jax.random.normal(k2, (2 * EMBED, HIDDEN)) * (2 * EMBED) ** -0.5, "b1": jnp.zeros(HIDDEN),
            "w2": jax.random.normal(k3, (HIDDEN, VOCAB)) * HIDDEN ** -0.5}


def init_state(key):
    params = init_params(key)
    return params, optimizer.init(params)


def loss_fn(params, batch):
    """Mean cross-entropy of predicting token t+1 from tokens t-1 and t."""
    emb = params["embed"][batch["tokens"]]                     # [B, T, E]
    context = jnp.concatenate([emb[:, :-2], emb[:, 1:-1]], -1)  # tokens t-1, t for t = 1 .. T-2
    hidden = jax.nn.relu(context @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 2:]).mean()


def get_batch(step, batch_size=BATCH_SIZE):
    """Batch ``step`` of synthetic sequences: count up by a per-sequence stride (1 or 2) from a random token."""
    rng = np.random.default_rng(step)
    start = rng.integers(0, VOCAB, size=(batch_size, 1))
    stride = rng.integers(1, 3, size=(batch_size, 1))
    return {"tokens": ((start + stride * np.arange(SEQ_LEN)) % VOCAB).astype(np.int32)}


@jax.jit
def train_step(state, batch):
    params, opt_state = state
    sub_batches = jax.tree.map(lambda x: x.reshape(ACCUM_STEPS, -1, *x.shape[1:]), batch)

    def accumulate(carry, sub_batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, sub_batch)
        return jax.tree.map(jnp.add, carry, (loss, grads)), None

    zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = lax.scan(accumulate, zeros, sub_batches)
    loss, grads = jax.tree.map(lambda x: x / ACCUM_STEPS, (loss, grads))
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": loss}


def main(steps=20, seed=0):
    state = init_state(jax.random.key(seed))
    losses = []
    for step in range(steps):
        state, metrics = train_step(state, get_batch(step))
        losses.append(float(metrics["loss"]))
        print(f"step {step:3d}  loss {losses[-1]:.6f}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    main(parser.parse_args().steps)
