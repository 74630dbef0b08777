"""The calibrated block problem: what a memory budget solves for one block structure.

A calibration (Note [Calibrate, plan, replay the plan] in _budget_region.py) records,
per op of one checkpointed block, its output bytes, its inputs and its estimated
recompute cost (:class:`_Record`, :class:`_CostModel`); with the outputs autograd saved
they define a :class:`_Problem`: which op outputs to save so that backward recomputes
the least within a byte limit. :meth:`_Problem.solve` answers a per-block limit
(``MemoryBudget(fraction)`` / ``bytes=``, Note [What a budget bounds] in budget.py),
:meth:`_Problem.frontier` the options a whole-step peak target chooses among
(:class:`_Option`, Note [The peak model] in _peak_model.py), and :meth:`_Problem.make_plan`
turns a saved set into the :class:`Plan` a block's next calls follow. This module
imports neither the budget nor the peak planner: what it reads of the budget it plans
for is :class:`BlockBudget`.

Note [Cost model]
    The recompute cost of an op is a roofline estimate: ``max(flops / F, bytes / W)``
    seconds, FLOPs from ``torch.utils.flop_counter``'s registry (Note [FLOPs torch's
    registry does not give] in _flops.py: CPU flash attention, grouped-query attention on
    torch 2.10-2.11; 0 for ops it does not know: they are costed by their bytes), bytes the op's tensor inputs and outputs,
    and ``F`` / ``W`` fixed rates per device type (:data:`_NOMINAL_RATES`), not timed
    in the process: the same budget and shapes give the same plan on every rank (a
    replay that unshards a nested FSDP unit issues a collective, so plans that differ
    between ranks could order collectives differently). Plans depend on the ratio
    ``F / W``, not on the rates themselves. ``launch/bench_core.py --budgets`` prints
    the plans' predicted recompute time beside the measured replay time.

Note [The solver]
    Minimizing recompute cost under a byte budget with shared recompute chains is a
    knapsack with interacting items. Every evaluation of a saved set is exact on the
    recorded dependency graph (:meth:`_Problem.evaluate`). With at most
    ``_EXACT_UP_TO`` candidate outputs (a block's heavy, recomputed, non-view ones) the
    solver enumerates every subset: the optimum for the cost model, monotone in the
    budget. With more it walks one greedy path without a budget -- each step saves the
    output with the best cost saved per byte added -- takes the cheapest prefix that
    fits, fills what is left of the budget the same greedy way, keeps the single best
    output if that is cheaper (for independent items: the classic factor-2 greedy),
    then the same from the cheapest minimum cuts within the budget (Note [Saved sets as
    cuts] in _cuts.py: sets no path of single picks reaches), and then improves by local
    search (drop one saved output, refill). That part is a heuristic without a bound. A
    peak target's options (:meth:`_Problem.frontier`) are every subset up to
    ``_EXACT_UP_TO`` candidates, else the greedy path, each single output and every cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ._cuts import cut_sets
from ._flops import op_flops

__all__ = ["BlockBudget", "Plan"]

_CP = CheckpointPolicy
_PS, _PR = _CP.PREFER_SAVE, _CP.PREFER_RECOMPUTE
_MAX_CANDIDATES = 96  # outputs the solver considers saving (the heaviest recomputed ones)
_EXACT_UP_TO = 12  # candidates up to which the solver enumerates every subset
_CUT_SEEDS = 3  # cuts within a byte limit the solver fills (the cheapest ones)


class BlockBudget(Protocol):
    """What :class:`_Problem` reads of the budget it plans for
    (:class:`~ac2_dist.MemoryBudget` is one)."""

    #: The budget's whole-step planner (a peak target's ``PeakPlanner``, whose figures a
    #: :class:`Plan` carries to ``memory.track``), or None.
    _planner: Any

    def budget_bytes(self, floor: int, top: int) -> int:
        """The byte limit of a block whose floor and top are known."""
        ...

    def _none(self) -> bool:
        """The budget saves nothing (``"recompute_all"``)."""
        ...

    def _full(self) -> bool:
        """The budget saves everything backward needs (``"must_save_all"``)."""
        ...


# ---- cost model ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _CostModel:
    """Roofline rates of a device type (Note [Cost model])."""

    device: torch.device
    flops_per_s: float
    bytes_per_s: float

    @classmethod
    def for_device(cls, device: torch.device) -> _CostModel:
        flops, bandwidth = _NOMINAL_RATES.get(device.type, _NOMINAL_RATES["cpu"])
        return cls(device, flops, bandwidth)

    def estimate(self, func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[int, float]:
        """(FLOPs, estimated seconds) of one op call."""
        flops = op_flops(func, args, kwargs, out)
        moved = _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
        return flops, max(flops / self.flops_per_s, moved / self.bytes_per_s)


# See Note [Cost model].
#: FLOP/s and bytes/s per device type. CPU: measured on the
#: development machine (2 cores, fp32: 2.2-2.5e11 FLOP/s for a 256^3 matmul, 4.9-6.1e10 B/s
#: for an elementwise add); CUDA: an H100's dense fp32 rate and HBM bandwidth, rounded.
_NOMINAL_RATES = {"cpu": (2.0e11, 5.0e10), "cuda": (5.0e13, 3.0e12)}


def _tensor_bytes(tree: Any) -> int:
    total = 0
    for t in torch.utils._pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


# ---- records, problem, plan -------------------------------------------------------------------


@dataclass(slots=True)
class _Record:
    seq: int
    call: int | None  # index of the policy call for this op (None: the policy was not asked)
    op: Any
    node: Any  # the graph node (held until the region exits)
    nbytes: int  # bytes of its non-view tensor outputs
    flops: int
    seconds: float
    inputs: tuple[int, ...]  # seqs of the nodes it reads
    view: bool
    held: Any = None  # its output, held until the region exits (Note [A calibration keeps what its plan saves] in _budget_region.py)


@dataclass
class Plan:
    """What a budget saves in one block structure (see :meth:`MemoryBudget.format_plan`)."""

    signature: tuple
    decisions: tuple  # per policy call: PREFER_SAVE / PREFER_RECOMPUTE
    budget_bytes: int
    floor_bytes: int
    top_bytes: int
    saved_bytes: int  # M(S) of the plan
    recompute_seconds: float  # estimated cost of the plan's recompute
    recompute_flops: int
    rows: list[tuple[int, str, int, float, bool]] = field(default_factory=list)  # (call, op, bytes, cost, saved)
    peak: Any = None  # the PeakPlanner of a peak target (memory.track reports its figures)

    def format(self, fqn: str = "") -> str:
        mib = 1 / 2**20
        lines = [
            f"{fqn or '(region)'}: budget {self.budget_bytes * mib:.2f} MiB (floor {self.floor_bytes * mib:.2f}, "
            f"top {self.top_bytes * mib:.2f}); plan saves {self.saved_bytes * mib:.2f} MiB, estimated recompute "
            f"{self.recompute_seconds * 1e3:.3f} ms ({self.recompute_flops / 1e6:.1f} MFLOP)",
            f"  {'#':>4}  {'op':<44} {'bytes':>10} {'cost us':>9}  saved",
        ]
        for call, name, nbytes, cost, saved in self.rows:
            lines.append(f"  {call:>4}  {name:<44} {nbytes:>10} {cost * 1e6:>9.1f}  {'yes' if saved else '-'}")
        return "\n".join(lines)


@dataclass
class _Option:
    """One saved set of a block structure: bytes above its floor and estimated cost."""

    dk: int
    seconds: float
    flops: int
    saved: frozenset
    # bytes above its floor at each sub-segment "bwd:k/i" of its own backward (i = 1, 2, ...;
    # ``dk`` where absent): a correction's price (Note [A block's backward, replay by replay] in _peak_model.py)
    at: tuple[int, ...] = ()


class _Problem:
    """The dependency graph of one calibrated region (Note [The solver])."""

    def __init__(self, records: list[_Record], targets: set[int], forced: set[int], written: set[int],
                 signature: tuple) -> None:
        self.records = {r.seq: r for r in records}
        self.order = sorted(self.records)  # program order
        self.targets = {t for t in targets if t in self.records}
        self.forced = forced & set(self.records)
        self.written = written & set(self.records)  # kept for a plan file (_plan/_plan_file.py)
        self.signature = signature
        recomputed = self.evaluate(frozenset())[2]  # what "recompute_all" replays
        candidates = [
            s for s in recomputed
            if not self.records[s].view and self.records[s].nbytes > 0 and s not in written
            and self.records[s].call is not None
        ]
        # The costliest outputs to recompute bound the greedy solver's work; a cut may save any
        # of them (Note [Saved sets as cuts] in _cuts.py).
        candidates.sort(key=lambda s: -self.records[s].seconds)
        self.cuttable = candidates
        self.candidates = candidates[:_MAX_CANDIDATES]
        self._cuts: list[frozenset[int]] | None = None

    def cuts(self) -> list[frozenset[int]]:
        """The min-cut proposals of this block (computed once; Note [Saved sets as cuts])."""
        if self._cuts is None:
            self._cuts = [] if len(self.cuttable) <= _EXACT_UP_TO else cut_sets(self)
        return self._cuts

    def evaluate(self, saved: frozenset[int]) -> tuple[int, float, set[int]]:
        """(bytes held, recompute seconds, recomputed seqs) when ``saved`` are saved."""
        kept = saved | self.forced
        needed = set(self.targets)
        recomputed: set[int] = set()
        records = self.records
        for seq in reversed(self.order):
            if seq in needed and seq not in kept:
                recomputed.add(seq)
                for m in records[seq].inputs:
                    if m in records:
                        needed.add(m)
        held = sum(records[s].nbytes for s in needed if s in kept)
        cost = sum(records[s].seconds for s in recomputed)
        return held, cost, recomputed

    def solve(self, limit: int) -> frozenset[int]:
        """The saved set for a byte limit (Note [The solver])."""
        best_set, (best_mem, best_cost, _) = frozenset(), self.evaluate(frozenset())
        if best_mem > limit:
            return best_set  # the floor itself: nothing can be saved
        if len(self.candidates) <= _EXACT_UP_TO:
            return self._exact(limit)
        for chosen, mem, cost in self._greedy_path():
            if mem <= limit and cost < best_cost:
                best_set, best_mem, best_cost = chosen, mem, cost
        best_set, best_cost = self._fill(best_set, best_mem, best_cost, limit)
        # the cheapest cuts within the limit (Note [Saved sets as cuts] in _cuts.py), each filled
        # the same way, or a single output
        seeds = sorted(((cost, mem, seed) for seed in self.cuts()
                        for mem, cost, _ in [self.evaluate(seed)] if mem <= limit), key=lambda t: t[:2])
        for cost, mem, seed in seeds[:_CUT_SEEDS]:
            seed, cost = self._fill(seed, mem, cost, limit)
            if cost < best_cost:
                best_set, best_cost = seed, cost
        for c in self.candidates:
            mem, cost, _ = self.evaluate(frozenset((c,)))
            if mem <= limit and cost < best_cost:
                best_set, best_cost = frozenset((c,)), cost
        return self._improve(best_set, best_cost, limit)

    def _exact(self, limit: int) -> frozenset[int]:
        """The cheapest saved set within ``limit`` among all subsets of the candidates
        (small graphs: at most 2 ** _EXACT_UP_TO evaluations)."""
        best_set, best_key = frozenset(), None
        cands = self.candidates
        for mask in range(1 << len(cands)):
            chosen = frozenset(c for i, c in enumerate(cands) if mask >> i & 1)
            mem, cost, _ = self.evaluate(chosen)
            if mem > limit:
                continue
            key = (cost, mem)
            if best_key is None or key < best_key:
                best_set, best_key = chosen, key
        return best_set

    def _improve(self, chosen: frozenset[int], cost: float, limit: int) -> frozenset[int]:
        """Local search: drop one saved output and refill the budget; keep improvements
        (a greedy pick that blocked better combinations gets undone)."""
        improved = True
        while improved:
            improved = False
            for c in sorted(chosen):
                rest = chosen - {c}
                mem, k, _ = self.evaluate(rest)
                candidate, k = self._fill(rest, mem, k, limit, skip=c)
                if k < cost - 1e-12:
                    chosen, cost, improved = candidate, k, True
                    break
        return chosen

    def _fill(self, chosen: frozenset[int], mem: int, cost: float, limit: int,
              skip: int | None = None) -> tuple[frozenset[int], float]:
        """Add outputs that still fit, best cost saved per byte first (the prefix of the
        greedy path stops at the first output that does not fit; smaller ones may)."""
        while True:
            best = None
            for c in self.candidates:
                if c in chosen or c == skip:
                    continue
                m, k, _ = self.evaluate(chosen | {c})
                if m > limit or k >= cost:
                    continue
                ratio = (cost - k) / max(m - mem, 1)
                if best is None or ratio > best[0]:
                    best = (ratio, c, m, k)
            if best is None:
                return chosen, cost
            _, c, mem, cost = best
            chosen = chosen | {c}

    def _greedy_path(self) -> list[tuple[frozenset[int], int, float]]:
        path = []
        chosen: frozenset[int] = frozenset()
        mem, cost, _ = self.evaluate(chosen)
        left = list(self.candidates)
        while left and cost > 0:
            best = None
            for c in left:
                m, k, _ = self.evaluate(chosen | {c})
                if k >= cost:
                    continue
                ratio = (cost - k) / max(m - mem, 1)
                if best is None or ratio > best[0] or (ratio == best[0] and m < best[2]):
                    best = (ratio, c, m, k)
            if best is None:
                break
            _, c, mem, cost = best
            chosen = chosen | {c}
            left.remove(c)
            path.append((chosen, mem, cost))
        return path

    def plan(self, budget: BlockBudget) -> Plan:
        floor, _, _ = self.evaluate(frozenset())
        everything = frozenset(self.candidates)
        top, _, _ = self.evaluate(everything)
        top = max(top, floor)
        limit = budget.budget_bytes(floor, top)
        if budget._none():
            saved = frozenset()
        elif budget._full() or limit >= top:
            saved = everything
        else:
            saved = self.solve(limit)
        return self.make_plan(budget, saved, limit)

    def frontier(self) -> list[_Option]:
        """Saved sets that are cheapest for their bytes, fewest bytes first (a peak
        target's options for this structure: Note [The peak model] in _peak_model.py). Every
        subset of the candidates up to ``_EXACT_UP_TO`` of them; else the greedy path,
        each single candidate and every minimum cut (Note [Saved sets as cuts] in _cuts.py)."""
        cands = self.candidates
        if len(cands) <= _EXACT_UP_TO:
            sets = [frozenset(c for i, c in enumerate(cands) if mask >> i & 1) for mask in range(1 << len(cands))]
        else:
            sets = [frozenset()] + [chosen for chosen, _, _ in self._greedy_path()]
            sets += [frozenset((c,)) for c in cands] + self.cuts()
        floor = self.evaluate(frozenset())[0]
        points = []
        for saved in sets:
            held, seconds, recomputed = self.evaluate(saved)
            flops = sum(self.records[s].flops for s in recomputed)
            points.append(_Option(held - floor, seconds, flops, saved))
        points.sort(key=lambda o: (o.dk, o.seconds, o.flops, len(o.saved)))
        out: list[_Option] = []
        for o in points:
            if not out or o.seconds < out[-1].seconds - 1e-15:
                out.append(o)
        return out

    def release(self) -> None:
        """Drop the graph nodes and held outputs (the problem outlives its region)."""
        for r in self.records.values():
            r.node = None
            r.held = None

    def make_plan(self, budget: BlockBudget, saved: frozenset[int], limit: int | None = None) -> Plan:
        """The plan that saves ``saved`` (the candidates' seqs)."""
        floor, _, _ = self.evaluate(frozenset())
        held, seconds, recomputed = self.evaluate(saved)
        if limit is None:  # a peak target's share for this block
            limit = held
        top = max(self.evaluate(frozenset(self.candidates))[0], floor)
        by_call = {r.call: r for r in self.records.values() if r.call is not None}
        n_calls = len(self.signature)
        decisions = tuple(_PS if (k in by_call and by_call[k].seq in saved) else _PR for k in range(n_calls))
        rows = [
            (r.call, str(r.op), r.nbytes, r.seconds, r.seq in saved)
            for r in sorted(by_call.values(), key=lambda r: r.call)
            if r.seq in recomputed or r.seq in saved
        ]
        flops = sum(self.records[s].flops for s in recomputed)
        return Plan(self.signature, decisions, limit, floor, top, held, seconds, flops, rows,
                    peak=budget._planner)
