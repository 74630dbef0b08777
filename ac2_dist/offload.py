"""Asynchronous selective CPU offload of saved activations.

A value a policy offloads (``CheckpointPolicy.MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD``,
or ``tag_with_policy`` with one of them) is copied to host memory and brought back
when backward needs it. :class:`Offload` is the schedule those copies follow, shared
by the checkpointed blocks (outermost regions) that use it: device->host copies into
pinned buffers from a pool on a side stream during forward, the wait for a block's
copies deferred by ``defer`` blocks, and host->device copies issued ahead of the
backward that needs them by the replay prefetch (``ReplayConfig(prefetch=k)``).
``Offload(block_inputs=True)`` also moves each block's inputs -- the hidden states every
policy keeps, the long-context boundary -- on the same schedule.

It is the schedule of the systems ac2 is compared with: TransformerEngine / Megatron's
CPU offload (copies on a side stream, the wait for layer i deferred to a later layer,
the last layer kept), torchtitan's compiled offload, torchtune's ``OffloadActivations``
(which relies on the CPU running ahead of the GPU); its reference point in torch is
``torch.autograd.graph.save_on_cpu(pin_memory=True)``, which copies synchronously
and allocates pinned memory per tensor.

One copy engine runs the schedule (as one executor runs replays, replay.py):
:class:`CudaCopies` on CUDA streams, or :class:`InlineCopies`, which copies on the
calling thread into ordinary host buffers. ``Offload(stream="inline")`` also takes CPU
tensors: the CPU test suite runs the very schedule a GPU runs, copies included, and
checks its order, lifetimes and values.
"""

