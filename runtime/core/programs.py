"""The compiled blocks a worker runs, as shipped from the client: a run's programs, one set per stage.

A run is S stages on virtual slices (data parallelism is S = 1). Each stage's
:class:`StagePrograms` is plain bytes and numbers: ``jax.export``
serializations for one virtual-slice mesh, and the facts the runtime needs to
move their inputs and outputs. One worker loads one stage's. The worker never
imports the user's code. A :class:`ProgramSet` is the run's stages in order.

Program signatures (``state``: the stage's state as a flat list of arrays; it
holds only the stage's own parameters and their optimizer state):

- ``init(seed: int32[]) -> state``
- ``apply(state, grad_sum: float32[P_k]) -> state``: takes the canonical
  tree sum of the M microbatch gradients (it divides by M itself).
- one stage (an unpipelined run): ``grad(state, batch) -> float32[P + 1]``
  for one microbatch: the flattened gradient, then the loss, replicated on
  the slice's devices (one vector, so the loss is reduced with the gradient in
  the same tree order).

A stage of a pipeline (S > 1) takes the activations ``a_in`` received from the
previous stage and sends ``a_out`` to the next (flat lists; ``g_out`` /
``g_in``: their gradients). In place of ``grad``:

- ``forward(state, batch, a_in) -> a_out`` (every stage but the last; stage 0
  takes no ``a_in``)
- ``backward(state, batch, a_in, g_out) -> (float32[P_k + 1], g_in)``: the
  stage's flat parameter gradient for one microbatch, then a 0 where the loss
  goes; recomputes the forward from ``a_in`` (only stage inputs are kept
  between the passes). Stage 0 returns no ``g_in``.
- ``last(state, batch, a_in) -> (float32[P_k + 1], g_in)`` (the last stage):
  forward, loss and backward of one microbatch; the loss last in the vector.

With eval configured (an unpipelined run), one more:

- ``eval(state, batch) -> float32[2]``: one microbatch's training loss, forward only (its gradient never
  computed), on the state as it is, as ``(loss total, weight)``: the loss itself and 1, or, for a loss
  normalised by a token count it names, the unnormalised sum and that count (MaxText's ``total_loss``,
  ``total_weights``). Built only when a run evaluates.

So every program takes ``(state, batch)``, then the stage's input activations
if it has any, then their gradients if it sends any. Every stage's vector ends
with a loss slot, so each stage's gradients reduce across its replicas exactly
as an unpipelined gradient does (:mod:`runtime.core.microbatch`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

__all__ = ["MESH_AXIS", "SAMPLER_WEIGHTS_KEPT", "TRAINER_WEIGHTS_KEPT", "ProgramSet", "SamplerPrograms", "StagePrograms",
           "stages_digest"]

#: Name of the mesh axis inside a virtual slice.
MESH_AXIS = "fsdp"

#: An RL run's weights versions a trainer keeps for the samplers to pull (its newest), and a sampler keeps for its
#: peers (the newest it installed): the workers' outboxes (``runtime.worker.weights``) keep these many, and the run
#: state's record of who holds which (``runtime.control.run_state``) follows the same rule.
TRAINER_WEIGHTS_KEPT = 3
SAMPLER_WEIGHTS_KEPT = 2

# Layout keys only a stage of a pipeline has: a one-stage run's layout is without them.
_PIPELINE_KEYS = ("stage", "num_stages", "activation_in", "activation_out")


@dataclasses.dataclass(frozen=True)
class StagePrograms:
    """One stage's programs: what one worker loads (:meth:`from_parts` of a ``Load``) and its executor runs."""

    blobs: dict             # program name -> jax.export bytes (see the module docstring for which)
    devices_per_slice: int
    num_microbatches: int
    grad_size: int          # P_k: elements of this stage's flat gradient
    state_bytes: int        # bytes of this stage's state on one replica
    batch_spec: dict        # key -> [shape, dtype] of one microbatch
    in_specs: dict          # program -> per flat input: sharded dim or None (replicated)
    stage: int = 0
    num_stages: int = 1
    activation_in: list = dataclasses.field(default_factory=list)    # [shape, dtype] per leaf from the previous stage
    activation_out: list = dataclasses.field(default_factory=list)   # [shape, dtype] per leaf to the next stage
    # How a persistent checkpoint names the state's leaves (runtime.state.checkpoint_tree.CheckpointTree's JSON);
    # None: a flat list (always, for a stage of a pipeline). A MaxText model's is MaxText's own layout.
    checkpoint_tree: dict | None = None

    @property
    def pipelined(self) -> bool:
        """One stage of several (activations cross to neighbouring stages)."""
        return self.num_stages > 1

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def grad_program(self) -> str:
        """The program whose first output is the stage's ``float32[P_k + 1]``."""
        if not self.pipelined:
            return "grad"
        return "last" if self.is_last else "backward"

    @property
    def evaluates(self) -> bool:
        """Whether the stage has the ``eval`` program (a run with eval configured)."""
        return "eval" in self.in_specs

    def program_names(self) -> set[str]:
        return ({"init", "apply", self.grad_program} | (set() if self.is_last else {"forward"})
                | ({"eval"} if self.evaluates else set()))

    def programs(self) -> dict[str, bytes]:
        return dict(self.blobs)

    def layout(self) -> dict:
        layout = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("blobs", "checkpoint_tree")}
        if not self.pipelined:
            for k in _PIPELINE_KEYS:
                del layout[k]
        if self.checkpoint_tree is not None:
            layout["checkpoint_tree"] = self.checkpoint_tree
        return layout

    def layout_json(self) -> bytes:
        return json.dumps(self.layout()).encode()

    @classmethod
    def from_parts(cls, blobs: dict[str, bytes], layout: bytes | str | dict) -> StagePrograms:
        """A stage as a ``Load`` carries it; ``ValueError`` unless ``blobs`` are exactly the stage's programs."""
        meta = json.loads(layout) if isinstance(layout, (bytes, str)) else layout
        stage = cls(blobs=dict(blobs), **meta)
        if set(blobs) != stage.program_names():
            raise ValueError(f"stage {stage.stage} of {stage.num_stages} has programs {sorted(blobs)}, "
                             f"not {sorted(stage.program_names())}")
        return stage


