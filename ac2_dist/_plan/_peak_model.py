"""The model a ``MemoryBudget(peak=N)`` plans with: a step's peak predicted from its
measured segment bases and each block's bytes above its floor, and :func:`_solve`,
which picks one option per block within the target. Moved verbatim from _peak.py (the
planner there measures the bases and calls :func:`_solve`).

Note [The peak model]
    The first step runs every block at the floor (``"recompute_all"``: a calibration
    that holds nothing, Note [A calibration keeps what its plan saves] in _budget_region.py does
    not apply) and is measured from the allocator (on CPU its events: Note [One trace,
    two readers] in _alloc.py; on CUDA its memory history and counters: Note [Measuring
    a CUDA step without a profiler] in _alloc_history.py), with plan marks where block k's region enters (``fwd:k``) and where its
    graph is first unpacked or prefetched (``bwd:k``: its backward begins). Each mark
    opens a *segment* that runs to the next mark; its measured peak above the step's
    start is that segment's *base*. A plan that saves ``dk_j`` bytes above block j's
    floor (``M_j(S_j) - M_j(floor)``, Note [What a budget bounds] in budget.py) adds
    ``dk_j`` to every segment in which those values are alive, so

        predicted(S) = max over segments s of  base_s + sum(dk_j for j in alive(s))

    with ``alive(fwd:k) = alive(bwd:k) = {0..k}``: block k's own saves count in its
    forward (they accumulate there) and in its backward (the floor recomputes its
    values lazily, one chain per unpack, so at its backward's start the floor holds
    fewer of them than a plan that saved them; a correction prices that: Note [A block's
    backward, replay by replay]). Blocks later in the forward are alive
    in fewer segments; the last block's saves are alive only in its own forward and
    backward and in what runs between them (the head, the loss, its backward): saving
    there costs the least peak. The bases hold everything that does not depend on the
    plan (parameters, gradients, FSDP buffers and prefetches, the loss), measured, not
    modelled. Block j's options are the Pareto frontier of (``dk``, estimated recompute
    seconds) of its structure (:meth:`_Problem.frontier`, Note [Cost model] in
    _block_problem.py); :func:`_solve` picks one option per block minimizing the summed cost
    subject to every segment's prediction <= N: a dynamic program over the blocks in
    forward order, whose state is the running sum of ``dk`` (the constraints are prefix
    sums, so the state is all they need: Note [The DP checks exact bytes]).
    Blocks are identified by module fqn; anonymous regions (a drop-in ``checkpoint(fn)``
    call, fqn ``""``) by their position among the step's anonymous calls.

    Where the model errs, it errs high: a saved output that is also kept anyway (a
    block's output is the next block's input) is counted in ``dk``; block k's own saves
    do not all add at its backward's peak; under FSDP, step 1 also holds one-time
    buffers (lazy initialization). So the first plan measures below its prediction
    (0.69-0.83 of the target in the tests) and the correction step uses the rest.

Note [The DP checks exact bytes]
    The dynamic program keeps one state per 1/4096 of the target (prefix sums that close
    are merged, the cheaper kept), so it stays small whatever the model; but every
    constraint is checked on the exact prefix sum the state carries. Rounding each
    block's bytes up instead (as it once did) made the plans err high by up to one such
    grid step per block: on HF Llama 6 x 512 with the head group the plan with no matmul
    recompute, predicted and measured 12 KiB under compile's 0.8 point, was refused by
    the 7 rounded steps (700 KiB). Merging may drop a state that a later block needed
    (the cheaper of two close sums is kept, not the smaller): a plan a little costlier
    than the optimum, never one over the target. The state with the smallest sum is kept
    besides, so a plan is found whenever the options with the fewest bytes fit: a
    pipeline rank's model (Note [A stage's microbatches in flight] in _stage_model.py)
    caps a whole stage's sum at exactly 0 where its microbatches in flight leave no room,
    and on a 405B-sized stage one grid step (10 MB) merged the floor's sum 0 with a
    cheaper 2 MB one, so no plan was found above the floor.

Note [A correction adds to what was measured]
    A plan A that measured under the target corrects from that step's segment peaks, not
    from bases implied by subtracting A's ``dk``: how much of ``dk`` a block's saves
    really added is what the model does not know. Block k's own saves add little at its
    backward (they stand in for what the floor recomputes there), so ``peak - dk(A)``
    undercounts a base by what A saved in block k, and a plan B that moved saves from
    block k to earlier blocks then measures above its prediction (HF GPT-2, 30 % of the
    way from the floor to no AC: predicted 1.39 MB, measured 1.53 MB, 3.6 % over the
    target). So a corrected plan is priced from A's measured peaks upward: each option of
    block j costs what it holds beyond A's saved set, ``held(o | A_j) - held(A_j)``
    (:func:`_above`), and what it would stop saving frees nothing, so

        predicted(B) = max over segments s of  peak_A(s) + sum(above_j(B_j) for j in alive(s))

    which errs high as the first model does (the replays' working sets aside: Note [A
    climb that replays nothing new]). The planner then stores the bases this prediction
    implies for B, so later corrections and ``describe()`` read one model.

Note [A climb that replays nothing new]
    What the correction does not price is a replay's working set: a plan B that replays
    an op A did not allocates that op's output in B's backward, which no step measured
    (GPT-2: +48 KiB, 3 %). A plan that replays, in every block, a subset of what A
    replays allocates nothing A's step did not (each op is replayed at most once, from
    values B keeps), so it may use the whole target; any other plan keeps the largest
    candidate output of the step free (``margin``). :func:`_solve_from` solves both and
    takes the cheaper. Climbing from a plan under the target -- saving more, replaying
    less -- is the first kind, so a climb can reach the target itself where a margin of
    one output (a GPT-2 MLP activation: 16 MiB at 6 x 512, seq 512, batch 4) would stop it short.

Note [A block's backward, replay by replay]
    Block k's own saves do not all add at its backward's peak: what a plan A replays there
    is alive from its replay on, as it would be if it were saved, so saving it costs bytes
    only *before* A's replay made it. A correction from A prices that: a planned step marks,
    after each replay once block k's backward has begun (``Graph.on_replay``), a
    sub-segment ``bwd:k/i`` and remembers what block k's replays had made by then
    (``made_i``, by the ops' policy call indices, which a calibration's records share: node
    seqs differ between calls; a planned call notes them through the graph's observer, for
    the few planned steps). In a correction ``bwd:k`` stands for the stretch before the first
    mark (the first replay's working set), priced in full; in the bases and the guard it is
    still the whole backward. At ``bwd:k/i`` an option ``o`` of block k adds

        at_i(o) = held(A | (o - made_i)) - held(A)

    above A's measured peak there (its saves A had not replayed yet), not ``held(o | A) -
    held(A)``: a value made by then is alive under both plans until its last use and freed
    there under both (use counts), so it adds nothing. The earlier blocks' options add in
    full, as everywhere in their backward and after. Where A's peak sat late in a block's backward -- after the replays that
    made what a larger plan would save -- the larger plan adds nothing there (HF Mixtral,
    3 x 64, 4 experts: the next plan up saved 128 KiB more and measured the same peak, the
    whole-segment price said +131,072 B over the target). The marks' peaks join the sync
    round only where every rank marked the same sub-segments and made the same values
    (a fingerprint in the header); otherwise, and after a step over the target, the
    model prices whole segments again. The first plan (from the floor), the simulator and a
    job that plans for gloo's late buffers (Note [Collective buffers gloo frees late] in
    _late_buffers.py: CPU jobs of several ranks) price whole segments: where a late buffer
    lands moves from step to step, and one CI run of a 2-rank GPT-2 plan file's job with
    sub-segments went 1.5 % over its target (not reproduced in 7 runs here); a whole
    segment's base absorbs that, a sub-segment's is not shown to.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

from ._block_problem import _Option

__all__: list[str] = []


def _above(options: list[_Option], problem: Any, measured: frozenset) -> tuple[list[_Option], list[int]]:
    """``options`` of one block priced from a measured saved set (Note [A correction adds
    to what was measured]): each option's ``dk`` becomes ``held(o | measured) -
    held(measured)`` (never below 0); sorted by it, as :func:`_solve` needs, with each
    one's index in ``options``."""
    held = problem.evaluate(measured)[0]
    priced = sorted((max(0, problem.evaluate(o.saved | measured)[0] - held), i) for i, o in enumerate(options))
    return [dataclasses.replace(options[i], dk=dk) for dk, i in priced], [i for _, i in priced]

