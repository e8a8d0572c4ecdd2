"""MaxText's synthetic data (``dataset_type: synthetic``) as a jax-elastic data source.

MaxText's ``SyntheticDataIterator`` draws one global batch of token ids once
(``jax.random.randint`` from ``PRNGKey(0)`` under the trainer's ``unsafe_rbg``
PRNG) and yields it at every step; segment ids are ones, or MaxText's packed
segments when ``packing`` and ``max_segments_per_seq >= 2``. This source holds
the same global batch (drawn once, in the client, with the same calls) and
serves microbatch ``m`` of any step as rows ``m * size .. (m + 1) * size`` of
it, so it is indexable by ``(step, microbatch)``, deterministic, and with one
slice and one microbatch it is exactly the batch MaxText's trainer sees.
"""

from __future__ import annotations

import numpy as np

__all__ = ["KEYS", "SyntheticSource", "maxtext_synthetic_batch"]

# The batch keys MaxText's loss reads for a causal LM (maxtext_utils.get_shaped_batch).
KEYS = ("inputs", "inputs_position", "inputs_segmentation", "targets", "targets_position", "targets_segmentation")

# The PRNG MaxText's pre-training trainer sets process-wide (train.initialize).
MAXTEXT_PRNG_IMPL = "unsafe_rbg"


def maxtext_synthetic_batch(maxtext_config, global_batch: int) -> dict[str, np.ndarray]:
    """The ``global_batch`` rows MaxText's synthetic iterator yields, as numpy (called in the client)."""
    import jax
    import jax.numpy as jnp
    from maxtext.input_pipeline.synthetic_data_processing import _make_packed_segment_ids

    length = int(maxtext_config.max_target_length)
    with jax.default_prng_impl(MAXTEXT_PRNG_IMPL):   # MaxText draws under its trainer's PRNG
        tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(0), (global_batch, length + 1), 0,
                                               maxtext_config.vocab_size, dtype=jnp.int32))
        if maxtext_config.packing:
            segments = np.asarray(_make_packed_segment_ids(global_batch, length, maxtext_config.max_segments_per_seq))
        else:
            segments = np.ones((global_batch, length), np.int32)
    positions = np.broadcast_to(np.arange(length + 1, dtype=np.int32), (global_batch, length + 1))
    return {
        "inputs": tokens[:, :-1],
        "inputs_position": positions[:, :-1],
        "inputs_segmentation": segments,
        "targets": tokens[:, 1:],
        "targets_position": positions[:, 1:],
        "targets_segmentation": segments,
    }


class SyntheticSource:
    """Microbatch ``m`` of every step is rows ``m * microbatch_size ..`` of one fixed global batch.

    Build it with :meth:`from_configs`. Picklable (plain numpy), so it ships to
    workers as is; ``batch`` is pure. It is MaxText's eval data too (MaxText's
    eval iterator is the same ``SyntheticDataIterator``), which never ends:
    ``steps`` is ``None``.
    """

    steps = None   # steps the data holds: unbounded

    def __init__(self, global_batch: dict[str, np.ndarray], microbatch_size: int):
        rows = {len(v) for v in global_batch.values()}
        if len(rows) != 1 or next(iter(rows)) % microbatch_size:
            raise ValueError(f"a global batch of {sorted(rows)} rows does not split into microbatches of "
                             f"{microbatch_size}")
        self.rows = {k: np.ascontiguousarray(v, dtype=np.int32) for k, v in global_batch.items()}
        self.microbatch_size = int(microbatch_size)
        self.microbatches = next(iter(rows)) // self.microbatch_size

    @classmethod
    def from_configs(cls, elastic_config, maxtext_config) -> SyntheticSource:
        """The global batch of ``elastic_config`` (microbatches x microbatch size), drawn as MaxText does."""
        size = elastic_config.microbatch_size
        return cls(maxtext_synthetic_batch(maxtext_config, elastic_config.microbatches * size), size)

    def element_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {k: ((self.microbatch_size, *v.shape[1:]), v.dtype) for k, v in self.rows.items()}

    def batch(self, step: int, microbatch: int) -> dict[str, np.ndarray]:
        if step < 0 or not 0 <= microbatch < self.microbatches:
            raise ValueError(f"no microbatch {microbatch} of step {step}: the source has microbatches "
                             f"0..{self.microbatches - 1} of every step >= 0")
        lo = microbatch * self.microbatch_size
        return {k: v[lo:lo + self.microbatch_size] for k, v in self.rows.items()}

    def __repr__(self) -> str:
        return f"SyntheticSource(microbatches={self.microbatches}, microbatch_size={self.microbatch_size})"
