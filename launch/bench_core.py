"""Single-process benchmark: ac2_dist vs torch.utils.checkpoint, measured side by side.

Runs a stack of GPT blocks (each block checkpointed on its own) under five modes --
no AC, torch full AC, torch SAC (save mm/addmm), ac2 full AC, ac2 SAC (same save
list) -- and prints, per mode: peak memory of forward+backward and activations kept
after forward (allocator events via torch.profiler), backward FLOPs (FlopCounterMode,
recompute included) and the median step time; then ac2/torch ratios.

    python launch/bench_core.py                  # D=512, T=256, B=4, 4 blocks, CPU
    python launch/bench_core.py --json out.json  # also write the figures
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPTStack  # noqa: E402

import ac2_dist as ac  # noqa: E402
from ac2_dist._alloc import AllocationTrace  # noqa: E402

aten = torch.ops.aten
SAVE_OPS = [aten.mm.default, aten.addmm.default]
MODES = ["no-ac", "torch-full", "torch-sac", "ac2-full", "ac2-sac"]


def block_runner(mode: str) -> Callable:
    if mode == "no-ac":
        return lambda blk, x: blk(x)
    if mode == "torch-full":
        return lambda blk, x: checkpoint(blk, x, use_reentrant=False)
    if mode == "torch-sac":
        ctx_fn = functools.partial(create_selective_checkpoint_contexts, SAVE_OPS)
        return lambda blk, x: checkpoint(blk, x, use_reentrant=False, context_fn=ctx_fn)
    policy = "recompute_all" if mode == "ac2-full" else SAVE_OPS

    def run(blk, x):
        with ac.apply_ac_policy(policy):
            return blk(x)

    return run


def forward(model: GPTStack, x: torch.Tensor, runner: Callable) -> torch.Tensor:
    for blk in model.blocks:
        x = runner(blk, x)
    return x.float().pow(2).mean()


def step(model, x, runner) -> None:
    model.zero_grad(set_to_none=True)
    forward(model, x, runner).backward()


def measure_memory(model, x, runner) -> dict:
    model.zero_grad(set_to_none=True)
    with AllocationTrace() as trace:
        trace.mark("forward")
        loss = forward(model, x, runner)
        trace.mark("backward")
        loss.backward()
        del loss
        trace.mark("end")
    return {
        "peak_bytes": trace.whole.peak_bytes,
        "forward_peak_bytes": trace.phases["forward"].peak_bytes,
        "kept_after_forward_bytes": trace.phases["backward"].start_bytes,
    }


def backward_flops(loss_fn: Callable[[], torch.Tensor]) -> int:
    """Backward FLOPs (recompute included) = FLOPs of forward+backward - of forward.

    The counter is active over forward *and* backward: torch's SAC fails when a
    dispatch mode appears only during its recompute (it sees extra ops and raises
    "not found in storage"), so counting backward alone cannot measure it.
    """
    fwd = FlopCounterMode(display=False)
    with fwd:
        loss_fn()
    both = FlopCounterMode(display=False)
    with both:
        loss_fn().backward()
    return both.get_total_flops() - fwd.get_total_flops()


def measure_flops(model, x, runner) -> int:
    model.zero_grad(set_to_none=True)
    return backward_flops(lambda: forward(model, x, runner))


def tracer_overhead_us(n_ops: int = 3000, reps: int = 5) -> dict[str, float]:
    """Forward cost per tiny op (8x8 tensors) above plain eager, in microseconds.

    Isolates the per-op Python cost of each mode's forward machinery: the ac2 tracer
    vs torch SAC's caching dispatch mode (torch full AC has no per-op forward hook).
    """
    x = torch.randn(8, 8, requires_grad=True)

    def chain():
        h = x
        for i in range(n_ops // 2):
            h = (h * 0.5).sin() if i % 2 else h + x
        return h.sum()

    def best(fn):
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return min(out)

    def in_region(policy):
        def run():
            with ac.apply_ac_policy(policy):
                chain()
        return run

    def torch_sac():
        ctx_fn = functools.partial(create_selective_checkpoint_contexts, SAVE_OPS)
        checkpoint(lambda: chain(), use_reentrant=False, context_fn=ctx_fn)

    eager = best(chain)
    cases = {
        "torch-full": lambda: checkpoint(lambda: chain(), use_reentrant=False),
        "torch-sac": torch_sac,
        "ac2-full": in_region("recompute_all"),
        "ac2-sac": in_region(SAVE_OPS),
    }
    return {name: (best(fn) - eager) / n_ops * 1e6 for name, fn in cases.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=7, help="timed steps per mode (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--no-micro", action="store_true", help="skip the per-op overhead micro-benchmark")
    args = p.parse_args(argv)
    modes = args.modes.split(",")

    torch.manual_seed(0)
    model = GPTStack(args.layers, args.dim, args.heads)
    x = torch.randn(args.batch, args.seq, args.dim, requires_grad=True)
    runners = {m: block_runner(m) for m in modes}

    results = {m: {} for m in modes}
    for m in modes:
        results[m].update(measure_memory(model, x, runners[m]))
        results[m]["backward_flops"] = measure_flops(model, x, runners[m])
    for _ in range(args.warmup):
        for m in modes:
            step(model, x, runners[m])
    times = {m: [] for m in modes}
    for _ in range(args.iters):  # round-robin so drift hits every mode alike
        for m in modes:
            t0 = time.perf_counter()
            step(model, x, runners[m])
            times[m].append(time.perf_counter() - t0)
    for m in modes:
        results[m]["step_seconds_median"] = statistics.median(times[m])
        results[m]["step_seconds_all"] = times[m]

    mib = 1 / 2**20
    print(f"bench_core: {args.layers} GPT blocks, D={args.dim}, T={args.seq}, B={args.batch}, "
          f"CPU threads={torch.get_num_threads()}, torch {torch.__version__}, {platform.machine()}")
    print(f"{'mode':<11} {'peak MiB':>9} {'kept MiB':>9} {'bwd GFLOP':>10} {'step s':>8}")
    for m in modes:
        r = results[m]
        print(f"{m:<11} {r['peak_bytes'] * mib:9.1f} {r['kept_after_forward_bytes'] * mib:9.1f} "
              f"{r['backward_flops'] / 1e9:10.2f} {r['step_seconds_median']:8.3f}")
    ratios = {}
    for ours, theirs in [("ac2-full", "torch-full"), ("ac2-sac", "torch-sac")]:
        if ours in results and theirs in results:
            a, b = results[ours], results[theirs]
            ratios[f"{ours}/{theirs}"] = {
                "peak": a["peak_bytes"] / b["peak_bytes"],
                "kept_after_forward": a["kept_after_forward_bytes"] / max(b["kept_after_forward_bytes"], 1),
                "backward_flops": a["backward_flops"] / b["backward_flops"],
                "step_time": a["step_seconds_median"] / b["step_seconds_median"],
            }
    for name, r in ratios.items():
        print(f"{name:<22} peak {r['peak']:.3f}x  kept {r['kept_after_forward']:.3f}x  "
              f"bwd FLOPs {r['backward_flops']:.3f}x  step {r['step_time']:.3f}x")
    overhead = {} if args.no_micro else tracer_overhead_us()
    if overhead:
        print("forward overhead per tiny op above eager (us): "
              + ", ".join(f"{k} {v:.1f}" for k, v in overhead.items()))
    out = {"config": vars(args), "results": results, "ratios": ratios, "overhead_us_per_op": overhead,
           "torch": torch.__version__, "threads": torch.get_num_threads()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
