"""Memory-budget policy: the user names the memory, ac2 chooses what to save (CONTRACT §11).

    ac.apply_ac(model, ac.MemoryBudget(0.5), modules=[Block])       # a fraction
    ac.apply_ac(model, ac.MemoryBudget(bytes=64 << 20), modules=[Block])
    ac.apply_ac(model, ac.MemoryBudget(lambda rank: 0.25 if rank == 0 else 0.75), modules=[Block])
    ac.apply_ac(model, ac.MemoryBudget(peak="70GiB"), modules=[Block])  # the step's peak (_peak.py)

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
    recomputes the rest and its next call calibrates again. The structure is the
    module's own computation: ops FSDP runs for a nested unit (its all-gathers and their
    one-time buffers) are not part of it (Note [FSDP's own ops are not structure] in
    fsdp.py): they are answered PREFER_RECOMPUTE, which a plan answers for them anyway.

Note [A calibration keeps what its plan saves]
    A calibrating region holds the outputs a plan could save (of the recomputable ops
    its own frame decides: not views, not in-place writes, not random ops replayed
    under ``rng="replay"``) until it exits; then, with the plan made, the outputs the
    plan saves become saved values of the graph (``Graph._save_in_place``, as
    ``tag_with_policy`` does) -- provided the tensor is still that op's value (same
    version, still mapped to it; a plan never saves an output written later) -- and
    the rest are let go. So the calibrating call
    keeps what later calls keep and backward recomputes what it will recompute on
    every later step, at the cost of holding one block's op outputs transiently (until
    the block's forward returns) instead of recomputing them.

Note [Identical blocks share the first step]
    A module without a plan of its own whose first op matches a cached plan (preferably
    the plan of its siblings: ``blocks.3`` looks at ``blocks.#``) follows that plan from
    its first op instead of calibrating, as later steps do; identical blocks therefore
    follow the first block's plan in the first step. Until the plan first says
    PREFER_SAVE the region keeps recording as a calibration would (everything was
    recomputable so far): if it diverges from every cached plan before that point, or
    ends early, it *is* a calibration and plans on its own. Diverging after a save, it
    recomputes the rest and its next call calibrates (no following then).

Note [Cost model]
    The recompute cost of an op is a roofline estimate: ``max(flops / F, bytes / W)``
    seconds, FLOPs from ``torch.utils.flop_counter``'s registry (or an op of the same
    arithmetic's formula, :data:`_FLOP_ALIASES`: CPU flash attention has none of its own;
    0 for ops it does not know: they are costed by their bytes), bytes the op's tensor inputs and outputs,
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
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import flop_registry

from ._nodes import flatten_outputs, input_refs
from ._peak import PeakPlanner, _Option, parse_size
from .fsdp import own_ops_scope
from .side_effects import op_info

__all__ = ["MemoryBudget", "Plan"]

_CP = CheckpointPolicy
_PS, _PR = _CP.PREFER_SAVE, _CP.PREFER_RECOMPUTE
# A torch.profiler.record_function scope opens and closes (Note [FSDP's own ops are not
# structure] in fsdp.py).
_SCOPE_ENTER = torch.ops.profiler._record_function_enter_new.default
_SCOPE_EXIT = torch.ops.profiler._record_function_exit._RecordFunction
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
        peak: instead of either, a physical target for the whole step: the rank's peak
            allocated bytes during forward + backward stay <= ``peak`` (an int, a size
            string such as ``"70GiB"`` or ``"512MiB"``, or a callable ``rank -> size``).
            One instance applied to all blocks is one budget for the model: their saved
            sets are planned together from what the first step measures, verified after
            each step and corrected until the measured peak fits (Notes in _peak.py).
            On CUDA the scale is ``torch.cuda.max_memory_allocated``'s; on CPU the peak
            above what was allocated when the step's first checkpointed forward began.
        strict: with ``peak``: a target below the measured floor raises (at the next
            forward) instead of warning once and running at the floor.

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
        peak: int | str | Callable[[int], int | str] | None = None,
        strict: bool = False,
    ) -> None:
        given = [name for name, v in (("fraction", fraction), ("bytes", bytes), ("peak", peak)) if v is not None]
        if len(given) != 1:
            raise TypeError("ac2_dist.MemoryBudget: pass exactly one of fraction, bytes or peak"
                            + (f" (got {' and '.join(given)})" if given else ""))
        if not isinstance(strict, bool):
            raise TypeError(f"ac2_dist.MemoryBudget: strict must be a bool, got {strict!r}")
        if strict and peak is None:
            raise TypeError("ac2_dist.MemoryBudget: strict applies to a peak target (MemoryBudget(peak=..., strict=True))")
        self._fraction = fraction
        self._bytes = bytes
        self._peak_arg = peak
        self._strict = strict
        self._planner: PeakPlanner | None = None
        self._lock = threading.Lock()
        self._plans: dict[tuple, Plan] = {}  # structure signature -> plan (shared by equal blocks)
        self._by_fqn: dict[str, Plan] = {}  # the plan a module's next call follows
        self._recalibrate: set[str] = set()  # modules whose next call calibrates (their last one diverged)
        self._by_pattern: dict[str, Plan] = {}  # fqn with list indices as '#' -> the plan last used there
        self._fqn_plans: dict[str, dict[tuple, Plan]] = {}  # a peak target's plans: fqn -> structure -> plan
        self._resolved: tuple[str, float] | None = None
        self._cost: _CostModel | None = None
        self.plans_made = 0  # solver runs (planning cost paid)
        self._calibrations = 0  # regions that calibrated (a cached plan may have answered them)
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
        elif self._peak_arg is not None:
            value = self._call("peak", self._peak_arg, rank)
            where = f" (returned for rank {rank})" if callable(self._peak_arg) else ""
            resolved = ("peak", parse_size(value, "peak" + where))
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

    @property
    def peak_planner(self) -> PeakPlanner | None:
        """The global planner of a ``peak`` target (``None`` for fraction/bytes budgets)."""
        if self._peak_arg is None:
            return None
        if self._planner is None:
            target = self._resolve()[1]
            with self._lock:
                if self._planner is None:
                    self._planner = PeakPlanner(self, target)
        return self._planner

    def close(self) -> None:
        """Stop the measurement a ``peak`` target may have running.

        While it verifies its plan (the first steps, Note [Verify, correct, stay put] in
        _peak.py) the planner traces allocations from a step's first region to the next
        step's, when no ``memory.track`` runs. Call this if training stops during those
        steps and the process goes on (e.g. before starting ``torch.profiler``); at exit
        it stops by itself. A later step measures again if the plan has not settled."""
        if self._planner is not None:
            self._planner.close()

    # ---- regions ------------------------------------------------------------------------
    def new_region_policy(self, module_fqn: str) -> _BudgetRegion:
        """The policy of one region (one call of a checkpointed module); called by ac2."""
        planner = self.peak_planner
        if planner is not None:
            module_fqn = planner.before_region(module_fqn)
        return _BudgetRegion(self, module_fqn)

    def _plan_for(self, fqn: str) -> tuple[Plan | None, bool]:
        """(the plan ``fqn``'s call follows, whether a call without one may follow a
        cached plan of the same structure instead of calibrating)."""
        with self._lock:
            plan = self._by_fqn.get(fqn)
            return plan, plan is None and bool(self._plans) and fqn not in self._recalibrate

    def _first_match(self, fqn: str, key: tuple) -> Plan | None:
        """A cached plan whose first op is ``key`` (a module without a plan of its own
        follows it: Note [Identical blocks share the first step]); first the plan of its
        siblings (``blocks.0`` for ``blocks.3``)."""
        with self._lock:
            hint = self._by_pattern.get(_fqn_pattern(fqn))
            if hint is not None and hint.signature and hint.signature[0] == key:
                return hint
            for plan in self._plans.values():
                if plan.signature and plan.signature[0] == key:
                    return plan
        return None

    def _switch(self, plan: Plan, k: int, key: tuple, fqn: str = "") -> Plan | None:
        """A cached plan whose first ``k`` ops and decisions equal ``plan``'s and whose
        op ``k`` is ``key`` (the same module called with another structure, e.g. under
        another dispatch mode or with other shapes, already calibrated); first the
        module's own plans of a peak target (its structure-keyed plans are the floor)."""
        with self._lock:
            own = list(self._fqn_plans.get(fqn, {}).values())
            for other in own + list(self._plans.values()):
                if (other is not plan and len(other.signature) > k and other.signature[k] == key
                        and other.signature[:k] == plan.signature[:k] and other.decisions[:k] == plan.decisions[:k]):
                    return other
        return None

    def _follow(self, fqn: str, plan: Plan) -> None:
        with self._lock:
            self._by_fqn[fqn] = plan
            self._by_pattern[_fqn_pattern(fqn)] = plan

    def _forget(self, fqn: str) -> None:
        """``fqn``'s call diverged from every cached plan: its next call calibrates."""
        with self._lock:
            self._by_fqn.pop(fqn, None)
            self._recalibrate.add(fqn)

    def _adopt(self, fqn: str, problem: _Problem) -> Plan:
        planner = self.peak_planner
        with self._lock:
            self._calibrations += 1
            plan = self._plans.get(problem.signature)
            if plan is None:
                if planner is not None:  # the floor until a step is measured (Note [The peak model])
                    plan = problem.make_plan(self, frozenset())
                    planner.problems.setdefault(problem.signature, problem)
                else:
                    plan = problem.plan(self)
                self._plans[problem.signature] = plan
                self.plans_made += 1
            own = self._fqn_plans.get(fqn, {}).get(problem.signature)
            if own is not None:  # a peak target planned this module in this structure
                plan = own
            self._by_fqn[fqn] = plan
            self._by_pattern[_fqn_pattern(fqn)] = plan
            self._recalibrate.discard(fqn)
            return plan

    def _set_plans(self, plans: dict[str, Plan]) -> None:
        """The plans the modules' next calls follow (a peak target's global plan)."""
        with self._lock:
            self._by_fqn.update(plans)
            for fqn, plan in plans.items():
                self._recalibrate.discard(fqn)
                self._fqn_plans.setdefault(fqn, {})[plan.signature] = plan

    def _cost_model(self, device: torch.device) -> _CostModel:
        if self._cost is None or self._cost.device != device:
            self._cost = _CostModel.for_device(device)
        return self._cost

    # ---- what was chosen ------------------------------------------------------------------
    def plan(self, module_fqn: str = "") -> Plan | None:
        """The plan ``module_fqn``'s next call follows (``None`` before its calibration)."""
        return self._plan_for(module_fqn)[0]

    def format_plan(self, module_fqn: str | None = None) -> str:
        """A table per planned module: op, output bytes, estimated cost, saved or not;
        with a ``peak`` target first the target, the measured floor, the predicted and
        the measured peak and the measured steps."""
        head = self._planner.describe() + "\n\n" if self._planner is not None else ""
        return head + self._format_plans(module_fqn)

    def _format_plans(self, module_fqn: str | None) -> str:
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
        if self._fraction is not None:
            what = f"fraction={self._fraction!r}"
        elif self._bytes is not None:
            what = f"bytes={self._bytes!r}"
        else:
            what = f"peak={self._peak_arg!r}" + (", strict=True" if self._strict else "")
        return f"MemoryBudget({what})"

    def __reduce__(self) -> tuple:
        # Plans hold ops and are rebuilt after loading (the first call calibrates again).
        if self._fraction is not None:
            return (MemoryBudget, (self._fraction,))
        if self._bytes is not None:
            return (_budget_of_bytes, (self._bytes,))
        return (_budget_of_peak, (self._peak_arg, self._strict))


