"""Cuts a loss marked with ``elastic.pipeline_stage`` into per-stage programs, once, in the client.

The loss is traced with abstract values only, as :mod:`elastic._programs`
does. Each parameter leaf belongs to the one stage whose forward reads it
(found by dead-code elimination of each stage's trace); a leaf no stage
reads goes to the last stage, and a leaf two stages read (tied weights, or
a value of an earlier stage reaching a later one other than through the
marks) is refused by name. Each stage's state is its parameters and the
optimizer's state over them, so a stage's ``apply`` is the optimizer's
update of its own leaves: the same math per leaf as an unpipelined update for
an elementwise optimizer (Adam, SGD, ...); an optimizer that couples leaves
(``clip_by_global_norm``) sees one stage's leaves at a time.

Each stage's ``backward`` recomputes its forward from the stage's input, so
only stage inputs live between a microbatch's forward and backward passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from elastic._programs import _flatten_f32, _unflatten_like, export_program, shard_dim, trace_init, used_inputs
from elastic.stages import StageCutError, cut_at_stage, probe_stages
from runtime import MESH_AXIS, PipelineProgramSet, ProgramExportError, StagePrograms

__all__ = ["build_stage_programs", "stage_owners"]


def build_stage_programs(*, init_params: Callable, loss: Callable, optimizer, batch_spec: dict, num_stages: int,
                         devices_per_slice: int, num_microbatches: int, platform: str = "cpu") -> PipelineProgramSet:
    """Traces ``loss(params, batch)`` (``num_stages - 1`` marks) and exports each stage's programs."""
    s_count, d = num_stages, devices_per_slice
    mesh = AbstractMesh((d,), (MESH_AXIS,))
    params_shapes = trace_init(init_params)
    batch = {k: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype)) for k, (shape, dtype) in batch_spec.items()}
    acts = _probe(loss, params_shapes, batch, s_count)
    leaves, ptree = jax.tree.flatten(params_shapes)
    owners = stage_owners(loss, params_shapes, batch, acts)

    stages = []
    for k in range(s_count):
        mine = [i for i, o in enumerate(owners) if o == k]
        stages.append(_stage(k, s_count, mine, leaves, ptree, _stage_forward(loss, ptree, acts, k), init_params,
                             optimizer, batch,
                             acts[k - 1] if k else None, acts[k] if k < s_count - 1 else None,
                             mesh, d, num_microbatches, platform))
    return PipelineProgramSet(tuple(stages))


def _stage(k, s_count, mine, leaves, ptree, run_stage, init_params, opt, batch, act_in, act_out, mesh, d,
           num_microbatches, platform) -> StagePrograms:
    """One stage's programs. ``mine``: indices of the parameter leaves it owns."""
    last = k == s_count - 1

    def select(param_leaves):   # the stage's parameters: its leaves, None for everyone else's (an empty subtree)
        own = set(mine)
        return jax.tree.unflatten(ptree, [x if i in own else None for i, x in enumerate(param_leaves)])

    def full(own_leaves):       # every parameter leaf: the stage's own, zeros for the others (dead code there)
        it = iter(own_leaves)
        own = set(mine)
        return [next(it) if i in own else jnp.zeros(s.shape, s.dtype) for i, s in enumerate(leaves)]

    params_k = select(leaves)
    state_shapes, state_tree = jax.tree.flatten(jax.eval_shape(lambda p: (p, opt.init(p)), params_k))
    n_own = len(mine)

    def unpack(state):
        params, opt_state = jax.tree.unflatten(state_tree, state)
        return params, opt_state

    def init(seed):
        p = select(jax.tree.leaves(init_params(jax.random.key(seed))))
        return jax.tree.leaves((p, opt.init(p)))

    in_leaves = jax.tree.leaves(act_in) if act_in is not None else []
    out_leaves = jax.tree.leaves(act_out) if act_out is not None else []
    in_tree = jax.tree.structure(act_in) if act_in is not None else None
    out_tree = jax.tree.structure(act_out) if act_out is not None else None
    grad_size = sum(math.prod(leaves[i].shape) for i in mine)

    def stage_fn(own, b, a_in):
        return run_stage(full(own), b, None if a_in is None else jax.tree.unflatten(in_tree, a_in))

    def forward(state, b, *a_in):
        own = state[:n_own]
        return jax.tree.leaves(stage_fn(own, b, list(a_in[0]) if a_in else None))

    def vector(d_own, loss):
        flat = (_flatten_f32(d_own) if d_own else jnp.zeros((0,), jnp.float32))
        return jnp.concatenate([flat, jnp.asarray(loss, jnp.float32)[None]])

    def backward(state, b, *rest):
        own = state[:n_own]
        a_in, g_out = (rest[0], rest[1]) if k else (None, rest[0])
        if k:
            _, vjp = jax.vjp(lambda o, a: jax.tree.leaves(stage_fn(o, b, a)), own, list(a_in))
            d_own, g_in = vjp(list(g_out))
            return vector(d_own, 0.0), g_in
        _, vjp = jax.vjp(lambda o: jax.tree.leaves(stage_fn(o, b, None)), own)
        (d_own,) = vjp(list(g_out))
        return vector(d_own, 0.0), []

    def last_fn(state, b, a_in):
        own = state[:n_own]
        value, (d_own, g_in) = jax.value_and_grad(lambda o, a: stage_fn(o, b, a), argnums=(0, 1))(own, list(a_in))
        return vector(d_own, value), g_in

    def apply(state, grad_sum):
        params, opt_state = unpack(state)
        mean = _unflatten_like(grad_sum / np.float32(num_microbatches), params)
        updates, opt_state = opt.update(mean, opt_state, params)
        import optax

        return jax.tree.leaves((optax.apply_updates(params, updates), opt_state))

    state_dims = [shard_dim(s.shape, d) for s in state_shapes]
    batch_dims = [0] * len(batch)
    in_dims = [_batch_dim(a.shape, d) for a in in_leaves]
    out_dims = [_batch_dim(a.shape, d) for a in out_leaves]
    acts_in = (list(in_leaves),) if k else ()
    specs = {"init": [None], "apply": state_dims + [None]}
    blobs = {
        "init": export_program(f"stage {k} init", init, (jax.ShapeDtypeStruct((), jnp.int32),), [None], state_dims,
                               mesh, platform),
        "apply": export_program(f"stage {k} apply", apply, (state_shapes, jax.ShapeDtypeStruct((grad_size,),
                                jnp.float32)), specs["apply"], state_dims, mesh, platform),
    }
    if last:
        specs["last"] = state_dims + batch_dims + in_dims
        blobs["last"] = export_program(f"stage {k} last", last_fn, (state_shapes, batch, list(in_leaves)),
                                       specs["last"], (None, in_dims), mesh, platform)
    else:
        specs["forward"] = state_dims + batch_dims + in_dims
        blobs["forward"] = export_program(f"stage {k} forward", forward, (state_shapes, batch, *acts_in),
                                          specs["forward"], out_dims, mesh, platform)
        specs["backward"] = state_dims + batch_dims + in_dims + out_dims
        blobs["backward"] = export_program(f"stage {k} backward", backward,
                                           (state_shapes, batch, *acts_in, list(out_leaves)),
                                           specs["backward"], (None, in_dims), mesh, platform)
    state_bytes = sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in state_shapes)
    return StagePrograms(
        stage=k, num_stages=s_count, blobs=blobs, devices_per_slice=d, num_microbatches=num_microbatches,
        grad_size=int(grad_size), state_bytes=int(state_bytes),
        batch_spec={key: [list(s.shape), np.dtype(s.dtype).str] for key, s in batch.items()}, in_specs=specs,
        activation_in=_spec_list(in_leaves), activation_out=_spec_list(out_leaves))


