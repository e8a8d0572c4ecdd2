"""MaxText's decoder cut into pipeline stages: an :class:`elastic.Trainer` job of MaxText's own pieces.

With ``dcn_pipeline_parallelism = S`` > 1, :func:`make_pipeline_job` trains
MaxText's model as S stage programs on S x R virtual slices
(``docs/pipeline.md``, ``docs/maxtext.md``). MaxText's fused train step
cannot be cut (it takes its own gradients), so the job is built from its
parts:

- the loss is MaxText's ``loss_fn`` on MaxText's NNX model, with an
  ``elastic.pipeline_stage`` mark on the input of decoder layer
  ``k * L / S`` for k = 1 .. S-1: stage 0 holds the embedding and the first
  L/S layers, the last stage the last L/S layers, the final norm, the output
  head and the loss. The marks are put in while the loss is traced, around
  the decoder's per-layer calls (:func:`_marked_layers`); the model and its
  parameters are MaxText's unchanged;
- the parameters are MaxText's, initialised as its trainer initialises them
  (``PRNGKey(init_weights_seed)`` under ``unsafe_rbg``);
- the optimizer is MaxText's (``create_training_optimizer``), after MaxText's
  gradient clipping (``clip_by_global_norm(gradient_clipping_threshold)``).
  Each stage updates its own parameters, so the clipping norm is the stage's
  own, not the whole model's (documented in docs/maxtext.md).

The loss is traced layer by layer, so this side builds the model with
``scan_layers=false`` (a mark cannot sit inside a scan); that changes the
parameters' layout (one subtree per layer), not the math.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

import elastic
from integrations.maxtext.data import MAXTEXT_PRNG_IMPL
from integrations.maxtext.slice import draws_random, maxtext_key, maxtext_model, slice_mesh

__all__ = ["PipelineKeys", "StagePieces", "check_pipelined", "make_pipeline_job", "pipeline_keys"]


@dataclasses.dataclass(frozen=True)
class PipelineKeys:
    """What the pipeline keys set: MaxText's side of the config, and jax-elastic's microbatch count."""

    maxtext: dict          # the MaxText config jax-elastic builds each stage's model from: these keys forced
    microbatches: int = 0  # elastic_microbatches (0: not pipelined, the usual rule)


def pipeline_keys(user, stages: int, slices: int, path) -> PipelineKeys:
    """What ``dcn_pipeline_parallelism = stages`` > 1 sets on each side, keeping MaxText's global batch
    (``user``: the keys the user set, key -> (value, where); ``path``: the config file, whose chain as MaxText
    merges it gives ``per_device_batch_size`` when the user set none).

    MaxText's pipelined run trains ``per_device_batch_size`` x (stages x slices x devices) examples a step in
    ``num_pipeline_microbatches`` microbatches (default: ``stages``) per data replica. jax-elastic gives each of
    its ``num_pipeline_microbatches`` x ``slices`` microbatches to one pipeline replica, so a device of a slice
    takes ``per_device_batch_size`` x stages / ``num_pipeline_microbatches`` examples of each (a whole number)."""
    if stages == 1:
        nmb = user.get("num_pipeline_microbatches")
        if nmb is not None and nmb[0] not in (-1, None):
            raise elastic.ConfigError(f"config key 'num_pipeline_microbatches' ({nmb[0]!r}, in {nmb[1]}) has no "
                                      "effect without dcn_pipeline_parallelism > 1")
        return PipelineKeys({})
    where = {k: f"{k}={user[k][0]!r} (in {user[k][1]})" for k in user}
    accum = user.get("gradient_accumulation_steps", (1, ""))[0]
    if accum != 1:
        raise elastic.ConfigError(f"config key {where['gradient_accumulation_steps']} with dcn_pipeline_parallelism="
                                  f"{stages}: a pipelined step's microbatches are num_pipeline_microbatches; drop "
                                  "gradient_accumulation_steps")
    nmb = user.get("num_pipeline_microbatches", (-1, ""))[0]
    if nmb in (-1, None):
        nmb = stages   # MaxText's default
    if not isinstance(nmb, int) or isinstance(nmb, bool) or nmb < 1:
        raise elastic.ConfigError(f"config key {where['num_pipeline_microbatches']} must be a whole number >= 1 "
                                  "(or -1: one per stage)")
    if "per_device_batch_size" in user:
        batch = user["per_device_batch_size"][0]
    else:
        from maxtext.configs import pyconfig

        batch = pyconfig._load_config(str(path)).get("per_device_batch_size")   # MaxText's files of the chain
    rows = float(batch) * stages / nmb
    if rows < 1 or not rows.is_integer():
        raise elastic.ConfigError(
            f"per_device_batch_size ({batch}) x dcn_pipeline_parallelism ({stages}) / num_pipeline_microbatches "
            f"({nmb}) is {rows:g}: each device takes that many examples of a microbatch, which must be a whole "
            "number >= 1; change one of them")
    m = nmb * slices
    if "elastic_microbatches" in user and user["elastic_microbatches"][0] != m:
        raise elastic.ConfigError(f"config key {where['elastic_microbatches']} contradicts num_pipeline_microbatches "
                                  f"({nmb}) x dcn_data_parallelism ({slices}) = {m}; set only "
                                  "num_pipeline_microbatches")
    return PipelineKeys({"dcn_pipeline_parallelism": 1, "num_pipeline_microbatches": -1, "per_device_batch_size":
                       int(rows), "scan_layers": False}, m)


def check_pipelined(mt, stages: int) -> None:
    """ConfigError (one line, naming the key) for a MaxText model this module cannot cut into ``stages``."""
    layers = int(mt.num_decoder_layers)
    if layers % stages:
        raise elastic.ConfigError(f"dcn_pipeline_parallelism={stages} must divide base_num_decoder_layers "
                                  f"({layers}): each stage holds the same number of decoder layers, as in MaxText")
    if bool(getattr(mt, "logits_via_embedding", False)):
        raise elastic.ConfigError(f"logits_via_embedding=true ties the first stage's embedding to the last stage's "
                                  f"output head; set it to false with dcn_pipeline_parallelism={stages}")
    if int(getattr(mt, "num_experts", 1)) > 1:
        raise elastic.ConfigError(f"num_experts={mt.num_experts}: a mixture-of-experts model is not cut into "
                                  "pipeline stages yet (its load-balancing loss sums every layer's routing); set "
                                  "dcn_pipeline_parallelism=1")
    if draws_random(mt):
        raise elastic.ConfigError("dropout (enable_dropout with dropout_rate > 0) or random routing is not "
                                  f"supported with dcn_pipeline_parallelism={stages} yet; set dropout_rate=0")
    block = str(getattr(getattr(mt, "decoder_block", ""), "value", getattr(mt, "decoder_block", "")))
    if block.lower() in _UNCUT_BLOCKS:
        raise elastic.ConfigError(f"decoder_block {block!r} is not cut into pipeline stages yet (its decoder does "
                                  "not run its layers one after another); set dcn_pipeline_parallelism=1")


# Decoders whose layers are not one plain sequence of calls on the activations.
_UNCUT_BLOCKS = ("deepseek", "deepseek4", "gemma3", "gemma4", "qwen3_next", "qwen3_5", "llama4", "gpt_oss")


def make_pipeline_job(elastic_config: elastic.Config, maxtext_config, data) -> elastic.Trainer:
    """An ``elastic.Trainer`` job of MaxText's model in ``dcn_pipeline_parallelism`` stages (module docstring)."""
    stages = elastic_config.dcn_pipeline_parallelism
    check_pipelined(maxtext_config, stages)
    pieces = StagePieces(maxtext_config, elastic_config.devices_per_slice, stages)
    return elastic.Trainer(init=pieces.init, loss=pieces.loss, optimizer=pieces.optimizer(), data=data,
                           config=elastic_config)


