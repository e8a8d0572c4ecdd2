"""A checkpoint's state as a named tree, for a reader that knows the model (MaxText's trainer), not the runtime.

The runtime keeps a replica's state as a flat list of arrays. By default a
persistent checkpoint stores that list as it is (orbax item ``state``). A job
may instead give a :class:`CheckpointTree`: where each leaf goes in a nested
tree of dicts and lists (orbax item ``items``, the name MaxText's checkpoints
use), and how it is stored there:

- ``skeleton``: JSON of dicts (string keys), lists and ``None``, whose other
  values are leaf indices, each index of the state exactly once; ``None``
  stays an empty node, as orbax writes it;
- ``leaves``: per leaf, ``[dtype, key_impl]``: ``dtype`` a dtype name to
  store it as (a same-size integer view, e.g. NNX's ``uint32`` step as
  Linen's ``int32``; bits unchanged) or ``None``; ``key_impl`` a JAX PRNG
  implementation name when the leaf is that key's data, stored as a typed key
  (as a reader restoring typed keys expects) or ``None``;
- ``step_path``: where the tree holds the step count (MaxText's ``step``), if
  it does: a checkpoint another program wrote (no jax-elastic record beside
  it) is read only when that leaf equals the step its directory stands for.

An empty leaf (orbax writes none) is an empty node, rebuilt from the state's
layout when read.

:func:`to_items` builds what is written, :func:`from_items` takes the flat
leaves back out of what was read, with their own dtypes, so the digest the
record holds verifies them as for any checkpoint. This module imports JAX
to write (the leaves go as JAX arrays) and to read typed keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["CheckpointTree", "from_items", "map_skeleton", "step_in", "take", "to_items"]


@dataclasses.dataclass(frozen=True)
class CheckpointTree:
    """Where each state leaf is written in a checkpoint's ``items`` tree (see the module docstring)."""

    skeleton: object
    leaves: tuple[tuple[str | None, str | None], ...]
    step_path: tuple[str, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "leaves", tuple((d, k) for d, k in self.leaves))
        if self.step_path is not None:
            object.__setattr__(self, "step_path", tuple(self.step_path))
        seen: list[int] = []
        _walk(self.skeleton, seen.append, ())
        if sorted(seen) != list(range(len(self.leaves))):
            missing = sorted(set(range(len(self.leaves))) - set(seen))
            twice = sorted({i for i in seen if seen.count(i) > 1})
            raise ValueError(f"a checkpoint tree must place each of its {len(self.leaves)} leaves once: "
                             f"missing {missing[:5]}, twice {twice[:5]}, out of range "
                             f"{sorted(i for i in set(seen) if not 0 <= i < len(self.leaves))[:5]}")
        for dtype, _ in self.leaves:
            if dtype is not None:
                np.dtype(dtype)   # a name numpy knows, or TypeError

    def to_json(self) -> dict:
        return {"skeleton": self.skeleton, "leaves": [list(x) for x in self.leaves],
                "step_path": None if self.step_path is None else list(self.step_path)}

    @classmethod
    def from_json(cls, value) -> CheckpointTree:
        """The tree :meth:`to_json` gave; ``ValueError`` when ``value`` is not one."""
        try:
            return cls(value["skeleton"], tuple(tuple(x) for x in value["leaves"]), value.get("step_path"))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a checkpoint tree ({type(e).__name__}: {e})") from None

    @classmethod
    def named(cls, paths: Sequence[tuple[str | int, ...]]) -> CheckpointTree | None:
        """The tree placing leaf ``i`` at ``paths[i]``: its path in the state's pytree, each step a string (a dict
        key, an attribute name: a key of the tree) or an int (a position in a sequence: a place in a list; places no
        leaf takes are empty nodes). None when the paths do not make one tree (a path that is a prefix of another,
        a node that is both a dict and a list, a key orbax could not tell apart: empty, or with "." or "/"): the
        state is then stored flat. Pure; the caller (``elastic``'s
        program builder, for an ``elastic.Trainer``'s ``(params, optimizer state)``) takes the paths from JAX."""
        root: dict = {}
        for index, path in enumerate(paths):
            if not path:
                return None
            node = root
            for step, key in enumerate(path):
                if isinstance(key, str) and (not key or "." in key or "/" in key):
                    return None   # orbax joins a leaf's keys with "." into a file name: "a.b" and a/b would clash
                last = step == len(path) - 1
                if key in node and (last or not isinstance(node[key], dict)):
                    return None   # two leaves at one place, or a leaf where another path goes on
                if last:
                    node[key] = index
                else:
                    node = node.setdefault(key, {})

        def build(node):
            if not isinstance(node, dict):
                return node
            keys = list(node)
            if all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
                if min(keys) < 0:
                    raise ValueError("a negative position")
                return [build(node[i]) if i in node else None for i in range(max(keys) + 1)]
            if all(isinstance(k, str) for k in keys):
                return {k: build(v) for k, v in node.items()}
            raise ValueError("a node both a dict and a list")

        try:
            skeleton = build(root)
            return cls(skeleton, tuple((None, None) for _ in paths))
        except ValueError:
            return None

    def __len__(self) -> int:
        return len(self.leaves)