@dataclasses.dataclass(frozen=True)
class ProgramSet:
    """A run's programs: ``by_stage[k]`` is stage ``k``'s (one entry for an unpipelined run)."""

    by_stage: tuple[StagePrograms, ...]

    def __post_init__(self):
        stages = self.by_stage
        if not stages:
            raise ValueError("a run has at least one stage")
        for k, s in enumerate(stages):
            if s.stage != k or s.num_stages != len(stages):
                raise ValueError(f"stage {k} of {len(stages)} is labelled {s.stage} of {s.num_stages}")
        for a, b in zip(stages, stages[1:]):
            if a.activation_out != b.activation_in:
                raise ValueError(f"stage {a.stage} sends {a.activation_out}, stage {b.stage} takes {b.activation_in}")

    @property
    def num_stages(self) -> int:
        return len(self.by_stage)

    @property
    def pipelined(self) -> bool:
        return self.num_stages > 1

    @property
    def num_microbatches(self) -> int:
        return self.by_stage[0].num_microbatches

    def keys(self) -> list[tuple[str, int, int]]:
        """What each set of programs is for: ``(role, stage, devices of the mesh it was exported for)``. Today a
        run's trainers have one set per stage, all for one mesh (a sampler's are :class:`SamplerPrograms`);
        programs for another mesh would be more keys."""
        return [("trainer", s.stage, s.devices_per_slice) for s in self.by_stage]

    def for_key(self, role: str, stage: int, devices: int) -> StagePrograms:
        """The programs of ``(role, stage, devices)`` (:meth:`keys`); a ``KeyError`` naming those exported when
        there are none for it (a slice of another mesh: they were not exported)."""
        for key, programs in zip(self.keys(), self.by_stage):
            if key == (role, stage, devices):
                return programs
        raise KeyError(f"no programs exported for {role} stage {stage} on a mesh of {devices} device(s); exported: "
                       + ", ".join(f"{r} stage {k} on {d}" for r, k, d in self.keys()))

    @property
    def devices_per_slice(self) -> int:
        return self.by_stage[0].devices_per_slice

    @property
    def state_bytes(self) -> int:
        return sum(s.state_bytes for s in self.by_stage)

    @property
    def grad_size(self) -> int:
        return sum(s.grad_size for s in self.by_stage)

    @property
    def evaluates(self) -> bool:
        """Whether the run's programs include ``eval`` (held-out loss at an interval)."""
        return all(s.evaluates for s in self.by_stage)

    @property
    def checkpoint_tree(self) -> dict | None:
        """How a persistent checkpoint names the state's leaves (None: flat lists, as a pipeline's stages are)."""
        return None if self.pipelined else self.by_stage[0].checkpoint_tree

    @property
    def init(self) -> bytes:
        """Stage 0's init program (what a platform check reads)."""
        return self.by_stage[0].blobs["init"]

    def programs(self) -> dict[str, bytes]:
        """Every program by name: an unpipelined run's as its workers load them (``init``, ``grad``, ``apply``),
        a pipeline's as ``stage<k>/<program>`` (what fingerprints and the compilation cache are keyed by)."""
        if not self.pipelined:
            return self.by_stage[0].programs()
        return {f"stage{s.stage}/{name}": blob for s in self.by_stage for name, blob in sorted(s.blobs.items())}

    def layout_json(self) -> bytes:
        """An unpipelined run's layout, as its workers load it with :meth:`programs` (a pipeline's workers each
        load their stage's: ``by_stage[k]``)."""
        if self.pipelined:
            raise ValueError("a pipelined run has a layout per stage: ship by_stage[k]'s")
        return self.by_stage[0].layout_json()


