"""Per-rank memory reports: what each rank saved, recomputed and peaked at (CONTRACT §8).

::

    with ac.memory.track(model) as tracker:
        loss = model(x).sum(); loss.backward()
    report = tracker.report()              # this rank
    reports = ac.memory.gather(report)     # list on rank 0, None elsewhere
    print(ac.memory.format_table(reports))

Figures come from real accounting: on CPU the allocator's own events (torch.profiler
memory events, replayed in time order), on CUDA the caching allocator's statistics;
what ac2 holds after forward is read from the regions' graphs (unique storages,
parameters excluded). Nothing is installed while no tracker is active.
"""

from __future__ import annotations

import json
import os
import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.nn as nn

from ._alloc import AllocationTrace
from ._graph import REASONS, Graph, Node
from ._region import _thread_state

__all__ = ["RankReport", "Tracker", "track", "gather", "format_table", "plot", "save_run", "load_run", "run_warnings"]

SCHEMA_VERSION = 1
_ALLGATHER_EVENTS = frozenset({"c10d::_allgather_base_", "_c10d_functional::all_gather_into_tensor"})


@dataclass
class RankReport:
    """One rank's figures; bytes are ints. ``to_dict()`` is JSON-safe.

    Peaks are the most bytes allocated at any moment of a phase, above what was
    allocated when that step's forward started (largest step reported).
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
        Every key of CONTRACT §8 is required; ``steps`` and ``live_bytes_after_forward``
        (added later in schema 1) default to 0; unknown keys are ignored.
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
    "recomputed_ops": _check_int,
    "recomputed_bytes": _check_int,
    "replay_seconds": _check_float,
    "collectives_not_replayed": _check_int,
    "allgathers_backward": _check_int,
    "per_module": _check_per_module,
    "schema_version": _check_int,
})
_OPTIONAL = frozenset({"steps", "live_bytes_after_forward"})  # added within schema 1
_REQUIRED = tuple(k for k in _FIELD_CHECKS if k not in _OPTIONAL)


def _held_bytes(graphs: Iterable[Graph], params: set[int]) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes of unique storages ac2 holds for backward, by reason and by module."""
    seen: set[int] = set()
    by_reason = dict.fromkeys(REASONS, 0)
    by_module: dict[str, int] = {}
    visited: set[int] = set()
    for graph in graphs:
        stack: list[Node] = [h.node for h in list(graph.handles)]
        while stack:
            node = stack.pop()
            if id(node) in visited:
                continue
            visited.add(id(node))
            stack.extend(m for _, m, _ in node.inputs)
            for s in node.saved or ():
                if s is None or not isinstance(s.value, torch.Tensor):
                    continue
                t = s.value
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
                by_reason[s.reason] += nbytes
                by_module[node.fqn] = by_module.get(node.fqn, 0) + nbytes
    return by_reason, by_module


