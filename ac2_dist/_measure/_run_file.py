"""Rank reports across ranks and on disk: :func:`gather` onto rank 0, :func:`save_run`
/ :func:`load_run` a run file, :func:`run_warnings` on a set that still renders.
Moved verbatim from memory.py, which re-exports them."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from typing import Any

import torch

from ._rank_report import SCHEMA_VERSION, RankReport, _describe, as_report, as_reports

__all__ = ["gather", "save_run", "load_run", "run_warnings"]


def gather(report: RankReport) -> list[RankReport] | None:
    """Collect every rank's report on rank 0 (a collective); ``None`` elsewhere.

    Call it on every rank. Without an initialized process group it returns ``[report]``.
    Raises TypeError, before any communication, for anything but a :class:`RankReport`
    (a ``Tracker``: pass ``tracker.report()``).
    """
    as_report(report, "gather")
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return [report]
    dicts = _gather_json(report.to_dict())
    return None if dicts is None else [RankReport.from_dict(d) for d in dicts]


def _gather_json(obj: Any, dst: int = 0) -> list[Any] | None:
    """Gather a JSON-serializable ``obj`` from every rank onto rank ``dst`` (a collective).

    Returns the decoded objects by rank on ``dst`` and ``None`` elsewhere; without an
    initialized process group, ``[obj]`` (JSON round-tripped, as on the collective path).
    """
    # Note [Gather without numpy]: dist.gather_object pickles into a tensor and reads
    # it back with tensor.numpy(), which fails with "Numpy is not available" when numpy
    # is not installed (torch does not depend on it). Here the payload is JSON bytes in
    # a uint8 tensor (torch.frombuffer / tolist need no numpy): all_gather the sizes,
    # then gather the bytes padded to the longest (gloo and nccl both support gather).
    payload = json.dumps(obj).encode()
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return [json.loads(payload)]
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    padded = padded.to(device)
    out = [torch.empty_like(padded) for _ in range(world)] if rank == dst else None
    dist.gather(padded, out, dst=dst)
    if out is None:
        return None
    return [json.loads(bytes(t[:n].cpu().tolist())) for t, n in zip(out, lengths)]


def save_run(reports: list[RankReport] | None, path: str) -> None:
    """Write ``{"schema_version": ..., "ranks": [...]}`` to ``path``.

    ``reports`` is what :func:`gather` returned: on the ranks where that is ``None``
    (every rank but rank 0) nothing is written, so every rank can make the same call.
    Raises TypeError for anything but a list of :class:`RankReport` (or ``None``).
    """
    if reports is None:
        return
    reports = as_reports(reports, "save_run")
    with open(path, "w") as f:
        json.dump({"schema_version": SCHEMA_VERSION, "ranks": [r.to_dict() for r in reports]}, f, indent=1)


def load_run(path: str) -> list[RankReport]:
    """Read a file written by :func:`save_run`.

    Raises OSError if it cannot be read and ValueError (one line naming the file and
    what is wrong) if it is not a valid run file. Files that are valid but look
    inconsistent (duplicate or out-of-range ranks, mixed world sizes, no ranks) load,
    with a :class:`UserWarning` per problem (see :func:`run_warnings`).
    """
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, too deep
        raise ValueError(f"{path} is not JSON ({e}); expected a file written by ac2_dist.memory.save_run") from None
    if not isinstance(data, dict) or not isinstance(data.get("ranks"), list):
        raise ValueError(
            f"{path} is not a run file: expected an object {{\"schema_version\": {SCHEMA_VERSION}, "
            f"\"ranks\": [...]}}, got {_describe(data)}"
        )
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"{path} has schema_version {data.get('schema_version')!r}, expected {SCHEMA_VERSION}; "
            "read it with the ac2_dist version that wrote it"
        )
    reports = []
    for i, entry in enumerate(data["ranks"]):
        try:
            reports.append(RankReport.from_dict(entry))
        except ValueError as e:
            raise ValueError(f"{path}: ranks[{i}]: {e}") from None
    for problem in run_warnings(reports):
        warnings.warn(f"{path}: {problem}", UserWarning, stacklevel=2)
    return reports


def run_warnings(reports: list[RankReport]) -> list[str]:
    """Inconsistencies in a set of rank reports that still render (one line each):
    no reports, mixed world sizes, ranks outside ``[0, world_size)``, duplicate ranks."""
    reports = as_reports(reports, "run_warnings")
    if not reports:
        return ["no rank reports"]
    problems = []
    sizes = sorted({r.world_size for r in reports})
    if len(sizes) > 1:
        problems.append(f"mixed world sizes {sizes} (reports from different jobs?)")
    outside = sorted({r.rank for r in reports if r.rank >= r.world_size})
    if outside:
        problems.append(f"rank(s) {outside} not below world_size ({', '.join(map(str, sizes))})")
    counts = Counter(r.rank for r in reports)
    dup = sorted(rank for rank, n in counts.items() if n > 1)
    if dup:
        problems.append(f"duplicate rank(s) {dup}")
    return problems

