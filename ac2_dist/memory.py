"""Per-rank memory reports: what each rank saved, recomputed and peaked at.

::

    with ac.memory.track(model) as tracker:
        loss = model(x).sum(); loss.backward()
    report = tracker.report()              # this rank
    reports = ac.memory.gather(report)     # list on rank 0, None elsewhere
    print(ac.memory.format_table(reports))

Figures come from real accounting: the allocator's own events (torch.profiler memory
events, replayed in time order: _alloc.py), the same on CPU and CUDA, for the device
the tracked model (or its regions) computes on: the device of its tensors, not the
current CUDA device. Tracking reads no allocator statistic and resets none: a
user's ``torch.cuda.max_memory_allocated()`` around a tracked step reads the step's
peak as it would untracked. What ac2 holds after forward is read from the regions'
graphs (unique storages, parameters excluded): bytes on the device, and offloaded
values resident in host memory apart. Nothing is installed while no tracker is active.

This module tracks a step (:class:`Tracker`); the report it makes and what reads it
live beside it and are importable from here: :class:`RankReport` (_rank_report.py),
:func:`gather` and the run files (_run_file.py), :func:`format_table` and
:func:`plot` (_report_table.py); what ac2 holds after forward is counted in _held.py.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn

from ._device import module_cuda_device
from ._measure._alloc import AllocationTrace, active_trace
from ._measure._rank_report import _FIELD_CHECKS, SCHEMA_VERSION, RankReport  # noqa: F401  (re-exported: memory.RankReport, memory.SCHEMA_VERSION)
from ._measure._report_table import format_table, plot
from ._measure._run_file import _gather_json, gather, load_run, run_warnings, save_run  # noqa: F401  (_gather_json: launch/bench.py)
from ._pipelining import pipeline_microbatch as _pipeline_microbatch
from ._region import _thread_state
from ._trace._graph import Graph
from ._trace._graph_stats import GraphStats
from ._trace._held import _held_bytes, _storage_key

__all__ = ["RankReport", "Tracker", "track", "gather", "format_table", "plot", "save_run", "load_run", "run_warnings"]

_ALLGATHER_EVENTS = frozenset({"c10d::_allgather_base_", "_c10d_functional::all_gather_into_tensor"})


class _Span:
    """One phase of a step (forward or backward) between two marks of the trace."""

    __slots__ = ("kind", "step", "start", "peak", "end", "calls")

    def __init__(self, kind: str, step: int) -> None:
        self.kind = kind  # "forward" or "backward"
        self.step = step  # 0: not part of any step (a step restarted by Tracker.step())
        self.start = self.peak = self.end = 0  # bytes: when it began, highest, when it ended
        self.calls = 0  # all-gathers that started in it


class _Forward:
    """A tracked forward whose output has a ``grad_fn``: in flight until a backward
    through its output ends (a pre-hook on the output's ``grad_fn`` queues an engine
    callback for the end of that backward call) or its autograd graph is freed (the
    graph's nodes hold this object through the pre-hook: it dies with them, and leaves
    the tracker's WeakSet of forwards in flight)."""

    __slots__ = ("tracker", "handles", "fired", "__weakref__")

    def __init__(self, tracker: Tracker) -> None:
        self.tracker: Tracker | None = tracker
        self.handles: list[Any] = []
        self.fired = False

    def __call__(self, grad_outputs: Any) -> None:  # pre-hook of an output's grad_fn
        if not self.fired and self.tracker is not None:
            self.fired = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        tracker = self.tracker
        if tracker is not None:
            tracker._pending.discard(self)


def _output_grad_fns(output: Any) -> list[Any]:
    """The distinct ``grad_fn`` of the tensors in a forward's output (tensors, lists,
    tuples and mappings, e.g. a ``ModelOutput``, at any depth)."""
    fns: dict[int, Any] = {}
    seen: set[int] = set()  # containers already walked (a structure may share or contain itself)
    stack = [output]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            fn = o.grad_fn
            if fn is not None:
                fns[id(fn)] = fn
        elif isinstance(o, (list, tuple, Mapping)) and id(o) not in seen:
            seen.add(id(o))
            stack.extend(o.values() if isinstance(o, Mapping) else o)
    return list(fns.values())


class _Graphs:
    """A live view of the graphs a tracker recorded, in order; held weakly (Note [The
    tracker keeps no graph alive]), so it yields those still alive."""

    __slots__ = ("_refs",)

    def __init__(self, refs: list[weakref.ref[Graph]]) -> None:
        self._refs = refs

    def _live(self) -> list[Graph]:
        return [g for g in (r() for r in self._refs) if g is not None]

    def __iter__(self) -> Iterator[Graph]:
        return iter(self._live())

    def __len__(self) -> int:
        return len(self._live())

    def __getitem__(self, index: Any) -> Any:
        return self._live()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, _Graphs)):
            return self._live() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<{len(self)} live of {len(self._refs)} recorded graphs>"


