"""Builds the runtime's programs from user code, once, in the client: :func:`build_programs`, for any stage count.

The client traces with abstract values only (``jax.ShapeDtypeStruct`` on an
``AbstractMesh``), so it never materializes the training state whatever the
model size. Each program is exported with ``jax.export`` for one virtual slice
of ``D`` devices of one platform (the config key ``hardware``) and shipped as
bytes. An unpipelined run is one stage whose ``grad`` program is the whole
gradient; a pipelined run's loss is cut at its :func:`elastic.pipeline_stage`
marks (:mod:`elastic.stages`) into a forward and a backward per stage.

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

from elastic.stages import StageCutError, cut_at_stage, probe_stages
from runtime import MESH_AXIS, CheckpointTree, ProgramExportError, ProgramSet, StagePrograms, program_fingerprint

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
    batch_spec: dict,            # key -> (shape, dtype) of one microbatch
    devices_per_slice: int,
    num_microbatches: int,
    platform: str = "cpu",       # jax.export's name: cpu, cuda, rocm, tpu
    num_stages: int = 1,         # pipeline stages (dcn_pipeline_parallelism); 1: data parallelism alone
    init_params: Callable | None = None,   # key -> params            } a loss and an optax optimizer
    loss: Callable | None = None,          # (params, batch) -> loss  } (elastic.Trainer): any stage count
    optimizer=None,                        #                          }
    init_state: Callable | None = None,    # key -> state                        } a whole step's parts
    grad_fn: Callable | None = None,       # (state, batch) -> (loss, grads)     } (elastic.wrap): one stage
    apply_fn: Callable | None = None,      # (state, mean grads pytree) -> state }
    eval_fn: Callable | None = None,       # (state, batch) -> (loss total, weight); default (grad's loss, 1)
    checkpoint_tree=None,        # runtime.state.checkpoint_tree.CheckpointTree: how checkpoints name the leaves
                                 # (a loss and an optimizer's: params/... and opt_state/..., by their pytree paths)
    evaluate: bool = False,      # also export ``eval`` (the loss of one microbatch, forward only): eval is configured
) -> ProgramSet:
    """Traces and exports a run's programs, for ``num_stages`` stages on slices of ``devices_per_slice``
    devices of ``platform``. The client calls it once, before any worker starts; what cannot be exported
    raises :class:`ProgramExportError` naming the program.

    One stage computes the whole gradient in one program (``grad``), from a loss and an optimizer or from a
    step's parts. More stages cut ``loss`` at its ``num_stages - 1`` :func:`elastic.pipeline_stage` marks
    (:func:`_cut_stages`): only a loss and an optimizer can be cut. ``evaluate``: one stage also exports ``eval``
    (a pipelined run has none: ``ValueError``; the config refuses eval there first).
    """
    if evaluate and num_stages > 1:
        raise ValueError("eval is not built for a pipelined run (dcn_pipeline_parallelism > 1)")
    if loss is not None:
        if num_stages > 1:
            stages = _cut_stages(init_params, loss, optimizer, batch_spec, num_stages, devices_per_slice,
                                 num_microbatches, platform)
            return ProgramSet(stages)
        init_state, grad_fn, apply_fn = _loss_step(init_params, loss, optimizer)
        checkpoint_tree = checkpoint_tree or _trainer_tree
    elif num_stages != 1:
        raise ValueError(f"num_stages={num_stages}: a step's own parts (init_state, grad_fn, apply_fn) are one "
                         "stage; cut a loss and an optimizer instead")
    return ProgramSet((_whole_gradient(init_state, grad_fn, apply_fn, batch_spec, devices_per_slice,
                                       num_microbatches, platform, checkpoint_tree, evaluate, eval_fn),))


def _loss_step(init_params: Callable, loss: Callable, opt) -> tuple[Callable, Callable, Callable]:
    """A loss and an optax optimizer as a whole step's parts: the state is ``(params, optimizer state)``."""
    import optax

    def init_state(key):
        params = init_params(key)
        return params, opt.init(params)

    def grad_fn(state, batch):
        return jax.value_and_grad(loss)(state[0], batch)

    def apply_fn(state, grads):
        params, opt_state = state
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    return init_state, grad_fn, apply_fn


def _trainer_tree(state) -> CheckpointTree | None:
    """How an ``elastic.Trainer``'s checkpoints name its state ``(params, optimizer state)`` (abstract): ``params/...``
    and ``opt_state/...`` by each leaf's path in its pytree (dict keys, attribute names, list places), so a later
    run's ``load_parameters_path`` picks the parameters out by name (a model whose tree has no such names, e.g.
    a custom pytree node: None, stored flat as before)."""
    paths = []
    for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        names: list = ["params" if path[0].idx == 0 else "opt_state"]
        for key in path[1:]:
            if isinstance(key, jax.tree_util.DictKey):
                names.append(str(key.key))
            elif isinstance(key, jax.tree_util.GetAttrKey):
                names.append(key.name)
            elif isinstance(key, jax.tree_util.SequenceKey):
                names.append(key.idx)
            else:
                return None
        paths.append(tuple(names))
    return CheckpointTree.named(paths)


