"""An MLP regressor in Flax NNX: ``nnx.Optimizer``, ``nnx.value_and_grad`` and an ``nnx.jit`` step.

``original.py`` is the loop before jax-elastic, ``elastic_version.py`` the same
file made elastic; examples/README.md shows the diff and how to run both.
"""

import argparse

import jax
import numpy as np
import optax
from flax import nnx

BATCH_SIZE = 16
IN_DIM, HIDDEN, OUT_DIM = 8, 32, 2


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(IN_DIM, HIDDEN, rngs=rngs)
        self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, OUT_DIM, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.gelu(self.norm(self.hidden(x))))


def create(key):
    model = MLP(nnx.Rngs(params=key))
    return model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)


def get_batch(step, batch_size=BATCH_SIZE):
    """Batch ``step`` of a synthetic regression task: y = [sin(x0 + x1), x2 * x3] plus noise."""
    rng = np.random.default_rng(step)
    x = rng.uniform(-1, 1, size=(batch_size, IN_DIM)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0] + x[:, 1]), x[:, 2] * x[:, 3]], axis=1)
    return {"x": x, "y": (y + 0.01 * rng.normal(size=y.shape)).astype(np.float32)}


@nnx.jit
def train_step(model, optimizer, batch):
    def loss_fn(model):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def main(steps=20, seed=0):
    model, optimizer = create(jax.random.key(seed))
    losses = []
    for step in range(steps):
        loss = train_step(model, optimizer, get_batch(step))
        losses.append(float(loss))
        print(f"step {step:3d}  loss {losses[-1]:.6f}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    main(parser.parse_args().steps)
