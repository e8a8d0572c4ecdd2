"""An MLP classifier trained with plain JAX + optax: one ``@jax.jit`` step per batch.

``original.py`` is the loop before jax-elastic, ``elastic_version.py`` the same
file made elastic; examples/README.md shows the diff and how to run both.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import elastic

BATCH_SIZE = 16
IN_DIM, HIDDEN, CLASSES = 16, 32, 4
optimizer = optax.adamw(1e-2)


def init_params(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (IN_DIM, HIDDEN)) * IN_DIM ** -0.5, "b1": jnp.zeros(HIDDEN),
            "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) * HIDDEN ** -0.5, "b2": jnp.zeros(CLASSES)}


def init_state(key):
    params = init_params(key)
    return params, optimizer.init(params)


def loss_fn(params, batch):
    hidden = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def get_batch(step, batch_size=BATCH_SIZE):
    """Batch ``step`` of a synthetic dataset: the label is the largest of the first CLASSES features."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(batch_size, IN_DIM)).astype(np.float32)
    return {"x": x, "y": x[:, :CLASSES].argmax(axis=1).astype(np.int32)}


def get_microbatch(step, microbatch, size, count):
    """Microbatch ``microbatch`` of step ``step``: ``size`` examples of ``get_batch(step, size * count)``."""
    batch = get_batch(step, size * count)
    return {k: v[microbatch * size:(microbatch + 1) * size] for k, v in batch.items()}


@jax.jit
def train_step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    grads = elastic.cross_slice_mean(grads)   # the gradient sync point: mean over the global batch
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


def make_job(cfg):
    """The elastic job for ``cfg`` (``elastic chaos --trainer examples.optax_loop.elastic_version:make_job``)."""
    size = cfg.microbatch_size
    data = elastic.FunctionSource(functools.partial(get_microbatch, size=size, count=cfg.microbatches),
                                  element_spec={"x": ((size, IN_DIM), np.float32), "y": ((size,), np.int32)})
    return elastic.wrap(train_step, init_state=init_state, data=data, config=cfg)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--plain", action="store_true", help="run the loop above in plain JAX, without the runtime")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides of the elastic run")
    args = parser.parse_args()
    if args.plain:
        main(args.steps)
    else:   # on local workers; the bundled tiny config: 4 slices x 2 devices, 4 microbatches of 4 examples
        cfg = elastic.load_config("tiny", ["run_name=optax_loop", f"steps={args.steps}", *args.overrides])
        make_job(cfg).fit(on_step=lambda step, loss: print(f"step {step:3d}  loss {loss:.6f}"))
