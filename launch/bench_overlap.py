"""Side-stream replays on a simulated CUDA timeline: inline vs side-stream prefetch 0/1/2
vs torch's checkpoint, a Llama-style model under FSDP2, on a named GPU's rates.

    python launch/bench_overlap.py [--layers 8 --dim 512 --seq 512 --batch 2 --device h100]

Each mode runs the same model (every block ``fully_shard``-ed, then the root; one gloo
rank in this process) under the test suite's simulated CUDA (tests/_simcuda.py), whose
recorded trace becomes a timeline (Note [The simulated timeline] in tests/_simtime.py):
kernel durations from the planner's cost model at the device's rates, collectives over
the link as on an 8-GPU node, FSDP2's own streams and events, the caching allocator's
per-stream pools. Two steps run; the table reads the second step's backward:

- backward: from ``loss.backward()`` to the end of its last kernel, with the device
  shared by concurrent kernels (``shared``) or each stream at full speed (``parallel``,
  an upper bound on what overlap can hide);
- replay: the device time of ac2's replay kernels; exposed: what they add to backward
  (the backward again with replays taking no time, subtracted); hidden %: the rest;
- ideal: the replay time the backward could hide at most, the device's idle time in
  the same backward with free replays (FSDP2's all-gather waits, host gaps); shown as
  hidden / ideal;
- stall: time the compute stream sat waiting for another stream's event (the side
  stream, FSDP2's streams); late waits: waits for a later unit's replay (must be 0);
- allocated, reserved: the caching allocator's peaks over both steps (reserved also with
  ``expandable_segments``).

Deterministic: the same configuration gives the same figures on any machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

MODES = ("no AC", "torch checkpoint", "ac2 inline", "ac2 side, prefetch 0", "ac2 side, prefetch 1",
         "ac2 side, prefetch 2")


@dataclass
class Config:
    layers: int = 8
    dim: int = 512
    heads: int = 8
    seq: int = 512
    batch: int = 2
    vocab: int = 512
    device: str = "h100"
    host_op_us: float = 5.0
    world: int = 8  # ranks a collective's duration is priced for


def run_mode(mode: str, cfg: Config) -> Any:
    """One mode's two steps under a recording SimCuda; returns the SimCuda."""
    import _simtime
    from _simcuda import SimCuda
    from _simfsdp import fsdp_model, fsdp_on
    from models import LlamaBlock

    import ac2_dist as ac

    dev = _simtime.device(cfg.device, host_op_s=cfg.host_op_us * 1e-6, world=cfg.world)
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(1))
    with SimCuda(timeline=dev) as sim, fsdp_on(sim):
        model = fsdp_model(cfg.layers, cfg.dim, cfg.heads, cfg.vocab, max_seq=cfg.seq)

        def phase(event: str, unit: str) -> None:
            if event == "backward_start":
                sim.mark(f"phase:{unit}")

        if mode == "torch checkpoint":
            from torch.utils.checkpoint import checkpoint

            for block in model.layers:
                block.forward = _checkpointed(checkpoint, block.forward)
        elif mode != "no AC":
            stream = "inline" if mode == "ac2 inline" else "auto"
            prefetch = int(mode[-1]) if "prefetch" in mode else 0
            ac.apply_ac(model, "recompute_all", modules=[LlamaBlock],
                        replay=ac.ReplayConfig(stream=stream, prefetch=prefetch, log=phase))
        for step in range(2):
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            sim.mark(f"backward{step}")
            loss.backward()
            sim.synchronize()
            sim.mark(f"end{step}")
        sim.check()
    return sim


