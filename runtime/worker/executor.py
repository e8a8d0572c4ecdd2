"""Runs one stage's programs (:class:`~runtime.core.programs.StagePrograms`) on the local devices of one slice.

Used by the worker (behind gRPC) and by the single-process reference run, so
both execute exactly the same code on the same programs. Not thread-safe: the
owner serializes calls.

An unpipelined run's step is :meth:`SliceExecutor.partials` over the ``grad``
program (the data-parallel step, kept apart from the interpreter's calls for its
speed and its laps); a stage of a pipeline is driven one microbatch at a time
by :class:`runtime.pipeline.interpreter.StageRunner` through :meth:`forward`
and :meth:`backward`, which serve a one-stage run too (the reference run's
path). Activations and their gradients cross between stages as host arrays
(as they cross the wire between workers), so a stage's inputs are placed on
its own mesh.

A slice of several hosts (:mod:`runtime.core.hosts`) is one JAX distributed
system: every host's executor holds the same programs over the slice's whole
mesh and calls them in the same order on global arrays. Inputs and the
gradient are the same host arrays on every host; the state is each host's
blocks (:meth:`host_state`, :meth:`set_state`, :meth:`state_digest`), so
what moves a state moves host ``k``'s to host ``k``.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from runtime.state.checkpoint_tree import CheckpointTree
from runtime.state.state_copy import state_digest
from runtime.core.hosts import block_of, host_layout
from runtime.core.microbatch import Node, tree_reduce
from runtime.core.platforms import check_runnable, local_platform
from runtime.core.programs import MESH_AXIS, StagePrograms
from runtime.core.timing import Clock

__all__ = ["SliceExecutor", "add_f32", "probe_devices"]


def add_f32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The one addition used to combine gradient partials (IEEE float32)."""
    return np.add(a, b, dtype=np.float32)


