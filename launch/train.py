"""ac2_dist's main job: FSDP2 training of a small Llama-style decoder under torchrun.

    torchrun --standalone --nproc-per-node 2 launch/train.py            # CPU / gloo
    torchrun --standalone --nproc-per-node 8 launch/train.py --dim 1024  # GPUs / nccl

``--device auto`` (the default) trains on the GPUs, one per rank (nccl), when this
node has one for each of its ranks, else on the CPU (gloo; with some GPUs but fewer
than ranks it says so: nccl cannot put two ranks on one GPU); ``--device cuda``
requires one GPU per rank and stops with an error otherwise.

Byte-level language modelling on text already on disk (this project's sources and
the Python standard library's), every block checkpointed (``--ac``), parameters
sharded with ``fully_shard`` over all ranks. Prints one line per step (loss,
tokens/s, step time), then the per-rank memory report of the last step, then a baseline:
the same model and batches for a few steps each with no activation checkpointing,
torch's checkpoint and this run's ``--ac`` (peak, kept after forward, step time;
``--no-baseline`` skips it). The job ends with ``ac2_dist.distributed.shutdown()``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import Llama, LlamaBlock  # noqa: E402

import ac2_dist as ac  # noqa: E402

aten = torch.ops.aten
SAVE_OPS = [aten.mm.default, aten.addmm.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default]
AC_MODES = ["none", "torch-full", "torch-sac", "ac2-full", "ac2-sac"]


def corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """Bytes of text files on this machine: the project's sources, then the stdlib's."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = [os.path.join(here, "ac2_dist"), os.path.join(here, "launch"), os.path.dirname(os.__file__)]
    chunks, total = [], 0
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "test", "tests"))
            for name in sorted(filenames):
                if not name.endswith((".py", ".md", ".txt", ".rst")):
                    continue
                try:
                    with open(os.path.join(dirpath, name), "rb") as f:
                        data = f.read()
                except OSError:
                    continue
                chunks.append(data)
                total += len(data)
                if total >= max_bytes:
                    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()
    if total < 1 << 16:
        raise RuntimeError(f"train.py: found only {total} bytes of text under {roots}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def batches(data: torch.Tensor, batch: int, seq: int, seed: int, rank: int):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def apply_checkpointing(model: Llama, mode: str) -> None:
    """``mode``: one of AC_MODES, ``ac2-budget-<fraction>`` (an ac2_dist.MemoryBudget) or
    ``ac2-peak-<bytes>`` (a MemoryBudget with that peak target)."""
    if mode.startswith("ac2-budget-"):
        ac.apply_ac(model, ac.MemoryBudget(float(mode[len("ac2-budget-"):])), modules=[LlamaBlock])
    elif mode.startswith("ac2-peak-"):
        ac.apply_ac(model, ac.MemoryBudget(peak=int(mode[len("ac2-peak-"):])), modules=[LlamaBlock])
    elif mode in ("ac2-full", "ac2-sac"):
        ac.apply_ac(model, "recompute_all" if mode == "ac2-full" else SAVE_OPS, modules=[LlamaBlock])
    elif mode in ("torch-full", "torch-sac"):
        kwargs = {"use_reentrant": False}
        if mode == "torch-sac":
            kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, SAVE_OPS)
        for block in model.layers:
            block.forward = _torch_checkpointed(block.forward, kwargs)


def _torch_checkpointed(forward, kwargs: dict):
    """``forward`` under torch's checkpoint. A Python frame around the call (not a
    ``functools.partial`` of it): ``block.compile()`` compiles from the block's forward,
    and torch's ``checkpoint`` itself is a frame dynamo skips."""

    def run(*args, **kw):
        return checkpoint(forward, *args, **kw, **kwargs)

    return run


def compile_blocks(model: Llama, backend: str = "inductor") -> None:
    """torchtitan's order: checkpointing applied first, then each block compiled
    (``fullgraph=True``), then ``fully_shard``."""
    for block in model.layers:
        block.compile(backend=backend, fullgraph=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ac", choices=[*AC_MODES, "ac2-budget"], default="ac2-full",
                   help="activation checkpointing per block (ac2-budget: ac2_dist.MemoryBudget(--budget))")
    p.add_argument("--budget", type=float, default=0.5, help="the fraction of --ac ac2-budget")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--reshard", action=argparse.BooleanOptionalAction, default=True,
                   help="FSDP2 reshard_after_forward for the blocks")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (after checkpointing)")
    p.add_argument("--report-json", default=None, help="write the gathered memory report here (rank 0)")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=None,
                   help="end with a table of no AC, torch's checkpoint and --ac on the same model and batches "
                        "(default: on, off with --compile, which would compile every mode)")
    p.add_argument("--baseline-steps", type=int, default=8,
                   help="steps per mode in the baseline: one warm-up, the timed ones, then --baseline-measured")
    p.add_argument("--baseline-measured", type=int, default=3,
                   help="the baseline's last steps, each measured by ac2_dist.memory.track (its peak column: "
                        "the lowest and the highest of them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: one GPU per rank if this node has enough, else the CPU; cuda: require them")
    args = p.parse_args(argv)
    if args.baseline_measured < 1:
        p.error("--baseline-measured must be at least 1")
    if args.baseline_steps < args.baseline_measured + 2:
        p.error(f"--baseline-steps must be at least --baseline-measured + 2 = {args.baseline_measured + 2} "
                "(a warm-up step, a timed one, the measured ones)")
    if args.baseline is None:
        args.baseline = not args.compile
    return args


