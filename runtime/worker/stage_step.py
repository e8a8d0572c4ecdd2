"""A pipeline stage's share of a step on a worker: its instruction stream, activations over the data plane.

The controller sends each stage worker its stream
(``StepRequest.pipeline``); the worker runs it with the same interpreter
the one-process run uses (:class:`runtime.pipeline.interpreter.StageRunner`).
A transfer to a neighbouring stage is one push of the arrays packed into a
float32 piece (:func:`pack`) under its own phase
(:func:`runtime.wire.parts.pipeline_phase`), through the same transport,
checks and mailbox as the all-reduce; a receive waits in the mailbox for that
phase from that stage. What comes out is each microbatch's gradient vector,
summed here over the worker's subtrees in the canonical order, for the
stage's all-reduce among its replicas, and the seconds the worker computed and
its stream took (:class:`StageTimes`: the step's measured bubble, see
:mod:`runtime.pipeline.bubble`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from runtime._proto import elastic_pb2 as pb
from runtime.core.errors import ProtocolError
from runtime.core.microbatch import Node, tree_reduce
from runtime.core.timing import Clock
from runtime.pipeline.interpreter import StageRunner
from runtime.pipeline.schedule import ACT, BACKWARD, FORWARD, FREE, GRAD, LAST, RECV, SEND, Instr
from runtime.wire.parts import pieces, pipeline_phase
from runtime.wire.requests import node_of
from runtime.worker.executor import add_f32

__all__ = ["StageTimes", "check_pipeline_step", "pack", "packed_size", "run_stage_step", "unpack"]

_OPS = (FORWARD, BACKWARD, LAST, SEND, RECV, FREE)


def packed_size(specs: list) -> int:
    """Float32 words of arrays of ``[[shape, dtype], ...]`` packed by :func:`pack`."""
    return -(-sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in specs) // 4)


def pack(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays' bytes one after the other, zero-padded to whole float32 words (a piece of the data plane)."""
    raw = b"".join(np.require(a, requirements="C").tobytes() for a in arrays)
    buf = np.zeros(-(-len(raw) // 4) * 4, np.uint8)
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    return buf.view(np.float32)


def unpack(vec: np.ndarray, specs: list) -> list[np.ndarray]:
    """The arrays :func:`pack` packed, given their ``[[shape, dtype], ...]``."""
    raw = vec.view(np.uint8)
    out, off = [], 0
    for shape, dtype in specs:
        dtype = np.dtype(dtype)
        n = math.prod(shape) * dtype.itemsize
        if off + n > raw.size:
            raise ProtocolError(f"a pipeline piece of {raw.size} bytes is too short for arrays {specs}")
        out.append(raw[off:off + n].view(dtype).reshape(shape))
        off += n
    return out


def check_pipeline_step(req: pb.StepRequest, num_stages: int, stage: int) -> list[Instr]:
    """The request's stream as instructions, refused (:class:`ProtocolError`) unless it runs exactly this
    worker's microbatches through this worker's stage and only talks to its neighbours."""
    pl = req.pipeline
    if (pl.stage, pl.stages) != (stage, num_stages):
        raise ProtocolError(f"step {req.step}: stage {pl.stage} of {pl.stages} asked of a worker that loaded "
                            f"stage {stage} of {num_stages}")
    mine = sorted(i for n in req.nodes for i in node_of(n).ids)
    last = stage == num_stages - 1
    instrs = []
    for x in pl.instructions:
        if x.op not in _OPS:
            raise ProtocolError(f"step {req.step}: unknown pipeline instruction {x.op!r}")
        if x.op in (SEND, RECV) and (x.what not in (ACT, GRAD) or x.peer not in (stage - 1, stage + 1)
                                     or not 0 <= x.peer < num_stages):
            raise ProtocolError(f"step {req.step}: stage {stage} cannot {x.op} {x.what!r} with stage {x.peer}")
        instrs.append(Instr(x.op, x.microbatch, x.what, x.peer))
    computed = sorted(i.microbatch for i in instrs if i.op == (LAST if last else BACKWARD))
    if computed != mine or (not last and sorted(i.microbatch for i in instrs if i.op == FORWARD) != mine):
        raise ProtocolError(f"step {req.step}: the stream computes microbatches {computed}, this worker's share "
                            f"is {mine}")
    if (stage > 0 and not pl.prev.address) or (not last and not pl.next.address):
        raise ProtocolError(f"step {req.step}: stage {stage} is missing the address of a neighbouring stage")
    return instrs


class _Wire:
    """Transfers of one stage worker's step: pushes to its neighbours, receives from its mailbox."""

    def __init__(self, req: pb.StepRequest, programs, push: Callable, mailbox, chunk_bytes: int, deadline: float):
        self.req, self.programs, self.push, self.mailbox = req, programs, push, mailbox
        self.chunk_bytes, self.deadline = chunk_bytes, deadline

    def send(self, src: int, dst: int, what: str, microbatch: int, arrays: list[np.ndarray]) -> None:
        peer = self.req.pipeline.next if dst == src + 1 else self.req.pipeline.prev
        parts = pieces(self.req.fence, self.req.step, pipeline_phase(what == GRAD, microbatch), src,
                       Node(0, microbatch), pack(arrays), self.chunk_bytes)
        self.push(peer, parts, self.deadline)

    def recv(self, dst: int, src: int, what: str, microbatch: int) -> list[np.ndarray]:
        got = self.mailbox.wait(self.req.fence.epoch, self.req.step, pipeline_phase(what == GRAD, microbatch), {src},
                                self.deadline)
        vec = got[src].get(Node(0, microbatch))
        if vec is None:
            raise ProtocolError(f"stage {src} sent no piece for microbatch {microbatch}")
        return unpack(vec, self.programs.activation_in if what == ACT else self.programs.activation_out)


class StageTimes(NamedTuple):
    """A stage worker's step: seconds it computed (forward, backward, last) and its stream's seconds."""

    busy: float
    stream: float


def run_stage_step(req: pb.StepRequest, executor, push: Callable, mailbox, chunk_bytes: int, deadline: float,
                   clock: Clock, delay: float = 0.0) -> tuple[dict[Node, np.ndarray], StageTimes]:
    """Runs this worker's stream of step ``req.step``; returns ``{node: float32[P_k + 1]}`` over its subtrees and
    what it cost. ``delay``: seconds slept per forward and per backward (a benchmark's simulated compute)."""
    programs = executor.programs
    instrs = check_pipeline_step(req, programs.num_stages, programs.stage)
    runner = StageRunner(programs.stage, executor, req.step, clock, delay)
    wire = _Wire(req, programs, push, mailbox, chunk_bytes, deadline)
    for instr in instrs:
        runner.run(instr, wire)
    vecs = {node_of(n): tree_reduce(runner.vecs, node_of(n), add_f32) for n in req.nodes}
    return vecs, StageTimes(runner.busy, runner.stream_seconds)