class SliceExecutor:
    """Holds one replica of one stage's training state on ``devices``.

    Call :meth:`load` once, then :meth:`init`, then any number of steps: each
    ``partials`` (or ``forward``/``backward`` per microbatch), then
    ``apply``. Errors from user programs propagate unchanged.
    """

    def __init__(self, programs: StagePrograms, data_source, devices=None):
        devices = list(devices if devices is not None else jax.devices())
        d = programs.devices_per_slice
        if len(devices) < d:
            raise ValueError(f"slice needs {d} devices, this process has {len(devices)}")
        # The slice's hosts: this process's JAX distributed system (one process: a one-host slice).
        self.hosts, self.host = jax.process_count(), jax.process_index()
        if self.hosts > 1:
            _check_host_devices(devices[:d], self.hosts, self.host)
        self.programs = programs
        # How persistent checkpoints name the state's leaves (None: a flat list); one object for the program set.
        self.checkpoint_tree = (None if programs.checkpoint_tree is None
                                else CheckpointTree.from_json(programs.checkpoint_tree))
        self.data = data_source
        self.mesh = Mesh(np.array(devices[:d]), (MESH_AXIS,))
        self.state = None
        self.prev_state = None   # one step of history, for rollback after a failed step
        self.steps_applied = 0
        self._fns: dict[str, object] = {}
        self._exported: dict[str, object] = {}
        self._shardings: dict[str, list[NamedSharding]] = {}
        self._digest: tuple[object, str] = (None, "")   # (the state it is of, its digest)
        self._batches: dict[tuple[int, int], dict] = {}  # (step, microbatch) -> its batch, from forward to backward
        # (step, microbatch) -> its batch, fed with the step's request (an RL run's rollouts), in place of the data
        # source's: set by the step's runner for the step, cleared after it (:meth:`feed`).
        self.fed: dict[tuple[int, int], dict] = {}

    # -- setup ---------------------------------------------------------------

    def load(self) -> float:
        """Deserializes and compiles every program; returns seconds spent.

        Programs for a platform other than this slice's devices' are refused
        before any compile (:class:`~runtime.core.errors.PlatformMismatchError`).
        """
        t0 = time.perf_counter()
        local = local_platform(self.mesh.devices.flat)
        for name, blob in self.programs.programs().items():
            exp = jax.export.deserialize(bytearray(blob))
            check_runnable(tuple(exp.platforms), local, f"the {name!r} program")
            if exp.nr_devices != self.programs.devices_per_slice:
                raise ValueError(f"program {name!r} is for {exp.nr_devices} devices, slice has "
                                 f"{self.programs.devices_per_slice}")
            self._exported[name] = exp
            specs = self.programs.in_specs[name]
            if len(specs) != len(exp.in_avals):
                raise ValueError(f"program {name!r} takes {len(exp.in_avals)} inputs, layout names {len(specs)}")
            self._shardings[name] = [self._sharding(d) for d in specs]
            args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                    for a, s in zip(exp.in_avals, self._shardings[name])]
            args, kwargs = jax.tree.unflatten(exp.in_tree, args)
            self._fns[name] = jax.jit(exp.call).lower(*args, **kwargs).compile()
        return time.perf_counter() - t0

    def _sharding(self, dim: int | None) -> NamedSharding:
        """Replicated, or dimension ``dim`` split over the slice's mesh axis."""
        if dim is None:
            return NamedSharding(self.mesh, PartitionSpec())
        return NamedSharding(self.mesh, PartitionSpec(*([None] * dim), MESH_AXIS))

    def _call(self, name: str, *args):
        exp = self._exported[name]
        flat, tree = jax.tree.flatten((args, {}))
        if tree != exp.in_tree:
            raise ValueError(f"program {name!r} expects inputs {exp.in_tree}, got {tree}")
        placed = [x if isinstance(x, jax.Array) else jax.device_put(x, s)
                  for x, s in zip(flat, self._shardings[name])]
        args, _ = jax.tree.unflatten(tree, placed)
        return self._fns[name](*args)

    # -- the step ------------------------------------------------------------

    def init(self, seed: int) -> int:
        self.state = self._call("init", np.int32(seed))
        self.prev_state = None
        self.steps_applied = 0
        return self.state_nbytes()

    def grad(self, step: int, microbatch: int, clock: Clock | None = None) -> np.ndarray:
        """The flat float32 gradient of one microbatch then its loss (``float32[P + 1]``), on the host.

        ``clock`` gets ``data`` (the batch), ``grad_compute`` (the program,
        its inputs' host->device included) and ``device_to_host``.
        """
        clock = clock if clock is not None else Clock()
        batch = self._source_batch(step, microbatch)
        clock.lap("data")
        vec = self._call("grad", self.state, batch)
        jax.block_until_ready(vec)
        clock.lap("grad_compute")
        out = np.asarray(vec, dtype=np.float32)
        clock.lap("device_to_host")
        return out

    def partials(self, step: int, nodes, clock: Clock | None = None) -> dict:
        """Canonical sums over each subtree in ``nodes``: ``{node: float32[P + 1]}`` (gradient sum, then loss sum).

        Each microbatch's gradient is computed once, then summed in the
        canonical tree order (see :mod:`runtime.core.microbatch`).
        """
        clock = clock if clock is not None else Clock()
        out = {}
        for node in nodes:
            leaves = {Node(0, m): self.grad(step, m, clock) for m in node.ids}
            out[node] = tree_reduce(leaves, node, add_f32)
            clock.lap("local_sum")
        return out

    def evaluate(self, items, clock: Clock | None = None) -> list[tuple[float, float]]:
        """The ``eval`` program's ``(loss total, weight)`` of each ``(eval step, microbatch)`` in ``items``, in
        their order, on the state as it is (float32 values). The batches come from the data source's
        ``eval_batch`` (the eval data, pure in its arguments as ``batch`` is). Changes nothing; ``clock`` gets
        ``eval``."""
        out = []
        for e, m in items:
            out.append(self._call("eval", self.state, self.data.eval_batch(e, m)))
        jax.block_until_ready(out)
        losses = [(float(v[0]), float(v[1])) for v in (np.asarray(x, dtype=np.float32) for x in out)]
        if clock is not None:
            clock.lap("eval")
        return losses

    def forward(self, step: int, microbatch: int, a_in: list, clock: Clock | None = None) -> list[np.ndarray]:
        """A pipeline stage's output activations for one microbatch, on the host; ``clock`` gets ``forward``."""
        batch = self._batch(step, microbatch)
        return _host(self._call("forward", self.state, batch, *self._received(a_in)), clock, "forward")

    def backward(self, step: int, microbatch: int, a_in: list, g_out: list,
                 clock: Clock | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
        """``(float32[P_k + 1], gradient of the input)`` of one microbatch, from the stage's gradient program (a
        one-stage run's ``grad``: no input, so no input gradient); ``clock`` gets ``backward``."""
        batch = self._batch(step, microbatch)
        g_out = [list(g_out)] if self.programs.activation_out else []   # the last stage starts from its loss
        out = self._call(self.programs.grad_program, self.state, batch, *self._received(a_in), *g_out)
        self._batches.pop((step, microbatch), None)
        vec, *g_in = _host(jax.tree.leaves(out), clock, "backward")
        return vec, g_in

    def _received(self, a_in: list) -> list[list]:
        """The stage's input activations as its programs take them: none for the first stage (or the only one)."""
        return [list(a_in)] if self.programs.activation_in else []

    def _batch(self, step: int, microbatch: int) -> dict:
        """The microbatch's batch, loaded once for its forward and its backward."""
        key = (step, microbatch)
        if key not in self._batches:
            self._batches[key] = self._source_batch(step, microbatch)
        return self._batches[key]

    def feed(self, batches: dict[tuple[int, int], dict]) -> None:
        """The batches of the coming step's microbatches that its request carries (``{(step, microbatch):
        batch}``; an RL run's, made by its samplers): used in place of the data source's. Replaces the last."""
        self.fed = dict(batches)

    def _source_batch(self, step: int, microbatch: int) -> dict:
        """The fed batch of ``(step, microbatch)`` when the request carried one, else the data source's."""
        fed = self.fed.get((step, microbatch))
        return fed if fed is not None else self.data.batch(step, microbatch)

    def apply(self, grad_sum: np.ndarray, clock: Clock | None = None) -> None:
        """The optimizer update with the reduced gradient; ``clock`` gets ``apply`` (host->device included).

        Waits for the new state, so a reply after it means the state is there.
        """
        self._batches.clear()
        new = self._call("apply", self.state, grad_sum)
        jax.block_until_ready(new)
        if clock is not None:
            clock.lap("apply")
        self.prev_state, self.state = self.state, new
        self.steps_applied += 1

    def rollback(self) -> None:
        """Undoes the last :meth:`apply` (only one step of history is kept)."""
        if self.prev_state is None:
            raise ValueError(f"no step to roll back (at {self.steps_applied} applied steps)")
        self.state, self.prev_state = self.prev_state, None
        self.steps_applied -= 1

    def state_dims(self) -> list:
        """Each state leaf's split dimension over the slice's mesh (None: replicated)."""
        return self.programs.in_specs["apply"][:-1]

    def whole_layout(self) -> list:
        """``[(shape, dtype)]`` of the whole state leaves (on a slice of several hosts, more than this host holds)."""
        return [(tuple(a.shape), a.dtype) for a in self._exported["apply"].in_avals[:-1]]

    def state_layout(self, layout: list) -> list:
        """``[(shape, dtype)]`` of the state this host holds, from the whole leaves' ``layout``: the leaves
        themselves on a one-host slice, this host's blocks of them on a slice of several."""
        return host_layout(layout, self.state_dims(), self.hosts)

    def host_state(self) -> list[np.ndarray]:
        """The state this host holds as host arrays (for a peer-to-peer transfer): the leaves, or on a slice of
        several hosts this host's block of each (:mod:`runtime.core.hosts`)."""
        return self.host_blocks(self.state)

    def host_blocks(self, state) -> list[np.ndarray]:
        """:meth:`host_state` of ``state`` (one this executor held: the background writer copies an applied
        state to the host while the next step runs)."""
        if self.hosts == 1:
            return [np.asarray(x) for x in state]
        return [_block(x, dim) for x, dim in zip(state, self.state_dims())]

    def set_state(self, leaves: list[np.ndarray], steps_applied: int, digest: str = "") -> None:
        """Adopts a state copied from another replica, placed on this slice's mesh.

        ``digest``: :func:`state_digest` of ``leaves`` when the caller already
        computed it (a transfer verifies it), so it is not computed again.
        """
        shardings = self._shardings["apply"][:-1]
        avals = self._exported["apply"].in_avals[:-1]
        if len(leaves) != len(shardings):
            raise ValueError(f"state has {len(leaves)} leaves, programs expect {len(shardings)}")
        expected = self.state_layout(self.whole_layout())
        for i, (x, (shape, dtype)) in enumerate(zip(leaves, expected)):
            if x.shape != tuple(shape) or x.dtype != dtype:
                raise ValueError(f"state leaf {i}: got {x.shape} {x.dtype}, expected {tuple(shape)} {dtype}")
        if self.hosts == 1:
            self.state = jax.device_put(list(leaves), list(shardings))   # one call: 193 leaves cost 15 ms one by one
        else:
            self.state = [_from_blocks(x, a.shape, s, dim, self.hosts, self.host)
                          for x, a, s, dim in zip(leaves, avals, shardings, self.state_dims())]
        self.prev_state = None
        self.steps_applied = steps_applied
        if digest:
            self._digest = (self.state, digest)

    # -- inspection ----------------------------------------------------------

    def state_nbytes(self) -> int:
        return int(sum(x.nbytes for x in jax.tree.leaves(self.state)))

    def state_digest(self) -> str:
        """Digest of every state leaf's bytes, in pytree order (same on every replica); see :func:`state_digest`.
        On a slice of several hosts, of this host's blocks (the slice's is its hosts' combined).

        Computed once per state: a recovery asks for it several times (abort,
        transfer, the check after it), and a state never changes in place.
        """
        state, digest = self._digest
        if state is not self.state:
            digest = state_digest(jax.tree.leaves(self.state) if self.hosts == 1 else self.host_state())
            self._digest = (self.state, digest)
        return digest


def _check_host_devices(devices: list, hosts: int, host: int) -> None:
    """A slice of several hosts: host ``k``'s devices are mesh positions ``k*D/H .. (k+1)*D/H - 1`` (what
    :mod:`runtime.core.hosts` says each host holds). ValueError naming the misfit otherwise."""
    d = len(devices)
    if d % hosts:
        raise ValueError(f"a slice of {d} devices does not divide among {hosts} hosts")
    per = d // hosts
    for i, dev in enumerate(devices):
        if dev.process_index != i // per:
            raise ValueError(f"mesh position {i} is a device of host {dev.process_index}, not of host {i // per} "
                             f"({per} devices per host)")


def _block(x: jax.Array, dim: int | None) -> np.ndarray:
    """This host's block of a global array split along ``dim`` (None: the whole, replicated leaf)."""
    if dim is None:
        return np.asarray(x)
    shards = sorted(x.addressable_shards, key=lambda s: s.index[dim].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards], axis=dim)


