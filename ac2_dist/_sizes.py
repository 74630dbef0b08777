"""Sizes in bytes, read from what users write (:func:`parse_size`: ``"70GiB"``) and
written for them to read (:func:`human_bytes`)."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["human_bytes", "human_or_dash", "parse_size"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(value: Any, name: str = "peak") -> int:
    """Bytes from an int (> 0) or a string such as ``"70GiB"``, ``"512MiB"``, ``"1.5 GB"``
    (units B, KB/MB/GB/TB = powers of 1000, KiB/MiB/GiB/TiB = powers of 1024)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"ac2_dist.MemoryBudget: {name} must be an int (bytes) or a size string "
                        f"such as '70GiB' or '512MiB', got {type(value).__name__} {value!r}")
    if isinstance(value, int):
        nbytes = value
    else:
        m = _SIZE.match(value)
        unit = _UNITS.get(m.group(2).lower()) if m else None
        if m is None or unit is None:
            raise ValueError(f"ac2_dist.MemoryBudget: {name}={value!r} is not a size; write bytes as an int "
                             f"or a number with a unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '70GiB')")
        nbytes = int(float(m.group(1)) * unit)
    if nbytes <= 0:
        raise ValueError(f"ac2_dist.MemoryBudget: {name} must be > 0 bytes, got {value!r}")
    return nbytes


def human_bytes(n: float) -> str:
    """``n`` bytes as text: ``"512 B"``, ``"1.5 MiB"`` (powers of 1024, up to TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_or_dash(n: int | None) -> str:
    """:func:`human_bytes` of ``n``, or ``-`` for no figure."""
    return "-" if n is None else human_bytes(n)
