"""MaxText's model, loss, optimizer and train state as a jax-elastic job.

:func:`make_job` returns an :func:`elastic.wrap` job whose train step is
MaxText 0.2.5's pre-training ``train_step`` (``maxtext.trainers.pre_train.
train``) for the features :mod:`integrations.maxtext.config` accepts, with
the cross-slice mark where MaxText has its raw gradients:

    loss, raw_grads = value_and_grad(MaxText's loss_fn)        # per microbatch (grad program)
    raw_grads = elastic.cross_slice_mean(raw_grads)            # the runtime's canonical tree sum / M
    grads = clip_by_global_norm(raw_grads)                     # MaxText's clipping, after the reduction
    state.apply_gradients(grads)                               # MaxText's optimizer (apply program)

The pieces are MaxText's own: the model (``create_nnx_abstract_model``'s
factory), ``loss_fn``, ``create_training_optimizer``, ``TrainStateNNX``,
``apply_gradient_clipping``. Initialisation is MaxText's: its trainer sets the
``unsafe_rbg`` PRNG and seeds the model with ``PRNGKey(init_weights_seed)``;
the init program derives that key from jax-elastic's seed (which
:func:`~integrations.maxtext.config.load_maxtext_config` sets to
``init_weights_seed``) and uses the same PRNG explicitly.

The runtime's state is a pytree of arrays: MaxText's NNX train state with its
PRNG keys stored as key data (``uint32``), wrapped back inside each program.
Each program is built for one virtual slice: MaxText's mesh there has
``fsdp`` = devices per slice and every other axis 1; jax-elastic places the
state FSDP-style by its own rule, and MaxText's sharding constraints inside
the model stay hints.
"""

from __future__ import annotations

import numpy as np

import elastic
from integrations.maxtext.checkpoints import checkpoint_tree
from integrations.maxtext.config import check_supported
from integrations.maxtext.data import MAXTEXT_PRNG_IMPL
from integrations.maxtext.slice import draws_random, maxtext_jax, maxtext_key, maxtext_model, slice_mesh
from integrations.maxtext.text_data import source_for

__all__ = ["MICROBATCH_KEY", "MicrobatchIndexed", "import_maxtext", "make_job"]

#: The batch key holding a microbatch's global index (``int32``, one per row) when the forward pass draws random
#: numbers (:func:`draws_random`); :func:`make_job` adds it to the data source and the train step removes it
#: before MaxText's loss sees the batch.
MICROBATCH_KEY = "elastic_microbatch"

# The MaxText modules make_job uses; several print as they import (stubs of optional dependencies, transformers).
_MAXTEXT_MODULES = ("maxtext.common.train_state_nnx", "maxtext.utils.model_creation_utils",
                    "maxtext.utils.train_utils", "maxtext.trainers.pre_train.train", "maxtext.utils.maxtext_utils",
                    "maxtext.input_pipeline.synthetic_data_processing")


def import_maxtext() -> None:
    """Imports the MaxText modules :func:`make_job` uses, now (the command line does it while it keeps what
    libraries print off the terminal, before a user's factory runs). Imports JAX."""
    import importlib

    for module in _MAXTEXT_MODULES:
        importlib.import_module(module)


