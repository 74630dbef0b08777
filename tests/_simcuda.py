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
  returned it (a storage whose allocation it did not see -- made before the simulation
  started, or inside an op's own code, as gloo's collectives make temporaries -- counts
  as allocated on the stream that first uses it). Pinned host buffers (:meth:`SimCuda.host_buffer`) are ordered like any
  block but are not the device allocator's (torch's host allocator records its own
  events).
- Free: when a block's storage dies, its memory goes back to the pool of the stream it
  was allocated on, A. If a kernel on another stream B used it, either
  ``record_stream(B)`` was called (the allocator then reuses the block only once B has
  passed this point) or A must be ordered after that kernel before it allocates again.
  Otherwise the allocator may hand the block to the next allocation on A while B's
  kernel is still queued: an **unsynchronised cross-stream free**, which fails the test
  at that next allocation (a free with no allocation on A after it cannot be reused). Reuse itself
  is modelled: a freed block goes to A's free list and the next allocation on A takes
  it (``stats.reused``); a ``record_stream``-ed one first waits until A is ordered after
  the recorded streams' positions at the free.
- Order of access: a kernel that reads a block must be ordered after the block's last
  write, and one that writes it after its last write and every read since (a hand-over
  without ``wait_event``, a host buffer rewritten while a copy still reads it): an
  **unordered access**, which fails the test too.
