"""What ``ac2_dist.simulate`` reports per mode (:class:`ModeReport`), the table it prints,
the named devices whose rates price recompute, and what it does not count."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._sizes import human_bytes

__all__ = ["DEVICES", "HOST_LINKS", "NOT_COUNTED", "ModeReport"]

#: FLOP/s (16-bit, 32-bit dense matmul) and memory bytes/s of the named devices
#: (vendor datasheet figures, SXM parts; fp32 without TF32, torch's default).
DEVICES: dict[str, tuple[float, float, float]] = {
    "h100": (989e12, 67e12, 3.35e12),
    "h200": (989e12, 67e12, 4.8e12),
    "a100": (312e12, 19.5e12, 2.039e12),
    "cpu": (2.0e11, 2.0e11, 5.0e10),
}

#: Host <-> device bytes/s of the named devices' host link, one direction (PCIe Gen5 x16
#: for H100/H200 SXM, Gen4 for A100, as pinned copies achieve it; a copy in memory on CPU).
HOST_LINKS: dict[str, float] = {"h100": 50e9, "h200": 50e9, "a100": 25e9, "cpu": 10e9}

#: What the simulation does not count, each with a typical size on a GPU.
NOT_COUNTED: tuple[tuple[str, str], ...] = (
    ("allocator fragmentation, reserved but unallocated blocks, beyond the caching allocator's model",
     "blocks record_stream holds past a free, allocator settings (the 'peak reserved' rows model the rest)"),
    ("NCCL communicator buffers and streams", "0.5-2 GiB per process group"),
    ("the CUDA context and kernels (cuBLAS/cuDNN workspaces included)", "0.5-1 GiB per process"),
    ("kernels' internal scratch (attention, reductions)", "a few MiB to a few hundred MiB"),
    ("collective buffers held past their wait (gloo's worker threads)",
     "up to two FSDP units' unsharded parameters on a gloo job (a peak target is planned clear of them)"),
)

# Categories of torch's trackers -> the rows the report shows.
_ROWS = (
    ("parameters (sharded) and buffers", ("Sharded Param", "Parameter", "Buffer")),
    ("gradients", ("Sharded Grad", "Unsharded Grad", "Gradient")),
    ("optimizer states", ("OptState", "Optstate")),
    ("FSDP unsharded parameters, all-gather / reduce-scatter buffers", ("Unsharded Param", "All Gather",
                                                                        "Reduce Scatter")),
    ("activations (forward outputs alive)", ("Activation",)),
    ("temporaries (backward and replay working set)", ("Temp",)),
    ("inputs and other", ("Inputs", "Other")),
)


def rows(breakdown: dict[str, int]) -> dict[str, int]:
    """A tracker's categories summed into the report's rows."""
    out = {name: sum(breakdown.get(c, 0) for c in cats) for name, cats in _ROWS}
    known = {c for _, cats in _ROWS for c in cats} | {"Total"}
    other = sum(v for k, v in breakdown.items() if k not in known)
    out["inputs and other"] += other
    return out


@dataclass
class ModeReport:
    """One simulated mode on the simulated rank.

    Attributes:
        name: ``"no AC"``, ``"full AC"``, ``"save: <ops>"`` or ``"target <size>"``.
        peak_bytes: the rank's simulated peak (every tensor alive: parameters,
            gradients, optimizer states, FSDP's buffers, activations, temporaries).
        start_bytes: alive when the counted step began.
        breakdown: the peak's bytes per category.
        when: when the peak happens (``"forward of block 3"``, ``"backward of block 0"``,
            ``"optimizer step"``, ...).
        recompute_flops: FLOPs backward recomputes per step (the planner's cost model).
        recompute_seconds: their estimated time on the named device (roofline).
        kept_bytes: per block fqn, the bytes its forward leaves alive (its output included).
        predicted_bytes: for a target, the peak model's prediction (the planner's
            figure; ``peak_bytes`` is the simulated step running the plan).
        boundary_bytes: the block inputs ``Offload(block_inputs=True)`` moves to host
            memory (every block's but the last's), per step.
        offload_peak_bytes: the peak of the same step with them offloaded (None for no
            AC: its blocks are not checkpointed).
        offload_when: when that peak happens.
        boundary_copy_seconds: one block input's copy over the host link, one way (the
            largest block's).
        block_backward_seconds: a block's backward, estimated as twice its forward's
            FLOPs at the device's rate (the smallest block's): the window the copy back
            of the next block's input is hidden in (by the prefetch), as the copy out is in
            the next block's forward.
        reserved_bytes: the step's peak *reserved* bytes (``max_memory_reserved``'s
            scale): its allocations run through a model of torch's CUDA caching
            allocator (rounding, small and large pools, segment sizes, best fit,
            splitting, FSDP2's all-gather and reduce-scatter streams' own pools); 0
            for a target's prediction.
        reserved_expandable_bytes: the same with ``expandable_segments:True``.
    """

    name: str
    peak_bytes: int
    start_bytes: int
    breakdown: dict[str, int]
    when: str
    recompute_flops: int = 0
    recompute_seconds: float = 0.0
    kept_bytes: dict[str, int] = field(default_factory=dict)
    predicted_bytes: int | None = None
    boundary_bytes: int = 0
    offload_peak_bytes: int | None = None
    offload_when: str = "-"
    boundary_copy_seconds: float = 0.0
    block_backward_seconds: float = 0.0
    reserved_bytes: int = 0
    reserved_expandable_bytes: int = 0


def _short(when: str, head: bool = True) -> str:
    return (when.replace("backward of block ", "bwd block ").replace("forward of block ", "fwd block ")
            .replace("backward, outside the blocks", "bwd, head/loss" if head else "bwd, outside blocks")
            .replace("forward, outside the blocks", "fwd, outside blocks")
            .replace("predicted (peak model)", "(model)"))


def format_table(modes: list[ModeReport], head: str, has_head: bool = True) -> str:
    """The report's table: one column per mode. ``has_head``: the model computes the head
    and the loss (not a pipeline stage before the last): a peak in backward outside the
    blocks is said to be theirs."""
    names = [m.name for m in modes]
    width = max([12] + [len(n) for n in names] + [len(_short(m.when, has_head)) for m in modes]) + 2
    label = 64
    lines = [head, "", f"{'':<{label}}" + "".join(f"{n:>{width}}" for n in names)]

    def row(title: str, cells: list[str]) -> None:
        lines.append(f"{title:<{label}}" + "".join(f"{c:>{width}}" for c in cells))

    row("peak on the rank", [human_bytes(m.peak_bytes) for m in modes])
    if any(m.predicted_bytes is not None for m in modes):
        row("  peak model's prediction (target)", ["-" if m.predicted_bytes is None else human_bytes(m.predicted_bytes)
                                                   for m in modes])
    row("  when", [_short(m.when, has_head) for m in modes])
    if any(m.reserved_bytes for m in modes):
        row("peak reserved (caching allocator model)", [human_bytes(m.reserved_bytes) for m in modes])
        row("  with expandable_segments", [human_bytes(m.reserved_expandable_bytes) for m in modes])
    per_mode = [rows(m.breakdown) for m in modes]
    for name, _ in _ROWS:
        row("  " + name, [human_bytes(r[name]) for r in per_mode])
    row("alive when the step begins", [human_bytes(m.start_bytes) for m in modes])
    row("kept by the blocks' forwards (sum)", [human_bytes(sum(m.kept_bytes.values())) for m in modes])
    row("recompute per step, GFLOP", [f"{m.recompute_flops / 1e9:.3f}" for m in modes])
    row("recompute per step, estimated ms", [f"{m.recompute_seconds * 1e3:.3f}" for m in modes])
    if any(m.offload_peak_bytes is not None for m in modes):
        def cell(m: ModeReport, text: str) -> str:
            return "-" if m.offload_peak_bytes is None else text

        row("block inputs offloaded: Offload(block_inputs=True)", [""] * len(modes))
        row("  moved to host memory (every block's input but the last's)",
            [cell(m, human_bytes(m.boundary_bytes)) for m in modes])
        row("  peak on the rank with them offloaded", [cell(m, human_bytes(m.offload_peak_bytes or 0)) for m in modes])
        row("  when", [cell(m, _short(m.offload_when, has_head)) for m in modes])
        row("  one block input's copy, each way, estimated ms",
            [cell(m, f"{m.boundary_copy_seconds * 1e3:.3f}") for m in modes])
        row("  a block's backward (its window), estimated ms",
            [cell(m, f"{m.block_backward_seconds * 1e3:.3f}") for m in modes])
    lines.append("")
    lines.append("Not counted (allocated-bytes scale; add these to compare with nvidia-smi):")
    for what, size in NOT_COUNTED:
        lines.append(f"  - {what}: {size}")
    return "\n".join(lines)
