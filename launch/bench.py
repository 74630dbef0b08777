"""All activation-checkpointing modes side by side in one torchrun job, per rank.

    torchrun --standalone --nproc-per-node 2 launch/bench.py --out bench-out

For each of no AC, torch full AC, torch SAC, ac2 full and ac2 SAC (same model, same
data, FSDP2 over all ranks, every block checkpointed): peak memory of forward and of
backward, activations kept after forward, backward FLOPs (recompute included), median
step time, collectives and all-gathers issued during backward, per rank; then the
ratios ac2 / torch.utils.checkpoint. Step times are taken in rounds, every mode once per
round (interleaved; all ranks meet in a barrier before each step); the step-time ratio
is per round, printed as median (min-max) over the rounds. Writes ``bench.json`` and ``bench.md`` to --out
(and ``bench.png`` with --png, needs matplotlib).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import PAIRS, PlainFlops, backward_flops, ratio_stats, timed_rounds  # noqa: E402
from models import Llama  # noqa: E402
from train import (  # noqa: E402
    AC_MODES,
    apply_checkpointing,
    batches,
    compile_blocks,
    corpus,
    init_distributed,
)

import ac2_dist as ac  # noqa: E402

_COLLECTIVE_PREFIXES = ("c10d::", "_c10d_functional::")


def _collectives_in_backward(model, x, y) -> int:
    """Collectives issued during one backward, from profiler events (compiled graphs
    call them outside any Python dispatch mode)."""
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    loss = _loss(model, x, y)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    return sum(1 for e in prof.events()
               if e.name.startswith(_COLLECTIVE_PREFIXES) and "wait" not in e.name and "wrap" not in e.name)


def _build(args, mode, mesh, device):
    torch.manual_seed(args.seed)
    model = Llama(vocab=256, dim=args.dim, layers=args.layers, heads=args.heads, max_seq=args.seq).to(device)
    apply_checkpointing(model, mode)
    if args.compile:
        compile_blocks(model)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=args.reshard)
    fully_shard(model, mesh=mesh)
    return model


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def _measure_mode(model, x, y, compiled: bool) -> dict:
    """Memory, collectives and FLOPs of one mode's model (one tracked step). FLOPs are
    counted by a mode that dispatches every op unchanged (bench_common.PlainFlops: a
    decomposing counter would show ac2 another block structure); compiled kernels do not
    dispatch through Python modes: no FLOPs for compiled modes."""
    model.zero_grad(set_to_none=True)
    with ac.memory.track(model) as tracker:
        loss = _loss(model, x, y)
        loss.backward()
        del loss
    report = tracker.report()
    collectives = _collectives_in_backward(model, x, y)
    model.zero_grad(set_to_none=True)
    flops = None if compiled else backward_flops(lambda: _loss(model, x, y), PlainFlops)
    return {
        "peak_bytes_forward": report.peak_bytes_forward,
        "peak_bytes_backward": report.peak_bytes_backward,
        "kept_after_forward_bytes": report.live_bytes_after_forward,
        "ac2_saved_bytes": report.saved_bytes,
        "backward_flops": flops,
        "collectives_backward": collectives,
        "allgathers_backward": report.allgathers_backward,
        "recomputed_ops": report.recomputed_ops,
        "report": report.to_dict(),
    }


def _step(model, x, y) -> None:
    model.zero_grad(set_to_none=True)
    _loss(model, x, y).backward()


def _gflop(flops: int | None) -> str:
    return "n/a" if flops is None else f"{flops / 1e9:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{a / b:.3f}"


def _markdown(results: list[dict], modes: list[str], args) -> str:
    mib = 1 / 2**20
    lines = [
        f"`torchrun --standalone --nproc-per-node {len(results)} launch/bench.py` — Llama {args.layers}x{args.dim}, "
        f"seq {args.seq}, batch {args.batch}/rank, FSDP2 (reshard_after_forward={args.reshard}), "
        f"{'blocks compiled (Inductor), ' if args.compile else ''}"
        f"{len(results)} ranks, {results[0]['device']}, torch {torch.__version__}",
        "",
        "| mode | rank | peak fwd MiB | peak bwd MiB | kept MiB | bwd GFLOP | step s | collectives bwd | all-gathers bwd |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in modes:
        for rank, res in enumerate(results):
            r = res["modes"][mode]
            name = mode
            if "target_bytes" in r:  # a peak target: its step peak over the target (memory.track's scale)
                name = f"ac2 peak {r['target_bytes'] * mib:.1f} MiB ({r['peak_vs_target']:.3f}x)"
            lines.append(
                f"| {name} | {rank} | {r['peak_bytes_forward'] * mib:.1f} | {r['peak_bytes_backward'] * mib:.1f} | "
                f"{r['kept_after_forward_bytes'] * mib:.1f} | {_gflop(r['backward_flops'])} | "
                f"{r['step_seconds_median']:.3f} | {r['collectives_backward']} | {r['allgathers_backward']} |"
            )
    lines += ["", f"| ratio (rank 0) | peak fwd | peak bwd | bwd FLOPs | step time, median (min-max) of {args.iters} rounds |",
              "|---|---:|---:|---:|---:|"]
    for ours, theirs in PAIRS:
        if ours in modes and theirs in modes:
            a, b = results[0]["modes"][ours], results[0]["modes"][theirs]
            st = ratio_stats(a["step_seconds_all"], b["step_seconds_all"])
            lines.append(
                f"| {ours} / {theirs} | {a['peak_bytes_forward'] / b['peak_bytes_forward']:.3f} | "
                f"{a['peak_bytes_backward'] / b['peak_bytes_backward']:.3f} | "
                f"{_ratio(a['backward_flops'], b['backward_flops'])} | "
                f"{st['median']:.3f} ({st['min']:.3f}-{st['max']:.3f}) |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(AC_MODES))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=5, help="timed rounds (every mode once per round)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reshard", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out")
    p.add_argument("--png", action="store_true", help="also write bench.png (ac2 modes' reports)")
    p.add_argument("--compile", action="store_true", help="torch.compile every block of every mode")
    p.add_argument("--budgets", default="", help="also ac2_dist.MemoryBudget modes at these fractions, e.g. 0,0.5,1")
    p.add_argument("--peaks", type=int, default=0, help="also MemoryBudget(peak=N) modes at this many targets from "
                   "ac2 full's peak to no AC's (measured first, the larger rank's figure)")
    args = p.parse_args(argv)
    if args.peaks == 1:
        p.error("--peaks needs at least 2 targets (the floor and no AC's peak)")
    device = init_distributed()
    clean = False
    try:
        bench(args, device, init_device_mesh(device.type, (dist.get_world_size(),)))
        clean = True
    finally:
        ac.distributed.shutdown(after_error=not clean)


def _peak_modes(args, mesh, device, x, y) -> list[str]:
    """``ac2-peak-<bytes>`` modes: targets evenly from ac2 full's step peak to no AC's
    (``memory.track``'s figures, the larger over the ranks: one target for every rank)."""
    peaks = []
    for mode in ("ac2-full", "none"):
        model = _build(args, mode, mesh, device)
        _step(model, x, y)
        r = _measure_mode(model, x, y, compiled=True)  # FLOPs are not needed here
        peaks.append(max(r["peak_bytes_forward"], r["peak_bytes_backward"]))
        del model
    t = torch.tensor(peaks, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    floor, top = t.tolist()
    n = args.peaks
    return [f"ac2-peak-{floor + round(k * (top - floor) / (n - 1))}" for k in range(n)]


def bench(args: argparse.Namespace, device: torch.device, mesh: DeviceMesh) -> None:
    """Measure every mode on this rank; rank 0 writes and prints the results.

    The models (they reference the process group) live in this call only.
    """
    modes = args.modes.split(",") + [f"ac2-budget-{f}" for f in args.budgets.split(",") if f]
    rank = dist.get_rank()
    data = batches(corpus(), args.batch, args.seq, args.seed, rank)
    x, y = (t.to(device) for t in next(data))
    if args.peaks:
        modes += _peak_modes(args, mesh, device, x, y)
    models = {mode: _build(args, mode, mesh, device) for mode in modes}
    mine = {"rank": rank, "device": device.type, "modes": {}}
    for mode in modes:
        # Lazy init, first all-gathers; a MemoryBudget calibrates; a peak target measures,
        # corrects and settles (Note [Verify, correct, stay put] in ac2_dist/_plan/_peak_verify.py).
        for _ in range(4 if mode.startswith("ac2-peak-") else 1):
            _step(models[mode], x, y)
        mine["modes"][mode] = _measure_mode(models[mode], x, y, args.compile)
        if mode.startswith("ac2-peak-"):
            target = int(mode[len("ac2-peak-"):])
            r = mine["modes"][mode]
            r["target_bytes"] = target
            r["peak_vs_target"] = max(r["peak_bytes_forward"], r["peak_bytes_backward"]) / target

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    steps = {mode: functools.partial(_step, models[mode], x, y) for mode in modes}
    times = timed_rounds(steps, args.iters, args.warmup, sync=sync)
    for mode in modes:
        r = mine["modes"][mode]
        r["step_seconds_median"] = statistics.median(times[mode])
        r["step_seconds_all"] = times[mode]
        if rank == 0:
            print(f"{mode:<11} step {r['step_seconds_median']:.3f}s  peak bwd "
                  f"{r['peak_bytes_backward'] / 2**20:.1f} MiB  bwd {_gflop(r['backward_flops'])} GFLOP", flush=True)
    gathered = ac.memory._gather_json(mine)  # JSON over the group: needs no numpy
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        table = _markdown(gathered, modes, args)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump({"config": vars(args), "ranks": gathered}, f, indent=1)
        with open(os.path.join(args.out, "bench.md"), "w") as f:
            f.write(table + "\n")
        print(table)
        if args.png:
            for mode in modes:
                if mode.startswith("ac2"):
                    reports = [ac.memory.RankReport.from_dict(g["modes"][mode]["report"]) for g in gathered]
                    ac.memory.plot(reports, os.path.join(args.out, f"bench-{mode}.png"))
        print(f"wrote {args.out}/bench.json and bench.md")


if __name__ == "__main__":
    main()
