"""Helpers the benchmark scripts share (bench_core.py, bench.py, bench_hf.py,
gpu_check.py): the mode names and how a model is checkpointed under each, the step and
its loss, timing rounds (every mode once per round) and their per-round ratios,
allocator measurements of one step, backward FLOPs, JSON writing. Moved verbatim from
bench_core.py; each benchmark script keeps its own CLI."""

from __future__ import annotations

import copy
import functools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

import ac2_dist as ac
from ac2_dist._measure._alloc import AllocationTrace
from ac2_dist._plan._flops import op_flops  # torch's formulas, with what its registry does not give

aten = torch.ops.aten
SAVE_OPS = [aten.mm.default, aten.addmm.default]
MODES = ["no-ac", "torch-full", "torch-sac", "ac2-full", "ac2-sac"]
PAIRS = [("ac2-full", "torch-full"), ("ac2-sac", "torch-sac")]


def checkpointed(model: nn.Module, mode: str, types: tuple, rng: str = "save") -> nn.Module:
    """A copy of ``model`` with every module of ``types`` checkpointed under ``mode``."""
    model = copy.deepcopy(model)
    if mode == "no-ac":
        return model
    if mode.startswith("ac2"):
        return ac.apply_ac(model, "recompute_all" if mode == "ac2-full" else SAVE_OPS, modules=list(types),
                           rng=rng)
    kwargs = {"use_reentrant": False}
    if mode == "torch-sac":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, SAVE_OPS)
    for m in model.modules():
        if isinstance(m, types):
            m.forward = functools.partial(checkpoint, m.forward, **kwargs)
    return model


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def step(model: nn.Module, x: Any, loss: Callable = forward) -> None:
    model.zero_grad(set_to_none=True)
    loss(model, x).backward()


def write_json(path: str | None, out: dict) -> dict:
    """Write ``out`` to ``path`` (if given); returns ``out``."""
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
    return out


def ratio_stats(ours: list[float], theirs: list[float]) -> dict[str, float]:
    """Per-round ratios ours[i] / theirs[i] (times taken in the same round): median, min, max."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def timed_rounds(steps: dict[str, Callable[[], None]], rounds: int, warmup: int,
                 sync: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Seconds of each step per round; every round runs every mode once, in order."""
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    times: dict[str, list[float]] = {m: [] for m in steps}
    for _ in range(rounds):
        for m, fn in steps.items():
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            fn()
            if sync is not None:
                sync()
            times[m].append(time.perf_counter() - t0)
    return times


def measure_memory(model, x, loss_fn: Callable = forward) -> dict:
    """Peak of forward+backward, of forward, and bytes kept after forward: bytes above
    what was allocated when the step began (allocator events)."""
    model.zero_grad(set_to_none=True)
    with AllocationTrace() as trace:
        trace.mark("forward")
        loss = loss_fn(model, x)
        trace.mark("backward")
        loss.backward()
        del loss
        trace.mark("end")
    return {
        "peak_bytes": trace.whole.peak_bytes,
        "forward_peak_bytes": trace.phases["forward"].peak_bytes,
        "kept_after_forward_bytes": trace.phases["backward"].start_bytes,
    }


def backward_flops(loss_fn: Callable[[], torch.Tensor], counter: Callable[[], Any] | None = None) -> int:
    """Backward FLOPs (recompute included) = FLOPs of forward+backward - of forward,
    counted by ``counter()`` (default ``FlopCounterMode``; :class:`PlainFlops`
    dispatches every op unchanged).

    The counter is active over forward *and* backward: torch's SAC fails when a
    dispatch mode appears only during its recompute (it sees extra ops and raises
    "not found in storage"), so counting backward alone cannot measure it.
    """
    make = counter or functools.partial(FlopCounterMode, display=False)
    fwd = make()
    with fwd:
        loss_fn()
    both = make()
    with both:
        loss_fn().backward()
    return both.get_total_flops() - fwd.get_total_flops()


class PlainFlops(torch.utils._python_dispatch.TorchDispatchMode):
    """FLOPs from torch's formula registry, dispatching every op unchanged (FlopCounterMode
    decomposes ops it has no formula for -- CPU flash attention -- and a checkpointed
    block then shows ac2 another structure). CPU flash attention is counted with the
    CUDA flash kernel's formula (the same q/k/v arithmetic), grouped-query attention on
    torch 2.10-2.11 as 2.13 counts it (ac2_dist/_plan/_flops.py); a formula that fails raises."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def get_total_flops(self) -> int:  # FlopCounterMode's name, for backward_flops
        return self.flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.flops += op_flops(func, args, kwargs, out, strict=True)
        return out


def plain_backward_flops(model, x) -> int:
    """:func:`backward_flops` of ``model`` counted by :class:`PlainFlops`."""
    model.zero_grad(set_to_none=True)
    return backward_flops(lambda: forward(model, x), PlainFlops)


def measure_flops(model, x) -> int:
    model.zero_grad(set_to_none=True)
    return backward_flops(lambda: forward(model, x))
