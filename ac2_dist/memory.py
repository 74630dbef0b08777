"""Per-rank memory reports: what each rank saved, recomputed and peaked at.

::

    with ac.memory.track(model) as tracker:
        loss = model(x).sum(); loss.backward()
    report = tracker.report()              # this rank
    reports = ac.memory.gather(report)     # list on rank 0, None elsewhere
    print(ac.memory.format_table(reports))

Figures come from real accounting: the allocator's own events (torch.profiler memory
events, replayed in time order: _alloc.py), the same on CPU and CUDA, for the device
the tracked model (or its regions) computes on (Note [The device comes from the
tensors] in _device.py). Tracking reads no allocator statistic and resets none: a
user's ``torch.cuda.max_memory_allocated()`` around a tracked step reads the step's
peak as it would untracked. What ac2 holds after forward is read from the regions'
graphs (unique storages, parameters excluded): bytes on the device, and offloaded
values resident in host memory apart. Nothing is installed while no tracker is active.
"""

from __future__ import annotations

import json
import os
import warnings
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.nn as nn

from ._alloc import AllocationTrace, active_trace
from ._device import module_cuda_device
from ._graph import Graph
from ._graph_stats import GraphStats
from ._nodes import REASONS, Node
from ._pipelining import pipeline_microbatch as _pipeline_microbatch
from ._region import _thread_state
from ._sizes import human_bytes as _human_bytes

__all__ = ["RankReport", "Tracker", "track", "gather", "format_table", "plot", "save_run", "load_run", "run_warnings"]

SCHEMA_VERSION = 1
_ALLGATHER_EVENTS = frozenset({"c10d::_allgather_base_", "_c10d_functional::all_gather_into_tensor"})


@dataclass
class RankReport:
    """One rank's figures; bytes are ints. ``to_dict()`` is JSON-safe.

    Peaks are the most bytes allocated at any moment of a step's forward (backward)
    phases, above what was allocated when that step began (largest step reported);
    ``live_bytes_after_forward`` is the most allocated, above the same base, when one of
    its forward phases ended (with several microbatches in flight, all of them).
    A step is found as :func:`track` says (or set by :meth:`Tracker.step`).
    ``saved_bytes`` (and its split by reason) is what ac2 holds for backward in the
    device's memory after forward; ``saved_host_bytes`` what it holds in host memory
    (offloaded values whose host copy is the one kept), not device bytes.
    """

    rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    steps: int = 0
    peak_bytes_forward: int = 0
    peak_bytes_backward: int = 0
    live_bytes_after_forward: int = 0  # everything still allocated when forward returned
    saved_bytes: int = 0
    saved_bytes_by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    saved_host_bytes: int = 0  # offloaded values held in host memory after forward
    recomputed_ops: int = 0
    recomputed_bytes: int = 0
    replay_seconds: float = 0.0
    collectives_not_replayed: int = 0
    allgathers_backward: int = 0
    per_module: dict[str, dict[str, int]] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> RankReport:
        """Rebuild a report from :meth:`to_dict`'s output (e.g. one entry of a run file).

        Raises ValueError naming the first field that is missing or has the wrong type.
        Every key of schema 1's first release is required; ``steps``,
        ``live_bytes_after_forward`` and ``saved_host_bytes`` (added later in schema 1)
        default to 0; unknown keys are ignored.
        """
        if not isinstance(d, dict):
            raise ValueError(f"a rank report must be a JSON object (dict), got {_describe(d)}")
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(
                f"report schema_version {version!r} is not supported (expected "
                f"{SCHEMA_VERSION}); re-run with a matching ac2_dist version"
            )
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ValueError(f"report is missing field(s) {', '.join(missing)}")
        values: dict[str, Any] = {}
        for name, check in _FIELD_CHECKS.items():
            if name in d:
                values[name] = check(name, d[name])
        return cls(**values)


def _describe(value: Any) -> str:
    """A short, one-line description of a JSON value for error messages."""
    if value is None:
        return "null"
    kind = _JSON_NAMES.get(type(value), type(value).__name__)
    text = repr(value)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"


_JSON_NAMES = MappingProxyType({dict: "object", list: "list", str: "string", bool: "boolean",
                                int: "integer", float: "number"})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise ValueError(f"field {name} must be an integer, got {_describe(value)}")
    return value


def _check_rank(name: str, value: Any) -> int:
    if _check_int(name, value) < 0:
        raise ValueError(f"field {name} must be >= 0, got {value}")
    return value


def _check_world_size(name: str, value: Any) -> int:
    if _check_int(name, value) < 1:
        raise ValueError(f"field {name} must be >= 1, got {value}")
    return value


