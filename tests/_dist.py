"""Run a function on several gloo ranks in spawned processes, or a script under torchrun;
a run that hangs fails, a slow one is waited for (Note [A timeout catches a hang] in
_hang.py)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import _hang
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(fn: Callable, rank: int, world: int, store: str, queue: Any, args: tuple) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            # gloo's own limit on a collective: far past the hang check's (Note [A timeout
            # catches a hang] in _hang.py), so that a rank slowed by a loaded machine is waited for
            timeout=datetime.timedelta(seconds=_hang.CEILING_SECONDS),
        )
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:  # reported to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable, *args: Any, world: int = 2) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; returns results by rank.

    Raises with every failing rank's traceback, or when the ranks stop making progress
    (processes are killed: a hang fails the test instead of blocking the suite; a slow
    machine does not, Note [A timeout catches a hang] in _hang.py).
    """
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(fn, r, world, store, queue, args), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        watch = _hang.Watch([p.pid for p in procs if p.pid is not None],
                            f"{getattr(fn, '__qualname__', fn)} on {world} ranks")
        try:
            while len(results) + len(errors) < world:
                watch.check()
                try:
                    rank, status, value = queue.get(timeout=2.0)
                except queue_mod.Empty:
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"rank process died with exit code {dead[0].exitcode}") from None
                    continue
                if status == "ok":
                    results[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
        finally:
            for p in procs:
                p.join(timeout=10)  # a rank that reported exits at once; one that did not is killed
                if p.is_alive():
                    _hang.kill_tree([p.pid] if p.pid is not None else [])
                    p.join(timeout=5)
        if errors:
            raise AssertionError("\n".join(errors))
        return [results[r] for r in range(world)]


def run_torchrun(script: str, *args: str, nproc: int = 2, cwd: str | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc script *args`` as a user runs it (CPU:
    gloo); its output captured as text. Does not raise on failure; raises
    :class:`_hang.Hang` if the job stops making progress."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           script, *args]
    return _hang.run(cmd, cwd=cwd, env=env)
