"""A model of torch's CUDA caching allocator: what a sequence of allocations and frees
on given streams reserves from the device (``torch.cuda.max_memory_reserved``'s scale),
beside what it allocates.

Note [The caching allocator, modelled]
    The model follows ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.10-2.14), default
    settings:

    - a request is rounded up to a multiple of 512 bytes (512 at least);
    - requests of at most 1 MiB come from the *small* pool, larger ones from the
      *large* pool; each pool keeps the free blocks of every stream apart, and a
      request is served only from its own stream's free blocks (per-stream pools);
    - a free block is chosen best fit (the smallest that is large enough, then the
      lowest address), and split when what is left is worth keeping: at least 512
      bytes in the small pool, more than 1 MiB in the large pool;
    - with no fitting free block a new segment is reserved: 2 MiB for a small request,
      20 MiB for a request under 10 MiB, else the request rounded up to 2 MiB; nothing
      is given back to the device (no ``empty_cache``, no out-of-memory retry);
    - a freed block merges with free neighbours of its segment;
    - a block ``record_stream``-ed on other streams goes back to its pool only once the
      events recorded on those streams at its free have completed, which the
      allocator checks at the start of each allocation: until then it is held;
    - with ``expandable_segments`` each (stream, pool) has one segment that grows by
      mapping pages at its end (2 MiB pages for the small pool, 20 MiB for the large
      one), extending a free block at its end when there is one.

    What it leaves out: ``max_split_size_mb`` and ``roundup_power2_divisions`` (off by
    default), ``garbage_collection_threshold``, graph pools, IPC, the out-of-memory
    path. Time enters only through the held blocks: the caller passes the time of each
    call and, per held block, when its streams' events complete.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Block", "CachingAllocator", "round_size", "segment_size"]

_MIN_BLOCK = 512
_SMALL_SIZE = 1 << 20  # requests up to this come from the small pool
_SMALL_BUFFER = 2 << 20  # a small pool's segment
_LARGE_BUFFER = 20 << 20  # a large pool's segment for a request under _MIN_LARGE_ALLOC
_MIN_LARGE_ALLOC = 10 << 20
_ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    """A request's size as the allocator serves it."""
    return _MIN_BLOCK if nbytes < _MIN_BLOCK else -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK


def segment_size(size: int) -> int:
    """The segment reserved for a (rounded) request no free block fits."""
    if size <= _SMALL_SIZE:
        return _SMALL_BUFFER
    if size < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER
    return -(-size // _ROUND_LARGE) * _ROUND_LARGE


@dataclass(eq=False)
class Block:
    """A block of a segment: allocated, free, or held (freed, waiting for events)."""

    stream: Any
    small: bool
    address: int
    size: int
    segment: int  # the segment's id
    allocated: bool = False
    held: bool = False  # freed with record_stream events not yet complete
    requested: int = 0
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)

    def key(self) -> tuple:
        return (self.size, self.address)


class _Pool:
    """The free blocks of one (stream, small/large) pool, ordered by (size, address)."""

    def __init__(self) -> None:
        self.keys: list[tuple] = []
        self.blocks: dict[tuple, Block] = {}

    def add(self, b: Block) -> None:
        k = b.key()
        bisect.insort(self.keys, k)
        self.blocks[k] = b

    def remove(self, b: Block) -> None:
        k = b.key()
        i = bisect.bisect_left(self.keys, k)
        assert self.keys[i] == k
        del self.keys[i]
        del self.blocks[k]

    def best_fit(self, size: int) -> Block | None:
        i = bisect.bisect_left(self.keys, (size, -1))
        return self.blocks[self.keys[i]] if i < len(self.keys) else None


