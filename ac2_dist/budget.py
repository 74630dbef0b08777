"""Memory-budget policy: the user names the memory, ac2 chooses what to save (CONTRACT §11).

    ac.apply_ac(model, ac.MemoryBudget(0.5), modules=[Block])       # a fraction
    ac.apply_ac(model, ac.MemoryBudget(bytes=64 << 20), modules=[Block])
    ac.apply_ac(model, ac.MemoryBudget(lambda rank: 0.25 if rank == 0 else 0.75), modules=[Block])

Note [What a budget bounds]
    Per region, with S the set of op outputs the plan saves: ``M(S)`` is the bytes of
    the saved op outputs backward still holds after forward (outputs autograd saves,
    and saved inputs of the ops it recomputes), side-effect outputs (collectives, saved
    random ops, writes) included; region inputs (the block input, parameters) are not
    counted (they are kept under every policy). The floor is ``M`` under
    ``"recompute_all"``, the top ``M`` under ``"must_save_all"``; ``fraction=f`` keeps
    ``M(S) <= floor + f * (top - floor)``; ``bytes=b`` keeps ``M(S) <= floor + b``.
    0 is ``"recompute_all"``, 1 (or ``b >= top - floor``) saves every output backward
    needs, as ``"must_save_all"`` does.

Note [Calibrate, plan, replay the plan]
    A region (one call of a checkpointed module) whose structure has no plan yet is a
    *calibration*: every op is recomputable (the memory of ``"recompute_all"``) and an
    observer on the graph records, per op, its output bytes, its inputs and its
    estimated recompute cost. When the region exits, the ops' dependency graph and the
    outputs autograd saved (the graph's handles) define the problem; :meth:`_Problem.solve`
    picks the saved set; the plan is cached by structure (the sequence of ops and output
    shapes), so identical blocks share it and later steps pay no planning cost. A
    planned region answers each op from the plan after checking the op and its output
    shape against it; at a mismatch it switches to another cached plan that agrees so
    far (a structure seen before: other shapes, another dispatch path), and otherwise
    recomputes the rest and its next call calibrates again.

Note [Cost model]
    The recompute cost of an op is a roofline estimate: ``max(flops / F, bytes / W)``
    seconds, FLOPs from ``torch.utils.flop_counter``'s registry (0 for ops it does not
    know: they are costed by their bytes), bytes the op's tensor inputs and outputs,
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
    and then improves by local search (drop one saved output, refill). That part is a
    heuristic without a bound.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import flop_registry

from .side_effects import op_info

__all__ = ["MemoryBudget", "Plan"]

_CP = CheckpointPolicy
_PS, _PR = _CP.PREFER_SAVE, _CP.PREFER_RECOMPUTE
_MAX_CANDIDATES = 96  # outputs the solver considers saving (the heaviest recomputed ones)
_EXACT_UP_TO = 12  # candidates up to which the solver enumerates every subset


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class MemoryBudget:
    """A policy that saves, per region, the op outputs that minimize recompute cost
    within a memory budget (Note [What a budget bounds]).

    Args:
        fraction: of the way from ``"recompute_all"`` (0) to ``"must_save_all"`` (1),
            in ``[0, 1]``; or a callable ``rank -> fraction`` (uneven ranks: pipeline
            stages, MoE experts).
        bytes: instead of ``fraction``, the bytes a region may save above the
            ``"recompute_all"`` floor (an int >= 0), or a callable ``rank -> bytes``.

    Usable wherever a policy is (``apply_ac``, ``wrap``, ``apply_ac_policy``,
    ``apply_ac_policy_fn``, ``checkpoint``), nested with other policies (its answers
    are ``PREFER_*``: a ``MUST_*`` of another region wins). The first call of each
    block structure calibrates (Note [Calibrate, plan, replay the plan]); see
    :meth:`format_plan` for what was chosen. Eager only (``torch.compile`` has its own:
    ``torch._functorch.config.activation_memory_budget``).
    """

    def __init__(
        self,
        fraction: float | Callable[[int], float] | None = None,
        *,
        bytes: int | Callable[[int], int] | None = None,  # noqa: A002 - public name fixed by CONTRACT §11
    ) -> None:
        if (fraction is None) == (bytes is None):
            raise TypeError("ac2_dist.MemoryBudget: pass exactly one of fraction or bytes")
        self._fraction = fraction
        self._bytes = bytes
        self._lock = threading.Lock()
        self._plans: dict[tuple, Plan] = {}  # structure signature -> plan (shared by equal blocks)
        self._by_fqn: dict[str, Plan] = {}  # the plan a module's next call follows
        self._resolved: tuple[str, float] | None = None
        self._cost: _CostModel | None = None
        self.plans_made = 0  # solver runs (planning cost paid)
        self._resolve()  # validate now: before any forward runs

    # ---- the budget --------------------------------------------------------------------
    def _resolve(self) -> tuple[str, float]:
        """``("fraction", f)`` or ``("bytes", b)`` for this process's rank (validated)."""
        if self._resolved is not None:
            return self._resolved
        rank = _rank()
        if self._fraction is not None:
            value = self._call("fraction", self._fraction, rank)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"ac2_dist.MemoryBudget: fraction must be a number in [0, 1]"
                    f"{' (returned for rank ' + str(rank) + ')' if callable(self._fraction) else ''}, got {value!r}"
                )
            resolved = ("fraction", float(value))
        else:
            value = self._call("bytes", self._bytes, rank)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"ac2_dist.MemoryBudget: bytes must be a non-negative int"
                    f"{' (returned for rank ' + str(rank) + ')' if callable(self._bytes) else ''}, got {value!r}"
                )
            resolved = ("bytes", value)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            self._resolved = resolved  # the rank is final once the process group exists
        return resolved

    @staticmethod
    def _call(name: str, value: Any, rank: int) -> Any:
        if not callable(value):
            return value
        try:
            return value(rank)
        except Exception as e:
            raise ValueError(f"ac2_dist.MemoryBudget: the {name} callable raised for rank {rank}: {e!r}") from e

    def budget_bytes(self, floor: int, top: int) -> int:
        """The byte limit of a region whose floor and top are known (Note [What a budget bounds])."""
        kind, value = self._resolve()
        if kind == "fraction":
            return floor + round(value * (top - floor))
        return floor + min(int(value), top - floor)

    def _full(self) -> bool:
        kind, value = self._resolve()
        return kind == "fraction" and value == 1.0

    def _none(self) -> bool:
        kind, value = self._resolve()
        return value == 0

    # ---- regions ------------------------------------------------------------------------
    def new_region_policy(self, module_fqn: str) -> _BudgetRegion:
        """The policy of one region (one call of a checkpointed module); called by ac2."""
        return _BudgetRegion(self, module_fqn)

    def _plan_for(self, fqn: str) -> Plan | None:
        with self._lock:
            return self._by_fqn.get(fqn)

    def _switch(self, plan: Plan, k: int, key: tuple) -> Plan | None:
        """A cached plan whose first ``k`` ops and decisions equal ``plan``'s and whose
        op ``k`` is ``key`` (the same module called with another structure, e.g. under
        another dispatch mode or with other shapes, already calibrated)."""
        with self._lock:
            for other in self._plans.values():
                if (other is not plan and len(other.signature) > k and other.signature[k] == key
                        and other.signature[:k] == plan.signature[:k] and other.decisions[:k] == plan.decisions[:k]):
                    return other
        return None

    def _follow(self, fqn: str, plan: Plan) -> None:
        with self._lock:
            self._by_fqn[fqn] = plan

    def _forget(self, fqn: str) -> None:
        with self._lock:
            self._by_fqn.pop(fqn, None)

    def _adopt(self, fqn: str, problem: _Problem) -> Plan:
        with self._lock:
            plan = self._plans.get(problem.signature)
            if plan is None:
                plan = problem.plan(self)
                self._plans[problem.signature] = plan
                self.plans_made += 1
            self._by_fqn[fqn] = plan
            return plan

    def _cost_model(self, device: torch.device) -> _CostModel:
        if self._cost is None or self._cost.device != device:
            self._cost = _CostModel.for_device(device)
        return self._cost

    # ---- what was chosen ------------------------------------------------------------------
    def plan(self, module_fqn: str = "") -> Plan | None:
        """The plan ``module_fqn``'s next call follows (``None`` before its calibration)."""
        return self._plan_for(module_fqn)

    def format_plan(self, module_fqn: str | None = None) -> str:
        """A table per planned module: op, output bytes, estimated cost, saved or not."""
        with self._lock:
            items = sorted(self._by_fqn.items()) if module_fqn is None else \
                [(module_fqn, self._by_fqn.get(module_fqn))]
        out = []
        for fqn, plan in items:
            if plan is None:
                out.append(f"{fqn or '(region)'}: no plan yet (its first call calibrates)")
            else:
                out.append(plan.format(fqn))
        return "\n\n".join(out) if out else "(no plans yet)"

    def __repr__(self) -> str:
        what = f"fraction={self._fraction!r}" if self._fraction is not None else f"bytes={self._bytes!r}"
        return f"MemoryBudget({what})"

    def __reduce__(self) -> tuple:
        # Plans hold ops and are rebuilt after loading (the first call calibrates again).
        if self._fraction is not None:
            return (MemoryBudget, (self._fraction,))
        return (_budget_of_bytes, (self._bytes,))


