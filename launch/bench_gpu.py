"""Replay scheduling benchmark: one-device FSDP2, backward time and peak memory.

    python launch/bench_gpu.py                      # CUDA: 8 GPT blocks, D=2048, bf16
    python launch/bench_gpu.py --model llama --modes no-ac,torch-full,ac2-inline,ac2-side-prefetch0,ac2-side-prefetch1,ac2-side-prefetch2
    python launch/bench_gpu.py --device cpu --dim 128 --layers 2 --seq 64   # CPU smoke run

Modes: ``no-ac``, ``torch-full`` (torch's non-reentrant checkpoint per block),
``ac2-inline`` (ac2 full AC, inline replays, no prefetch), ``ac2-side-prefetch<k>``
(k = 0, 1, 2: replays on a CUDA side stream, prefetched k blocks ahead; on CPU the
"side stream" falls back to inline, so those modes measure prefetch alone) and
``ac2-side-stream-prefetch`` (= ``ac2-side-prefetch1``). Backward time is the median
over --iters steps (device synchronized); peak memory is above what was allocated
before the step (CUDA: the caching allocator's max_memory_allocated; CPU: allocator
events via torch.profiler). ``launch/gpu_check.py`` runs these functions with its own
process group and sizes.
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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPTBlock, GPTStack, Llama, LlamaBlock  # noqa: E402

import ac2_dist as ac  # noqa: E402
from ac2_dist._measure._alloc import AllocationTrace  # noqa: E402

MODES = ["no-ac", "torch-full", "ac2-inline", "ac2-side-stream-prefetch"]
SIDE = "ac2-side-prefetch"  # + depth
ALL_MODES = ["no-ac", "torch-full", "ac2-inline", f"{SIDE}0", f"{SIDE}1", f"{SIDE}2"]
# A save-matmuls policy on the side stream against inline, and inline once more: the two
# inline runs' difference is the noise floor the side stream's gradients are judged by.
SAVE_MM = "-save-mm"
SAVE_MM_MODES = [f"ac2-inline{SAVE_MM}", f"{SIDE}1{SAVE_MM}", f"ac2-inline{SAVE_MM}-rerun"]


def replay_config(mode: str, stream: Any = None) -> ac.ReplayConfig | None:
    """The ReplayConfig of an ac2 mode (``stream``: an explicit side stream, else "auto")."""
    mode = mode.split(SAVE_MM)[0]
    if mode == "ac2-inline":
        return ac.ReplayConfig(stream="inline", prefetch=0)
    if mode == "ac2-side-stream-prefetch":
        mode = f"{SIDE}1"
    if mode.startswith(SIDE):
        return ac.ReplayConfig(stream=stream if stream is not None else "auto", prefetch=int(mode[len(SIDE):]))
    return None


def block_type(args: argparse.Namespace) -> type:
    return LlamaBlock if args.model == "llama" else GPTBlock


def make_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    if args.model == "llama":
        return Llama(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads,
                     hidden=getattr(args, "hidden", None), max_seq=args.seq)
    return GPTStack(args.layers, args.dim, args.heads)


def make_input(args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if args.model == "llama":
        return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    return torch.randn(args.batch, args.seq, args.dim, generator=g).to(device).requires_grad_()


def loss_of(args: argparse.Namespace) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    if args.model == "llama":
        return lambda model, x: F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
    return lambda model, x: model(x).float().pow(2).mean()


def build(args: argparse.Namespace, mode: str, mesh: Any, device: torch.device, stream: Any = None) -> nn.Module:
    """The model of ``mode`` with every block checkpointed accordingly, then FSDP2."""
    with torch.device(device):  # initialized where it runs (a CPU init of billions of parameters is slow)
        model = make_model(args)
    blocks = [m for m in model.modules() if isinstance(m, block_type(args))]
    if mode == "torch-full":
        for blk in blocks:
            blk.forward = functools.partial(checkpoint, blk.forward, use_reentrant=False)
    elif mode != "no-ac":
        config = replay_config(mode, stream)
        if config is None:
            raise ValueError(f"bench_gpu: unknown mode {mode!r}; modes: {ALL_MODES} or ac2-side-stream-prefetch")
        policy = [torch.ops.aten.mm.default] if SAVE_MM in mode else "recompute_all"
        ac.apply_ac(model, policy, modules=[block_type(args)], replay=config)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for blk in blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def grad_sample(model: nn.Module, per_tensor: int = 4096) -> list[torch.Tensor]:
    """Up to ``per_tensor`` evenly strided elements of each parameter's gradient, on the
    CPU in fp32 (FSDP2's DTensors gathered first): enough to compare modes, small
    enough to keep for billions of parameters."""
    out = []
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        flat = g.detach().reshape(-1)
        out.append(flat[:: max(1, flat.numel() // per_tensor)].float().cpu())
    return out


def measure(args: argparse.Namespace, mode: str, mesh: Any, device: torch.device, *, grads: bool = False,
            stream: Any = None) -> dict:
    """Median backward time and peak memory of ``mode``; with ``grads`` also a sample of
    the gradients of one more step (key ``"grads"``, :func:`grad_sample`, not JSON)."""
    model = build(args, mode, mesh, device, stream)
    x = make_input(args, device)
    loss_fn = loss_of(args)
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step():
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, x)
        sync()
        t0 = time.perf_counter()
        loss.backward()
        sync()
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        step()
    times = [step() for _ in range(args.iters)]
    model.zero_grad(set_to_none=True)
    reserved = None
    if cuda:
        sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = torch.cuda.max_memory_allocated() - base
        # What the caching allocator holds from the device at the step's peak: per-stream
        # pools, segment rounding, record_stream holds, a side stream's cuBLAS workspace
        # (the process-wide figure: torch.cuda.max_memory_reserved).
        reserved = torch.cuda.max_memory_reserved()
    else:
        with AllocationTrace() as trace:
            step()
        peak = trace.whole.peak_bytes
    out: dict[str, Any] = {"backward_seconds_median": statistics.median(times), "peak_bytes": peak,
                           "peak_reserved_bytes": reserved}
    if grads:
        out["grads"] = grad_sample(model)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000, help="--model llama")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", default=None)
    return p


def one_rank_group(device: torch.device) -> str | None:
    """A 1-rank process group (nccl on CUDA, gloo on CPU) so fully_shard has a mesh, unless
    one exists or torchrun set one up; returns the temp dir of its file store, if any."""
    if dist.is_initialized():
        return None
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
        return None
    tmp = tempfile.mkdtemp()
    dist.init_process_group(backend, init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
    return tmp


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    own_group = not dist.is_initialized()
    one_rank_group(device)
    try:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        results = {m: measure(args, m, mesh, device) for m in args.modes.split(",")}
        if dist.get_rank() == 0:
            name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
            print(f"bench_gpu: {args.layers} {args.model} blocks D={args.dim} T={args.seq} B={args.batch} "
                  f"{args.dtype}, FSDP2 x{dist.get_world_size()}, {name}, torch {torch.__version__}")
            print(f"{'mode':<26} {'backward ms':>12} {'peak MiB':>10}")
            for m, r in results.items():
                print(f"{m:<26} {r['backward_seconds_median'] * 1e3:12.1f} {r['peak_bytes'] / 2**20:10.1f}")
            if "torch-full" in results:
                t = results["torch-full"]
                for m, r in results.items():
                    if m.startswith("ac2"):
                        print(f"{m} / torch-full: backward "
                              f"{r['backward_seconds_median'] / t['backward_seconds_median']:.3f}x, "
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
