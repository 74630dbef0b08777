"""Replaying recorded ops in backward: the half of :class:`~ac2_dist._trace._graph.Graph` that
computes the node outputs backward asks for from the nearest saved values.

:class:`Replayer` is ``Graph``'s base class. It runs what is missing in program order
through the normal path (taking pending uses: Note [Use counts free recomputed values
as soon as consumed]), fills cut nodes from private replays (Note [Nested modules cut
the replay]), brings RNG chains to the state before a random op (Note [One generator
state per region]), replays writes into fresh values (Note [Replaying writes to fresh
tensors], Note [Writes through views of fresh tensors]) and caches the outputs
consumers wait for. The Notes are in ``_graph.py``, except the one below, the rule of
the replays that take no pending use; the use counts, saved values, executor,
statistics and chains it works on are the graph's.

Note [A private replay holds what it reads]
    Two kinds of reader share a graph's values in backward. The normal path (an
    unpack, a prefetch and the replays they schedule) holds pending uses: ``arm``
    counted each of its reads and ``take`` drops a cached value at the last one
    (Note [Use counts free recomputed values as soon as consumed]). A private replay
    -- a cut node's fill (Note [Nested modules cut the replay]) or an RNG chain's
    advance past an op backward does not need (Note [One generator state per
    region]) -- holds none: whether it runs, and how often, depends on the order in
    which consumers arrive, which autograd, a prefetch or a retained backward
    decides, so nothing armed its reads. Pending uses therefore say nothing about
    what it will read, and a value it found in the graph can be gone when it reads
    it: another consumer's ``take`` dropped it (a normal-path replay run by an RNG
    advance inside it), or it is a cut node filled when no pending consumer was
    left, which ``_keep`` does not cache at all. The prefetch walk in pack order did
    the latter to nested modules: the layers' handles took a layer output to zero
    uses, then the next layer's private fill read it ("Expected a proper Tensor but
    got None").

    The rule: a private replay owns its reads. When it plans (``_missing``) it takes
    a reference to each cached value of the graph it will read; it reads a saved
    value at its first use (no saved value is dropped while a private replay may
    still run: Note [Saved values die at their last use]); it keeps what the nodes
    it runs and the cut nodes it fills return, whether the graph caches them too or
    not; and it drops each reference after its own last read of it. It never goes
    back to the graph for a value, so it is correct in any order of consumers and
    still holds only its live frontier. (A graph with nested checkpointed modules is
    not prefetched, so a prefetch never runs private replays: it walks handles in pack
    order, which its pacing needs: Note [A prefetch holds one unit's values ahead] in
    _prefetch.py.)
"""

from __future__ import annotations

import operator
from array import array
from typing import TYPE_CHECKING, Any

import torch

from ..side_effects import _INFO
from ._graph_stats import GraphStats
from ._nodes import flatten_outputs, producers, tensor_nbytes

if TYPE_CHECKING:
    from ._nodes import Node, RngChain


_node_seq = operator.attrgetter("seq")  # a sort key without a Python call per node
_Tensor = torch.Tensor


def _owns_storage(v: torch.Tensor) -> bool:
    """No tensor but ``v`` is on ``v``'s storage (the temporary storage object this
    asks through counts one more).

    Note [A replayed write owns its storage]
        A replayed write (Note [Replaying writes to fresh tensors], Note [Writes through
        views of fresh tensors] in _graph.py) writes into the value its producer's
        replay made. That is exact only if nothing else still needs the bytes from
        before the write: no pending use of the value itself (``shared``), no value
        parked for a handle by a prefetch that is this very tensor, and no other live
        tensor on its storage -- a view of it cached for a consumer that has not run
        yet, parked by a prefetch, or held by the autograd node whose saved tensors are
        being unpacked. The last is read from the storage's use count. Otherwise the
        replay writes into a copy (a clone keeps a dense value's strides, so views
        re-made from it by ``as_strided`` read what they read in forward: Note [Writes
        inside a region] in _writes.py). The written input is taken after the op's
        other inputs, so an argument that reads the value before the write does not
        count as a second user of it. A view the write itself builds from the value
        comes after the check.
    """
    try:
        return torch._C._storage_Use_Count(v.untyped_storage()._cdata) <= 2
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):  # no storage: assume shared
        return False