# Note [The offload schedule]
#     A block is one outermost region using this :class:`Offload` (one call of a
#     checkpointed module). Blocks are numbered in the order they open, per Offload.
#     For block i:
#
#     1. forward of i: each offloaded value is recorded (:class:`OffloadedTensor`)
#        holding its device tensor; nothing is copied yet;
#     2. block i+1 opens: block i's device->host copies are issued on the copy stream
#        (it first waits for the compute stream, which produced the values), each into
#        a pinned buffer from the pool; an event marks their end;
#     3. block i+``defer`` closes: the compute stream waits for that event and block i's
#        device tensors are dropped (freed, ordered after their copies): at most
#        ``defer`` + 1 blocks' offloaded values are on the device during forward;
#     4. backward: when block j's backward starts, the replay prefetch of blocks
#        j-1 .. j-k (Note [Prefetching the next unit's replay], replay.py) reads their
#        saved values, which issues their host->device copies ahead of their backward
#        (on the replay side stream on CUDA); without prefetch a copy is issued when the
#        value is unpacked;
#     5. an offloaded value dies at its last use (Note [Saved values die at their last
#        use], _graph.py) or with its graph; its pinned buffer then returns to the pool,
#        tagged with the event of its last host->device copy.
#
#     The last block opened before backward is never copied: no block opens after it,
#     so backward reads its device tensors in place. A block whose copies were issued
#     but not waited for when backward first reads it (the last ``defer`` - 1 before
#     it) is *kept* too: its device tensors serve backward and its buffers return to
#     the pool at once. So the last block is never offloaded, without knowing the
#     number of blocks. A kept block's device tensors were allocated on the compute
#     stream and die with their records (the value's last use, its graph) with no wait
#     for the streams that read them: the copy stream's reads are ``record_stream``-ed
#     when the block is kept (or when a record dies before its copies were waited for),
#     a side-stream replay's when it reads the value (Note [Tensors that cross
#     streams] in replay.py).
#
#     A ``with apply_ac_policy(...)`` block does not know its device when it opens
#     (Note [The device comes from the tensors] in _device.py): its block starts with no
#     streams, and the first CUDA value it offloads gives it CUDA's (``_device_streams``),
#     so it takes the asynchronous path as a module's block does.
#
# Note [Offloaded values that are written]
#     A value is copied to the host one block after it was saved. If, before that, the
#     region writes it in place while a replay still needs the value from before the
#     write, the tracer snapshots it (Note [Versions of written tensors], _tracer.py):
#     for an offloaded value that means copying it now and making the compute stream
#     wait for that copy before the write; its device tensor is dropped and backward
#     reads the host copy. A value written after it was saved in any other way (outside
#     the region, or read by autograd directly) is detected by its version counter as
#     long as its device tensor is held: reading it is then an error, unless the region
#     has ``allow_cache_entry_mutation=True``. Once a block's copies were waited for,
#     the host copy is the value as saved and later writes to the device tensor do not
#     reach it.
#
# Note [One copy back per backward]
#     A value is read in backward by each of its unpacks and by each replay that starts
#     from it (a block input: the norm's two saves and its replay read it five times in
#     a Llama block under "recompute_all"). Each read copying it back would move the
#     bytes over the link that many times and hold as many device copies. So the first
#     read's host->device copy is kept on the record (``OffloadedTensor.fetched``) and
#     serves the later reads until the graph's use counts say this backward's last
#     reader has it (``_GraphBackward._last_use``); then the record lets it go (a
#     retained graph's next backward copies it back again). 4 Llama blocks, block
#     inputs offloaded, no prefetch: 15 copies back before, 3 after.
#
# Note [Offloaded block inputs]
#     Every policy keeps a block's inputs: the hidden states passed from block to block
#     are what backward's replay starts from. At long context they are most of what
#     checkpointing leaves on the device (a Llama-3-8B-sized model at 131072 tokens: 32
#     blocks x 131072 x 4096 x 2 bytes = 32 GiB). ``Offload(block_inputs=True)`` moves
#     them off the device as torch's ``save_on_cpu`` around torch's checkpoint does, but
#     on this schedule: when a block's region opens, each of the call's positional
#     tensor arguments that requires grad (not a parameter; a mask or position ids does
#     not) becomes an offloaded value of that block, recorded before any op reads it. It
#     is copied when the next block opens, its device tensor dropped when the wait for
#     the copies comes (a block's input then lives on the device only while that block
#     and the next ``defer`` run forward), and it is brought back by the prefetch
#     before the block's backward, or when its first reader unpacks it. The last block's
#     input is read on the device, as every kept block's values are. Its copy has no
#     autograd history: a ``create_graph=True`` backward through such a block is refused
#     (an error names the input) -- under torch the unpack re-attaches the history,
#     which Python cannot do for ac2's copy.

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._offload_copies import CudaCopies, InlineCopies, _Pool
from ._streams import StreamBackend, region_streams
from ._trace._nodes import modified_error

__all__ = ["Offload", "OffloadStats", "OffloadedTensor", "InlineCopies", "CudaCopies"]

Log = Callable[[str, str], None]

# Unit states (Note [The offload schedule]).
_OPEN, _CLOSED, _COPIED, _COMMITTED, _KEPT = "open", "closed", "copied", "committed", "kept"


