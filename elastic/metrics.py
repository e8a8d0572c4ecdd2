"""MaxText's metrics of a run: TensorBoard event files and the ``metrics_file``, from committed steps.

Contract:

* The client writes them, never a worker: ``elastic.trainer``'s ``fit`` opens one :class:`MetricsWriter` per
  attempt (:func:`open_metrics`), subscribes it to the run's event log and closes it when the attempt ends. Its
  only input is the event log: a step is written when the log records its ``step_committed``, so a step that
  a recovery computes again (a rewind, a restore) is never written twice, and a step that was never committed
  is never written.
* What is written is MaxText's (``maxtext.common.metric_logger``): every step's scalars under MaxText's names
  (:func:`step_scalars`), in TensorBoard event files in ``<run dir>/tensorboard/<run name>`` (MaxText's
  ``tensorboard_dir`` joined with its run name) with ``enable_tensorboard``, and as one JSON line per step
  (the scalars, ``step`` as a float, ``run_name``) appended to ``metrics_file``. The elastic ones
  (``elastic/slices_live``, ``elastic/recoveries``; ``elastic/goodput`` in TensorBoard at each flush) are
  under their own prefix. ``log_period`` is MaxText's: TensorBoard is flushed at every step divisible by it
  (:func:`flushes`) and at the end; each ``metrics_file`` line is flushed as written (MaxText reopens the file
  per step).
* An eval (``eval_interval``) is written when the log records its ``eval_completed`` (after its step
  committed, once: :func:`eval_scalars`, MaxText's ``eval/`` names), as MaxText writes its eval: the scalars
  at the train step in TensorBoard, and one more ``metrics_file`` line of that step. Each file's evals are
  tracked apart from its steps (an eval a recovery owed is recorded a step late).
* A restarted client (the same run) appends: each file's last step written is read back (for TensorBoard, the
  last ``learning/loss`` of the run's event files) and only later steps are written, first those the event
  log of the earlier attempts holds (a killed client loses TensorBoard's unflushed tail: it is written again
  from the log), then the live ones. A fresh attempt (the log replaced: a chaos run, a finished run run again)
  starts the files anew, as MaxText truncates ``metrics_file`` at step 0.
* The writing runs on a thread of its own: the event log's listener only queues the event. A failure to
  write never reaches the run: each file that fails prints one warning line and is no longer written.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import queue
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from runtime import RunState, read_events

__all__ = ["EVAL_LOSS", "LOSS", "Commit", "Eval", "MetricsWriter", "ModelMetrics", "StepFold", "eval_scalars",
           "flushes", "last_metrics_file_step", "last_tensorboard_step", "metrics_line", "open_metrics",
           "step_scalars", "tensorboard_dir"]

#: TensorBoard's tag of the loss, the one read back to find a restarted run's last step written.
LOSS = "learning/loss"
#: The eval loss (MaxText's name), the one read back to find a restarted run's last eval written.
EVAL_LOSS = "eval/avg_loss"
# The elastic scalars' own prefix (MaxText's are learning/ and perf/).
_ELASTIC = "elastic/"
# Goodput is folded from the whole log; recomputed at a flush only while that costs under this share of the time.
_GOODPUT_SHARE = 0.01
_CLOSE_SECONDS = 30.0   # the longest close() waits for the writer thread to write what is queued


@dataclass(frozen=True)
class ModelMetrics:
    """What only the model knows, for MaxText's scalars: its learning rate at a step, and the tokens and TFLOPs
    (all devices together) of one step. Set on a job as ``job.model_metrics``; the MaxText integration and
    the bundled model set it. Unknown (None, 0): the scalar is not written."""

    learning_rate: Callable[[int], float] | None = None
    tokens_per_step: float = 0.0
    tflops_per_step: float = 0.0


def tensorboard_dir(run_dir: pathlib.Path) -> pathlib.Path:
    """Where a run's event files go: MaxText's ``<base_output_directory>/<run_name>/tensorboard/<run_name>``."""
    return run_dir / "tensorboard" / run_dir.name


def flushes(step: int, log_period: int) -> bool:
    """Whether TensorBoard is flushed after ``step``: MaxText's rule, ``step % log_period == 0``."""
    return step % log_period == 0


@dataclass(frozen=True)
class Commit:
    """What the event log says of one committed step, for its scalars (:func:`step_scalars`)."""

    step: int
    loss: float
    seconds: float | None   # MaxText's step time: since the previous commit (None: unknown)
    slices: int             # live slices (the placement's active ones)
    recoveries: int         # recoveries so far


