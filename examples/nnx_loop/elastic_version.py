"""An MLP regressor in Flax NNX: ``nnx.Optimizer``, ``nnx.value_and_grad`` and an ``nnx.jit`` step.

``original.py`` is the loop before jax-elastic, ``elastic_version.py`` the same
file made elastic; examples/README.md shows the diff and how to run both.
"""

import argparse
import functools

import jax
import numpy as np
import optax
from flax import nnx

import elastic

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


def get_microbatch(step, microbatch, size, count):
    """Microbatch ``microbatch`` of step ``step``: ``size`` examples of ``get_batch(step, size * count)``."""
    batch = get_batch(step, size * count)
    return {k: v[microbatch * size:(microbatch + 1) * size] for k, v in batch.items()}


@nnx.jit
def train_step(model, optimizer, batch):
    def loss_fn(model):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    grads = elastic.cross_slice_mean(grads)   # the gradient sync point: mean over the global batch
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


def make_job(cfg):
    """The elastic job for ``cfg`` (``elastic chaos --trainer examples.nnx_loop.elastic_version:make_job``)."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: create(jax.random.key(0))))

    def step(state, batch):   # train_step as (state, batch) -> (state, metrics), the form elastic.wrap takes
        model, optimizer = nnx.merge(graphdef, state)
        loss = train_step(model, optimizer, batch)
        return nnx.state((model, optimizer)), {"loss": loss}

    size = cfg.microbatch_size
    data = elastic.FunctionSource(functools.partial(get_microbatch, size=size, count=cfg.microbatches),
                                  element_spec={"x": ((size, IN_DIM), np.float32), "y": ((size, OUT_DIM), np.float32)})
    return elastic.wrap(step, init_state=lambda key: nnx.state(create(key)), data=data, config=cfg)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--plain", action="store_true", help="run the loop above in plain JAX, without the runtime")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides of the elastic run")
    args = parser.parse_args()
    if args.plain:
        main(args.steps)
    else:   # on local workers; the bundled tiny config: 4 slices x 2 devices, 4 microbatches of 4 examples
        cfg = elastic.load_config("tiny", ["run_name=nnx_loop", f"steps={args.steps}", *args.overrides])
        make_job(cfg).fit(on_step=lambda step, loss: print(f"step {step:3d}  loss {loss:.6f}"))
