"""Replay scheduling benchmark: one-device FSDP2, backward time and peak memory.

    python launch/bench_gpu.py                      # CUDA: 8 GPT blocks, D=2048, bf16
    python launch/bench_gpu.py --device cpu --dim 128 --layers 2 --seq 64   # CPU smoke run

Modes: no AC, torch full AC, ac2 full AC with inline replays, ac2 full AC with
side-stream replays and prefetch=1 (on CPU "side stream" falls back to inline, so that
mode measures prefetch alone). Backward time is the median over --iters steps (device
synchronized); peak memory is above what was allocated before the step (CUDA: the
caching allocator's max_memory_allocated; CPU: allocator events via torch.profiler).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPTBlock, GPTStack  # noqa: E402

import ac2_dist as ac  # noqa: E402
from ac2_dist._alloc import AllocationTrace  # noqa: E402

MODES = ["no-ac", "torch-full", "ac2-inline", "ac2-side-stream-prefetch"]


def build(args, mode: str, mesh, device: torch.device) -> GPTStack:
    torch.manual_seed(0)
    model = GPTStack(args.layers, args.dim, args.heads).to(device)
    if mode == "torch-full":
        for blk in model.blocks:
            blk.forward = functools.partial(checkpoint, blk.forward, use_reentrant=False)
    elif mode == "ac2-inline":
        ac.apply_ac(model, "recompute_all", modules=[GPTBlock], replay=ac.ReplayConfig(stream="inline", prefetch=0))
    elif mode == "ac2-side-stream-prefetch":
        ac.apply_ac(model, "recompute_all", modules=[GPTBlock], replay=ac.ReplayConfig(stream="auto", prefetch=1))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def measure(args, mode, mesh, device) -> dict:
    model = build(args, mode, mesh, device)
    x = torch.randn(args.batch, args.seq, args.dim, device=device, requires_grad=True)
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step(timed: bool):
        model.zero_grad(set_to_none=True)
        loss = model(x).float().pow(2).mean()
        sync()
        t0 = time.perf_counter()
        loss.backward()
        sync()
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        step(False)
    times = [step(True) for _ in range(args.iters)]
    model.zero_grad(set_to_none=True)
    if cuda:
        sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(False)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with AllocationTrace() as trace:
            step(False)
        peak = trace.whole.peak_bytes
    return {"backward_seconds_median": statistics.median(times), "peak_bytes": peak}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    own_group = not dist.is_initialized()
    tmp = None
    if own_group:
        if "RANK" in os.environ:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        else:  # one process: a 1-rank group so fully_shard has a mesh
            tmp = tempfile.mkdtemp()
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        results = {m: measure(args, m, mesh, device) for m in args.modes.split(",")}
        if dist.get_rank() == 0:
            name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
            print(f"bench_gpu: {args.layers} GPT blocks D={args.dim} T={args.seq} B={args.batch} {args.dtype}, "
                  f"FSDP2 x{dist.get_world_size()}, {name}, torch {torch.__version__}")
            print(f"{'mode':<26} {'backward ms':>12} {'peak MiB':>10}")
            for m, r in results.items():
                print(f"{m:<26} {r['backward_seconds_median'] * 1e3:12.1f} {r['peak_bytes'] / 2**20:10.1f}")
            if "torch-full" in results:
                t = results["torch-full"]
                for m in ("ac2-inline", "ac2-side-stream-prefetch"):
                    if m in results:
                        r = results[m]
                        print(f"{m} / torch-full: backward {r['backward_seconds_median'] / t['backward_seconds_median']:.3f}x, "
                              f"peak {r['peak_bytes'] / t['peak_bytes']:.3f}x")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"config": vars(args), "results": results}, f, indent=1)
        return results
    finally:
        if own_group:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