def _checkpointed(checkpoint: Any, forward: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def measure(sim: Any, contention: bool = True) -> dict[str, float]:
    """The second step's backward figures of one recorded run (see the module docstring)."""
    real = sim.timeline(contention=contention)
    free = sim.timeline(contention=contention, free_replays=True)
    lo, hi = real.marks["backward1"][0], real.marks["end1"][0]
    flo, fhi = free.marks["backward1"][0], free.marks["end1"][0]
    wall, wall_free = hi - lo, fhi - flo
    replay = real.replay_seconds(lo, hi)
    exposed = max(0.0, wall - wall_free)
    device_busy = _busy_union(free, flo, fhi)
    hidden = max(0.0, replay - exposed)
    return {
        "backward_ms": wall * 1e3,
        "replay_ms": replay * 1e3,
        "exposed_ms": exposed * 1e3,
        "hidden_pct": 100.0 * hidden / replay if replay else float("nan"),
        "hidden_ms": hidden * 1e3,
        "ideal_ms": min(replay, max(0.0, wall_free - device_busy)) * 1e3,
        "stall_ms": real.stalls(0, lo, hi) * 1e3,
        "late_waits": float(len(real.late_waits())),
        "reserved_mib": real.peak_reserved / 2**20,
        "allocated_mib": real.peak_allocated / 2**20,
        "reserved_expandable_mib": sim.timeline(contention=contention, expandable_segments=True).peak_reserved / 2**20,
    }


def _busy_union(result: Any, lo: float, hi: float) -> float:
    """Time in [lo, hi) at least one compute kernel ran (the device was not idle)."""
    spans = sorted((max(i.start, lo), min(i.end, hi)) for i in result.intervals
                   if result.kernels[i.kernel].kind == "compute" and i.end > lo and i.start < hi)
    total, end = 0.0, lo
    for s, e in spans:
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def table(rows: list[tuple[str, dict, dict]], cfg: Config) -> str:
    torch_row = next(r for name, r, _ in rows if name == "torch checkpoint")
    head = (f"Llama {cfg.layers} x {cfg.dim} ({cfg.heads} heads), batch {cfg.batch} x seq {cfg.seq}, FSDP2 per block, "
            f"simulated {cfg.device} (collectives as on {cfg.world} GPUs, {cfg.host_op_us:g} us of host time per op)")
    lines = [head, "",
             "| mode | backward ms, shared (parallel) | vs torch | replay ms | exposed ms | hidden %, shared (parallel) "
             "| hidden / ideal ms | stall ms | late waits | allocated MiB | reserved MiB (expandable) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r, p in rows:
        ideal = f"{r['hidden_ms']:.3f} / {r['ideal_ms']:.3f}" if r["replay_ms"] else "-"
        hidden = f"{r['hidden_pct']:.0f} ({p['hidden_pct']:.0f})" if r["replay_ms"] else "-"
        lines.append(
            f"| {name} | {r['backward_ms']:.3f} ({p['backward_ms']:.3f}) | {r['backward_ms'] / torch_row['backward_ms']:.3f} "
            f"| {r['replay_ms']:.3f} | {r['exposed_ms']:.3f} | {hidden} | {ideal} | {r['stall_ms']:.3f} "
            f"| {r['late_waits']:.0f} | {r['allocated_mib']:.1f} | {r['reserved_mib']:.1f} ({r['reserved_expandable_mib']:.1f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in ("layers", "dim", "heads", "seq", "batch", "world"):
        p.add_argument(f"--{f}", type=int, default=getattr(Config, f))
    p.add_argument("--device", default=Config.device)
    p.add_argument("--host-op-us", type=float, default=Config.host_op_us)
    p.add_argument("--out", help="write the table (Markdown) here too")
    args = p.parse_args(argv)
    cfg = Config(layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq, batch=args.batch,
                 device=args.device, host_op_us=args.host_op_us, world=args.world)
    import torch.distributed as dist

    store = tempfile.mktemp()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        rows = []
        for mode in MODES:
            sim = run_mode(mode, cfg)
            rows.append((mode, measure(sim, True), measure(sim, False)))
            print(f"bench_overlap: {mode} done", file=sys.stderr)
    finally:
        dist.destroy_process_group()
    text = table(rows, cfg)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
