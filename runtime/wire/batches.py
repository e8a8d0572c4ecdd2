"""A microbatch's batch as a message (``FedBatch``): what an RL run's sampler makes and its trainer trains on.

The client carries these from the sampler's ``Rollout`` reply to the trainer's
step request unchanged (token ids and a few floats per row: small next to the
weights, which never pass through it).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from runtime._proto import elastic_pb2 as pb
from runtime.core.errors import ProtocolError

__all__ = ["decode_batch", "encode_batch"]

_PLAIN_KINDS = "biuf"   # what a batch's bytes may be viewed as (never Python objects)


def encode_batch(step: int, microbatch: int, version: int, arrays: Mapping[str, np.ndarray]) -> pb.FedBatch:
    """``arrays`` (name -> host array) as one ``FedBatch`` of ``(step, microbatch)``, made with weights ``version``."""
    return pb.FedBatch(step=step, microbatch=microbatch, version=version, arrays=[
        pb.NamedArray(name=n, shape=np.shape(a), dtype=np.asarray(a).dtype.str,
                      data=np.ascontiguousarray(a).tobytes()) for n, a in arrays.items()])


def decode_batch(batch: pb.FedBatch, spec: Mapping[str, tuple] | None = None) -> dict[str, np.ndarray]:
    """The arrays of ``batch`` (name -> array; views of its bytes). With ``spec`` (``{key: (shape, dtype)}``, a
    program's batch), exactly its keys, each of its shape and dtype. ``ProtocolError`` naming what does not fit."""
    out = {}
    for a in batch.arrays:
        try:
            dtype = np.dtype(a.dtype)
        except TypeError:
            raise ProtocolError(f"batch ({batch.step}, {batch.microbatch}): array {a.name!r} has dtype "
                                f"{a.dtype!r}") from None
        shape = tuple(a.shape)
        if dtype.kind not in _PLAIN_KINDS or any(n < 0 for n in shape) or \
                int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != len(a.data):
            raise ProtocolError(f"batch ({batch.step}, {batch.microbatch}): array {a.name!r} of {len(a.data)} "
                                f"bytes is not {shape} {dtype}")
        out[a.name] = np.frombuffer(a.data, dtype).reshape(shape)
    if spec is not None:
        want = {k: (tuple(s), np.dtype(t)) for k, (s, t) in spec.items()}
        missing = sorted(set(want) - set(out))
        if missing:
            raise ProtocolError(f"batch ({batch.step}, {batch.microbatch}) lacks {missing}")
        for k, (shape, dtype) in want.items():
            if out[k].shape != shape or out[k].dtype != dtype:
                raise ProtocolError(f"batch ({batch.step}, {batch.microbatch}): {k!r} is {out[k].shape} "
                                    f"{out[k].dtype}, the program takes {shape} {dtype}")
        out = {k: out[k] for k in want}
    return out
