"""Host buffers and the copies of the offload schedule (offload.py): the bounded pool
of (pinned) host buffers, and the two copy engines -- :class:`InlineCopies` on the
calling thread (CPU tensors: the schedule under test) and :class:`CudaCopies` on CUDA
streams. The records they copy are ``offload.OffloadedTensor``s (read by attribute:
``host``, ``device``, ``reuse_after``, shape and dtype)."""

# Note [Pinned buffer pool]
#     Pinning host memory costs milliseconds per allocation (``cudaHostAlloc``), which
#     is what makes per-tensor pinned offload slow. The pool keeps released buffers and
#     hands them out again; a buffer comes back with the event of the last copy that read
#     it, and the copy stream waits for that event before writing into it again. After
#     the first step a steady training loop allocates no pinned memory
#     (``Offload.stats.buffers_allocated`` stops growing). The pool is the Offload's:
#     ``Offload.empty_pool()`` drops the buffers it holds.
#
#     Shapes vary in real training (packed or variable-length batches, the last partial
#     batch), and page-locked memory is scarce, so the pool is bounded:
#     - a request is served from a *size class*: its bytes rounded up to one of four
#       steps between consecutive powers of two (at most 25 % more), so nearby sizes
#       share buffers;
#     - the pool never holds more than the most bytes that were ever in use at once
#       (its own high-water mark, rounded sizes): before it makes a new buffer it drops
#       free ones, the largest first, until the free and the used ones fit under that
#       mark (``OffloadStats.buffers_dropped``). A dropped buffer goes back to torch's
#       host allocator, which frees it once the copies reading it are done.
#     Keyed by exact size (before), 12 steps at sequence lengths 24..35 held 216 buffers,
#     10x the largest step's bytes, and grew with every new length.

from __future__ import annotations

from typing import Any

import torch

from ._streams import StreamBackend

__all__ = ["CudaCopies", "InlineCopies"]


def _size_class(nbytes: int) -> int:
    """The bytes of the buffer that serves a request of ``nbytes`` (Note [Pinned buffer
    pool]): a multiple of 512, and above 4 KiB one of four steps between powers of two."""
    if nbytes <= 4096:
        return max(512, -(-nbytes // 512) * 512)
    step = (1 << (nbytes - 1).bit_length()) // 8  # a quarter of the way from 2^(k-1) to 2^k
    return -(-nbytes // step) * step


class _Pool:
    """Host buffers by size class, bounded by the most bytes ever in use at once (Note
    [Pinned buffer pool])."""

    def __init__(self, stats: Any) -> None:  # the Offload's OffloadStats
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self._stats = stats
        self._free_bytes = 0
        self._in_use = 0
        self._peak = 0  # the most bytes in use at once: the cap on what the pool holds

    def get(self, nbytes: int, engine: InlineCopies) -> tuple[torch.Tensor, Any]:
        """A buffer of at least ``nbytes`` (its size class) and the event of the last copy
        that read it (or None); a new one from ``engine`` if none is free. A pinned buffer
        serves an inline copy as well, and an unpinned one a CUDA copy (then
        synchronously); each Offload has one kind."""
        size = _size_class(nbytes)
        self._in_use += size
        self._peak = max(self._peak, self._in_use)
        free = self._free.get(size)
        if free:
            self._stats.buffers_reused += 1
            self._free_bytes -= size
            return free.pop()
        self._drop_until(self._peak - self._in_use)
        self._stats.buffers_allocated += 1
        self._stats.bytes_allocated += size
        return engine.host_buffer(size), None

    def put(self, buf: torch.Tensor, event: Any) -> None:
        size = buf.numel()
        self._in_use -= size
        self._free.setdefault(size, []).append((buf, event))
        self._free_bytes += size

    def _drop_until(self, room: int) -> None:
        """Drop free buffers, the largest first, until they hold at most ``room`` bytes."""
        for size in sorted(self._free, reverse=True):
            bufs = self._free[size]
            while bufs and self._free_bytes > room:
                bufs.pop()
                self._free_bytes -= size
                self._stats.buffers_dropped += 1
                self._stats.bytes_dropped += size
            if not bufs:
                del self._free[size]
            if self._free_bytes <= room:
                return

    def clear(self) -> None:
        self._free.clear()
        self._free_bytes = 0

    def held(self) -> tuple[int, int]:
        """(buffers, bytes) the pool holds now (free ones)."""
        n = sum(len(v) for v in self._free.values())
        return n, self._free_bytes


class InlineCopies:
    """Copies on the calling thread, in program order: CPU "device" tensors (the
    schedule under test on CPU). No events: every copy is done when it returns."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A new host buffer of ``nbytes`` for the pool."""
        # See Note [Pinned buffer pool].
        return torch.empty(nbytes, dtype=torch.uint8)

    def issue(self, records: list[Any]) -> Any:
        """Copy ``records`` to their host buffers; returns the event marking the end."""
        for r in records:
            r.host.copy_(r.device)
        return None

    def writer_waits(self, event: Any) -> None:
        """The compute stream waits for ``event`` (copies it must not overtake)."""

    def guard(self, t: torch.Tensor) -> None:
        """``t`` may be freed before the compute stream waited for the copy reading it
        (a kept block, a graph that died first): its memory waits for the copy stream."""

    def to_device(self, r: Any) -> tuple[torch.Tensor, Any]:
        """A device tensor holding ``r``'s host copy, and the event after the copy."""
        out = torch.empty_strided(r.shape, r.stride, dtype=r.dtype, device=r.device_of)
        out.copy_(r.host)
        return out, None


class CudaCopies(InlineCopies):
    """Device->host copies on a CUDA side stream (``stream=None``: the current stream,
    i.e. ``Offload(stream="inline")`` for CUDA tensors), into pinned buffers;
    host->device copies on the stream that reads the value (the replay side stream
    when prefetched). ``streams``: torch.cuda, or the test suite's simulated CUDA."""

    def __init__(self, streams: StreamBackend, stream: Any = None) -> None:
        self._streams = streams
        self._stream = stream

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return self._streams.host_buffer(nbytes)

    def _copy_stream(self) -> Any:
        return self._stream if self._stream is not None else self._streams.current_stream()

    def issue(self, records: list[Any]) -> Any:
        side = self._copy_stream()
        current = self._streams.current_stream()
        if side != current:
            side.wait_stream(current)  # the values were produced on the compute stream
        with self._streams.use(side):
            for r in records:
                if r.reuse_after is not None:  # the buffer's last reader (Note [Pinned buffer pool])
                    side.wait_event(r.reuse_after)
                    r.reuse_after = None
                r.host.copy_(r.device, non_blocking=True)
            return side.record_event()

    def guard(self, t: torch.Tensor) -> None:
        # Only where needed: record_stream delays the reuse of a freed block until the
        # allocator sees the copy done, which would hold committed blocks' memory longer.
        if self._stream is not None and self._stream != self._streams.current_stream():
            self._streams.record_stream(t, self._stream)

    def writer_waits(self, event: Any) -> None:
        if event is not None:
            self._streams.current_stream().wait_event(event)

    def to_device(self, r: Any) -> tuple[torch.Tensor, Any]:
        out = torch.empty_strided(r.shape, r.stride, dtype=r.dtype, device=r.device_of)
        out.copy_(r.host, non_blocking=True)
        return out, self._streams.current_stream().record_event()
