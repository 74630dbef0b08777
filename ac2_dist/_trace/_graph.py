"""The recorded graph: nodes, saved values and use counts.

One :class:`Graph` per outermost region. The tracer appends a :class:`Node` per ATen
op; autograd's saved-tensor hooks hold :class:`Handle` objects that point at a node
output; unpacking a handle *realizes* that output, replaying only the nodes on the
way back to the nearest saved values.

Note [Use counts free recomputed values as soon as consumed]
    Every way of consuming a node output during backward -- a handle being unpacked,
    or a node being replayed that takes it as input -- is matched by exactly one
    earlier ``arm`` of that output. ``arm`` adds one *pending* use; the first pending
    use of an output that is neither saved nor cached *schedules* its node, which arms
    each of the node's inputs once (a node consumes each input once when it runs).
    ``take`` returns the value and removes one pending use; the cached value is
    dropped when none is left. So a recomputed intermediate lives exactly until its
    last pending consumer has it, and every node runs at most once per backward
    (all handles are armed before anything is replayed: together at the first unpack,
    Note [Arming waits for backward], and again at the start of a retained second
    backward, see Note [Epochs: retain_graph=True]).

Note [Arming waits for backward]
    A handle packed in forward is armed (its pending uses added, its node scheduled and
    the walk to the nearest saved values done) at the graph's first unpack or prefetch,
    all handles together in pack order (:meth:`Graph.settle`), not in the pack hook:
    the pack hook runs once per saved tensor, in the forward whose cost the tracer is
    measured by, and the walk is the same work either way. Counts are order-free, so
    the result is what arming each handle at pack time gave; forward edits to the
    graph (a tagged or boundary save, a cut) see no scheduled node and have nothing to
    undo. A handle that autograd freed before backward (a branch nobody differentiates)
    is not armed at all. Once settled, a graph arms each new save at pack time again
    (saves made during or after an in-region backward).

Note [Packing before backward takes no lock]
    The graph's lock orders packs against arming (``settle``, ``arm``) when backward
    runs on other threads (autograd's device threads) while something still saves
    (a backward inside the region, ``create_graph``). Before the graph is settled no
    backward has unpacked from it, and the tracer records without a lock anyway (a
    graph is recorded by one thread, and a backward of it on another thread while
    that thread still records is not supported: node fields the walk reads change
    under it). So a pack that sees ``settled`` false only counts its save (``count``,
    the handle list), with no lock; one that sees it true takes the lock and arms.
    ``settled`` turns true only under the lock, inside an unpack or a prefetch.

Note [Use counts live in one array]
    The pending uses of every node output of a graph are one ``array('q')``
    (``Graph.uses``): a node of ``nout`` outputs gets ``nout`` consecutive counters
    starting at its ``seq`` (seqs advance by ``nout``, so they stay increasing, in
    program order). A node therefore owns no list of counters: one object fewer per
    recorded op for the garbage collector to track, and 8 bytes per output instead of
    a 64-byte list. The array is allocated ahead, doubling (``Graph.capacity``): a
    recorded op only advances ``Graph.seq``; counters past it stay zero until used.

Note [Epochs: retain_graph=True]
    Without ``retain_graph`` autograd frees each handle after unpacking it and a
    second backward fails inside autograd with its own "retain_graph" error. With it,
    handles survive and are unpacked again. Each handle remembers the autograd
    GraphTask (one backward call, ``torch._C._current_graph_task_id()``) that consumed
    it; a handle consumed by an earlier task being unpacked means a new backward pass
    started: every handle consumed by an earlier task is armed again (handles not yet
    consumed still hold their pending use) before anything is replayed. A handle read
    twice within one task (a custom Function reading ``saved_tensors`` twice) is armed
    once more for that read only.

Note [Replaying writes to fresh tensors]
    An op that writes a tensor created inside the region by a recomputable op, whose
    current value nothing saved (a buffer filled by ``bernoulli_``, ``out.add_(bias)``
    on a matmul result, ``relu_`` on a fresh value), is itself recomputable: the
    tracer records it with its written input as an ordinary input (``Node.writes``
    lists the positions). Its replay writes into the value its producer's replay
    made, after cloning it if someone else still needs the value from before the
    write (a pending use or a saved reference), so consumers of either version see
    what they saw in forward. Writes to anything else -- region inputs, parameters,
    buffers, saved values, tensors a view was taken of, views -- stay side effects,
    except writes through views of fresh values (next Note).

Note [Writes through views of fresh tensors]
    A buffer the region allocates and fills through views of it (``kv = a.new_empty(..);
    kv[..., :d].copy_(a); kv[..., d:].copy_(b)``, how HF DeepSeek-V3 builds its keys) is
    recomputable like any fresh value. A write whose one written tensor is a view of a
    fresh value (its autograd ``_base``), reached from that value by recorded view ops
    that nothing but other views has read, and whose base only views have read (no
    handle, not saved, no undeclared alias), is recorded as a replayable write of the
    *base*: its written input is the base's node output, ``Node.via`` holds the view
    ops, and the base after the write is the node's last output (the tensor -> node map
    points the base there). The replay takes the base's value (a copy if someone else
    still needs the value from before the write, as for direct writes), rebuilds the
    view from it, runs the write into the view and hands on the base. Writes chain: the
    next write through a view of the base reads the previous write's base output. A
    view of the base that was current before a write is stale after it (views share
    the base's version counter), so a later read of it becomes a saved boundary, as
    before. Anything else stays a side effect.

Note [Nested modules cut the replay]
    The outputs of a checkpointed module called inside another region (nested
    ``apply_ac``/``wrap``) are *cut* nodes. Arming stops at a cut node as at a saved
    value, and a cut node gets its value only when a consumer needs it, from a
    private replay of its module (:meth:`Graph._fill_cut`): the module's internal
    values computed on the way are dropped, only the cut outputs are kept (cached
    with their pending uses; the private replay itself holds what it reads: Note [A
    private replay holds what it reads] in _replayer.py). Backward of an outer
    region therefore holds the chain of nested module outputs plus one module's
    internals, as torch's nested checkpoint does, instead of every internal value of
    the outer region. The price is torch's too: a nested module's ops run twice in
    backward (once for its output, once for its own backward).

Note [Prefetch stops at nested modules]
    Prefetching a unit realizes every live handle of its graph at once (Note
    [Prefetching the next unit's replay] in replay.py). In a graph with nested
    checkpointed modules those handles are the saved tensors of every nested module
    (a stage's layers): realizing them together would hold all the layers' recomputed
    values at the same time, where backward without prefetch holds one layer's (the
    bound of Note [Nested modules cut the replay], torch's nested checkpoint's). So
    such a graph is not prefetched: its values are realized on demand, one nested
    module at a time. Units without nested modules are prefetched as before.

Note [One generator state per region]
    With ``rng="replay"`` the tracer stashes a generator's state once, before the
    region's first random op on it, and links the following random ops on that
    generator into an :class:`RngChain` (a CPU generator state is 5 KB: one per op
    would keep more than torch's one per checkpoint). A random op's replay needs the
    state right before it in forward, so the chain replays in forward order: to run
    op k it first runs ops ``cursor .. k-1`` -- the ones backward needs through the
    normal path (their values are cached for their consumers), the others privately
    for their effect on the generator only -- and keeps the state after each op as
    the new frontier. Backward needs a region's last random op first, so in practice
    the first replay regenerates the region's masks in order, as torch's recompute
    does. A random op run unrecorded (under inference mode, or with ``rng="save"`` in
    a nested region) ends the chain; the next one starts a new chain with a fresh
    stash. A random op the region saves does not (next Note).

Note [A saved random op stays in its chain]
    A policy may save a random op's output (a save list naming ``aten.randn_like``)
    while the region replays the others (``rng="replay"``). The saved op still moves
    its generator in forward, so the replay of the next random op needs the state
    after it. Rather than a second stash (a CPU generator state is 5 KB), the saved op
    keeps its recorded inputs and its place in the chain: advancing the chain past it
    runs it privately for its effect on the generator only (its output is the saved
    one), as for any chain op backward does not need. Its inputs are replayed only if
    a later random op of the chain is replayed.

Note [Saved values die at their last use]
    A saved op output (a policy save, a side effect's output) that no autograd handle
    reads directly serves backward only as an input of replays. Its uses are counted
    like a recomputed value's (``arm`` counts saved slots too, ``take`` removes one),
    and at its last use in a backward that does not retain the graph
    (``torch._C._autograd._get_current_graph_task_keep_graph()``) the slot drops the
    value (:data:`FREED`), as torch's selective checkpoint pops its cache during
    recompute. A retained graph keeps it for the next backward; region inputs and
    values a handle reads (autograd holds them anyway) are never dropped; nor is
    anything while the region still records (backward inside the region: a later op
    may read the value) or while a private replay (which takes no pending use: Note
    [Nested modules cut the replay], Note [One generator state per region]) may
    still read it.

Note [Saved values are version-checked references]
    Saved values (region inputs, policy saves, side-effect outputs) are held by
    reference, not copied. The tensor's ``_version`` (shared by all its views) is
    recorded when saved and checked on use; a mismatch means the value was mutated
    after being saved and is an error unless ``allow_cache_entry_mutation=True``.
    Differentiable or aliasing op outputs are stored detached (a shared-storage
    alias with the same version counter) so no reference cycle
    tensor -> grad_fn -> handle -> node -> tensor forms; region inputs and
    non-differentiable non-view outputs are stored as the same object (identity is
    preserved: a user who compares a saved input by ``is`` sees the object they passed).
"""

