"""MaxText on one virtual slice: its mesh, its PRNG key and JAX settings, and whether its forward pass draws random
numbers. Shared by the fused job (:mod:`integrations.maxtext.model`) and the pipelined one
(:mod:`integrations.maxtext.pipeline`)."""

from __future__ import annotations

import contextlib

import numpy as np

import elastic
from integrations.maxtext.data import MAXTEXT_PRNG_IMPL

__all__ = ["draws_random", "maxtext_jax", "maxtext_key", "maxtext_model", "slice_mesh"]


def slice_mesh(config, devices: int):
    """MaxText's mesh for one virtual slice: this process's first ``devices`` JAX devices on MaxText's axes, fsdp
    = ``devices`` and every other axis 1 (as :func:`~integrations.maxtext.config.load_maxtext_config` sets them).
    ConfigError when the process has fewer devices."""
    import jax
    from jax.sharding import AxisType, Mesh

    local = jax.local_devices()
    if len(local) < devices:
        raise elastic.ConfigError(
            f"this process has {len(local)} JAX device(s) but a slice has {devices} (ici_fsdp_parallelism): "
            f"MaxText's model is built on a slice's mesh; start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} (before JAX starts)")
    shape = tuple(config.ici_parallelism)
    return Mesh(np.array(local[:devices]).reshape(shape), tuple(config.mesh_axes),
                axis_types=(AxisType.Auto,) * len(shape))


def maxtext_model(config, mesh, rng_key):
    """MaxText's NNX model for ``config`` on ``mesh``, initialised from ``rng_key`` (its trainer's model factory,
    under its logical axis rules)."""
    from flax.core.spmd import logical_axis_rules
    from maxtext.utils import model_creation_utils

    with logical_axis_rules(config.logical_axis_rules):
        return model_creation_utils.get_nnx_create_model_fn(config, mesh, rng_key=rng_key)()


def draws_random(config) -> bool:
    """Whether MaxText's forward pass in training draws random numbers: dropout (``enable_dropout`` and
    ``dropout_rate`` > 0) or random expert routing (``use_random_routing``)."""
    dropout = bool(getattr(config, "enable_dropout", False)) and float(getattr(config, "dropout_rate", 0.0)) > 0
    return dropout or bool(getattr(config, "use_random_routing", False))


def maxtext_key(key):
    """``PRNGKey(seed)`` of MaxText's ``unsafe_rbg`` from the runtime's ``key(seed)`` (any threefry or rbg impl).

    Both seed their key data from ``threefry_seed(seed)``: threefry's data is
    that pair; rbg's and unsafe_rbg's are the pair twice.
    """
    import jax
    import jax.numpy as jnp

    data = jax.random.key_data(key)
    if data.shape[-1] not in (2, 4):
        raise elastic.ConfigError(f"cannot derive MaxText's key from a {jax.random.key_impl(key)} key; leave "
                                  "jax_default_prng_impl at threefry2x32 or unsafe_rbg")
    half = data[..., :2]
    return jax.random.wrap_key_data(jnp.concatenate([half, half], axis=-1), impl=MAXTEXT_PRNG_IMPL)


@contextlib.contextmanager
def maxtext_jax(config):
    """The JAX settings MaxText's trainer makes process-wide (train.initialize), for this block only."""
    import jax

    if bool(config.shardy) != bool(jax.config.jax_use_shardy_partitioner):
        raise elastic.ConfigError(f"config key 'shardy' ({config.shardy}) differs from this process's "
                                  f"jax_use_shardy_partitioner ({jax.config.jax_use_shardy_partitioner}); "
                                  "drop the override")
    with jax.default_prng_impl(MAXTEXT_PRNG_IMPL), \
            jax.remove_size_one_mesh_axis_from_type(bool(config.remove_size_one_mesh_axis_from_type)):
        yield