def make_job(elastic_config: elastic.Config, maxtext_config, *, data=None, eval_data=None) -> elastic.WrappedStep:
    """An ``elastic.wrap`` job training MaxText's model; ``.fit()`` runs it.

    ``data``: a jax-elastic data source whose microbatches have MaxText's batch
    keys (``integrations.maxtext.data.KEYS``) with ``microbatch_size`` rows of
    ``max_target_length`` tokens; default the config's own dataset
    (:func:`~integrations.maxtext.text_data.source_for`: MaxText's synthetic
    data, grain ArrayRecord or Parquet files, local Parquet for ``hf``).
    When the forward pass draws random numbers (:func:`draws_random`) the
    source is wrapped in :class:`MicrobatchIndexed`, which adds each
    microbatch's index (:data:`MICROBATCH_KEY`) for its dropout streams.
    With ``eval_interval`` > 0 the live slices compute MaxText's eval loss
    (``eval/avg_loss``: the eval data's cross-entropy sum over its token
    count, with the training step's loss function) on ``eval_data``, default
    the config's eval data (``source_for(..., split="eval")``: its eval files,
    or the synthetic data); ``elastic.ConfigError`` naming ``eval_interval``
    when the config names none.
    Persistent checkpoints are written in MaxText's layout
    (:mod:`integrations.maxtext.checkpoints`). Called in the client, which needs ``devices_per_slice`` local
    JAX devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before
    JAX starts; ``python -m integrations.maxtext`` sets it). The programs are
    traced and exported here, under MaxText's JAX settings, so ``fit`` only
    runs them (``job.with_config`` keeps them for the same slice shape and
    microbatch count, as the chaos harness uses it). Raises
    ``elastic.ConfigError`` when the two configs were not made for each other,
    ``ProgramExportError`` when MaxText's step cannot be exported.
    """
    _check_pair(elastic_config, maxtext_config)
    if data is None:   # MaxText's dataset_type: synthetic, grain (ArrayRecord, Parquet), hf (local Parquet)
        data = source_for(elastic_config, maxtext_config)
    evaluates = elastic_config.eval_interval > 0
    if evaluates and int(getattr(maxtext_config, "eval_start_step", 0) or 0):
        raise elastic.ConfigError(f"config key 'eval_start_step' ({maxtext_config.eval_start_step}) is not "
                                  "supported under jax-elastic: evals follow step 0 and every eval_interval steps "
                                  "after it; set eval_start_step=0")
    if evaluates and eval_data is None:
        eval_data = source_for(elastic_config, maxtext_config, split="eval")
        if eval_data is None:
            raise elastic.ConfigError(f"config key 'eval_interval' is {elastic_config.eval_interval}, but the MaxText "
                                      "config names no eval data (grain_eval_files, or hf_eval_files with "
                                      "dataset_type=hf); set them, or eval_interval=-1")
    if elastic_config.dcn_pipeline_parallelism > 1:   # MaxText's decoder cut into stages (its own module)
        from integrations.maxtext.pipeline import make_pipeline_job

        job = make_pipeline_job(elastic_config, maxtext_config, data)
    else:
        if draws_random(maxtext_config):   # each microbatch draws its own dropout masks: the step needs its index
            data = MicrobatchIndexed(data, elastic_config.microbatch_size)
            if eval_data is not None:
                eval_data = MicrobatchIndexed(eval_data, elastic_config.microbatch_size)
        pieces = _Pieces(maxtext_config, elastic_config.devices_per_slice, elastic_config.microbatches)
        job = elastic.wrap(pieces.train_step, init_state=pieces.init_state, data=data, config=elastic_config,
                           checkpoint_tree=checkpoint_tree(pieces.shapes, pieces.is_key, MAXTEXT_PRNG_IMPL),
                           eval_data=eval_data if evaluates else None, eval_keys=("total_loss", "total_weights"))
    with maxtext_jax(maxtext_config):
        job.programs()   # trace and export now, under MaxText's PRNG and mesh-typing settings
    job.model_metrics = model_metrics(elastic_config, maxtext_config)
    return job


def model_metrics(elastic_config: elastic.Config, maxtext_config) -> elastic.ModelMetrics:
    """MaxText's learning-rate schedule, tokens and TFLOPs of a step (what its ``MetricLogger`` divides by the step
    time), for the client's metrics (:mod:`elastic.metrics`). MaxText's per-device figures are of its config,
    built for one slice and one microbatch: a step is ``microbatches`` of them on every device of a slice."""
    from maxtext.utils import maxtext_utils

    schedule = maxtext_utils.create_learning_rate_schedule(maxtext_config)
    per_step = elastic_config.devices_per_slice * elastic_config.microbatches
    try:
        tflops = float(maxtext_utils.calculate_tflops_training_per_device(maxtext_config, log=False)[0]) * per_step
    except Exception:  # noqa: BLE001 - MaxText's estimate does not cover every model; the scalar is then left out
        tflops = 0.0
    tokens = float(maxtext_utils.calculate_tokens_training_per_device(maxtext_config)) * per_step
    return elastic.ModelMetrics(learning_rate=lambda step: float(schedule(step)), tflops_per_step=tflops,
                                tokens_per_step=tokens)