def stages_digest(digests: list[str]) -> str:
    """A run's state digest from each stage's, in stage order: an unpipelined run's is its one stage's; a
    pipeline's, sha256 over them."""
    if len(digests) == 1:
        return digests[0]
    return "stages:" + hashlib.sha256("\n".join(digests).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class SamplerPrograms:
    """An RL run's samplers' programs (:mod:`runtime.worker.sampler`, :mod:`runtime.control.sampling`).

    ``rollout``: the ``jax.export`` bytes of ``rollout(weights, prompts, seed, step, microbatch)`` for a sampler's
    mesh; ``layout``: what a sampler's ``Load`` carries beside it (``role: sampler``, ``devices_per_slice``, each
    weights leaf's ``[shape, dtype, sharded dim]``, the ``prompt`` ``[shape, dtype]``, the ``outputs`` ``[name,
    shape, dtype]`` in the program's order, ``num_microbatches``); ``prompts``: the pickled prompt source
    (``prompts(step, microbatch)``); ``weight_leaves``: which of the trainer's state leaves are the policy's
    weights (what a trainer publishes), in the sampler's order; ``weights_dtype``: the dtype they travel and live
    in on a sampler ("": the trainer's).
    """

    rollout: bytes
    layout: dict
    prompts: bytes
    weight_leaves: tuple[int, ...]
    weights_dtype: str = ""
    reference: bytes = b""   # a KL term: ``reference(seed) -> weights``, the frozen initial policy (the layout's
                             # ``reference_seed``); b"": none

    def programs(self) -> dict[str, bytes]:
        """The samplers' programs by name, as their ``Load`` carries them."""
        return {"rollout": self.rollout, **({"reference": self.reference} if self.reference else {})}

    @property
    def devices_per_slice(self) -> int:
        return int(self.layout["devices_per_slice"])

    def layout_json(self) -> bytes:
        return json.dumps(self.layout).encode()