@dataclass(frozen=True)
class Eval:
    """What the event log says of one eval (``eval_completed``), for its scalars (:func:`eval_scalars`)."""

    step: int
    loss: float
    total_loss: float
    total_weights: float
    seconds: float


class StepFold:
    """Folds a run's events, in log order, into its commits (pure: no I/O, no clock).

    ``feed(event)`` returns the :class:`Commit` of a ``step_committed`` event, the :class:`Eval` of an
    ``eval_completed`` one, and None for any other. The
    live slices are :class:`runtime.RunState`'s placement; the recoveries count ``recovered`` events; the
    step time is MaxText's, the time since the previous commit (the step's own ``seconds`` for an attempt's
    first).
    """

    def __init__(self):
        self.state = RunState()
        self.recoveries = 0
        self.last_commit_t: float | None = None

    def feed(self, event: Mapping[str, Any]) -> Commit | None:
        self.state = self.state.apply(event)
        kind = event["kind"]
        if kind == "job_started":
            self.last_commit_t = None
        elif kind == "recovered":
            self.recoveries += 1
        elif kind == "eval_completed":
            loss = float(event["loss"])
            return Eval(int(event["step"]), loss, float(event.get("total_loss", loss)),
                        float(event.get("total_weights", 1.0)), float(event.get("seconds", 0.0)))
        if kind != "step_committed":
            return None
        t, step = float(event["t"]), int(event["step"])
        seconds = t - self.last_commit_t if self.last_commit_t is not None else event.get("seconds")
        self.last_commit_t = t
        placement = self.state.placement   # none in a reference run: its one process is one slice
        slices = len(placement.active) if placement is not None else 1
        return Commit(step, float(event["loss"]), seconds, slices, self.recoveries)


def step_scalars(commit: Commit, model: ModelMetrics, devices_per_slice: int) -> dict[str, float]:
    """One step's scalars under MaxText's names (``MetricLogger.record_train_metrics``), then jax-elastic's
    under ``elastic/``. Per device: over the devices of the live slices."""
    out = {LOSS: commit.loss}
    if model.learning_rate is not None:
        out["learning/current_learning_rate"] = float(model.learning_rate(commit.step))
    seconds, devices = commit.seconds, commit.slices * devices_per_slice
    if seconds is not None and seconds > 0:
        out["perf/step_time_seconds"] = float(seconds)
        for name, total in (("tflops", model.tflops_per_step), ("tokens", model.tokens_per_step)):
            if total and devices:
                out[f"perf/per_device_{name}"] = total / devices
                out[f"perf/per_device_{name}_per_sec"] = total / devices / seconds
    out.update({_ELASTIC + "slices_live": float(commit.slices), _ELASTIC + "recoveries": float(commit.recoveries)})
    return out


def eval_scalars(ev: Eval) -> dict[str, float]:
    """One eval's scalars under MaxText's names (``MetricLogger._finalize_eval_metrics``): the loss over the
    eval's tokens (or microbatches), its perplexity, and the sums behind it."""
    try:
        perplexity = math.exp(ev.loss)
    except OverflowError:
        perplexity = math.inf
    return {EVAL_LOSS: ev.loss, "eval/avg_perplexity": perplexity, "eval/total_loss": ev.total_loss,
            "eval/total_weights": ev.total_weights, _ELASTIC + "eval_seconds": ev.seconds}


def metrics_line(scalars: Mapping[str, float], step: int, run_name: str) -> str:
    """MaxText's ``metrics_file`` line (``_prepare_metrics_for_json``): the scalars, ``step`` as a float, the run."""
    return json.dumps({**{k: float(v) for k, v in scalars.items()}, "step": float(step), "run_name": run_name})


def last_metrics_file_step(path: pathlib.Path, key: str = LOSS) -> int:
    """The last step whose ``key`` (the loss, or :data:`EVAL_LOSS`) a ``metrics_file`` holds (-1: none, or no
    file); a torn last line is ignored."""
    try:
        lines = path.read_bytes().split(b"\n")
    except FileNotFoundError:
        return -1
    last = -1
    for raw in lines:
        try:
            line = json.loads(raw)
            if key in line:
                last = max(last, int(line["step"]))
        except (ValueError, KeyError, TypeError):
            continue   # a torn line (a client killed mid-write), or not one of ours
    return last


