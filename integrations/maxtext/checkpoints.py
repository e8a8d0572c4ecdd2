"""MaxText's checkpoint layout for jax-elastic's persistent checkpoints of a MaxText model.

MaxText 0.2.5 writes a checkpoint as orbax's item ``items`` holding its
train state in the Linen on-disk layout (``train_state_nnx.to_checkpoint_dict``):
``params/params/...`` (the weights), ``opt_state`` (optax's chain as a list,
``mu``/``nu`` under ``params``), ``step`` (``int32``; NNX keeps ``uint32``)
and ``nnx_aux`` (the RNG streams: typed ``unsafe_rbg`` keys and their
counts), in ``<checkpoint dir>/<d>/items``, where ``<d>`` holds the state
after ``d + 1`` steps.

:func:`checkpoint_tree` derives the :class:`elastic.CheckpointTree`
that places jax-elastic's flat state leaves exactly there, by running
MaxText's own ``to_checkpoint_dict`` on a state whose leaves are their
indices (so the layout is MaxText's by construction, not a copy of its
rules). With it (``make_job`` passes it to ``elastic.wrap``):

- jax-elastic's checkpoints are ``<dir>/<step>/items`` in MaxText's layout
  plus jax-elastic's record (``<dir>/<step>/meta``: digest, loss sums,
  programs), so MaxText's trainer restores them (``load_full_state_path``,
  or auto-resume when it runs in the same ``base_output_directory/run_name``);
- a checkpoint MaxText's trainer wrote restores into jax-elastic
  (``load_full_state_path`` naming it or its directory, or auto-resume from
  the run's own ``checkpoints``): it is read with this tree, its ``step`` leaf
  checked against its directory's, and the run goes on from there.
"""

from __future__ import annotations

from elastic import CheckpointTree

__all__ = ["checkpoint_tree"]

#: Where MaxText's layout keeps the step count.
STEP_PATH = ("step",)


def checkpoint_tree(state, is_key, key_impl: str) -> CheckpointTree:
    """The tree placing the leaves of ``state`` (an ``nnx.State`` of a ``TrainStateNNX``, abstract or not; its
    leaves in ``jax.tree.flatten`` order are the runtime's) where MaxText's ``to_checkpoint_dict`` puts them.
    ``is_key``: the same tree, True where a leaf is a PRNG key (the runtime holds its data, MaxText a typed
    ``key_impl`` key)."""
    import jax
    import numpy as np
    from maxtext.common import train_state_nnx

    leaves, treedef = jax.tree.flatten(state)
    keys = jax.tree.leaves(is_key)
    if len(keys) != len(leaves):
        raise ValueError(f"is_key has {len(keys)} leaves, the state {len(leaves)}")
    on_disk = train_state_nnx.to_checkpoint_dict(jax.tree.unflatten(treedef, list(range(len(leaves)))))
    stored: dict[int, str | None] = {}

    def skeleton(node):
        if isinstance(node, dict):
            return {str(k): skeleton(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [skeleton(v) for v in node]
        if node is None:
            return None
        index = int(node)   # a leaf index; MaxText's casts (the step's int32) make it an array of that dtype
        if hasattr(node, "dtype") and not keys[index] and np.dtype(node.dtype) != np.dtype(leaves[index].dtype):
            stored[index] = np.dtype(node.dtype).name
        return index

    tree = skeleton(on_disk)
    return CheckpointTree(tree, tuple((stored.get(i), key_impl if keys[i] else None) for i in range(len(leaves))),
                          step_path=STEP_PATH)
