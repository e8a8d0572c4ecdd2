"""A sampler of an RL run: the rollout program, the policy weights of one version, the rollouts it makes.

A sampler worker is an ordinary worker process loaded with a sampler's
programs instead of a trainer's (its ``Load`` layout says ``role: sampler``).
It holds no training state: only the policy's parameters of one weights
version (installed whole, :meth:`Sampler.install`, after a pull from a
trainer's outbox or a peer sampler, :mod:`runtime.worker.weights`) and the
``rollout`` program, exported by the client for the sampler's mesh::

    rollout(weights, prompts, seed, step, microbatch) -> outputs, in the layout's order
    rollout(weights, reference, prompts, seed, step, microbatch)   (a KL term: the frozen initial policy's
                                                                     weights too, made once by the ``reference``
                                                                     program from the run's seed)

which samples the completions of one rollout microbatch, scores them and
returns the trainer's batch for it. Its randomness comes from keys the
program derives from ``(seed, step, microbatch)`` and each row, so a
microbatch's rollout is the same bits on any sampler: which sampler makes it,
and how many there are, changes nothing. The prompts come from the data
source shipped at load (``prompts(step, microbatch)``), as a trainer's
batches come from its own.

A rollout takes the installed version at its start; a version arriving
meanwhile replaces it only for later rollouts, so no rollout ever mixes two.
"""

from __future__ import annotations

import json
import threading
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from runtime._proto import elastic_pb2 as pb
from runtime.core.errors import ProtocolError, StaleEpochError
from runtime.core.platforms import check_runnable, local_platform
from runtime.core.programs import MESH_AXIS, SAMPLER_WEIGHTS_KEPT
from runtime.wire.batches import encode_batch
from runtime.worker.weights import WeightOutbox

__all__ = ["Sampler", "SAMPLER_ROLE", "check_sampler_layout", "sampler_role"]

SAMPLER_ROLE = "sampler"
ADVANTAGE_EPS = 1e-6   # what a group's standard deviation is padded by (elastic.rl.grpo.ADVANTAGE_EPS's value)


def sampler_role(request: pb.LoadRequest) -> dict | None:
    """A ``Load``'s layout when it loads a sampler (``role: sampler``), else None (a trainer's programs)."""
    try:
        layout = json.loads(request.layout)
    except ValueError:
        return None   # the trainer's own checks name it
    return layout if isinstance(layout, dict) and layout.get("role") == SAMPLER_ROLE else None


def check_sampler_layout(layout: dict) -> None:
    """A sampler's ``Load`` layout has every key it needs, well formed; ``ProtocolError`` naming what does not."""
    try:
        int(layout["devices_per_slice"])
        for shape, dtype, dim in layout["weights"]:
            np.dtype(dtype), tuple(int(n) for n in shape), dim is None or int(dim)
        shape, dtype = layout["prompt"]
        np.dtype(dtype), tuple(int(n) for n in shape)
        for name, shape, dtype in layout["outputs"]:
            str(name), np.dtype(dtype), tuple(int(n) for n in shape)
        if int(layout["num_microbatches"]) < 1:
            raise ValueError("num_microbatches < 1")
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"the sampler's layout does not parse: {type(e).__name__}: {e}") from None