def _check_float(name: str, value: Any) -> float:
    if not (_is_int(value) or isinstance(value, float)):
        raise ValueError(f"field {name} must be a number, got {_describe(value)}")
    return float(value)


def _check_str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"field {name} must be a string, got {_describe(value)}")
    return value


def _check_int_map(name: str, value: Any) -> dict[str, int]:
    if not isinstance(value, dict):
        raise ValueError(f"field {name} must be an object of integers, got {_describe(value)}")
    for key, v in value.items():
        if not _is_int(v):
            raise ValueError(f"field {name}[{key!r}] must be an integer, got {_describe(v)}")
    return dict(value)


def _check_per_module(name: str, value: Any) -> dict[str, dict[str, int]]:
    if not isinstance(value, dict):
        raise ValueError(f"field {name} must be an object {{fqn: {{...}}}}, got {_describe(value)}")
    return {fqn: _check_int_map(f"{name}[{fqn!r}]", entry) for fqn, entry in value.items()}


# Note [Run-file validation]: every field of RankReport has a checker here (a test
# keeps the two in sync), so a report read back has the types format_table/plot use;
# a bad file fails in from_dict with the field's name instead of deep inside rendering.
_FIELD_CHECKS = MappingProxyType({
    "rank": _check_rank,
    "world_size": _check_world_size,
    "device": _check_str,
    "steps": _check_int,
    "peak_bytes_forward": _check_int,
    "peak_bytes_backward": _check_int,
    "live_bytes_after_forward": _check_int,
    "saved_bytes": _check_int,
    "saved_bytes_by_reason": _check_int_map,
    "saved_host_bytes": _check_int,
    "recomputed_ops": _check_int,
    "recomputed_bytes": _check_int,
    "replay_seconds": _check_float,
    "collectives_not_replayed": _check_int,
    "allgathers_backward": _check_int,
    "per_module": _check_per_module,
    "schema_version": _check_int,
})
_OPTIONAL = frozenset({"steps", "live_bytes_after_forward", "saved_host_bytes"})  # added within schema 1
_REQUIRED = tuple(k for k in _FIELD_CHECKS if k not in _OPTIONAL)


def _host_resident(s: Any, t: torch.Tensor) -> bool:
    """Whether saved value ``s``, held as ``t``, is kept in host memory for a value
    computed elsewhere (an offloaded value's host copy), not in the device's memory."""
    if s.offloaded:  # the offload schedule: the device tensor until committed, then the host copy
        return s.value.device is None
    if s.device is not None:  # a synchronous copy to the CPU (no schedule)
        return True
    home = s.meta[2] if s.hooks is not None and s.meta is not None else None  # SAVE_WITH_HOOKS
    return home is not None and home.type != "cpu" and t.device.type == "cpu"


def _held_bytes(graphs: Iterable[Graph], params: set[int]) -> tuple[dict[str, int], dict[str, int], int,
                                                                     dict[str, int]]:
    """Bytes of unique storages ac2 holds for backward in the device's memory, by reason
    and by module, and in host memory (offloaded values), in all and by module."""
    seen: set[int] = set()
    by_reason = dict.fromkeys(REASONS, 0)
    by_module: dict[str, int] = {}
    host = 0
    host_by_module: dict[str, int] = {}
    visited: set[int] = set()
    for graph in graphs:
        stack: list[Node] = [h.node for h in list(graph.handles)]
        while stack:
            node = stack.pop()
            if id(node) in visited:
                continue
            visited.add(id(node))
            stack.extend(node.inputs[1::3])  # Note [Node inputs are one flat tuple] (_nodes.py)
            for s in node.saved or ():
                # An offloaded value occupies its device tensor or its host copy (offload.py).
                t = s.value.held() if s is not None and s.offloaded else getattr(s, "value", None)
                if not isinstance(t, torch.Tensor):
                    continue
                if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or node.fsdp_unit is not None:
                    continue  # parameters (and views of them) are not activations
                try:
                    storage = t.untyped_storage()
                    key, nbytes = storage.data_ptr(), storage.nbytes()
                except (RuntimeError, NotImplementedError):  # subclasses without storage
                    key, nbytes = id(t), s.nbytes
                if key in params or key in seen or nbytes == 0:
                    continue
                seen.add(key)
                if _host_resident(s, t):
                    host += nbytes
                    host_by_module[node.fqn] = host_by_module.get(node.fqn, 0) + nbytes
                    continue
                by_reason[s.reason] += nbytes
                by_module[node.fqn] = by_module.get(node.fqn, 0) + nbytes
    return by_reason, by_module, host, host_by_module


