"""Transitional: a pipeline stage runs on the one :class:`~runtime.worker.executor.SliceExecutor`. Delete once
``runtime.worker.worker`` imports it from there."""

from runtime.worker.executor import SliceExecutor

__all__ = ["StageExecutor"]

StageExecutor = SliceExecutor
