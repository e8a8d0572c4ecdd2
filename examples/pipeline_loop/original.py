"""A deeper MLP trained with plain JAX + optax, its loss split into two halves for a two-stage pipeline.

``original.py`` is the loop before jax-elastic, ``elastic_version.py`` the same
file with its forward pass cut into pipeline stages; examples/README.md shows
the diff and how to run both.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

BATCH_SIZE = 16
IN_DIM, HIDDEN, CLASSES, DEPTH = 16, 32, 4, 4
optimizer = optax.adam(1e-2)


def init_params(key):
    keys = jax.random.split(key, DEPTH + 1)
    dims = [IN_DIM] + [HIDDEN] * DEPTH
    layers = [{"w": jax.random.normal(k, (a, b)) * a ** -0.5, "b": jnp.zeros(b)}
              for k, a, b in zip(keys, dims, dims[1:])]
    return {"layers": layers, "out": jax.random.normal(keys[-1], (HIDDEN, CLASSES)) * HIDDEN ** -0.5}


def loss_fn(params, batch):
    hidden = batch["x"]
    for i, layer in enumerate(params["layers"]):
        hidden = jax.nn.relu(hidden @ layer["w"] + layer["b"])
    logits = hidden @ params["out"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def get_batch(step, batch_size=BATCH_SIZE):
    """Batch ``step`` of a synthetic dataset: the label is the largest of the first CLASSES features."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(batch_size, IN_DIM)).astype(np.float32)
    return {"x": x, "y": x[:, :CLASSES].argmax(axis=1).astype(np.int32)}


@jax.jit
def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def main(steps=20, seed=0):
    params = init_params(jax.random.key(seed))
    opt_state = optimizer.init(params)
    losses = []
    for step in range(steps):
        params, opt_state, loss = train_step(params, opt_state, get_batch(step))
        losses.append(float(loss))
        print(f"step {step:3d}  loss {losses[-1]:.6f}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    main(parser.parse_args().steps)
