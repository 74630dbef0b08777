"""Running the prefetches a unit's backward asks for (Note [Prefetching the next unit's
replay] in replay.py), within a byte budget when they replay on a side stream.

Note [A prefetch holds one unit's values ahead]
    On a side stream a prefetch's replays allocate from the side stream's own allocator
    pool (Note [What side streams cost] in _streams.py): a block the compute stream
    freed never serves it, and a block it freed serves nothing else. Prefetching unit
    i-1 whole when unit i's backward starts put both units' recomputed values in that
    pool at once: two blocks' replays reserved beside the compute stream's pool, whose
    cache from forward is what torch's checkpoint recomputes one block into.

    So a prefetch on a side stream runs under a byte budget. What counts, per unit
    whose prefetch has started and not been used up: its recomputed values alive
    (parked, or cached for a replay still to come: the graph's ``stats.cached_bytes``;
    a parked saved value is not counted) and its FSDP units' unsharded parameters while
    they are gathered or being gathered (they live until FSDP reshards the unit after
    its backward, past the last use of its values). The budget while unit j is
    prefetched, for ``depth`` units ahead: ``depth`` times unit j's values and
    parameters plus the running unit's parameters, unit j's figures being what its
    prefetch held when it last ran to the end, kept by the unit (its module's wrapper)
    from one backward to the next; in its first backward, the largest figures another
    unit's prefetch set in the same backward; with neither (a backward's first prefetch,
    the first time), it is prefetched whole and sets them. A step of a prefetch starts while the count is under the budget,
    or while all of it is the prefetched unit's own (a unit alone holds no more than
    its figure). At the budget the prefetch stops; each unpack of a parked value lets
    it go on (``Graph.pump``): autograd drops the values unit i's backward has used,
    their blocks go back to the side pool, and the next few handles of unit i-1 are
    realized into them. Handles go in pack order, so a step replays the few ops up to
    its value (in reverse pack order the first step replayed nearly the whole chain).
    What the prefetch has not reached when unit i-1's own backward begins is dropped
    from it and replayed when unpacked, on the compute stream and from its pool (Note
    [Nothing waits behind another unit] in replay.py). A unit prefetched two levels
    ahead and then one is started once.

    Not paced: the running unit's own replay when nobody prefetched it (the first unit
    of a backward replays inline, from the compute stream's pool): the first prefetch
    of a backward can go whole beside it, so the device's peak may still hold two
    units' recomputed values there, as without pacing.

    Measured on the simulated H100 timeline (launch/bench_overlap.py, 8 Llama blocks of
    1024 under FSDP2, prefetch 1): peak reserved 1800 MiB unpaced, 1676 paced (torch's
    checkpoint: 1290); replay time hidden with streams in parallel 88 % and 86.5 %.
    Budgets without the second unit's parameters kept more memory back (1622 MiB) but
    left the tail of each prefetch to the compute stream (71 % hidden).

    The points where a paced prefetch replays depend on byte counts, so it issues no
    collective as it goes: the all-gathers of every FSDP unit its graph reads are issued
    when the prefetch starts (``Graph.unshard_ahead``, ``FSDPModule.unshard(async_op=True)``
    on the side stream), where the whole prefetch used to run -- the same point on every
    rank (Note [Deterministic prefetch order] in _trace/_graph_backward.py). The first
    replay that reads a unit's parameter waits for its all-gather and copies the
    parameters out (Note [Replays unshard what they read] in fsdp.py), so the unsharded
    parameters are allocated when the pacing gets there. A unit FSDP has resharded since
    the prefetch started (a module shared by several units) stops the prefetch instead of
    being gathered again.

    An inline executor (CPU, ``stream="inline"``) prefetches whole: one stream, one pool,
    nothing to gain from pacing.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from .fsdp import is_gathered_or_gathering, unsharded_params

__all__ = ["prefetcher"]


class _Prefetcher:
    """One thread's prefetches (backward runs a device's units on one thread)."""

    def __init__(self) -> None:
        self.graphs: list[weakref.ref] = []  # graphs prefetched under the budget, oldest first
        # What one unit's prefetch held when it last ran to the end, by the unit (its
        # module's wrapper, which outlives the step's graphs): recomputed values, gathered
        # parameters. A unit without a figure is prefetched whole (and sets one).
        self.figures: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.this_backward: tuple[int, int] | None = None  # the largest figures set in this backward
        self.depth = 1
        self.task: int | None = None  # the backward these graphs belong to
        self._pump = self.run
        self._stopped: weakref.WeakSet = weakref.WeakSet()  # prefetches room() stopped: no figures from them

    def begin(self, graph: Any) -> None:
        """``graph``'s unit starts its backward: its own prefetch stops here."""
        task = torch._C._current_graph_task_id()
        if task != self.task:  # another backward: what an earlier one left parked does not count
            self.task = task
            self.graphs = []
            self.this_backward = None
        if graph.prefetch_todo:
            graph.cancel_prefetch()
            _log(graph, "prefetch_end")  # stopped: the rest is replayed when unpacked

    def start(self, graph: Any, depth: int) -> None:
        """Prefetch ``graph`` (a unit ``depth`` or fewer ahead of the running one). Logs
        ``prefetch_start`` now and ``prefetch_end`` when it has run to the end (or its
        unit's backward stopped it). A unit already prefetched in this backward (two
        levels ahead, then one) is left to go on."""
        if not graph.executor.paced_prefetch:
            _log(graph, "prefetch_start")
            graph.prefetch()
            _log(graph, "prefetch_end")
            return
        if any(ref() is graph for ref in self.graphs):
            return
        _log(graph, "prefetch_start")
        self.depth = depth
        graph.unshard_ahead()
        graph.pump = self._pump
        self.graphs.append(weakref.ref(graph))
        paced = self._figure(graph) is not None
        graph.prefetch((lambda: self.room(graph)) if paced else None)
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
        """Whether the prefetched units leave room for one more step of ``graph``'s
        prefetch: what they hold is under ``graph``'s budget, or is all ``graph``'s own
        (one unit never holds more than its figure). A unit whose parameters FSDP has
        resharded since the prefetch started (a module shared by several units) stops the
        prefetch: gathering them again here would be a collective at a point that
        depends on byte counts."""
        if not all(is_gathered_or_gathering(m) for r in graph.fsdp_units if (m := r()) is not None):
            graph.cancel_prefetch()  # the rest is replayed when unpacked, in autograd's order
            self._stopped.add(graph)
            _log(graph, "prefetch_end")
            return False
        held = others = 0
        live = []
        for ref in self.graphs:
            g = ref()
            if g is None:
                continue
            n = g.stats.cached_bytes + _gathered_bytes(g)
            if n <= 0 and not g.prefetch_todo:
                continue  # consumed and resharded: nothing of it counts any more
            held += n
            if g is not graph:
                others += n
            live.append(ref)
        self.graphs = live
        return others <= 0 or held < self.budget(graph)

    def budget(self, graph: Any) -> int:
        """What the prefetched units and the running one may hold while ``graph`` is
        prefetched: ``depth`` units' values and parameters, and the running unit's
        parameters, gathered until its backward ends (Note [A prefetch holds one unit's
        values ahead]), one unit's being ``graph``'s figure."""
        fig = self._figure(graph)
        if fig is None:
            return 1 << 62
        values, params = fig
        return self.depth * (values + params) + params

    def _figure(self, graph: Any) -> tuple[int, int] | None:
        key = graph.unit_key
        fig = self.figures.get(key) if key is not None else None
        return fig if fig is not None else self.this_backward

    def _ran(self, graph: Any) -> None:
        if not graph.prefetch_todo and graph not in self._stopped:  # ran to the end, before its unit's backward
            fig = (graph.stats.cached_bytes, _gathered_bytes(graph))
            if graph.unit_key is not None:
                self.figures[graph.unit_key] = fig
            if self.this_backward is None or sum(fig) > sum(self.this_backward):
                self.this_backward = fig
            _log(graph, "prefetch_end")


def _gathered_bytes(graph: Any) -> int:
    """Bytes of the unsharded parameters of ``graph``'s FSDP units that are gathered, or
    whose all-gather the prefetch has issued (the first replay reading one copies them
    all out at once): they live until FSDP reshards the unit after its backward, past
    the last use of the values parked for them."""
    total = 0
    for ref in graph.fsdp_units:
        module = ref()
        if module is not None and is_gathered_or_gathering(module):
            total += sum(p.numel() * p.element_size() for p in unsharded_params(module))
    return total


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