def to_items(leaves: Sequence[np.ndarray], tree: CheckpointTree):
    """The ``items`` tree to write for the flat ``leaves``: each at its place, in its stored dtype or as a typed
    key, as a JAX array on this process's CPU (orbax's array handler then writes it as MaxText's trainer writes
    its own)."""
    if len(leaves) != len(tree):
        raise ValueError(f"the checkpoint tree places {len(tree)} leaves, the state has {len(leaves)}")

    def stored(i: int):
        dtype, key_impl = tree.leaves[i]
        x = np.asarray(leaves[i])
        if not x.size:
            return None   # orbax writes no empty array; from_items rebuilds it
        if dtype is not None:
            x = _view(x, np.dtype(dtype))
        x = jax.device_put(x, cpu)
        return jax.random.wrap_key_data(x, impl=key_impl) if key_impl is not None else x

    import jax

    cpu = jax.local_devices(backend="cpu")[0]
    return map_skeleton(tree.skeleton, stored)


def from_items(items, tree: CheckpointTree, layout: Sequence[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
    """The flat leaves (each of ``layout``'s shape and dtype) out of an ``items`` tree read back; ``ValueError``
    naming the first place that is missing or does not fit."""
    if len(layout) != len(tree):
        raise ValueError(f"the checkpoint tree places {len(tree)} leaves, the state has {len(layout)}")
    got = take(items, tree.skeleton, tree, layout)
    return [got[i] for i in range(len(tree))]


def take(items, skeleton, tree: CheckpointTree, layout, prefix: tuple = ()) -> dict[int, np.ndarray]:
    """``{leaf index: array}`` of the leaves ``skeleton`` places (``tree``'s skeleton, or its subtree at
    ``prefix``), out of ``items`` read back (the same part of the checkpoint's tree), each of ``layout``'s
    shape and dtype; ``ValueError`` naming the first place that is missing or does not fit."""
    out: dict[int, np.ndarray] = {}

    def one(index: int, path: tuple) -> None:
        shape, want = layout[index]
        if not np.prod(shape, dtype=np.int64):
            out[index] = np.empty(shape, want)
            return
        node = _lookup(items, path, prefix)
        dtype, key_impl = tree.leaves[index]
        if key_impl is not None and _is_key(node):
            import jax

            node = jax.random.key_data(node)
        x = np.asarray(node)
        if dtype is not None and x.dtype == np.dtype(dtype):
            x = _view(x, np.dtype(want))
        if tuple(x.shape) != tuple(shape) or x.dtype != np.dtype(want):
            raise ValueError(f"the checkpoint's {'/'.join(map(str, prefix + path))} is {x.dtype}{list(x.shape)}, "
                             f"the state's leaf {index} {np.dtype(want)}{list(shape)}")
        out[index] = x

    _walk(skeleton, one, (), with_path=True)
    return out


def step_in(items, tree: CheckpointTree) -> int | None:
    """The step count an ``items`` tree read back holds at ``tree.step_path`` (None without one)."""
    if tree.step_path is None:
        return None
    return int(np.asarray(_lookup(items, tree.step_path)))


def _lookup(items, path: tuple, prefix: tuple = ()):
    node = items
    for key in path:
        try:
            node = node[int(key)] if isinstance(node, (list, tuple)) else node[key]
        except (KeyError, IndexError, TypeError, ValueError):
            raise ValueError(f"the checkpoint has no {'/'.join(map(str, prefix + path))}") from None
    return node


def _view(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if x.dtype == dtype:
        return x
    if x.dtype.itemsize != dtype.itemsize:
        raise ValueError(f"cannot store a {x.dtype} leaf as {dtype}: a stored dtype must be the same size")
    return (x if x.flags.c_contiguous else x.copy()).view(dtype)   # (ascontiguousarray makes a 0-d array 1-d)


def _is_key(x) -> bool:
    import jax

    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def map_skeleton(node, fn):
    """``node`` with each leaf index ``i`` replaced by ``fn(i)`` (dicts, lists and ``None`` kept)."""
    if isinstance(node, dict):
        return {k: map_skeleton(v, fn) for k, v in node.items()}
    if isinstance(node, list):
        return [map_skeleton(v, fn) for v in node]
    return None if node is None else fn(node)


def _walk(node, fn, path: tuple, with_path: bool = False) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if not isinstance(k, str):
                raise ValueError(f"a checkpoint tree's keys are strings, got {k!r} at {'/'.join(map(str, path))}")
            _walk(v, fn, (*path, k), with_path)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _walk(v, fn, (*path, i), with_path)
    elif node is not None:
        if isinstance(node, bool) or not isinstance(node, int):
            raise ValueError(f"a checkpoint tree's leaves are leaf indices, got {node!r} at "
                             f"{'/'.join(map(str, path))}")
        if with_path:
            fn(node, path)
        else:
            fn(node)

