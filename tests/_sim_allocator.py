"""A simulated CUDA caching allocator's statistics and memory history, on CPU.

What ac2 reads from (or must leave alone in) the CUDA caching allocator, with the
allocator's semantics: ``memory_allocated`` / ``max_memory_allocated`` /
``reset_peak_memory_stats``, ``memory_stats`` (the bytes and the cumulative counts of
allocations and frees), and the memory history (``_record_memory_history``,
``_snapshot``'s ``device_traces``, ``torch._C._cuda_isHistoryEnabled``): blocks are
rounded up to 512 bytes, the history records the requested size, a recording keeps at
most ``max_entries`` entries (the oldest are dropped), switching it off clears it.

Allocations are made by hand (:meth:`SimAllocator.alloc` / :meth:`free`), or by the
CPU tensors that ops return while :meth:`SimAllocator.feeding` runs (a dispatch mode:
a storage is allocated the first time an op returns it and freed when the last
tensor seen on it dies). :meth:`install` puts it in place of ``torch.cuda``'s
functions with pytest's ``monkeypatch``; every call is counted in ``calls``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_BLOCK = 512


def _rounded(nbytes: int) -> int:
    return max(_BLOCK, -(-nbytes // _BLOCK) * _BLOCK)


class SimAllocator:
    def __init__(self) -> None:
        self.current = 0  # bytes allocated (rounded blocks)
        self.peak = 0  # the peak statistic (since the last reset)
        self.true_peak = 0  # never reset: what the step really reached
        self.allocations = 0  # cumulative counts (memory_stats' allocation.all.allocated / freed)
        self.frees = 0
        self.blocks: dict[int, int] = {}  # key -> requested bytes
        self.history: list[dict] | None = None  # None: not recording
        self.max_entries = 0
        self.skip: set[str] = set()
        self.calls: Counter[str] = Counter()
        self.backend = "native"  # PYTORCH_CUDA_ALLOC_CONF's backend
        self._next = 1

    # ---- allocations ---------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        key = self._next
        self._next += 1
        self.blocks[key] = nbytes
        self.current += _rounded(nbytes)
        self.peak = max(self.peak, self.current)
        self.true_peak = max(self.true_peak, self.current)
        self.allocations += 1
        self._record("alloc", key, nbytes)
        return key

    def free(self, key: int) -> None:
        nbytes = self.blocks.pop(key)
        self.current -= _rounded(nbytes)
        self.frees += 1
        self._record("free_requested", key, nbytes)

    def _record(self, action: str, key: int, nbytes: int) -> None:
        if self.history is None or action in self.skip:
            return
        self.history.append({"action": action, "addr": key * 4096, "size": nbytes, "stream": 0})
        if len(self.history) > self.max_entries:
            del self.history[0]

    # ---- torch.cuda's functions ------------------------------------------------------------
    def memory_allocated(self, device: Any = None) -> int:
        self.calls["memory_allocated"] += 1
        return self.current

    def max_memory_allocated(self, device: Any = None) -> int:
        self.calls["max_memory_allocated"] += 1
        return self.peak

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.calls["reset_peak_memory_stats"] += 1
        self.peak = self.current

    def reset_accumulated_memory_stats(self, device: Any = None) -> None:
        self.calls["reset_accumulated_memory_stats"] += 1
        self.allocations = self.frees = 0

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        self.calls["memory_stats"] += 1
        return {"allocated_bytes.all.current": self.current, "allocated_bytes.all.peak": self.peak,
                "allocation.all.allocated": self.allocations, "allocation.all.freed": self.frees,
                "allocation.all.current": len(self.blocks)}

    def record_memory_history(self, enabled: Any = "all", context: Any = "all", stacks: str = "all",
                              max_entries: int = 2**62, device: Any = None, clear_history: bool = False,
                              compile_context: bool = False, global_record_annotations: bool = False,
                              skip_actions: list[str] | None = None) -> None:
        self.calls["_record_memory_history"] += 1
        if enabled is None:
            self.history = None  # switching it off clears it (the allocator's recordHistory)
            return
        if self.history is None or clear_history:
            self.history = []
        self.max_entries = max_entries
        self.skip = set(skip_actions or ())

    def snapshot(self, device: Any = None) -> dict:
        self.calls["_snapshot"] += 1
        return {"segments": [], "device_traces": [list(self.history or [])]}

    def is_history_enabled(self) -> bool:
        return self.history is not None

    def install(self, monkeypatch: Any) -> SimAllocator:
        for name in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats",
                     "reset_accumulated_memory_stats", "memory_stats"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self.record_memory_history)
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", self.snapshot)
        monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", self.is_history_enabled, raising=False)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: self.backend)
        return self

    # ---- fed by the tensors ops return ---------------------------------------------------
    @contextlib.contextmanager
    def feeding(self) -> Iterator[None]:
        """While it runs, the storages of the CPU tensors that ops return are this
        allocator's blocks (see the module docstring)."""
        mode = _Feed(self)
        with mode:
            yield


class _Feed(TorchDispatchMode):
    def __init__(self, sim: SimAllocator) -> None:
        super().__init__()
        self.sim = sim
        self.users: dict[int, list] = {}  # storage address -> [block key, live tensors seen on it]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if type(t) is torch.Tensor and t.device.type == "cpu":
                self._seen(t)
        return out

    def _seen(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return
        entry = self.users.get(ptr)
        if entry is None:
            entry = self.users[ptr] = [self.sim.alloc(nbytes), 0]
        entry[1] += 1
        weakref.finalize(t, self._dropped, ptr, entry)

    def _dropped(self, ptr: int, entry: list) -> None:
        entry[1] -= 1
        if entry[1] == 0:
            self.sim.free(entry[0])
            if self.users.get(ptr) is entry:
                del self.users[ptr]