class Tracker:
    """Collects one rank's figures while active; see :func:`track`.

    ``graphs`` is a live view of the regions' graphs recorded so far that are still
    alive (the tracker holds them weakly); ``graph_stats`` has every recorded graph's
    :class:`~ac2_dist.GraphStats`, dead or alive. :meth:`step` starts a step by hand.
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(
                f"ac2_dist.memory.track(model): model must be a torch.nn.Module or None, got "
                f"{type(model).__name__}; pass the model itself (for several models, track their "
                "common parent module, or call track() without a model)"
            )
        self.model = model
        # Note [The tracker keeps no graph alive]: a graph holds what backward needs
        # (saved values, RNG chains and their nodes); a strong reference kept every
        # region's graph of every tracked step alive until the tracker died, so memory
        # grew step over step and backward peaked higher than untracked. The tracker
        # keeps weak references and each graph's GraphStats (counters, no tensors); the
        # bytes ac2 holds are read from the live graphs when a forward ends.
        self._graph_refs: list[weakref.ref[Graph]] = []
        self._stats: list[GraphStats] = []
        self._peak_planners: dict[str, Any] = {}  # fqn -> the PeakPlanner of a MemoryBudget(peak=...)
        self._trace: AllocationTrace | None = None
        self._hooks: list[Any] = []
        self._report = RankReport()
        self._param_storages: set[int] = set()
        # Note [The device comes from the tensors] (_device.py): the model's parameters and
        # buffers; without a model (or one without tensors), the regions it sees (None:
        # decided when the tracker exits).
        self._device: str | None = None
        if model is not None:
            cuda = module_cuda_device(model)
            if cuda is not None or any(True for _ in model.parameters()) or any(True for _ in model.buffers()):
                self._device = "cpu" if cuda is None else "cuda"
        self._regions_on_cuda = False  # a region it saw computed on CUDA
        self._used = False
        # Steps and phases (Note [Steps and phases]).
        self._spans: list[_Span] = []
        self._phase: str | None = None
        self._auto = True  # off once step() was called
        self._step_has_work = False
        self._pending: weakref.WeakSet[_Forward] = weakref.WeakSet()  # forwards in flight, this step
        self._forwards: weakref.WeakSet[_Forward] = weakref.WeakSet()  # every one with hooks installed
        self._microbatches: set[tuple[int, int]] = set()  # pipeline (stage, microbatch) seen this step
        self._last_microbatch: tuple[int, int] | None = None
        self._step_first_graph = 0  # index in _graph_refs of the current step's first graph

    @property
    def graphs(self) -> _Graphs:
        """The regions' graphs recorded so far that are still alive, in order."""
        return _Graphs(self._graph_refs)

    @property
    def graph_stats(self) -> list[GraphStats]:
        """Every recorded region's :class:`~ac2_dist.GraphStats`, in order."""
        return list(self._stats)

    # ---- lifecycle ----------------------------------------------------------------
    def __enter__(self) -> Tracker:
        st = _thread_state()
        if self._used:
            raise RuntimeError("ac2_dist.memory.track: a Tracker is single-use; call track() again")
        if st.tracker is not None:
            raise RuntimeError("ac2_dist.memory.track: a tracker is already active on this thread")
        running = active_trace()
        if running is not None and running.preempt is not None:  # a MemoryBudget(peak=...) measuring
            running.preempt()  # Note [One trace, two readers] (_alloc.py)
        if torch._C._autograd._profiler_enabled():
            raise RuntimeError(
                "ac2_dist.memory.track reads allocations and all-gathers from torch.profiler and "
                "cannot run inside another profiler session (it would end yours); track outside "
                "the profiler, or read memory from your own profile"
            )
        self._used = True
        # Note [Tracker start is all or nothing]: from here on every step changes thread
        # or model state (the thread's tracker, hooks on the model, a profiler session);
        # if any step fails, _release() undoes the ones done, so a failed start leaves
        # no dead tracker behind (regions would feed it, and every later track() would
        # say "already active").
        st.tracker = self
        try:
            self._start()
        except BaseException:
            self._release()
            raise
        return self

    def _start(self) -> None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            self._report.rank, self._report.world_size = dist.get_rank(), dist.get_world_size()
        if self.model is not None:
            self._param_storages = {_storage_key(p) for p in self.model.parameters()}
            # prepend: run before FSDP's root pre-forward, whose all-gather belongs to
            # this step's forward, not the previous step's backward.
            self._hooks.append(self.model.register_forward_pre_hook(self._on_forward, prepend=True))
            self._hooks.append(self.model.register_forward_hook(self._on_forward_end))
        # Which device's allocations count is settled when the trace exits (_release).
        trace = AllocationTrace(device_type=self._device or "cpu", watch=_ALLGATHER_EVENTS)
        trace.__enter__()  # fails if another profiler is running
        self._trace = trace
        if self.model is None:
            self._open("forward", new_step=True)

    def _release(self) -> AllocationTrace | None:
        """Detach from the thread, the model, the forwards in flight and the regions'
        graphs; stop the profiler session if one was started and return its trace
        (``None`` if none was)."""
        st = _thread_state()
        if st.tracker is self:
            st.tracker = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for fwd in list(self._forwards):  # no hook is left on outputs still alive
            fwd.tracker = None
            for h in fwd.handles:
                h.remove()
        self._forwards = weakref.WeakSet()
        self._pending = weakref.WeakSet()
        for g in self.graphs:  # a replay after the block must not call back into us
            if g.tracker is self:
                g.tracker = None
        trace, self._trace = self._trace, None
        if self._device is None:
            self._device = "cuda" if self._regions_on_cuda else "cpu"
        self._report.device = self._device
        if trace is not None:
            trace.device_type = self._device
            trace.__exit__(None, None, None)
        return trace

    def __exit__(self, *exc: Any) -> None:
        trace = self._release()
        if trace is not None:
            self._finish(trace)

    # ---- steps and phases ---------------------------------------------------------
    # Note [Steps and phases]: a step is a run of forward and backward phases (they
    # interleave under pipeline schedules: 1F1B runs F0 F1 B0 F2 B1 ...); its figures
    # are above the bytes allocated when it began. Each phase is a span of the trace
    # (its mark is the span's index), on CPU and CUDA alike: no allocator statistic is
    # read or reset. With a model, its forward is a forward phase and
    # everything after it returns (loss, sends, backward) a backward phase; without,
    # a forward phase runs from a region's start to the first replay. Unless step()
    # was called, a new step starts at a forward (with a model) or at a region after a
    # backward (without) when no forward of the current step is still in flight:
    # with a model, one that returned an output with a grad_fn whose backward has not
    # ended and whose autograd graph is alive; without, a live graph with a handle no
    # backward has read yet. Inside a torch.distributed.pipelining stage forward, the
    # (stage, microbatch) pair decides instead (Note [Pipeline steps] in _pipelining.py).

    def step(self) -> None:
        """Start a new step now; from then on only calls to ``step()`` start steps
        (automatic detection is off). Call it where each iteration begins, e.g. before
        ``schedule.step(...)`` or the forward. A current step in which nothing ran yet
        starts again now instead (no empty step is counted)."""
        if self._trace is None:
            raise RuntimeError("ac2_dist.memory.Tracker.step() can only be called while the tracker is active "
                               "(inside its with-block)")
        self._auto = False
        if self._report.steps > 0 and not self._step_has_work:
            for span in self._spans:
                if span.step == self._report.steps:
                    span.step = 0
            self._report.steps -= 1
        self._open("forward", new_step=True)

    def _open(self, kind: str, new_step: bool = False) -> None:
        """Start a phase (and, with ``new_step``, a step) now."""
        r = self._report
        if new_step:
            r.steps += 1
            self._step_has_work = False
            self._pending = weakref.WeakSet()
            self._microbatches = set()
            self._step_first_graph = len(self._graph_refs)
        span = _Span(kind, r.steps)
        self._spans.append(span)
        self._phase = kind
        self._trace.mark(str(len(self._spans) - 1))

    def _region_device(self, device: torch.device | None) -> None:
        """A region it saw decided its device (Note [The device comes from the tensors])."""
        if device is not None and device.type == "cuda":
            self._regions_on_cuda = True

    def _on_forward(self, *args: Any) -> None:
        """The model's forward starts."""
        if self._trace is None:
            return
        new_step = self._report.steps == 0
        microbatch = None
        if self._auto:
            microbatch = _pipeline_microbatch()
            if microbatch is not None:
                new_step = new_step or microbatch in self._microbatches
            else:
                new_step = new_step or not self._pending
        self._open("forward", new_step)
        if microbatch is not None:
            self._microbatches.add(microbatch)
        self._step_has_work = True

    def _on_forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        # The backward phase starts when the model's forward returns: hooks on the
        # output's gradient would fire after FSDP's own pre-backward hooks, which
        # already issue (prefetch) all-gathers.
        if self._trace is None:
            return
        self._snapshot_saved()
        if self._auto:
            fns = _output_grad_fns(output)
            if fns:
                fwd = _Forward(self)
                fwd.handles = [fn.register_prehook(fwd) for fn in fns]
                self._pending.add(fwd)
                self._forwards.add(fwd)
        self._open("backward")

    def _on_unpack(self) -> None:
        """A replay (or prefetch): without a model, the first one ends a forward phase."""
        if self._phase == "forward" and self.model is None and self._trace is not None:
            self._snapshot_saved()
            self._last_microbatch = None
            self._open("backward")
            self._step_has_work = True

    def _add_graph(self, graph: Graph) -> None:
        self._graph_refs.append(weakref.ref(graph))
        self._stats.append(graph.stats)
        if self.model is not None or self._trace is None:
            return
        new_step = False
        microbatch = None
        if self._auto:
            microbatch = _pipeline_microbatch()
            if microbatch is not None:
                new_step = microbatch != self._last_microbatch and microbatch in self._microbatches
            elif self._phase == "backward":
                new_step = not self._graphs_in_flight()
        if new_step or self._phase == "backward":
            self._open("forward", new_step)
        if microbatch is not None:
            self._microbatches.add(microbatch)
            self._last_microbatch = microbatch
        self._step_has_work = True

    def _graphs_in_flight(self) -> bool:
        """Whether a graph of the current step (before the one just added) is alive
        with a handle that no backward has read yet."""
        for ref in self._graph_refs[self._step_first_graph:-1]:
            g = ref()
            if g is not None and any(h.consumed_task is None or h.taken < h.count for h in list(g.handles)):
                return True
        return False

    def _note_plan(self, fqn: str, plan: Any) -> None:
        """A :class:`ac2_dist.MemoryBudget` plan that a region of ``fqn`` follows (or made)."""
        entry = self._report.per_module.setdefault(fqn, {"saved_bytes": 0, "recomputed_bytes": 0})
        entry["budget_bytes"] = plan.budget_bytes
        entry["plan_saved_bytes"] = plan.saved_bytes
        entry["plan_recompute_us"] = round(plan.recompute_seconds * 1e6)
        if getattr(plan, "peak", None) is not None:  # a peak target: its figures are read at exit
            self._peak_planners[fqn] = plan.peak

    def _snapshot_saved(self) -> None:
        by_reason, by_module, host, host_by_module = _held_bytes(self.graphs, self._param_storages)
        total = sum(by_reason.values())
        r = self._report
        if (total, host) >= (r.saved_bytes, r.saved_host_bytes):  # the largest step (device bytes first)
            r.saved_bytes, r.saved_bytes_by_reason, r.saved_host_bytes = total, by_reason, host
            for entry in r.per_module.values():
                entry["saved_bytes"] = 0
                entry.pop("saved_host_bytes", None)
            for fqn, nbytes in by_module.items():
                r.per_module.setdefault(fqn, {"saved_bytes": 0, "recomputed_bytes": 0})["saved_bytes"] = nbytes
            for fqn, nbytes in host_by_module.items():
                r.per_module.setdefault(fqn, {"saved_bytes": 0, "recomputed_bytes": 0})["saved_host_bytes"] = nbytes

    def _finish(self, trace: AllocationTrace) -> None:
        r = self._report
        segments = {int(name): phase for name, phase in trace.segments if name.isdigit()}
        bases: dict[int, int] = {}
        for k, span in enumerate(self._spans):
            phase = segments.get(k)
            if phase is not None:
                span.calls = phase.calls
                span.start, span.peak, span.end = phase.start_bytes, phase.peak_bytes, phase.end_bytes
            if span.step == 0:
                continue
            base = bases.setdefault(span.step, span.start)  # allocated when the step began
            if span.kind == "forward":
                r.peak_bytes_forward = max(r.peak_bytes_forward, span.peak - base)
                r.live_bytes_after_forward = max(r.live_bytes_after_forward, span.end - base)
            else:
                r.peak_bytes_backward = max(r.peak_bytes_backward, span.peak - base)
                r.allgathers_backward += span.calls
        for s in self._stats:
            r.recomputed_ops += s.recomputed_ops
            r.recomputed_bytes += s.recomputed_bytes
            r.replay_seconds += s.replay_seconds
            r.collectives_not_replayed += s.collectives
            for fqn, nbytes in s.recomputed_by_module.items():
                r.per_module.setdefault(fqn, {"saved_bytes": 0, "recomputed_bytes": 0})["recomputed_bytes"] += nbytes
        for fqn, planner in self._peak_planners.items():  # MemoryBudget(peak=...): target, predicted, measured
            entry = r.per_module.setdefault(fqn, {"saved_bytes": 0, "recomputed_bytes": 0})
            entry["peak_target_bytes"] = planner.target
            if planner.predicted is not None:
                entry["peak_predicted_bytes"] = planner.predicted
            if planner.last_seen is not None:
                entry["peak_measured_bytes"] = planner.last_seen

    def report(self) -> RankReport:
        """This rank's :class:`RankReport` (complete once the ``with`` block exited)."""
        return self._report


