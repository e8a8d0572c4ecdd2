"""The compiled blocks a worker runs, as shipped from the client.

A :class:`ProgramSet` is plain bytes and numbers: ``jax.export`` serializations
of three programs for one virtual-slice mesh, and the facts the runtime needs
to move their inputs and outputs. The worker never imports the user's code.

Program signatures (``state`` is an opaque pytree, e.g. ``(params, opt_state)``):

- ``init(seed: int32[]) -> state``
- ``grad(state, batch) -> float32[P + 1]`` for one microbatch: the flattened
  gradient, then the loss, replicated on the slice's devices (one vector, so
  the loss is reduced with the gradient in the same tree order).
- ``apply(state, grad_sum: float32[P]) -> state``: takes the canonical tree sum
  of the M microbatch gradients (it divides by M itself).
"""

from __future__ import annotations

import dataclasses
import json

__all__ = ["ProgramSet", "MESH_AXIS"]

#: Name of the mesh axis inside a virtual slice.
MESH_AXIS = "fsdp"


@dataclasses.dataclass(frozen=True)
class ProgramSet:
    init: bytes
    grad: bytes
    apply: bytes
    devices_per_slice: int
    num_microbatches: int
    grad_size: int          # P: elements of the flat gradient
    state_bytes: int        # bytes of the training state on one replica
    batch_spec: dict        # key -> [shape, dtype] of one microbatch
    in_specs: dict          # program -> per flat input: sharded dim or None (replicated)
    # How a persistent checkpoint names the state's leaves (runtime.state.checkpoint_tree.CheckpointTree's JSON);
    # None: a flat list. A MaxText model's is MaxText's own layout.
    checkpoint_tree: dict | None = None

    def layout_json(self) -> bytes:
        layout = {
            "devices_per_slice": self.devices_per_slice,
            "num_microbatches": self.num_microbatches,
            "grad_size": self.grad_size,
            "state_bytes": self.state_bytes,
            "batch_spec": self.batch_spec,
            "in_specs": self.in_specs,
        }
        if self.checkpoint_tree is not None:
            layout["checkpoint_tree"] = self.checkpoint_tree
        return json.dumps(layout).encode()

    def programs(self) -> dict[str, bytes]:
        return {"init": self.init, "grad": self.grad, "apply": self.apply}

    @classmethod
    def from_parts(cls, programs: dict[str, bytes], layout: bytes) -> ProgramSet:
        missing = {"init", "grad", "apply"} - programs.keys()
        if missing:
            raise ValueError(f"program set lacks {sorted(missing)}")
        meta = json.loads(layout)
        return cls(init=programs["init"], grad=programs["grad"], apply=programs["apply"], **meta)