_GRID = 4096  # the DP merges prefix sums within target / _GRID of each other (Note [The DP checks exact bytes])


def block_of(segment: str) -> int:
    """The block index of a segment name (``fwd:k``, ``bwd:k``, ``bwd:k/i``)."""
    return int(segment.split(":")[1].split("/")[0])


def _sub_caps(bases: dict[str, int], k: int, target: int) -> list[tuple[int, int]]:
    """(i - 1, target - base) of block k's sub-segments ``bwd:k/i`` in ``bases``."""
    head = f"bwd:{k}/"
    return [(int(s[len(head):]) - 1, target - b) for s, b in bases.items() if s.startswith(head)]


def _solve(options: list[list[_Option]], bases: dict[str, int], target: int) -> tuple[int, ...] | None:
    """One option per block, least summed cost, every segment's prediction
    ``base_s + sum(dk_j, j <= k)`` <= ``target`` (Note [The peak model]; at block k's
    sub-segments with its option's ``at`` price: Note [A block's backward, replay by
    replay]); ``None`` if even the options with the fewest bytes do not fit."""
    n = len(options)
    caps = []
    for k in range(n):
        here = [bases[s] for s in (f"fwd:{k}", f"bwd:{k}") if s in bases]
        caps.append(target - max(here) if here else math.inf)
    # Note [The DP checks exact bytes]
    q = max(1, math.ceil(max(target, 1) / _GRID))
    # state: prefix sum // q -> (cost, flops, choices as a linked list, exact prefix sum)
    states: dict[int, tuple[float, int, Any, int]] = {0: (0.0, 0, None, 0)}
    for k, opts in enumerate(options):
        cap = caps[k]
        subs = _sub_caps(bases, k, target)
        nxt: dict[int, tuple[float, int, Any, int]] = {}
        low: tuple[float, int, Any, int] | None = None  # the smallest sum (Note [The DP checks exact bytes])
        for cost, flops, back, s in states.values():
            for i, o in enumerate(opts):
                s2 = s + o.dk
                if s2 > cap:
                    break  # options are sorted by dk
                if subs and any(s + (o.at[j] if j < len(o.at) else o.dk) > c for j, c in subs):
                    continue
                key = s2 // q
                cand = (cost + o.seconds, flops + o.flops, (i, back), s2)
                if low is None or (s2, cand[0]) < (low[3], low[0]):
                    low = cand
                cur = nxt.get(key)
                if cur is None or (cand[0], cand[1], s2) < (cur[0], cur[1], cur[3]):
                    nxt[key] = cand
        if not nxt:
            return None
        # Keep the Pareto states: a larger sum only if cheaper (a smaller sum meets
        # every later constraint that a larger one meets).
        states = {}
        best = math.inf
        for key in sorted(nxt):
            c = nxt[key]
            if c[0] < best - 1e-15:
                states[key] = c
                best = c[0]
        if low is not None and low[3] < min(c[3] for c in states.values()):
            states[-1] = low
    _, _, back, _ = min(states.values(), key=lambda c: (c[0], c[1], c[3]))
    picked = []
    while back is not None:
        picked.append(back[0])
        back = back[1]
    return tuple(reversed(picked))


