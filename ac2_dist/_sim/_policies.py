"""The modes a simulation runs: every policy the library takes, and what the blocks
recompute under one the simulation cannot read statically.

Note [A mode is any policy]
    A mode is ``"none"``, ``"full"``, a non-empty list of ops to save, ``"titan"``
    (torchtitan's op-level selective checkpointing rule, :class:`TorchtitanOpSAC`), a
    policy callable ``(ctx, op, *args, **kwargs) -> decision``, a policy factory (a
    callable taking no argument that returns a policy: a fresh, possibly stateful, one
    for every block call), or a per-block :class:`~ac2_dist.MemoryBudget` (a bytes or
    fraction budget). ``MemoryBudget(peak=...)`` is the simulation's ``target``: its
    planner measures steps from the allocator, which a step of fake tensors does not
    reach. A policy may decide op by op while it runs (a stateful factory, a budget), so
    what a mode recomputes is counted from its counted step itself, for every mode alike
    (full AC and save lists too, so that equal saved sets report equal figures): every
    op dispatched while an ac2 replay runs on the thread (``_thread_state().replaying``)
    is priced by the planner's cost model (:class:`_ReplayCost`) -- its FLOPs and its
    roofline seconds at the rates of the device asked for, views free. (A planned mode,
    ``target``, reports the plan's own estimate: its options' prices.)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._plan._block_problem import _CostModel
from .._region import _thread_state
from ..budget import MemoryBudget
from ..side_effects import op_info

__all__: list[str] = []

aten = torch.ops.aten


def _titan_save_ops() -> frozenset:
    names = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
             "_scaled_dot_product_fused_attention_overrideable",
             # the CPU kernel a simulation dispatches where a GPU runs flash attention
             "_scaled_dot_product_flash_attention_for_cpu", "abs", "max")
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    ops.add(aten.mm.default)
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        ops.add(functional.reduce_scatter_tensor.default)
    return frozenset(ops)


class TorchtitanOpSAC:
    """torchtitan's op-level selective checkpointing rule, one per block call: save the
    outputs of the attention ops, ``reduce_scatter``, ``abs`` and ``max``, and of every
    second matmul (the 1st, 3rd, ...: the 2nd, 4th, ... are recomputed); recompute the rest.
    A policy factory: the class itself is passed (each call makes a fresh counter)."""

    SAVE = _titan_save_ops()

    def __init__(self) -> None:
        self.mm = 0

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        if op is aten.mm.default:
            self.mm += 1
            return self.mm % 2 == 1
        return op in self.SAVE


@dataclass
class Mode:
    """A normalized mode: its report name and how ``apply_ac`` takes it."""

    name: str
    kind: str  # "none", "full", "save" (a list of ops), "policy" (counted while it runs)
    policy: Any = None
    factory: Callable[[], Any] | None = None


def _is_factory(fn: Callable) -> bool:
    """A callable that takes no argument (a policy takes at least ``ctx`` and ``op``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return not any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                   for p in params)


def normalize(mode: Any) -> Mode:
    """A user's mode as a :class:`Mode` (Note [A mode is any policy]); ValueError for
    anything else, naming it."""
    if isinstance(mode, str):
        if mode == "none":
            return Mode("no AC", "none")
        if mode == "full":
            return Mode("full AC", "full")
        if mode == "titan":
            return Mode("torchtitan op-SAC", "policy", factory=TorchtitanOpSAC)
        raise ValueError(f"ac2_dist.simulate: unknown mode {mode!r}; name 'none', 'full' or 'titan', or give a list "
                         f"of ops to save, a policy callable, a policy factory or a MemoryBudget")
    if isinstance(mode, MemoryBudget):
        if mode._peak_arg is not None:
            raise ValueError("ac2_dist.simulate: a MemoryBudget(peak=...) mode is the simulation's target: pass "
                             "target=... (--target), which plans it on the simulated blocks")
        return Mode(f"budget {mode!r}", "policy", policy=mode)
    if isinstance(mode, (list, tuple)):
        if not mode:
            raise ValueError("ac2_dist.simulate: a save-list mode needs at least one op")
        return Mode("save: " + ",".join(str(getattr(op, "__name__", op)).split(".")[0] for op in mode), "save",
                    policy=list(mode))
    if callable(mode):
        name = getattr(mode, "__qualname__", None) or getattr(type(mode), "__qualname__", repr(mode))
        if _is_factory(mode):
            return Mode(f"policy factory {name}", "policy", factory=mode)
        return Mode(f"policy {name}", "policy", policy=mode)
    raise ValueError(f"ac2_dist.simulate: a mode is 'none', 'full', 'titan', a list of ops to save, a policy "
                     f"callable, a policy factory or a MemoryBudget, got {mode!r}")


class _ReplayCost(TorchDispatchMode):
    """FLOPs and roofline seconds of the ops dispatched while an ac2 replay runs on this
    thread (Note [A mode is any policy])."""

    def __init__(self, rates: tuple[float, float]) -> None:
        super().__init__()
        self.cost = _CostModel(torch.device("cpu"), *rates)
        self.replaying = _thread_state().replaying
        self.flops = 0
        self.seconds = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.replaying.depth:
            info = op_info(func)
            if info.aliases:  # a view moves nothing: priced as the planner does
                return out
            flops, seconds = self.cost.estimate(func, args, kwargs, out)
            self.flops += flops
            self.seconds += seconds
        return out