def _from_blocks(block: np.ndarray, shape: tuple, sharding: NamedSharding, dim: int | None, hosts: int,
                 host: int) -> jax.Array:
    """A global array of ``shape`` from this host's ``block`` of it (the whole leaf when replicated)."""
    if dim is None:
        return jax.device_put(block, sharding)
    own = block_of(shape, dim, hosts, host)[dim]

    def local(index):
        index = list(index)
        index[dim] = slice(index[dim].start - own.start, index[dim].stop - own.start)
        return block[tuple(index)]

    return jax.make_array_from_callback(tuple(shape), sharding, local)


def _host(arrays, clock: Clock | None, lap: str) -> list[np.ndarray]:
    arrays = list(arrays)
    jax.block_until_ready(arrays)
    out = [np.asarray(a) for a in arrays]
    if clock is not None:
        clock.lap(lap)
    return out


def probe_devices() -> int:
    """Runs a tiny program on every device of this process; returns how many gave the right answer.

    Raises ``RuntimeError`` naming the first device that computed a wrong
    result, so a worker with a bad device never joins the run.
    """
    n = 0
    for d in jax.local_devices():
        x = jax.device_put(np.arange(16, dtype=np.float32), d)
        got = float(jax.jit(lambda v: (v * 2.0).sum())(x))
        if got != 240.0:
            raise RuntimeError(f"device probe failed on {d}: computed {got}, expected 240.0")
        n += 1
    return n
