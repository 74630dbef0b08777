"""The backward side of :class:`~ac2_dist._trace._graph.Graph`: arming the saved values'
handles (Note [Arming waits for backward]), taking pending uses, unpacking a handle
(the saved value, or a replay through :class:`~._replayer.Replayer`), prefetching,
and a new epoch under ``retain_graph=True``.

:class:`_GraphBackward` is ``Graph``'s base class (``Graph`` keeps the forward side:
recording nodes, the tensor map, packing). Its methods moved verbatim from _graph.py,
where the Notes they cite without a file name are (as for _replayer.py).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..compile import skip_dynamo
from ..fsdp import ensure_unsharded, is_unsharded
from ._history import recompute_with_history
from ._nodes import FREED, Handle, Node, Saved, tensor_nbytes
from ._replayer import Replayer

__all__: list[str] = []

_MISSING = object()  # Graph._existing: the value needs the executor


def _wrapped_fqn(module: Any, default: str) -> str:
    wrapped = getattr(module, "__dict__", {}).get("_ac2_wrap")  # _modules._CheckpointedForward
    return wrapped.source.module_fqn if wrapped is not None else default



def _took(h: Handle, task: int) -> None:
    """Count one use of ``h`` taken by backward ``task`` (Note [One handle per saved value] in _nodes.py)."""
    if h.consumed_task is None:
        h.consumed_task, h.taken = task, 1
    else:
        h.taken += 1


def _remember(h: Handle, v: Any) -> Any:
    """Keep a weak reference to what ``h``'s unpack returned: a second read in the same
    backward returns the same tensor without a replay (Note [Saved values die at their
    last use] may have freed what a replay would need)."""
    h.last = weakref.ref(v) if isinstance(v, torch.Tensor) else None
    return v



class _GraphBackward(Replayer):
    """What backward does with a :class:`~ac2_dist._trace._graph.Graph` (its forward side
    sets the fields these methods read)."""

    # ---- backward side ------------------------------------------------------------
    def settle(self) -> None:
        """Arm every live handle once per save (at the first unpack of a backward); the
        caller holds the lock."""
        # See Note [Arming waits for backward].
        if self.settled:
            return
        self.settled = True
        uses = self.uses
        for r in self._handle_refs:
            h = r()
            if h is not None:
                self.arm(h.node, h.idx)
                if h.count > 1:  # arm()'s later calls for one output add a use each, no walk
                    uses[h.node.seq + h.idx] += h.count - 1

    def arm(self, node: Node, idx: int) -> None:
        """Add one pending use of ``node[idx]``, scheduling the replay of what it needs
        if it has no value yet; saved values count their uses too, and each value is
        freed at its last use."""
        # See Note [Use counts free recomputed values as soon as consumed] and Note [Saved
        # values die at their last use].
        uses = self.uses
        uses[node.seq + idx] += 1
        if node.scheduled or node.saved is not None and node.saved[idx] is not None:
            return  # the common cases: no walk (the first value is the one just armed)
        cuts = self.has_cuts  # without cut nodes no node's ``cut`` is read (a class default)
        if cuts and node.cut or node.values is not None and node.values[idx] is not None:
            return
        node.scheduled = True
        # A stack of input tuples, walked in place (Note [Node inputs are one flat
        # tuple]): no tuple per edge. Each edge is counted once, when its consumer is
        # scheduled; the order does not matter (counts only).
        todo = [node.inputs]
        while todo:
            inp = todo.pop()
            k, end = 1, len(inp)
            while k < end:  # cheaper than range() for the one or two inputs most ops have
                n = inp[k]
                i = inp[k + 1]
                k += 3
                uses[n.seq + i] += 1
                saved = n.saved
                if saved is not None and saved[i] is not None:
                    continue
                if not n.scheduled and not (cuts and n.cut) and not (n.values is not None and n.values[i] is not None):
                    n.scheduled = True
                    todo.append(n.inputs)

    def take(self, node: Node, idx: int) -> Any:
        """Hand ``node[idx]`` to one consumer; drop the cached value at its last use."""
        uses, k = self.uses, node.seq + idx
        if node.saved is not None and node.saved[idx] is not None:
            v = self._saved_value(node, idx)
            uses[k] -= 1
            if uses[k] <= 0:
                self._last_use(node, idx)
            return v
        values = node.values
        v = values[idx]
        left = uses[k] - 1
        if left > 0:
            uses[k] = left
            return v
        uses[k] = 0
        values[idx] = None
        if isinstance(v, torch.Tensor):
            try:  # tensor_nbytes(v), inlined (once per recomputed value)
                nbytes = v.numel() * v.element_size()
            except Exception:
                nbytes = 0
            self.stats.cached_bytes -= nbytes
        if values.count(None) == len(values):  # all None (no generator per call)
            node.values = None
        return v

    def _release(self, node: Node, idx: int) -> None:
        """Take one pending use of ``node[idx]`` without reading it (its value exists and a
        parked copy serves that use): what :meth:`take` does to the counts, the saved
        value's unpack hook, unshard and stream guard left out."""
        uses, k = self.uses, node.seq + idx
        if node.saved is not None and node.saved[idx] is not None:
            uses[k] -= 1
            if uses[k] <= 0:
                self._last_use(node, idx)
            return
        self.take(node, idx)  # a cached recomputed value: counts only, no op

    def _last_use(self, node: Node, idx: int) -> None:
        """This backward's last pending reader of the saved ``node[idx]`` has it."""
        s = node.saved[idx]
        if s.offloaded:  # Note [One copy back per backward] (offload.py)
            s.value.fetched = None
        if node.held == 0 and node.op is not None:
            self._free_saved(node, idx)

    def _free_saved(self, node: Node, idx: int) -> None:
        """Drop a saved op output whose last pending reader (a replay) has it, unless this
        backward retains the graph or a private replay may still read it (Note [Saved
        values die at their last use])."""
        self.uses[node.seq + idx] = 0
        if (
            self.map is not None  # the region still records: a later op may read it
            or torch._C._autograd._get_current_graph_task_keep_graph()
            or self.create_graph  # a history replay may read it (Note [A saved value keeps its recipe] in _history.py)
            or self._private_replays_left()
        ):
            return
        node.saved[idx] = FREED

    def _private_replays_left(self) -> bool:
        """A private replay (which takes no pending use) may still run: the graph has cut
        nodes, or an RNG chain has an op ahead of its cursor that backward does not need
        (replayed privately, for its effect on the generator) before one it does need.
        Ops after the chain's last needed one are never passed: a random op of a branch
        autograd freed before backward, which Note [Arming waits for backward] leaves
        unscheduled, does not keep the graph's saved values alive."""
        if self.has_cuts:
            return True
        for chain in self.rng_chains:
            nodes = chain.nodes
            needed_later = False
            for k in range(len(nodes) - 1, chain.cursor - 1, -1):
                n = nodes[k]
                if n.scheduled and n.values is None:
                    needed_later = True  # _advance will bring the chain here
                elif needed_later and not n.scheduled and n.values is None:
                    return True
        return False

    def _saved_value(self, node: Node, idx: int) -> Any:
        """A saved value for a replay or an unpack (unsharding its FSDP unit first), made
        safe to read on the executor's stream (Note [Tensors that cross streams] in
        replay.py)."""
        s = node.saved[idx]
        if node.fsdp_unit is not None:
            triggered = ensure_unsharded(node.fsdp_unit)
            if self.log is not None:
                unit = node.fsdp_unit()
                self.log("unshard" if triggered else "unsharded", _wrapped_fqn(unit, self.fqn))
        if self.create_graph and s.detached:  # Note [A saved value keeps its recipe] (_history.py)
            recompute_with_history(self, node, idx)
            s = node.saved[idx]
        v = s.get()
        guard = self.executor.guard_read
        if guard is not None:
            guard(v)
        return v

    @skip_dynamo
    def unpack(self, h: Handle) -> Any:
        """The saved-tensor unpack hook of the region (its pack hook is :meth:`pack`)."""
        if self.tracker is not None:
            self.tracker._on_unpack()
        if self.on_backward is not None:
            self._backward_begins()
        with self.lock:
            if not self.settled:
                self.settle()
            if h.prefetched is not None:
                value, ready = h.prefetched, h.ready
                left = self._parked_uses.pop(id(h), 1) - 1
                if left > 0:  # Note [A prefetch serves every use of a handle]
                    self._parked_uses[id(h)] = left
                else:
                    h.prefetched = h.ready = None
                    self._unpark(value)
                v = _remember(h, self.executor.hand_over(value, ready))
            else:
                task = torch._C._current_graph_task_id()
                if task < 0 or (h.consumed_task == task and h.taken >= h.count):
                    # Read outside backward, or once more than it was saved in the same
                    # backward (a custom Function reading ctx.saved_tensors twice): the value
                    # the first read returned if it is still alive, else one extra use of
                    # this value (Note [One handle per saved value] in _nodes.py).
                    v = h.last() if h.last is not None and task >= 0 else None
                    if v is not None:
                        return v
                    self.arm(h.node, h.idx)
                    return self.executor.realize(self, h.node, h.idx)
                if h.consumed_task is not None and h.consumed_task != task:
                    self._new_epoch(task)  # a retained graph differentiated again
                node, idx = h.node, h.idx
                saved, values = node.saved, node.values
                if (saved is None or saved[idx] is None) and values is not None and values[idx] is not None \
                        and self.executor.takes_existing:
                    v = self.take(node, idx)  # _existing's first case, inlined (Note [Unpacking a value that exists])
                else:
                    v = self._existing(node, idx) if self.executor.takes_existing else _MISSING
                    if v is _MISSING:
                        v = self.executor.realize(self, node, idx)
                # _took(h, task) and _remember(h, v), inlined (one unpack per saved tensor)
                if h.consumed_task is None:
                    h.consumed_task, h.taken = task, 1
                else:
                    h.taken += 1
                h.last = weakref.ref(v) if isinstance(v, torch.Tensor) else None
                return v
        # Only a parked value's unpack gets here: the bytes a budgeted prefetch counts
        # went down, so it may go on (Note [A prefetch holds one unit's values ahead]
        # in _prefetch.py), outside this graph's lock.
        pump = self.pump
        if pump is not None:
            pump()
        return v

    def _backward_begins(self) -> None:
        fn, self.on_backward = self.on_backward, None
        if fn is not None:
            fn(self)

    @property
    def handles(self) -> list[Handle]:
        """The live handles, in pack order."""
        return self.live_handles()

    def _existing(self, node: Node, idx: int) -> Any:
        """``take(node, idx)`` when that runs no op, else ``_MISSING``.

        Note [Unpacking a value that exists]
            Most unpacks in backward find their value already there: a recomputed value
            cached for its pending consumers (the first unpack replayed the chain), or a
            plain saved reference. Taking it dispatches nothing, so it needs none of
            the replay environment (Note [Replay environment] in replay.py) and is
            done here, without the executor. A value that does need work to hand over
            -- a replay, an FSDP unshard, an unpack hook, an offloaded or CPU copy --
            goes through the executor as before. The saved value's checks (version,
            ``create_graph`` with a detached value) run the same.
        """
        saved = node.saved
        if saved is None or saved[idx] is None:
            values = node.values
            if values is not None and values[idx] is not None:
                return self.take(node, idx)
            return _MISSING
        s = saved[idx]
        if type(s) is Saved and s.hooks is None and s.device is None and not s.offloaded and node.fsdp_unit is None:
            self.create_graph = torch.is_grad_enabled()
            if self.create_graph and s.detached:  # a replay gives it its history (_history.py)
                return _MISSING
            return self.take(node, idx)
        return _MISSING

    # Note [Deterministic prefetch order]
    #     Realizing handles may unshard FSDP units (a collective), so every walk that
    #     can replay goes in an order fixed by pack order (the program's order, the
    #     same on every rank): a WeakSet's iteration order follows memory addresses and
    #     differs between ranks. A prefetch under a byte budget (_prefetch.py) replays
    #     at points that depend on sizes, so it unshards its units when it starts
    #     (``unshard_ahead``), at the same point on every rank.
    #
    # Note [Handles are weakly listed]
    #     The graph keeps a plain weak reference to each handle, appended at pack time
    #     (already in pack order), with no callback; a dead handle's reference stays
    #     in the list (walks skip it). Cheaper per saved tensor than a WeakSet (no set
    #     entry, no callback when autograd frees the handle in backward), and handles
    #     are walked only by prefetches, by a retained graph's next backward and by
    #     reports. The list is never reordered or shortened, so a handle's position
    #     is its pack order and ``packed`` is the list's length: a handle carries no
    #     sequence number of its own.

    def live_handles(self) -> list[Handle]:
        """Live handles in pack order (the program's order, the same on every rank)."""
        return self.handles_since(0)

    @property
    def packed(self) -> int:
        """Handles created so far (live or not: the position of the next one)."""
        # See Note [Handles are weakly listed] (above).
        return len(self._handle_refs)

    def handles_since(self, first: int) -> list[Handle]:
        """Live handles packed after the first ``first`` ones, in pack order."""
        with self.lock:
            refs = self._handle_refs[first:]
        return [h for h in (r() for r in refs) if h is not None]

    def prefetch(self, budget: Any = None) -> int:
        """Realize every handle not yet consumed in this backward and park the value
        on it, in pack order, while ``budget()`` (if given) says there is room. Returns
        how many were realized; the rest wait in ``prefetch_todo`` for
        :meth:`prefetch_more` (Note [A prefetch holds one unit's values ahead] in
        _prefetch.py).

        Handles are walked in pack order (the program's order, the same on every rank):
        each realize replays only the ops up to its value, so a budgeted prefetch
        allocates a few values at a time instead of the whole chain at its first step.

        A graph with nested checkpointed modules (cut nodes) is not prefetched."""
        # See Note [Prefetching the next unit's replay] in replay.py; the order: Note
        # [Deterministic prefetch order] (above); cut nodes: Note [Prefetch stops at
        # nested modules] in _graph.py.
        if self.has_cuts:
            return 0
        with self.lock:
            handles = self.live_handles()
            handles.reverse()  # popped from the end: pack order
            self.prefetch_todo = handles
        return self.prefetch_more(budget)

    def prefetch_more(self, budget: Any = None) -> int:
        """Go on with a prefetch :meth:`prefetch` started, while ``budget()`` is true."""
        todo = self.prefetch_todo
        if not todo:
            return 0
        task = torch._C._current_graph_task_id()
        if self.tracker is not None:
            self.tracker._on_unpack()  # a prefetch is backward work
        done = 0
        with self.lock:
            self.settle()
            while todo:
                if budget is not None and not budget():
                    break
                h = todo.pop()
                if h.prefetched is not None or (h.consumed_task == task and h.taken >= h.count):
                    continue
                if h.consumed_task is not None and h.consumed_task != task:
                    self._new_epoch(task)
                uses = h.count - (h.taken if h.consumed_task == task else 0)
                value, ready = self.executor.prefetch(self, h.node, h.idx)
                for _ in range(uses - 1):  # Note [A prefetch serves every use of a handle]
                    self._release(h.node, h.idx)
                h.prefetched, h.ready = value, ready
                for _ in range(uses):
                    _took(h, task)  # the parked value serves each of these unpacks
                if uses > 1:
                    self._parked_uses[id(h)] = uses
                saved = h.node.saved
                self._park(value, saved is None or saved[h.idx] is None)
                done += 1
        # A value this backward does not unpack (it stops early, or the graph belongs
        # to another loss's backward) stays parked for the backward that does.
        return done

    def cancel_prefetch(self) -> None:
        """Realize no more handles ahead: this unit's backward has begun, and what the
        prefetch did not reach is replayed when unpacked."""
        self.prefetch_todo = []

    def unshard_ahead(self) -> None:
        """Start the all-gather of every FSDP unit whose parameters this graph's replays
        read, in a fixed order: a paced prefetch replays at points that depend on bytes,
        so the collectives are issued where the prefetch starts (Note [Deterministic
        prefetch order]). The first replay that reads a unit's parameter waits for its
        all-gather and copies the parameters out (``ensure_unsharded``): they are
        allocated then, paced with the values."""
        for ref in self.fsdp_units:
            module = ref()
            if module is not None and not is_unsharded(module):
                self.executor.ahead(self, lambda m=module: m.unshard(async_op=True))
                if self.log is not None:
                    self.log("unshard", _wrapped_fqn(module, self.fqn))

    # Note [A prefetch serves every use of a handle]
    #     A handle stands for every save of one value (Note [One handle per saved value]
    #     in _nodes.py: a weight, the normed input both MLP matmuls read, an rsqrt output),
    #     and each save is one unpack. The prefetch takes all the uses this backward has
    #     left on the handle and parks the value for each of them: every unpack of a
    #     prefetched unit is served from what the prefetch made, handed over with that
    #     value's own ready event. Parking one use (as before) sent the other unpacks to
    #     the executor, which on a side stream ordered the consumer after the side
    #     stream's tail -- by then the next unit's whole prefetched replay -- so the
    #     compute stream waited for unit i-1's replay in the middle of unit i's backward.
    #     The value was cached for those uses anyway (the graph's use counts keep it until
    #     the last one): parking them holds nothing longer.

    def _park(self, value: Any, recomputed: bool) -> None:
        """Account a prefetched value once, however many handles hold it; in
        ``cached_bytes`` only if a replay made it (a saved value parked is not a
        recomputed value)."""
        if isinstance(value, torch.Tensor):
            n, _ = self._parked.get(id(value), (0, recomputed))
            self._parked[id(value)] = (n + 1, recomputed)
            if n == 0 and recomputed:
                self.stats.cached_bytes += tensor_nbytes(value)
                self.stats.peak_cached_bytes = max(self.stats.peak_cached_bytes, self.stats.cached_bytes)

    def _unpark(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            n, recomputed = self._parked.pop(id(value))
            if n > 1:
                self._parked[id(value)] = (n - 1, recomputed)
            elif recomputed:
                self.stats.cached_bytes -= tensor_nbytes(value)

    def _new_epoch(self, task: int) -> None:
        """A new backward over a retained graph: every handle consumed by an earlier one
        gets the pending uses it took back (Note [One handle per saved value] in _nodes.py); a parked
        prefetched value is still valid and serves the unpacks it was parked for."""
        self.epoch += 1
        self.stats.backward_epochs += 1
        for chain in self.rng_chains:
            chain.rewind()
        for h in self.live_handles():
            if h.consumed_task is not None and h.consumed_task != task:
                again = h.taken
                if h.prefetched is not None:  # its parked uses serve this backward's unpacks
                    parked = self._parked_uses.get(id(h), 1)
                    again -= parked
                    h.consumed_task, h.taken = task, parked
                else:
                    h.consumed_task, h.taken = None, 0
                for _ in range(again):
                    self.arm(h.node, h.idx)