def _at(options: list[_Option], problem: Any, measured: frozenset, made: list[frozenset[int]]) -> list[_Option]:
    """``options`` (priced by :func:`_above`) with their ``at`` prices at the block's
    sub-segments, whose replays had made ``made`` (the ops' call indices):
    Note [A block's backward, replay by replay]."""
    if not made:
        return options
    seq_of = {r.call: r.seq for r in problem.records.values() if r.call is not None}
    held = problem.evaluate(measured)[0]
    cache: dict[frozenset, int] = {}

    def price(extra: frozenset) -> int:
        if extra not in cache:
            cache[extra] = max(0, problem.evaluate(measured | extra)[0] - held)
        return cache[extra]

    made = [frozenset(seq_of[c] for c in m if c in seq_of) for m in made]
    return [dataclasses.replace(o, at=tuple(min(o.dk, price(o.saved - m)) for m in made)) for o in options]


def _solve_from(options: list[list[_Option]], problems: list[Any], measured: tuple[int, ...] | None,
                peaks: dict[str, int], target: int, margin: int = 0,
                made: dict[int, list[frozenset[int]]] | None = None) -> tuple[tuple[int, ...], dict[str, int]]:
    """A corrected plan (Note [A correction adds to what was measured]): the cheapest choice
    whose prediction from the measured plan ``measured`` (an option index per block; None:
    the floor) and its step's segment ``peaks`` fits ``target``, or ``measured`` itself if
    none does; and the bases that prediction implies for the model of :func:`_solve`.
    A choice that replays an op the measured plan did not replay fits ``target - margin``
    only (Note [A climb that replays nothing new]). ``made``: per block, what its replays
    had made at each of its sub-segments in ``peaks`` (Note [A block's backward, replay
    by replay])."""
    choice, mine = corrected(options, problems, tuple(measured or [0] * len(options)), peaks, target, margin,
                             _solve, made)
    extra = [o.dk - opts[i].dk for o, opts, i in zip(mine, options, choice)]
    bases = {}
    for s, base in peaks.items():
        k = block_of(s)
        own = mine[k].dk
        if "/" in s:  # its sub-segment's price (Note [A block's backward, replay by replay])
            j = int(s.split("/")[1]) - 1
            own = mine[k].at[j] if j < len(mine[k].at) else own
        bases[s] = base + sum(extra[:k]) + own - options[k][choice[k]].dk
    return choice, bases


