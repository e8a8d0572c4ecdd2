"""Transitional names for code not yet moved to :mod:`runtime.core.programs`, where a run's programs are one
type for any stage count. Delete once nothing imports this module (``runtime.worker.worker``,
``runtime.control.controller``).

``StagePrograms`` here is a check, not a class of its own: ``isinstance(p, StagePrograms)`` is whether ``p``
is one stage of a pipeline (:attr:`runtime.core.programs.StagePrograms.pipelined`), as it was when only a
pipeline's stages had this type. Read ``p.pipelined`` instead.
"""

from __future__ import annotations

from runtime.core import programs as _programs
from runtime.core.programs import stages_digest

__all__ = ["StagePrograms", "stages_digest"]


class _PipelineStageCheck(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, _programs.StagePrograms) and obj.pipelined


class StagePrograms(metaclass=_PipelineStageCheck):
    """``isinstance(p, StagePrograms)``: ``p`` is a :class:`runtime.core.programs.StagePrograms` of a pipeline."""