def _batch_shapes(batch_spec: dict, d: int) -> dict:
    """One microbatch as ``jax.ShapeDtypeStruct``s; refused unless each leading (batch) dimension splits over D."""
    shapes = {k: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype)) for k, (shape, dtype) in batch_spec.items()}
    for k, s in shapes.items():
        if not s.shape or s.shape[0] % d:
            raise ProgramExportError(f"batch key {k!r} has shape {s.shape}: its leading (batch) dimension "
                                     f"must be divisible by the {d} devices of a slice")
    return shapes


def _spec_list(leaves) -> list:
    return [[list(a.shape), np.dtype(a.dtype).str] for a in leaves]


def _nbytes(shapes) -> int:
    return int(sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in shapes))


_SEED = jax.ShapeDtypeStruct((), jnp.int32)


def _whole_gradient(init_state, grad_fn, apply_fn, batch_spec, d, num_microbatches, platform,
                    checkpoint_tree, evaluate=False, eval_fn=None) -> StagePrograms:
    """The one stage of an unpipelined run: init / grad / apply, the gradient of the whole model in one program."""
    mesh = AbstractMesh((d,), (MESH_AXIS,))

    # Programs take and return the state as a flat list of arrays: the
    # serialized form then needs no knowledge of the user's pytree types.
    state_tree = trace_init(init_state)
    state_shapes, treedef = jax.tree.flatten(state_tree)
    state_dim_list = [shard_dim(s.shape, d) for s in state_shapes]
    if callable(checkpoint_tree):   # derived from the state (an elastic.Trainer's: _trainer_tree)
        checkpoint_tree = checkpoint_tree(state_tree)
    _check_tree(checkpoint_tree, state_shapes)

    def init(seed):
        return jax.tree.leaves(init_state(jax.random.key(seed)))
    batch_shapes = _batch_shapes(batch_spec, d)
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
    in_specs = {"init": [None], "grad": state_dim_list + batch_dims, "apply": state_dim_list + [None]}
    blobs = {
        "init": export_program("init", init, (_SEED,), in_specs["init"], state_dim_list, mesh, platform),
        "grad": export_program("grad", grad, (state_shapes, batch_shapes), in_specs["grad"], None, mesh, platform),
        "apply": export_program("apply", apply, (state_shapes, flat_spec), in_specs["apply"], state_dim_list, mesh,
                                platform),
    }
    if evaluate:
        # The training loss as grad computes it, nothing else: XLA drops the unused backward pass, so this is
        # the forward alone, and an eval loss means exactly what a training loss means.
        def evaluate_fn(state, batch):
            if eval_fn is not None:   # the job's own (loss total, weight): a loss normalised by a token count
                total, weight = eval_fn(jax.tree.unflatten(treedef, state), batch)
            else:
                total, weight = grad_tree(state, batch)[0], 1.0
            return jnp.stack([jnp.asarray(total, jnp.float32), jnp.asarray(weight, jnp.float32)])

        in_specs["eval"] = state_dim_list + batch_dims
        blobs["eval"] = export_program("eval", evaluate_fn, (state_shapes, batch_shapes), in_specs["eval"], None,
                                       mesh, platform)
    return StagePrograms(
        blobs=blobs, devices_per_slice=d, num_microbatches=num_microbatches, grad_size=int(grad_size),
        state_bytes=_nbytes(state_shapes), batch_spec=dict(zip(batch_shapes, _spec_list(batch_shapes.values()))),
        in_specs=in_specs, checkpoint_tree=None if checkpoint_tree is None else checkpoint_tree.to_json())


# -- the pipeline cut ------------------------------------------------------------------------------------------
#
# A loss marked with elastic.pipeline_stage becomes one set of programs per stage. Each parameter leaf belongs
# to the one stage whose forward reads it (found by dead-code elimination of each stage's trace); a leaf no
# stage reads goes to the last stage, and a leaf two stages read (tied weights, or a value of an earlier stage
# reaching a later one other than through the marks) is refused by name. Each stage's state is its parameters
# and the optimizer's state over them, so a stage's apply is the optimizer's update of its own leaves: the
# same math per leaf as an unpipelined update for an elementwise optimizer (Adam, SGD, ...); an optimizer that
# couples leaves (clip_by_global_norm) sees one stage's leaves at a time. Each stage's backward recomputes its
# forward from the stage's input, so only stage inputs live between a microbatch's forward and backward.


def _cut_stages(init_params: Callable, loss: Callable, optimizer, batch_spec: dict, num_stages: int,
                devices_per_slice: int, num_microbatches: int, platform: str) -> tuple[StagePrograms, ...]:
    """Traces ``loss(params, batch)`` (``num_stages - 1`` marks) and exports each stage's programs."""
    s_count, d = num_stages, devices_per_slice
    mesh = AbstractMesh((d,), (MESH_AXIS,))
    params_shapes = trace_init(init_params)
    batch = _batch_shapes(batch_spec, d)
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
    return tuple(stages)


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
        "init": export_program(f"stage {k} init", init, (_SEED,), [None], state_dims, mesh, platform),
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
    return StagePrograms(
        stage=k, num_stages=s_count, blobs=blobs, devices_per_slice=d, num_microbatches=num_microbatches,
        grad_size=int(grad_size), state_bytes=_nbytes(state_shapes),
        batch_spec=dict(zip(batch, _spec_list(batch.values()))), in_specs=specs,
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


