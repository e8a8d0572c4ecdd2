"""``pipeline_stage``: the marks that cut a model's forward pass into pipeline stages.

In a loss given to :class:`elastic.Trainer`, ``x = elastic.pipeline_stage(x)``
ends one stage and starts the next: with ``dcn_pipeline_parallelism = S`` the
forward pass carries S - 1 marks, called in order, each on the whole value
that flows to the next stage (an array or a pytree of arrays: the
activations). Outside the runtime the mark is the identity, so the same loss
runs unchanged in plain JAX.

The runtime traces the loss in two modes:

- *probe*: each mark records its value's tree structure, shapes and dtypes
  (plain ``jax.ShapeDtypeStruct``, never tracers) and where it was called
  from, so a mark inside ``lax.scan``, a ``cond``, ``vmap``, ``grad`` or
  ``jax.checkpoint`` is refused: such a body is traced once but runs many
  times (or under a transformation), so it cannot be cut there;
- *stage k*: mark ``k - 1`` returns the stage's input fed in by the runtime
  (everything before it is dead code, which XLA drops) and mark ``k`` writes
  its value into mutable refs created by the outer trace (``jax.new_ref``,
  which crosses ``jax.jit`` boundaries) so the stage program returns it
  (everything after it is dead code). The last stage returns the loss.

As with ``cross_slice_mean`` (:mod:`elastic.marker`), every mode entry
changes a ``jax.make_user_context`` value that is part of JAX's jit cache key,
so a jitted loss is traced afresh in each mode.
"""

from __future__ import annotations

import contextvars
import dataclasses
import sys

from elastic.marker import MarkerError, entered

__all__ = ["pipeline_stage", "probe_stages", "cut_at_stage", "StageCutError"]


class StageCutError(MarkerError):
    """``pipeline_stage`` marks that the runtime cannot cut the model at."""


@dataclasses.dataclass
class _StageMode:
    kind: str                        # "probe" or "stage"
    stage: int = 0                   # stage mode: which stage the trace is of
    value: object = None             # stage mode: the stage's input (for mark stage - 1)
    refs: object = None              # stage mode: (treedef, refs) the mark ``stage`` writes into
    calls: int = 0
    shapes: list = dataclasses.field(default_factory=list)   # probe: each mark's value, as ShapeDtypeStructs


_MODE: contextvars.ContextVar[_StageMode | None] = contextvars.ContextVar("elastic_pipeline_stage", default=None)

# (file suffix, function names): JAX frames that trace a body once for many runs, or transform it.
_UNCUTTABLE = (
    ("jax/_src/lax/control_flow/loops.py", {"scan": "lax.scan", "while_loop": "lax.while_loop",
                                            "fori_loop": "lax.fori_loop", "map": "lax.map"}),
    ("jax/_src/lax/control_flow/conditionals.py", {"cond": "lax.cond", "switch": "lax.switch"}),
    ("jax/_src/api.py", {"vmap_f": "jax.vmap", "vjp": "jax.grad / jax.vjp", "jvp": "jax.jvp",
                         "linearize": "jax.linearize", "pmap_f": "jax.pmap"}),
    ("jax/_src/ad_checkpoint.py", {"fun_remat": "jax.checkpoint (remat)"}),
)


def pipeline_stage(x):
    """Ends a pipeline stage: ``x`` flows to the next stage. Identity outside the runtime."""
    mode = _MODE.get()
    if mode is None:
        return x
    i = mode.calls
    mode.calls += 1
    import jax  # lazy: importing elastic must not start JAX (the CLI sets XLA_FLAGS first)

    if mode.kind == "probe":
        inside = _enclosing_transform()
        if inside:
            raise StageCutError(f"elastic.pipeline_stage mark {i} is called inside {inside}, whose body is traced "
                                "once for many runs (or transformed); call the marks between those blocks, in "
                                "the straight-line forward pass (e.g. between groups of scanned layers)")
        mode.shapes.append(jax.tree.map(lambda a: jax.ShapeDtypeStruct(jax.numpy.shape(a), jax.numpy.result_type(a)),
                                        x))
        return x
    if i == mode.stage - 1:
        _same_structure(i, x, mode.value)
        return mode.value
    if i == mode.stage:
        treedef, refs = mode.refs
        _same_structure(i, x, treedef)
        for ref, leaf in zip(refs, jax.tree.leaves(x)):
            ref[...] = leaf
    return x


def _same_structure(i: int, x, want) -> None:
    import jax

    want = want if isinstance(want, jax.tree_util.PyTreeDef) else jax.tree.structure(want)
    if jax.tree.structure(x) != want:
        raise StageCutError(f"the value at elastic.pipeline_stage mark {i} changed structure between traces: "
                            f"{jax.tree.structure(x)} vs {want}")


def _enclosing_transform() -> str:
    """The JAX loop, branch or transformation the calling mark is traced inside ("" when none)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        for suffix, names in _UNCUTTABLE:
            if path.endswith(suffix) and frame.f_code.co_name in names:
                return names[frame.f_code.co_name]
        frame = frame.f_back
    return ""


def _mode(m: _StageMode):
    return entered(_MODE, m)


def probe_stages():
    """Context: each mark records its value's shapes (``m.shapes``, one tree per mark, in call order)."""
    return _mode(_StageMode("probe"))


def cut_at_stage(stage: int, value, treedef, refs):
    """Context: mark ``stage - 1`` returns ``value`` (the stage's input; ignored for stage 0) and mark ``stage``
    writes its value (of structure ``treedef``) into ``refs`` (ignored for the last stage: pass None, [])."""
    return _mode(_StageMode("stage", stage=stage, value=value, refs=(treedef, list(refs))))
