"""Running the prefetches a unit's backward asks for (Note [Prefetching the next unit's
replay] in replay.py), within a byte budget when they replay on a side stream.

Note [A prefetch holds one unit's values ahead]
    On a side stream a prefetch's replays allocate from the side stream's own allocator
    pool (Note [What side streams cost] in _streams.py): a block the compute stream
    freed never serves it, and a block it freed serves nothing else. Prefetching unit
    i-1 whole when unit i's backward starts put both units' recomputed values in that
    pool at once: two blocks' replays reserved beside the compute stream's pool, whose
    cache from forward is what torch's checkpoint recomputes one block into.

    So a prefetch on a side stream runs under a byte budget: the recomputed values
    alive for prefetched units -- parked, or cached for a replay still to come (each
    graph's ``stats.cached_bytes``), the unit whose backward is running included --
    are kept to ``depth`` times the most one unit's prefetch has held at once (its
    graph's ``peak_cached_bytes`` when it has run to the end): a step of a prefetch
    starts while they are under that, or while they are all its own unit's (a unit
    alone never holds more than the figure). Each backward's first prefetch runs whole
    and sets the figure (later ones may raise it). At the budget the prefetch stops;
    each unpack of a parked value lets it go on (``Graph.pump``): autograd drops the
    values unit i's backward has used, their blocks go back to the side pool, and the
    next few handles of unit i-1 are realized into them. Handles go in pack order, so a
    step replays the few ops up to its value (in reverse pack order the first step
    replayed nearly the whole chain). What the prefetch has not reached when unit i-1's
    own backward begins is dropped from it and replayed when unpacked, on the compute
    stream and from its pool (Note [Nothing waits behind another unit] in replay.py).

    The points where a paced prefetch replays depend on byte counts, so it issues no
    collective as it goes: the all-gathers of every FSDP unit its graph reads are issued
    when the prefetch starts (``Graph.unshard_ahead``, ``FSDPModule.unshard(async_op=True)``
    on the side stream), where the whole prefetch used to run -- the same point on every
    rank (Note [Deterministic prefetch order] in _trace/_graph_backward.py). The first
    replay that reads a unit's parameter waits for its all-gather and copies the
    parameters out (Note [Replays unshard what they read] in fsdp.py), so the unsharded
    parameters are allocated when the pacing gets there.

    An inline executor (CPU, ``stream="inline"``) prefetches whole: one stream, one pool,
    nothing to gain from pacing.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

__all__ = ["prefetcher"]


class _Prefetcher:
    """One thread's prefetches (backward runs a device's units on one thread)."""

    def __init__(self) -> None:
        self.graphs: list[weakref.ref] = []  # graphs prefetched under the budget, oldest first
        self.unit_bytes = 0  # the most one unit's prefetch held, in this backward
        self.depth = 1
        self.task: int | None = None  # the backward these graphs belong to
        self._pump = self.run

    def begin(self, graph: Any) -> None:
        """``graph``'s unit starts its backward: its own prefetch stops here."""
        task = torch._C._current_graph_task_id()
        if task != self.task:  # another backward: what an earlier one left parked does not count
            self.task = task
            self.graphs = []
            self.unit_bytes = 0
        if graph.prefetch_todo:
            graph.cancel_prefetch()
            _log(graph, "prefetch_end")  # stopped: the rest is replayed when unpacked

    def start(self, graph: Any, depth: int) -> None:
        """Prefetch ``graph`` (a unit ``depth`` or fewer ahead of the running one). Logs
        ``prefetch_start`` now and ``prefetch_end`` when it has run to the end (or its
        unit's backward stopped it)."""
        _log(graph, "prefetch_start")
        if not graph.executor.paced_prefetch:
            graph.prefetch()
            _log(graph, "prefetch_end")
            return
        self.depth = depth
        graph.unshard_ahead()
        graph.pump = self._pump
        self.graphs.append(weakref.ref(graph))
        graph.prefetch((lambda: self.room(graph)) if self.unit_bytes else None)
        self._ran(graph)

    def run(self) -> None:
        """Go on with the prefetches the budget stopped, oldest first."""
        for ref in list(self.graphs):
            g = ref()
            if g is not None and g.prefetch_todo:
                g.prefetch_more(lambda g=g: self.room(g))
                self._ran(g)
                if g.prefetch_todo:
                    return  # out of room: a younger prefetch waits for this one

    def room(self, graph: Any) -> bool:
        """Whether the prefetched units' recomputed values leave room for one more step of
        ``graph``'s prefetch: under the budget, or ``graph``'s own values are all there
        is (one unit never holds more than the figure a unit's prefetch set)."""
        held = others = 0
        live = []
        for ref in self.graphs:
            g = ref()
            if g is None:
                continue
            n = g.stats.cached_bytes
            if n <= 0 and not g.prefetch_todo:
                continue  # consumed: nothing of it counts any more
            held += n
            if g is not graph:
                others += n
            live.append(ref)
        self.graphs = live
        return others <= 0 or held < self.depth * self.unit_bytes

    def _ran(self, graph: Any) -> None:
        if not graph.prefetch_todo:  # ran to the end, before its unit's backward began
            self.unit_bytes = max(self.unit_bytes, graph.stats.peak_cached_bytes)
            _log(graph, "prefetch_end")


def _log(graph: Any, event: str) -> None:
    if graph.log is not None:
        graph.log(event, graph.fqn)


class _Local(threading.local):
    def __init__(self) -> None:
        self.prefetcher = _Prefetcher()


_LOCAL = _Local()  # per thread: the prefetcher of the backward this thread runs


def prefetcher() -> _Prefetcher:
    """This thread's prefetcher."""
    return _LOCAL.prefetcher
