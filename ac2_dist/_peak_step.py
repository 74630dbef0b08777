"""One step as a ``MemoryBudget(peak=N)`` planner measures it (:class:`_Step`: its
regions, its plan marks, its segment peaks read from the trace) and what the planner
remembers of it (:class:`_Record`). Moved verbatim from _peak.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._alloc import AllocationTrace
from ._alloc_history import AllocatorHistory

__all__: list[str] = []


@dataclass
class _Call:
    """One budget region of a step (a checkpointed block's call)."""

    fqn: str
    dk: int  # bytes its plan saves above its floor (0 at the floor)
    signature: tuple | None = None  # its structure (known when it exits)


@dataclass
class _Step:
    """One forward + backward as the planner measures it (Note [What a peak target bounds] in _peak.py)."""

    index: int
    prefix: str  # of its plan marks: unique per planner and step
    base_abs: int = 0  # allocated when it began (CUDA; 0 on CPU)
    calls: list[_Call] = field(default_factory=list)
    anonymous: int = 0  # regions without a module fqn so far (PeakPlanner._key)
    trace: AllocationTrace | AllocatorHistory | None = None  # CPU: a profiler trace; CUDA: the allocator's history
    own_trace: bool = False
    backward: bool = False  # its backward began
    ended: bool = False  # its backward completed
    problem: str | None = None  # why it cannot be measured
    peaks: dict[str, int] | None = None  # segment -> peak above the step's start
    choice: Any = None  # the planner's choice when it began (what its blocks should follow)

    def mark(self, what: str) -> None:
        if self.trace is not None:
            self.trace.plan_mark(self.prefix + what)

    def names(self) -> list[str]:
        out = []
        for k in range(len(self.calls)):
            out += [f"{self.prefix}fwd:{k}", f"{self.prefix}bwd:{k}"]
        return out + [f"{self.prefix}end"]

    def collect(self, trace: AllocationTrace | AllocatorHistory) -> None:
        """The trace that measured this step has exited: read its segments."""
        if getattr(trace, "problem", None) is not None:  # the allocator's history could not be read
            self.problem = self.problem or trace.problem
            return
        spans = trace.spans(self.names())
        start = spans.get(f"{self.prefix}fwd:0")
        if start is None:
            self.problem = self.problem or "its marks are missing from the allocation trace"
            return
        n = len(self.prefix)
        self.peaks = {name[n:]: peak - start[0] for name, (_, peak) in spans.items() if not name.endswith("end")}
        if not self.backward or not self.ended:
            self.problem = self.problem or "its backward did not complete while it was traced"


@dataclass
class _Record:
    """What one measured step showed (:meth:`PeakPlanner.describe`)."""

    step: int
    what: str
    predicted: int | None
    measured: int | None
    note: str = ""


def _missing(segments: list[str], peaks: dict[str, int] | None) -> str | None:
    if not peaks or f"fwd:{len(segments) // 2 - 1}" not in peaks:
        return "its marks are missing from the allocation trace"
    return None
