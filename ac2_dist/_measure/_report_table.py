"""Rank reports rendered: :func:`format_table` (a rank x metric table) and :func:`plot`
(a PNG). Moved verbatim from memory.py, which re-exports them."""

from __future__ import annotations

import os

from .._sizes import human_bytes as _human_bytes
from .._trace._nodes import REASONS
from ._rank_report import RankReport, as_reports

__all__ = ["format_table", "plot"]


_ROWS = [
    ("peak forward", "peak_bytes_forward", _human_bytes),
    ("peak backward", "peak_bytes_backward", _human_bytes),
    ("live after forward", "live_bytes_after_forward", _human_bytes),
    ("saved after forward", "saved_bytes", _human_bytes),
    *[(f"  saved: {reason}", f"saved_bytes_by_reason.{reason}", _human_bytes) for reason in REASONS],
    ("saved in host memory", "saved_host_bytes", _human_bytes),
    ("recomputed ops", "recomputed_ops", lambda v: f"{v:.0f}"),
    ("recomputed", "recomputed_bytes", _human_bytes),
    ("replay time", "replay_seconds", lambda v: f"{v * 1e3:.1f} ms"),
    ("collectives not replayed", "collectives_not_replayed", lambda v: f"{v:.0f}"),
    ("all-gathers in backward", "allgathers_backward", lambda v: f"{v:.0f}"),
]


def _value(r: RankReport, key: str) -> float:
    if "." in key:
        a, b = key.split(".")
        return getattr(r, a).get(b, 0)
    return getattr(r, key)


def format_table(reports: list[RankReport] | RankReport | None) -> str:
    """A rank x metric table; with several ranks, min / max / imbalance (max / mean)
    columns follow the ranks' (one report: its column only).

    ``reports``: what :func:`gather` returned (``None`` off rank 0 gives
    ``"(no reports)"``), or one :class:`RankReport`. Raises TypeError for anything else.
    """
    if reports is None:
        return "(no reports)"
    reports = as_reports(reports, "format_table")
    if not reports:
        return "(no reports)"
    reports = sorted(reports, key=lambda r: r.rank)
    across = len(reports) > 1  # cross-rank columns mean nothing for one rank
    header = ["metric"] + [f"rank {r.rank}" for r in reports] + (["min", "max", "imbalance"] if across else [])
    rows = [header]
    for label, key, fmt in _ROWS:
        vals = [_value(r, key) for r in reports]
        row = [label] + [fmt(v) for v in vals]
        if across:
            mean = sum(vals) / len(vals)
            row += [fmt(min(vals)), fmt(max(vals)), f"{max(vals) / mean:.2f}x" if mean else "-"]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    modules = sorted({fqn for r in reports for fqn in r.per_module})
    if modules:
        lines.append("")
        lines.append("per module (saved / recomputed)" + (", by rank:" if across else ":"))
        for fqn in modules:
            cells = []
            for r in reports:
                m = r.per_module.get(fqn, {})
                cell = f"{_human_bytes(m.get('saved_bytes', 0))} / {_human_bytes(m.get('recomputed_bytes', 0))}"
                if m.get("saved_host_bytes"):  # offloaded values kept in host memory
                    cell += f" (+{_human_bytes(m['saved_host_bytes'])} in host memory)"
                if "budget_bytes" in m:  # an ac2_dist.MemoryBudget plan
                    cell += (f" (budget {_human_bytes(m['budget_bytes'])}, plan saves "
                             f"{_human_bytes(m['plan_saved_bytes'])}, est. recompute "
                             f"{m['plan_recompute_us'] / 1e3:.2f} ms)")
                if "peak_target_bytes" in m:  # a MemoryBudget(peak=...): the step's figures
                    cell += (f" [step peak target {_human_bytes(m['peak_target_bytes'])}, predicted "
                             f"{_human_bytes(m.get('peak_predicted_bytes', 0)) if 'peak_predicted_bytes' in m else '-'}"
                             f", measured {_human_bytes(m['peak_measured_bytes']) if 'peak_measured_bytes' in m else '-'}]")
                cells.append(cell)
            lines.append(f"  {fqn or '(region)'}: " + " | ".join(cells))
    return "\n".join(lines)


def plot(reports: list[RankReport] | RankReport, path: str | os.PathLike[str]) -> None:
    """Write a PNG: per-rank bars of saved / recomputed / peak, and a per-module breakdown.

    Needs matplotlib (``pip install 'ac2-dist[plot]'``). Raises TypeError unless
    ``reports`` is a list of :class:`RankReport` (or one), ValueError unless ``path``
    ends in ``.png``, ImportError without matplotlib, OSError if ``path`` cannot be written.
    """
    reports = as_reports(reports, "plot")
    if not os.fspath(path).lower().endswith(".png"):
        raise ValueError(f"ac2_dist.memory.plot writes PNG files: give a path ending in .png, got {path!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("ac2_dist.memory.plot needs matplotlib: pip install 'ac2-dist[plot]'") from e
    reports = sorted(reports, key=lambda r: r.rank)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    mib = 1 / 2**20
    series = [
        ("saved after forward", [r.saved_bytes * mib for r in reports]),
        ("recomputed", [r.recomputed_bytes * mib for r in reports]),
        ("peak forward", [r.peak_bytes_forward * mib for r in reports]),
        ("peak backward", [r.peak_bytes_backward * mib for r in reports]),
    ]
    width = 0.8 / len(series)
    for k, (label, vals) in enumerate(series):
        ax1.bar([r.rank + k * width for r in reports], vals, width, label=label)
    ax1.set_xticks([r.rank + 0.4 - width / 2 for r in reports], [f"rank {r.rank}" for r in reports])
    ax1.set_ylabel("MiB")
    ax1.set_title("per rank")
    ax1.legend()
    modules = sorted({fqn for r in reports for fqn in r.per_module})
    if modules:
        for k, r in enumerate(reports):
            ax2.barh([i + k * 0.8 / len(reports) for i in range(len(modules))],
                     [r.per_module.get(m, {}).get("saved_bytes", 0) * mib for m in modules],
                     0.8 / len(reports), label=f"rank {r.rank} saved")
        ax2.set_yticks(range(len(modules)), [m or "(region)" for m in modules])
        ax2.set_xlabel("MiB saved after forward")
        ax2.set_title("per module")
        ax2.legend()
    else:
        ax2.axis("off")
    try:
        fig.tight_layout()
        fig.savefig(path, dpi=100, format="png")
    finally:
        plt.close(fig)