class _Pieces:
    """MaxText's train state factory and step for one virtual slice of ``devices`` devices."""

    def __init__(self, config, devices: int, microbatches: int = 1):
        import jax
        from flax import nnx

        self.config, self.microbatches, self.devices = config, int(microbatches), int(devices)
        self.mesh = slice_mesh(config, devices)
        abstract = nnx.eval_shape(lambda: self._create(jax.random.key(0, impl=MAXTEXT_PRNG_IMPL)))
        self.graphdef, self.shapes = nnx.split(abstract)
        self.is_key = jax.tree.map(lambda s: bool(jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key)), self.shapes)

    def __reduce__(self):
        """Pickled as how to build it again (its mesh and model definition hold this process's JAX devices): a
        client-fault chaos run hands the job to a child process, which rebuilds these pieces on its own devices."""
        return (type(self), (self.config, self.devices, self.microbatches))

    def _create(self, rng_key):
        """MaxText's ``create_train_state_fn`` (train_utils.setup_train_loop) seeded with ``rng_key``."""
        from flax import nnx
        from flax.core.spmd import logical_axis_rules
        from maxtext.common import train_state_nnx
        from maxtext.utils import train_utils

        config = self.config
        model = maxtext_model(config, self.mesh, rng_key)
        with logical_axis_rules(config.logical_axis_rules):
            _, tx = train_utils.create_training_optimizer(config, model, mesh=self.mesh)
            return train_state_nnx.TrainStateNNX(model, nnx.Optimizer(model, tx, wrt=nnx.Param))

    def init_state(self, key):
        """The init program: MaxText's initial train state from ``PRNGKey(seed)`` under ``unsafe_rbg``."""
        from flax import nnx

        return self._to_arrays(nnx.state(self._create(maxtext_key(key))))

    def train_step(self, state, batch):
        """MaxText's NNX ``train_step`` (its path without gradient accumulation), marked where its raw gradients
        are complete; microbatch ``batch[MICROBATCH_KEY]`` draws its own random numbers (module docstring)."""
        import jax
        import jax.numpy as jnp
        from flax import nnx
        from flax.core.spmd import logical_axis_rules
        from maxtext.trainers.pre_train import train as maxtext_train
        from maxtext.utils import maxtext_utils

        config = self.config
        batch = dict(batch)
        index = batch.pop(MICROBATCH_KEY, None)
        ts = nnx.merge(self.graphdef, self._from_arrays(state))
        nnx.pop(ts.model, nnx.Intermediate)
        model_graphdef, params, rest = nnx.split(ts.model, nnx.Param, ...)
        if index is None:
            updated = nnx.Not(nnx.Any(nnx.Param, nnx.Intermediate))   # MaxText's non_param_rest
        else:
            rest = _microbatch_streams(rest, index[0], self.microbatches)
            updated = nnx.Not(nnx.Any(nnx.Param, nnx.Intermediate, nnx.RngKey))   # the step's keys stay

        def loss_of(params, rest, data):
            local = nnx.merge(model_graphdef, params, rest, copy=True)
            loss, aux = maxtext_train.loss_fn(local, config, dict(data), None, None, is_train=True)
            return loss, (aux, nnx.state(local, updated))

        with logical_axis_rules(config.logical_axis_rules):
            (loss, (aux, non_param)), raw_grads = jax.value_and_grad(loss_of, has_aux=True)(params, rest, batch)
        nnx.update(ts.model, non_param)   # e.g. RNG stream counts: they never depend on the batch
        raw_grads = jax.tree.map(lambda g: g.astype(config.grad_dtype) if g.dtype == jnp.float32 else g, raw_grads)
        raw_grads = elastic.cross_slice_mean(raw_grads)
        grads = raw_grads
        if config.gradient_clipping_threshold > 0:
            grads = maxtext_utils.apply_gradient_clipping(raw_grads, None, config.gradient_clipping_threshold)
        ts.apply_gradients(grads)
        # MaxText's eval sums (eval_step's evaluation/total_loss and total_weights): the eval program reads them
        return self._to_arrays(nnx.state(ts, nnx.Not(nnx.Intermediate))), {
            "loss": loss, "total_loss": aux["xent_sum"], "total_weights": aux["total_weights"]}

    def _to_arrays(self, state):
        import jax

        return jax.tree.map(lambda x, k: jax.random.key_data(x) if k else x, state, self.is_key)

    def _from_arrays(self, state):
        import jax

        return jax.tree.map(lambda x, k: jax.random.wrap_key_data(x, impl=MAXTEXT_PRNG_IMPL) if k else x,
                            state, self.is_key)


