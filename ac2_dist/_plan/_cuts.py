"""Min-cut placements: the saved sets a block problem proposes beside its greedy ones.

Note [Saved sets as cuts]
    A block's recorded ops form a DAG from the region's inputs (free: the region keeps
    them) to the values backward reads (the problem's targets). A saved set S is valid
    when every target is saved or recomputable from saved values and region inputs, so
    S is a *cut* between the two. With the ops that must not be recomputed (``banned``)
    pinned to the forward side, the cut of fewest bytes is a minimum s-t cut of the
    node-split graph the min-cut partitioner of ``torch.compile`` solves:

    - every op ``v`` is two nodes ``v.in -> v.out``, of capacity its output bytes when a
      plan may save it (a candidate), infinite otherwise (views, outputs written in
      place later, ops no plan decides);
    - ``m.out -> v.in`` (infinite) for every recorded input ``m`` of ``v``: replaying
      ``v`` needs its inputs;
    - ``source -> v.in`` (infinite) for a banned op and for an op the graph must save
      (collectives, random ops: the problem's ``forced``): they run in forward only;
    - ``v.out -> sink`` (infinite) for every target.

    A cut edge ``v.in -> v.out`` is a saved output; everything on the sink side is
    replayed in backward. Region inputs are not nodes: backward has them for free, so an
    op that reads only region inputs (or nothing, a factory op) can always be replayed,
    and without a banned op the cut is empty (the floor). So the cut saves the inputs of a cheap chain instead of its
    outputs where those are fewer bytes, and of two tensors that carry the same
    information (a value and its cast or copy) the smaller. Each cut is then priced
    exactly by the problem's own evaluation (bytes held, recompute cost), as every other
    proposal is: the cut only proposes.

    The proposals (:func:`cut_sets`): for every cost level ``c`` of the block's
    recomputed ops, the cut that recomputes only ops cheaper than ``c``; for every FLOP
    level, the cut that recomputes no op with that many FLOPs or more (the partitioner's
    "ban the compute-intensive ops", at every threshold a block has: at the lowest,
    every matmul and attention op stays in forward and only memory-bound ops replay);
    and for each of the costliest ops the cut that bans it alone. Max flow is Dinic's
    algorithm on integer capacities: a block of ``n`` ops is ``2n + 2`` nodes, and the
    proposals cost ``O(levels)`` flows, computed once per block structure.
"""

from __future__ import annotations

from collections import deque
from typing import Any

__all__: list[str] = []

_MAX_LEVELS = 48  # cost thresholds tried per block (evenly picked among its distinct costs)
_SINGLES = 16  # the costliest ops, each banned alone


