"""The caching-allocator model (ac2_dist/_sim/_allocator.py, Note [The caching allocator,
modelled]) against the rules of torch's CUDACachingAllocator, case by case: rounding,
pools and segment sizes, best fit, splitting, per-stream pools, merging, blocks held by
record_stream until their events complete, expandable segments."""

from __future__ import annotations

import random

import pytest

from ac2_dist._sim._allocator import CachingAllocator, round_size, segment_size

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (1, 511, 512, 513, 1000)] == [512, 512, 512, 1024, 1024]
    assert segment_size(512) == segment_size(MiB) == 2 * MiB  # small pool
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB + 1) == 12 * MiB


def test_small_requests_share_a_2_mib_segment_and_large_ones_a_20_mib_one():
    a = CachingAllocator()
    blocks = [a.malloc(4096, "s") for _ in range(100)]
    assert a.reserved == 2 * MiB and a.segments == 1 and a.allocated == 100 * 4096
    big = [a.malloc(3 * MiB, "s") for _ in range(6)]  # 6 x 3 MiB from one 20 MiB segment
    assert a.reserved == 22 * MiB and a.segments == 2
    a.malloc(3 * MiB, "s")  # the seventh does not fit the 2 MiB left over
    assert a.reserved == 42 * MiB and a.segments == 3
    for b in blocks + big:
        a.free(b)
    assert a.allocated == 3 * MiB and a.reserved == 42 * MiB  # nothing given back
    assert a.peak_reserved == 42 * MiB


def test_best_fit_split_and_merge():
    a = CachingAllocator()
    x, y, z = a.malloc(5 * MiB, "s"), a.malloc(5 * MiB, "s"), a.malloc(5 * MiB, "s")
    assert (x.segment, y.segment, z.segment) == (1, 1, 1) and a.reserved == 20 * MiB
    a.free(y)  # a 5 MiB hole between x and z; the 5 MiB tail is free too
    w = a.malloc(4 * MiB, "s")  # best fit: ties go to the lower address (the hole)
    assert w.address == y.address and w.size == 5 * MiB  # a 1 MiB rest is not split off (> 1 MiB is)
    a.free(w)
    v = a.malloc(3 * MiB, "s")
    assert v.address == y.address and v.size == 3 * MiB  # a 2 MiB rest is split off...
    u = a.malloc(2 * MiB, "s")
    assert u.address == y.address + 3 * MiB  # ...and serves the next request
    a.free(u)
    a.free(v)
    a.free(x)
    a.free(z)  # x, the hole, z and the tail merge back into one 20 MiB free block
    whole = a.malloc(20 * MiB, "s")
    assert whole.address == x.address and a.reserved == 20 * MiB


def test_small_pool_splits_any_rest_of_512_bytes():
    a = CachingAllocator()
    b = a.malloc(1024, "s")
    a.free(b)
    c = a.malloc(512, "s")
    d = a.malloc(512, "s")
    assert {c.address, d.address} == {b.address, b.address + 512} and a.reserved == 2 * MiB


def test_pools_are_per_stream():
    a = CachingAllocator()
    x = a.malloc(8 * MiB, "compute")
    a.free(x)
    y = a.malloc(8 * MiB, "side")  # the compute stream's free block is not the side stream's
    assert y.segment != x.segment and a.reserved == 40 * MiB
    z = a.malloc(8 * MiB, "compute")
    assert z.segment == x.segment and a.reserved == 40 * MiB


def test_a_record_stream_hold_keeps_the_block_until_its_events_complete():
    a = CachingAllocator()
    x = a.malloc(8 * MiB, "compute", now=0.0)
    a.free(x, now=1.0, ready=5.0)  # read on the side stream, whose event completes at t=5
    assert a.held_bytes(2.0) == 8 * MiB
    a.malloc(8 * MiB, "compute", now=2.0)  # not reusable yet: the rest of the segment serves it
    y = a.malloc(8 * MiB, "compute", now=3.0)  # the segment is full now: a second one
    assert a.reserved == 40 * MiB and y.segment == 2
    z = a.malloc(8 * MiB, "compute", now=6.0)  # the events completed: back in the pool
    assert z.address == x.address and a.reserved == 40 * MiB and a.held_bytes(6.0) == 0


def test_expandable_segments_grow_one_segment_per_stream_and_pool():
    a = CachingAllocator(expandable_segments=True)
    blocks = [a.malloc(7 * MiB, "s") for _ in range(5)]  # 35 MiB: pages of 20 MiB
    assert a.reserved == 40 * MiB and len({b.segment for b in blocks}) == 1
    a.free(blocks[-1])  # 7 MiB free at the end, plus 5 MiB never used
    a.malloc(15 * MiB, "s")  # extends the free tail by one page instead of a new segment
    assert a.reserved == 60 * MiB
    plain = CachingAllocator()
    for _ in range(5):
        plain.malloc(7 * MiB, "s")
    assert plain.reserved == 60 * MiB  # two blocks per 20 MiB segment: fragmentation


@pytest.mark.parametrize("expandable", [False, True])
def test_random_traces_keep_the_books(expandable):
    """Many random allocations and frees on two streams: allocated bytes match the live
    blocks, reserved never shrinks, live blocks never overlap, and freeing everything
    leaves every segment one free block per pool."""
    rng = random.Random(0)
    a = CachingAllocator(expandable_segments=expandable)
    live = []
    for step in range(3000):
        if live and rng.random() < 0.45:
            b = live.pop(rng.randrange(len(live)))
            a.free(b, now=step, ready=step + rng.choice([3, 30]) if rng.random() < 0.3 else None)
        else:
            size = rng.choice([rng.randrange(1, 4096), rng.randrange(1, 2 * MiB), rng.randrange(1, 30 * MiB)])
            live.append(a.malloc(size, rng.choice(["a", "b"]), now=step))
        assert a.allocated == sum(b.size for b in live)
        assert a.reserved == a.peak_reserved or a.reserved <= a.peak_reserved
        spans = sorted((b.address, b.address + b.size) for b in live)
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
    for b in live:
        a.free(b, now=10**6)
    a._release_held(10**7)  # what the next malloc does first
    free = [b for pool in a.pools.values() for b in pool.blocks.values()]
    assert a.allocated == 0 and not a.held and sum(b.size for b in free) == a.reserved
    # every segment merged back into one free block
    assert len(free) == len({b.segment for b in free}) == a.segments
