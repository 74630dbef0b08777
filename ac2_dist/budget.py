"""Memory-budget policy: the user names the memory, ac2 chooses what to save.

    ac.apply_ac(model, ac.MemoryBudget(0.5), modules=[Block])       # a fraction
    ac.apply_ac(model, ac.MemoryBudget(bytes=64 << 20), modules=[Block])
    ac.apply_ac(model, ac.MemoryBudget(lambda rank: 0.25 if rank == 0 else 0.75), modules=[Block])
    ac.apply_ac(model, ac.MemoryBudget(peak="70GiB"), modules=[Block])  # the step's peak

What a budget bounds, per region (one call of a checkpointed module): the bytes of the
op outputs backward still holds after forward, side-effect outputs (collectives, saved
random ops, writes) included; the region's inputs (the block input, parameters) are
not counted, since every policy keeps them. The *floor* is that amount under
``"recompute_all"``, the *top* under ``"must_save_all"``. ``fraction=f`` keeps it at
most ``floor + f * (top - floor)``; ``bytes=b`` at most ``floor + b``. So 0 is
``"recompute_all"``, and 1 (or ``b >= top - floor``) saves every output backward needs,
as ``"must_save_all"`` does. ``peak=`` bounds the whole step's peak instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ._plan import _plan_file
from ._plan._block_problem import Plan, _CostModel, _Problem
from ._plan._budget_region import _BudgetRegion
from ._plan._peak import PeakPlanner
from ._sizes import human_bytes as _human
from ._sizes import parse_size

__all__ = ["MemoryBudget", "Plan"]

# Note [What a budget bounds]
# Per region, with S the set of op outputs the plan saves: ``M(S)`` is the bytes of
# the saved op outputs backward still holds after forward (outputs autograd saves,
# and saved inputs of the ops it recomputes), side-effect outputs (collectives, saved
# random ops, writes) included; region inputs (the block input, parameters) are not
# counted (they are kept under every policy). The floor is ``M`` under
# ``"recompute_all"``, the top ``M`` under ``"must_save_all"``; ``fraction=f`` keeps
# ``M(S) <= floor + f * (top - floor)``; ``bytes=b`` keeps ``M(S) <= floor + b``.
# 0 is ``"recompute_all"``, 1 (or ``b >= top - floor``) saves every output backward
# needs, as ``"must_save_all"`` does.


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class MemoryBudget:
    """A policy that saves, per region, the op outputs that minimize recompute cost
    within a memory budget: the bytes of op outputs a region keeps for backward
    (side-effect outputs included, its inputs and parameters not), counted above what
    ``"recompute_all"`` keeps.

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
            each step and corrected until the measured peak fits.
            On CUDA the scale is ``torch.cuda.max_memory_allocated``'s; on CPU the peak
            above what was allocated when the step began: after ``apply_ac(model, ...)``
            at ``model``'s forward, as ``memory.track(model)``'s peaks (with ``plan``:
            the simulated bytes alive then plus that peak, so the target means what it
            meant to the simulation).
        strict: with ``peak``: a target below the measured floor raises (at the next
            forward) instead of warning once and running at the floor.
        offload_block_inputs: with ``peak``: when a step at the floor is over the target
            and the blocks follow an offload schedule (``ac2_dist.Offload``, which
            ``apply_ac`` gives its modules on CUDA) that keeps their inputs on the device,
            the blocks' inputs are offloaded to host memory (``Offload(block_inputs=True)``,
            with a warning) and the floor is measured again before the target is called
            infeasible. ``False`` keeps them on the device.
        plan: with ``peak``: the path of a plan file written by
            ``ac2_dist.simulate`` (``SimulationReport.save_plan`` or ``python -m
            ac2_dist.simulate ... --plan-out``). The first step follows it instead of
            calibrating at the floor; the measured steps then verify and correct it as
            usual. Pass the target the simulation was given: on CUDA and on CPU alike
            it is the rank's total. A checkpointed module the file does not name, or a block whose ops
            differ from the file's, raises ``ValueError`` naming the first difference.
            Under a ``torch.distributed.pipelining`` schedule steps interleave and
            cannot be measured: a plan the simulation made for the pipeline rank
            (``simulate(..., pipeline=..., target=...)``, ``--pp ... --target``) is
            followed as simulated, never corrected; without such a plan the blocks stay
            at the floor (``"recompute_all"``). A pipeline rank's plan in a step that
            runs outside a pipeline schedule raises ``RuntimeError``.

    Usable wherever a policy is (``apply_ac``, ``wrap``, ``apply_ac_policy``,
    ``apply_ac_policy_fn``, ``checkpoint``), nested with other policies (its answers
    are ``PREFER_*``: a ``MUST_*`` of another region wins). The first call of each
    block structure calibrates: it runs with every output saved and measures each op's
    size and cost; later calls of that structure (and identical blocks) follow the plan
    made from it. See :meth:`format_plan` for what was chosen. Eager only
    (``torch.compile`` has its own: ``torch._functorch.config.activation_memory_budget``).

    Example::

        import torch
        import ac2_dist as ac

        Layer = torch.nn.TransformerEncoderLayer
        model = torch.nn.Sequential(*[Layer(64, 4, 256, dropout=0.0, batch_first=True) for _ in range(4)])
        budget = ac.MemoryBudget(0.5)   # half-way from "recompute_all" to "must_save_all", per layer
        ac.apply_ac(model, budget, modules=[Layer])
        model(torch.randn(2, 16, 64)).sum().backward()   # the first call calibrates, the rest follow the plan
        print(budget.format_plan())
    """

    # Note [Calibrate, plan, replay the plan] in _budget_region.py: how the first call of
    # a block structure calibrates; Note [What a budget bounds] (above): the bound.

    def __init__(
        self,
        fraction: float | Callable[[int], float] | None = None,
        *,
        bytes: int | Callable[[int], int] | None = None,  # noqa: A002 - the public keyword (MemoryBudget(bytes=...))
        peak: int | str | Callable[[int], int | str] | None = None,
        strict: bool = False,
        plan: str | None = None,
        offload_block_inputs: bool = True,
    ) -> None:
        given = [name for name, v in (("fraction", fraction), ("bytes", bytes), ("peak", peak)) if v is not None]
        if len(given) != 1:
            raise TypeError("ac2_dist.MemoryBudget: pass exactly one of fraction, bytes or peak"
                            + (f" (got {' and '.join(given)})" if given else ""))
        if not isinstance(strict, bool):
            raise TypeError(f"ac2_dist.MemoryBudget: strict must be a bool, got {strict!r}")
        if not isinstance(offload_block_inputs, bool):
            raise TypeError(f"ac2_dist.MemoryBudget: offload_block_inputs must be a bool, got {offload_block_inputs!r}")
        if strict and peak is None:
            raise TypeError("ac2_dist.MemoryBudget: strict applies to a peak target (MemoryBudget(peak=..., strict=True))")
        self._fraction = fraction
        self._bytes = bytes
        self._peak_arg = peak
        self._strict = strict
        self._offload_block_inputs = offload_block_inputs
        if plan is not None and peak is None:
            raise TypeError("ac2_dist.MemoryBudget: plan applies to a peak target (MemoryBudget(peak=..., plan=path))")
        self._plan_path = plan
        self._loaded = _plan_file.load(plan) if plan is not None else None  # read now: errors before any step
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
        """The byte limit of a region whose floor (``"recompute_all"``) and top
        (``"must_save_all"``) are known: ``floor + fraction * (top - floor)``, or
        ``floor + bytes``."""
        # See Note [What a budget bounds] above.
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
                created = self._planner is None
                if created:
                    self._planner = PeakPlanner(self, target)
            if created and self._loaded is not None:  # outside the lock: installing takes it
                _plan_file.install(self._planner, self._loaded)
        return self._planner

    def close(self) -> None:
        """Stop the measurement a ``peak`` target may have running.

        While it verifies its plan (the first steps after the first, until the measured
        peak fits the target and the plan stops changing) the planner traces allocations
        from a step's first region to the next step's, when no ``memory.track`` runs.
        Call this if training stops during those steps and the process goes on (e.g.
        before starting ``torch.profiler``); at exit it stops by itself. A later step
        measures again if the plan has not settled."""
        # See Note [Verify, correct, stay put] in _plan/_peak_verify.py.
        if self._planner is not None:
            self._planner.close()

    def _watch_model(self, model: torch.nn.Module) -> None:
        """``apply_ac(model, budget, ...)``: a peak target's steps begin at ``model``'s
        forward, where ``memory.track(model)``'s do (Note [What a peak target bounds])."""
        planner = self.peak_planner
        if planner is not None:
            planner.watch(model)

    # ---- regions ------------------------------------------------------------------------
    def new_region_policy(self, module_fqn: str) -> _BudgetRegion:
        """The policy of one region (one call of a checkpointed module); called by ac2."""
        planner = self.peak_planner
        if planner is not None:
            module_fqn = planner.before_region(module_fqn)
            if self._loaded is not None and torch.is_grad_enabled() and module_fqn not in self._loaded.fqns:
                planner.close()  # the step it began measuring stops here
                raise ValueError(_plan_file.mismatch(self._loaded, module_fqn, None, None))
        return _BudgetRegion(self, module_fqn)

    def _mismatch(self, fqn: str, k: int, key: tuple | None) -> None:
        """A block diverged from its plan at op ``k``: refused if the plan came from a file."""
        # Note [A plan file is the planner's state] in _plan/_plan_file.py
        if self._loaded is not None and fqn in self._loaded.fqns:
            self.close()  # the step it began measuring stops here
            raise ValueError(_plan_file.mismatch(self._loaded, fqn, k, key))

    def _plan_for(self, fqn: str) -> tuple[Plan | None, bool]:
        """(the plan ``fqn``'s call follows, whether a call without one may follow a
        cached plan of the same structure instead of calibrating)."""
        with self._lock:
            plan = self._by_fqn.get(fqn)
            return plan, plan is None and bool(self._plans) and fqn not in self._recalibrate

    def _first_match(self, fqn: str, key: tuple) -> Plan | None:
        """A cached plan whose first op is ``key`` (a module without a plan of its own
        follows it: Note [Identical blocks share the first step] in _budget_region.py);
        first the plan of its siblings (``blocks.0`` for ``blocks.3``)."""
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
                if planner is not None:  # the floor until a step is measured (Note [The peak model] in _peak_model.py)
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

    def format_plan(self, module_fqn: str | None = None, *, detail: bool = False) -> str:
        """What the budget chose, as text.

        By default a summary of a few lines whatever the number of blocks: with a
        ``peak`` target the target and the planner's state, the measured floor, the
        predicted and the measured peak; then, summed over the planned modules, the
        bytes saved above the floor, the op outputs saved and recomputed, and the
        estimated recompute cost per step. ``detail=True``: the full text instead, the
        measured steps and a table per planned module (op, output bytes, estimated
        cost, saved or not). ``module_fqn``: that module only."""
        head = self._planner.describe() if self._planner is not None else ""
        if detail:
            return (head + "\n\n" if head else "") + self._format_plans(module_fqn)
        lines = head.splitlines()[:2] if head else [f"{self!r}"]
        with self._lock:
            items = sorted(self._by_fqn.items()) if module_fqn is None else \
                [(module_fqn, self._by_fqn.get(module_fqn))]
        plans = [plan for _, plan in items if plan is not None]
        waiting = [fqn or "(region)" for fqn, plan in items if plan is None]
        if plans:
            rows = [row for plan in plans for row in plan.rows if row[2] > 0]  # views hold no bytes
            saved = sum(1 for row in rows if row[4])
            structures = len({p.signature for p in plans})
            lines.append(
                f"  {_count(len(plans), 'planned module')} ({_count(structures, 'structure')}): "
                f"{_human(sum(p.saved_bytes - p.floor_bytes for p in plans))} saved above the floor "
                f"(of {_human(sum(p.top_bytes - p.floor_bytes for p in plans))} possible); "
                f"{_count(saved, 'op output')} saved, {len(rows) - saved} recomputed")
            if self._planner is None:  # a peak target's second line has it
                lines.append(f"  estimated recompute {sum(p.recompute_seconds for p in plans) * 1e3:.3f} ms "
                             f"({sum(p.recompute_flops for p in plans) / 1e6:.1f} MFLOP) per step")
        if waiting:
            lines.append(f"  no plan yet (the first call calibrates): {', '.join(waiting)}")
        elif not plans:
            lines.append("  (no plans yet)")
        lines.append("  per module and per measured step: format_plan(detail=True)")
        return "\n".join(lines)

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
            what += "" if self._offload_block_inputs else ", offload_block_inputs=False"
            what += f", plan={self._plan_path!r}" if self._plan_path is not None else ""
        return f"MemoryBudget({what})"

    def __reduce__(self) -> tuple:
        # Plans hold ops and are rebuilt after loading (the first call calibrates again).
        if self._fraction is not None:
            return (MemoryBudget, (self._fraction,))
        if self._bytes is not None:
            return (_budget_of_bytes, (self._bytes,))
        return (_budget_of_peak, (self._peak_arg, self._strict, self._plan_path, self._offload_block_inputs))


def _budget_of_bytes(nbytes: Any) -> MemoryBudget:
    return MemoryBudget(bytes=nbytes)


def _budget_of_peak(peak: Any, strict: bool, plan: str | None = None, inputs: bool = True) -> MemoryBudget:
    return MemoryBudget(peak=peak, strict=strict, plan=plan, offload_block_inputs=inputs)


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _fqn_pattern(fqn: str) -> str:
    """``blocks.3.mlp`` -> ``blocks.#.mlp``: the modules of one list share a pattern."""
    return ".".join("#" if part.isdigit() else part for part in fqn.split("."))