def last_tensorboard_step(directory: pathlib.Path, tag: str = LOSS) -> int:
    """The last step whose ``tag`` (the loss, or :data:`EVAL_LOSS`) the event files in ``directory`` hold (-1:
    none). Reads the
    records' framing (length, its checksum, data, its checksum) and decodes each with tensorboardX's own
    ``Event``; a file's torn last record (a client killed mid-write) ends that file."""
    from tensorboardX.proto import event_pb2

    last = -1
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at + 12 <= len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            end = at + 12 + length + 4
            if end > len(data):
                break
            event = event_pb2.Event()
            try:
                event.ParseFromString(data[at + 12:at + 12 + length])
            except Exception:  # noqa: BLE001 - protobuf's DecodeError: a damaged record ends the file
                break
            if any(v.tag == tag for v in event.summary.value):
                last = max(last, event.step)
            at = end
    return last


def _cut_torn_line(path: pathlib.Path) -> None:
    """Cuts off a last line without its newline (a client killed mid-write), so the next starts a line of its own."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    kept = data.rfind(b"\n") + 1
    if kept < len(data):
        os.truncate(path, kept)


class _Sink:
    """One place metrics go (TensorBoard, metrics_file): the last step it holds, and its one warning."""

    def __init__(self, name: str, last: int):
        self.name, self.last, self.broken = name, last, False
        self.last_eval = -1   # the last eval's step it holds

    def wants(self, step: int) -> bool:
        return not self.broken and step > self.last

    def wants_eval(self, step: int) -> bool:
        return not self.broken and step > self.last_eval

    def failed(self, error: BaseException) -> None:
        self.broken = True
        print(f"elastic: warning: {self.name}: {type(error).__name__}: {error}; the run goes on without writing "
              "it", file=sys.stderr)


class MetricsWriter:
    """Writes the committed steps of a run to its TensorBoard files and ``metrics_file``; see the module."""

    def __init__(self, *, run_dir: pathlib.Path, tensorboard: bool, metrics_file: str, log_period: int,
                 model: ModelMetrics, devices_per_slice: int, fresh: bool, history: Iterable[Mapping] = ()):
        self.run_dir, self.log_period = run_dir, log_period
        self.model, self.devices_per_slice = model, devices_per_slice
        self.fold = StepFold()
        self._queue: queue.Queue = queue.Queue()
        self._writer = self._file = None
        self._tb = self._mf = None
        self._goodput = _Sink("elastic/goodput (TensorBoard)", -1)   # its failure leaves the other scalars be
        self._goodput_cost, self._goodput_at = 0.0, 0.0
        self._superseded = False
        if tensorboard:
            self._tb = _Sink("TensorBoard (enable_tensorboard)", -1)
            self._guard(self._tb, self._open_tensorboard, fresh)
        if metrics_file:
            self._mf = _Sink(f"metrics_file {metrics_file}", -1)
            self._guard(self._mf, self._open_metrics_file, pathlib.Path(metrics_file), fresh)
        for event in history:   # the earlier attempts' committed steps their client did not write
            self._write(event)
        self._thread = threading.Thread(target=self._loop, name="elastic-metrics", daemon=True)
        self._thread.start()

    def observe(self, event: dict) -> None:
        """The event log's listener (called under its lock): queues the event for the writer thread."""
        self._queue.put(event)

    def close(self, *, superseded: bool = False) -> None:
        """Writes what is queued (waiting at most 30 s), flushes and closes the files. Never raises.
        ``superseded``: another client drives the run now and writes its metrics; nothing more is written."""
        self._superseded = superseded
        self._queue.put(None)
        self._thread.join(_CLOSE_SECONDS)
        if self._thread.is_alive():
            print("elastic: warning: metrics (enable_tensorboard, metrics_file) still writing after "
                  f"{_CLOSE_SECONDS:.0f} s; left unfinished", file=sys.stderr)
            return
        if self._writer is not None and not superseded:
            self._guard(self._goodput, self._goodput_point, True)
            self._guard(self._tb, self._writer.close)
        if self._file is not None:
            self._guard(self._mf, self._file.close)

    # ------------------------------------------------------------------ the writer thread

    def _loop(self) -> None:
        while (event := self._queue.get()) is not None:
            self._write(event)

    def _write(self, event: Mapping[str, Any]) -> None:
        if self._superseded:
            return
        sinks = [sink for sink in (self._tb, self._mf) if sink is not None]
        try:
            commit = self.fold.feed(event)
            if isinstance(commit, Eval):
                wanting = [sink for sink in sinks if sink.wants_eval(commit.step)]
                scalars = eval_scalars(commit) if wanting else None
            else:
                wanting = [sink for sink in sinks if commit is not None and sink.wants(commit.step)]
                scalars = step_scalars(commit, self.model, self.devices_per_slice) if wanting else None
        except Exception as e:  # noqa: BLE001 - an event or a model the metrics cannot read must not stop the run
            for sink in sinks:
                if not sink.broken:
                    sink.failed(e)
            return
        for sink in wanting:   # only steps (evals) a file does not hold yet: none twice, the scalars computed once
            write = self._tensorboard_step if sink is self._tb else self._metrics_file_step
            self._guard(sink, write, commit.step, scalars, isinstance(commit, Eval))

    def _tensorboard_step(self, step: int, scalars: Mapping[str, float], evaluated: bool = False) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)
        if evaluated:
            self._tb.last_eval = step
            return
        self._tb.last = step
        if flushes(step, self.log_period):
            self._guard(self._goodput, self._goodput_point, False)
            self._writer.flush()

    def _metrics_file_step(self, step: int, scalars: Mapping[str, float], evaluated: bool = False) -> None:
        self._file.write(metrics_line(scalars, step, self.run_dir.name) + "\n")
        self._file.flush()
        if evaluated:
            self._mf.last_eval = step
        else:
            self._mf.last = step

    def _goodput_point(self, last: bool) -> None:
        """``elastic/goodput`` at the last step written: the report's goodput of the log so far, once a step,
        recomputed while that costs under 1% of the time (the log is read and folded whole); always at the end."""
        step = self._tb.last
        cheap = self._goodput_cost <= _GOODPUT_SHARE * (time.monotonic() - self._goodput_at)
        if self._tb.broken or step <= self._goodput.last or not (last or cheap):
            return
        from elastic.report.goodput import goodput

        started = time.monotonic()
        fraction = goodput(read_events(self.run_dir / "events.jsonl"))["goodput_fraction"]
        self._writer.add_scalar(_ELASTIC + "goodput", fraction, step)
        self._goodput.last = step
        self._goodput_at = time.monotonic()
        self._goodput_cost = self._goodput_at - started

    # ------------------------------------------------------------------ files

    def _open_tensorboard(self, fresh: bool) -> None:
        from tensorboardX import SummaryWriter

        directory = tensorboard_dir(self.run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        if not fresh:   # (a fresh run's earlier files were moved aside with its other records: run_records)
            self._tb.last = last_tensorboard_step(directory)
            self._tb.last_eval = last_tensorboard_step(directory, EVAL_LOSS)
        # Each attempt's file is its own, named in the order they were written (TensorBoard reads them in name
        # order): two in the same second would otherwise share a name, the second overwriting the first.
        self._writer = SummaryWriter(str(directory), filename_suffix=f".{time.time_ns()}")

    def _open_metrics_file(self, path: pathlib.Path, fresh: bool) -> None:
        if not fresh:
            self._mf.last = last_metrics_file_step(path)
            self._mf.last_eval = last_metrics_file_step(path, EVAL_LOSS)
            _cut_torn_line(path)
        self._file = open(path, "w" if fresh else "a", encoding="utf-8")   # noqa: SIM115 - closed by close()

    @staticmethod
    def _guard(sink: _Sink | None, fn: Callable, *args) -> None:
        if sink is None or sink.broken:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - writing metrics must never fail or stop the run
            sink.failed(e)


def open_metrics(*, run_dir: pathlib.Path, tensorboard: bool, metrics_file: str, log_period: int,
                 model: ModelMetrics, devices_per_slice: int, fresh: bool,
                 history: Iterable[Mapping] = ()) -> MetricsWriter | None:
    """The attempt's writer, or None when neither ``enable_tensorboard`` nor ``metrics_file`` is set.
    ``fresh``: the attempt replaced the run's log (the files start anew); else ``history`` is the log of the
    earlier attempts, whose committed steps the files do not hold yet are written first."""
    if not tensorboard and not metrics_file:
        return None
    return MetricsWriter(run_dir=run_dir, tensorboard=tensorboard, metrics_file=metrics_file, log_period=log_period,
                         model=model, devices_per_slice=devices_per_slice, fresh=fresh,
                         history=() if fresh else history)

