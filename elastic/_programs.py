"""Builds the runtime's programs from user code, once, in the client.

The client traces with abstract values only (``jax.ShapeDtypeStruct`` on an
``AbstractMesh``), so it never materializes the training state whatever the
model size. Each program is exported with ``jax.export`` for one virtual slice
of ``D`` devices of one platform (the config key ``hardware``) and shipped as
bytes.

What cannot be exported: host callbacks (``jax.pure_callback``,
``jax.debug.callback``) and anything that needs concrete values at trace time
(Python control flow on array values). Both raise :class:`ProgramExportError`
naming the program, before any worker starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from runtime import MESH_AXIS, ProgramExportError, ProgramSet, program_fingerprint

__all__ = ["build_programs", "shard_dim", "export_program", "program_fingerprints", "trace_init", "used_inputs"]


def shard_dim(shape: tuple[int, ...], num_devices: int) -> int | None:
    """FSDP placement of one state leaf: its largest dimension divisible by D.

    Returns None (replicate) for scalars, for D == 1, and for leaves with no
    such dimension. Ties go to the first dimension.
    """
    if num_devices == 1:
        return None
    best = None
    for i, n in enumerate(shape):
        if n % num_devices == 0 and n >= num_devices and (best is None or n > shape[best]):
            best = i
    return best


def _named(mesh, dim):
    if dim is None:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, PartitionSpec(*([None] * dim), MESH_AXIS))


def export_program(name: str, fn: Callable, args: tuple, in_dims: list, out_dims, mesh, platform: str = "cpu") -> bytes:
    """Exports ``fn(*args)`` for JAX platform ``platform`` with the given per-leaf placements; returns its bytes.

    Any platform can be exported for from any client (a CPU-only one
    included): lowering needs no device of that platform.
    """
    in_shardings = jax.tree.unflatten(jax.tree.structure(args), [_named(mesh, d) for d in in_dims])
    out_shardings = jax.tree.map(lambda d: _named(mesh, d), out_dims, is_leaf=lambda x: x is None)
    try:
        jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings)
        return bytes(jax.export.export(jitted, platforms=[platform])(*args).serialize())
    except Exception as e:  # noqa: BLE001 - any tracing/lowering failure is reported as one typed error
        raise ProgramExportError(f"could not export the {name!r} program with jax.export: "
                                 f"{type(e).__name__}: {e}") from e


def _flatten_f32(tree) -> jax.Array:
    return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree)])


def _unflatten_like(flat: jax.Array, like):
    leaves, treedef = jax.tree.flatten(like)
    out, off = [], 0
    for x in leaves:
        n = math.prod(x.shape)
        out.append(flat[off:off + n].reshape(x.shape).astype(x.dtype))
        off += n
    return jax.tree.unflatten(treedef, out)


def trace_init(init: Callable):
    """``init(key)``'s result as a tree of ``jax.ShapeDtypeStruct`` (nothing materialized)."""
    try:
        return jax.eval_shape(lambda seed: init(jax.random.key(seed)), jax.ShapeDtypeStruct((), jnp.int32))
    except Exception as e:  # noqa: BLE001 - user code: one typed error naming it
        raise ProgramExportError(f"could not trace the init function: {type(e).__name__}: {e}") from e


