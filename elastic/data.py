"""Deterministic, indexable data sources.

Contract. A data source is built on the client, pickled (pickle or
cloudpickle) and shipped to every worker; data never passes through the client.
A worker calls ``source.batch(step, microbatch)`` for each microbatch it was
assigned. That call must be a pure function of ``(step, microbatch)``: the same
arguments give the same bytes on any process, at any time, in any order, any
number of times. This is what lets the runtime re-run a step or hand a dead
slice's microbatches to a survivor without changing the training trajectory.

``element_spec()`` gives the shape and dtype of one microbatch without loading
data; the client uses it to build programs. ``batch`` results must match it.

Errors: a batch that does not match its spec raises ``ValueError`` naming the
key, the expected and the actual shape/dtype. Exceptions raised by user code
propagate unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "DataSource",
    "ElementSpec",
    "FunctionSource",
    "GrainSource",
    "WithEval",
    "check_batch",
    "normalize_spec",
]

ElementSpec = dict[str, tuple[tuple[int, ...], np.dtype]]
"""Per key: (shape, dtype) of one microbatch."""


@runtime_checkable
class DataSource(Protocol):
    """What the runtime needs from a data source (see the module docstring)."""

    def batch(self, step: int, microbatch: int) -> dict[str, np.ndarray]:
        """Microbatch ``microbatch`` of step ``step``; pure and deterministic."""
        ...

    def element_spec(self) -> ElementSpec:
        """Shape and dtype of one microbatch, per key."""
        ...


def normalize_spec(spec: Mapping[str, Any]) -> ElementSpec:
    """``{key: (shape, dtype)}`` with ints and numpy dtypes; ``ValueError`` saying what the spec must look like."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"element_spec must be a dict {{key: (per-microbatch shape, dtype)}}, got "
                         f"{type(spec).__name__}; for one array use {{'x': (shape, dtype)}} and read batch['x']")
    for key, value in spec.items():
        if not (isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], (tuple, list))):
            raise ValueError(f"element_spec[{key!r}] must be (shape tuple, dtype) of one microbatch, got {value!r}")
    return {str(k): (tuple(int(d) for d in shape), np.dtype(dtype)) for k, (shape, dtype) in spec.items()}


def check_batch(batch: Mapping[str, Any], spec: ElementSpec) -> dict[str, np.ndarray]:
    """Return ``batch`` as a dict of numpy arrays; ``ValueError`` if it does not match ``spec``."""
    if not isinstance(batch, Mapping):
        raise ValueError(f"a data source's batch must be a dict of arrays, got {type(batch).__name__}; "
                         "wrap one array as {'x': array} (and read batch['x'] in the step)")
    missing, extra = sorted(set(spec) - set(batch)), sorted(set(batch) - set(spec))
    if missing or extra:
        raise ValueError(f"batch keys do not match element_spec: missing {missing}, unexpected {extra}")
    out = {}
    for key, (shape, dtype) in spec.items():
        arr = np.asarray(batch[key])
        if arr.shape != shape or arr.dtype != dtype:
            raise ValueError(
                f"batch[{key!r}]: expected shape {shape} dtype {dtype}, got shape {arr.shape} dtype {arr.dtype}"
            )
        out[key] = arr
    return out


def _check_index(step: int, microbatch: int) -> None:
    if step < 0 or microbatch < 0:
        raise ValueError(f"step and microbatch must be >= 0, got step={step} microbatch={microbatch}")


class FunctionSource:
    """A plain callable ``fn(step, microbatch) -> dict of arrays`` with an explicit spec.

    ``fn`` must itself be deterministic and picklable (cloudpickle handles
    lambdas and closures).
    """

    def __init__(self, fn: Callable[[int, int], Mapping[str, Any]], element_spec: Mapping[str, Any]):
        self.fn = fn
        self._spec = normalize_spec(element_spec)

    def element_spec(self) -> ElementSpec:
        return dict(self._spec)

    def batch(self, step: int, microbatch: int) -> dict[str, np.ndarray]:
        _check_index(step, microbatch)
        return check_batch(self.fn(step, microbatch), self._spec)

    def __repr__(self) -> str:
        return f"FunctionSource({self.fn!r}, {self._spec!r})"


