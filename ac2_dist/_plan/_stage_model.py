"""The peak model of a pipeline rank's step: Note [The peak model] (_peak_model.py) with
every microbatch in flight counted, and its solver. Read by the simulation's planner of a
pipeline stage (_sim/_stage_plan.py).

Note [A stage's microbatches in flight]
    Under a pipeline schedule a rank's step runs each block's forward once per microbatch,
    and a microbatch's saves stay alive from its forward until its backward: one plan (one
    saved set per block, the same for every microbatch) is held as many times as
    microbatches are in flight. The simulated floor step marks a segment at every
    schedule action (``act:F0@i``: the forward of microbatch i on the rank's stage 0;
    ``B``, ``I``, ``W`` its backward or its zero-bubble halves; ``U``, ``R``, ``G`` the
    runtime's unshard, reshard and gradient reduction; ``act:E@0`` the step's end, its
    optimizer step) and at every block region (``fwd:j@i``, ``bwd:j@i``), in time order.
    Walking them, block j's saves of microbatch i are alive from ``fwd:j@i`` through
    ``bwd:j@i`` -- through the end of the stage's ``W`` of microbatch i where an ``I``
    ran that backward (``stage_backward_input`` keeps the autograd graph, and with it the
    saved values, for the weights' gradients) -- so each segment s has a count
    ``n[s][j]``, the microbatches whose block-j saves it holds, and

        predicted(S) = max over segments s of  base_s + sum_j n[s][j] * dk_j(S_j)

    which is Note [The peak model]'s prediction when one microbatch is in flight
    (``n`` is 1 for blocks 0..k in ``fwd:k`` and ``bwd:k``) and errs high as it does.

    The constraints are no longer prefix sums over the blocks in forward order: in 1F1B's
    steady state, block 0's forward of microbatch i runs while microbatches i-1, ..., i-w+1
    hold every block's saves. Per segment and per stage of the rank, ``n`` is a count
    ``c`` for every block of the stage plus 1 for a prefix of them (the microbatch whose
    forward or backward runs there): exactly so in every schedule simulated; where it is
    not, ``c`` is the stage's largest count and no prefix (it errs high). With ``T_σ``
    stage σ's summed ``dk`` the constraint of segment s is

        sum_σ c[s][σ] * T_σ + P(k_s) <= target - base_s

    (``P(k)``: the prefix sum of the segment's own stage through block k). :func:`solve`
    bounds every ``T_σ`` by a ``U_σ`` from a grid (64 values for one stage a rank, 32 per
    stage for two, fewer for more, from 0 to the most any segment that holds ``T_σ``
    lets it be): then every constraint is a prefix constraint of one
    stage, ``T_σ <= U_σ`` is the prefix constraint of its last block, and the stages are
    independent -- each is :func:`~._peak_model._solve` on its blocks. The cheapest plan
    over the grid is returned; it fits by construction, and is at most one grid step of
    ``T`` from the optimum of the model.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from ._block_problem import _Option
from ._peak_model import _solve

__all__: list[str] = []


def _parse(segment: str) -> tuple[str, int, int]:
    """``(kind, index, microbatch)`` of ``fwd:j@i`` / ``bwd:j@i`` (kind ``fwd`` / ``bwd``,
    index the block) or ``act:Xk@i`` (kind ``X``, index the rank's stage)."""
    head, micro = segment.rsplit("@", 1)
    kind, index = head.split(":", 1)
    if kind == "act":
        return index[0], int(index[1:]), int(micro)
    return kind, int(index), int(micro)


def counts(segments: Sequence[str], stage_of: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Per segment (in time order), how many microbatches' saves of each block it holds
    (Note [A stage's microbatches in flight]); ``stage_of[j]``: block j's stage on the rank."""
    alive: dict[tuple[int, int], None] = {}  # (microbatch, block) -> alive
    drop_next: list[tuple[int, int]] = []  # freed when the next segment begins
    after_w: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (stage, microbatch) -> freed after its W
    action = ("", -1, -1)
    out: dict[str, tuple[int, ...]] = {}
    for s in segments:
        for key in drop_next:
            alive.pop(key, None)
        drop_next = []
        kind, index, micro = _parse(s)
        if kind == "fwd":
            alive[(micro, index)] = None
        elif kind == "bwd":
            alive[(micro, index)] = None
            if action[0] == "I":
                after_w.setdefault((stage_of[index], micro), []).append((micro, index))
            else:
                drop_next.append((micro, index))
        else:
            if action[0] == "W":  # the W has ended: the saves its I kept are gone
                for key in after_w.pop(action[1:], []):
                    alive.pop(key, None)
            action = (kind, index, micro)
        n = [0] * len(stage_of)
        for _, j in alive:
            n[j] += 1
        out[s] = tuple(n)
    return out


def predict(bases: dict[str, int], n: dict[str, tuple[int, ...]], dks: Sequence[int]) -> int:
    """The model's prediction above the step's start (Note [A stage's microbatches in flight])."""
    return max(base + sum(c * d for c, d in zip(n[s], dks)) for s, base in bases.items())


def _shape(n: tuple[int, ...], stages: list[list[int]]) -> tuple[list[int], int, int]:
    """``(c per stage, the prefix's stage, the prefix's last local block)`` of one
    segment's counts (prefix stage -1: none)."""
    cs, prefix = [], (-1, -1)
    for sigma, blocks in enumerate(stages):
        vals = [n[j] for j in blocks]
        c = min(vals)
        extra = [v - c for v in vals]
        ones = sum(extra)
        is_prefix = all(e in (0, 1) for e in extra) and extra[:ones] == [1] * ones
        if ones and is_prefix and prefix[0] < 0:
            prefix = (sigma, ones - 1)
        elif ones:
            c = max(vals)  # not a prefix: counted in full (errs high)
        cs.append(c)
    return cs, prefix[0], prefix[1]


def solve(options: list[list[_Option]], bases: dict[str, int], n: dict[str, tuple[int, ...]],
          stage_of: Sequence[int], target: int) -> tuple[int, ...] | None:
    """The cheapest option per block whose prediction fits ``target`` (above the step's
    start), or None if the options with the fewest bytes do not fit (Note [A stage's
    microbatches in flight])."""
    nstages = max(stage_of) + 1
    stages = [[j for j, s in enumerate(stage_of) if s == sigma] for sigma in range(nstages)]
    shapes = {s: _shape(n[s], stages) for s in bases}
    # T_σ can be no more than its options' largest sum, nor than any segment that holds
    # it c times allows: the grid spans what can fit
    tops = [sum(max(o.dk for o in options[j]) for j in blocks) for blocks in stages]
    for s, base in bases.items():
        for sigma, c in enumerate(shapes[s][0]):
            if c:
                tops[sigma] = min(tops[sigma], max(0, target - base) // c)
    per = min(64, max(2, int(round(1024 ** (1 / nstages)))))
    grids = [sorted({0, *(math.ceil(top * g / (per - 1)) for g in range(per))}) for top in tops]
    best: tuple[float, int, tuple[int, ...]] | None = None
    for bound in itertools.product(*grids):
        caps: list[dict[str, int]] = [{} for _ in stages]
        ok = True
        for s, base in bases.items():
            cs, sigma, k = shapes[s]
            fixed = base + sum(c * u for c, u in zip(cs, bound))
            if sigma < 0:
                if fixed > target:
                    ok = False
                    break
                continue
            key = f"fwd:{k}"
            caps[sigma][key] = max(caps[sigma].get(key, fixed), fixed)
        if not ok:
            continue
        choice: list[int] = [0] * len(stage_of)
        cost, flops = 0.0, 0
        for sigma, blocks in enumerate(stages):
            last = f"fwd:{len(blocks) - 1}"
            caps[sigma][last] = max(caps[sigma].get(last, target - bound[sigma]), target - bound[sigma])
            picked = _solve([options[j] for j in blocks], caps[sigma], target)
            if picked is None:
                ok = False
                break
            for j, i in zip(blocks, picked):
                choice[j] = i
                cost += options[j][i].seconds
                flops += options[j][i].flops
        if ok and (best is None or (cost, flops) < best[:2]):
            best = (cost, flops, tuple(choice))
    return None if best is None else best[2]
