"""The tracer's general-path steps that run outside the body of its
``__torch_dispatch__``: higher-order operators, the writes an op makes (snapshots,
stale views, fresh outputs, writes through views), literals, and the recomputable
node of an op with its argument walk. :class:`~._tracer.Tracer` inherits them from
:class:`_GeneralPath` (the methods moved verbatim from _tracer.py, where the Notes
they cite without a file name live: Note [Versions of written tensors] in _tracer.py,
Note [Aliases a schema does not declare] in _tracer.py). The hot path,
``Tracer.__torch_dispatch__``, stays in _tracer.py and is unchanged: it calls these
as ``self._...`` exactly as before."""

from __future__ import annotations

import torch

from .._policy import _Frame, is_save, resolve
from ..side_effects import _INFO, hop_writes, op_info
from ._graph import Graph
from ._history import recipe_input
from ._nodes import Node, Saved, version_of
from ._writes import is_literal, stale_view

__all__: list[str] = []

_CP = torch.utils.checkpoint.CheckpointPolicy
_Tensor = torch.Tensor
# Tensors a replay can stand in for by an empty tensor of the same metadata (no subclass).
_PLAIN = (_Tensor, torch.nn.Parameter)
# ``Node.args`` of an op whose positional arguments are all tensors (or None).
_NONES = tuple((None,) * n for n in range(8))


def _list_refs(graph: Graph, pos: int | str, seq: list | tuple, allow: bool, reads: bool = True) -> tuple[list, tuple]:
    """A ``Tensor[]`` argument at ``pos``: the list with its tensors replaced by None, and
    the flat ``((pos, k), producer, idx, ...)`` inputs of those tensors (``reads``: count
    the node as a reader of each)."""
    lst = list(seq)
    refs: list = []
    for k, e in enumerate(seq):
        if isinstance(e, _Tensor):
            m, j = graph.ref(e, allow)
            if reads:
                m.readers += 1
            else:
                m = recipe_input(graph, m, j, e)
            refs += ((pos, k), m, j)
            lst[k] = None
    return lst, tuple(refs)


