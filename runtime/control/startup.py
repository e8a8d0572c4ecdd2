"""The start of a run: launch, register, place, load the programs, and the first state on every slice.

:func:`start` is the controller's ``STARTING`` phase. A worker lost while it
registers, compiles or initializes is handled as a death mid-step would be
(:meth:`runtime.control.controller.Controller.recover` plans and records it): replaced by a
spare, or the run starts narrower (down to ``min_slices``) and grows back
later, or waits, or fails. The first state comes from the seed, or from the
newest checkpoint of this run's own directory (MaxText's auto-resume), or
from ``load_full_state_path``; a bad ``load_full_state_path`` is refused before
any worker starts.
"""

from __future__ import annotations

import time

from runtime.control.checkpointing import Loaded

__all__ = ["first_state", "resume_from", "resumed", "start"]


def start(ctl) -> None:
    """Launches, registers, places, loads programs everywhere and initializes the state on the active slices
    of ``ctl`` (the :class:`runtime.control.controller.Controller` whose run starts).

    A worker lost while it registers, compiles or initializes is handled
    as a death mid-step would be: replaced by a spare, or the run starts
    narrower (down to ``min_slices``) and grows back later, or waits, or
    fails. No state exists yet, so every replacement initializes from
    the seed (same bits) instead of receiving a copy.
    """
    resume = resume_from(ctl)   # before launching: a bad load_full_state_path fails fast
    t0 = time.time()
    o = ctl.opts
    for _ in range(o.slices + o.spares):
        ctl.group.launch()
    workers = ctl.group.wait_for_workers(o.slices + o.spares, o.register_timeout_seconds)
    ctl.place(workers, sorted(ctl.dead), t0)   # lost: died before registering
    p = ctl.placement
    pipelined = p.stages > 1
    stages = dict(p.stage_of)
    if ctl.shadows.enabled:   # shadow spares take the stages in turn (each shadows its stage's state)
        stages.update({w: i % p.stages for i, w in enumerate(p.spares)})
    loaded = ctl.group.load(ctl.placement.members, spares=ctl.placement.spares,
                            stages=stages if pipelined else None)
    for w, r in loaded.items():
        ctl.events.emit("device_probe", worker=w, ok=True, devices=r.devices_probed, seconds=r.probe_seconds)
    ctl.events.emit("programs_loaded", compile_seconds={w: r.compile_seconds for w, r in loaded.items()},
                    program_bytes=ctl.group.program_bytes(),
                    **({"stages": {w: stages.get(w, 0) for w in loaded}} if pipelined else {}))
    ctl.before_state("loading programs")
    ctl.observer.attach(ctl)
    sizes = {}
    while True:
        loaded = first_state(ctl, [w for w in ctl.placement.active if w not in sizes], resume)
        sizes.update(loaded.bytes)
        sizes = {w: b for w, b in sizes.items() if w not in ctl.dead}
        if all(w in sizes for w in ctl.placement.active):
            break
        ctl.before_state("restoring the checkpoint" if resume else "initializing the state")
    if resume is None:
        more = {"parameters_from": ctl.opts.load_parameters_path} if ctl.opts.load_parameters_path else {}
        ctl.events.emit("state_initialized", seed=ctl.attempt.seed, state_bytes=max(sizes.values()), **more)
    else:
        resumed(ctl, loaded, resume[0], max(sizes.values()))
    if ctl.shadows.enabled:   # the spares start with the same state: from the seed, or the same checkpoint
        spares = [w for w in ctl.placement.spares if w not in ctl.dead]
        got = first_state(ctl, spares, resume and (resume[0], loaded.step))
        if got.bytes and got.step == ctl.state.dispatched:
            ctl.events.emit("shadows_started", workers=sorted(got.bytes), step=got.step)

def resume_from(ctl) -> tuple[str, int] | None:
    """``(directory, step)`` of the newest complete checkpoint this run resumes from (MaxText's auto-resume:
    the run's checkpoint directory already holds some), else of ``load_full_state_path``; None for a fresh
    start.

    Raises ``BadInputError`` when ``load_full_state_path`` cannot be read
    or holds no complete checkpoint (of that step)."""
    own = ctl.checkpoints.newest(ctl.state.steps)
    if own is not None:
        return ctl.checkpoints.directory, own
    if ctl.opts.load_full_state_path:
        return ctl.checkpoints.locate(ctl.opts.load_full_state_path)
    return None

def first_state(ctl, workers, resume: tuple[str, int] | None) -> Loaded:
    """``workers`` initialize from the seed (``resume`` None: ``Loaded`` of step 0, no losses; with
    ``load_parameters_path`` their parameters then replaced by that checkpoint's) or load the checkpoint
    ``(directory, step)``; those that did are in the answer's ``bytes``."""
    if resume is None:
        sizes = ctl.group.init(workers, ctl.attempt.seed)
        if ctl.opts.load_parameters_path and sizes:
            loaded = ctl.group.load_checkpoints(list(sizes), ctl.opts.load_parameters_path, 0, parameters_only=True)
            sizes = {w: sizes[w] for w in loaded}
        return Loaded(0, sizes, [])
    return ctl.checkpoints.load(workers, resume[1], resume[0])

def resumed(ctl, loaded: Loaded, directory: str, state_bytes: int) -> None:
    """The active slices loaded checkpoint ``loaded``: the run continues after its step, with its losses.

    Every replica must hold the same step and bits (checked); the losses
    of the steps before come from the checkpoint (NaN where it recorded
    none, and the event says so).
    """
    step = loaded.step
    ctl.executor.copies.check_replicas(ctl.placement, step)
    sums = loaded.loss_sums if len(loaded.loss_sums) == step else [float("nan")] * step
    before = loaded.written_on   # another mesh wrote it: its losses are means over its microbatches
    losses = [ctl.mean_loss(x, before[1] if before else None) for x in sums]
    ctl.events.emit("run_resumed", step=step, directory=directory, tier="checkpoint",
                    bytes=sum(loaded.bytes.values()), state_bytes=state_bytes,
                    resharded_from=dict(zip(("devices_per_slice", "microbatches"), before)) if before else None,
                    losses=[x if x == x else None for x in losses],
                    loss_sums=[float(x) if x == x else None for x in sums],
                    losses_recorded=len(loaded.loss_sums) == step)
