"""torch's optimal SAC solver as a peer in the Pareto benchmark (needs ``pulp`` and ``pwlf``).

torch ships a module-level MILP (``torch.distributed._tools.sac_ilp.sac_milp``) that
decides, from one profiled step, which modules to checkpoint and what fraction of each
one's activation memory to discard, and a per-module knapsack
(``get_optimal_checkpointing_policy_per_module``) that turns a fraction into a save or
recompute decision per op. Its statistics come from ``MemTracker``, ``RuntimeEstimator``
and ``SACEstimator`` run under ``FakeTensorMode``; their runtime estimates are CUDA's
(cuda events or the GPU's roofline). On a CPU this module gives them the same roofline
with the CPU's own rates, measured here: ``max(FLOPs / matmul rate, bytes / copy rate)``
per op (torch's formula, FLOPs from torch's FLOP counter).

``plans(build_fn, loss_fn, ids, layer_types, count)`` profiles a fake copy of the
model once, solves ``sac_milp`` at ``count`` budgets (GiB, in its own model of the step:
parameters, gradients and activations) restricted to the decoder layers, and returns
for each budget the per-layer op decisions; ``checkpointed(model, plan)`` applies one
under torch's SAC (``create_selective_checkpoint_contexts``), the way the solver's
decisions are meant to be run.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)


def available() -> bool:
    try:
        import pulp  # noqa: F401
        import pwlf  # noqa: F401
    except ImportError:
        return False
    return True


def cpu_rates() -> tuple[float, float]:
    """(FLOP/s of an fp32 1024^3 matmul, bytes/s of a 64 MiB add), best of 5."""
    a = torch.randn(1024, 1024)
    b = torch.randn(16 << 20)
    mm, bw = [], []
    for _ in range(5):
        t = time.perf_counter()
        a @ a
        mm.append(time.perf_counter() - t)
        t = time.perf_counter()
        b + 1.0
        bw.append(time.perf_counter() - t)
    return 2 * 1024**3 / min(mm), 2 * b.numel() * 4 / min(bw)  # the add reads b and writes its output


def _roofline(flops_per_s: float, bytes_per_s: float) -> Callable:
    """A ``(func, args, kwargs) -> (out, ms)`` estimator: torch's roofline, CPU rates."""
    from torch.utils import _pytree as pytree
    from torch.utils._runtime_estimation import _IGNORE_OPS, get_num_bytes
    from torch.utils.flop_counter import flop_registry

    def estimate(func: Any, args: Any, kwargs: Any) -> tuple[Any, float]:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in _IGNORE_OPS:
            return out, 0.0
        flat_in = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        flat_out = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        nbytes = sum(get_num_bytes(t) for t in flat_in + flat_out)
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        return out, max(flops / flops_per_s, nbytes / bytes_per_s) * 1e3

    return estimate


class _Profile:
    """One fake step's statistics, as torch's SAC solver reads them."""

    def __init__(self, build_fn: Callable[[], torch.nn.Module], loss_fn: Callable, ids: torch.Tensor,
                 layer_types: tuple[type, ...]) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
        from torch.distributed._tools.mem_tracker import MemTracker, _ModState
        from torch.distributed._tools.runtime_estimator import RuntimeEstimator
        from torch.distributed._tools.sac_estimator import SACEstimator

        estimate = _roofline(*cpu_rates())
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = build_fn()
            fids = torch.empty_like(ids).copy_(ids)

            def one_step() -> None:
                model.zero_grad(set_to_none=True)
                loss_fn(model, fids).backward()

            tracker = MemTracker()
            tracker.track_external(model)
            with tracker as mt:
                for i in range(2):
                    one_step()
                    if i == 1:
                        last = mt.get_tracker_snapshot("current")
                    else:
                        mt.reset_mod_stats()
            for stats in tracker.memory_tracking.values():
                # ModTracker's backward hooks do not fire for modules whose inputs need no
                # grad (the embeddings) or whose outputs need none (a rotary table): torch's
                # own tests fill the post-backward snapshot with the step's last one; the
                # other backward states are filled the same way
                for state in (_ModState.PRE_BW, _ModState.PEAK_BW, _ModState.POST_BW):
                    if state not in stats.snapshots:
                        stats.snapshots[state] = [copy.deepcopy(last)]
            runtime = RuntimeEstimator()
            runtime("operator-level-cost-model")
            runtime._estimate = estimate
            with runtime:
                one_step()
            sac = SACEstimator()
            sac("operator-level-cost-model")
            sac._estimate_runtime = estimate
            model.zero_grad(set_to_none=True)
            with sac:
                out = loss_fn(model, fids)
            out.backward()
            info = aggregate_stats(model, tracker, runtime, sac, torch.device("cpu"))
        self.graph = parse_module_info(info)
        self.sac_stats = sac.sac_mod_stats
        root = type(model).__name__
        self.units = [f"{root}.{name}" for name, m in model.named_modules() if isinstance(m, layer_types)]
        for node in self.graph.nodes:
            if node["fqn"] not in self.units:  # never checkpointed (y = 0): no trade-off curve,
                node["n_segments"] = 0          # whose fit on a 2-op module can be NaN

    def baseline(self) -> tuple[float, float]:
        """(peak GiB, compute ms) of no AC in the solver's own model."""
        from torch.distributed._tools.ilp_utils import get_peak_memory_runtime_baseline

        peak, ms = get_peak_memory_runtime_baseline(self.graph)
        return peak / 2**30, ms


