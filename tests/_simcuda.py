"""A simulated CUDA for the CPU test suite: streams, events and a caching-allocator model
under which ac2's side-stream replays, prefetch and asynchronous offload run on CPU
tensors, and which fails a test on a cross-stream use that CUDA's stream semantics and
caching allocator would not order. It plugs into ac2 through the stream-backend seam
(Note [Stream backends] in ac2_dist/_streams.py): regions installed while a
:class:`SimCuda` is active take it for ``torch.cuda``.

The model
- Streams. A stream counts the kernels queued on it and keeps a vector clock: for each
  other stream, the last of its kernels this stream is ordered after. An event is the
  recording stream's clock, its own count included; ``wait_event`` merges it in
  (``wait_stream`` records one and waits for it), so ordering is transitive. A host
  synchronisation (``synchronize``, ``Event.synchronize``) orders everything queued
  afterwards after what it waited for.
- Kernels. Every ATen op that runs while the simulation is active is one kernel on the
  calling thread's current stream. It reads its tensor arguments and writes those its
  schema marks written (``Tensor(a!)``) and the tensors it returns new; a view op
  (an argument its schema aliases without writing) touches no memory.
- Blocks. A block is one storage, allocated on the stream current when an op first
  returned it (a storage made before the simulation started counts as the default
  stream's). Pinned host buffers (:meth:`SimCuda.host_buffer`) are ordered like any
  block but are not the device allocator's (torch's host allocator records its own
  events).
- Free: when a block's storage dies, its memory goes back to the pool of the stream it
  was allocated on, A. If a kernel on another stream B used it, either
  ``record_stream(B)`` was called (the allocator then reuses the block only once B has
  passed this point) or A must already be ordered after that kernel. Otherwise the
  allocator may hand the block to the next allocation on A while B's kernel is still
  queued: an **unsynchronised cross-stream free**, which fails the test. Reuse itself
  is modelled: a freed block goes to A's free list and the next allocation on A takes
  it (``stats.reused``); a ``record_stream``-ed one first waits until A is ordered after
  the recorded streams' positions at the free.
- Order of access: a kernel that reads a block must be ordered after the block's last
  write, and one that writes it after its last write and every read since (a hand-over
  without ``wait_event``, a host buffer rewritten while a copy still reads it): an
  **unordered access**, which fails the test too.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ac2_dist import _streams


class SimEvent:
    """A recorded point of a stream: its vector clock then."""

    __slots__ = ("sim", "clock")

    def __init__(self, sim: SimCuda, clock: dict[int, int]) -> None:
        self.sim = sim
        self.clock = clock

    def synchronize(self) -> None:
        self.sim._host_waits(self.clock)

    def query(self) -> bool:
        return True


class SimStream:
    """A simulated stream (what ``torch.cuda.Stream`` gives ac2)."""

    __slots__ = ("sim", "id", "name", "count", "clock")

    def __init__(self, sim: SimCuda, sid: int, name: str) -> None:
        self.sim = sim
        self.id = sid
        self.name = name
        self.count = 0  # kernels queued on it
        self.clock: dict[int, int] = {}  # other stream id -> last kernel of it this one is ordered after

    def record_event(self, event: Any = None) -> SimEvent:
        clock = dict(self.clock)
        clock[self.id] = self.count
        return SimEvent(self.sim, clock)

    def wait_event(self, event: SimEvent) -> None:
        for sid, k in event.clock.items():
            if sid != self.id and k > self.clock.get(sid, 0):
                self.clock[sid] = k

    def wait_stream(self, other: SimStream) -> None:
        self.wait_event(other.record_event())

    def synchronize(self) -> None:
        self.sim._host_waits(self.record_event().clock)

    def __repr__(self) -> str:
        return f"<SimStream {self.name}>"


@dataclass
class SimStats:
    """What the simulation saw (cumulative)."""

    kernels: int = 0
    streams_created: int = 0
    cross_stream_uses: int = 0  # accesses to a block allocated on another stream
    frees: int = 0  # device blocks freed
    cross_stream_frees: int = 0  # ... of which another stream had used
    guarded_by_record_stream: int = 0
    guarded_by_wait: int = 0
    unsynchronised_frees: int = 0
    unordered_accesses: int = 0
    reused: int = 0  # allocations the model served from a stream's free list


class _Block:
    __slots__ = ("stream", "nbytes", "what", "host", "recorded", "uses", "last_write", "reads", "violation")

    def __init__(self, stream: SimStream, nbytes: int, what: str, write: tuple | None) -> None:
        self.stream = stream  # allocated on
        self.nbytes = nbytes
        self.what = what  # the op that allocated it
        self.host = False  # a pinned host buffer (not the device allocator's)
        self.recorded: set[int] = set()  # record_stream'ed on these streams
        self.uses: dict[int, tuple[int, str]] = {}  # stream id -> (last kernel, op) that used it
        self.last_write = write  # (stream id, kernel, op)
        self.reads: dict[int, tuple[int, str]] = {}  # since the last write
        self.violation: list[str] | None = None  # the message of an unsynchronised free of it


def _storage(t: torch.Tensor) -> Any:
    if t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no storage (a functional/nested wrapper)
        return None


def _op_name(func: Any) -> str:
    return str(func)


class _Kernels(TorchDispatchMode):
    """Every op is a kernel on the current simulated stream."""

    def __init__(self, sim: SimCuda) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sim = self.sim
        with sim._lock:
            stream = sim.current_stream()
            stream.count += 1
            sim.stats.kernels += 1
            k = stream.count
            name = _op_name(func)
            seen: dict[int, Any] = {}
            for t, access in _accesses(func, args, kwargs):
                storage = _storage(t)
                if storage is None:
                    continue
                seen[storage._cdata] = storage
                if access == "view":
                    continue
                block = sim._block(storage, t)
                if access == "write":
                    sim._write(block, stream, k, name)
                else:
                    sim._read(block, stream, k, name)
        out = func(*args, **kwargs)
        with sim._lock:
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor):
                    continue
                storage = _storage(t)
                if storage is None or storage._cdata in seen or storage._cdata in sim.blocks:
                    continue
                sim._allocate(storage, stream, k, name)
        return out


def _accesses(func: Any, args: tuple, kwargs: dict) -> Iterator[tuple[torch.Tensor, str]]:
    """(tensor, "read" | "write" | "view") for each tensor argument of ``func``."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                yield t, "read"
        return
    for i, a in enumerate(schema.arguments):
        if not a.kwarg_only and i < len(args):
            value = args[i]
        elif a.name in kwargs:
            value = kwargs[a.name]
        else:
            continue
        info = a.alias_info
        access = "read" if info is None else ("write" if info.is_write else "view")
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor):
                yield t, access


