"""``cross_slice_mean``: the mark that splits a fused train step in two.

Inside a step given to :func:`elastic.wrap`, ``grads =
elastic.cross_slice_mean(grads)`` is where gradients are averaged over every
microbatch of the global batch, across slices (the analogue of ``lax.pmean``
over the DCN axis). The runtime traces the step in three modes:

- *probe*: the mark records the gradients' tree structure, shapes and dtypes
  (plain values, never tracers) and passes them through;
- *capture* (the grad program): the mark writes the gradients into mutable
  JAX refs created by the outer trace (``jax.new_ref``) and passes them
  through; the program returns the loss and what the refs hold. Refs cross
  ``jax.jit`` boundaries, so the mark works at any jit depth: a step decorated
  with ``@jax.jit`` or ``nnx.jit``, a ``functools.partial``, a method, or a
  jitted helper that contains the mark. Everything after the mark is dead
  code there and XLA drops it;
- *substitute* (the apply program): the mark returns the reduced gradients fed
  in by the runtime (the gradient computation before it is then dead).

Every mode entry changes a ``jax.make_user_context`` value that is part of
JAX's jit cache key, so a jitted step is traced afresh in each mode instead of
reusing a trace made in another mode (or by the user's own plain calls).

Outside the runtime the mark is the identity (one slice: the mean over one
microbatch is the gradient itself), so the same step runs unchanged in plain
JAX. The mark must be called exactly once per step, outside any
transformation that traces its body more than once or differentiates it
(``lax.scan``, ``jax.grad``, ``vmap``): call it on the final gradients.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import threading

__all__ = ["cross_slice_mean", "probe_gradients", "capture_gradients", "substitute_gradients", "MarkerError"]


class MarkerError(ValueError):
    """``cross_slice_mean`` was used in a way the runtime cannot split."""


@dataclasses.dataclass
class _Mode:
    kind: str                  # "probe", "capture" or "substitute"
    value: object = None       # capture: (treedef, refs); substitute: the reduced gradients
    calls: int = 0
    shapes: object = None      # probe: the gradients as a tree of jax.ShapeDtypeStruct


_MODE: contextvars.ContextVar[_Mode | None] = contextvars.ContextVar("elastic_cross_slice_mode", default=None)
_TOKENS = itertools.count(1)
_JIT_KEY = None
_JIT_KEY_LOCK = threading.Lock()


def cross_slice_mean(grads):
    """Mean of ``grads`` over the global batch, across slices. Identity outside the runtime."""
    mode = _MODE.get()
    if mode is None:
        return grads
    mode.calls += 1
    if mode.calls > 1:
        raise MarkerError("elastic.cross_slice_mean was called more than once in one step (call it once, on the "
                          "final gradients, outside lax.scan / jax.grad / vmap)")
    import jax  # lazy: importing elastic must not start JAX (the CLI sets XLA_FLAGS first)

    if mode.kind == "probe":
        mode.shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)),
                                   grads)
        return grads
    if mode.kind == "capture":
        treedef, refs = mode.value
        _same_structure(grads, treedef)
        for ref, leaf in zip(refs, jax.tree.leaves(grads)):
            ref[...] = leaf
        return grads
    _same_structure(grads, jax.tree.structure(mode.value))
    return mode.value


def _same_structure(grads, want) -> None:
    import jax

    got = jax.tree.structure(grads)
    if got != want:
        raise MarkerError(f"gradients at the mark changed structure between traces: {got} vs {want}")


def _jit_key():
    """A jit-cache-key context (created once): a fresh value per mode entry forces a fresh trace."""
    global _JIT_KEY
    with _JIT_KEY_LOCK:
        if _JIT_KEY is None:
            import jax

            _JIT_KEY = jax.make_user_context(None)
    return _JIT_KEY


@contextlib.contextmanager
def entered(var: contextvars.ContextVar, m):
    """Sets ``var`` to the mode ``m`` for the block, under a fresh jit-cache-key value (a fresh trace)."""
    token = var.set(m)
    try:
        with _jit_key()(next(_TOKENS)):
            yield m
    finally:
        var.reset(token)


def _mode(m: _Mode):
    return entered(_MODE, m)


def probe_gradients():
    """Context: the mark records its gradients' shapes; ``with probe_gradients() as m: ...; m.shapes``."""
    return _mode(_Mode("probe"))


def capture_gradients(treedef, refs):
    """Context: the mark writes its gradients (structure ``treedef``) into ``refs``, one ``jax.Ref`` per leaf."""
    return _mode(_Mode("capture", (treedef, list(refs))))


def substitute_gradients(reduced):
    """Context: the mark returns ``reduced`` instead of its input."""
    return _mode(_Mode("substitute", reduced))