class _GeneralPath:
    """The general path's steps of :class:`~._tracer.Tracer` (it sets ``graph``,
    ``frames``, ``ctx`` and ``_made_by``)."""

    def _higher_order(self, func, args, kwargs):
        """A HigherOrderOperator call: a saved node, never replayed (Note
        [Higher-order operators] in side_effects.py)."""
        leaves = torch.utils._pytree.tree_leaves
        frames = self.frames
        inner = frames[-1]
        writes = hop_writes(func, args, kwargs)
        inputs = [t for t in leaves((args, kwargs)) if isinstance(t, _Tensor)] if writes else ()
        if writes:
            self._snapshot_read(inputs)
        out = func(*args, **kwargs)
        ctx = self.ctx
        ctx.op_output, ctx.module_fqn = out, inner.module_fqn
        try:
            decision = resolve(frames, ctx, func, args, kwargs)
        finally:
            ctx.op_output = None
        if decision is _CP.MUST_RECOMPUTE:
            raise RuntimeError(
                f"ac2_dist: the policy returned MUST_RECOMPUTE for the higher-order operator {func}, "
                "which ac2_dist records as one saved call and never replays. Return a save or "
                "PREFER_* policy for it."
            )
        if not is_save(decision):
            decision = _CP.MUST_SAVE
        graph = self.graph
        flat = leaves(out)
        node = graph.new_node(func, len(flat), inner.module_fqn)
        graph.stats.saved_nodes += 1
        for i, o in enumerate(flat):
            if isinstance(o, _Tensor):
                node.set_saved(i, Saved(o, decision, reason="policy", allow_mutation=inner.allow_mutation,
                                        keep_identity=False, owner=f"output of {func}",
                                        offload=graph.offload, user_hooks=graph.user_hooks))
                graph.map.set(o, node, i, version_of(o))
        graph.held.add(node)  # Note [Held values are found by storage] (_writes.py)
        returned = {id(o) for o in flat}
        for t in inputs:
            if id(t) not in returned:
                graph.leaf(t, _CP.MUST_SAVE, "side_effect", inner.allow_mutation, f"tensor written by {func}")
        if graph.observer is not None:
            graph.observer(node, func, args, kwargs, out)
        return out

    def _before_writes(self, info, args, kwargs) -> dict[int, torch.Tensor]:
        """The tensors this op writes (by id); snapshot held values replays still need
        (Note [Versions of written tensors])."""
        written: dict[int, torch.Tensor] = {}
        made_by = self._made_by = {}  # id -> op that made a written tensor (error names, leaves)
        gmap = self.graph.map
        for pos in info.written:
            stack = [args[pos] if type(pos) is int and pos < len(args) else kwargs.get(pos)]
            while stack:  # a tensor, a list of tensors or (allgather_) a list of lists
                w = stack.pop()
                if isinstance(w, _Tensor):
                    written[id(w)] = w
                    e = gmap.get(w)
                    if e is not None and e.node.op is not None:
                        made_by[id(w)] = e.node.op
                elif isinstance(w, (list, tuple)):
                    stack.extend(w)
        self._snapshot_read(written.values())
        self.graph.held.before_write(written.values())  # Note [Held values are found by storage] (_writes.py)
        return written

    def _refresh_stale_views(self, written: dict[int, torch.Tensor], frame: _Frame) -> None:
        """A written view that an earlier write through another alias made stale is
        re-made from its base's current value first, so the write can be replayed
        (Note [Writes inside a region] in _writes.py, 3)."""
        gmap = self.graph.map
        for t in written.values():
            if t._is_view():
                e = gmap.get(t)
                if e is not None and e.version is not None and e.version != t._version:
                    stale_view(self.graph, t, frame.module_fqn)

    def _fresh(self, written: dict[int, torch.Tensor]) -> bool:
        """Every written tensor is the current, unsaved output of an op of this region,
        not a view and never viewed (Note [Replaying writes to fresh tensors])."""
        gmap = self.graph.map
        for t in written.values():
            e = gmap.get(t)
            if e is None or e.version != t._version or t._is_view():
                return False
            node, idx = e.node, e.idx
            # Views of it and reads of it before the write are fine: the replay copies what
            # others still need (Note [Writes inside a region] in _writes.py). A literal
            # Python made in the region is a value the region made.
            if not is_literal(node, idx) and (node.op is None or node.aliased or node.cut or (
                node.saved is not None and node.saved[idx] is not None
            )):
                return False
            partner = node.alias_of
            if partner is not None:  # Note [Aliases a schema does not declare]
                m, j = partner
                if (m.op is None or m.viewed or m.cut or m.readers != 1 or m.held
                        or (m.saved is not None and m.saved[j] is not None)):
                    return False
        return True

    def _written_view(self, written: dict[int, torch.Tensor], args: tuple, kwargs: dict) -> tuple | None:
        """``(base, node, idx, steps)`` when the one tensor this op writes is a view of a
        fresh value that only views have read (Note [Writes through views of fresh
        tensors]); ``None`` otherwise. ``steps`` replays the view from the base."""
        (w,) = written.values()
        base = w._base
        if base is None:
            return None
        gmap = self.graph.map
        e, eb = gmap.get(w), gmap.get(base)
        if e is None or eb is None or e.version != w._version or eb.version != base._version:
            return None
        node, idx = e.node, e.idx
        steps: list[tuple] = []
        while True:
            if node is eb.node and idx == eb.idx and is_literal(node, idx):
                break  # a literal's view (Note [Writes inside a region] in _writes.py)
            # Reads of the base or of a view before the write are fine (Note [Writes inside
            # a region] in _writes.py); a value autograd holds is not (eager's own check).
            if (node.op is None or node.cut or node.held
                    or (node.saved is not None and node.saved[idx] is not None)):
                return None
            if node is eb.node and idx == eb.idx:
                break
            if node.via is not None:  # the view an earlier replayable write returned
                if idx != 0 or node.nout != 2:
                    return None
                steps[:0] = node.via
                idx = 1
                continue
            if getattr(node.op, "ac2_conversion", False):  # not an ATen view to replay the write through
                return None  # (Note [Wrapper subclasses made and unwrapped outside dispatch] in _subclass_wraps.py)
            src = (_INFO.get(id(node.op)) or op_info(node.op)).view_src
            if src is None or node.lists or len(node.inputs) != 3 or node.inputs[0] != src:
                return None
            # (op, args, kwargs, source position, output index): multi-output views
            # (split, unbind, chunk) return a list, the step takes its output ``idx``.
            steps.insert(0, (node.op, node.args, node.kwargs, src, idx if node.nout > 1 else None))
            _, node, idx = node.inputs
        if node.aliased or node.alias_of is not None:
            return None
        return base, node, idx, tuple(steps)

    @staticmethod
    def _rebase(node: Node, via: tuple) -> None:
        """Make a write through a view read the view's base instead (Note [Writes through
        views of fresh tensors]): the replay rebuilds the view from the base's value."""
        _, m, j, steps = via
        inputs = list(node.inputs)
        for k in range(0, len(inputs), 3):
            if inputs[k] in node.writes:
                inputs[k + 1].readers -= 1
                m.readers += 1
                inputs[k + 1], inputs[k + 2] = m, j
        node.inputs = tuple(inputs)  # Note [Node inputs are one flat tuple] (_nodes.py)
        node.via = steps

    def _snapshot_read(self, tensors) -> None:
        """Before ``tensors`` are written: snapshot the held values of theirs that a
        replay reads (Note [Versions of written tensors])."""
        gmap = self.graph.map
        for t in tensors:
            e = gmap.get(t)
            if e is not None and (e.version is None or e.version == t._version):
                node, idx = e.node, e.idx
                while True:  # t, and the values it aliases (Note [Aliases a schema does not declare])
                    if node.readers and node.saved is not None and node.saved[idx] is not None:
                        node.saved[idx].snapshot()
                    if node.alias_of is None:
                        break
                    node, idx = node.alias_of

    def _literal(self, func, t: torch.Tensor, frame: _Frame) -> torch.Tensor:
        """``aten.lift_fresh`` of a small literal Python made: the literal becomes a leaf
        remembered by value (Note [Writes inside a region] in _writes.py), and the op's
        output (``t`` itself) that leaf."""
        out = func(t)
        self.graph.literal_leaf(t, frame.module_fqn)
        if out is not t:
            e = self.graph.map.get(t)
            self.graph.map.set(out, e.node, 0, version_of(out))
        return out

    @staticmethod
    def _recomputable(graph: Graph, func, info, args, kwargs, nout, frame, scratch=(), same=(),
                      shape_only=(), reads=True) -> Node:
        # Note [Node inputs are one flat tuple] (_nodes.py), in argument order. Built by
        # tuple concatenation (arguments are few); a tensor list (cat of many) in one step.
        # The node is made after the walk: a leaf the walk makes for an unknown argument
        # gets the lower seq, as in program order (and as on the plain-op path).
        # ``reads`` False: a saved op's recipe (Note [A saved value keeps its recipe] in
        # _history.py), which no replay of the normal path reads: its arguments do not
        # count it as a reader (nor as a view taken of them).
        inputs: tuple = ()
        allow = frame.allow_mutation
        targs = None  # args with tensors replaced by None, made only if some are not tensors
        view_src = info.view_src
        gmap_get = graph.map._d.get
        zeroed: tuple = ()  # Note [Statistics an op accumulates] (side_effects.py)
        like: tuple = ()
        lists = False  # args/kwargs hold lists with tensor slots
        for i, a in enumerate(args):
            if isinstance(a, _Tensor):
                if scratch and i in scratch:
                    zeroed += ((i, a.shape, a.dtype, a.device),)
                    continue
                if same and i in same:  # filled with the written tensor (Note [Writes inside a region])
                    continue
                if i in shape_only and type(a) in _PLAIN:  # Note [Arguments read for their shape] (_writes.py)
                    like += ((i, tuple(a.size()), tuple(a.stride()), a.dtype, a.device),)
                    continue
                e = gmap_get(id(a))
                if e is not None and e() is a and ((v := e.version) is None or v == a._version):
                    m, j = e.node, e.idx  # Graph.ref, inlined: the common case
                else:
                    m, j = graph.ref(a, allow)
                if reads:
                    m.readers += 1
                    if i == view_src:
                        m.viewed = True
                        m.viewers += 1
                else:
                    m = recipe_input(graph, m, j, a)
                inputs += (i, m, j)
            elif a is not None:
                if targs is None:
                    targs = [None if isinstance(t, _Tensor) else t for t in args]
                if info.has_tensor_lists and type(a) in (list, tuple):
                    targs[i], refs = _list_refs(graph, i, a, allow, reads)
                    inputs += refs
                    lists = lists or bool(refs)
        tkw = None
        if kwargs:
            tkw = dict(kwargs)
            for k, v in kwargs.items():
                if isinstance(v, _Tensor):
                    tkw[k] = None
                    if same and k in same:
                        continue
                    m, j = graph.ref(v, allow)
                    if reads:
                        m.readers += 1
                    else:
                        m = recipe_input(graph, m, j, v)
                    inputs += (k, m, j)
                elif info.has_tensor_lists and type(v) in (list, tuple):
                    tkw[k], refs = _list_refs(graph, k, v, allow, reads)
                    inputs += refs
                    lists = lists or bool(refs)
        n = len(args)
        # Note [Rare node fields live in a lazy dict] (_nodes.py): all-tensor arguments
        # share one tuple of Nones per length; the rare fields are set only when needed.
        node = graph.new_node(
            func, nout, frame.module_fqn, inputs,
            tuple(targs) if targs is not None else _NONES[n] if n < len(_NONES) else (None,) * n,
        )
        if tkw is not None:
            node.kwargs = tkw
        if zeroed:
            node.scratch = zeroed
        if like:
            node.like = like
        if lists:
            node.lists = True
        return node