class MicrobatchIndexed:
    """A data source whose microbatches also carry their global index: ``batch(step, m)[MICROBATCH_KEY]`` is
    ``m`` once for each of the microbatch's ``rows`` (``int32``), beside the wrapped ``source``'s keys. Pure and
    picklable as ``source`` is."""

    def __init__(self, source, rows: int):
        if MICROBATCH_KEY in source.element_spec():
            raise elastic.ConfigError(f"the data source already has a batch key {MICROBATCH_KEY!r}; the MaxText "
                                      "integration adds it (a microbatch's index, for its dropout masks)")
        self.source, self.rows = source, int(rows)

    def element_spec(self):
        return {**self.source.element_spec(), MICROBATCH_KEY: ((self.rows,), np.dtype(np.int32))}

    def batch(self, step: int, microbatch: int):
        return {**self.source.batch(step, microbatch), MICROBATCH_KEY: np.full((self.rows,), microbatch, np.int32)}

    def __repr__(self) -> str:
        return f"MicrobatchIndexed({self.source!r})"


def _microbatch_streams(rest, index, microbatches: int):
    """``rest`` (the model's non-parameter state) with microbatch ``index``'s RNG stream keys: each ``RngKey``
    itself for microbatch 0, else the ``index``-th of ``microbatches`` keys split from it.

    Split, not ``fold_in``: under MaxText's ``unsafe_rbg`` a fold is an XOR with a hash of the value, so folding
    the microbatch into a key that the stream then folds its count into would make microbatch ``a`` at count
    ``b`` draw what microbatch ``b`` draws at count ``a``.
    """
    import jax
    import jax.numpy as jnp

    index = jnp.asarray(index, jnp.int32)

    def streams(x):
        if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return x
        flat = x.reshape(-1)
        split = jax.vmap(lambda k: jax.random.split(k, max(microbatches, 2)))(flat)   # (keys, microbatches)
        own = jax.random.key_data(jnp.take(split, jnp.clip(index, 0, microbatches - 1), axis=1))
        data = jax.random.key_data(flat)
        chosen = jnp.where(index == 0, data, own)
        return jax.random.wrap_key_data(chosen, impl=jax.random.key_impl(x)).reshape(x.shape)

    return jax.tree.map(streams, rest)


def _check_pair(ec: elastic.Config, mt) -> None:
    """The MaxText config must be the one load_maxtext_config built for ``ec``'s slices."""
    want = {"num_slices": 1, "gradient_accumulation_steps": 1, "micro_batch_size_to_train_on": ec.microbatch_size,
            "steps": ec.steps}
    got = {k: getattr(mt, k, None) for k in want}
    fsdp = dict(zip(mt.mesh_axes, mt.ici_parallelism)).get("fsdp")
    others = [n for a, n in zip(mt.mesh_axes, mt.ici_parallelism) if a != "fsdp" and n != 1]
    if got != want or fsdp != ec.devices_per_slice or others or any(n != 1 for n in mt.dcn_parallelism):
        raise elastic.ConfigError(
            f"the MaxText config was not built for this jax-elastic config (want {want} and an fsdp-only mesh of "
            f"{ec.devices_per_slice} device(s); got {got}, ici {list(mt.ici_parallelism)}, dcn "
            f"{list(mt.dcn_parallelism)}); make both with integrations.maxtext.load_maxtext_config")
    check_supported(mt)