def _stage_forward(loss, ptree, acts: list, k: int) -> Callable:
    """Stage ``k``'s forward, ``(parameter leaves, batch, its input) -> its output`` (the loss for the last stage),
    traced from the whole loss: the marks cut it (:func:`elastic.stages.cut_at_stage`)."""
    s_count = len(acts) + 1

    def run(param_leaves, batch, a_in):
        params = jax.tree.unflatten(ptree, param_leaves)
        if k < s_count - 1:
            out, out_tree = jax.tree.flatten(acts[k])
            refs = [jax.new_ref(jnp.zeros(a.shape, a.dtype)) for a in out]
        else:
            out_tree, refs = None, []
        with cut_at_stage(k, a_in, out_tree, refs) as m:
            value = loss(params, batch)
        if m.calls != s_count - 1:
            raise StageCutError(f"the loss called elastic.pipeline_stage {m.calls} times while tracing stage {k}, "
                                f"{s_count - 1} times before: the marks must not depend on the stage")
        return value if k == s_count - 1 else jax.tree.unflatten(out_tree, [r[...] for r in refs])
    return run


def _batch_dim(shape, d: int) -> int | None:
    """An activation's placement on the slice: split on its leading (batch) dimension when it divides."""
    return 0 if d > 1 and shape and shape[0] % d == 0 else None


def _spec_list(leaves) -> list:
    return [[list(a.shape), np.dtype(a.dtype).str] for a in leaves]


def _probe(loss, params, batch, num_stages: int) -> list:
    """Each mark's value as a tree of ShapeDtypeStructs; refuses a loss with the wrong number of marks."""
    try:
        with probe_stages() as m:
            jax.eval_shape(loss, params, batch)
    except StageCutError as e:
        raise ProgramExportError(str(e)) from e
    except Exception as e:  # noqa: BLE001 - user code: one typed error naming it
        raise ProgramExportError(f"could not trace loss(params, batch): {type(e).__name__}: {e}") from e
    if m.calls != num_stages - 1:
        raise ProgramExportError(f"dcn_pipeline_parallelism={num_stages} needs {num_stages - 1} "
                                 f"elastic.pipeline_stage mark(s) in the loss's forward pass; it called "
                                 f"{m.calls} (a mark inside lax.scan or a loop body counts once)")
    for i, tree in enumerate(m.shapes):
        if not jax.tree.leaves(tree):
            raise ProgramExportError(f"elastic.pipeline_stage mark {i} carries no array: pass it the activations "
                                     "that flow to the next stage")
    return m.shapes


def stage_owners(loss, params, batch, acts) -> list[int]:
    """The stage each parameter leaf belongs to (the one whose forward reads it; unread leaves: the last)."""
    s_count = len(acts) + 1
    leaves, ptree = jax.tree.flatten(params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    readers: list[list[int]] = [[] for _ in leaves]
    for k in range(s_count):
        try:
            closed = jax.make_jaxpr(_stage_forward(loss, ptree, acts, k))(leaves, batch, acts[k - 1] if k else None)
        except StageCutError as e:
            raise ProgramExportError(str(e)) from e
        for i, used in enumerate(used_inputs(closed.jaxpr)[:len(leaves)]):
            if used:
                readers[i].append(k)
    for i, ks in enumerate(readers):
        if len(ks) > 1:
            raise ProgramExportError(f"parameter {paths[i] or '(the root)'} is read by pipeline stages {ks}: a "
                                     "parameter belongs to one stage (untie shared weights, or pass a value an "
                                     "earlier stage computes through elastic.pipeline_stage instead of reading "
                                     "it directly)")
    return [ks[0] if ks else s_count - 1 for ks in readers]