def track(model: nn.Module | None = None) -> Tracker:
    """Track memory over one or more steps on this rank (a context manager).

    A step is one training iteration: its forward and backward phases (interleaved
    under a pipeline schedule), with figures above what was allocated when it began.
    With ``model``, forward and backward are told apart by hooks on it: its forward is
    a forward phase and everything after it returns (loss, backward) a backward phase.
    Without, a forward phase runs from a region's start to its first replay.

    A new step starts at a forward (without a model: at a region after a backward) when
    no forward of the current step is in flight, i.e. still waiting for its backward, so
    forwards differentiated later make one step with the first (GPipe's microbatches,
    several losses summed before one backward), while each forward-backward pair of
    plain training is a step. A forward is in flight from its return (if its output has
    a ``grad_fn``; never under ``torch.no_grad()``) until a backward through its output
    ends or its autograd graph is freed: an output kept with grad enabled and never
    differentiated keeps it in flight. Under a ``torch.distributed.pipelining``
    schedule, the microbatch index decides instead: a forward of a microbatch that this
    stage already ran in the current step starts the next step (so 1F1B's last stage,
    which finishes each microbatch before the next, also reports one step per schedule
    step). Elsewhere (gradient accumulation, another pipeline framework), call
    :meth:`Tracker.step` at the start of each iteration: steps are then set by hand only.

    Example::

        import torch
        import ac2_dist as ac

        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        ac.apply_ac(model, "recompute_all")
        with ac.memory.track(model) as tracker:
            model(torch.randn(32, 64)).sum().backward()
        print(ac.memory.format_table(tracker.report()))   # under torchrun: memory.gather(...) first
    """
    return Tracker(model)