def _storage_key(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # DTensor (FSDP2's sharded params)
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(t)


class Tracker:
    """Collects one rank's figures while active; see :func:`track`."""

    def __init__(self, model: nn.Module | None = None) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(
                f"ac2_dist.memory.track(model): model must be a torch.nn.Module or None, got "
                f"{type(model).__name__}; pass the model itself (for several models, track their "
                "common parent module, or call track() without a model)"
            )
        self.model = model
        self.graphs: list[Graph] = []
        self._trace: AllocationTrace | None = None
        self._hooks: list[Any] = []
        self._report = RankReport()
        self._in_backward = False
        self._param_storages: set[int] = set()
        if model is None:
            self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        else:
            self._cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
        self._used = False

    # ---- lifecycle ----------------------------------------------------------------
    def __enter__(self) -> Tracker:
        st = _thread_state()
        if self._used:
            raise RuntimeError("ac2_dist.memory.track: a Tracker is single-use; call track() again")
        if st.tracker is not None:
            raise RuntimeError("ac2_dist.memory.track: a tracker is already active on this thread")
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
        self._report.device = "cuda" if self._cuda else "cpu"
        # Figures are per step, above what was allocated when that step's forward started
        # (parameters, gradients and optimizer state from earlier are not activations).
        self._cuda_step_base = torch.cuda.memory_allocated() if self._cuda else 0
        if self.model is not None:
            self._param_storages = {_storage_key(p) for p in self.model.parameters()}
            # prepend: run before FSDP's root pre-forward, whose all-gather belongs to
            # this step's forward, not the previous step's backward.
            self._hooks.append(self.model.register_forward_pre_hook(self._on_forward, prepend=True))
            self._hooks.append(self.model.register_forward_hook(self._on_forward_end))
        trace = AllocationTrace(device_type=self._report.device, watch=_ALLGATHER_EVENTS)
        trace.__enter__()  # fails if another profiler is running
        self._trace = trace
        if self.model is None:
            self._on_forward()

    def _release(self) -> AllocationTrace | None:
        """Detach from the thread, the model and the regions' graphs; stop the profiler
        session if one was started and return its trace (``None`` if none was)."""
        st = _thread_state()
        if st.tracker is self:
            st.tracker = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for g in self.graphs:  # a replay after the block must not call back into us
            if g.tracker is self:
                g.tracker = None
        trace, self._trace = self._trace, None
        if trace is not None:
            trace.__exit__(None, None, None)
        return trace

    def __exit__(self, *exc: Any) -> None:
        trace = self._release()
        if trace is not None:
            self._finish(trace)

    # ---- phase marks ----------------------------------------------------------------
    def _on_forward(self, *args: Any) -> None:
        if self._trace is not None:
            self._report.steps += 1
            self._in_backward = False
            self._trace.mark(f"forward:{self._report.steps}")
            if self._cuda:
                self._cuda_step_base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()

    def _on_forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        # The backward phase starts when the model's forward returns: hooks on the
        # output's gradient would fire after FSDP's own pre-backward hooks, which
        # already issue (prefetch) all-gathers.
        self._snapshot_saved()
        if self._cuda:
            self._cuda_forward_peak = torch.cuda.max_memory_allocated()
            r = self._report
            r.live_bytes_after_forward = max(r.live_bytes_after_forward, torch.cuda.memory_allocated() - self._cuda_step_base)
        self._on_backward()

    def _on_backward(self, *args: Any) -> None:
        if self._trace is not None and not self._in_backward:
            self._in_backward = True
            self._trace.mark(f"backward:{self._report.steps}")
            if self._cuda:
                self._report.peak_bytes_forward = max(
                    self._report.peak_bytes_forward,
                    getattr(self, "_cuda_forward_peak", 0) - self._cuda_step_base,
                )
                torch.cuda.reset_peak_memory_stats()

    def _on_unpack(self) -> None:
        """First replay of a step without a model: forward has ended."""
        if self.model is None and not self._in_backward:
            self._snapshot_saved()
            self._on_backward()

    def _add_graph(self, graph: Graph) -> None:
        if self.model is None and self._in_backward:  # a region after a backward: next step
            self._on_forward()
        self.graphs.append(graph)

    def _note_plan(self, fqn: str, plan: Any) -> None:
        """A :class:`ac2_dist.MemoryBudget` plan that a region of ``fqn`` follows (or made)."""
        entry = self._report.per_module.setdefault(fqn, {"saved_bytes": 0, "recomputed_bytes": 0})
        entry["budget_bytes"] = plan.budget_bytes
        entry["plan_saved_bytes"] = plan.saved_bytes
        entry["plan_recompute_us"] = round(plan.recompute_seconds * 1e6)

    def _snapshot_saved(self) -> None:
        by_reason, by_module = _held_bytes(self.graphs, self._param_storages)
        total = sum(by_reason.values())
        r = self._report
        if total >= r.saved_bytes:  # the largest step
            r.saved_bytes, r.saved_bytes_by_reason = total, by_reason
            for entry in r.per_module.values():
                entry["saved_bytes"] = 0
            for fqn, nbytes in by_module.items():
                r.per_module.setdefault(fqn, {"saved_bytes": 0, "recomputed_bytes": 0})["saved_bytes"] = nbytes

    def _finish(self, trace: AllocationTrace) -> None:
        r = self._report
        phases = trace.phases
        if not self._cuda:  # CUDA peaks come from the allocator's statistics (phase hooks)
            for name, phase in phases.items():
                kind, _, step = name.partition(":")
                forward = phases.get(f"forward:{step}")
                base = forward.start_bytes if forward is not None else 0  # live when the step began
                if kind == "forward":
                    r.peak_bytes_forward = max(r.peak_bytes_forward, phase.peak_bytes - base)
                    r.live_bytes_after_forward = max(r.live_bytes_after_forward, phase.end_bytes - base)
                elif kind == "backward":
                    r.peak_bytes_backward = max(r.peak_bytes_backward, phase.peak_bytes - base)
        else:
            r.peak_bytes_backward = max(r.peak_bytes_backward, torch.cuda.max_memory_allocated() - self._cuda_step_base)
        r.allgathers_backward = sum(
            trace.calls_after(name) - trace.calls_after(f"forward:{int(name.split(':')[1]) + 1}")
            for name in trace.phases
            if name.startswith("backward:")
        )
        for g in self.graphs:
            s = g.stats
            r.recomputed_ops += s.recomputed_ops
            r.recomputed_bytes += s.recomputed_bytes
            r.replay_seconds += s.replay_seconds
            r.collectives_not_replayed += s.collectives
            for fqn, nbytes in s.recomputed_by_module.items():
                r.per_module.setdefault(fqn, {"saved_bytes": 0, "recomputed_bytes": 0})["recomputed_bytes"] += nbytes

    def report(self) -> RankReport:
        """This rank's :class:`RankReport` (complete once the ``with`` block exited)."""
        return self._report


def track(model: nn.Module | None = None) -> Tracker:
    """Track memory over one or more steps on this rank (a context manager).

    With ``model``, forward and backward are told apart by hooks on it: its forward
    starts a step, and everything after it returns (loss, backward) is the backward
    phase. Without, a step's backward phase starts at its first replay.
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


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_ROWS = [
    ("peak forward", "peak_bytes_forward", _human_bytes),
    ("peak backward", "peak_bytes_backward", _human_bytes),
    ("live after forward", "live_bytes_after_forward", _human_bytes),
    ("saved after forward", "saved_bytes", _human_bytes),
    *[(f"  saved: {reason}", f"saved_bytes_by_reason.{reason}", _human_bytes) for reason in REASONS],
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
                if "budget_bytes" in m:  # an ac2_dist.MemoryBudget plan
                    cell += (f" (budget {_human_bytes(m['budget_bytes'])}, plan saves "
                             f"{_human_bytes(m['plan_saved_bytes'])}, est. recompute "
                             f"{m['plan_recompute_us'] / 1e3:.2f} ms)")
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