def choose_device(requested: str, gpus: int, local_ranks: int) -> tuple[str, str]:
    """(``"cuda"`` or ``"cpu"``, a notice for the user or ``""``) for ``--device
    requested`` with ``gpus`` GPUs and ``local_ranks`` ranks on this node: nccl needs
    a GPU of its own per rank. Raises SystemExit for ``cuda`` without enough GPUs."""
    if requested == "cpu":
        return "cpu", ""
    if gpus >= local_ranks and gpus > 0:
        return "cuda", ""
    if requested == "cuda":
        raise SystemExit(
            f"launch/train.py --device cuda: {local_ranks} rank(s) on this node need a GPU each (nccl), this node "
            f"has {gpus}; launch with torchrun --nproc-per-node {max(gpus, 1)}"
            + (" " if gpus else " on a machine with a GPU, ") + "or train on the CPU with --device cpu")
    if gpus:
        return "cpu", (f"train.py: {local_ranks} ranks on this node but {gpus} GPU(s) (nccl needs one per rank): "
                       f"training on the CPU (gloo); launch with torchrun --nproc-per-node {gpus} to train on the "
                       f"GPU(s), or pass --device cuda to make this an error")
    return "cpu", ""


def init_distributed(requested: str = "auto") -> torch.device:
    """torchrun rank setup: nccl and this rank's GPU (``choose_device``), else gloo with
    the CPU cores split between the ranks of this node."""
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    gpus = torch.cuda.device_count() if requested != "cpu" and torch.cuda.is_available() else 0
    kind, notice = choose_device(requested, gpus, local_ranks)
    if notice and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print(notice, flush=True)
    dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    if kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> float:
    """Run the job under torchrun; returns the last step's mean loss."""
    args = parse_args(argv)
    device = init_distributed(args.device)
    clean = False
    try:
        # Everything that references the process group (model, optimizer, tracker,
        # device mesh) lives in train()'s frame only: gone when shutdown() runs.
        last = train(args, device)
        clean = True
    finally:
        ac.distributed.shutdown(after_error=not clean)
    return last


def build(args: argparse.Namespace, mode: str, device: torch.device, mesh: DeviceMesh) -> Llama:
    """The job's model with ``mode``'s checkpointing, compiled if asked, sharded over ``mesh``."""
    torch.manual_seed(args.seed)  # identical initial weights on every rank and in every mode
    model = Llama(vocab=256, dim=args.dim, layers=args.layers, heads=args.heads, max_seq=args.seq).to(device)
    apply_checkpointing(model, mode)
    if args.compile:
        compile_blocks(model)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=args.reshard)
    fully_shard(model, mesh=mesh)
    return model