def _budget_of_bytes(nbytes: Any) -> MemoryBudget:
    return MemoryBudget(bytes=nbytes)


def _budget_of_peak(peak: Any, strict: bool) -> MemoryBudget:
    return MemoryBudget(peak=peak, strict=strict)


def _fqn_pattern(fqn: str) -> str:
    """``blocks.3.mlp`` -> ``blocks.#.mlp``: the modules of one list share a pattern."""
    return ".".join("#" if part.isdigit() else part for part in fqn.split("."))


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
        formula = flop_registry.get(_FLOP_ALIASES.get(packet, packet)) if packet is not None else None
        if formula is not None:
            try:
                flops = int(formula(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not accept these arguments
                flops = 0
        moved = _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
        return flops, max(flops / self.flops_per_s, moved / self.bytes_per_s)


#: Ops the FLOP registry has no formula for, costed with the formula of an op that does
#: the same arithmetic (CPU flash attention: the CUDA kernel's; same q/k/v arguments first).
_FLOP_ALIASES = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: torch.ops.aten._scaled_dot_product_flash_attention,
}

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
    held: Any = None  # its output, held until the region exits (Note [A calibration keeps what its plan saves])


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
        return self.make_plan(budget, saved, limit)

    def frontier(self) -> list[_Option]:
        """Saved sets that are cheapest for their bytes, fewest bytes first (a peak
        target's options for this structure: Note [The peak model] in _peak.py). Every
        subset of the candidates up to ``_EXACT_UP_TO`` of them; else the greedy path
        and each single candidate."""
        cands = self.candidates
        if len(cands) <= _EXACT_UP_TO:
            sets = [frozenset(c for i, c in enumerate(cands) if mask >> i & 1) for mask in range(1 << len(cands))]
        else:
            sets = [frozenset()] + [chosen for chosen, _, _ in self._greedy_path()]
            sets += [frozenset((c,)) for c in cands]
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

    def make_plan(self, budget: MemoryBudget, saved: frozenset[int], limit: int | None = None) -> Plan:
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


class _BudgetRegion:
    """The policy of one region under a :class:`MemoryBudget` (Note [Calibrate, plan,
    replay the plan]); also the region's observer while it calibrates."""

    def __init__(self, budget: MemoryBudget, fqn: str) -> None:
        self.budget = budget
        self.fqn = fqn
        self.plan, self.may_follow = budget._plan_for(fqn)
        self.calls = 0
        self.current: int | None = None  # call index of the op being decided (None: not structure)
        self.diverged = False
        # Observing the ops as a calibration (also while following a cached plan that has
        # answered only PREFER_RECOMPUTE so far: Note [Identical blocks share the first step]).
        self.recording = False
        self.signature: list[tuple] = []
        self.records: list[_Record] = []
        self.graph: Any = None
        self.observing = False  # self._observe is installed on the graph
        self.previous_observer: Any = None
        self.first_handle = 0
        self.allow_mutation = False
        self.cost: _CostModel | None = None
        self.scopes: list[tuple[int, bool]] = []  # open FSDP profiler scopes: (handle key, FSDP's own ops)
        self.fsdp_own = False  # inside a scope of FSDP's own ops (Note [FSDP's own ops are not structure])
        self.peak_call: Any = None  # (step, call index) of a peak target (_peak.py)
        self.problem_signature: tuple | None = None  # the structure this region calibrated

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if (op is _SCOPE_ENTER or op is _SCOPE_EXIT) and self._fsdp_scope(op, args, ctx.op_output):
            self.current = None
            return _PR
        if self.fsdp_own:  # FSDP's own op: not structure, never saved by a plan
            self.current = None
            return _PR
        k = self.calls
        self.calls = k + 1
        self.current = k
        key = (op, _first_shape(ctx.op_output))
        plan = self.plan
        if plan is None:  # calibrating
            if k == 0 and self.may_follow:  # Note [Identical blocks share the first step]
                plan = self.budget._first_match(self.fqn, key)
                if plan is not None:
                    self.plan = plan
                    return self._recorded(plan.decisions[0], key)
            self.signature.append(key)
            return _PR
        if self.diverged:
            return _PR
        if k < len(plan.signature) and plan.signature[k] == key:
            decision = plan.decisions[k]
            return self._recorded(decision, key) if self.recording else decision
        other = self.budget._switch(plan, k, key, self.fqn)
        if other is not None:  # another cached structure that agrees so far: follow it
            self.plan = other
            decision = other.decisions[k]
            return self._recorded(decision, key) if self.recording else decision
        if self.recording:  # nothing saved so far: this region is a calibration after all
            self.plan = None
            self.signature.append(key)
            return _PR
        self.diverged = True  # an unknown structure: recompute the rest, calibrate next time
        return _PR

    def _recorded(self, decision: CheckpointPolicy, key: tuple) -> CheckpointPolicy:
        """A plan's decision in a region still recording as a possible calibration: it
        stops at the plan's first save (it can no longer be one)."""
        if decision is _PS:
            self.recording = False
            self.signature = []
            self.records = []
        else:
            self.signature.append(key)
        return decision

    def _fsdp_scope(self, op: Any, args: tuple, out: Any) -> bool:
        """Track FSDP's profiler scopes; True for the op that opens or closes one (Note
        [FSDP's own ops are not structure] in fsdp.py)."""
        scopes = self.scopes
        if op is _SCOPE_ENTER:
            own = own_ops_scope(args[0] if args else None)
            if own is None:
                return False
            scopes.append((_handle_key(out), own))
            self.fsdp_own = own
            return True
        if scopes and args and _handle_key(args[0]) == scopes[-1][0]:
            scopes.pop()
            self.fsdp_own = scopes[-1][1] if scopes else False
            return True
        return False

    # ---- region hooks (Note [Region-scoped policies] in _policy.py) ------------------------
    def region_enter(self, graph: Any) -> None:
        if graph is None:  # no grad: nothing is recorded
            return
        self.graph = graph
        planner = self.budget._planner
        if planner is not None:
            planner.enter(self, graph)
        if self.plan is not None:
            if graph.tracker is not None:
                graph.tracker._note_plan(self.fqn, self.plan)
            return
        frames = graph.frames
        self.allow_mutation = bool(frames) and frames[-1].fn is self and frames[-1].allow_mutation
        self.recording = True
        self.observing = True
        self.previous_observer = graph.observer
        graph.observer = self._observe
        self.first_handle = graph.packed

    def _observe(self, node: Any, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        previous = self.previous_observer
        if previous is not None:
            previous(node, func, args, kwargs, out)
        if not self.recording:
            return
        info = op_info(func)
        call = None if info.ignored else self.current
        view = info.returns_alias or info.view_src is not None
        nbytes = 0 if view else _tensor_bytes(out)
        if self.cost is None:
            device = next((t.device for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)),
                          torch.device("cpu"))
            self.cost = self.budget._cost_model(device)
        flops, seconds = (0, 0.0) if view else self.cost.estimate(func, args, kwargs, out)
        # Note [A calibration keeps what its plan saves]: hold what a plan could save.
        frames = self.graph.frames
        held = out if (
            self.budget._planner is None  # a peak target's calibration is the floor (Note [The peak model])
            and call is not None and nbytes > 0 and node.saved is None and node.rng is None and not node.must_recompute
            and not node.writes and node.via is None and frames and frames[-1].fn is self
        ) else None
        self.records.append(_Record(node.seq, call, func, node, nbytes, flops, seconds,
                                    tuple(m.seq for m in node.inputs[1::3]), view, held))

    def region_exit(self, graph: Any, failed: bool) -> None:
        if self.graph is None:
            return
        try:
            self._region_exit(graph, failed)
        finally:
            planner = self.budget._planner
            if planner is not None:
                planner.exit(self)

    def _region_exit(self, graph: Any, failed: bool) -> None:
        if self.observing:
            graph.observer = self.previous_observer
        plan = self.plan
        if plan is not None:
            if failed:
                self.records = []
                return
            if not self.diverged and self.calls == len(plan.signature):
                self.records = []
                self.budget._follow(self.fqn, plan)  # it may have switched plans
                if self.observing and graph.tracker is not None:  # followed a cached plan from the start
                    graph.tracker._note_plan(self.fqn, plan)
                return
            if not self.recording:
                self.budget._forget(self.fqn)  # calibrate next time
                return
            # A shorter structure, and the plan saved nothing so far: a calibration after all.
        if failed:
            self.records = []
            return
        targets = {h.node.seq for h in graph.handles_since(self.first_handle)}
        forced = {r.seq for r in self.records if r.node.saved is not None and all(s is not None for s in r.node.saved)}
        written = set()  # outputs written in place later: saving one would make the write a side effect
        for r in self.records:
            writes = r.node.writes
            if writes:
                for pos, m, _ in input_refs(r.node):
                    if pos in writes:
                        written.add(m.seq)
                        if m.alias_of is not None:  # its storage's owner (Note [Aliases a schema does not declare] in _tracer.py)
                            written.add(m.alias_of[0].seq)
        problem = _Problem(self.records, targets, forced, written, tuple(self.signature))
        plan = self.budget._adopt(self.fqn, problem)
        self._keep_planned(graph, plan)
        problem.release()
        self.problem_signature = problem.signature
        self.records = []  # let the nodes and the held outputs go
        if graph.tracker is not None:
            graph.tracker._note_plan(self.fqn, plan)

    def _keep_planned(self, graph: Any, plan: Plan) -> None:
        """Save the held outputs the plan saves (Note [A calibration keeps what its plan saves])."""
        gmap = graph.map
        decisions = plan.decisions
        if gmap is None or _PS not in decisions:
            return
        # The region's frame is gone but the tracer may still be installed: what saving
        # runs (an alias of the value) is not an op of any region.
        with _disable_current_modes():
            self._save_held(graph, gmap, decisions)

    def _save_held(self, graph: Any, gmap: Any, decisions: tuple) -> None:
        for r in self.records:
            if r.held is None or r.call >= len(decisions) or decisions[r.call] is not _PS:
                continue
            node = r.node
            if node.cut or node.must_recompute:
                continue
            kept = False
            for t in flatten_outputs(r.held):
                if not isinstance(t, torch.Tensor):
                    continue
                e = gmap.get(t)
                if e is None or e[1] is not node or (e[3] is not None and e[3] != t._version):
                    continue  # no longer this op's value (written since, or remapped)
                if node.saved is not None and node.saved[e[2]] is not None:
                    continue
                graph._save_in_place(node, e[2], t, _PS, "policy", self.allow_mutation)
                kept = True
            if kept:
                graph.stats.saved_nodes += 1


def _handle_key(handle: Any) -> int:
    """Identifies a record_function handle: the ``ScriptObject`` that reaches the exit op
    is a new Python wrapper of the one the enter op returned; its hash is the object's
    address (alive while the scope is open)."""
    try:
        return hash(handle)
    except TypeError:
        return id(handle)


def _first_shape(out: Any) -> tuple | None:
    if isinstance(out, torch.Tensor):
        return tuple(out.shape)
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return tuple(o.shape)
    return None
