"""Which ``torch.distributed.pipelining`` stage forward runs on this thread, read from
the stage's own frame (Note [Pipeline steps]): ``memory.track`` counts steps by it, a
``MemoryBudget(peak=...)`` measures no step under it (at the floor, or following a
pipeline rank's plan file: Note [A pipeline rank's plan is followed as simulated] in
_plan/_peak_pipeline.py)."""

from __future__ import annotations

import sys

__all__ = ["in_pipeline_stage", "pipeline_microbatch"]


def pipeline_microbatch() -> tuple[int, int] | None:
    """``(id(stage), microbatch)`` of the ``torch.distributed.pipelining`` stage forward
    running on this thread, if one is (``_PipelineStageBase.forward_one_chunk`` on the
    call stack); ``None`` otherwise or if pipelining is not imported.

    Note [Pipeline steps]: counting forwards in flight cannot tell a schedule step from
    its microbatches on a stage that finishes each microbatch's backward before the next
    forward (the last stage of 1F1B: F0 B0 F1 B1 ...), which is exactly plain training.
    The schedule knows: it runs microbatch i's forward once per stage and step, so a
    forward of a (stage, microbatch) pair already seen in the current step starts the
    next step. The pair is read from the stage's own frame (nothing is patched).
    """
    stage_module = sys.modules.get("torch.distributed.pipelining.stage")
    base = getattr(stage_module, "_PipelineStageBase", None)
    code = getattr(getattr(base, "forward_one_chunk", None), "__code__", None)
    if code is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            local = frame.f_locals
            chunk = local.get("fwd_chunk_id")
            return (id(local.get("self")), chunk) if isinstance(chunk, int) else None
        frame = frame.f_back
    return None


def in_pipeline_stage() -> bool:
    """Whether a ``torch.distributed.pipelining`` stage runs a forward on this thread:
    its schedule's (``forward_one_chunk``) or its first step's shape or metadata
    inference -- any function of ``torch.distributed.pipelining.stage`` on the call
    stack (the inference's name differs between torch versions)."""
    stage_module = sys.modules.get("torch.distributed.pipelining.stage")
    path = getattr(stage_module, "__file__", None)
    if path is None:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == path:
            return True
        frame = frame.f_back
    return False
