"""Peak CUDA bytes between marks, from the caching allocator's own memory history.

Note [Measuring a CUDA step without a profiler]
    A ``MemoryBudget(peak=...)`` verifies its plan on CUDA by the peak allocated bytes
    of each segment of a step (Note [The peak model] in _peak_model.py). It reads them from
    the caching allocator, with no profiler session (a user's ``torch.profiler`` would
    stop it, and profiling slows the steps it measures) and without resetting any
    statistic a user reads (``max_memory_allocated()`` around a step reads the step's
    true peak, measured or not):

    * At the step's start the allocator's memory history is switched on, trace only
      (``_record_memory_history(context=None)``: no stack is gathered; 2 entries are
      kept per allocation and free, skipping the other actions where torch allows) --
      unless someone already records it, whose recording is read as it is and left
      running. At every mark the allocator's counters are read (``memory_stats``:
      bytes allocated now, the peak statistic, and the number of allocations and
      frees so far). When the step is read the history is fetched (``_snapshot``)
      and switched off again if this meter switched it on.
    * The counters place each mark in the trace: the step's ``n`` allocations and
      frees are the last ``n`` ``alloc``/``free_requested`` entries, and a mark that
      counted ``k`` of them lies after the ``k``-th. (Counting from the end, a
      recording that began earlier or wraps around still works as long as it holds
      the whole step.)
    * A segment's peak: starting from the bytes allocated at its mark (exact, the
      allocator's counter), each entry adds or removes its bytes. The trace gives the
      *requested* size; the allocator hands out blocks rounded up to 512 bytes, and
      that rounding is applied, but a reused cached block may be larger still (by up
      to 1 MiB for a large block), which the trace does not say. So the walk starts
      from the exact count at its mark, is never below the exact count at the next
      one, and the peak statistic corrects it: a segment in which the statistic rose
      peaked at exactly its new value; one in which it did not, at most at its value.
    * The step cannot be read (``problem`` says why, the planner keeps its plan) if
      the allocator is not the native caching allocator (``cudaMallocAsync`` keeps no
      history), the history lost entries (a recording by someone else that keeps fewer, or
      skips allocations), another thread allocated while the counters and the
      history were read, or the counters were reset
      (``reset_accumulated_memory_stats``) during the step.

    Recording costs little (no stack per entry); the history is fetched once per
    measured step, for the few steps the planner measures (Note [Verify, correct,
    stay put]); a planner that settled records nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AllocatorHistory"]

_MAX_ENTRIES = 1 << 20  # the history's ring buffer while this meter records (entries are small: no stacks)
_KEPT = ("alloc", "free_requested")
# Actions a recording may skip (torch >= 2.8); what the walk does not read.
_SKIPPED = ["free_completed", "segment_alloc", "segment_free", "snapshot", "oom"]
_BLOCK = 512  # the caching allocator rounds every request up to a multiple of this


@dataclass(frozen=True)
class _Counters:
    ops: int  # allocations + frees so far (the allocator's cumulative counters)
    allocated: int  # bytes allocated now
    peak: int  # the peak statistic (since the last reset)


def _counters(index: int) -> _Counters:
    s = torch.cuda.memory_stats(index)
    return _Counters(s.get("allocation.all.allocated", 0) + s.get("allocation.all.freed", 0),
                     s.get("allocated_bytes.all.current", 0), s.get("allocated_bytes.all.peak", 0))


def _history_enabled() -> bool:
    enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    return bool(enabled()) if enabled is not None else False


def _start_recording() -> None:
    record = torch.cuda.memory._record_memory_history
    kwargs: dict[str, Any] = {"context": None, "stacks": "python", "max_entries": _MAX_ENTRIES}
    try:
        params = inspect.signature(record).parameters
    except (TypeError, ValueError):
        params = {}
    if "skip_actions" in params:
        kwargs["skip_actions"] = _SKIPPED
    record(enabled="all", **kwargs)


def _stop_recording() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)


def _rounded(nbytes: int) -> int:
    return max(_BLOCK, -(-nbytes // _BLOCK) * _BLOCK)


class AllocatorHistory:
    """Measures one step on one CUDA device, from the caching allocator's history (no
    profiler); the planner's interface of an allocation trace: ``plan_mark``,
    ``spans``, ``on_exit`` listeners, and ``__enter__``/``__exit__``."""

    # See Note [Measuring a CUDA step without a profiler].

    preempt: Callable[[], None] | None = None  # another meter never stops this one

    def __init__(self, device: torch.device) -> None:
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.on_exit: list[Callable[[AllocatorHistory], None]] = []
        self.problem: str | None = None  # why the step cannot be read, once exited
        self._owned = False
        self._start: _Counters | None = None
        self._marks: list[tuple[str, _Counters]] = []
        self._segments: list[tuple[str, int, int]] = []  # (mark, bytes allocated at it, peak until the next)
        self._running = False

    def __enter__(self) -> AllocatorHistory:
        backend = torch.cuda.memory.get_allocator_backend()
        if backend != "native":
            self.problem = (f"the CUDA allocator backend is {backend!r}, which keeps no memory history "
                            "(the default backend, 'native', does)")
            return self
        self._owned = not _history_enabled()
        if self._owned:
            _start_recording()
        self._running = True
        self._start = _counters(self.index)
        return self

    def plan_mark(self, name: str) -> None:
        """Mark ``name`` now (a segment of the step begins)."""
        if self._running:
            self._marks.append((name, _counters(self.index)))

    def __exit__(self, *exc: Any) -> None:
        if self._running:
            self._running = False
            self._stop()
        listeners, self.on_exit = self.on_exit, []
        for fn in listeners:
            fn(self)

    def _stop(self) -> None:
        try:
            end = _counters(self.index)
            snapshot = torch.cuda.memory._snapshot()
            after = _counters(self.index)
        finally:
            if self._owned:
                _stop_recording()
        traces = snapshot.get("device_traces") or []
        trace = traces[self.index] if self.index < len(traces) else []
        self._read(end, after, trace)

    def _read(self, end: _Counters, after: _Counters, trace: list[dict]) -> None:
        start = self._start
        n = end.ops - start.ops
        entries = [e for e in trace if e.get("action") in _KEPT]
        if after.ops != end.ops:
            self.problem = "another thread allocated while the step's memory history was read"
        elif n < 0 or any(c.ops < start.ops or c.ops > end.ops for _, c in self._marks):
            self.problem = "the allocator's counters were reset during the step"
        elif len(entries) < n:
            self.problem = (f"the allocator's memory history kept {len(entries)} of the step's {n} allocations and "
                            "frees (a recording by someone else with fewer entries, or skipping them)")
        if self.problem is not None:
            return
        steps = [(+1 if e["action"] == "alloc" else -1) * _rounded(int(e.get("size", 0)))
                 for e in entries[len(entries) - n:]]
        bounds = self._marks + [("", end)]
        segments = []
        for (name, c), (_, nxt) in zip(bounds, bounds[1:]):
            live = peak = c.allocated
            for delta in steps[c.ops - start.ops:nxt.ops - start.ops]:
                live += delta
                if live > peak:
                    peak = live
            peak = max(peak, nxt.allocated)
            if nxt.peak > c.peak:  # the statistic rose in this segment: its peak, exactly
                peak = nxt.peak
            elif nxt.peak == c.peak:  # it did not (and was not reset): at most its value
                peak = min(peak, c.peak)
            segments.append((name, c.allocated, peak))
        self._segments = segments

    def spans(self, names: list[str]) -> dict[str, tuple[int, int]]:
        """``{name: (bytes allocated at its mark, peak bytes until the next of
        ``names``' marks)}`` (the last one runs to the end); a name marked twice keeps
        its first mark. Empty if the step could not be read (``problem``)."""
        wanted = set(names)
        out: dict[str, tuple[int, int]] = {}
        current: str | None = None
        for name, allocated, peak in self._segments:
            if name in wanted and name not in out:
                current = name
                out[name] = (allocated, peak)
            elif current is not None:
                at, top = out[current]
                out[current] = (at, max(top, peak))
        return out