class Replayer:
    """Base class of :class:`~ac2_dist._trace._graph.Graph`: the replay of recorded ops (see
    the module docstring). Its methods read the graph's state below and call the
    graph's ``take``, ``arm`` and ``_saved_value``."""

    uses: array  # pending uses per node output (Note [Use counts live in one array])
    stats: GraphStats
    _parked: dict[int, tuple[int, bool]]  # id(prefetched value) -> (handles holding it, replayed)
    executor: Any  # runs one node (ac2_dist.replay: inline, side stream)
    tracker: Any  # an active ac2_dist.memory.Tracker, if any
    on_replay: Any  # called as on_replay(graph, nodes) after a replay, if set
    rng_chains: list[RngChain]

    def realize(self, node: Node, idx: int) -> Any:
        """Value of ``node[idx]``, replaying what is missing from the nearest saved values."""
        if not node.has_value(idx):
            self._replay(node)
        return self.take(node, idx)

    def _replay(self, node: Node) -> None:
        """Compute ``node``'s outputs through the normal (pending-use) path: replay what is
        missing in program order, filling cut nodes from their private replays."""
        if node.cut:
            self._fill_cut(node)
            return
        # Note [The plain replay path]
        #     Replaying costs Python per op, and most replayed nodes are plain: no output
        #     saved, scheduled (so not cut: ``arm`` never schedules a cut node and
        #     ``Graph.cut`` unschedules one), no list argument, nothing written in place
        #     (``same``/``rebuilt`` arguments come with a write), no scratch or shape-only
        #     (``like``) argument, no RNG chain. Those run in this loop's frame, doing what
        #     ``_run`` (``_execute`` + ``_keep``) does for them with ``take`` inlined for
        #     recomputed inputs (a saved input still goes through ``take``), the op called
        #     as the executor's ``run`` would call it (``calls_ops_directly``: the tracer's
        #     ``OpInfo.call``) and the op and byte counts added once at the end. Any other
        #     node goes through ``_run``. A node of an ``OpInfo.plain`` op skips the
        #     checks of the rare fields (Note [Rare node fields live in a lazy dict] in
        #     _nodes.py): the tracer sets them only for list arguments, accumulators,
        #     writes and random draws, and an op with any of those is not plain. Values,
        #     use counts, freeing at the last use and statistics come out as ``_run``
        #     makes them (test_replay_paths.py compares the two paths): a change to what
        #     ``take``, ``_execute`` or ``_keep`` do is a change here too.
        uses, stats, run, take = self.uses, self.stats, self.executor.run, self.take
        direct, infos = self.executor.calls_ops_directly, _INFO
        tracked = self.tracker is not None
        ops = allocated = 0
        todo = self._missing(node)
        try:
            for n in todo:
                op = n.op
                info = infos.get(id(op))
                if (n.saved is not None or not n.scheduled or info is None
                        or not info.plain and (n.lists or n.writes or n.scratch or n.like or n.rng is not None)):
                    if n.cut:
                        self._fill_cut(n)
                    else:
                        self._run(n)
                    continue
                n.scheduled = False
                args = list(n.args)
                kwargs = dict(n.kwargs) if n.kwargs else {}
                inp = n.inputs
                k, end = 0, len(inp)
                while k < end:  # cheaper than range() for the one or two inputs most ops have
                    m = inp[k + 1]
                    j = inp[k + 2]
                    saved = m.saved
                    if saved is None or saved[j] is None:  # take(m, j) for a recomputed value
                        u = m.seq + j
                        left = uses[u] - 1
                        values = m.values
                        v = values[j]
                        if left > 0:
                            uses[u] = left
                        else:  # its last use: dropped
                            uses[u] = 0
                            values[j] = None
                            if isinstance(v, _Tensor):
                                try:  # tensor_nbytes(v), inlined
                                    stats.cached_bytes -= v.numel() * v.element_size()
                                except Exception:
                                    pass
                            if values.count(None) == len(values):
                                m.values = None
                    else:
                        v = take(m, j)
                    pos = inp[k]
                    k += 3
                    if type(pos) is int:
                        args[pos] = v
                    else:
                        kwargs[pos] = v
                if not direct or info.guarded and op._op is not info.call:
                    out = run(n, args, kwargs)
                else:
                    out = info.call(*args, **kwargs)
                ops += 1
                if isinstance(out, _Tensor):  # one output
                    try:  # tensor_nbytes(out), inlined
                        made = out.numel() * out.element_size()
                    except Exception:
                        made = 0
                    if uses[n.seq] > 0:
                        cached = made
                        flat = [out]
                    else:
                        cached = 0
                        flat = [None]
                    if out._is_view():  # views allocate nothing
                        made = 0
                else:
                    flat = flatten_outputs(out)
                    made = cached = 0
                    seq = n.seq
                    for i, v in enumerate(flat):
                        if isinstance(v, _Tensor):
                            try:  # tensor_nbytes(v), inlined
                                nbytes = v.numel() * v.element_size()
                            except Exception:
                                nbytes = 0
                            if not v._is_view():
                                made += nbytes
                            if uses[seq + i] > 0:
                                cached += nbytes
                                continue
                        flat[i] = None
                allocated += made
                if tracked:
                    by_module = stats.recomputed_by_module
                    by_module[n.fqn] = by_module.get(n.fqn, 0) + made
                if cached:
                    stats.cached_bytes += cached
                    if stats.cached_bytes > stats.peak_cached_bytes:
                        stats.peak_cached_bytes = stats.cached_bytes
                n.values = flat
        finally:
            stats.recomputed_ops += ops
            stats.recomputed_bytes += allocated
        hook = self.on_replay
        if hook is not None:
            hook(self, todo)

    @staticmethod
    def _missing(node: Node) -> list[Node]:
        """Nodes to run (or cut nodes to fill) for ``node``'s outputs, in program order;
        the walk stops at values that exist and at cut nodes."""
        # A stack of input tuples walked in place, ``Node.has_value`` inlined (Note
        # [Node inputs are one flat tuple]: no Python call per edge). ``todo`` keeps the
        # order nodes are found in, mostly against program order: the sort runs in ~n.
        todo = {node: None}
        stack = [node.inputs]
        while stack:
            inp = stack.pop()
            k, end = 1, len(inp)
            while k < end:
                m = inp[k]
                j = inp[k + 1]
                k += 3
                if m in todo:
                    continue
                saved = m.saved
                if saved is not None and saved[j] is not None:
                    continue
                values = m.values
                if values is not None and values[j] is not None:
                    continue
                todo[m] = None
                if m.scheduled or not m.cut:  # a scheduled node is never cut (Graph.cut)
                    stack.append(m.inputs)
        return sorted(todo, key=_node_seq)

    def _fill_cut(self, cut: Node) -> None:
        """Compute a cut node's outputs by a private replay of what it depends on
        (Note [Nested modules cut the replay]); cache the outputs someone waits for."""
        self._keep(cut, self._private(cut))

    def _private(self, node: Node) -> list[Any]:
        """``node``'s outputs from a replay that takes no pending use and caches nothing
        but the cut nodes it meets (those are armed: their consumers wait).

        It holds every value it reads itself, from when it finds it until the last node
        of the replay that reads it has run (Note [A private replay holds what it
        reads]): values of the graph that exist when it plans, read then;
        saved values, read at their first use; its own intermediates and the outputs of
        the cut nodes it fills, as they are computed. So it holds its live frontier,
        not every value it computed, and never re-reads the graph for a value that a
        pending-use ``take`` may have dropped meanwhile.
        """
        order = self._missing(node)
        order.remove(node)
        left: dict[tuple[Node, int], int] = {}  # reads still to come, per node output
        for n in order:
            if not n.cut:  # a cut node's inputs are read by its own private replay
                for key in producers(n):
                    left[key] = left.get(key, 0) + 1
        for key in producers(node):
            left[key] = left.get(key, 0) + 1
        # (value, the graph holds it too) of each output read that is at hand now.
        held: dict[tuple[Node, int], tuple[Any, bool]] = {}
        planned = set(order)
        for m, j in left:
            if m not in planned and (m.saved is None or m.saved[j] is None):
                held[m, j] = (m.values[j], True)  # a cached recomputed value: hold it now

        def value_of(m: Node, j: int) -> tuple[Any, bool]:
            key = (m, j)
            entry = held.get(key)
            if entry is None:  # a saved value, read at its first use here
                entry = (self._saved_value(m, j), True)
            n = left[key] - 1
            left[key] = n
            if n:
                held[key] = entry
            else:
                held.pop(key, None)
            return entry[0], entry[1] or n > 0

        for n in order:
            if n.cut:
                flat = self._private(n)
                mine = list(flat)
                self._keep(n, flat)  # cached for the pending consumers, if any
                values = n.values
                for i, v in enumerate(mine):
                    if (n, i) in left:
                        held[n, i] = (v, values is not None and values[i] is not None)
            else:
                for i, v in enumerate(self._execute(n, value_of)):
                    if (n, i) in left:
                        held[n, i] = (v, False)
        return self._execute(node, value_of)

    def _take_shared(self, node: Node, idx: int) -> tuple[Any, bool]:
        """``take`` for a replay: the value and whether anyone else still holds it."""
        v = self.take(node, idx)
        return v, node.has_value(idx)

    def _run(self, node: Node) -> None:
        if node.op is None or node.saved is not None and all(s is not None for s in node.saved):
            raise RuntimeError(f"ac2_dist internal error: asked to replay {node.name}")
        if not node.scheduled:  # defensive: keep take() balanced
            for m, j in producers(node):
                self.arm(m, j)
        node.scheduled = False
        self._keep(node, self._execute(node, self._take_shared))

    def _execute(self, node: Node, value_of: Any) -> list[Any]:
        """Run ``node``; flat outputs. ``value_of(producer, idx)`` gives each input and
        whether someone else still needs that value (then a write to it goes to a copy)."""
        if node.lists:
            args = [list(a) if type(a) is list else a for a in node.args]
            kwargs = {k: list(v) if type(v) is list else v for k, v in node.kwargs.items()}
        else:
            args = list(node.args)
            kwargs = dict(node.kwargs) if node.kwargs else {}
        writes = node.writes
        cloned = 0
        base = written = None
        inputs = node.inputs
        if writes:  # the written inputs last (Note [A replayed write owns its storage])
            triples = [inputs[k:k + 3] for k in range(0, len(inputs), 3)]
            triples.sort(key=lambda t: t[0] in writes)
            inputs = tuple(x for t in triples for x in t)
        it = iter(inputs)
        for pos, m, j in zip(it, it, it):
            v, shared = value_of(m, j)
            if writes and pos in writes:
                if shared or id(v) in self._parked or not _owns_storage(v):
                    # Someone else still needs the bytes from before the write (Note [A
                    # replayed write owns its storage]).
                    v = v.clone()
                    cloned += tensor_nbytes(v)
                base = v
                if node.via is not None:  # Note [Writes through views of fresh tensors]
                    for op, vargs, vkwargs, src, k in node.via:
                        vargs = list(vargs)
                        vargs[src] = v
                        v = op(*vargs, **vkwargs)
                        if k is not None:  # a multi-output view (split, unbind): its output k
                            v = v[k]
                written = v
            if type(pos) is int:
                args[pos] = v
            elif type(pos) is str:
                kwargs[pos] = v
            else:
                p, k = pos
                (args if type(p) is int else kwargs)[p][k] = v
        for pos in node.same:  # the written tensor itself (Note [Writes inside a region] in _writes.py)
            if type(pos) is int:
                args[pos] = written
            else:
                kwargs[pos] = written
        for pos, size, stride, offset in node.rebuilt:  # other views of the written storage
            (args if type(pos) is int else kwargs)[pos] = torch.as_strided(base, size, stride, offset)
        for pos, size, stride, dtype, device in node.like:  # Note [Arguments read for their shape] (_writes.py)
            args[pos] = torch.empty_strided(size, stride, dtype=dtype, device=device)
        for pos, shape, dtype, device in node.scratch:  # Note [Statistics an op accumulates]
            args[pos] = torch.zeros(shape, dtype=dtype, device=device)
        chain = None
        if node.rng is not None:
            chain = self.rng_chains[node.rng[0]]
            self._advance(chain, node.rng[1])
        flat = flatten_outputs(self.executor.run(node, args, kwargs, chain))
        if node.via is not None:  # the written base is the last output
            flat.append(base)
        stats = self.stats
        stats.recomputed_ops += 1
        allocated = 0
        for v in flat:
            if isinstance(v, torch.Tensor) and not v._is_view():  # views allocate nothing
                allocated += tensor_nbytes(v)
        if writes:  # written in place: the bytes were counted for the producer (or the clone)
            allocated = cloned
        elif getattr(node.op, "ac2_conversion", False):  # its input's storage (_subclass_wraps.py)
            allocated = 0
        stats.recomputed_bytes += allocated
        if self.tracker is not None:
            by_module = stats.recomputed_by_module
            by_module[node.fqn] = by_module.get(node.fqn, 0) + allocated
        return flat

    def _advance(self, chain: RngChain, k: int) -> None:
        """Bring ``chain`` to the state right before its ``k``-th op (Note [One
        generator state per region])."""
        if chain.cursor > k:
            chain.rewind()
        while chain.cursor < k:
            i = chain.cursor
            j = chain.nodes[i]
            if j.scheduled and j.values is None:
                self._replay(j)  # needed by backward: the normal path
            else:
                self._private(j)  # for its effect on the generator only
            if chain.cursor <= i:
                raise RuntimeError(f"ac2_dist internal error: the RNG chain did not advance past {j.name}")

    def _keep(self, node: Node, flat: list[Any]) -> None:
        """Cache the outputs of a replayed node that consumers wait for."""
        stats = self.stats
        uses, seq = self.uses, node.seq
        for i, v in enumerate(flat):
            if isinstance(v, torch.Tensor) and uses[seq + i] > 0 and (node.saved is None or node.saved[i] is None):
                stats.cached_bytes += tensor_nbytes(v)
            else:
                flat[i] = None
        stats.peak_cached_bytes = max(stats.peak_cached_bytes, stats.cached_bytes)
        node.values = flat
