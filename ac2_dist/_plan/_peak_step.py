"""One step as a ``MemoryBudget(peak=N)`` planner measures it (:class:`_Step`: its
regions, its plan marks, its segment peaks read from the trace) and what the planner
remembers of it (:class:`_Record`), and the sync round that gives every rank the same
figures (:func:`_all_max`). Moved verbatim from _peak.py.

Note [One plan on every rank]
    A replay of a nested FSDP unit unshards it (a collective), so ranks whose plans
    differ could issue collectives in different orders. At every step start but the
    first, every rank takes part in exactly one sync round (two MAX all-reduces over the
    default process group: the length, then a fixed header -- settled?, unusable?, block
    count, target, the allocated bytes the next step starts from -- and the segment
    peaks), whatever it has to offer: a rank with no usable step says so, a settled
    rank still joins until the round says every rank has settled, then none syncs
    again. So the number of collectives is the number of step starts on every rank,
    and with equal targets and equal block structures every rank runs the same
    deterministic planner on the same numbers (the highest peak per segment) and gets
    the same plan. Ranks with different targets (a callable) or block counts plan on
    their own figures. Every rank must therefore run the same checkpointed forwards
    under grad (as FSDP and DDP require anyway). A ``torch.distributed.pipelining``
    stage reaches a step's first region when its schedule says, not when the other
    stages do: the planner detects the stage (its frame on the stack, before any
    collective) and never syncs: it stays at the floor or follows a pipeline rank's plan
    file (Note [A pipeline rank's plan is followed as simulated] in _peak_pipeline.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

from .._measure._alloc import AllocationTrace
from .._measure._alloc_history import AllocatorHistory

__all__: list[str] = []


@dataclass
class _Call:
    """One budget region of a step (a checkpointed block's call)."""

    fqn: str
    dk: int  # bytes its plan saves above its floor (0 at the floor)
    signature: tuple | None = None  # its structure (known when it exits)
    # its nodes' call indices (Note [A block's backward, replay by replay] in _peak_model.py)
    seq_calls: dict[int, int] | None = None


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
    parts: dict[str, int] = field(default_factory=dict)  # sub-segments of blocks' backward -> peak (and bwd:k before them)
    choice: Any = None  # the planner's choice when it began (what its blocks should follow)
    at_model: bool = False  # it began at the model's forward (mark "start"), not at its first region
    # per block, what its replays had made (its ops' call indices) at each mark
    # "bwd:k/i" (i = 1, 2, ...), and everything made so far (Note [A block's backward, replay
    # by replay] in _peak_model.py)
    made: dict[int, list[frozenset[int]]] = field(default_factory=dict)
    made_now: dict[int, set[int]] = field(default_factory=dict)

    def mark(self, what: str) -> None:
        if self.trace is not None:
            self.trace.plan_mark(self.prefix + what)

    def names(self) -> list[str]:
        out = [f"{self.prefix}start"] if self.at_model else []
        for k in range(len(self.calls)):
            out += [f"{self.prefix}fwd:{k}", f"{self.prefix}bwd:{k}"]
            out += [f"{self.prefix}bwd:{k}/{i}" for i in range(1, len(self.made.get(k, ())) + 1)]
        return out + [f"{self.prefix}end"]

    def collect(self, trace: AllocationTrace | AllocatorHistory) -> None:
        """The trace that measured this step has exited: read its segments."""
        if getattr(trace, "problem", None) is not None:  # the allocator's history could not be read
            self.problem = self.problem or trace.problem
            return
        spans = trace.spans(self.names())
        start = spans.get(f"{self.prefix}{'start' if self.at_model else 'fwd:0'}")
        if start is None or f"{self.prefix}fwd:0" not in spans:
            self.problem = self.problem or "its marks are missing from the allocation trace"
            return
        n = len(self.prefix)
        self.peaks = {name[n:]: peak - start[0] for name, (_, peak) in spans.items() if not name.endswith("end")}
        # Note [A block's backward, replay by replay] (_peak_model.py): a block's sub-segments
        # go to ``parts`` (with its backward up to the first of them); ``peaks`` keeps whole segments.
        self.parts = {}
        for k, marks in self.made.items():
            whole, m = f"bwd:{k}", 0
            while whole in self.peaks and m < len(marks) and f"{whole}/{m + 1}" in self.peaks:
                m += 1
            del marks[m:]  # a mark the trace did not see (it stopped first) is no sub-segment
            if m:
                self.parts[whole] = self.peaks[whole]
            for i in range(1, m + 1):
                part = self.parts[f"{whole}/{i}"] = self.peaks.pop(f"{whole}/{i}")
                self.peaks[whole] = max(self.peaks[whole], part)
        for name in [s for s in self.peaks if "/" in s]:  # marks of no remembered replay
            del self.peaks[name]
        # Note [What a peak target bounds] (_peak.py): from the model's forward to the first
        # block (FSDP's root all-gather, the embedding) is part of the first block's segment.
        self.peaks["fwd:0"] = max(self.peaks["fwd:0"], self.peaks.pop("start", 0))
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


def _all_max(values: list[int]) -> list[int]:
    """Element-wise MAX over the default process group (Note [One plan on every rank]);
    lists of different lengths are padded (the caller compares the lengths it sent)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend()):
        device = torch.device("cuda", torch.cuda.current_device())
    with _disable_current_modes(), torch.no_grad():
        head = torch.tensor([len(values)], dtype=torch.int64, device=device)
        dist.all_reduce(head, op=dist.ReduceOp.MAX)
        longest = int(head.item())
        t = torch.tensor(values + [-(2**62)] * (longest - len(values)), dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()


class _ModelStart:
    """The forward pre-hook :func:`_watch_model` leaves on the model: calls its planner's
    ``model_forward`` while the planner lives. A copy or a pickle of the model (whose
    budget is a new one, not watching it) gets one that does nothing."""

    def __init__(self, begin: Callable[[nn.Module, Any], None] | None = None) -> None:
        self.begin = None if begin is None else weakref.WeakMethod(begin)  # type: ignore[arg-type]

    def __call__(self, module: nn.Module, args: Any) -> None:
        call = None if self.begin is None else self.begin()
        if call is not None:
            call(module, args)

    def __reduce__(self) -> tuple:
        return (_ModelStart, ())


def _watch_model(begin: Callable[[nn.Module, Any], None], model: nn.Module) -> None:
    """Call ``begin(model, args)`` first thing at each forward of ``model``, before the forward
    pre-hooks that libraries register on it (FSDP's root all-gather; ``fully_shard``
    usually comes after ``apply_ac`` and prepends its hook): a global pre-hook, run before
    every module's own, catches the model's first call and then prepends a hook of the
    model's own (Note [What a peak target bounds] in _peak.py). Holds neither strongly."""
    target, own = weakref.ref(model), _ModelStart(begin)
    handles: list[Any] = []

    def first(module: nn.Module, args: Any) -> None:
        watched = target()
        if module is not watched and watched is not None and own.begin is not None and own.begin() is not None:
            return
        while handles:  # the model's first call, or the model or its planner is gone
            handles.pop().remove()
        if watched is not None and module is watched:
            module.register_forward_pre_hook(own, prepend=True)
            own(module, args)

    handles.append(nn.modules.module.register_module_forward_pre_hook(first))
