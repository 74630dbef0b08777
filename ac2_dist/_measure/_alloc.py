"""Real allocation accounting from the allocator's own events (torch.profiler).

On CPU there is no ``memory_allocated()``; the profiler's memory events are the
allocator's record of every allocation and free (address, size and time). Replaying
them in time order gives the bytes allocated within a window that are alive at any
moment of it. The CUDA caching allocator reports its blocks the same way (block sizes:
the scale of ``torch.cuda.memory_allocated``), so one code path serves both devices
(``memory.track``); the session records CPU activity only (the allocator reports to
it; no kernel tracing) and reads or resets no allocator statistic. A peak target on
CUDA measures without a profiler session (_alloc_history.py).

Note [One trace, two readers]
    Two profiler sessions cannot run at once (the inner one's stop ends both), yet a
    ``MemoryBudget(peak=...)`` verifies its plan from the allocator while a user's (or a
    test's) ``memory.track`` / ``AllocationTrace`` may be measuring the same step. So
    each running trace is listed per thread (:func:`active_trace`); the planner marks
    its step with *plan marks* (a prefix of their own, read into ``plan_marks``, never
    into ``marks``: no phase of the other reader moves) and reads its figures from
    ``spans`` when the trace exits (``on_exit``). Both readers get the allocator's
    events unchanged; neither sees the other's figures. When no trace runs, the
    planner starts its own for the step and stops it when its next step begins (not
    at the end of backward: a profiler stopped inside the autograd engine's final
    callback is restored as enabled when the engine restores the thread's state); a
    trace that starts in between (``memory.track``) stops it first (``preempt``).
"""

from __future__ import annotations

import atexit
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._profiler import _ExtraFields_Allocation as _Allocation
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import _disable_current_modes

from . import _quiet

__all__ = ["AllocationTrace", "Phase", "active_trace"]

_MARK_PREFIX = "ac2::mark::"
# Marks of a MemoryBudget(peak=...) step (Note [One trace, two readers]): kept apart from
# the phase marks, so a planner measuring inside someone else's trace moves no phase.
_PLAN_PREFIX = "ac2::plan::"

# The AllocationTraces running on this thread, innermost last (Note [One trace, two readers]).
_local = threading.local()


class _QuietProfile(profile):
    """ac2's own session: kineto prints nothing as it starts and stops (Note [ac2's
    profiler session prints nothing] in _quiet.py)."""

    def prepare_trace(self) -> None:
        with warnings.catch_warnings():  # torch 2.10 and 2.11 warn at any session's first cycle
            warnings.filterwarnings("ignore", message=_quiet.CYCLE_WARNING, category=UserWarning)
            super().prepare_trace()

    def start_trace(self) -> None:
        with _quiet.kineto_quiet():
            super().start_trace()

    def stop_trace(self) -> None:
        with _quiet.kineto_quiet():
            super().stop_trace()