class _Flow:
    """A flow network on integer capacities (Dinic's algorithm)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.head: list[list[int]] = [[] for _ in range(n)]
        self.to: list[int] = []
        self.cap: list[int] = []

    def add(self, u: int, v: int, cap: int) -> None:
        self.head[u].append(len(self.to))
        self.to.append(v)
        self.cap.append(cap)
        self.head[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0)

    def _levels(self, s: int, t: int) -> list[int] | None:
        level = [-1] * self.n
        level[s] = 0
        queue = deque([s])
        to, cap, head = self.to, self.cap, self.head
        while queue:
            u = queue.popleft()
            for e in head[u]:
                if cap[e] > 0 and level[to[e]] < 0:
                    level[to[e]] = level[u] + 1
                    queue.append(to[e])
        return level if level[t] >= 0 else None

    def _push(self, s: int, t: int, level: list[int], it: list[int], limit: int) -> int:
        """One augmenting path in the level graph, iteratively (no recursion limit)."""
        to, cap, head = self.to, self.cap, self.head
        path: list[int] = []  # edges
        u = s
        while True:
            if u == t:
                f = min(cap[e] for e in path) if path else limit
                f = min(f, limit)
                for e in path:
                    cap[e] -= f
                    cap[e ^ 1] += f
                return f
            advanced = False
            while it[u] < len(head[u]):
                e = head[u][it[u]]
                v = to[e]
                if cap[e] > 0 and level[v] == level[u] + 1:
                    path.append(e)
                    u = v
                    advanced = True
                    break
                it[u] += 1
            if not advanced:
                if not path:
                    return 0
                level[u] = -1  # a dead end: no path through it in this phase
                e = path.pop()
                u = to[e ^ 1]
                it[u] += 1

    def source_side(self, s: int, t: int, infinite: int) -> list[bool] | None:
        """Run max flow; the nodes reachable from ``s`` in the residual graph, or None if
        the flow is infinite (no finite cut exists)."""
        total = 0
        while True:
            level = self._levels(s, t)
            if level is None:
                break
            it = [0] * self.n
            while True:
                f = self._push(s, t, level, it, infinite)
                if f == 0:
                    break
                total += f
                if total >= infinite:
                    return None
        seen = [False] * self.n
        seen[s] = True
        queue = deque([s])
        while queue:
            u = queue.popleft()
            for e in self.head[u]:
                if self.cap[e] > 0 and not seen[self.to[e]]:
                    seen[self.to[e]] = True
                    queue.append(self.to[e])
        return seen


def min_cut(problem: Any, banned: set[int], savable: set[int]) -> frozenset[int] | None:
    """The saved set of fewest bytes that recomputes no op in ``banned`` (Note [Saved
    sets as cuts]), among outputs in ``savable``; None when no such set exists."""
    records = problem.records
    order = problem.order
    index = {seq: i for i, seq in enumerate(order)}
    n = len(order)
    s, t = 2 * n, 2 * n + 1
    infinite = 1 + 2 * sum(records[q].nbytes for q in savable) + 1
    flow = _Flow(2 * n + 2)
    pinned = banned | problem.forced
    for i, seq in enumerate(order):
        r = records[seq]
        # a value the graph saves anyway costs the cut nothing (it is held either way)
        flow.add(2 * i, 2 * i + 1, 0 if seq in problem.forced else r.nbytes if seq in savable else infinite)
        ins = [m for m in r.inputs if m in index]
        for m in ins:
            flow.add(2 * index[m] + 1, 2 * i, infinite)
        if seq in pinned:
            flow.add(s, 2 * i, infinite)
        if seq in problem.targets:
            flow.add(2 * i + 1, t, infinite)
    side = flow.source_side(s, t, infinite)
    if side is None:
        return None
    return frozenset(seq for i, seq in enumerate(order)
                     if side[2 * i] and not side[2 * i + 1] and seq not in problem.forced)


def cut_sets(problem: Any) -> list[frozenset[int]]:
    """Saved sets from minimum cuts at every cost threshold of the block, and with each
    of its costliest ops banned alone (Note [Saved sets as cuts])."""
    savable = set(problem.cuttable)
    recomputed = problem.evaluate(frozenset())[2]
    costly = sorted((s for s in recomputed if problem.records[s].seconds > 0),
                    key=lambda s: -problem.records[s].seconds)
    if not costly:
        return []
    levels = sorted({problem.records[s].seconds for s in costly}, reverse=True)
    if len(levels) > _MAX_LEVELS:
        step = len(levels) / _MAX_LEVELS
        levels = [levels[int(k * step)] for k in range(_MAX_LEVELS)] + [levels[-1]]
    out: list[frozenset[int]] = []
    seen: set[frozenset[int]] = set()

    def propose(banned: set[int]) -> None:
        cut = min_cut(problem, banned, savable)
        if cut is not None and cut not in seen:
            seen.add(cut)
            out.append(cut)

    for c in levels:
        propose({q for q in costly if problem.records[q].seconds >= c})
    # the partitioner's own family: only ops that do arithmetic (matmuls, attention) banned,
    # the FLOP-heaviest first
    flops = sorted({problem.records[q].flops for q in costly if problem.records[q].flops > 0}, reverse=True)
    for f in flops[:_MAX_LEVELS]:
        propose({q for q in costly if problem.records[q].flops >= f})
    for q in costly[:_SINGLES]:
        propose({q})
    return out