def plans(build_fn: Callable[[], torch.nn.Module], loss_fn: Callable, ids: torch.Tensor,
          layer_types: tuple[type, ...], count: int) -> list[dict]:
    """``sac_milp`` at ``count`` budgets evenly spaced from the least its own model of the
    step finds feasible (found by bisection) to its no-AC peak, the last left out (no AC):
    for each, ``{"budget_gib", "discard": {fqn: ratio}, "ops": {fqn: [1 save / 0
    recompute per op]}, "solver_ms", "solver_peak_gib"}``."""
    from torch.distributed._tools.sac_ilp import (
        get_optimal_checkpointing_policy_per_module,
        sac_milp,
    )

    prof = _Profile(build_fn, loss_fn, ids, layer_types)
    top, _ = prof.baseline()

    def solve(budget: float) -> tuple[dict, float, int]:
        return sac_milp(copy.deepcopy(prof.graph), memory_budget=budget, ac_units=prof.units)

    import logging

    logging.getLogger("torch.distributed._tools.sac_ilp").setLevel(logging.CRITICAL)  # infeasible probes
    lo, hi = 0.0, top  # infeasible, feasible
    for _ in range(12):
        mid = (lo + hi) / 2
        if solve(mid)[2] < 0:
            lo = mid
        else:
            hi = mid
    out = []
    for k in range(count):
        budget = hi + (top - hi) * k / count
        discard, ms, peak = solve(budget)
        if peak < 0 or not discard:
            continue
        ops = {fqn: get_optimal_checkpointing_policy_per_module(prof.sac_stats[fqn], 1.0 - r)
               for fqn, r in discard.items()}
        out.append({"budget_gib": budget, "discard": discard, "ops": ops,
                    "solver_ms": ms, "solver_peak_gib": peak / 2**30})
    print(f"  sac_milp: no-AC peak {top:.4f} GiB in its model, least feasible {hi:.4f} GiB; "
          f"{len(out)} plans", flush=True)
    return out


class _OpListPolicy:
    """Save or recompute each op of one layer call by its index in the solver's op list
    (the ops ``SACEstimator`` counts: those torch's SAC does not ignore, less ``lift_fresh``
    and ``clone``); forward and torch's recompute are counted apart."""

    def __init__(self, decisions: list[int]) -> None:
        from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP

        self.decisions, self.skip = decisions, OPS_TO_ALWAYS_SKIP
        self.seen = {False: 0, True: 0}

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in self.skip:
            return CheckpointPolicy.PREFER_RECOMPUTE
        again = bool(getattr(ctx, "is_recompute", False))
        i = self.seen[again]
        self.seen[again] += 1
        if i >= len(self.decisions):
            raise RuntimeError(f"op {op} is number {i} of a layer call; the solver profiled {len(self.decisions)}")
        return CheckpointPolicy.MUST_SAVE if self.decisions[i] else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(model: torch.nn.Module, plan: dict) -> torch.nn.Module:
    """A copy of ``model`` with each module the plan checkpoints under torch's SAC."""
    model = copy.deepcopy(model)
    root = type(model).__name__
    for name, m in model.named_modules():
        decisions = plan["ops"].get(f"{root}.{name}")
        if decisions is None:
            continue
        m.forward = functools.partial(
            checkpoint, m.forward, use_reentrant=False,
            context_fn=functools.partial(lambda d: create_selective_checkpoint_contexts(_OpListPolicy(d)), decisions))
    return model