def corrected(options: list[list[_Option]], problems: list[Any], measured: tuple[int, ...], peaks: dict[str, int],
              target: int, margin: int, solve: Any,
              made: dict[int, list[frozenset[int]]] | None = None) -> tuple[tuple[int, ...], list[_Option]]:
    """The choice of Note [A correction adds to what was measured] from the measured plan
    ``measured`` and its step's ``peaks``, solved by ``solve(options, bases, cap)`` (a
    peak model's solver): each option priced above the measured saved set (at block k's
    sub-segments with ``made[k]``: Note [A block's backward, replay by replay]); a choice
    that replays an op the measured plan did not fits ``target - margin`` only (Note [A
    climb that replays nothing new]). Returns it (``measured`` if none fits) and each
    block's chosen option as priced."""
    priced, back, fresh = [], [], []
    for k, (opts, problem, i) in enumerate(zip(options, problems, measured)):
        p, b = _above(opts, problem, opts[i].saved)
        subs = len([s for s in peaks if s.startswith(f"bwd:{k}/")])
        p = _at(p, problem, opts[i].saved, (made or {}).get(k, [])[:subs])
        priced.append(p)
        back.append(b)
        replayed = problem.evaluate(opts[i].saved)[2]
        fresh.append([k for k, j in enumerate(b) if problem.evaluate(opts[j].saved)[2] <= replayed])
    picked = solve(priced, peaks, target - margin)
    if margin:
        within = solve([[p[k] for k in ks] for p, ks in zip(priced, fresh)], peaks, target)
        if within is not None:
            within = tuple(ks[k] for ks, k in zip(fresh, within))
            if picked is None or _cost(priced, within) < _cost(priced, picked):
                picked = within
    choice = measured if picked is None else tuple(b[i] for b, i in zip(back, picked))
    return choice, [p[b.index(i)] for p, b, i in zip(priced, back, choice)]


def fingerprint(made: dict[int, list[frozenset[int]]]) -> int:
    """A number every rank computes alike from the same sub-segments and made values
    (Note [A block's backward, replay by replay]): 0 for none."""
    if not any(made.values()):
        return 0
    text = repr(sorted((k, [sorted(m) for m in ms]) for k, ms in made.items()))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big") + 1


def _cost(options: list[list[_Option]], choice: tuple[int, ...]) -> tuple[float, int]:
    return sum(o[i].seconds for o, i in zip(options, choice)), sum(o[i].flops for o, i in zip(options, choice))
