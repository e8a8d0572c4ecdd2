"""``cross_slice_mean``: the mark that splits a fused train step in two.

Inside a step given to :func:`elastic.wrap`, ``grads =
elastic.cross_slice_mean(grads)`` is where gradients are averaged over every
microbatch of the global batch, across slices (the analogue of ``lax.pmean``
over the DCN axis). The runtime traces the step twice:

- as the *grad* program, the mark records its input and passes it through;
  the program returns the loss and the recorded gradients (everything after
  the mark is dead code there and XLA drops it);
- as the *apply* program, the mark returns the reduced gradients fed in by the
  runtime (the gradient computation before it is then dead and dropped).

Outside the runtime the mark is the identity (one slice: the mean over one
microbatch is the gradient itself), so the same step runs unchanged in plain JAX.
The mark must be called exactly once, at the top level of the step (not inside
``lax.scan``, ``jax.grad`` or another transformation).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

__all__ = ["cross_slice_mean", "capture_gradients", "substitute_gradients", "MarkerError"]


class MarkerError(ValueError):
    """``cross_slice_mean`` was used in a way the runtime cannot split."""


@dataclasses.dataclass
class _Mode:
    kind: str                  # "capture" or "substitute"
    value: object = None       # substitute: the reduced gradients
    seen: list = dataclasses.field(default_factory=list)


_MODE: contextvars.ContextVar[_Mode | None] = contextvars.ContextVar("elastic_cross_slice_mode", default=None)


def cross_slice_mean(grads):
    """Mean of ``grads`` over the global batch, across slices. Identity outside the runtime."""
    mode = _MODE.get()
    if mode is None:
        return grads
    mode.seen.append(grads)
    if len(mode.seen) > 1:
        raise MarkerError("elastic.cross_slice_mean was called more than once in one step")
    if mode.kind == "capture":
        return grads
    import jax  # lazy: importing elastic must not start JAX (the CLI sets XLA_FLAGS first)

    got, want = jax.tree.structure(grads), jax.tree.structure(mode.value)
    if got != want:
        raise MarkerError(f"gradients at the mark changed structure between traces: {got} vs {want}")
    return mode.value


@contextlib.contextmanager
def _mode(m: _Mode):
    token = _MODE.set(m)
    try:
        yield m
    finally:
        _MODE.reset(token)


def capture_gradients():
    """Context: marks record the gradients; ``with capture_gradients() as m: ...; m.seen[0]``."""
    return _mode(_Mode("capture"))


def substitute_gradients(reduced):
    """Context: marks return ``reduced`` instead of their input."""
    return _mode(_Mode("substitute", reduced))
