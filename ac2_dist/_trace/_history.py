"""Saved values given back their autograd history, for a backward with
``create_graph=True`` (double backward: gradient penalties, Hessian-vector products,
MAML).

Note [A saved value keeps its recipe]
    A value the region saves (a policy's save, a tagged or boundary save) is held
    detached: held with its ``grad_fn``, it would close a cycle through autograd's C++
    nodes (tensor -> grad_fn -> saved handle -> graph -> tensor) that gc cannot
    collect (Note [Saved values are version-checked references] in _graph.py). A
    first-order backward only reads its bytes. A backward with ``create_graph=True``
    also differentiates through it, and eager's saved tensor carries the history back
    to the region's inputs and parameters; a detached one would cut that path and the
    second-order gradient would silently miss every term through it.

    So a saved op output keeps its *recipe* (one recorded with grad mode off too, run so:
    ``Node.no_grad``; what it makes is a constant other recipes may read): the node
    records its op, arguments and producers as a recomputable node does (the tracer's
    ``_recomputable`` walk with ``reads=False``: the recipe counts as nobody's reader,
    so it makes no snapshot before a later write and no write a side effect); a tagged
    or boundary save keeps the inputs it had. The normal replay path never reads a
    saved node's recipe: arming, scheduling and ``_missing`` stop at a saved value as
    before. When a ``create_graph=True`` backward asks for a detached saved value,
    :func:`recompute_with_history` replays its recipe with grad mode on, from values
    that have their history -- region inputs and parameters (held as themselves),
    saved values without a history, values this backward already recomputed -- and
    the saved slot then holds the result, with its ``grad_fn``. The replay saves
    natively (Note [Replays save natively] in replay.py), so that ``grad_fn`` leads
    only to natively saved tensors and to the region's inputs: no cycle. The values
    are bitwise the forward's (the same ops on the same inputs), and each is
    recomputed once; from then on the graph holds what eager holds (a create_graph
    backward keeps what eager keeps).

    What has no recipe (the one exception: an error naming the op): an op that is
    never replayed -- a collective or FSDP op, a random op under ``rng="save"`` (one
    under ``rng="replay"`` is replayed from its generator state: Note [One generator
    state per region] in _graph.py), an op writing one of its inputs, an opaque or
    registered side effect -- and a value the region made and then wrote in place
    before reading it again (held as a leaf). A region input or parameter the region
    wrote in place after a saved op read it is gone too (the recipe made no
    snapshot): an error, as eager's is when it saved that tensor itself.

Note [A recipe holds no saved value]
    A recipe that pointed at its producers' saved nodes would keep their values alive
    until it dies, values the first-order backward never reads and that were freed
    before (under ``must_save_all``, most of them: a cast, a view, a pointwise output
    whose backward reads nothing; Llama, 4 layers: 9.5 -> 14.6 MB kept). So a recipe
    reads each argument through :func:`recipe_input`:

    - a saved producer with a recipe of its own through its *shadow*: a recomputable
      node with the same op, arguments and recipe, holding no value, made once per
      saved node (``Node.shadow``; the shadow knows its saved node weakly,
      ``Node.original``); a ``create_graph`` backward computes a shadow once and keeps
      its values on it (``Node.values``, which nothing of the normal path reads: a
      shadow is never armed), and a shadow and its saved node share what either
      computed first;
    - the output of an op that is never replayed and has no recipe (a collective's, a
      registered side effect's) through a *weak twin*: a leaf holding a weak reference
      to the same tensor (and its version) in ``Node.shadow`` of the saved node. While
      the first-order backward, or the program, keeps the tensor, the recipe reads it;
      one freed before a ``create_graph`` backward asks for it is an error naming it (a
      sequence-parallel all-gather's output would otherwise live through backward for
      recipes alone);
    - a region input or parameter as itself, with a history or without: a parameter
      costs nothing, and an input is what torch's checkpoint keeps of every region (an
      eager-attention model's 4-d mask, shared by its layers, then lives until the
      first layer's backward, as under torch's checkpoint; read weakly, a gradient
      penalty on such a model under a save list failed: the mask was gone).

    A recipe also reads recomputable nodes as themselves, and their own inputs are the
    normal path's: a saved value, a side effect's output. What only such a path
    reaches (a saved matmul output under a view that a saved op's recipe reads, and that
    the first-order backward never recomputes) would live through backward for recipes
    alone. So when forward ends (:func:`prune_recipes`, from ``Graph.close_map``, for a
    graph with recipes) the nodes the first-order backward can reach are marked -- from
    the live handles and the RNG chains' ops (a replay may run any of them for its
    generator), through the inputs of every node but a fully saved one (its recipe) --
    and in a node only recipes reach, a saved value with a recipe drops its bytes
    (recomputed like any detached value if a ``create_graph`` backward asks) and a
    never-replayed op's output becomes a weak reference as above. Recipes therefore hold
    nodes, not values, but for region inputs. (This also releases a saved value that
    something other than the first-order backward's walk kept before: GPT-2, 4 layers,
    ``MemoryBudget(0.5)``: the attention projection's output, 256 x 384 per layer, held
    through a recomputable split and view nothing unpacks; 11.6 -> 10.0 MB kept,
    gradients bitwise eager's.)
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

from ._nodes import Node, Saved

__all__: list[str] = []


class Graph(Protocol):
    """What recipes use of the graph being recorded (``_graph.Graph``, which imports this
    module: a protocol keeps the arrow one way)."""

    _handle_refs: Any  # weak references to the live handles
    rng_chains: Any
    _entries: Any  # the tensor map's entries, while forward records

    def new_node(self, op: Any, nout: int, fqn: str = "", inputs: tuple = (), args: tuple = (),
                 fresh: Any = None) -> Node: ...


class _GraphBackward(Protocol):
    """What a recompute with history calls of the graph in backward
    (``_graph_backward._GraphBackward``)."""

    def _saved_value(self, node: Node, idx: int) -> Any: ...

    def _execute(self, node: Node, value_of: Any) -> list[Any]: ...


def has_recipe(node: Node) -> bool:
    """Whether a saved node keeps its recipe (Note [A saved value keeps its recipe]): an
    op recorded with its arguments. A saved node without one was made with neither (a
    leaf, or an op never replayed), or let them go (a tagged value without a history).
    Read off the fields every node has: no rare field, so no instance dict per saved op."""
    return node.op is not None and bool(node.inputs or node.args)


# The rare node fields ``Replayer._execute`` reads; the forward-only ones (``alias_of``,
# which holds its partner node, ``aliased``, ...) stay with the saved node.
_REPLAYED_FIELDS = ("lists", "rng", "like", "scratch", "writes", "same", "rebuilt", "via", "no_grad")


class _WeakInput:
    """A weak twin's slot: the tensor a held value is, by weak reference, with the version
    it had (Note [A recipe holds no saved value])."""

    __slots__ = ("ref", "version", "owner", "detached", "shape", "reason", "op", "history")
    offloaded = False
    hooks = device = None
    nbytes = 0

    def __init__(self, s: Any, t: torch.Tensor, op: Any) -> None:
        self.op = op
        self.reason = s.reason if s is not None else "boundary"
        # The tensor the program made (not the saved detached alias, which only the
        # saved slot holds): it shares the version counter the saved value is checked by.
        self.ref = weakref.ref(t)
        self.version = s.version if s is not None else t._version
        self.owner = s.owner if s is not None else "leaf made in the region (requires_grad_ on a value it computed)"
        self.detached = s.detached if s is not None else False  # a history it had and lost: nothing to recompute it from
        self.shape = tuple(t.shape)
        self.history = t.requires_grad  # the program's tensor had one (a custom Function's output)

    def alive(self) -> torch.Tensor | None:
        return self.ref()

    def stale(self) -> bool:
        if self.version is None:
            return False
        t = self.ref()
        return t is None or t._version != self.version

    def snapshot(self) -> None:
        return None

    def get(self) -> torch.Tensor:
        t = self.ref()
        if t is None:
            raise RuntimeError(f"ac2_dist internal error: the {self.owner} was read after it was freed")
        return t


def _weakly_read(m: Node, s: Any) -> bool:
    """A held value a recipe reads weakly: the output of an op with no recipe (never
    replayed), held plainly (a packed, offloaded or copied value is its owner's to
    release); region inputs and parameters are read as themselves."""
    return (m.op is not None and type(s) is Saved and s.hooks is None and not s.offloaded
            and s.device is None and isinstance(s.value, torch.Tensor))


def _weak_twin(graph: Graph, m: Node, j: int, t: torch.Tensor | None) -> Node:
    """``m``'s weak twin, reading output ``j`` as ``t`` (the tensor the program holds; the
    saved alias where it is not known)."""
    twin = m.shadow
    if twin is None:
        twin = m.shadow = graph.new_node(None, m.nout, m.fqn)
        twin.saved = [None] * m.nout
    if twin.saved[j] is None:
        s = m.saved[j]
        twin.saved[j] = _WeakInput(s, t if t is not None else s.value, m.op)
    return twin


def _leaf_twin(graph: Graph, m: Node, t: torch.Tensor) -> Node:
    """A leaf reading ``t`` by weak reference: a tensor the region computed (``m``'s
    output) and then made a leaf that requires grad (``requires_grad_()``, no ATen op)."""
    twin = graph.new_node(None, 1, m.fqn)
    twin.saved = [_WeakInput(None, t, None)]
    return twin


def recipe_input(graph: Graph, m: Node, j: int, t: torch.Tensor | None = None) -> Node:
    """The node a recipe records for its argument ``m[j]`` (Note [A recipe holds no saved
    value]): ``m`` itself if it recomputes ``j`` (no saved value) or holds ``j`` as
    itself (a region input or parameter); ``m``'s shadow if it saves ``j`` with a recipe
    of its own; a weak twin of ``m`` for the output of an op without a recipe that has
    a history (a constant is read from ``m``); a weak leaf for a leaf made in the region
    (``t``, the program's tensor, a leaf that requires grad: ``m``'s replay would
    give a tensor that does not)."""
    # ``is_leaf``, not ``grad_fn is None``: reading ``grad_fn`` makes autograd's node a
    # Python object that lives as long as the node (one more gc-tracked object per op).
    # A view made under no_grad of a tensor that requires grad is such a leaf too; its
    # base's history is eager's, and a replay of the view reads the base: not a leaf made here.
    if t is not None and t.requires_grad and t.is_leaf and m.op is not None and not t._is_view():
        return _leaf_twin(graph, m, t)  # Note [A recipe holds no saved value]: a leaf made inside
    saved = m.saved
    if saved is None or saved[j] is None:
        return m
    s = saved[j]
    if not has_recipe(m) or m.no_grad and t is not None and t.requires_grad and not t._is_view():
        # No recipe, or one that cannot give the history the program's tensor has (an op
        # inside a custom autograd.Function's forward: its history is the Function's; a
        # view made under no_grad requires grad as its base does, with no history).
        if _weakly_read(m, s) and (t is None or t.requires_grad):
            return _weak_twin(graph, m, j, t)
        return m  # held as itself, or a constant in eager too: read as saved
    sh = m.shadow
    if sh is None:
        sh = graph.new_node(m.op, m.nout, m.fqn, m.inputs, m.args)
        sh.kwargs = m.kwargs
        d = m.__dict__  # the rare fields a replay reads (Note [Rare node fields live in a lazy dict])
        for k in _REPLAYED_FIELDS:
            if k in d:
                setattr(sh, k, d[k])
        sh.original = weakref.ref(m)
        m.shadow = sh
    return sh


def recipe_inputs(graph: Graph, inputs: tuple) -> tuple:
    """``inputs`` (Note [Node inputs are one flat tuple] in _nodes.py) with each saved
    producer that has a recipe replaced by its shadow."""
    out = list(inputs)
    for k in range(1, len(out), 3):
        out[k] = recipe_input(graph, out[k], out[k + 1])
    return tuple(out)


def _needs_history(s: Any) -> bool:
    """A saved slot that holds its value detached from a history it had."""
    return type(s) is Saved and s.detached


def _no_recipe(op: Any, s: Any, wanted: Node) -> RuntimeError:
    what = "" if wanted.op is op else f" (needed to recompute the saved output of {wanted.op})"
    if op is None and s.reason == "offloaded":  # a region input packed by hooks or offloaded
        return RuntimeError(
            f"ac2_dist: backward with create_graph=True needs the {s.owner}{what} with its autograd "
            "history, and what comes back from the CPU copy (or the saved-tensor hooks around the "
            "region) is its value only. A second-order backward through a block whose inputs are moved off "
            "the device is not supported: run it without Offload(block_inputs=True) and without "
            "saved-tensor hooks (such as save_on_cpu) around the checkpointed call."
        )
    if op is None:
        why = ("it is a value the region made and then wrote in place before reading it again, "
               "held as it was at that read")
    else:
        why = (f"{op} is never replayed ({s.reason.replace('_', ' ')}: a collective, FSDP, in-place "
               "or random op under rng='save' is kept from forward)")
    hint = " For random ops pass rng='replay' to the region." if s.reason == "rng" else ""
    return RuntimeError(
        f"ac2_dist: backward with create_graph=True needs the saved {s.owner}{what} with its autograd "
        f"history, and ac2_dist cannot recompute it: {why}. Differentiate this region once, or move "
        f"that op out of the checkpointed region.{hint}"
    )


def _gone(s: _WeakInput, wanted: Node) -> RuntimeError:
    if s.history:
        why = ("whose history ac2_dist cannot make again (the output of a custom autograd.Function, whose history "
               "is the Function's, or of an op it does not replay): it read that tensor by weak reference, and the "
               "program freed it after forward (what ac2_dist keeps of it for the first-order backward has no "
               "history)")
    else:
        why = ("kept from forward without a history and freed after it: nothing else read it, and ac2_dist does "
               "not keep such a tensor alive for a second-order backward alone")
    return RuntimeError(
        f"ac2_dist: backward with create_graph=True needs the saved output of {wanted.op} with its "
        f"autograd history, recomputed from the {s.owner} (shape {s.shape}), {why}. Use a policy that does not "
        f"save {wanted.op} in this region (the region then keeps what its replay needs), or keep a reference to "
        "that tensor until backward."
    )


def _stale(s: Any, wanted: Node) -> RuntimeError:
    return RuntimeError(
        f"ac2_dist: backward with create_graph=True needs the saved output of {wanted.op} with its "
        f"autograd history, recomputed from the {s.owner}, which was written in place after that op "
        f"read it (version {s.version} at that read); ac2_dist kept no copy of it for this. Use a policy "
        f"that does not save {wanted.op} in this region (the region then keeps what the replay needs), "
        "or write a clone of that tensor instead."
    )


def _constant_of(m: Node, j: int) -> Node | None:
    """The saved node whose slot ``j`` serves shadow ``m`` as it is: a value without a
    history in eager either (made from values that have none, as a value computed under
    ``no_grad`` is), which a recompute with history would give back unchanged."""
    original = m.original() if m.original is not None else None
    if original is None or original.saved is None:
        return None
    s = original.saved[j]
    return original if type(s) is Saved and not s.detached and isinstance(s.value, torch.Tensor) else None


def _plan(node: Node) -> list[Node]:
    """The nodes a recompute of ``node`` with history runs, ``node`` included, in program
    order: detached saved nodes (by their recipes), shadows and recomputable nodes with
    no value yet. Raises where a value it needs cannot serve (Note [A saved value keeps
    its recipe])."""
    todo: dict[int, Node] = {id(node): node}
    stack = [node]
    while stack:
        n = stack.pop()
        inp = n.inputs
        for k in range(1, len(inp), 3):
            m, j = inp[k], inp[k + 1]
            if id(m) in todo:
                continue
            saved = m.saved
            s = saved[j] if saved is not None else None
            if type(s) is _WeakInput:
                if s.detached:
                    raise _no_recipe(s.op, s, node)
                if s.alive() is None:
                    raise _gone(s, node)
                if s.stale():
                    raise _stale(s, node)
                continue
            if s is not None:
                if not _needs_history(s):
                    if type(s) is Saved and s.version is not None and s.hooks is None and not s.offloaded \
                            and s.device is None:
                        now = (s.counter if s.counter is not None else s.value)._version
                        if now != s.version:
                            raise _stale(s, node)
                    continue
                if not has_recipe(m):
                    raise _no_recipe(m.op, s, node)
            else:
                values = m.values
                if values is not None and values[j] is not None:
                    continue  # this backward's value (a shadow's, or the normal path's cache)
                if _constant_of(m, j) is not None:
                    continue
            todo[id(m)] = m
            stack.append(m)
    return _inputs_first(node, todo)


def _inputs_first(node: Node, todo: dict[int, Node]) -> list[Node]:
    """``todo`` in an order where every node comes after the nodes of ``todo`` it reads,
    ``node`` last. Not sequence order: a shadow is made when its saved node's consumer is
    recorded, so it carries a later sequence number than that consumer (Note [A recipe
    holds no saved value])."""
    order: list[Node] = []
    done: set[int] = set()
    stack: list[tuple[Node, bool]] = [(node, False)]
    while stack:
        n, expanded = stack.pop()
        if id(n) in done:
            continue
        if expanded:
            done.add(id(n))
            order.append(n)
            continue
        stack.append((n, True))
        inp = n.inputs
        for k in range(len(inp) - 2, 0, -3):  # inputs pushed last-first: run in argument order
            m = inp[k]
            if id(m) in todo and id(m) not in done:
                stack.append((m, False))
    return order


def _keep(n: Node, flat: list[Any]) -> None:
    """Hold what a recompute with history gave ``n``: a detached saved slot holds it from
    now on; a shadow keeps its values; each passes them to its counterpart."""
    original = n.original() if n.original is not None else None
    target = original if original is not None else n
    if target.saved is not None:
        for i, s in enumerate(target.saved):
            if _needs_history(s) and isinstance(flat[i], torch.Tensor):
                s.with_history(flat[i])
    shadow = n if n.original is not None else n.shadow
    if shadow is not None and shadow.values is None:
        shadow.values = list(flat)


def recompute_with_history(graph: _GraphBackward, node: Node, idx: int) -> None:
    """Give ``node[idx]`` -- a saved value held detached -- its autograd history: its
    recipe replayed with grad mode on, and first what that replay needs (Note [A saved
    value keeps its recipe]). Runs in the replay environment of a ``create_graph=True``
    backward (``InlineExecutor._realize``)."""
    s = node.saved[idx]
    if not has_recipe(node):
        raise _no_recipe(node.op, s, node)
    computed: dict[int, list[Any]] = {}

    def value_of(m: Node, j: int) -> tuple[Any, bool]:
        flat = computed.get(id(m))
        if flat is not None:
            return flat[j], True
        saved = m.saved
        if saved is not None and saved[j] is not None:
            return graph._saved_value(m, j), True
        values = m.values
        if values is not None and values[j] is not None:
            return values[j], True
        original = _constant_of(m, j)  # a shadow whose original holds a constant (_plan)
        assert original is not None
        return graph._saved_value(original, j), True

    for n in _plan(node):
        if n.no_grad:  # recorded under no_grad: its output has no history, as in eager
            with torch.no_grad():
                flat = graph._execute(n, value_of)
        else:
            flat = graph._execute(n, value_of)
        computed[id(n)] = flat
        if n.original is not None or n.saved is not None:
            _keep(n, flat)
    v = node.saved[idx].value
    if isinstance(v, torch.Tensor) and not v.requires_grad:
        _check_no_history(node, computed[id(node)], [value_of(m, j)[0] for m, j in zip(node.inputs[1::3],
                                                                                         node.inputs[2::3])])


def _check_no_history(node: Node, flat: list[Any], inputs: list[Any]) -> None:
    """A recompute with history gave ``node``'s output none: so did eager's if the op
    gave another output one (``native_layer_norm``'s mean and rstd) or read an input
    that has one (an integer op), or read none as an input (``rand_like``, ``zeros_like``
    read only its shape); else an input lost its history,
    which would silently drop second-order terms: an error."""
    if any(isinstance(o, torch.Tensor) and o.requires_grad for o in flat):
        return
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if not tensors or any(x.requires_grad for x in tensors):  # none read (``rand_like``, ``zeros_like``)
        return
    raise RuntimeError(
        f"ac2_dist: backward with create_graph=True needs the saved output of {node.op} with its autograd "
        "history, and its recompute read values that have none although that op's inputs had one in forward: "
        "values computed inside a custom autograd.Function's forward (under torch.vmap too), whose history is "
        "the Function's and which no replay of ATen ops makes again. Use a policy that does not save "
        f"{node.op} in this region, or keep the Function's output alive until backward."
    )


def prune_recipes(graph: Graph) -> None:
    """When forward ends, before the tensor map goes: release what only recipes reach
    (Note [A recipe holds no saved value])."""
    reached: set[int] = set()
    later: list[Node] = []
    stack: list[Node] = []
    for r in graph._handle_refs:
        h = r()
        if h is not None:
            stack.append(h.node)
    for chain in graph.rng_chains:  # a replay may run any of them (Note [One generator state per region])
        stack.extend(chain.nodes)
    while stack:
        n = stack.pop()
        if id(n) in reached:
            continue
        reached.add(id(n))
        saved = n.saved
        # Note [Node inputs are one flat tuple] (_nodes.py)
        if saved is None or n.rng is not None or any(x is None for x in saved):
            stack.extend(n.inputs[1::3])
        else:  # a saved node's recipe
            later.extend(n.inputs[1::3])
    stack = later
    made: dict[tuple[int, int], torch.Tensor] | None = None
    while stack:
        n = stack.pop()
        if id(n) in reached:
            continue
        reached.add(id(n))
        stack.extend(n.inputs[1::3])
        saved = n.saved
        if saved is None:
            continue
        recipe = has_recipe(n)
        for i, s in enumerate(saved):
            if type(s) is not Saved or s.hooks is not None or s.offloaded or s.device is not None:
                continue
            if s.detached and recipe:
                s.value = s.counter = s.version = None  # recomputed if a create_graph backward asks
            elif not recipe and _weakly_read(n, s):
                if made is None:
                    made = _made_tensors(graph)
                saved[i] = _WeakInput(s, made.get((id(n), i), s.value), n.op)


def _made_tensors(graph: Graph) -> dict[tuple[int, int], torch.Tensor]:
    """(id(node), output index) -> the tensor the program holds for it, from the tensor map."""
    made: dict[tuple[int, int], torch.Tensor] = {}
    entries = graph._entries
    if entries:
        for e in list(entries.values()):
            t = e()
            if t is not None:
                made[id(e.node), e.idx] = t
    return made
