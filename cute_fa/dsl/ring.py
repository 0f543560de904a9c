"""Pipeline positions computed from a use count instead of carried through loops.

A stage of an mbarrier ring is used for the ``count``-th time at index ``count % stages`` with
phase ``(count // stages) % 2`` (the producer waits on the opposite phase: a fresh "empty"
barrier counts as completed once). A role that knows how many times it has used a ring (block
``j`` of a loop is use ``j``, or ``2 j + 1``) can build the state where it needs it, so no
``PipelineState`` has to be carried through dynamic loops and branches.
"""

from __future__ import annotations

import cutlass.pipeline as pipeline
from cutlass import Int32


def ring_state(stages: int, count, producer: bool) -> pipeline.PipelineState:
    """The ``PipelineState`` of use ``count`` (Int32 or int) of a ring of ``stages``."""
    count = Int32(count)
    phase = (count // stages) % 2
    if producer:
        phase = phase ^ 1
    return pipeline.PipelineState(stages, count, count % stages, phase)


def slot_state(stages: int, index, use, producer: bool) -> pipeline.PipelineState:
    """The ``PipelineState`` of use ``use`` of stage ``index`` of a pipeline whose stages are
    owned by different roles (stage i = Q tile i) rather than taken in turn: every stage
    keeps its own phase, ``use % 2``."""
    use = Int32(use)
    phase = use % 2
    if producer:
        phase = phase ^ 1
    return pipeline.PipelineState(stages, use, Int32(index), phase)
