"""A peak target below the floor: the block inputs offloaded before giving up.

Note [Below the floor, the block inputs go first]
    At the floor ("recompute_all" in every block) a block keeps little but its inputs,
    the hidden states every policy keeps; at long context those are most of what the
    blocks hold (Note [Offloaded block inputs] in offload.py). So when the floor step's
    measured peak is above the target and the blocks follow an offload schedule
    (``Offload``: ``apply_ac`` gives its modules one on CUDA) that does not offload
    their inputs yet, the planner turns ``block_inputs`` on for that schedule, warns once
    saying so, forgets the floor it measured and measures the floor again, with the
    inputs offloaded; only if that step is still over the target is the target
    infeasible (a warning, or with ``strict=True`` an error). Every rank decides alike:
    the floor's peak is the maximum over the ranks (Note [One plan on every rank] in
    _peak_step.py). ``MemoryBudget(peak=..., offload_block_inputs=False)`` keeps the
    inputs on the device. The copies cost link time, not device memory; the schedule
    overlaps them with the next block's forward and the prefetch with the previous
    block's backward.
"""

from __future__ import annotations

import weakref
from typing import Any

from .._sizes import human_bytes

__all__: list[str] = []


def remember_schedule(planner: Any, graph: Any) -> None:
    """Note the offload schedule a block of the step follows (its region's ``graph``)."""
    unit = getattr(graph, "offload", None)
    if unit is not None and planner.offload is None:
        planner.offload = weakref.ref(unit.owner)


def offload_block_inputs(planner: Any, floor: int) -> bool:
    """Below the floor: turn on the schedule's block inputs and measure the floor again
    (Note [Below the floor, the block inputs go first]). False if there is no schedule,
    it already offloads them, or the budget forbids it."""
    offload = planner.offload() if planner.offload is not None else None
    if offload is None or offload.block_inputs or not planner.budget._offload_block_inputs:
        return False
    offload.block_inputs = True
    planner.bases = None
    planner.guard = {}
    planner._warn_once("block_inputs", (
        f"ac2_dist.MemoryBudget(peak={human_bytes(planner.target)}): a step at the floor (\"recompute_all\" in every "
        f"block) peaked at {human_bytes(floor)} ({floor} bytes) on this rank, above the target; the blocks' inputs are offloaded to host memory "
        "from the next step (Offload(block_inputs=True)) and the floor is measured again. Pass "
        "MemoryBudget(..., offload_block_inputs=False) to keep them on the device"))
    return True
