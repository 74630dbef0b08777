"""The view-write fuzzer (tests/_view_fuzz.py) over a fixed budget of seeds: random
programs of buffers, views of every kind and in-place writes through them, each run
eagerly, under torch's checkpoint and under ac2 (``ac2_dist.checkpoint``,
``apply_ac_policy("recompute_all")``, a random save list; the C and the Python recorder):
no crash where torch's checkpoint runs, outputs, gradients and state bitwise eager's, kept
bytes (from the allocator) no more than torch's, nothing left after the step.

The budget: seeds 0-169 in five chunks (about 150 programs run; the rest are invalid
eagerly or raise under torch's checkpoint). ``AC2_FUZZ_SECONDS=300`` turns each chunk
into a timed run over fresh seeds (the five together run that many seconds); CI's long
run is ``python -m tests._view_fuzz --minutes 5``. A failure prints the seed, the
program's source and ``python -m tests._view_fuzz --seed N -v``, which replays it alone.
"""

from __future__ import annotations

import os

import pytest
from _view_fuzz import fuzz

CHUNKS = 5
SEEDS_PER_CHUNK = 34


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_view_write_programs_match_eager_and_keep_no_more_than_torch(chunk):
    seconds = float(os.environ.get("AC2_FUZZ_SECONDS", "0")) / CHUNKS
    if seconds > 0:
        summary = fuzz(iter(range(1_000_000 * (chunk + 1), 1_000_000 * (chunk + 2))), seconds=seconds)
    else:
        summary = fuzz(iter(range(chunk * SEEDS_PER_CHUNK, (chunk + 1) * SEEDS_PER_CHUNK)))
    print("\n" + summary.format(show=0))
    # The generator must keep making programs that run (it cannot pass by making none).
    assert summary.run >= summary.seeds // 2, summary.format(show=0)
    assert not summary.failures, summary.format(show=3)