def _storage_key(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # DTensor (FSDP2's sharded params)
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(t)


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
    """
    return Tracker(model)


def gather(report: RankReport) -> list[RankReport] | None:
    """Collect every rank's report on rank 0 (a collective); ``None`` elsewhere.

    Call it on every rank. Without an initialized process group it returns ``[report]``.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return [report]
    dicts = _gather_json(report.to_dict())
    return None if dicts is None else [RankReport.from_dict(d) for d in dicts]


def _gather_json(obj: Any, dst: int = 0) -> list[Any] | None:
    """Gather a JSON-serializable ``obj`` from every rank onto rank ``dst`` (a collective).

    Returns the decoded objects by rank on ``dst`` and ``None`` elsewhere; without an
    initialized process group, ``[obj]`` (JSON round-tripped, as on the collective path).
    """
    # Note [Gather without numpy]: dist.gather_object pickles into a tensor and reads
    # it back with tensor.numpy(), which fails with "Numpy is not available" when numpy
    # is not installed (torch does not depend on it). Here the payload is JSON bytes in
    # a uint8 tensor (torch.frombuffer / tolist need no numpy): all_gather the sizes,
    # then gather the bytes padded to the longest (gloo and nccl both support gather).
    payload = json.dumps(obj).encode()
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return [json.loads(payload)]
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    padded = padded.to(device)
    out = [torch.empty_like(padded) for _ in range(world)] if rank == dst else None
    dist.gather(padded, out, dst=dst)
    if out is None:
        return None
    return [json.loads(bytes(t[:n].cpu().tolist())) for t, n in zip(out, lengths)]


def save_run(reports: list[RankReport], path: str) -> None:
    """Write ``{"schema_version": ..., "ranks": [...]}`` to ``path``."""
    with open(path, "w") as f:
        json.dump({"schema_version": SCHEMA_VERSION, "ranks": [r.to_dict() for r in reports]}, f, indent=1)


def load_run(path: str) -> list[RankReport]:
    """Read a file written by :func:`save_run`.

    Raises OSError if it cannot be read and ValueError (one line naming the file and
    what is wrong) if it is not a valid run file. Files that are valid but look
    inconsistent (duplicate or out-of-range ranks, mixed world sizes, no ranks) load,
    with a :class:`UserWarning` per problem (see :func:`run_warnings`).
    """
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, too deep
        raise ValueError(f"{path} is not JSON ({e}); expected a file written by ac2_dist.memory.save_run") from None
    if not isinstance(data, dict) or not isinstance(data.get("ranks"), list):
        raise ValueError(
            f"{path} is not a run file: expected an object {{\"schema_version\": {SCHEMA_VERSION}, "
            f"\"ranks\": [...]}}, got {_describe(data)}"
        )
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"{path} has schema_version {data.get('schema_version')!r}, expected {SCHEMA_VERSION}; "
            "read it with the ac2_dist version that wrote it"
        )
    reports = []
    for i, entry in enumerate(data["ranks"]):
        try:
            reports.append(RankReport.from_dict(entry))
        except ValueError as e:
            raise ValueError(f"{path}: ranks[{i}]: {e}") from None
    for problem in run_warnings(reports):
        warnings.warn(f"{path}: {problem}", UserWarning, stacklevel=2)
    return reports


def run_warnings(reports: list[RankReport]) -> list[str]:
    """Inconsistencies in a set of rank reports that still render (one line each):
    no reports, mixed world sizes, ranks outside ``[0, world_size)``, duplicate ranks."""
    if not reports:
        return ["no rank reports"]
    problems = []
    sizes = sorted({r.world_size for r in reports})
    if len(sizes) > 1:
        problems.append(f"mixed world sizes {sizes} (reports from different jobs?)")
    outside = sorted({r.rank for r in reports if r.rank >= r.world_size})
    if outside:
        problems.append(f"rank(s) {outside} not below world_size ({', '.join(map(str, sizes))})")
    counts = Counter(r.rank for r in reports)
    dup = sorted(rank for rank, n in counts.items() if n > 1)
    if dup:
        problems.append(f"duplicate rank(s) {dup}")
    return problems


_ROWS = [
    ("peak forward", "peak_bytes_forward", _human_bytes),
    ("peak backward", "peak_bytes_backward", _human_bytes),
    ("live after forward", "live_bytes_after_forward", _human_bytes),
    ("saved after forward", "saved_bytes", _human_bytes),
    *[(f"  saved: {reason}", f"saved_bytes_by_reason.{reason}", _human_bytes) for reason in REASONS],
    ("saved in host memory", "saved_host_bytes", _human_bytes),
    ("recomputed ops", "recomputed_ops", lambda v: f"{v:.0f}"),
    ("recomputed", "recomputed_bytes", _human_bytes),
    ("replay time", "replay_seconds", lambda v: f"{v * 1e3:.1f} ms"),
    ("collectives not replayed", "collectives_not_replayed", lambda v: f"{v:.0f}"),
    ("all-gathers in backward", "allgathers_backward", lambda v: f"{v:.0f}"),
]


