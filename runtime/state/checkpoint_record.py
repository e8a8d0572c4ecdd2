"""The record a checkpoint or snapshot holds beside its leaves, and the checks of what is read back.

A record is the JSON a store writes with one replica's state: the format
number, the step, the :func:`runtime.state.state_copy.state_digest` digest of the
leaves (which names its algorithm), each leaf's shape and dtype (by name,
bfloat16 included), the time the save started and the caller's metadata.
:func:`make_record` builds it (and refuses what could not be read back: a
bad step or digest, metadata that is not JSON, a dtype without a name); on
a read, :func:`check_record` checks that a record is one of a format read
here for the step asked for and gives the layout of the leaves to read, and
:func:`verified` checks the leaves read back against it (each shape and
dtype, then the digest).
:func:`newest_valid` is the fallback on a bad read: the newest step that
reads and verifies, and the newer ones passed over, with the reason.

Formats: 2 (written today) records ``"digest": "<algorithm>:<hex>"``; 1
(the format before) recorded ``"sha256": "<64 hex digits>"``, the sha256
:func:`~runtime.state.state_copy.state_digest`. Both are read, and each is
verified with the algorithm it names; what a read returns is the leaves'
digest in today's algorithm (:data:`~runtime.state.state_copy.DIGEST`), the one
replicas compare, whatever the record's.

Two stores write records: persistent checkpoints
(:class:`runtime.state.checkpoint.CheckpointStore`, with orbax) and in-memory
snapshots (:class:`runtime.state.snapshot.SnapshotStore`, plain files). Both check
what they read here, so a state comes back verified the same way from
either, and a failed check is the same error: :class:`CheckpointCorruptError`
naming the path, or :class:`CheckpointNotFoundError` when nothing is usable.
This module does no I/O and imports no orbax: the stores read and write,
it only builds records and judges what was read.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import NamedTuple

import numpy as np

from runtime.core.errors import ElasticError
from runtime.state.state_copy import DIGEST, digest_algorithm, state_digest

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "Restored",
    "Skipped",
    "check_record",
    "make_record",
    "newest_valid",
    "recorded_digest",
    "verified",
]

#: The format number of the records written: 2, ``"digest"`` naming its algorithm.
FORMAT = 2
#: The formats read: 2, and 1 (``"sha256"``: the bare hex digits of the sha256 digest); any other is refused.
READ_FORMATS = (1, 2)
_RESERVED = ("step", "created")              # keys a restore adds to the caller's metadata


# -- errors --------------------------------------------------------------------


class CheckpointError(ElasticError):
    """Base of the checkpoint store's errors."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint (of ``step``, or none at all) in ``directory``."""

    def __init__(self, directory: str, step: int | None, reason: str):
        super().__init__(directory, step, reason)
        self.directory, self.step, self.reason = directory, step, reason

    def __str__(self) -> str:
        what = f"step {self.step}" if self.step is not None else "a checkpoint"
        return f"no complete checkpoint of {what} in {self.directory}: {self.reason}"


class CheckpointCorruptError(CheckpointError):
    """A complete checkpoint that cannot be read or fails verification.

    A storage error while reading counts too: the store cannot tell a lost
    object from a lost connection once the storage client gave up retrying.
    """

    def __init__(self, path: str, reason: str):
        super().__init__(path, reason)
        self.path, self.reason = path, reason

    def __str__(self) -> str:
        return (f"checkpoint {self.path} is unusable: {self.reason}; restore an older one "
                "(CheckpointStore.restore_newest_valid) or delete it")


# -- results -------------------------------------------------------------------


class Restored(NamedTuple):
    """What a store's ``restore`` read (unpacks as ``step, leaves, digest, metadata``).

    ``digest``: :func:`~runtime.state.state_copy.state_digest` of ``leaves`` in
    today's algorithm (whatever the record's was). ``metadata``: the caller's
    metadata plus ``"step"`` and ``"created"`` (Unix seconds when the save started).
    """

    step: int
    leaves: list
    digest: str
    metadata: dict


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A complete checkpoint (or snapshot) a store's ``restore_newest_valid`` passed over, and why."""

    step: int
    path: str
    reason: str


# -- the record ----------------------------------------------------------------


def _dtype(name: str) -> np.dtype:
    import ml_dtypes  # noqa: F401 - registers bfloat16 and friends by name

    return np.dtype(name)