def build_programs(
    *,
    init_state: Callable,        # key -> state
    grad_fn: Callable,           # (state, batch) -> (loss, grads pytree)
    apply_fn: Callable,          # (state, mean grads pytree) -> state
    batch_spec: dict,            # key -> (shape, dtype) of one microbatch
    devices_per_slice: int,
    num_microbatches: int,
    platform: str = "cpu",       # jax.export's name: cpu, cuda, rocm, tpu
    checkpoint_tree=None,        # runtime.state.checkpoint_tree.CheckpointTree: how checkpoints name the leaves
) -> ProgramSet:
    """Traces and exports init / grad / apply for a slice of ``devices_per_slice`` devices of ``platform``."""
    d = devices_per_slice
    mesh = AbstractMesh((d,), (MESH_AXIS,))
    seed_spec = jax.ShapeDtypeStruct((), jnp.int32)

    # Programs take and return the state as a flat list of arrays: the
    # serialized form then needs no knowledge of the user's pytree types.
    state_shapes, treedef = jax.tree.flatten(trace_init(init_state))
    state_dim_list = [shard_dim(s.shape, d) for s in state_shapes]
    _check_tree(checkpoint_tree, state_shapes)

    def init(seed):
        return jax.tree.leaves(init_state(jax.random.key(seed)))
    batch_shapes = {k: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype)) for k, (shape, dtype) in batch_spec.items()}
    for k, s in batch_shapes.items():
        if not s.shape or s.shape[0] % d:
            raise ProgramExportError(f"batch key {k!r} has shape {s.shape}: its leading (batch) dimension "
                                     f"must be divisible by the {d} devices of a slice")
    batch_dims = [0] * len(batch_shapes)

    def grad_tree(state, batch):
        return grad_fn(jax.tree.unflatten(treedef, state), batch)

    grad_shapes = jax.eval_shape(lambda st, b: grad_tree(st, b)[1], state_shapes, batch_shapes)
    grad_size = sum(math.prod(g.shape) for g in jax.tree.leaves(grad_shapes))

    def grad(state, batch):
        # One vector, the loss last: it is reduced with the gradient, and the host takes it as is (no copy).
        loss, grads = grad_tree(state, batch)
        return jnp.concatenate([_flatten_f32(grads), jnp.asarray(loss, jnp.float32)[None]])

    def apply(state, grad_sum):
        mean = _unflatten_like(grad_sum / np.float32(num_microbatches), grad_shapes)
        return jax.tree.leaves(apply_fn(jax.tree.unflatten(treedef, state), mean))

    flat_spec = jax.ShapeDtypeStruct((grad_size,), jnp.float32)
    programs = {
        "init": export_program("init", init, (seed_spec,), [None], state_dim_list, mesh, platform),
        "grad": export_program("grad", grad, (state_shapes, batch_shapes), state_dim_list + batch_dims,
                               None, mesh, platform),
        "apply": export_program("apply", apply, (state_shapes, flat_spec), state_dim_list + [None],
                                state_dim_list, mesh, platform),
    }
    state_bytes = sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in state_shapes)
    return ProgramSet(
        **programs,
        devices_per_slice=d,
        num_microbatches=num_microbatches,
        grad_size=int(grad_size),
        state_bytes=int(state_bytes),
        batch_spec={k: [list(s.shape), np.dtype(s.dtype).str] for k, s in batch_shapes.items()},
        in_specs={"init": [None], "grad": state_dim_list + batch_dims, "apply": state_dim_list + [None]},
        checkpoint_tree=None if checkpoint_tree is None else checkpoint_tree.to_json(),
    )


def _check_tree(tree, state_shapes) -> None:
    """A checkpoint tree must place this state's leaves, each in a dtype of its size."""
    if tree is None:
        return
    if len(tree) != len(state_shapes):
        raise ProgramExportError(f"the checkpoint tree places {len(tree)} leaves; the state has {len(state_shapes)}")
    for i, ((dtype, _), s) in enumerate(zip(tree.leaves, state_shapes)):
        if dtype is not None and np.dtype(dtype).itemsize != np.dtype(s.dtype).itemsize:
            raise ProgramExportError(f"the checkpoint tree stores state leaf {i} ({s.dtype}) as {dtype}: a stored "
                                     "dtype must be the same size")


def program_fingerprints(programs: ProgramSet) -> dict[str, str]:
    """``{program name: sha256 of its StableHLO text without source locations}``: which math each program is.

    The client records them (``programs_built``) so that a later attempt of the run can tell, before
    anything starts, which program changed (``init``: the model's parameters; ``grad``: the model and its
    loss; ``apply``: the optimizer's update, where a learning-rate schedule lives). The same model and
    optimizer give the same fingerprints however and wherever they were traced.
    """
    return {name: program_fingerprint(blob) for name, blob in sorted(programs.programs().items())}


def used_inputs(jaxpr) -> list[bool]:
    """Which inputs of ``jaxpr`` its outputs depend on (dead-code elimination)."""
    from jax._src.interpreters import partial_eval as pe  # no public DCE API

    _, used = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return used


