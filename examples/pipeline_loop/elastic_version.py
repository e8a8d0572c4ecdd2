"""A deeper MLP trained with plain JAX + optax, its loss split into two halves for a two-stage pipeline.

``original.py`` is the loop before jax-elastic, ``elastic_version.py`` the same
file with its forward pass cut into pipeline stages; examples/README.md shows
the diff and how to run both.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import elastic

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
        if i == DEPTH // 2:
            hidden = elastic.pipeline_stage(hidden)   # the second stage starts here
        hidden = jax.nn.relu(hidden @ layer["w"] + layer["b"])
    logits = hidden @ params["out"]
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


def make_job(cfg):
    """The pipelined job for ``cfg`` (``dcn_pipeline_parallelism=2``; ``elastic run tiny --trainer
    examples.pipeline_loop.elastic_version:make_job dcn_pipeline_parallelism=2 --reference``)."""
    size = cfg.microbatch_size
    data = elastic.FunctionSource(functools.partial(get_microbatch, size=size, count=cfg.microbatches),
                                  element_spec={"x": ((size, IN_DIM), np.float32), "y": ((size,), np.int32)})
    return elastic.Trainer(init=init_params, loss=loss_fn, optimizer=optimizer, data=data, config=cfg)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--plain", action="store_true", help="run the loop without the runtime")
    args = parser.parse_args()
    if args.plain:
        main(args.steps)
    else:   # two pipeline stages of 1 device, 4 microbatches of 4 examples: the plain loop's batch of 16
        config = elastic.load_config("tiny", [f"steps={args.steps}", "dcn_pipeline_parallelism=2",
                                              "dcn_data_parallelism=1", "ici_fsdp_parallelism=1",
                                              "per_device_batch_size=4", "elastic_microbatches=4"])
        print(make_job(config).fit(reference=True)["losses"])