from __future__ import annotations

import threading
import weakref
from array import array
from typing import Any

import torch

from .._policy import Decision
from ..compile import skip_dynamo
from ..side_effects import op_info
from ._graph_backward import _GraphBackward
from ._graph_stats import GraphStats
from ._history import prune_recipes, recipe_inputs
from ._nodes import (
    FREED,  # noqa: F401  (re-exported: tests/test_recording_cost.py reads _graph.FREED)
    NO_KWARGS,
    Handle,
    MapEntry,
    Node,
    RngChain,
    Saved,
    TensorMap,
    producers,
    version_of,
)
from ._subclass_wraps import conversion_ref
from ._writes import HeldStorages, Literal, stale_view

_CP = torch.utils.checkpoint.CheckpointPolicy


# Use counters allocated when a graph is made (Note [Use counts live in one array]).
_FIRST_CAPACITY = 256
# Nodes and handles are made without a Python __init__ call (Graph.new_node, Graph.pack).
_new_object = object.__new__


class Graph(_GraphBackward):
    """Nodes of one outermost region plus the tensor -> node-output map of forward."""

    def __init__(self, executor: Any, frames: list) -> None:
        # tensor -> node output it currently is (TensorMap); dropped when forward ends
        self.map: TensorMap | None = TensorMap()
        self._entries: dict | None = self.map._d  # new_node's inlined TensorMap.set; with map
        self._map_cb = self.map._cb
        # Pending uses of every node output (Note [Use counts live in one array]); slot 0
        # is unused (node seqs start at 1).
        self.uses = array("q", bytes(8 * _FIRST_CAPACITY))
        self.capacity = _FIRST_CAPACITY  # len(self.uses), kept as an int (hot path)
        self.seq = 1
        self.lock = threading.RLock()
        self.epoch = 0
        # Weak references to the handles, in pack order (Note [Handles are weakly listed] in _graph_backward.py).
        self._handle_refs: list[weakref.ref] = []
        self.settled = False  # every live handle armed (Note [Arming waits for backward])
        self.stats = GraphStats()
        self.executor = executor
        self.create_graph = False  # set by the executor around each realize
        self.frames = frames  # the policy frames of the thread that records (forward)
        self.tracker: Any = None  # an active ac2_dist.memory.Tracker, if any
        self.save_unit_outputs = True  # Note [FSDP units are region boundaries] (fsdp.py)
        # Called as observer(node, op, args, kwargs, out) for every recorded op while set
        # (a calibrating ac2_dist.MemoryBudget region; budget.py).
        self.observer: Any = None
        # Called once as on_backward(graph) by the first unpack, not by a prefetch (a
        # MemoryBudget(peak=...) marks where this unit's backward begins; a prefetched
        # replay runs during the next unit's backward and belongs to its span; _peak.py).
        self.on_backward: Any = None
        # Called as on_replay(graph, nodes) after each replay of recomputed values, with
        # the nodes it ran (a MemoryBudget(peak=...) marks sub-segments of a block's
        # backward: Note [A block's backward, replay by replay] in _peak_model.py).
        self.on_replay: Any = None
        self.rng_chains: list[RngChain] = []  # every chain (rewound at a new epoch)
        self.open_chains: dict[int, RngChain] = {}  # id(generator) -> chain open in forward
        # Set by module wrappers that prefetch (Note [Prefetching the next unit's replay]):
        self.prev: list[weakref.ref] = []  # graphs of the units that produced this one's inputs
        self.fqn = ""
        self.log: Any = None
        # id(prefetched value) -> (handles holding it, whether a replay made it)
        self._parked: dict[int, tuple[int, bool]] = {}
        # id(handle) -> unpacks of this backward its parked value still serves (Note [A
        # prefetch serves every use of a handle] in _graph_backward.py)
        self._parked_uses: dict[int, int] = {}
        # The event after the last replay a side-stream executor ran for this graph (None:
        # none ran): what a value it made is ready on (Note [Nothing waits behind another
        # unit] in replay.py).
        self.side_ready: Any = None
        # A prefetch that stopped at its byte budget: the handles it has still to realize,
        # the next last (Note [A prefetch holds one unit's values ahead] in _prefetch.py),
        # and the per-thread prefetcher that resumes it (called after a parked value is
        # handed over: the bytes the budget counts went down).
        self.prefetch_todo: list[Handle] = []
        self.pump: Any = None
        self.unit_key: Any = None  # what the prefetcher keeps this unit's figures under (its wrapper)
        # The FSDP units whose unsharded parameters are leaves of this graph, in the order
        # first marked (mark_fsdp_params): a prefetch unshards them when it starts.
        self.fsdp_units: list[weakref.ref] = []
        # The user's saved-tensor hooks around the region, as a SAVE_WITH_HOOKS, under
        # respect_saved_tensors_hooks=True: the op outputs the region saves go through them
        # (Note [The user's saved-tensor hooks] in _region.py). None: they do not.
        self.user_hooks: Any = None
        # A saved node keeps its recipe (Note [A saved value keeps its recipe] in _history.py).
        self.has_recipes = False
        # Region inputs with a recipe, if the thread made any (Note [A region rebuilds an input
        # from its recipe] in _rebuild.py): a Rebuilder, set by the region.
        self.rebuild: Any = None
        self.has_cuts = False  # Note [Nested modules cut the replay]: private replays happen
        # This region's block of an offload schedule (offload.OffloadUnit; set by the region
        # when its ReplayConfig has an Offload): where CPU-offloaded saves go.
        self.offload: Any = None
        # Values held by reference, found by storage when something writes (Note [Held
        # values are found by storage] in _writes.py); forward only.
        self.held: HeldStorages | None = HeldStorages()
        # Inner tensors of the subclasses the region made (Note [Wrapper subclasses made
        # and unwrapped outside dispatch] in _subclass_wraps.py); forward only.
        self.inners: Any = None

    # ---- forward side -------------------------------------------------------------
    def rng_chain(self, generator: torch.Generator) -> RngChain:
        """The chain the next random op on ``generator`` joins (forward)."""
        chain = self.open_chains.get(id(generator))
        if chain is None or chain.generator is not generator:
            chain = self.open_chains[id(generator)] = RngChain(generator, len(self.rng_chains))
            self.rng_chains.append(chain)
        return chain

    def new_node(
        self, op: Any, nout: int, fqn: str = "", inputs: tuple = (), args: tuple = (), fresh: Any = None,
    ) -> Node:
        """A node whose outputs get the next ``nout`` use counters (in the graph's one
        array of counters); ``inputs`` and ``args`` as the tracer recorded them, if known
        yet. ``fresh``: the new tensor a plain op returned, mapped to output 0 here."""
        # Note [Use counts live in one array]; ``fresh``: Note [The plain-op path] in _tracer.py.
        seq = self.seq
        end = self.seq = seq + nout
        if end > self.capacity:
            self._grow_uses(end)
        self.stats.nodes += 1
        # The fields every node sets (Note [Rare node fields live in a lazy dict] in _nodes.py),
        # without a Python __init__ call: the tracer makes one node per recorded op.
        node = _new_object(Node)
        node.op = op
        node.seq = seq
        node.args = args
        node.kwargs = NO_KWARGS
        # For every tensor argument its position, producer node and producer output
        # index, flat: (pos, node, idx, pos, node, idx, ...) (Note [Node inputs are one
        # flat tuple]); () for leaves and saved nodes. Read with input_refs/producers.
        node.inputs = inputs
        node.saved = None  # list[Saved | None] once an output is saved
        node.values = None  # list of recomputed values, during backward
        node.nout = nout  # its use counts are Graph.uses[seq : seq + nout] (Note [Use counts live in one array])
        node.scheduled = False
        node.fqn = fqn
        node.readers = 0  # recorded recomputable ops that take one of its outputs
        node.held = 0  # handles (autograd saved tensors) created on one of its outputs
        # a view of one of its outputs was recorded, or its output aliases a value the
        # region did not record (then also ``aliased``; Note [Aliases a schema does not
        # declare] in _tracer.py)
        node.viewed = False
        node.viewers = 0  # recorded view ops that take one of its outputs as their source
        # The plain-op path in C makes the same node (Note [The plain-op path in C] in
        # _crecord.c): a change to a node's fields changes it there too.
        if fresh is not None:
            # TensorMap.set, inlined (one call less per plain op). The version is 0: a plain
            # op's output is storage its kernel just allocated, with a new counter (a
            # larger real version would only make the entry look stale: a leaf, never
            # a wrong value; versions only grow).
            key = id(fresh)
            e = MapEntry(fresh, self._map_cb)
            e.key = key
            e.node = node
            e.idx = 0
            e.version = 0
            e.handle = None
            self._entries[key] = e
        return node

    def close_map(self) -> None:
        """Forward ended: drop the tensor map (its entries keep nodes alive) and the
        random ops no replay will pass (those at the end of a chain that nothing reads)."""
        # See Note [Chains end at their last needed op] (below).
        self.open_chains = {}
        if self.rng_chains:
            self._trim_chains()
        if self.has_recipes:  # Note [A recipe holds no saved value] (_history.py)
            prune_recipes(self)
        self.map = self._entries = self.held = self.inners = self.rebuild = None

    def _trim_chains(self) -> None:
        """Note [Chains end at their last needed op]
            A random op's node stays in its generator's chain (with its inputs) so that
            a replay of a later random op can run it first. Once forward has ended, a
            chain's last ops that nothing reads (no recorded reader, no live autograd
            handle: a dropout whose output the program dropped) are never replayed --
            no later random op needs the generator moved past them -- so they leave
            the chain, and with them what their inputs held (a region input copied
            before a later write, a recomputed producer). A chain left empty drops its
            generator state.
        """
        handled = set()
        for r in self._handle_refs:
            h = r()
            if h is not None:
                handled.add(id(h.node))
        for chain in self.rng_chains:
            nodes = chain.nodes
            k = len(nodes)
            while k and not nodes[k - 1].readers and id(nodes[k - 1]) not in handled:
                k -= 1
            if k < len(nodes):
                del nodes[k:]
                if not nodes:
                    chain.start = chain.state = None

    def _grow_uses(self, end: int) -> None:
        """Make room for counters up to ``end`` (Note [Use counts live in one array])."""
        more = max(end, 2 * self.capacity) - self.capacity
        self.uses.frombytes(bytes(8 * more))
        self.capacity += more

    def leaf(
        self,
        t: torch.Tensor,
        decision: Decision,
        reason: str,
        allow_mutation: bool,
        owner: str = "region input",
        version: int | None = None,
        made_here: bool = False,
    ) -> Node:
        """A saved node holding ``t`` (a region input or a new version; ``version``:
        the version ``t`` will have once the op writing it returns). ``made_here``: the
        region computed ``t``; it is held as a detached alias, not as itself."""
        # See Note [Writes inside a region] in _writes.py, 3.
        node = self.new_node(None, 1, self.frames[-1].module_fqn if self.frames else "")
        version = version_of(t) if version is None else version
        saved = Saved(
            t, decision, reason=reason, allow_mutation=allow_mutation,
            keep_identity=not made_here or not (t.is_floating_point() or t.is_complex()), owner=owner,
            version=version, offload=self.offload, history=t.requires_grad,
        )
        node.set_saved(0, saved)
        self.held.add(node)
        self.stats.saved_nodes += 1
        self.map.set(t, node, 0, version)
        return node

    def literal_leaf(self, t: torch.Tensor, fqn: str) -> Node:
        """A leaf remembering the small literal ``t`` by value."""
        # See Note [Writes inside a region] in _writes.py.
        node = self.new_node(None, 1, fqn)
        node.set_saved(0, Literal(t))
        self.map.set(t, node, 0, version_of(t))  # a write through a view makes it stale
        return node

    def ref(self, t: torch.Tensor, allow_mutation: bool) -> tuple[Node, int]:
        """The node output that ``t`` currently is: a new leaf if it is unknown; if it
        is stale (written since), a view re-made from its base, else a new leaf."""
        # See Note [Writes inside a region] in _writes.py.
        e = self.map.get(t)
        if e is not None and (e.version is None or e.version == t._version):
            return e.node, e.idx
        if e is None and (made := conversion_ref(self, t)) is not None:
            return made  # Note [Wrapper subclasses made and unwrapped outside dispatch] (_subclass_wraps.py)
        if e is None and self.rebuild is not None and (made := self.rebuild.ref(self, t, allow_mutation)) is not None:
            return made  # Note [A region rebuilds an input from its recipe] (_rebuild.py)
        fqn = self.frames[-1].module_fqn if self.frames else ""
        if e is not None and t._is_view():
            found = stale_view(self, t, fqn)
            if found is not None:
                return found
        if e is not None and e.node.op is not None:
            owner = f"value made in the region by {e.node.op}, read after an in-place write to its storage"
            return self.leaf(t, _CP.MUST_SAVE, "boundary", allow_mutation, owner, made_here=True), 0
        return self.leaf(t, _CP.MUST_SAVE, "boundary", allow_mutation), 0

    def tag(self, t: torch.Tensor, decision: Decision, allow_mutation: bool) -> None:
        """Save ``t`` (``tag_with_policy``): its node output stops being recomputed."""
        e = self.map.get(t)
        if e is None or (e.version is not None and e.version != t._version):
            self.leaf(t, decision, "tagged", allow_mutation, owner="tagged tensor")
            return
        node, idx = e.node, e.idx
        self._save_in_place(node, idx, t, decision, "tagged", allow_mutation)

    def boundary(self, t: torch.Tensor) -> None:
        """Save ``t`` as a region boundary (an FSDP unit's input or output)."""
        # See Note [FSDP units are region boundaries] in fsdp.py.
        e = self.map.get(t)
        if e is None or (e.version is not None and e.version != t._version):
            return  # unknown here: a region input, already a saved leaf
        node, idx = e.node, e.idx
        if node.must_recompute or (node.saved is not None and node.saved[idx] is not None):
            return
        self._save_in_place(node, idx, t, _CP.MUST_SAVE, "boundary", False)

    def cut(self, t: torch.Tensor) -> None:
        """Make ``t``'s node a cut node: a replay stops there and takes the value the
        nested module's own replay produces."""
        # See Note [Nested modules cut the replay].
        e = self.map.get(t)
        if e is None or (e.version is not None and e.version != t._version):
            return
        node = e.node
        if node.op is None or node.cut or node.values is not None:
            return
        if node.saved is not None and all(x is not None for x in node.saved):
            return
        if node.scheduled:  # armed as a replay already: its value now comes from _fill_cut
            node.scheduled = False
            for m, j in producers(node):
                self._disarm(m, j)
        node.cut = True
        self.has_cuts = True

    def mark_fsdp_params(self, params: list[torch.Tensor], unit: Any) -> None:
        """Leaves that are ``unit``'s unsharded parameters unshard it before use."""
        ref = None
        for p in params:
            e = self.map.get(p)
            node = e.node if e is not None else None
            # FSDP2's first unshard makes its unsharded parameters inside the region: the
            # parameter is then a view (nn.Parameter's detach) of the leaf that holds the
            # storage FSDP unshards; that leaf is the one to mark.
            while node is not None and node.op is not None and len(node.inputs) == 3 and node.nout == 1 \
                    and not getattr(node.op, "ac2_conversion", False) and op_info(node.op).aliases:
                node = node.inputs[1]
            if node is not None and node.op is None:
                if ref is None:
                    ref = weakref.ref(unit)
                    if all(r() is not unit for r in self.fsdp_units):
                        self.fsdp_units.append(ref)
                node.fsdp_unit = ref

    def _save_in_place(self, node: Node, idx: int, t: torch.Tensor, decision: Decision, reason: str, allow: bool) -> None:
        keep = node.op is None or not (t.is_floating_point() or t.is_complex())
        owner = f"{reason} region input" if node.op is None else f"{reason} output of {node.op}"
        node.set_saved(
            idx, Saved(t, decision, reason=reason, allow_mutation=allow, keep_identity=keep, owner=owner,
                       offload=self.offload, user_hooks=self.user_hooks if node.op is not None else None,
                       history=t.requires_grad)
        )
        if self.held is not None:
            self.held.add(node)
        if node.op is None:
            return
        uses, seq = self.uses, node.seq
        if node.scheduled and not any(
            uses[seq + i] > 0 and node.saved[i] is None for i in range(node.nout)
        ):
            # Armed for a compute that will not happen any more: give the inputs back
            # their pending uses (the exact reverse of arm()).
            node.scheduled = False
            for m, j in producers(node):
                self._disarm(m, j)
        if not node.scheduled and node.rng is None and all(s is not None for s in node.saved):
            # Fully saved now: recompute never passes through it. A value with a history
            # keeps its inputs as its recipe (Note [A saved value keeps its recipe] in
            # _history.py); otherwise they go (a random op keeps them: Note [A saved
            # random op stays in its chain]).
            if any(s.detached for s in node.saved):
                node.inputs = recipe_inputs(self, node.inputs)
                self.has_recipes = True
                return
            node.inputs = ()
            node.args = ()
            node.kwargs = NO_KWARGS

    def _disarm(self, node: Node, idx: int) -> None:
        uses = self.uses
        stack = [(node, idx)]
        while stack:
            n, i = stack.pop()
            uses[n.seq + i] -= 1
            if n.saved is not None and n.saved[i] is not None:
                continue
            if (
                not n.cut
                and n.scheduled
                and n.values is None
                and not any(uses[n.seq + k] > 0 and (n.saved is None or n.saved[k] is None) for k in range(n.nout))
            ):
                n.scheduled = False
                inp = n.inputs
                stack.extend(zip(inp[1::3], inp[2::3]))

    @skip_dynamo
    def pack(self, t: torch.Tensor) -> Handle:
        # Its forward cases also exist in C (Note [The pack hook in C] in _crecord.c): a
        # change here changes that copy too (tests compare the graphs both record).
        # Autograd may save an op's inputs before the tracer sees the op: a region input
        # can become a leaf here first, under the innermost region's mutation setting.
        entries = self._entries
        e = entries.get(id(t)) if entries is not None else None
        if e is not None and e() is t and ((v := e.version) is None or v == t._version):
            node, idx = e.node, e.idx  # Graph.ref, inlined: the common case
            h = e.handle
            if h is not None and h.consumed_task is None and h.prefetched is None:
                node.held += 1  # saved again: the same handle (Note [One handle per saved value] in _nodes.py)
                if not self.settled:  # Note [Packing before backward takes no lock]
                    h.count += 1
                    return h
                with self.lock:
                    h.count += 1
                    self.arm(node, idx)
                return h
        else:
            frames = self.frames
            node, idx = self.ref(t, frames[-1].allow_mutation if frames else False)
            e = entries.get(id(t)) if entries is not None else None  # the entry ref() made
            if e is not None and (e() is not t or e.node is not node or e.idx != idx):
                e = None
        node.held += 1
        h = _new_object(Handle)  # every slot set here (no Python __init__ call: one per saved value)
        h.node = node
        h.idx = idx
        h.count = 1
        h.consumed_task = h.prefetched = h.ready = h.last = None
        h.taken = 0
        if e is not None:
            e.handle = h
        if not self.settled:  # Note [Packing before backward takes no lock]
            self._handle_refs.append(weakref.ref(h))
            return h
        with self.lock:
            self._handle_refs.append(weakref.ref(h))
            self.arm(node, idx)
        return h

