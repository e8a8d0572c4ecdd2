"""MaxText's model as an RL policy: ``elastic.rl.RLTrainer(policy=MaxTextPolicy(...))``.

A MaxText config with ``rl_samplers`` > 0 trains MaxText's decoder by GRPO on the bundled task (docs/rl.md):
the policy's ``init`` is MaxText's own initialisation (as its trainer makes it, from ``PRNGKey(seed)``) and its
``apply`` is MaxText's forward pass over a row of tokens (positions ``0..T-1``, one segment, no dropout),
returning its logits. Both are traced into the exported programs, as MaxText's loss is for training.
"""

from __future__ import annotations

import elastic
from integrations.maxtext.pipeline import StagePieces
from integrations.maxtext.slice import draws_random

__all__ = ["MaxTextPolicy", "make_rl_job"]


class MaxTextPolicy:
    """MaxText's parameters and forward pass for a slice of ``devices`` devices."""

    def __init__(self, maxtext_config, devices: int):
        self.pieces = StagePieces(maxtext_config, devices, 1)

    def init(self, key):
        return self.pieces.init(key)

    def apply(self, params, tokens):
        import jax.numpy as jnp
        from flax import nnx
        from flax.core.spmd import logical_axis_rules

        p = self.pieces
        model = nnx.merge(p.graphdef, params, p.rest, copy=True)
        rows, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (rows, t))
        with logical_axis_rules(p.config.logical_axis_rules):
            logits = model(decoder_input_tokens=tokens, decoder_positions=positions,
                           decoder_segment_ids=jnp.ones((rows, t), jnp.int32), enable_dropout=False)
        return logits.astype(jnp.float32)


def make_rl_job(elastic_config: elastic.Config, maxtext_config):
    """GRPO post-training of MaxText's model of ``maxtext_config`` on the bundled task."""
    from elastic.rl import RLTrainer

    if draws_random(maxtext_config):
        raise elastic.ConfigError("an RL run's MaxText policy samples with its own keys: turn dropout and random "
                                  "routing off (enable_dropout=false, use_random_routing=false)")
    if elastic_config.rl_sampler_devices != elastic_config.devices_per_slice:
        raise elastic.ConfigError(f"a MaxText policy is built on its slice's mesh: rl_sampler_devices "
                                  f"({elastic_config.rl_sampler_devices}) must equal ici_fsdp_parallelism "
                                  f"({elastic_config.devices_per_slice})")
    return RLTrainer(elastic_config, policy=MaxTextPolicy(maxtext_config, elastic_config.devices_per_slice))
