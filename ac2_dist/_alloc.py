"""Real allocation accounting from the allocator's own events (torch.profiler).

On CPU there is no ``memory_allocated()``; the profiler's memory events are the
allocator's record of every allocation and free (size and time). Replaying them in
time order gives the bytes allocated at any moment of a window, relative to its
start. The same works for CUDA events, so one code path serves both devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["AllocationTrace", "Phase"]

_MARK_PREFIX = "ac2::mark::"


@dataclass
class Phase:
    """Allocation figures of one span of an :class:`AllocationTrace` (bytes)."""

    start_bytes: int = 0  # live bytes (relative to the trace start) when it began
    peak_bytes: int = 0  # highest live bytes reached inside it
    end_bytes: int = 0  # live bytes when it ended
    allocations: int = 0


@dataclass
class AllocationTrace:
    """Record allocations/frees on ``device_type`` while active.

    ``mark(name)`` splits the window into phases; after exit, ``phases[name]`` covers
    from that mark to the next one (or the end). ``whole`` covers the window.
    Figures are relative to the bytes live when the trace started.
    """

    device_type: str = "cpu"
    #: op names whose calls are recorded (time_ns, name) in ``calls`` (e.g. all-gathers)
    watch: frozenset = frozenset()
    events: list[tuple[int, int]] = field(default_factory=list)  # (time_ns, +/- bytes)
    calls: list[tuple[int, str]] = field(default_factory=list)
    marks: list[tuple[int, str]] = field(default_factory=list)
    phases: dict[str, Phase] = field(default_factory=dict)
    whole: Phase = field(default_factory=Phase)
    _prof: Any = None

    def __enter__(self) -> AllocationTrace:
        acts = [ProfilerActivity.CPU]
        if self.device_type == "cuda":
            acts.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=acts, profile_memory=True, record_shapes=False)
        self._prof.__enter__()
        return self

    def mark(self, name: str) -> None:
        """An instant profiler range: only its start time is read back (phase boundary)."""
        marker = record_function(_MARK_PREFIX + name)
        marker.__enter__()
        marker.__exit__(None, None, None)

    def __exit__(self, *exc: Any) -> None:
        self._prof.__exit__(*exc)
        want = self.device_type
        open_calls: dict[tuple[str, int], int] = {}  # (name, thread) -> end of the outer call
        for e in self._prof.profiler.kineto_results.events():
            name = e.name()
            if name == "[memory]":
                if _device_type(e) == want:
                    self.events.append((e.start_ns(), e.nbytes()))
            elif name.startswith(_MARK_PREFIX):
                self.marks.append((e.start_ns(), name[len(_MARK_PREFIX):]))
            elif name in self.watch:
                # A watched op may appear again nested inside its own event (dispatcher
                # re-entry): count only the outermost one per thread.
                key, start = (name, e.start_thread_id()), e.start_ns()
                if start > open_calls.get(key, -1):
                    open_calls[key] = e.end_ns()
                    self.calls.append((start, name))
        self._prof = None
        self.events.sort()
        self.marks.sort()
        self._summarize()

    def calls_after(self, mark: str) -> int:
        """Number of watched calls that started after the first ``mark``."""
        t0 = next((t for t, name in self.marks if name == mark), None)
        return 0 if t0 is None else sum(1 for t, _ in self.calls if t >= t0)

    def _summarize(self) -> None:
        bounds = self.marks + [(2**63, "")]
        live = 0
        phase: Phase | None = None
        k = 0
        self.whole = Phase()
        for t, nbytes in self.events:
            while t >= bounds[k][0]:
                if phase is not None:
                    phase.end_bytes = live
                phase = self.phases[bounds[k][1]] = Phase(live, live, live)
                k += 1
            live += nbytes
            self.whole.peak_bytes = max(self.whole.peak_bytes, live)
            self.whole.allocations += nbytes > 0
            if phase is not None:
                phase.peak_bytes = max(phase.peak_bytes, live)
                phase.allocations += nbytes > 0
                phase.end_bytes = live
        while k < len(self.marks):  # marks after the last event
            self.phases[bounds[k][1]] = Phase(live, live, live)
            k += 1
        self.whole.end_bytes = live


def _device_type(e: Any) -> str:
    dt = e.device_type()
    return "cuda" if dt == torch.autograd.DeviceType.CUDA else "cpu"