class Sampler:
    """Holds one weights version on ``devices`` and makes rollouts with it. Thread-safe."""

    def __init__(self, layout: dict, blobs: dict[str, bytes], source, devices=None):
        check_sampler_layout(layout)
        devices = list(devices if devices is not None else jax.devices())
        d = int(layout["devices_per_slice"])
        if len(devices) < d:
            raise ProtocolError(f"the sampler needs {d} devices, this process has {len(devices)}")
        if not callable(getattr(source, "prompts", None)):
            raise ProtocolError(f"the sampler's data source {type(source).__name__} has no prompts(step, microbatch)")
        if set(blobs) not in ({"rollout"}, {"rollout", "reference"}):
            raise ProtocolError(f"a sampler loads the program 'rollout' (and 'reference', for a KL term), got "
                                f"{sorted(blobs)}")
        if ("reference" in blobs) != ("reference_seed" in layout):
            raise ProtocolError("a sampler's 'reference' program and its layout's reference_seed come together")
        self.layout, self.blobs, self.source = layout, dict(blobs), source
        self.mesh = Mesh(np.array(devices[:d]), (MESH_AXIS,))
        self.weights_layout = [(tuple(s), np.dtype(t)) for s, t, _ in layout["weights"]]
        self.num_microbatches = int(layout["num_microbatches"])
        self.outbox = WeightOutbox(keep=SAMPLER_WEIGHTS_KEPT)   # what it installed, for peer samplers (the newest)
        self._lock = threading.Lock()
        self._installed: tuple[int, list] | None = None   # (version, device arrays)
        self._reference: list = []   # the frozen initial policy's weights (a KL term), made here from the seed
        self._fn = None

    def load(self) -> float:
        """Deserializes and compiles the rollout program for this sampler's mesh (and, for a KL term, makes the
        frozen reference policy's weights with the ``reference`` program from the run's seed); seconds spent."""
        t0 = time.perf_counter()
        rep = NamedSharding(self.mesh, PartitionSpec())
        self._rep = rep
        self._weight_shardings = [self._sharding(dim) for _, _, dim in self.layout["weights"]]
        reference = "reference" in self.blobs
        weights = self._weight_shardings * (2 if reference else 1)
        self._fn = self._compile("rollout", [*weights, rep, rep, rep, rep])
        if reference:
            make = self._compile("reference", [rep])
            self._reference = list(jax.tree.leaves(make(jax.device_put(np.int32(self.layout["reference_seed"]),
                                                                        rep))))
            jax.block_until_ready(self._reference)
            got = [(tuple(x.shape), np.dtype(x.dtype)) for x in self._reference]
            if got != self.weights_layout:
                raise ProtocolError(f"the reference program makes weights {got}, the layout names "
                                    f"{self.weights_layout}")
        return time.perf_counter() - t0

    def _compile(self, name: str, shardings: list):
        """Program ``name`` deserialized, checked against this sampler's devices and ``shardings`` (one per
        input), compiled."""
        exp = jax.export.deserialize(bytearray(self.blobs[name]))
        check_runnable(tuple(exp.platforms), local_platform(self.mesh.devices.flat), f"the {name!r} program")
        if exp.nr_devices != self.mesh.size:
            raise ProtocolError(f"the {name} program is for {exp.nr_devices} devices, the sampler has "
                                f"{self.mesh.size}")
        if len(shardings) != len(exp.in_avals):
            raise ProtocolError(f"the {name} program takes {len(exp.in_avals)} inputs, the layout names "
                                f"{len(shardings)}")
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(exp.in_avals, shardings)]
        args, kwargs = jax.tree.unflatten(exp.in_tree, args)
        return jax.jit(exp.call).lower(*args, **kwargs).compile()

    def _sharding(self, dim) -> NamedSharding:
        if dim is None:
            return NamedSharding(self.mesh, PartitionSpec())
        return NamedSharding(self.mesh, PartitionSpec(*([None] * int(dim)), MESH_AXIS))

    @property
    def version(self) -> int | None:
        """The installed weights version (None before the first)."""
        installed = self._installed
        return None if installed is None else installed[0]

    def install(self, version: int, leaves: list[np.ndarray], digest: str) -> None:
        """Places ``leaves`` (host arrays of the layout's weights) on the devices and makes them the version
        rollouts use from now on, older or newer than the one before (the client asks for the version a step
        needs: a restarted client may need the one before the newest back); the host arrays are kept to serve
        peers."""
        if len(leaves) != len(self.weights_layout):
            raise ProtocolError(f"{len(leaves)} weights leaves, the sampler's layout has {len(self.weights_layout)}")
        placed = [jax.device_put(x, s) for x, s in zip(leaves, self._weight_shardings)]
        jax.block_until_ready(placed)
        self.outbox.put(version, leaves, digest)
        with self._lock:
            self._installed = (version, placed)

    def rollout(self, step: int, microbatches, version: int, seed: int) -> list[pb.FedBatch]:
        """The rollout of each of ``microbatches`` of ``step`` with weights ``version``: the trainer's batches,
        as the step request carries them. ``StaleEpochError`` when another version is installed."""
        if self._fn is None:
            raise StaleEpochError("the sampler has not loaded its program")
        with self._lock:
            installed = self._installed
        if installed is None or installed[0] != version:
            raise StaleEpochError(f"weights version {version} is not installed (installed: "
                                  f"{None if installed is None else installed[0]})")
        weights = installed[1]
        out = []
        for m in microbatches:
            if not 0 <= m < self.num_microbatches:
                raise ProtocolError(f"rollout microbatch {m} is not one of 0..{self.num_microbatches - 1}")
            prompts = np.asarray(self.source.prompts(step, m))
            ref = (list(self._reference),) if self._reference else ()
            args = (list(weights), *ref, jax.device_put(prompts, self._rep),
                    *(jax.device_put(np.int32(v), self._rep) for v in (seed, step, m)))
            results = jax.tree.leaves(self._fn(*args))
            names = [o[0] for o in self.layout["outputs"]]
            arrays = {n: np.asarray(x) for n, x in zip(names, results)}
            if "host_reward" in self.layout:   # the task's reward is Python: called here, after the program
                arrays.update(self._host_reward(arrays["prompts"], arrays["completions"]))
            out.append(encode_batch(step, m, version, arrays))
        return out

    def _host_reward(self, prompts: np.ndarray, completions: np.ndarray) -> dict[str, np.ndarray]:
        """``rewards`` of each row by the task's Python reward (the data source's ``reward``), and their group
        ``advantages`` (``(r - mean) / (std + 1e-6)`` over each prompt's samples, float32, as the program's)."""
        rows = len(prompts)
        rewards = np.asarray(self.source.reward(prompts, completions), dtype=np.float32)
        if rewards.shape != (rows,):
            raise ProtocolError(f"the task's reward gave {rewards.shape}, one per row is ({rows},)")
        r = rewards.reshape(-1, int(self.layout["host_reward"]["samples"]))
        mean = np.mean(r, axis=1, keepdims=True, dtype=np.float32)
        std = np.sqrt(np.mean(np.square(r - mean), axis=1, keepdims=True, dtype=np.float32))
        return {"advantages": ((r - mean) / (std + np.float32(ADVANTAGE_EPS))).reshape(-1).astype(np.float32),
                "rewards": rewards}