def run_steps(model: Llama, data, steps: int, lr: float, device: torch.device, on_step=None, measured: int = 1):
    """``steps`` training steps (AdamW); the last ``measured`` ones under ``ac2_dist.memory.track``.

    Returns (mean loss per step, seconds per step, this rank's reports of the measured steps).
    ``on_step(step, loss, seconds)`` is called after each step on every rank."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    world = dist.get_world_size()
    losses, seconds, reports = [], [], []
    for step in range(1, steps + 1):
        x, y = (t.to(device) for t in next(data))
        t0 = time.perf_counter()
        # A with-block: the tracker's profiler session ends even if the step fails.
        with (ac.memory.track(model) if step > steps - measured else contextlib.nullcontext()) as tracker:
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
        if tracker is not None:
            reports.append(tracker.report())
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        losses.append(value.item() / world)
        if on_step is not None:
            on_step(step, losses[-1], seconds[-1])
    return losses, seconds, reports


def baseline_modes(mode: str) -> list[str]:
    """The modes the baseline compares: no AC, torch's full checkpoint, the torch mode an
    ac2 mode has a counterpart in (``ac2-sac`` -> ``torch-sac``), then ``mode`` itself."""
    modes = ["none", "torch-full"]
    if mode == "ac2-sac" or mode.startswith("ac2-budget"):
        modes.append("torch-sac")
    if mode not in modes:
        modes.append(mode)
    return modes


BASELINE_LEGEND = (
    "peak: the most bytes allocated at any moment of a step (forward or backward), above what was\n"
    "  allocated when it began: the lowest and the highest of the measured steps. Steps of one mode\n"
    "  differ by when the buffers of FSDP's collectives are freed (on CPU, gloo's threads; up to ~1 MiB\n"
    "  here, in every mode alike), so modes are compared by their lowest peak;\n"
    "kept: bytes still allocated when forward returned (what the step holds for backward);\n"
    "step: median wall time of the timed steps. Figures are the larger rank's.\n"
    "What each row of the per-rank report means: docs/guide/reports.md (glossary)."
)


def baseline(args: argparse.Namespace, device: torch.device, mesh: DeviceMesh) -> str:
    """The baseline table (rank 0; ``""`` elsewhere): each of :func:`baseline_modes` on a
    fresh model (the same initial weights) and the same batches, ``--baseline-steps``
    steps: a warm-up step, timed steps, then ``--baseline-measured`` steps measured by
    ``memory.track`` (peak: their lowest and highest; kept: the highest)."""
    label = {"none": "no AC", "torch-full": "torch checkpoint", "torch-sac": "torch SAC (save matmuls)",
             "ac2-full": "ac2 (recompute_all)", "ac2-sac": "ac2 (save matmuls)"}
    rows = []
    for mode in baseline_modes(args.ac if args.ac != "ac2-budget" else f"ac2-budget-{args.budget}"):
        model = build(args, mode, device, mesh)
        data = batches(corpus(), args.batch, args.seq, args.seed, dist.get_rank())
        measured = args.baseline_measured
        _, seconds, reports = run_steps(model, data, args.baseline_steps, args.lr, device, measured=measured)
        del model
        peaks = [max(r.peak_bytes_forward, r.peak_bytes_backward) for r in reports]
        figures = torch.tensor([min(peaks), max(peaks), max(r.live_bytes_after_forward for r in reports),
                                statistics.median(seconds[1:-measured]) * 1e6],
                               dtype=torch.float64, device=device)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        low, high, kept, step_us = figures.tolist()
        rows.append((label.get(mode, f"ac2 ({mode})"), low, high, kept, step_us / 1e3))
    if dist.get_rank() != 0:
        return ""
    torch_peak = rows[1][1]
    header = ("mode", "peak MiB", "kept MiB", "step ms", "peak / torch checkpoint")
    cells = [header] + [(name, f"{low / 2**20:.1f}" + ("" if measured == 1 else f" - {high / 2**20:.1f}"),
                         f"{kept / 2**20:.1f}", f"{ms:.1f}", f"{low / torch_peak:.2f}x")
                        for name, low, high, kept, ms in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    timed = args.baseline_steps - 1 - measured
    lines = [f"baseline (the same model and batches, {args.baseline_steps} steps per mode: 1 warm-up, "
             f"{timed} timed, {'the last' if measured == 1 else f'the last {measured}'} measured):"]
    for k, row in enumerate(cells):
        lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n" + BASELINE_LEGEND


def train(args: argparse.Namespace, device: torch.device) -> float:
    """Train, print the steps, rank 0's memory report and the baseline; the last step's
    mean loss. The model, optimizer, tracker and mesh live in this frame only."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    mode = f"ac2-budget-{args.budget}" if args.ac == "ac2-budget" else args.ac
    model = build(args, mode, device, mesh)
    data = batches(corpus(), args.batch, args.seq, args.seed, rank)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"train.py: {world} ranks ({device.type}), Llama {args.layers}x{args.dim}, "
              f"{n_params / 1e6:.2f}M params, seq {args.seq}, batch {args.batch}/rank, --ac {args.ac}"
              f"{' (compiled blocks)' if args.compile else ''}",
              flush=True)

    def show(step: int, loss: float, seconds: float) -> None:
        if rank == 0:
            tok_s = args.batch * args.seq * world / seconds
            print(f"step {step:3d}/{args.steps}  loss {loss:.4f}  {tok_s:8.0f} tok/s  {seconds * 1e3:7.1f} ms",
                  flush=True)

    losses, _, (report,) = run_steps(model, data, args.steps, args.lr, device, on_step=show)
    del model
    reports = ac.memory.gather(report)  # every rank: the list on rank 0, None elsewhere
    if reports is not None:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        print(f"per-rank memory report (step {args.steps}, --ac {args.ac}):")
        print(ac.memory.format_table(reports))
        if args.report_json:
            ac.memory.save_run(reports, args.report_json)
            print(f"wrote {args.report_json}")
    if args.baseline:
        table = baseline(args, device, mesh)
        if table:
            print("\n" + table, flush=True)
    elif rank == 0:
        print("What each row of the report means: docs/guide/reports.md (glossary).")
    return losses[-1]


if __name__ == "__main__":
    main()