class StagePieces:
    """MaxText's parameters, marked loss and optimizer for a slice of ``devices`` devices."""

    def __init__(self, config, devices: int, stages: int):
        import jax
        from flax import nnx

        self.config, self.stages, self.devices = config, stages, int(devices)
        self.mesh = slice_mesh(config, devices)
        abstract = nnx.eval_shape(lambda: self._model(jax.random.key(0, impl=MAXTEXT_PRNG_IMPL)))
        self.graphdef, _, rest = nnx.split(abstract, nnx.Param, ...)
        self.abstract = abstract
        # The model's other state (RNG streams): never read, as nothing in the forward pass draws random numbers
        # (check_pipelined); zeros of its shapes make the model whole.
        self.rest = jax.tree.map(_zeros_of, rest)
        per_stage = int(config.num_decoder_layers) // stages
        self.marks = frozenset(k * per_stage for k in range(1, stages))

    def __reduce__(self):
        """Pickled as how to build it again (its mesh and model definition hold this process's JAX devices), as
        :class:`integrations.maxtext.model._Pieces` is."""
        return (type(self), (self.config, self.devices, self.stages))

    def _model(self, rng_key):
        return maxtext_model(self.config, self.mesh, rng_key)

    def init(self, key):
        """MaxText's initial parameters from ``PRNGKey(seed)`` under ``unsafe_rbg``, as its trainer makes them."""
        from flax import nnx

        return nnx.state(self._model(maxtext_key(key)), nnx.Param)

    def loss(self, params, batch):
        """MaxText's ``loss_fn`` with a stage mark before every ``L / S``-th decoder layer."""
        from flax import nnx
        from flax.core.spmd import logical_axis_rules
        from maxtext.trainers.pre_train import train as maxtext_train

        model = nnx.merge(self.graphdef, params, self.rest, copy=True)
        with logical_axis_rules(self.config.logical_axis_rules), \
                _marked_layers(int(self.config.num_decoder_layers), self.marks):
            loss, _ = maxtext_train.loss_fn(model, self.config, dict(batch), None, None, is_train=True)
        return loss

    def optimizer(self):
        """MaxText's clipping then its optimizer (``create_training_optimizer``), over one stage's parameters."""
        import optax
        from maxtext.utils import train_utils

        _, tx = train_utils.create_training_optimizer(self.config, self.abstract, mesh=self.mesh)
        threshold = float(self.config.gradient_clipping_threshold)
        return optax.chain(optax.clip_by_global_norm(threshold), tx) if threshold > 0 else tx