def make_record(step, leaves, *, digest: str, metadata: dict | None = None) -> tuple[int, list, dict]:
    """``(step, host leaves, record)`` of a state to store: the record (format :data:`FORMAT`) names the format,
    the step, the state's ``digest`` (:func:`~runtime.state.state_copy.state_digest` of ``leaves``), each leaf's
    shape and dtype, the time and the caller's ``metadata`` (checked by :func:`check_record` when read back).
    Raises ValueError for a bad step, digest, metadata or dtype.
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    step = int(step)
    digest_algorithm(digest)   # ValueError naming what is wrong
    metadata = dict(metadata or {})
    if clash := [k for k in _RESERVED if k in metadata]:
        raise ValueError(f"metadata keys {clash} are the store's own")
    leaves = [np.asarray(x) for x in leaves]
    record = {"format": FORMAT, "step": step, "digest": digest, "created": time.time(),
              "leaves": [[list(x.shape), x.dtype.name] for x in leaves], "metadata": metadata}
    try:
        json.dumps(record, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint metadata is not JSON: {e}") from e
    for i, (x, (_, name)) in enumerate(zip(leaves, record["leaves"])):
        try:
            same = _dtype(name) == x.dtype
        except TypeError:
            same = False
        if not same:
            raise ValueError(f"leaf {i}: dtype {x.dtype} cannot be recorded by its name {name!r}")
    return step, leaves, record


def newest_valid(directory: str, steps, read, at_most: int | None, none: str) -> tuple[Restored, list[Skipped]]:
    """The newest of ``steps`` (at ``at_most`` or before) that ``read(step)`` reads without
    :class:`CheckpointCorruptError`, and the newer ones it passed over (newest first, with the reason); else
    :class:`CheckpointNotFoundError` for ``directory`` listing them (``none``: the reason when there were none)."""
    skipped: list[Skipped] = []
    for step in reversed(steps):
        if at_most is not None and step > at_most:
            continue
        try:
            return read(step), skipped
        except CheckpointCorruptError as e:
            skipped.append(Skipped(step, e.path, e.reason))
    why = "; ".join(f"step {s.step}: {s.reason}" for s in skipped) or none
    if at_most is not None:
        why = f"at or before step {at_most}: {why}"
    raise CheckpointNotFoundError(directory, None, why)


def verified(step: int, leaves: list, layout, record: dict, path: str) -> Restored:
    """``leaves`` read back for ``record`` (checked by :func:`check_record`, whose ``layout`` it answered), as
    :class:`Restored` once each leaf has its recorded shape and dtype and the whole hashes to the recorded
    digest, in the algorithm the record names; else :class:`CheckpointCorruptError` naming ``path``."""
    for i, (x, (shape, dtype)) in enumerate(zip(leaves, layout)):
        if x.shape != shape or x.dtype != dtype:
            raise CheckpointCorruptError(path, f"leaf {i} is {x.shape} {x.dtype}, its record says {shape} {dtype}")
    recorded = recorded_digest(record)
    algorithm = digest_algorithm(recorded)
    digest = state_digest(leaves, algorithm)
    if digest != recorded:
        raise CheckpointCorruptError(path, f"its leaves hash to {digest[:len(algorithm) + 17]}..., "
                                           f"it recorded {recorded[:len(algorithm) + 17]}...")
    if algorithm != DIGEST:   # an older record: the state's digest as replicas compare it
        digest = state_digest(leaves)
    return Restored(step, leaves, digest, dict(record["metadata"], step=step, created=record["created"]))


def recorded_digest(record: dict) -> str:
    """The digest a record (of a format :func:`check_record` accepted) holds, as ``"<algorithm>:<hex>"``:
    format 2's ``"digest"``, or format 1's ``"sha256"`` hex digits as the sha256 digest."""
    return record["digest"] if record["format"] >= 2 else f"sha256:{record['sha256']}"


def check_record(record, step: int, path: str) -> list[tuple[tuple[int, ...], np.dtype]]:
    """The record's leaf layout, after checking the record is one this store wrote for ``step`` (of a format
    in :data:`READ_FORMATS`, its digest of a known algorithm)."""
    got = record.get("format") if isinstance(record, dict) else type(record).__name__
    if isinstance(got, bool) or got not in READ_FORMATS:
        raise CheckpointCorruptError(path, f"its record is not of format {' or '.join(map(str, READ_FORMATS))} "
                                           f"(got {got!r})")
    try:
        layout = [(tuple(int(d) for d in shape), _dtype(name)) for shape, name in record["leaves"]]
        ok = (record["step"] == step and isinstance(record["metadata"], dict)
              and isinstance(record["created"], (int, float)))
        digest_algorithm(recorded_digest(record))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointCorruptError(path, f"its record is malformed ({_describe(e)})") from e
    if not ok:
        raise CheckpointCorruptError(path, f"its record does not describe step {step}")
    return layout


# -- helpers -------------------------------------------------------------------


def _describe(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 600 else text[:600] + "..."