class CachingAllocator:
    """Allocations and frees on streams, in time order (Note [The caching allocator,
    modelled]). ``malloc`` and ``free`` take the current (host) time; ``free`` takes,
    for a block ``record_stream``-ed on other streams, when the events recorded on them
    at the free complete."""

    def __init__(self, expandable_segments: bool = False) -> None:
        self.expandable = expandable_segments
        self.pools: dict[tuple, _Pool] = {}
        self.held: list[tuple[float, int, Block]] = []  # a heap: (when its events complete, order, block)
        self._order = 0
        self.reserved = 0
        self.reserved_by: dict[Any, int] = {}  # stream -> bytes its pools reserved
        self.allocated = 0
        self.peak_reserved = 0
        self.peak_allocated = 0
        self.segments = 0
        self._next_address = 0
        self._tails: dict[tuple, Block] = {}  # expandable: (stream, small) -> the segment's last block

    # ---- the allocator's calls ----------------------------------------------------
    def malloc(self, nbytes: int, stream: Any, now: float = 0.0) -> Block:
        """A block for ``nbytes`` on ``stream`` at time ``now``."""
        self._release_held(now)
        size = round_size(nbytes)
        small = size <= _SMALL_SIZE
        pool = self.pools.setdefault((stream, small), _Pool())
        block = pool.best_fit(size)
        if block is not None:
            pool.remove(block)
        elif self.expandable:
            block = self._grow(stream, small, size, pool)
        else:
            block = self._new_segment(stream, small, segment_size(size))
        block = self._split(block, size, pool)
        block.allocated = True
        block.requested = nbytes
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: Block, now: float = 0.0, ready: float | None = None, hold: bool = False) -> None:
        """Free ``block`` at ``now``; ``ready``: when the events of the streams it was
        ``record_stream``-ed on, recorded now, complete (None: not recorded on another
        stream, back in its pool at once); ``hold``: they complete at a time not known
        yet, and :meth:`release` returns the block once they have."""
        assert block.allocated, "a block freed twice"
        block.allocated = False
        self.allocated -= block.size
        if hold:
            block.held = True
            return
        if ready is not None and ready > now:
            block.held = True
            self._order += 1
            heapq.heappush(self.held, (ready, self._order, block))
            return
        self._to_pool(block)

    def release(self, block: Block) -> None:
        """A block freed with ``hold=True``: its streams' events have completed."""
        assert block.held and not block.allocated
        block.held = False
        self._to_pool(block)

    def held_bytes(self, now: float) -> int:
        """Bytes freed but held for their streams' events at ``now``."""
        return sum(b.size for t, _, b in self.held if t > now)

    # ---- internals ----------------------------------------------------------------
    def _release_held(self, now: float) -> None:
        while self.held and self.held[0][0] <= now:
            block = heapq.heappop(self.held)[2]
            block.held = False
            self._to_pool(block)

    def _new_segment(self, stream: Any, small: bool, size: int) -> Block:
        self.segments += 1
        block = Block(stream, small, self._next_address, size, self.segments)
        self._next_address += size
        self.reserved += size
        self.reserved_by[stream] = self.reserved_by.get(stream, 0) + size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _grow(self, stream: Any, small: bool, size: int, pool: _Pool) -> Block:
        """Expandable segments: map pages at the end of this (stream, pool)'s segment."""
        page = _SMALL_BUFFER if small else _LARGE_BUFFER
        tail = self._tails.get((stream, small))
        have = tail.size if tail is not None and not tail.allocated and not tail.held else 0
        grow = -(-(size - have) // page) * page
        self.reserved += grow
        self.reserved_by[stream] = self.reserved_by.get(stream, 0) + grow
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        if tail is not None and have:  # extend the free block at the end
            pool.remove(tail)
            tail.size += grow
            return tail
        if tail is None:
            self.segments += 1
            seg = self.segments
            address = self._next_address
            self._next_address += 1 << 40  # room to grow
        else:
            seg, address = tail.segment, tail.address + tail.size
        block = Block(stream, small, address, grow, seg, prev=tail)
        if tail is not None:
            tail.next = block
        self._tails[(stream, small)] = block
        return block

    def _split(self, block: Block, size: int, pool: _Pool) -> Block:
        rest = block.size - size
        if rest >= _MIN_BLOCK if block.small else rest > _SMALL_SIZE:
            remaining = Block(block.stream, block.small, block.address + size, rest, block.segment,
                              prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = remaining
            block.next = remaining
            block.size = size
            if self._tails.get((block.stream, block.small)) is block:
                self._tails[(block.stream, block.small)] = remaining
            pool.add(remaining)
        return block

    def _to_pool(self, block: Block) -> None:
        pool = self.pools.setdefault((block.stream, block.small), _Pool())
        for neighbour in (block.prev, block.next):  # merge free neighbours of the segment
            if neighbour is not None and not neighbour.allocated and not neighbour.held:
                pool.remove(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    if self._tails.get((block.stream, block.small)) is block:
                        self._tails[(block.stream, block.small)] = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
                    if self._tails.get((block.stream, block.small)) is neighbour:
                        self._tails[(block.stream, block.small)] = block
        pool.add(block)