@dataclass
class OffloadStats:
    """Counters of one :class:`Offload` (cumulative; read them between steps).

    ``buffers_allocated`` / ``bytes_allocated``: host buffers the pool created
    (pinned on CUDA); ``buffers_reused``: buffers it handed out again;
    ``buffers_dropped`` / ``bytes_dropped``: free buffers it let go to stay within the
    most host bytes a step ever had in use at once; ``d2h_*`` /
    ``h2d_*``: copies issued and their bytes; ``units_committed``: blocks whose
    copies were waited for and device tensors freed; ``units_kept``: blocks backward
    read on the device (the last ones, never offloaded). Blocks that offloaded
    nothing are not counted.
    """

    buffers_allocated: int = 0
    bytes_allocated: int = 0
    buffers_reused: int = 0
    buffers_dropped: int = 0
    bytes_dropped: int = 0
    d2h_copies: int = 0
    d2h_bytes: int = 0
    h2d_copies: int = 0
    h2d_bytes: int = 0
    units_committed: int = 0
    units_kept: int = 0


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill ``numel`` slots of storage, so the
    host copy can keep ``t``'s strides (as ``Tensor.to`` does)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class OffloadedTensor:
    """One offloaded value: its device tensor until its block is committed, then its
    host copy. What ``Saved`` holds instead of a tensor."""

    # See Note [The offload schedule].

    __slots__ = (
        "unit", "device", "counter", "version", "allow_mutation", "owner", "host", "buf", "reuse_after",
        "last_read", "shape", "stride", "dtype", "device_of", "nbytes", "copied", "stale", "fetched", "__weakref__",
    )

    def __init__(self, unit: OffloadUnit, t: torch.Tensor, *, version: int | None, counter: torch.Tensor | None,
                 allow_mutation: bool, owner: str) -> None:
        self.unit = unit
        self.device: torch.Tensor | None = t  # an alias of the saved tensor (Saved made it)
        self.counter = counter  # the tensor whose version counter guards it (a view's source)
        self.version = version
        self.allow_mutation = allow_mutation
        self.owner = owner
        self.shape, self.dtype, self.device_of = t.shape, t.dtype, t.device
        self.stride = t.stride() if _dense(t) else torch.empty(t.shape, device="meta").stride()
        self.nbytes = t.numel() * t.element_size()
        self.host: torch.Tensor | None = None
        self.buf: torch.Tensor | None = None
        self.reuse_after: Any = None  # event the copy stream waits for before writing buf
        self.last_read: Any = None  # event after the last host->device copy
        self.copied = False
        self.stale: str | None = None  # why the value is gone (Note [Offloaded values that are written])
        self.fetched: torch.Tensor | None = None  # this backward's copy back (Note [One copy back per backward])

    # ---- forward --------------------------------------------------------------
    def _take_buffer(self, pool: _Pool, engine: InlineCopies) -> None:
        buf, self.reuse_after = pool.get(self.nbytes, engine)
        flat = buf.view(self.dtype)
        self.buf = buf
        self.host = flat.as_strided(self.shape, self.stride)

    def _check_version(self) -> None:
        """Mark the value stale if its device tensor was written since it was saved."""
        if self.version is None or self.device is None:
            return
        now = (self.counter if self.counter is not None else self.device)._version
        if now != self.version:  # Note [A held value modified out of sight] (_nodes.py)
            self.stale = modified_error(f"{self.owner}, offloaded to the CPU", self.version, now)

    def before_write(self) -> None:
        """The device tensor is about to be written in place while replays still need its
        value: copy it now, make the compute stream wait for the copy, and read the host
        copy from now on."""
        # See Note [Offloaded values that are written].
        if self.device is None:
            return
        unit = self.unit
        owner = unit.owner
        with owner._lock:
            if self.host is None:  # not copied yet (its block is still open)
                self._take_buffer(owner._pool, unit.engine)
                owner._count_d2h(self)
                event = unit.engine.issue([self])
                self.copied = True
                owner._emit("d2h", unit.fqn)
            else:
                event = unit.copied_event
            unit.engine.writer_waits(event)
            self.device = self.counter = None
            self.version = None

    # ---- backward -------------------------------------------------------------
    def fetch(self) -> torch.Tensor:
        """The value, on its device: the device tensor while its block is not committed
        (a kept block), else a host->device copy on the current stream."""
        unit = self.unit
        owner = unit.owner
        with owner._lock:
            if self.stale is None and self.device is not None:
                if unit.state in (_CLOSED, _COPIED):
                    unit.keep()
                self._check_version()
                if self.stale is None:
                    return self.device
            if self.stale is not None:
                raise RuntimeError(self.stale)
            if self.fetched is not None:  # Note [One copy back per backward]
                return self.fetched
            if self.host is None:
                raise RuntimeError(
                    f"ac2_dist internal error: the offloaded {self.owner} has neither a device tensor "
                    "nor a host copy"
                )
            out, self.last_read = unit.engine.to_device(self)
            self.fetched = out
            owner.stats.h2d_copies += 1
            owner.stats.h2d_bytes += self.nbytes
            owner._emit("h2d", unit.fqn)
            return out

    def held(self) -> torch.Tensor | None:
        """What this value occupies now (its device tensor, else its host copy)."""
        return self.device if self.device is not None else self.host

    def release_host(self, event: Any) -> None:
        """Give the host buffer back to the pool."""
        # See Note [Pinned buffer pool] in _offload_copies.py.
        buf = self.buf
        if buf is None:
            return
        self.buf = self.host = None
        owner = self.unit.owner
        with owner._lock:
            owner._pool.put(buf, event)
            owner._emit("release_host", self.unit.fqn)

    def __del__(self) -> None:
        try:
            if self.device is not None and self.copied and self.unit.state == _COPIED:
                # Died before its copy was waited for. (A side-stream replay that read a
                # kept block's tensor guarded it then: Note [Tensors that cross streams].)
                self.unit.engine.guard(self.device)
            self.release_host(self.last_read if self.last_read is not None else self.unit.copied_event)
        except Exception:  # interpreter shutdown: nothing left to release into
            pass


