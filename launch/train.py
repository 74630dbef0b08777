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
tokens/s, step time), then the per-rank memory report of the last step.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: one GPU per rank if this node has enough, else the CPU; cuda: require them")
    return p.parse_args(argv)


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


def shutdown_distributed(clean: bool, mesh: DeviceMesh | None = None) -> None:
    """Tear the process group down, after the code that used it has returned.

    ``clean``: every rank got here without an error; then the ranks first meet in a
    barrier and the group is released for real (``mesh``: the job's device mesh), so
    that its threads are joined before the interpreter exits.
    """
    # Note [Shutdown order]: a gloo worker thread can still hold a finished collective's
    # work, and with it the last reference to the tensors it read or wrote, after the
    # main thread has moved on. If the thread lets go of it just as the interpreter
    # starts finalizing, releasing those tensors' Python objects needs the GIL, and a
    # thread that asks for the GIL then is ended by pthread_exit inside a C++
    # destructor: "terminate called without an active exception" (SIGABRT) at exit,
    # rarely, under load (torch checks Py_IsInitialized() before taking the GIL, but
    # finalization can start between the check and the GIL). destroy_process_group()
    # does not stop those threads while anything still references the group: the
    # model's FSDP state, and the device mesh, which torch's DTensor sharding caches
    # keep alive for the life of the process. So: a barrier (no collective in flight on
    # any rank), destroy the group, detach it from the mesh, and collect the model
    # (the training function has returned; gc.collect() frees reference cycles): the
    # group's destructor joins its threads while the interpreter is fully alive.
    # After an error only destroy_process_group(): a barrier or a join could wait for
    # a rank that is gone.
    if clean:
        dist.barrier()
    dist.destroy_process_group()
    if clean:
        if mesh is not None:
            getattr(mesh, "_pg_registry", {}).clear()  # torch >= 2.12 keeps the groups here
        gc.collect()


def main(argv: list[str] | None = None) -> float:
    """Run the job under torchrun; returns the last step's mean loss."""
    args = parse_args(argv)
    device = init_distributed(args.device)
    clean, mesh = False, None
    try:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        last = train(args, device, mesh)
        clean = True
    finally:
        shutdown_distributed(clean, mesh)
    return last


def train(args: argparse.Namespace, device: torch.device, mesh: DeviceMesh) -> float:
    """Train, print the steps and rank 0's memory report; the last step's mean loss.

    The model, optimizer and tracker (all reference the process group) live in this
    function's frame only (Note [Shutdown order]).
    """
    use_cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = Llama(vocab=256, dim=args.dim, layers=args.layers, heads=args.heads, max_seq=args.seq).to(device)
    apply_checkpointing(model, f"ac2-budget-{args.budget}" if args.ac == "ac2-budget" else args.ac)
    if args.compile:
        compile_blocks(model)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=args.reshard)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = batches(corpus(), args.batch, args.seq, args.seed, rank)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"train.py: {world} ranks ({device.type}), Llama {args.layers}x{args.dim}, "
              f"{n_params / 1e6:.2f}M params, seq {args.seq}, batch {args.batch}/rank, --ac {args.ac}"
              f"{' (compiled blocks)' if args.compile else ''}",
              flush=True)
    first = last = float("nan")
    report = None
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in next(data))
        t0 = time.perf_counter()
        # A with-block: the tracker's profiler session ends even if the step fails.
        with (ac.memory.track(model) if step == args.steps else contextlib.nullcontext()) as tracker:
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
        if tracker is not None:
            report = tracker.report()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value)
        value = value.item() / world
        if use_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        first = value if step == 1 else first
        last = value
        if rank == 0:
            tok_s = args.batch * args.seq * world / dt
            print(f"step {step:3d}/{args.steps}  loss {value:.4f}  {tok_s:8.0f} tok/s  {dt * 1e3:7.1f} ms",
                  flush=True)
    reports = ac.memory.gather(report)
    if rank == 0:
        print(f"loss {first:.4f} -> {last:.4f}")
        print(f"per-rank memory report (step {args.steps}, --ac {args.ac}):")
        print(ac.memory.format_table(reports))
        if args.report_json:
            ac.memory.save_run(reports, args.report_json)
            print(f"wrote {args.report_json}")
    return last


if __name__ == "__main__":
    main()
