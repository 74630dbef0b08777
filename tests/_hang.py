"""Waiting on other processes in tests: a wait ends on a hang, never on a slow machine.

Note [A timeout catches a hang]
    A test that waits for gloo ranks, a torchrun job or a script fails when what it
    waits for stops making progress: its whole process tree (the processes and all
    their descendants) used less than ``IDLE_SHARE`` of one core over the last
    ``STALL_SECONDS`` (a deadlock, a rank blocked on a collective its peer never
    joins, a process waiting for input: each uses no CPU at all; torchrun's agent
    polling its workers uses a fraction of a percent). A run that is only slow (a
    loaded machine, two cores shared by several jobs) keeps using CPU time and is
    waited for, however long it takes. ``CEILING_SECONDS`` ends a run that spins
    without finishing. Both can be set from the environment
    (``AC2_TEST_STALL_SECONDS``, ``AC2_TEST_CEILING_SECONDS``).

    The CPU time is read from ``/proc`` (Linux, where the suite runs); elsewhere only
    the ceiling applies.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import Any

STALL_SECONDS = float(os.environ.get("AC2_TEST_STALL_SECONDS", "180"))
CEILING_SECONDS = float(os.environ.get("AC2_TEST_CEILING_SECONDS", "3600"))
IDLE_SHARE = 0.02  # of one core, over STALL_SECONDS: less is no progress
_POLL = 1.0
_PROC = "/proc"
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class Hang(TimeoutError):
    """What a test waited for made no progress (Note [A timeout catches a hang])."""


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds used) of a live process, or None."""
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    try:
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK  # ppid; utime + stime
    except (IndexError, ValueError):
        return None


def _tree(roots: Iterable[int]) -> dict[int, float]:
    """CPU seconds of every live process in the trees under ``roots``."""
    stats = {}
    for name in os.listdir(_PROC):
        if name.isdigit() and (s := _stat(int(name))) is not None:
            stats[int(name)] = s
    children = collections.defaultdict(list)
    for pid, (ppid, _) in stats.items():
        children[ppid].append(pid)
    out: dict[int, float] = {}
    todo = [r for r in roots if r in stats]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out[pid] = stats[pid][1]
            todo += children.get(pid, ())
    return out


class Watch:
    """Progress of a set of processes and their descendants: :meth:`check` raises
    :class:`Hang` once they stall or pass the ceiling (Note [A timeout catches a hang])."""

    def __init__(self, pids: Iterable[int], what: str) -> None:
        self.pids = list(pids)
        self.what = what
        self.start = time.monotonic()
        self.seen: dict[int, float] = {}
        self.used = 0.0  # CPU seconds the trees used since the watch began (exited processes included)
        self.history: collections.deque[tuple[float, float]] = collections.deque([(self.start, 0.0)])
        self.proc = os.path.isdir(_PROC)

    def check(self) -> None:
        now = time.monotonic()
        if now - self.start > CEILING_SECONDS:
            raise Hang(f"{self.what}: still running after {CEILING_SECONDS:.0f} s (the ceiling; "
                       "AC2_TEST_CEILING_SECONDS sets it)")
        if not self.proc:
            return
        for pid, cpu in _tree(self.pids).items():
            self.used += max(0.0, cpu - self.seen.get(pid, 0.0))
            self.seen[pid] = cpu
        self.history.append((now, self.used))
        while len(self.history) > 1 and now - self.history[1][0] >= STALL_SECONDS:
            self.history.popleft()
        t0, used0 = self.history[0]
        if now - t0 >= STALL_SECONDS and self.used - used0 < IDLE_SHARE * STALL_SECONDS:
            raise Hang(f"{self.what}: no progress for {now - t0:.0f} s ({self.used - used0:.2f} CPU s used "
                       f"by its processes in that time, {now - self.start:.0f} s after it began): a hang "
                       "(AC2_TEST_STALL_SECONDS sets how long a wait without progress may last)")


def kill_tree(pids: Sequence[int]) -> None:
    """SIGKILL the processes and every descendant (descendants first seen, then roots)."""
    victims = list(_tree(pids)) if os.path.isdir(_PROC) else list(pids)
    for pid in reversed(victims):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def run(cmd: Sequence[str], *, cwd: Any = None, env: dict[str, str] | None = None,
        input: str | None = None) -> subprocess.CompletedProcess:  # noqa: A002 - subprocess.run's name
    """``subprocess.run(cmd, capture_output=True, text=True)`` that fails with
    :class:`Hang` only when the command stops making progress (Note [A timeout catches a
    hang]), never because it is slow. Output goes to temporary files, so a chatty
    command cannot block on a full pipe."""
    what = " ".join(str(c) for c in cmd)[:160]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err,
                                stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL, text=True)
        if input is not None:
            assert proc.stdin is not None
            proc.stdin.write(input)
            proc.stdin.close()
        watch = Watch([proc.pid], what)
        try:
            while proc.poll() is None:
                watch.check()
                try:
                    proc.wait(timeout=_POLL)
                except subprocess.TimeoutExpired:
                    pass
        except BaseException as exc:  # a hang, or the run interrupted: no process is left behind
            kill_tree([proc.pid])
            proc.wait()
            if not isinstance(exc, Hang):
                raise
            out.seek(0)
            err.seek(0)
            raise Hang(f"{exc}\n--- stdout (tail) ---\n{out.read()[-4000:]}\n"
                       f"--- stderr (tail) ---\n{err.read()[-4000:]}") from None
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(list(cmd), proc.returncode, out.read(), err.read())