class OffloadUnit:
    """The offloaded values of one block (one outermost region) and where they are in
    the schedule."""

    # See Note [The offload schedule].

    __slots__ = ("owner", "fqn", "streams", "engine", "on_device", "records", "state", "copied_event",
                 "__weakref__")

    def __init__(self, owner: Offload, fqn: str, streams: StreamBackend | None = None) -> None:
        self.owner = owner
        self.fqn = fqn
        self.streams = streams  # the region's stream backend; None on CPU (Note [Stream backends])
        self.engine: InlineCopies | None = None  # chosen by the first offloaded value (takes)
        self.on_device = False  # the engine copies device tensors (else CPU ones, inline)
        self.records: list[weakref.ref[OffloadedTensor]] = []
        self.state = _OPEN
        self.copied_event: Any = None

    def takes(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes through the schedule (else ``Saved`` keeps today's path):
        a plain, non-empty device (CUDA) tensor, or with ``stream="inline"`` a CPU tensor
        too; one kind per block (the first offloaded value's picks the copy engine)."""
        if type(t) is not torch.Tensor or t.numel() == 0:
            return False
        streams = self.streams
        if streams is None and self.engine is None:  # a block opened before its device was known
            streams = self.streams = _device_streams(t)
        on_device = streams is not None and streams.on_device(t)
        if not (on_device or (t.device.type == "cpu" and self.owner.stream == "inline")):
            return False
        if self.engine is None:
            self.engine = self.owner._engine(streams if on_device else None)
            self.on_device = on_device
        return on_device == self.on_device

    def save(self, t: torch.Tensor, *, version: int | None, counter: torch.Tensor | None,
             allow_mutation: bool, owner: str) -> OffloadedTensor:
        """Record an offloaded value of this block (``t``: an alias of the saved tensor)."""
        r = OffloadedTensor(self, t, version=version, counter=counter, allow_mutation=allow_mutation, owner=owner)
        self.records.append(weakref.ref(r))
        return r

    def live(self) -> list[OffloadedTensor]:
        return [r for r in (ref() for ref in self.records) if r is not None]

    def issue(self) -> None:
        """Step 2: device->host copies of the values still held (caller holds the lock)."""
        owner = self.owner
        todo = [r for r in self.live() if r.device is not None and not r.copied]
        for r in todo:
            r._take_buffer(owner._pool, self.engine)
            owner._count_d2h(r)
            r.copied = True
        self.copied_event = self.engine.issue(todo) if todo else None
        self.state = _COPIED
        if todo:
            owner._emit("d2h", self.fqn)

    def commit(self) -> None:
        """Step 3: wait for the copies, then free the device tensors (caller holds the lock)."""
        self.state = _COMMITTED
        if self.engine is None:  # the block offloaded nothing
            return
        self.owner.stats.units_committed += 1
        records = self.live()
        for r in records:
            r._check_version()
        self.engine.writer_waits(self.copied_event)
        self.owner._emit("wait", self.fqn)
        for r in records:
            r.device = r.counter = None
        self.owner._emit("free_device", self.fqn)

    def keep(self) -> None:
        """Backward reads this block before its copies were waited for: its device
        tensors serve backward, its buffers go back to the pool (caller holds the lock)."""
        copied = self.state == _COPIED
        self.state = _KEPT
        self.owner.stats.units_kept += 1
        self.owner._emit("keep", self.fqn)
        for r in self.live():
            if r.device is not None:
                if copied and r.copied:
                    self.engine.guard(r.device)
                r.release_host(self.copied_event)

    def close(self) -> None:
        """The block's region exited (forward done)."""
        # See Note [The offload schedule].
        self.owner._close(self)


class Offload:
    """The asynchronous CPU-offload schedule shared by checkpointed blocks.

    Pass it in a :class:`ac2_dist.ReplayConfig`: ``ac.apply_ac(model, policy,
    modules=[Block], replay=ac.ReplayConfig(offload=ac.Offload(defer=1)))``.
    ``apply_ac`` gives the modules it wraps one ``Offload()`` of their own when its
    config names none, so offloading policies follow this schedule on CUDA by default;
    ``wrap`` / ``apply_ac_policy`` regions follow it when given one (share one
    ``Offload`` between the blocks of a model), else they copy synchronously.

    Args:
        defer: the wait for block i's device->host copies happens when block
            i+``defer`` closes (1, 2, ...): how many blocks' forward the copies may
            overlap; at most ``defer`` + 1 blocks' offloaded values stay on the device.
        stream: ``"auto"`` (CUDA tensors: copies on a side stream of this Offload, made
            when it first copies and kept for its lifetime; CPU tensors are saved by
            reference, nothing to offload them to),
            ``"inline"`` (copies on the current stream; CPU tensors too, into ordinary
            host buffers: the schedule's CPU test mode) or a ``torch.cuda.Stream``.
        block_inputs: also offload each block's inputs -- the positional tensor arguments
            of a checkpointed module's call (or of ``checkpoint(fn, *args)``) that require
            grad, the hidden states passed from block to block, which every policy keeps.
            At long context they are what checkpointing leaves on the device; with this
            they cost host memory and a copy each way, on the schedule above: a block's
            input is on the device while it and the next ``defer`` blocks run forward,
            and comes back before its backward (by the replay prefetch, or when backward
            first reads it). Parameters and inputs that do not require grad (masks,
            position ids) stay. A ``create_graph=True`` backward through a block whose
            input was offloaded raises (the copy has no autograd history).
        log: called as ``log(event, block_fqn)`` for ``open`` / ``close`` (a block's
            region entered / exited), ``d2h`` (a block's copies issued),
            ``wait`` (the compute stream waits for them), ``free_device`` (its device
            tensors dropped), ``keep`` (backward reads it on the device), ``h2d`` (one
            value copied back) and ``release_host`` (a buffer back in the pool): for
            tests and debugging; ``None`` costs nothing.

    The host->device copies are issued by the replay prefetch (``ReplayConfig.prefetch``,
    the same depth), or at unpack without one.
    """

    def __init__(self, defer: int = 1, *, stream: Any = "auto", block_inputs: bool = False,
                 log: Log | None = None) -> None:
        if isinstance(defer, bool) or not isinstance(defer, int) or defer < 1:
            raise ValueError(
                f"ac2_dist.Offload: defer must be an int >= 1 (the wait for block i's copies happens when "
                f"block i+defer closes), got {defer!r}"
            )
        if not (stream in ("auto", "inline") or _is_stream(stream)):
            raise ValueError(f"ac2_dist.Offload: stream must be 'auto', 'inline' or a torch.cuda.Stream, got {stream!r}")
        if not isinstance(block_inputs, bool):
            raise ValueError(f"ac2_dist.Offload: block_inputs must be a bool, got {block_inputs!r}")
        self.defer = defer
        self.stream = stream
        self.block_inputs = block_inputs
        self.log = log
        self.stats = OffloadStats()
        self._lock = threading.RLock()
        self._pool = _Pool(self.stats)
        self._closed: deque[weakref.ref[OffloadUnit]] = deque()  # closed, not yet committed
        self._side: Any = stream if _is_stream(stream) else None
        self._engines: dict[StreamBackend | None, InlineCopies] = {}  # per stream backend; None: CPU

    def __repr__(self) -> str:
        inputs = ", block_inputs=True" if self.block_inputs else ""
        return f"ac2_dist.Offload(defer={self.defer}, stream={self.stream!r}{inputs})"

    def __reduce__(self) -> tuple:
        # The schedule's state (pool, streams, open blocks) belongs to this process.
        stream = self.stream if isinstance(self.stream, str) else "auto"
        return (_restore, (self.defer, stream, self.log, self.block_inputs))

    @staticmethod
    def is_block_input(t: Any) -> bool:
        """Whether a positional argument of a block's call is a block input that
        ``block_inputs=True`` offloads: a non-empty tensor that requires grad and is not
        a parameter."""
        # See Note [Offloaded block inputs].
        return (isinstance(t, torch.Tensor) and t.requires_grad and not isinstance(t, torch.nn.Parameter)
                and t.numel() > 0)

    def applies(self, on_cuda: bool) -> bool:
        """Whether a region should open a block of this schedule."""
        return on_cuda or self.stream == "inline"

    def pool_held(self) -> tuple[int, int]:
        """(buffers, bytes) waiting in the pool now."""
        with self._lock:
            return self._pool.held()

    def empty_pool(self) -> None:
        """Drop the buffers the pool holds (they are allocated again when needed)."""
        with self._lock:
            self._pool.clear()

    def _engine(self, streams: StreamBackend | None) -> InlineCopies:
        """The copy engine of device tensors on ``streams`` (None: CPU tensors, inline)."""
        engine = self._engines.get(streams)
        if engine is None:
            if streams is None:
                engine = InlineCopies()
            elif self.stream == "inline":
                engine = CudaCopies(streams, None)
            else:
                if self._side is None:
                    self._side = streams.new_stream()
                engine = CudaCopies(streams, self._side)
            self._engines[streams] = engine
        return engine

    def open_unit(self, fqn: str, streams: StreamBackend | None = None) -> OffloadUnit:
        """A block opens (its region is installed, on ``streams``: the region's stream
        backend, None on CPU): the blocks closed before it issue their copies."""
        # Step 2 of Note [The offload schedule].
        with self._lock:
            self._emit("open", fqn)
            for ref in self._closed:
                unit = ref()
                if unit is not None and unit.state == _CLOSED:
                    unit.issue()
            return OffloadUnit(self, fqn, streams)

    def _close(self, unit: OffloadUnit) -> None:
        with self._lock:
            self._emit("close", unit.fqn)
            if unit.state == _OPEN:
                unit.state = _CLOSED
            self._closed.append(weakref.ref(unit))
            while len(self._closed) > self.defer:  # step 3
                old = self._closed.popleft()()
                if old is not None and old.state == _COPIED:
                    old.commit()

    def _count_d2h(self, r: OffloadedTensor) -> None:
        self.stats.d2h_copies += 1
        self.stats.d2h_bytes += r.nbytes

    def _emit(self, event: str, fqn: str) -> None:
        if self.log is not None:
            self.log(event, fqn)


def _device_streams(t: torch.Tensor) -> StreamBackend | None:
    """The stream backend of ``t``'s device: CUDA's for a CUDA tensor, None for a CPU one
    (a simulated CUDA installed on this thread answers for both: Note [Stream backends]
    in _streams.py)."""
    return region_streams(t.is_cuda)


def _restore(defer: int, stream: str, log: Log | None, block_inputs: bool = False) -> Offload:
    return Offload(defer, stream=stream, log=log, block_inputs=block_inputs)


def _is_stream(s: Any) -> bool:
    return hasattr(torch, "cuda") and isinstance(s, torch.cuda.Stream)
