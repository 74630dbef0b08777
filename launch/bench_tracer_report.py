"""bench_tracer.py's result tables that need none of its modes: the collector-in-a-loop
lines, paired ratios per size and the instruction table (plus the size and ratio cells
its own timing table uses). Moved verbatim from bench_tracer.py."""

from __future__ import annotations

import statistics

__all__ = ["paired", "report_instructions", "report_loop"]


def report_loop(loop: dict[str, dict[int, dict]], total_ops: int) -> str:
    lines = [f"The collector in a training loop (steps back to back, {total_ops} ops per size, no collection forced"
             " between steps): us per op in the collector during forwards / forward us per op, full collections"]
    for mode, by_size in loop.items():
        lines.append(f"  {mode}: " + ", ".join(
            f"{_size(n)} {r['gc_us']:.2f} / {r['fwd_us']:.1f} ({r['full']} full in {r['steps']} steps)"
            for n, r in by_size.items()))
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


def _ratio(r: dict[str, dict], a: str, b: str, phase: str = "fwd") -> str:
    """Median over rounds of ``a``'s time over ``b``'s in the same round: a noise burst
    during one round moves one sample, not the ratio of two independent medians."""
    key = f"{phase}_s"
    return f"{statistics.median(x / y for x, y in zip(r[a][key], r[b][key])):.2f}"


def paired(results: dict[int, dict[str, dict]], mode: str, base: str) -> str:
    """Per size: median over rounds of ``mode``'s forward (backward) time over ``base``'s
    in the same round."""
    cells = []
    for n, r in results.items():
        f = statistics.median(a / b for a, b in zip(r[mode]["fwd_s"], r[base]["fwd_s"]))
        b = statistics.median(a / b for a, b in zip(r[mode]["bwd_s"], r[base]["bwd_s"]))
        cells.append(f"{_size(n)} {f:.2f} / {b:.2f}")
    return f"{mode} / {base} (forward / backward, paired per round): " + ", ".join(cells)


def report_instructions(counts: dict[int, dict[str, dict[str, float]]]) -> str:
    """The instruction table: per-op counts (thousands) and the ratios issue 23 asks for."""
    modes = list(next(iter(counts.values())))
    lines = ["| ops | " + " | ".join(modes) + " | ac2 full fwd / no-op | ac2 full fwd / no-op + hooks |"
             " ac2 full bwd / torch full |", "|---:|" + "---:|" * (len(modes) + 3)]

    def ratio(r: dict, a: str, b: str, ph: str = "fwd") -> str:
        return f"{r[a][ph] / r[b][ph]:.3f}" if a in r and b in r and ph in r[a] and ph in r[b] else ""

    for n, r in counts.items():
        cells = [" / ".join(f"{r[m][ph] / 1000:.1f}" for ph in ("fwd", "bwd") if ph in r[m]) for m in modes]
        cells += [ratio(r, "ac2-full", "noop-mode"), ratio(r, "ac2-full", "noop-mode+hooks"),
                  ratio(r, "ac2-full", "torch-full", "bwd")]
        lines.append(f"| {_size(n)} | " + " | ".join(cells) + " |")
    sizes = list(counts)
    lines.append("")
    if len(sizes) > 1 and any("fwd" in r for r in counts[sizes[0]].values()):
        first, last = counts[sizes[0]], counts[sizes[-1]]
        lines.append(f"forward per op at {_size(sizes[-1])} ops / at {_size(sizes[0])}: " + ", ".join(
            f"{m} {last[m]['fwd'] / first[m]['fwd']:.3f}" for m in modes if "fwd" in first[m]))
    if "base-full" in modes:
        for ph, phase in (("fwd", "forward"), ("bwd", "backward")):
            cells = [f"{_size(n)} {name} {ratio(r, mode, base, ph)}"
                     for n, r in counts.items()
                     for name, mode, base in (("full", "ac2-full", "base-full"), ("save-list", "ac2-save", "base-save"))
                     if ratio(r, mode, base, ph)]
            if cells:
                lines.append(f"this / baseline, {phase}: " + ", ".join(cells))
    return "\n".join(lines)