def _budget_of_bytes(nbytes: Any) -> MemoryBudget:
    return MemoryBudget(bytes=nbytes)


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
        flops = 0
        packet = getattr(func, "_overloadpacket", None)
        formula = flop_registry.get(packet) if packet is not None else None
        if formula is not None:
            try:
                flops = int(formula(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not accept these arguments
                flops = 0
        moved = _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
        return flops, max(flops / self.flops_per_s, moved / self.bytes_per_s)


#: FLOP/s and bytes/s per device type (Note [Cost model]). CPU: measured on the
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


class _Problem:
    """The dependency graph of one calibrated region (Note [The solver])."""

    def __init__(self, records: list[_Record], targets: set[int], forced: set[int], written: set[int],
                 signature: tuple) -> None:
        self.records = {r.seq: r for r in records}
        self.order = sorted(self.records)  # program order
        self.targets = {t for t in targets if t in self.records}
        self.forced = forced & set(self.records)
        self.signature = signature
        recomputed = self.evaluate(frozenset())[2]  # what "recompute_all" replays
        candidates = [
            s for s in recomputed
            if not self.records[s].view and self.records[s].nbytes > 0 and s not in written
            and self.records[s].call is not None
        ]
        # The costliest outputs to recompute bound the solver's work.
        candidates.sort(key=lambda s: -self.records[s].seconds)
        self.candidates = candidates[:_MAX_CANDIDATES]

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

    def plan(self, budget: MemoryBudget) -> Plan:
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
        held, seconds, recomputed = self.evaluate(saved)
        by_call = {r.call: r for r in self.records.values() if r.call is not None}
        n_calls = len(self.signature)
        decisions = tuple(_PS if (k in by_call and by_call[k].seq in saved) else _PR for k in range(n_calls))
        rows = [
            (r.call, str(r.op), r.nbytes, r.seconds, r.seq in saved)
            for r in sorted(by_call.values(), key=lambda r: r.call)
            if r.seq in recomputed or r.seq in saved
        ]
        flops = sum(self.records[s].flops for s in recomputed)
        return Plan(self.signature, decisions, limit, floor, top, held, seconds, flops, rows)


class _BudgetRegion:
    """The policy of one region under a :class:`MemoryBudget` (Note [Calibrate, plan,
    replay the plan]); also the region's observer while it calibrates."""

    def __init__(self, budget: MemoryBudget, fqn: str) -> None:
        self.budget = budget
        self.fqn = fqn
        self.plan = budget._plan_for(fqn)
        self.calls = 0
        self.diverged = False
        self.signature: list[tuple] = []
        self.records: list[_Record] = []
        self.graph: Any = None
        self.previous_observer: Any = None
        self.first_handle = 0
        self.cost: _CostModel | None = None

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        k = self.calls
        self.calls = k + 1
        shape = _first_shape(ctx.op_output)
        plan = self.plan
        if plan is None:  # calibrating
            self.signature.append((op, shape))
            return _PR
        if self.diverged:
            return _PR
        key = (op, shape)
        if k < len(plan.signature) and plan.signature[k] == key:
            return plan.decisions[k]
        other = self.budget._switch(plan, k, key)
        if other is not None:  # another cached structure that agrees so far: follow it
            self.plan = other
            return other.decisions[k]
        self.diverged = True  # an unknown structure: recompute the rest, calibrate next time
        return _PR

    # ---- region hooks (Note [Region-scoped policies] in _policy.py) ------------------------
    def region_enter(self, graph: Any) -> None:
        if graph is None:  # no grad: nothing is recorded
            return
        self.graph = graph
        if graph.tracker is not None and self.plan is not None:
            graph.tracker._note_plan(self.fqn, self.plan)
        if self.plan is None:
            self.previous_observer = graph.observer
            graph.observer = self._observe
            self.first_handle = graph.packed

    def _observe(self, node: Any, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        previous = self.previous_observer
        if previous is not None:
            previous(node, func, args, kwargs, out)
        info = op_info(func)
        call = None if info.ignored else self.calls - 1
        view = info.returns_alias or info.view_src is not None
        nbytes = 0 if view else _tensor_bytes(out)
        if self.cost is None:
            device = next((t.device for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)),
                          torch.device("cpu"))
            self.cost = self.budget._cost_model(device)
        flops, seconds = (0, 0.0) if view else self.cost.estimate(func, args, kwargs, out)
        self.records.append(_Record(node.seq, call, func, node, nbytes, flops, seconds,
                                    tuple(m.seq for _, m, _ in node.inputs), view))

    def region_exit(self, graph: Any, failed: bool) -> None:
        if self.graph is None:
            return
        if self.plan is not None:
            if self.diverged:
                self.budget._forget(self.fqn)
            else:
                self.budget._follow(self.fqn, self.plan)  # it may have switched plans
            return
        graph.observer = self.previous_observer
        if failed:
            return
        targets = {h.node.seq for h in graph.live_handles() if h.seq > self.first_handle}
        forced = {r.seq for r in self.records if r.node.saved is not None and all(s is not None for s in r.node.saved)}
        written = set()  # outputs written in place later: saving one would make the write a side effect
        for r in self.records:
            writes = r.node.writes
            if writes:
                for pos, m, _ in r.node.inputs:
                    if pos in writes:
                        written.add(m.seq)
                        if m.alias_of is not None:  # its storage's owner (Note [Aliases a schema ...])
                            written.add(m.alias_of[0].seq)
        problem = _Problem(self.records, targets, forced, written, tuple(self.signature))
        self.records = []  # let the nodes go
        plan = self.budget._adopt(self.fqn, problem)
        if graph.tracker is not None:
            graph.tracker._note_plan(self.fqn, plan)


def _first_shape(out: Any) -> tuple | None:
    if isinstance(out, torch.Tensor):
        return tuple(out.shape)
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return tuple(o.shape)
    return None