def _zeros_of(x):
    import jax
    import jax.numpy as jnp

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(jnp.zeros((*x.shape, 4), np.uint32), impl=MAXTEXT_PRNG_IMPL)
    return jnp.zeros(x.shape, x.dtype)


@contextlib.contextmanager
def _marked_layers(layers: int, marks: frozenset):
    """While tracing MaxText's model: the input activations of decoder layer n (n in ``marks``) pass through
    ``elastic.pipeline_stage``.

    MaxText 0.2.5's unscanned decoder calls each layer, in order, through
    ``jax.checkpoint(pure_layer_fn)(graphdef, state, y, ...)`` (whatever
    ``remat_policy`` is); this wraps those calls so the mark sits between
    layers, outside the remat. ConfigError when the decoder did not call
    ``layers`` layers that way (another decoder path: nothing could be cut).
    """
    import jax

    original, calls = jax.checkpoint, [0]

    def checkpoint(fun, *args, **kwargs):
        remat = original(fun, *args, **kwargs)
        if getattr(fun, "__name__", "") != "pure_layer_fn":
            return remat

        def layer(graphdef, state, y, *rest, **more):
            n = calls[0]
            calls[0] += 1
            return remat(graphdef, state, elastic.pipeline_stage(y) if n in marks else y, *rest, **more)
        return layer

    jax.checkpoint = checkpoint
    try:
        yield
    finally:
        jax.checkpoint = original
    if calls[0] != layers:
        raise elastic.ConfigError(f"MaxText's decoder ran {calls[0]} of its {layers} decoder layers one by one; "
                                  "jax-elastic cuts only a decoder that does (a dense decoder, scan_layers=false "
                                  "on jax-elastic's side); set dcn_pipeline_parallelism=1")