def _value(r: RankReport, key: str) -> float:
    if "." in key:
        a, b = key.split(".")
        return getattr(r, a).get(b, 0)
    return getattr(r, key)


def format_table(reports: list[RankReport] | None) -> str:
    """A rank x metric table with min / max / imbalance (max / mean) columns."""
    if not reports:
        return "(no reports)"
    reports = sorted(reports, key=lambda r: r.rank)
    header = ["metric"] + [f"rank {r.rank}" for r in reports] + ["min", "max", "imbalance"]
    rows = [header]
    for label, key, fmt in _ROWS:
        vals = [_value(r, key) for r in reports]
        mean = sum(vals) / len(vals)
        imbalance = f"{max(vals) / mean:.2f}x" if mean else "-"
        rows.append([label] + [fmt(v) for v in vals] + [fmt(min(vals)), fmt(max(vals)), imbalance])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    modules = sorted({fqn for r in reports for fqn in r.per_module})
    if modules:
        lines.append("")
        lines.append("per module (saved / recomputed), by rank:")
        for fqn in modules:
            cells = []
            for r in reports:
                m = r.per_module.get(fqn, {})
                cell = f"{_human_bytes(m.get('saved_bytes', 0))} / {_human_bytes(m.get('recomputed_bytes', 0))}"
                if m.get("saved_host_bytes"):  # offloaded values kept in host memory
                    cell += f" (+{_human_bytes(m['saved_host_bytes'])} in host memory)"
                if "budget_bytes" in m:  # an ac2_dist.MemoryBudget plan
                    cell += (f" (budget {_human_bytes(m['budget_bytes'])}, plan saves "
                             f"{_human_bytes(m['plan_saved_bytes'])}, est. recompute "
                             f"{m['plan_recompute_us'] / 1e3:.2f} ms)")
                if "peak_target_bytes" in m:  # a MemoryBudget(peak=...): the step's figures
                    cell += (f" [step peak target {_human_bytes(m['peak_target_bytes'])}, predicted "
                             f"{_human_bytes(m.get('peak_predicted_bytes', 0)) if 'peak_predicted_bytes' in m else '-'}"
                             f", measured {_human_bytes(m['peak_measured_bytes']) if 'peak_measured_bytes' in m else '-'}]")
                cells.append(cell)
            lines.append(f"  {fqn or '(region)'}: " + " | ".join(cells))
    return "\n".join(lines)


def plot(reports: list[RankReport], path: str | os.PathLike[str]) -> None:
    """Write a PNG: per-rank bars of saved / recomputed / peak, and a per-module breakdown.

    Needs matplotlib (``pip install 'ac2-dist[plot]'``). Raises ValueError unless ``path``
    ends in ``.png``, ImportError without matplotlib, OSError if ``path`` cannot be written.
    """
    if not os.fspath(path).lower().endswith(".png"):
        raise ValueError(f"ac2_dist.memory.plot writes PNG files: give a path ending in .png, got {path!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("ac2_dist.memory.plot needs matplotlib: pip install 'ac2-dist[plot]'") from e
    reports = sorted(reports, key=lambda r: r.rank)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    mib = 1 / 2**20
    series = [
        ("saved after forward", [r.saved_bytes * mib for r in reports]),
        ("recomputed", [r.recomputed_bytes * mib for r in reports]),
        ("peak forward", [r.peak_bytes_forward * mib for r in reports]),
        ("peak backward", [r.peak_bytes_backward * mib for r in reports]),
    ]
    width = 0.8 / len(series)
    for k, (label, vals) in enumerate(series):
        ax1.bar([r.rank + k * width for r in reports], vals, width, label=label)
    ax1.set_xticks([r.rank + 0.4 - width / 2 for r in reports], [f"rank {r.rank}" for r in reports])
    ax1.set_ylabel("MiB")
    ax1.set_title("per rank")
    ax1.legend()
    modules = sorted({fqn for r in reports for fqn in r.per_module})
    if modules:
        for k, r in enumerate(reports):
            ax2.barh([i + k * 0.8 / len(reports) for i in range(len(modules))],
                     [r.per_module.get(m, {}).get("saved_bytes", 0) * mib for m in modules],
                     0.8 / len(reports), label=f"rank {r.rank} saved")
        ax2.set_yticks(range(len(modules)), [m or "(region)" for m in modules])
        ax2.set_xlabel("MiB saved after forward")
        ax2.set_title("per module")
        ax2.legend()
    else:
        ax2.axis("off")
    try:
        fig.tight_layout()
        fig.savefig(path, dpi=100, format="png")
    finally:
        plt.close(fig)