class SimCuda(_streams.StreamBackend):
    """The simulated CUDA (see the module docstring). Use as a context manager on the
    thread that runs the model: ``with SimCuda() as sim: ...; sim.check()``."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()
        self.stats = SimStats()
        self.default = SimStream(self, 0, "default")
        self.streams: list[SimStream] = [self.default]
        self.host: dict[int, int] = {}  # stream id -> last kernel the host waited for
        self.blocks: dict[int, _Block] = {}  # storage _cdata -> live block
        self.free_lists: dict[int, list[_Block]] = {}  # stream id -> freed blocks, reusable
        self.pending: list[tuple[_Block, dict[int, int]]] = []  # record_stream'ed, not yet reusable
        self.violations: list[list[str]] = []  # one list of lines per violation (reuse appends)
        self._tls = threading.local()
        self._reported = 0  # violations check() raised for already
        self._closed = False
        self._stack = contextlib.ExitStack()

    # ---- the stream backend ac2 uses ----------------------------------------------
    def on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def device_index(self) -> int:
        return 0

    def new_stream(self) -> SimStream:
        with self._lock:
            stream = SimStream(self, len(self.streams), f"stream{len(self.streams)}")
            self.streams.append(stream)
            self.stats.streams_created += 1
            return stream

    def current_stream(self) -> SimStream:
        stack = getattr(self._tls, "stack", None)
        return stack[-1] if stack else self.default

    @contextlib.contextmanager
    def use(self, stream: SimStream) -> Iterator[SimStream]:
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        stack.append(stream)
        try:
            yield stream
        finally:
            stack.pop()

    def record_stream(self, t: torch.Tensor, stream: SimStream) -> None:
        storage = _storage(t)
        if storage is None:
            return
        with self._lock:
            self._block(storage, t).recorded.add(stream.id)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)  # a kernel: allocated on the current stream
        with self._lock:
            self._block(buf.untyped_storage(), buf).host = True
        return buf

    # ---- the host's view ----------------------------------------------------------
    def synchronize(self) -> None:
        """``torch.cuda.synchronize()``: the host waits for every stream."""
        for s in self.streams:
            s.synchronize()

    def _host_waits(self, clock: dict[int, int]) -> None:
        with self._lock:
            for sid, k in clock.items():
                if k > self.host.get(sid, 0):
                    self.host[sid] = k

    def _knows(self, stream: SimStream, other: int) -> int:
        """The last kernel of stream ``other`` that work queued on ``stream`` now is ordered after."""
        if other == stream.id:
            return stream.count
        return max(stream.clock.get(other, 0), self.host.get(other, 0))

    # ---- memory -------------------------------------------------------------------
    def _block(self, storage: Any, t: torch.Tensor) -> _Block:
        block = self.blocks.get(storage._cdata)
        if block is None:  # made before the simulation, or by no op it saw
            block = self._track(storage, self.default, "a tensor made outside the simulation", None)
        return block

    def _track(self, storage: Any, stream: SimStream, what: str, write: tuple | None) -> _Block:
        key = storage._cdata
        block = _Block(stream, storage.nbytes(), what, write)
        self.blocks[key] = block
        weakref.finalize(storage, self._free, key, block)
        return block

    def _allocate(self, storage: Any, stream: SimStream, k: int, name: str) -> None:
        self._release_pending(stream)
        free = self.free_lists.get(stream.id)
        if free:  # the caching allocator hands out a block this stream freed
            old = free.pop()
            self.stats.reused += 1
            if old.violation is not None:
                old.violation.append(
                    f"  ...and the model reused that block for {name} (kernel {k} of {stream.name}) "
                    "while the other stream's kernel was still unordered"
                )
        self._track(storage, stream, name, (stream.id, k, name))

    def _read(self, block: _Block, stream: SimStream, k: int, name: str) -> None:
        w = block.last_write
        if w is not None and w[0] != stream.id and self._knows(stream, w[0]) < w[1]:
            self._unordered(
                f"{name} (kernel {k} of {stream.name}) read a block of {block.nbytes} bytes that "
                f"{w[2]} wrote on {self.streams[w[0]].name} (its kernel {w[1]}) without being ordered "
                "after that write (no wait_event/wait_stream)"
            )
        block.reads[stream.id] = (k, name)
        self._use(block, stream, k, name)

    def _write(self, block: _Block, stream: SimStream, k: int, name: str) -> None:
        w = block.last_write
        if w is not None and w[0] != stream.id and self._knows(stream, w[0]) < w[1]:
            self._unordered(
                f"{name} (kernel {k} of {stream.name}) wrote a block of {block.nbytes} bytes that "
                f"{w[2]} wrote on {self.streams[w[0]].name} (its kernel {w[1]}) without being ordered after it"
            )
        for sid, (rk, rname) in block.reads.items():
            if sid != stream.id and self._knows(stream, sid) < rk:
                self._unordered(
                    f"{name} (kernel {k} of {stream.name}) wrote a block of {block.nbytes} bytes that "
                    f"{rname} still reads on {self.streams[sid].name} (its kernel {rk}): no wait for that read"
                )
        block.last_write = (stream.id, k, name)
        block.reads = {}
        self._use(block, stream, k, name)

    def _use(self, block: _Block, stream: SimStream, k: int, name: str) -> None:
        if stream.id != block.stream.id:
            self.stats.cross_stream_uses += 1
        block.uses[stream.id] = (k, name)

    def _unordered(self, message: str) -> None:
        self.stats.unordered_accesses += 1
        self.violations.append(["unordered access: " + message])

    def _free(self, key: int, block: _Block) -> None:
        with self._lock:
            if self.blocks.get(key) is block:
                del self.blocks[key]
            if self._closed or block.host:
                return
            self.stats.frees += 1
            a = block.stream
            others = {sid: use for sid, use in block.uses.items() if sid != a.id}
            if not others:
                self.free_lists.setdefault(a.id, []).append(block)
                return
            self.stats.cross_stream_frees += 1
            unguarded = [
                (sid, k, name) for sid, (k, name) in others.items()
                if sid not in block.recorded and self._knows(a, sid) < k
            ]
            if unguarded:
                self.stats.unsynchronised_frees += 1
                sid, k, name = unguarded[0]
                b = self.streams[sid]
                frames = [f for f in traceback.extract_stack()[:-2]
                          if "/_pytest/" not in f.filename and "/pluggy/" not in f.filename]
                stack = "".join(traceback.format_list(frames[-12:]))
                block.violation = [
                    f"unsynchronised cross-stream free: a block of {block.nbytes} bytes allocated on "
                    f"{a.name} by {block.what} was used on {b.name} by {name} (its kernel {k}) and freed "
                    f"while {a.name} was ordered only up to kernel {self._knows(a, sid)} of {b.name}, with "
                    f"no record_stream({b.name}): the caching allocator may give it to the next allocation "
                    f"on {a.name} while that kernel is still queued. Freed at:\n{stack}"
                ]
                self.violations.append(block.violation)
                self.free_lists.setdefault(a.id, []).append(block)
                return
            if any(sid in block.recorded and self._knows(a, sid) < k for sid, (k, _) in others.items()):
                self.stats.guarded_by_record_stream += 1
                self.pending.append((block, {sid: self.streams[sid].count for sid in block.recorded}))
            else:
                self.stats.guarded_by_wait += 1
                self.free_lists.setdefault(a.id, []).append(block)

    def _release_pending(self, stream: SimStream) -> None:
        """record_stream'ed blocks of ``stream`` whose recorded streams it is now ordered after."""
        pending, self.pending = self.pending, []  # a free during the walk appends to the new list
        for block, at in pending:
            if block.stream is stream and all(self._knows(stream, sid) >= k for sid, k in at.items()):
                self.free_lists.setdefault(stream.id, []).append(block)
            else:
                self.pending.append((block, at))

    # ---- results ------------------------------------------------------------------
    def report(self) -> list[str]:
        """Every violation seen, one message each."""
        return ["\n".join(v) for v in self.violations]

    def check(self) -> None:
        """Fail (AssertionError) if an unsynchronised free or unordered access was seen
        since the last check; collects garbage first, so that values freed by the
        collector are checked too."""
        gc.collect()
        messages = self.report()[self._reported:]
        self._reported += len(messages)
        if messages:
            raise AssertionError(
                f"simulated CUDA: {len(messages)} stream-semantics violation(s) "
                f"({self.stats.unsynchronised_frees} unsynchronised cross-stream free(s), "
                f"{self.stats.unordered_accesses} unordered access(es)); the first:\n" + messages[0]
            )

    # ---- activation ---------------------------------------------------------------
    def __enter__(self) -> SimCuda:
        self._stack.enter_context(_streams.simulate(self))
        self._stack.enter_context(_Kernels(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.collect()  # frees of cyclic garbage made under the simulation are checked too
        self._stack.close()
        with self._lock:
            self._closed = True
            self.blocks.clear()
            self.free_lists.clear()
            self.pending.clear()
