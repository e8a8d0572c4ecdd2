"""The compiled blocks of a pipelined run: one set of programs per stage, as shipped from the client.

A model cut into S stages (``elastic.pipeline_stage``) becomes S
:class:`StagePrograms`, each plain bytes and numbers like a
:class:`~runtime.core.programs.ProgramSet`, for one virtual-slice mesh.
A stage's state holds only its own parameters and their optimizer state.

Program signatures (``state``: the stage's state as a flat list of arrays;
``a_in`` / ``a_out``: the activations received from the previous stage and
sent to the next one, flat lists; ``g_out`` / ``g_in``: their gradients):

- ``init(seed: int32[]) -> state``
- ``forward(state, batch, a_in) -> a_out`` (every stage but the last; stage 0
  takes no ``a_in``)
- ``backward(state, batch, a_in, g_out) -> (float32[P_k + 1], g_in)``: the
  stage's flat parameter gradient for one microbatch, then a 0 where the loss
  goes; recomputes the forward from ``a_in`` (only stage inputs are kept
  between the passes). Stage 0 returns no ``g_in``.
- ``last(state, batch, a_in) -> (float32[P_k + 1], g_in)`` (the last stage):
  forward, loss and backward of one microbatch; the loss last in the vector.
- ``apply(state, grad_sum: float32[P_k]) -> state``: takes the canonical
  tree sum of the M microbatch gradients (it divides by M itself).

Every stage's vector ends with a loss slot, so each stage's gradients reduce
across its replicas exactly as an unpipelined gradient does
(:mod:`runtime.core.microbatch`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

__all__ = ["StagePrograms", "PipelineProgramSet", "stages_digest"]


@dataclasses.dataclass(frozen=True)
class StagePrograms:
    stage: int
    num_stages: int
    blobs: dict             # program name -> jax.export bytes: init, apply, and forward + backward, or last
    devices_per_slice: int
    num_microbatches: int
    grad_size: int          # P_k: elements of this stage's flat gradient
    state_bytes: int        # bytes of this stage's state on one replica
    batch_spec: dict        # key -> [shape, dtype] of one microbatch
    in_specs: dict          # program -> per flat input: sharded dim or None (replicated)
    activation_in: list     # [shape, dtype] per leaf received from the previous stage ([] for stage 0)
    activation_out: list    # [shape, dtype] per leaf sent to the next stage ([] for the last)
    checkpoint_tree: dict | None = None   # (a ProgramSet's field: stages are checkpointed as flat lists)

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def programs(self) -> dict[str, bytes]:
        return dict(self.blobs)

    @property
    def grad_program(self) -> str:
        """The program whose first output is the stage's ``float32[P_k + 1]``."""
        return "last" if self.is_last else "backward"

    def layout(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("blobs", "checkpoint_tree")}

    def layout_json(self) -> bytes:
        return json.dumps(self.layout()).encode()

    @classmethod
    def from_parts(cls, blobs: dict[str, bytes], layout: bytes | dict) -> StagePrograms:
        meta = json.loads(layout) if isinstance(layout, (bytes, str)) else layout
        stage = cls(blobs=dict(blobs), **meta)
        want = {"init", "apply"} | ({"last"} if stage.is_last else {"forward", "backward"})
        if set(blobs) != want:
            raise ValueError(f"stage {stage.stage} of {stage.num_stages} has programs {sorted(blobs)}, "
                             f"not {sorted(want)}")
        return stage


@dataclasses.dataclass(frozen=True)
class PipelineProgramSet:
    """Every stage's programs; ``stages[k]`` is stage ``k``'s."""

    stages: tuple[StagePrograms, ...]

    def __post_init__(self):
        if len(self.stages) < 2:
            raise ValueError(f"a pipeline has at least 2 stages, got {len(self.stages)}")
        for k, s in enumerate(self.stages):
            if s.stage != k or s.num_stages != len(self.stages):
                raise ValueError(f"stage {k} of {len(self.stages)} is labelled {s.stage} of {s.num_stages}")
        for a, b in zip(self.stages, self.stages[1:]):
            if a.activation_out != b.activation_in:
                raise ValueError(f"stage {a.stage} sends {a.activation_out}, stage {b.stage} takes {b.activation_in}")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_microbatches(self) -> int:
        return self.stages[0].num_microbatches

    @property
    def state_bytes(self) -> int:
        return sum(s.state_bytes for s in self.stages)

    @property
    def grad_size(self) -> int:
        return sum(s.grad_size for s in self.stages)

    @property
    def devices_per_slice(self) -> int:
        return self.stages[0].devices_per_slice

    @property
    def init(self) -> bytes:
        """Stage 0's init program (what a platform check reads)."""
        return self.stages[0].blobs["init"]

    def programs(self) -> dict[str, bytes]:
        """Every stage's programs, named ``stage<k>/<program>``."""
        return {f"stage{s.stage}/{name}": blob for s in self.stages for name, blob in sorted(s.blobs.items())}

    def layout_json(self) -> bytes:
        return json.dumps([s.layout() for s in self.stages]).encode()

    @classmethod
    def from_parts(cls, blobs: list[dict[str, bytes]], layout: bytes) -> PipelineProgramSet:
        metas = json.loads(layout)
        if len(metas) != len(blobs):
            raise ValueError(f"layout names {len(metas)} stages, {len(blobs)} sets of programs came")
        return cls(tuple(StagePrograms.from_parts(b, m) for b, m in zip(blobs, metas)))


def stages_digest(digests: list[str]) -> str:
    """One digest of a pipelined state: sha256 over each stage's state digest, in stage order."""
    return "stages:" + hashlib.sha256("\n".join(digests).encode()).hexdigest()