- Frees without the storage dying: ``untyped_storage().resize_(0)`` (FSDP2's reshard)
  frees the block then and there, checked as above; ``resize_`` from 0 allocates anew on
  the current stream.
- Host and device memory are apart: pinned host buffers (and what ops on them alone
  make) are host memory; the rest is device memory (``on_device``). An op that touches
  host memory only runs on the host, now, ordered after the streams only by what the
  host synchronised with (``Event.synchronize``, ``synchronize``, a blocking copy, a
  ``.item()``): a host read of a buffer a copy still writes, or a host write of one a
  copy still reads, is an unordered access. ``record_stream`` of host memory is an error
  (CUDA raises).
- Threads: a thread started while the simulation runs runs under it too (its own host
  lane and current stream, as autograd's device thread does); ``join`` orders the
  joiner after it.
- Time (``SimCuda(timeline=_simtime.device("h100"))``): the run is recorded as a trace
  that ``_simtime.simulate`` turns into a timeline (Note [The simulated timeline] in
  tests/_simtime.py).
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

import _simtime
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ac2_dist import _streams
from ac2_dist._region import _thread_state

_HOST = -1  # the host, as a "stream" in the clocks and the block records


class SimEvent:
    """A recorded point of a stream: its vector clock then (and its id in the trace)."""

    __slots__ = ("sim", "clock", "eid")

    def __init__(self, sim: SimCuda, clock: dict[int, int], eid: int = 0) -> None:
        self.sim = sim
        self.clock = clock
        self.eid = eid

    def synchronize(self) -> None:
        self.sim._host_waits(self.clock)
        self.sim._trace("sync", self.eid)

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
        return SimEvent(self.sim, clock, self.sim._trace_event(self))

    def wait_event(self, event: SimEvent) -> None:
        for sid, k in event.clock.items():
            if sid != self.id and k > self.clock.get(sid, 0):
                self.clock[sid] = k
        if event.eid:
            self.sim._trace("issue", self.id, "wait", event.eid)

    def wait_stream(self, other: SimStream) -> None:
        self.wait_event(other.record_event())

    def synchronize(self) -> None:
        self.record_event().synchronize()

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
    __slots__ = ("stream", "nbytes", "what", "host", "recorded", "uses", "last_write", "reads", "violation", "tid",
                 "freed", "pending")

    def __init__(self, stream: SimStream, nbytes: int, what: str, write: tuple | None) -> None:
        self.stream = stream  # allocated on
        self.nbytes = nbytes
        self.what = what  # the op that allocated it
        self.host = False  # host memory (a pinned buffer), not the device allocator's
        self.tid = 0  # its allocation in the trace (0: none: made before the simulation, or host memory)
        self.freed = False  # resize_(0)-ed: its storage lives on with no memory
        self.recorded: set[int] = set()  # record_stream'ed on these streams
        self.uses: dict[int, tuple[int, str]] = {}  # stream id -> (last kernel, op) that used it
        self.last_write = write  # (stream id, kernel, op)
        self.reads: dict[int, tuple[int, str]] = {}  # since the last write
        self.violation: list[str] | None = None  # the message of an unsynchronised free of it
        self.pending: tuple | None = None  # freed with uses A was not yet ordered after: (uses, where freed)


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
            name = _op_name(func)
            touched = [(t, access, _storage(t)) for t, access in _accesses(func, args, kwargs)]
            touched = [(t, access, s) for t, access, s in touched if s is not None]
            kinds = {sim._block(s, t).host for t, access, s in touched if access != "view"}
            on_host = kinds == {True}  # an op on host memory alone runs on the host, now
            sid = _HOST if on_host else stream.id
            if on_host:
                sim.host_ops += 1
                k = sim.host_ops
            else:
                stream.count += 1
                stream.clock[_HOST] = sim.host_ops  # host work issued before this kernel is done before it
                sim.stats.kernels += 1
                k = stream.count
            seen: dict[int, Any] = {}
            for t, access, storage in touched:
                seen[storage._cdata] = storage
                if access == "view":
                    continue
                block = sim._block(storage, t)
                if access == "write":
                    sim._write(block, sid, k, name)
                else:
                    sim._read(block, sid, k, name)
        out = func(*args, **kwargs)
        with sim._lock:
            made = []
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor):
                    continue
                storage = _storage(t)
                if storage is None or storage._cdata in seen or storage._cdata in sim.blocks:
                    continue
                made.append(sim._allocate(storage, stream, k, name, host=on_host))
            if sim.trace is not None:
                sim._trace_op(func, args, kwargs, out, stream, on_host, kinds, touched, made)
            if name == "aten._local_scalar_dense.default" and not on_host or _blocking_copy(func, args, kwargs, kinds):
                stream.synchronize()  # .item() / a copy to or from host memory without non_blocking
        return out


def _blocking_copy(func: Any, args: tuple, kwargs: dict, kinds: set) -> bool:
    """A copy between host and device memory the host waits for (``non_blocking=False``)."""
    if kinds != {True, False} or str(func) not in ("aten.copy_.default", "aten._to_copy.default"):
        return False
    nb = kwargs.get("non_blocking", args[2] if str(func) == "aten.copy_.default" and len(args) > 2 else False)
    return not nb


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
    thread that runs the model: ``with SimCuda() as sim: ...; sim.check()``. With
    ``timeline=_simtime.device("h100")`` the run is recorded for :meth:`timeline`."""

    def __init__(self, timeline: _simtime.Device | None = None) -> None:
        super().__init__()
        self.dev = timeline
        self.trace = _simtime.Trace() if timeline is not None else None
        if self.trace is not None:
            self.trace.streams[0] = "default"
        self.host_ops = 0  # ops run on the host so far (the host's "kernels")
        self._next_lane = 0
        self._threads: dict[int, int] = {}  # id(threading.Thread) -> its lane
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
        # Device bytes of the blocks alive (as device_bytes() counts them) and their peak
        # since reset_peak(): kept as blocks come and go.
        self.device_now = 0
        self.device_peak = 0
        self._closed = False
        self._stack = contextlib.ExitStack()

    # ---- the stream backend ac2 uses ----------------------------------------------
    def on_device(self, t: torch.Tensor) -> bool:
        storage = _storage(t)
        if storage is None or t.device.type != "cpu":
            return False
        with self._lock:
            return not self._block(storage, t).host

    def device_index(self) -> int:
        return 0

    def new_stream(self, name: str | None = None) -> SimStream:
        with self._lock:
            stream = SimStream(self, len(self.streams), name or f"stream{len(self.streams)}")
            self.streams.append(stream)
            self.stats.streams_created += 1
            if self.trace is not None:
                self.trace.streams[stream.id] = stream.name
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
            block = self._block(storage, t)
            if block.host:
                self.violations.append([
                    f"record_stream of host memory ({block.nbytes} bytes made by {block.what}) on {stream.name}: "
                    "CUDA raises (only device memory belongs to the caching allocator)"])
                return
            block.recorded.add(stream.id)

    def reset_peak(self) -> None:
        """Start ``device_peak`` over from the device bytes alive now."""
        with self._lock:
            self.device_peak = self.device_now

    def _grew(self, block: _Block) -> None:
        self.device_now += block.nbytes
        if self.device_now > self.device_peak:
            self.device_peak = self.device_now

    def device_bytes(self) -> int:
        """Bytes of the device blocks alive now: every live storage the simulation has seen
        (one made before it counts from its first use), host buffers and ``resize_(0)``-ed
        storages left out. A measure of the program's tensors, not of ac2's reports."""
        with self._lock:
            return sum(b.nbytes for b in self.blocks.values() if not b.host and not b.freed)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        self._tls.host_alloc = True  # what the empty below makes is host memory
        try:
            return torch.empty(nbytes, dtype=torch.uint8)
        finally:
            self._tls.host_alloc = False

    # ---- the trace (Note [The simulated timeline] in tests/_simtime.py) --------------
    def _lane(self) -> int:
        lane = getattr(self._tls, "lane", None)
        if lane is None:
            lane = self._tls.lane = self._next_lane
            self._next_lane += 1
        return lane

    def _trace(self, *action: Any) -> None:
        if self.trace is not None:
            self.trace.add(self._lane(), action)

    def _trace_event(self, stream: SimStream) -> int:
        if self.trace is None:
            return 0
        self.trace.events += 1
        self._trace("issue", stream.id, "record", self.trace.events)
        return self.trace.events

    def mark(self, name: str) -> None:
        """A mark at this thread's host time (``"phase:<unit>"`` labels the waits issued
        after it with that unit)."""
        self._trace("mark", name)

    def _trace_op(self, func: Any, args: tuple, kwargs: dict, out: Any, stream: SimStream, on_host: bool,
                  kinds: set, touched: list, made: list) -> None:
        dev = self.dev
        assert dev is not None
        self._trace("host", dev.host_op_s)
        name = _op_name(func)
        if name.startswith(("aten.empty", "aten.new_empty")) or not made and all(a == "view" for _, a, _ in touched):
            return  # an allocation, or a view: no kernel
        if on_host:
            self._trace("host", _simtime._nbytes((args, kwargs, out)) / dev.host_bytes)
            return
        copy = None
        if kinds == {True, False}:  # host and device memory: a copy engine's transfer
            dst = touched[0] if name == "aten.copy_.default" else None
            copy = "d2h" if dst is not None and self._block(dst[2], dst[0]).host else "h2d"
        kind, seconds = _simtime.duration(func, args, kwargs, out, dev, copy)
        replaying = _thread_state().replaying
        unit = (replaying.graph.fqn or "(region)") if replaying.depth and replaying.graph is not None else None
        assert self.trace is not None
        self.trace.kernels.append(_simtime.Kernel(name, kind, seconds, unit, _simtime.is_matmul(func)))
        self._trace("issue", stream.id, "kernel", len(self.trace.kernels) - 1)

    def timeline(self, contention: bool = True, free_replays: bool = False,
                 expandable_segments: bool = False) -> _simtime.Result:
        """The recorded run on the timeline's device."""
        assert self.trace is not None and self.dev is not None, "SimCuda(timeline=...) records a trace"
        return _simtime.simulate(self.trace, self.dev, contention, free_replays, expandable_segments)

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

    def _knows(self, sid: int, other: int) -> int:
        """The last kernel of stream ``other`` (``_HOST``: host op) that work queued on
        stream ``sid`` now (``_HOST``: the host, now) is ordered after."""
        if other == sid:
            return self.host_ops if sid == _HOST else self.streams[sid].count
        if sid == _HOST:
            return self.host.get(other, 0)
        return max(self.streams[sid].clock.get(other, 0), self.host.get(other, 0))

    def _name(self, sid: int) -> str:
        return "the host" if sid == _HOST else self.streams[sid].name

    # ---- memory -------------------------------------------------------------------
    def _block(self, storage: Any, t: torch.Tensor) -> _Block:
        block = self.blocks.get(storage._cdata)
        if block is None:  # made before the simulation, or by code whose ops it does not see
            # (a collective's own temporaries, made inside the op): taken as allocated on the
            # stream that first uses it
            stream = self.current_stream()
            block = self._track(storage, stream, "a tensor made outside the simulation's view", None)
            self._grew(block)
        return block

    def _track(self, storage: Any, stream: SimStream, what: str, write: tuple | None,
               nbytes: int | None = None) -> _Block:
        key = storage._cdata
        block = _Block(stream, storage.nbytes() if nbytes is None else nbytes, what, write)
        self.blocks[key] = block
        weakref.finalize(storage, self._free, key, block)
        return block

    def _allocate(self, storage: Any, stream: SimStream, k: int, name: str, host: bool = False,
                  nbytes: int | None = None) -> _Block:
        if host or getattr(self._tls, "host_alloc", False):
            block = self._track(storage, stream, name, (_HOST, k, name) if host else None, nbytes)
            block.host = True
            return block
        self._reuse(stream, k, name)
        block = self._track(storage, stream, name, (stream.id, k, name), nbytes)
        self._grew(block)
        if self.trace is not None:
            self.trace.blocks += 1
            block.tid = self.trace.blocks
            self._trace("malloc", block.tid, block.nbytes, stream.id)
        return block

    def _reuse(self, stream: SimStream, k: int, name: str) -> None:
        self._release_pending(stream)
        free = self.free_lists.get(stream.id)
        for block in free or ():  # any of them could serve this allocation
            if block.pending is not None:
                self._check_reuse(block, stream, k, name)
        if free:  # the caching allocator hands out a block this stream freed
            old = free.pop()
            self.stats.reused += 1
            if old.violation is not None:
                old.violation.append(
                    f"  ...and the model reused that block for {name} (kernel {k} of {stream.name}) "
                    "while the other stream's kernel was still unordered"
                )

    def _read(self, block: _Block, sid: int, k: int, name: str) -> None:
        w = block.last_write
        if w is not None and w[0] != sid and self._knows(sid, w[0]) < w[1]:
            how = "no synchronize" if sid == _HOST else "no wait_event/wait_stream"
            self._unordered(
                f"{name} (kernel {k} of {self._name(sid)}) read a block of {block.nbytes} bytes that "
                f"{w[2]} wrote on {self._name(w[0])} (its kernel {w[1]}) without being ordered "
                f"after that write ({how})"
            )
        block.reads[sid] = (k, name)
        self._use(block, sid, k, name)

    def _write(self, block: _Block, sid: int, k: int, name: str) -> None:
        w = block.last_write
        if w is not None and w[0] != sid and self._knows(sid, w[0]) < w[1]:
            self._unordered(
                f"{name} (kernel {k} of {self._name(sid)}) wrote a block of {block.nbytes} bytes that "
                f"{w[2]} wrote on {self._name(w[0])} (its kernel {w[1]}) without being ordered after it"
            )
        for rsid, (rk, rname) in block.reads.items():
            if rsid != sid and self._knows(sid, rsid) < rk:
                self._unordered(
                    f"{name} (kernel {k} of {self._name(sid)}) wrote a block of {block.nbytes} bytes that "
                    f"{rname} still reads on {self._name(rsid)} (its kernel {rk}): no wait for that read"
                )
        block.last_write = (sid, k, name)
        block.reads = {}
        self._use(block, sid, k, name)

    def _use(self, block: _Block, sid: int, k: int, name: str) -> None:
        if sid != block.stream.id and sid != _HOST and not block.host:
            self.stats.cross_stream_uses += 1
        block.uses[sid] = (k, name)

    def _unordered(self, message: str) -> None:
        self.stats.unordered_accesses += 1
        self.violations.append(["unordered access: " + message])

    def _free(self, key: int, block: _Block) -> None:
        with self._lock:
            if self.blocks.get(key) is block:
                del self.blocks[key]
            if self._closed or block.host or block.freed:
                return
            self._release(block)

    def _release(self, block: _Block) -> None:
        """The block's memory goes back to the allocator: its storage died, or was
        ``resize_(0)``-ed."""
        if self.trace is not None and block.tid:
            holds = tuple(self._trace_event(self.streams[s]) for s in sorted(block.recorded) if s != block.stream.id)
            self._trace("free", block.tid, holds)
        self.stats.frees += 1
        self.device_now -= block.nbytes
        a = block.stream
        others = {sid: use for sid, use in block.uses.items() if sid != a.id and sid != _HOST}
        if not others:
            self.free_lists.setdefault(a.id, []).append(block)
            return
        self.stats.cross_stream_frees += 1
        unguarded = [
            (sid, k, name) for sid, (k, name) in others.items()
            if sid not in block.recorded and self._knows(a.id, sid) < k
        ]
        if unguarded:  # checked at the next allocation on a (Note: the module docstring's "Free")
            frames = [f for f in traceback.extract_stack()[:-3]
                      if "/_pytest/" not in f.filename and "/pluggy/" not in f.filename]
            block.pending = (unguarded, "".join(traceback.format_list(frames[-12:])))
            self.free_lists.setdefault(a.id, []).append(block)
            return
        if any(sid in block.recorded and self._knows(a.id, sid) < k for sid, (k, _) in others.items()):
            self.stats.guarded_by_record_stream += 1
            self.pending.append((block, {sid: self.streams[sid].count for sid in block.recorded}))
        else:
            self.stats.guarded_by_wait += 1
            self.free_lists.setdefault(a.id, []).append(block)

    def _check_reuse(self, block: _Block, stream: SimStream, k: int, name: str) -> None:
        """An allocation on ``stream`` (which allocated ``block``) while ``block`` is in
        its pool: a violation unless ``stream`` is by now ordered after every use of it."""
        assert block.pending is not None
        unguarded, freed_at = block.pending
        late = [(sid, uk, uname) for sid, uk, uname in unguarded if self._knows(stream.id, sid) < uk]
        block.pending = None
        if not late:
            self.stats.guarded_by_wait += 1  # ordered by the time the stream allocated again
            return
        sid, uk, uname = late[0]
        b = self.streams[sid]
        self.stats.unsynchronised_frees += 1
        block.violation = [
            f"unsynchronised cross-stream free: a block of {block.nbytes} bytes allocated on "
            f"{stream.name} by {block.what} was used on {b.name} by {uname} (its kernel {uk}) and freed "
            f"with no record_stream({b.name}); {stream.name} allocated again ({name}, its kernel {k}) while "
            f"ordered only up to kernel {self._knows(stream.id, sid)} of {b.name}: the caching allocator "
            f"may give it the block while that kernel is still queued. Freed at:\n{freed_at}"
        ]
        self.violations.append(block.violation)

    def _release_pending(self, stream: SimStream) -> None:
        """record_stream'ed blocks of ``stream`` whose recorded streams it is now ordered after."""
        pending, self.pending = self.pending, []  # a free during the walk appends to the new list
        for block, at in pending:
            if block.stream is stream and all(self._knows(stream.id, sid) >= k for sid, k in at.items()):
                self.free_lists.setdefault(stream.id, []).append(block)
            else:
                self.pending.append((block, at))

    def _resize(self, storage: Any, size: int) -> None:
        """``storage.resize_(size)``, before it happens: to 0, a free of its block (the
        storage lives on: FSDP2's reshard); from 0, a new allocation on the current stream."""
        with self._lock:
            if self._closed:
                return
            old = storage.nbytes()
            block = self.blocks.get(storage._cdata)
            if size == 0 and old > 0 and block is not None and not block.host and not block.freed:
                self._release(block)
                block.freed = True
            elif old == 0 and size > 0 and (block is None or not block.host):
                stream = self.current_stream()
                self._allocate(storage, stream, stream.count, "untyped_storage().resize_", nbytes=size)

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
        self._stack.enter_context(self._patched())
        return self

    @contextlib.contextmanager
    def _patched(self) -> Iterator[None]:
        """``UntypedStorage.resize_`` and threads seen by the simulation while it runs."""
        sim = self
        resize, start, join = torch.UntypedStorage.resize_, threading.Thread.start, threading.Thread.join

        def resize_(storage: Any, size: int) -> Any:
            sim._resize(storage, int(size))
            return resize(storage, size)

        def start_(thread: threading.Thread) -> None:
            with sim._lock:
                lane = sim._threads[id(thread)] = sim._next_lane
                sim._next_lane += 1
            sim._trace("spawn", lane)
            run = thread.run

            def run_under_the_simulation() -> None:
                sim._tls.lane = lane
                with _streams.simulate(sim), _Kernels(sim):
                    run()

            thread.run = run_under_the_simulation  # type: ignore[method-assign]
            start(thread)

        def join_(thread: threading.Thread, timeout: float | None = None) -> None:
            join(thread, timeout)
            lane = sim._threads.get(id(thread))
            if lane is not None and not thread.is_alive():
                sim._trace("join", lane)

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        threading.Thread.start = start_  # type: ignore[method-assign]
        threading.Thread.join = join_  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]
            threading.Thread.start = start  # type: ignore[method-assign]
            threading.Thread.join = join  # type: ignore[method-assign]

    def __exit__(self, *exc: Any) -> None:
        gc.collect()  # frees of cyclic garbage made under the simulation are checked too
        self._stack.close()
        with self._lock:
            self._closed = True
            self.blocks.clear()
            self.free_lists.clear()
            self.pending.clear()