def active_trace() -> AllocationTrace | None:
    """The innermost :class:`AllocationTrace` running on this thread, if any."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


@dataclass
class Phase:
    """Allocation figures of one span of an :class:`AllocationTrace` (bytes)."""

    start_bytes: int = 0  # live bytes (allocated in the trace) when it began
    peak_bytes: int = 0  # highest live bytes reached inside it
    end_bytes: int = 0  # live bytes when it ended
    allocations: int = 0
    calls: int = 0  # watched calls (``AllocationTrace.watch``) that started inside it


@dataclass
class AllocationTrace:
    """Record allocations/frees while active; those on ``device_type`` (read when it
    exits) are counted.

    ``mark(name)`` splits the window into phases; after exit, ``segments`` lists them
    in time order as ``(name, Phase)``, each from its mark to the next one (or the end);
    a name may be marked several times (one segment each), and ``phases[name]`` is the
    last segment of that name. Events before the first mark belong to no segment.
    ``whole`` covers the window.
    Figures count the blocks allocated while the trace runs: 0 at its start, and frees
    of blocks allocated before it are not counted.
    """

    # See Note [Frees of blocks from before the trace].

    device_type: str = "cpu"
    #: op names whose calls are recorded (time_ns, name) in ``calls`` (e.g. all-gathers)
    watch: frozenset = frozenset()
    events: list[tuple[int, int]] = field(default_factory=list)  # (time_ns, +/- bytes)
    allocations: list[tuple[int, int, int]] = field(default_factory=list)  # (time_ns, address, +/- bytes)
    calls: list[tuple[int, str]] = field(default_factory=list)
    marks: list[tuple[int, str]] = field(default_factory=list)
    phases: dict[str, Phase] = field(default_factory=dict)
    segments: list[tuple[str, Phase]] = field(default_factory=list)
    whole: Phase = field(default_factory=Phase)
    #: (time_ns, name) of the planner's marks (``plan_mark``), in time order
    plan_marks: list[tuple[int, str]] = field(default_factory=list)
    # See Note [One trace, two readers] (on_exit, preempt).
    #: called with the trace once it has been summarized
    on_exit: list[Callable[[AllocationTrace], None]] = field(default_factory=list)
    #: set on a planner's own trace: a trace that starts while it runs stops it first
    #: (and it stops quietly at exit)
    preempt: Callable[[], None] | None = None
    _prof: Any = None

    def __enter__(self) -> AllocationTrace:
        top = active_trace()
        if top is not None and top.preempt is not None:
            top.preempt()
        # CPU activity only: allocations of every device are reported to the session by
        # their allocator; ``device_type`` picks the ones counted when it exits.
        prof = _QuietProfile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
        _quiet.session_started()
        try:
            prof.__enter__()
        except BaseException:
            try:
                if torch._C._autograd._profiler_enabled():  # it started, then failed
                    prof.__exit__(None, None, None)
            finally:
                _quiet.session_stopped()
            raise
        self._prof = prof
        atexit.register(self._stop_at_exit)
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(self)
        return self

    def _stop_at_exit(self) -> None:
        """Stop a session still running when the interpreter exits.

        Note [No profiler session outlives the interpreter]: a profiler session that is
        still running at interpreter exit crashes the process while C++ statics are torn
        down (SIGSEGV, exit status 139, instead of the script's own status or error).
        A trace whose ``__exit__`` never ran (a tracker entered by hand, then an exception)
        is stopped here, from atexit, while the interpreter is alive.
        """
        prof, self._prof = self._prof, None
        if prof is None:
            return
        self._unregister()
        try:
            if self.preempt is None:
                warnings.warn("ac2_dist: a memory tracker was still active at exit (its with-block "
                              "never ended); its profiler session is stopped now", RuntimeWarning, stacklevel=1)
            # else: a MemoryBudget(peak=...) measuring its last step, stopped quietly
            prof.__exit__(None, None, None)
        finally:
            _quiet.session_stopped()

    def mark(self, name: str) -> None:
        """An instant profiler range: only its start time is read back (phase boundary)."""
        _instant(_MARK_PREFIX + name)

    @staticmethod
    def plan_mark(name: str) -> None:
        """A mark that splits no phase: read back in ``plan_marks``. Static: it goes to
        whichever trace is running."""
        # See Note [One trace, two readers].
        _instant(_PLAN_PREFIX + name)

    def _unregister(self) -> None:
        stack = getattr(_local, "stack", None)
        if stack and self in stack:
            stack.remove(self)

    def __exit__(self, *exc: Any) -> None:
        atexit.unregister(self._stop_at_exit)
        self._unregister()
        prof, self._prof = self._prof, None
        try:
            prof.__exit__(*exc)
        finally:
            _quiet.session_stopped()
        allocations: list[tuple[int, int, int]] = []  # (time_ns, address, +/- bytes)
        for e in _walk(prof.profiler.kineto_results.experimental_event_tree()):
            name = e.name
            fields = e.extra_fields
            if isinstance(fields, _Allocation):
                if fields.device.type == self.device_type:
                    allocations.append((e.start_time_ns, fields.ptr, fields.alloc_size))
            elif name.startswith(_MARK_PREFIX):
                self.marks.append((e.start_time_ns, name[len(_MARK_PREFIX):]))
            elif name.startswith(_PLAN_PREFIX):
                self.plan_marks.append((e.start_time_ns, name[len(_PLAN_PREFIX):]))
            elif name in self.watch and not _inside(e, name):
                # A watched op may appear again nested inside its own event (dispatcher
                # re-entry): count only the outermost one.
                self.calls.append((e.start_time_ns, name))
        self.events = _paired(allocations)
        self.allocations = allocations  # (time_ns, address, +/- bytes), time order (for allocator models)
        self.marks.sort()
        self.plan_marks.sort()
        self.calls.sort()
        self._summarize()
        listeners, self.on_exit = self.on_exit, []
        for fn in listeners:
            fn(self)

    def spans(self, names: list[str]) -> dict[str, tuple[int, int]]:
        """``{name: (live bytes at its plan mark, peak live bytes until the next of
        ``names``' marks)}`` for the plan marks named in ``names`` (the last one runs
        to the end of the trace). A name marked twice keeps its first mark."""
        wanted = set(names)
        marks = []
        seen = set()
        for t, name in self.plan_marks:
            if name in wanted and name not in seen:
                seen.add(name)
                marks.append((t, name))
        stream = [(t, 0, k, name) for k, (t, name) in enumerate(marks)]
        stream += [(t, 1, k, nbytes) for k, (t, nbytes) in enumerate(self.events)]
        stream.sort(key=lambda e: e[:3])
        live = 0
        out: dict[str, list[int]] = {}
        current: list[int] | None = None
        for _, kind, _, value in stream:
            if kind == 0:
                current = out[value] = [live, live]
            else:
                live += value
                if current is not None and live > current[1]:
                    current[1] = live
        return {name: (a, b) for name, (a, b) in out.items()}

    def calls_after(self, mark: str) -> int:
        """Number of watched calls that started after the first ``mark``."""
        t0 = next((t for t, name in self.marks if name == mark), None)
        return 0 if t0 is None else sum(1 for t, _ in self.calls if t >= t0)

    def _summarize(self) -> None:
        """Replay allocations, frees, marks and watched calls in time order.

        At equal times a mark comes first (an allocation at its instant belongs to the
        segment it starts), then allocations and frees, then calls.
        """
        stream: list[tuple[int, int, int, Any]] = [(t, 0, k, name) for k, (t, name) in enumerate(self.marks)]
        stream += [(t, 1, k, nbytes) for k, (t, nbytes) in enumerate(self.events)]
        stream += [(t, 2, k, None) for k, (t, _) in enumerate(self.calls)]
        stream.sort(key=lambda e: e[:3])
        live = 0
        phase: Phase | None = None
        self.whole = Phase()
        self.segments = []
        for _, kind, _, value in stream:
            if kind == 0:  # a mark: the current segment ends, the next one starts
                phase = Phase(live, live, live)
                self.segments.append((value, phase))
            elif kind == 1:
                live += value
                self.whole.peak_bytes = max(self.whole.peak_bytes, live)
                self.whole.allocations += value > 0
                if phase is not None:
                    phase.peak_bytes = max(phase.peak_bytes, live)
                    phase.allocations += value > 0
                    phase.end_bytes = live
            else:
                self.whole.calls += 1
                if phase is not None:
                    phase.calls += 1
        self.whole.end_bytes = live
        self.phases = dict(self.segments)


def _instant(name: str) -> None:
    # Below any dispatch mode: a mark made inside a checkpointed region is no op of it
    # (a budget's plan would otherwise see its structure change when tracing stops).
    with _disable_current_modes():
        marker = record_function(name)
        marker.__enter__()
        marker.__exit__(None, None, None)


def _walk(roots: list[Any]) -> Iterator[Any]:
    """Every event of a profiler event tree, parents before children, siblings in order."""
    stack = list(reversed(roots))
    while stack:
        e = stack.pop()
        yield e
        stack.extend(reversed(e.children))


def _inside(e: Any, name: str) -> bool:
    """Whether an enclosing event of ``e`` has the same name."""
    parent = e.parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.parent
    return False


def _paired(allocations: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(time_ns, +/- bytes) in time order, keeping only frees of blocks allocated in the trace.

    Note [Frees of blocks from before the trace]: the CPU allocator remembers the size
    of every block allocated while any memory-profiling session ran (a table for the
    whole process), so a block allocated during an *earlier* session and freed during
    this one is reported as a free of known size, while blocks from before any session
    are freed silently. Counting those frees made the figures depend on what ran earlier
    in the process (garbage from an earlier tracked step, collected mid-forward, lowered
    this step's peak). So a free counts only if this trace saw the block's allocation
    (paired by address; an address can be reused once freed).
    """
    allocations.sort(key=lambda a: a[0])  # stable: equal times keep the tree's order
    live: dict[int, int] = {}
    events: list[tuple[int, int]] = []
    for t, ptr, nbytes in allocations:
        if nbytes > 0:
            live[ptr] = nbytes
            events.append((t, nbytes))
        elif nbytes < 0 and ptr in live:
            events.append((t, -live.pop(ptr)))
    return events
