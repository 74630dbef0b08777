"""Quiet by default: the profiler session ac2 starts to measure a step prints nothing.

Note [ac2's profiler session prints nothing]
    A memory-profiling ``torch.profiler`` session prints two kinds of native lines to
    stderr, from C++ loggers no Python setting reaches: kineto's ``USDT: ...
    profiler_start`` / ``profiler_stop`` when a session starts and stops, and c10's
    ``Memory block of unknown size was allocated before the profiling started`` (the CPU
    allocator, on the first free of a block from before the session, then every 1000th).
    ac2 starts such a session for every tracked step (``memory.track``, a
    ``MemoryBudget(peak=...)`` on CPU), so a 2-rank job printed them per step and per
    rank. Both loggers read a process-wide level that the libraries export: kineto's
    ``libkineto::Logger::severityLevel_`` (read it only once a session has been prepared:
    preparing the first one sets it) and c10's ``FLAGS_caffe2_log_level``.
    So ac2 raises kineto's level above its USDT lines only while its own session starts
    and stops (``start_trace`` / ``stop_trace``: kineto prints them on the calling thread),
    and c10's level to ERROR while its own session runs, and restores both after. A user's
    own ``torch.profiler`` session prints what torch prints. A level the user chose
    (``KINETO_LOG_LEVEL``, ``TORCH_CPP_LOG_LEVEL`` in the environment) is left alone, and
    where a symbol cannot be found (another platform, a torch that does not export it)
    nothing is changed. c10 warnings logged while an ac2 session runs are hidden with
    the allocator's: in Python code torch turns its C++ warnings into Python warnings,
    which are not affected. One Python warning is: torch 2.10 and 2.11 (fixed by 2.13)
    warn "Profiler clears events at the end of each cycle" as any session is prepared,
    once per process; ac2's session prepares with it ignored (``CYCLE_WARNING``; the
    ``acc_events=True`` that silences it would process every event of the step in Python).
    torch then counts it as shown, so a user's session prepared later does not warn either
    (measured on torch 2.11); the warning is about accumulating events over cycles, which
    neither ac2's single-cycle sessions nor that omission change.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# The message torch 2.10-2.11's profiler warns at a session's first cycle (Note [ac2's
# profiler session prints nothing]).
CYCLE_WARNING = r"Warning: Profiler clears events at the end of each cycle"

# (the environment variable a user sets to choose the level, library, symbol, quiet level)
_LEVELS = {
    # kineto: VERBOSE 0, INFO 1, WARNING 2, STAGE 3, ERROR 4, USDT 5
    "kineto": ("KINETO_LOG_LEVEL", "torch_cpu", "_ZN9libkineto6Logger14severityLevel_E", 6),
    # c10: INFO 0, WARNING 1, ERROR 2, FATAL 3
    "c10": ("TORCH_CPP_LOG_LEVEL", "c10", "FLAGS_caffe2_log_level", 2),
}
_cells: dict[str, ctypes.c_int | None] = {}
_lock = threading.Lock()
_depth = 0
_saved_c10: int | None = None


def _cell(name: str) -> ctypes.c_int | None:
    """The level's int in the loaded library, or None where it cannot be found."""
    if name not in _cells:
        _, lib, symbol, _ = _LEVELS[name]
        cell = None
        libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
        for filename in (f"lib{lib}.so", f"lib{lib}.dylib"):
            path = os.path.join(libdir, filename)
            if not os.path.exists(path):
                continue
            try:
                cell = ctypes.c_int.in_dll(ctypes.CDLL(path), symbol)
            except (OSError, ValueError):
                cell = None
            break
        _cells[name] = cell
    return _cells[name]


def _ours(name: str) -> ctypes.c_int | None:
    """The level's cell if ac2 may change it: the user chose no level, the symbol exists."""
    if sys.platform.startswith("win") or _LEVELS[name][0] in os.environ:
        return None
    return _cell(name)


def _set(name: str, value: int) -> None:
    cell = _cell(name)
    if cell is not None:
        cell.value = value


def levels() -> dict[str, int | None]:
    """The current levels (None: not found), for tests."""
    return {name: (None if _cell(name) is None else _cell(name).value) for name in _LEVELS}  # type: ignore[union-attr]


@contextmanager
def kineto_quiet() -> Iterator[None]:
    """Kineto prints nothing inside (wrap a start or stop of ac2's own session)."""
    cell = _ours("kineto")
    if cell is None:
        yield
        return
    old = cell.value
    _set("kineto", _LEVELS["kineto"][3])
    try:
        yield
    finally:
        _set("kineto", old)


def session_started() -> None:
    """ac2's own session is about to start: c10's warnings off until :func:`session_stopped`."""
    global _depth, _saved_c10
    with _lock:
        _depth += 1
        if _depth == 1:
            cell = _ours("c10")
            _saved_c10 = None if cell is None else cell.value
            if cell is not None and cell.value < _LEVELS["c10"][3]:
                _set("c10", _LEVELS["c10"][3])


def session_stopped() -> None:
    """ac2's own session has stopped (once per :func:`session_started`)."""
    global _depth, _saved_c10
    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth == 0 and _saved_c10 is not None:
            _set("c10", _saved_c10)
            _saved_c10 = None