class WithEval:
    """The training data source with an eval one beside it, as the workers get them (``eval_interval``):
    ``batch`` is the training source's, ``eval_batch(e, m)`` the eval source's microbatch ``m`` of eval step
    ``e``. Both pure in their arguments; picklable as both sources are."""

    def __init__(self, train, eval_source):
        self.train, self.eval = train, eval_source

    def element_spec(self) -> ElementSpec:
        return self.train.element_spec()

    def batch(self, step: int, microbatch: int) -> dict[str, np.ndarray]:
        return self.train.batch(step, microbatch)

    def eval_batch(self, step: int, microbatch: int) -> dict[str, np.ndarray]:
        return self.eval.batch(step, microbatch)

    def __repr__(self) -> str:
        return f"WithEval({self.train!r}, {self.eval!r})"


class GrainSource:
    """Adapter for a grain random-access data source (or any sized, indexable sequence).

    Record ``i`` of microbatch ``m`` of step ``step`` has global index
    ``g = step * microbatches * microbatch_size + m * microbatch_size + i``
    and reads ``source[perm_e(g % n)]`` with ``n = len(source)`` and epoch
    ``e = g // n``. ``perm_e`` is the identity, or with ``shuffle_seed`` a numpy
    permutation seeded by ``(shuffle_seed, e)``. Records are mappings of
    arrays/scalars (a non-mapping record is the single feature ``"value"``) and
    are stacked along a new leading axis of size ``microbatch_size``.
    """

    def __init__(self, source: Any, microbatch_size: int, microbatches: int, *, shuffle_seed: int | None = None):
        if microbatch_size < 1 or microbatches < 1:
            raise ValueError(
                f"microbatch_size and microbatches must be >= 1, got {microbatch_size} and {microbatches}"
            )
        if len(source) < 1:
            raise ValueError("GrainSource needs a non-empty source")
        self.source = source
        self.microbatch_size = int(microbatch_size)
        self.microbatches = int(microbatches)
        self.shuffle_seed = shuffle_seed
        self._len = len(source)
        self._perms: dict[int, np.ndarray] = {}
        first = self._record(0)
        self._spec: ElementSpec = {
            k: ((self.microbatch_size, *v.shape), v.dtype) for k, v in first.items()
        }

    def element_spec(self) -> ElementSpec:
        return dict(self._spec)

    def record_index(self, step: int, microbatch: int, i: int) -> int:
        """Index into ``source`` of record ``i`` of microbatch ``microbatch`` at ``step``."""
        g = (step * self.microbatches + microbatch) * self.microbatch_size + i
        epoch, offset = divmod(g, self._len)
        if self.shuffle_seed is None:
            return offset
        return int(self._permutation(epoch)[offset])

    def batch(self, step: int, microbatch: int) -> dict[str, np.ndarray]:
        _check_index(step, microbatch)
        records = [self._record(self.record_index(step, microbatch, i)) for i in range(self.microbatch_size)]
        stacked = {k: np.stack([r[k] for r in records]) for k in records[0]}
        return check_batch(stacked, self._spec)

    def _record(self, index: int) -> dict[str, np.ndarray]:
        rec = self.source[index]
        if not isinstance(rec, Mapping):
            rec = {"value": rec}
        return {str(k): np.asarray(v) for k, v in rec.items()}

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([self.shuffle_seed, epoch])))
            perm = rng.permutation(self._len)
            # Keep this epoch and its neighbours; rebinding (not mutating) keeps readers in other threads safe.
            kept = {e: p for e, p in self._perms.items() if abs(e - epoch) <= 1}
            self._perms = {**kept, epoch: perm}
        return perm

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_perms"] = {}  # a cache: cheap to rebuild, possibly large to ship
        return state

    def __repr__(self) -> str:
        return (
            f"GrainSource({self.source!r}, microbatch_size={self.microbatch_size}, "
            f"microbatches={self.microbatches}, shuffle_seed={self.shuffle_seed})"
        )
