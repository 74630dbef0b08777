"""The tracer: a TorchDispatchMode that records every ATen op of a region.

This is the hot path: ``__torch_dispatch__`` runs once per op. Everything that
depends only on the operator comes from the cached :class:`~.side_effects.OpInfo`;
the built-in string and save-list policies are decided without a Python call; the
argument walk only looks inside lists when the schema has ``Tensor[]`` arguments.

Note [What the tracer decides per op]
    1. Ignored metadata ops (``SAC_IGNORED_OPS``) are recomputable and the policy is
       not asked (as torch's selective checkpoint does).
    2. Otherwise the nested policies are resolved (``_policy.resolve``).
    3. Side effects override the policy (side_effects.py): collectives, FSDP ops, ops
       that write an input, opaque ops and RNG ops under ``rng="save"`` are saved; a
       MUST_RECOMPUTE for one of them is an error naming the op.
    4. A saved node keeps its outputs and drops its arguments (recompute never goes
       past it); a recomputable node keeps its arguments as references to the
       producing node outputs and keeps no output.
    5. Every tensor an op writes becomes a new version: the map now points it at a
       saved node holding the post-op value (see Note [Saved values are
       version-checked references] in _graph.py).

Note [Versions of written tensors]
    The tracer runs below autograd's ADInplaceOrView key, which bumps the version of
    every tensor an op writes (schema ``(a!)``) *after* the op returns to it. So the
    version recorded for a written tensor is ``_version + 1``; otherwise the very next
    use would look stale. Writes a schema hides (batch-norm stats, c10d) bump nothing.
    Before an op writes a tensor whose current value is held by reference (a region
    input or a saved output) and that a recomputable op already read, that value is
    snapshotted (cloned): the replay needs the value before the write (e.g. autograd's
    own ``self.clone()`` saved for ``mul_``'s backward).

Note [Versions of view outputs]
    For the same reason a view op's output reaches the tracer with a fresh version
    counter: ADInplaceOrView makes it a view (sharing its base's counter) only after
    the op returns. So the version recorded for a view output is its source
    argument's, and a saved view output is guarded by (an alias of) its source, whose
    counter is the one the view will share. Without this every ``weight.t()`` after an
    optimizer step looked stale and became a region input, and a mutation of a saved
    view's base went unnoticed.

Note [Aliases a schema does not declare]
    Some ops return a tensor that shares its input's storage without saying so in their
    schema and without being an autograd view: ``aten._unsafe_view`` (what
    ``torch.matmul`` of a 3-d input returns). A write to such an output also writes its
    input, and a replay of the write writes into the replayed input too. So an op whose
    output shares the storage of its first argument records that partner
    (``Node.alias_of``; the partner is marked ``aliased``). A write to the partner is a
    side effect; a write to the alias is replayable only while the partner is a
    recomputed value nothing else reads or saves (no other recorded reader, no
    autograd handle): then, in a replay, the partner's value is consumed by the alias
    alone and writing into it disturbs nothing (matmul's internal ``mm`` output).
    Otherwise the write is a side effect (Note [Replaying writes to fresh tensors] in
    _graph.py). ATen's pointwise ops with their own kernel (not composite ones) allocate
    their outputs (``OpInfo.fresh_output``): they skip the storage comparison, two
    ``data_ptr()`` calls per recorded op.

Note [The plain-op path]
    Most ops of a model are ``OpInfo.plain``: ATen pointwise kernels that write nothing,
    alias nothing, draw no random numbers and return one new tensor. For one of them,
    with no tensor subclass involved, one policy frame whose answer does not need the
    op's output (a string policy or a save-list/dict) and that answer "recompute", every
    step of Note [What the tracer decides per op] is known before the op runs: no side
    effect, no write, no version bump, no alias check, no rng chain. The tracer records
    such an op right after calling it (a recomputable node and its map entry, made in
    one call: ``Graph.new_node(..., fresh=out)``; the entry's version is 0, the counter
    of storage the kernel just allocated, without reading ``out._version``, an attribute
    read of ~550 instructions) and skips the general path's checks; anything else (a
    save, a policy function, nested frames, a memory budget's observer) takes the
    general path; so does an op called with keyword-only arguments (gelu's
    ``approximate``, add's ``alpha``): the walk here reads positional arguments only
    (recording them here too, with ``**kwargs`` passed on every call, measured 1 % more
    instructions per op on ops that have none). Both paths record the same graph, seqs
    included (a leaf the walk makes precedes its reader). Both paths call the op through
    ``OpInfo.call``, the C++ callable behind ``OpOverload.__call__``: that Python method
    only forwards its arguments, one frame per op saved. On torch 2.14+ it forwards to
    one of two attributes, which are the same object unless the op has a Python
    dispatcher (``OpInfo.guarded``): the tracer checks that identity per call and calls
    the op itself when they differ. What the tracer reads of the thread's state per op
    (the frame list, the replay counter) it holds directly. Where the C extension was
    built, this path (and the common cases of ``Graph.pack``) runs in C: Note [The
    plain-op path in C] in _crecord.c. This method stays the reference (tests record
    every model with both and compare the graphs) and the fallback for everything else.

Note [Dynamo inside a region]
    TorchDispatchMode wraps ``__torch_dispatch__`` in a dynamo-disable shim (~4 us per
    op). The tracer opts out of the shim and instead marks its code objects "skip,
    recursively" once (:func:`~.compile.skip_dynamo`): dynamo never converts them, even when
    a compiled function calls into the mode at run time (eager flex_attention runs
    a compiled wrapper that dispatches a higher-order op to the active mode). If
    dynamo traces a region anyway (a mode active while tracing), ops pass through.

Note [What inference mode records]
    Nothing computed under ``torch.inference_mode()`` inside a region can be
    differentiated, but a later op of the region may read what it made (``x + t`` with
    ``t`` drawn there): torch's checkpoint makes it again in its recompute and keeps
    nothing of it, so an op run there is recorded as a recomputable node -- a constant
    the region makes, replayed if a replay needs it -- its outputs mapped with no
    version (inference tensors have no version counter). A random one joins its
    generator's chain under ``rng="replay"``. Left unrecorded, as before: a random op
    under ``rng="save"`` and an op that writes, or that takes a tensor subclass or a
    higher-order operator (its outputs become region inputs, held, if a later op reads
    them).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._device import default_generator
from .._policy import PolicyContext, _Frame, is_save, resolve
from ..compile import COMPILER_STATE as _COMPILER
from ..compile import skip_dynamo as _skip_dynamo
from ..side_effects import _INFO, OpInfo, SideEffect, op_info
from ._collective_probe import _COMMUNICATING, _CollectiveProbe
from ._graph import Graph
from ._nodes import NO_KWARGS, Handle, MapEntry, Node, Saved, alias, flatten_outputs, version_of
from ._subclass_wraps import note_inner, refuse_hidden_write
from ._tracer_general import _NONES, _GeneralPath
from ._writes import literal, overwritten, write_aliases

_CP = torch.utils.checkpoint.CheckpointPolicy
_Tensor = torch.Tensor
_inference_mode = torch.is_inference_mode_enabled
_grad_enabled = torch.is_grad_enabled


def _any_requires_grad(values: Any) -> bool:
    """Some tensor among ``values`` (or in a list or tuple of them) requires grad."""
    for a in values:
        if isinstance(a, _Tensor):
            if a.requires_grad:
                return True
        elif type(a) in (list, tuple) and any(isinstance(b, _Tensor) and b.requires_grad for b in a):
            return True
    return False
_weakref = weakref.ref
# Enum members as module constants: ``_CP.MUST_RECOMPUTE`` is a class attribute lookup
# through the enum's metaclass, ~5x a global's cost, once per recorded op.
_MUST_RECOMPUTE = _CP.MUST_RECOMPUTE
_RECOMPUTE = (_CP.PREFER_RECOMPUTE, False)  # an op a save-list does not name (and ignored ops)
_NONE = SideEffect.NONE
_MUTATION = SideEffect.MUTATION
# What an op may return without being opaque (anything else, e.g. a Work handle, is).
_KNOWN_RESULTS = (
    _Tensor, int, float, bool, complex, torch.SymInt, torch.SymFloat, torch.SymBool, torch.dtype, torch.device,
)


def _rng_device(args: tuple, kwargs: dict) -> torch.device:
    for a in args:
        if isinstance(a, _Tensor):
            return a.device
    dev = kwargs.get("device")
    return torch.device(dev) if dev is not None else torch.device("cpu")


class Tracer(_GeneralPath, TorchDispatchMode):
    """Records the ops of one outermost region into a :class:`Graph`."""

    # Higher-order operators reach __torch_dispatch__ (Note [Higher-order operators]).
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Off while torch compiles something inside a region (Note [Dynamo inside a
        # region]); a compiled artifact's saved tensors reach the region's pack hook
        # as values it did not record: region inputs, saved.
        return True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Note [Dynamo inside a region]: no per-call shim; the code is marked skipped.
        return False

    def __init__(self, graph: Graph, state: Any, ctx: PolicyContext) -> None:
        super().__init__()
        self.graph = graph
        # Note [The plain-op path]: what the tracer reads of the thread's state per op,
        # held directly (the list is mutated in place, never rebound).
        self.frames = state.frames
        self.replaying = state.replaying
        self.ctx = ctx
        self.probe = _CollectiveProbe()
        self._made_by: dict[int, Any] = {}  # of the write being recorded (_before_writes)

    @_skip_dynamo
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: C901 - hot path
        if kwargs is None:
            kwargs = {}
        if self.replaying.depth or _COMPILER._is_compiling_flag:  # Note [Dynamo inside a region]
            return func(*args, **kwargs)
        if _inference_mode():  # Note [What inference mode records]
            return self._inference_op(func, types, args, kwargs)
        info = _INFO.get(id(func)) or op_info(func)
        frames = self.frames
        if info.plain and not types and not kwargs and len(frames) == 1:  # Note [The plain-op path]
            inner = frames[0]
            decision = inner.const
            if decision is not None:
                save = inner.const_save
            elif inner.by_id is not None:
                decision, save = inner.by_id.get(id(func), _RECOMPUTE)
            else:
                save = True  # a policy function: asked below, with the op's output
            graph = self.graph
            if not save and graph.observer is None:
                if info.guarded and func._op is not info.call:
                    out = func(*args)
                else:
                    out = info.call(*args)
                # The argument walk of _recomputable for positional arguments only:
                # plain ops have no list, view source or accumulator argument.
                gmap_get = graph.map._d.get
                inputs: tuple = ()
                i = 0
                scalars = False
                for a in args:
                    if isinstance(a, _Tensor):
                        e = gmap_get(id(a))
                        if e is not None and e() is a and ((v := e.version) is None or v == a._version):
                            m = e.node
                            inputs += (i, m, e.idx)
                        else:
                            m, j = graph.ref(a, inner.allow_mutation)
                            inputs += (i, m, j)
                        m.readers += 1
                    elif a is not None:
                        scalars = True
                    i += 1
                # Note [Rare node fields live in a lazy dict] (_nodes.py)
                node = graph.new_node(
                    func, 1, inner.module_fqn, inputs,
                    tuple([None if isinstance(a, _Tensor) else a for a in args]) if scalars
                    else _NONES[i] if i < len(_NONES) else (None,) * i,
                    out,
                )
                if decision is _MUST_RECOMPUTE:
                    node.must_recompute = True
                return out
        if info.higher_order:
            return self._higher_order(func, args, kwargs)
        inner = frames[-1]
        if info.view_src is not None and not types and (lit := literal(func, args)) is not None:
            if self.graph.map.get(lit) is None:  # Note [Writes inside a region] (_writes.py)
                return self._literal(func, lit, inner)

        rng = None
        writes = info.written and info.writes(args)
        fresh = accum = over = False
        written = via = aliases = None
        if writes:
            written = self._before_writes(info, args, kwargs)
            if types:  # Note [Wrapper subclasses made and unwrapped outside dispatch] (_subclass_wraps.py)
                refuse_hidden_write(self.graph, written.values(), func, inner.module_fqn)
            if info.accumulators:  # Note [Statistics an op accumulates] (side_effects.py)
                accum = info.accumulates(args)
            elif info.overwrites and overwritten(info, written, args, kwargs):
                over = True  # Note [Writes that overwrite] (_writes.py)
            elif info.declared_writes and info.side_effect is _MUTATION and not info.written_lists:
                self._refresh_stale_views(written, inner)
                fresh = self._fresh(written)
                if not fresh and len(written) == 1:  # Note [Writes through views of fresh tensors]
                    via = self._written_view(written, args, kwargs)
                    fresh = via is not None
                if fresh:  # Note [Writes inside a region] (_writes.py): arguments on the written storage
                    aliases = write_aliases(written, via[0] if via is not None else (
                        next(iter(written.values())) if len(written) == 1 else None), args, kwargs, info.written)
                    if aliases is None:
                        fresh, via = False, None
        random = info.is_rng and info.is_random(args, kwargs)
        if random and inner.rng == "replay" and (fresh or not writes):
            gen = info.generator(args, kwargs) or default_generator(_rng_device(args, kwargs))
            rng = self.graph.rng_chain(gen)  # Note [One generator state per region] (_graph.py)

        hidden = None
        if types:  # a tensor subclass will dispatch further (Note [Subclasses hide collectives] in _collective_probe.py)
            probe = self.probe
            probe.hit = None
            with probe:
                out = func(*args, **kwargs)
            hidden = probe.hit
        elif info.guarded and func._op is not info.call:
            out = func(*args, **kwargs)
        else:
            out = info.call(*args, **kwargs)

        # ---- decide (Note [What the tracer decides per op]) ----------------------
        if info.ignored:
            decision, save = _RECOMPUTE
        elif len(frames) == 1 and inner.const is not None:
            decision, save = inner.const, inner.const_save
        elif len(frames) == 1 and inner.by_id is not None:  # a save-list / dict policy
            decision, save = inner.by_id.get(id(func), _RECOMPUTE)
        else:
            ctx = self.ctx
            ctx.op_output = out
            ctx.module_fqn = inner.module_fqn
            try:
                decision = resolve(frames, ctx, func, args, kwargs)
            finally:
                ctx.op_output = None
            save = is_save(decision)

        single = isinstance(out, _Tensor)
        flat = (out,) if single else flatten_outputs(out)
        replayable = fresh or accum or over  # a write that is not a side effect
        side = _NONE if replayable else info.side_effect
        reason = "policy"
        if side is _NONE:
            if hidden is not None:
                side = SideEffect.COLLECTIVE
            elif writes and not replayable:
                side = SideEffect.MUTATION
            elif random and rng is None:
                side = SideEffect.RNG
            elif not single and any(
                o is not None and not isinstance(o, _KNOWN_RESULTS) for o in flat
            ):
                side = SideEffect.OPAQUE
        if side is not _NONE:
            reason = "rng" if side is SideEffect.RNG else "side_effect"
            if side in _COMMUNICATING:
                self.graph.stats.collectives += 1
            if decision is _CP.MUST_RECOMPUTE:
                hint = " (or pass rng='replay' to the region)" if side is SideEffect.RNG else ""
                via = f" (its tensor subclass issued {hidden})" if hidden is not None else ""
                raise RuntimeError(
                    f"ac2_dist: the policy returned MUST_RECOMPUTE for {func}, which is a "
                    f"{side.value} op{via} and is never replayed during backward: its output is kept from forward. "
                    f"Return a save or PREFER_* policy for it{hint}."
                )
            if not save:
                decision, save = _CP.MUST_SAVE, True

        graph = self.graph
        gmap = graph.map
        bump = 1 if writes and info.declared_writes else 0
        src = None
        if info.view_src is not None:  # Note [Versions of view outputs]
            src = args[info.view_src]
            view_version = version_of(src)
        if not save:
            # Note [Writes inside a region] (_writes.py): arguments that are the written
            # tensor itself read the written tensor in the replay, not an input of their own.
            same, rebuilt = aliases if fresh else ((), ())
            node = self._recomputable(graph, func, info, args, kwargs, len(flat) + (via is not None), inner,
                                      info.accumulators if accum else (), same + tuple(r[0] for r in rebuilt),
                                      (0,) if over else info.shape_only)
            if same:
                node.same = same
            if rebuilt:
                node.rebuilt = rebuilt
            if rng is not None:
                node.rng = (rng.index, len(rng.nodes))
                rng.nodes.append(node)
            if decision is _MUST_RECOMPUTE:  # Note [Rare node fields live in a lazy dict] (_nodes.py)
                node.must_recompute = True
            if fresh:  # Note [Replaying writes to fresh tensors] (_graph.py)
                node.writes = info.written
                if via is not None:
                    self._rebase(node, via)
        else:
            via = None  # saved: the base is not remapped (its next use is a new version)
            if src is not None:
                e = gmap.get(src)
                if e is not None:
                    e.node.viewed = True
            # Whether autograd gives the outputs a history (it does so after this mode
            # returns: their requires_grad is not set yet here).
            history = _grad_enabled() and (_any_requires_grad(args) or bool(kwargs)
                                           and _any_requires_grad(kwargs.values()))
            if rng is not None:  # Note [A saved random op stays in its chain] (_graph.py)
                node = self._recomputable(graph, func, info, args, kwargs, len(flat), inner,
                                          shape_only=info.shape_only)
                node.rng = (rng.index, len(rng.nodes))
                rng.nodes.append(node)
            elif side is _NONE and not writes:  # Note [A saved value keeps its recipe] (_history.py)
                node = self._recomputable(graph, func, info, args, kwargs, len(flat), inner,
                                          shape_only=info.shape_only, reads=False)
                graph.has_recipes = True
                if not _grad_enabled():
                    node.no_grad = True
            else:
                if random:  # drawn outside a chain (rng="save"): chains restart after it
                    graph.open_chains.clear()
                node = graph.new_node(func, len(flat), inner.module_fqn)
            graph.stats.saved_nodes += 1
            keep_base = not info.returns_alias
            counter = alias(src) if src is not None and view_version is not None else None
            for i, o in enumerate(flat):
                if isinstance(o, _Tensor):
                    keep = keep_base and not (o.is_floating_point() or o.is_complex())
                    if src is not None:
                        version = view_version
                    else:
                        version = o._version + bump if bump and id(o) in written else None
                    node.set_saved(
                        i,
                        Saved(o, decision, reason=reason, allow_mutation=inner.allow_mutation,
                              keep_identity=keep, owner=info.owner, version=version,
                              counter=counter, offload=graph.offload, user_hooks=graph.user_hooks,
                              history=history),
                    )
            graph.held.pending.append(_weakref(node))  # Note [Held values are found by storage] (_writes.py)

        if (
            single and src is None and not writes and not types and not info.returns_alias
            and not info.fresh_output and args and isinstance(args[0], _Tensor)
        ):  # Note [Aliases a schema does not declare]: does out start where args[0]'s data does?
            a0 = args[0]
            try:
                shared = out.data_ptr() == a0.data_ptr() and a0.numel() > 0
            except (RuntimeError, NotImplementedError):  # no storage (sparse, wrappers of collectives)
                shared = False
            if shared:
                e = gmap.get(a0)
                if e is None:
                    node.viewed = node.aliased = True
                else:
                    node.alias_of = (e.node, e.idx)
                    e.node.aliased = True
        if single and src is None and not bump:
            gmap.set(out, node, 0, out._version)  # the common case of the loop below
        else:
            for i, o in enumerate(flat):
                if isinstance(o, _Tensor):
                    if src is not None:
                        gmap.set(o, node, i, view_version)
                    else:
                        gmap.set(o, node, i, o._version + bump if bump and id(o) in written else o._version)
        if via is not None:  # the base is the write's last output
            base = via[0]
            gmap.set(base, node, len(flat), base._version + bump)
        if types:  # Note [Wrapper subclasses made and unwrapped outside dispatch] (_subclass_wraps.py)
            note_inner(graph, flat)

        if writes and not (fresh or over):
            returned = {id(o) for o in flat if isinstance(o, _Tensor)}
            for t in written.values():
                if id(t) not in returned:
                    made = self._made_by.get(id(t))
                    owner = (f"value made in the region by {made}, then written by {func}" if made
                             else f"tensor written by {func}")
                    graph.leaf(t, _CP.MUST_SAVE, "side_effect", inner.allow_mutation, owner, t._version + bump,
                               made_here=made is not None)
        if graph.observer is not None:  # a calibrating memory budget (budget.py)
            graph.observer(node, func, args, kwargs, out)
        return out

    def _inference_op(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        """An op under ``torch.inference_mode()`` (Note [What inference mode records])."""
        info = _INFO.get(id(func)) or op_info(func)
        inner = self.frames[-1]
        random = info.is_rng and info.is_random(args, kwargs)
        if types or info.higher_order or (info.written and info.writes(args)) or info.side_effect is not _NONE \
                and not random or (random and inner.rng != "replay"):
            if info.is_rng:
                self.graph.open_chains.clear()  # an unrecorded draw: chains restart after it
            return func(*args, **kwargs)
        graph = self.graph
        rng = None
        if random:
            gen = info.generator(args, kwargs) or default_generator(_rng_device(args, kwargs))
            rng = graph.rng_chain(gen)  # Note [One generator state per region] (_graph.py)
        out = func(*args, **kwargs)
        flat = (out,) if isinstance(out, _Tensor) else flatten_outputs(out)
        if not all(o is None or isinstance(o, _Tensor) for o in flat):
            graph.open_chains.clear()
            return out
        node = self._recomputable(graph, func, info, args, kwargs, len(flat), inner, shape_only=info.shape_only)
        if rng is not None:
            node.rng = (rng.index, len(rng.nodes))
            rng.nodes.append(node)
        for i, o in enumerate(flat):
            if isinstance(o, _Tensor):
                graph.map.set(o, node, i, version_of(o))
        return out


def _c_recorder() -> Any:
    """The C recorder's module (Note [The plain-op path in C] and Note [The pack hook in
    C] in _crecord.c), or None: the extension was not built (no C compiler at install
    time) or ``AC2_DIST_PURE_PYTHON`` is set to anything but ``0`` (then the Python
    recorder records, the same graphs, slower)."""
    if os.environ.get("AC2_DIST_PURE_PYTHON", "0") != "0":
        return None
    try:
        from . import _crecord
    except ImportError:
        return None
    for cls, fields in ((Node, _crecord.NODE_FIELDS), (MapEntry, _crecord.ENTRY_FIELDS),
                        (Handle, _crecord.HANDLE_FIELDS)):
        slots = set(cls.__slots__) - {"__dict__", "__weakref__"}
        if slots != set(fields):
            raise ImportError(
                f"ac2_dist: the built C recorder (ac2_dist/_trace/_crecord*.so) sets {cls.__name__} fields "
                f"{sorted(fields)} but the class has {sorted(slots)}: it was built from another "
                "version of the sources. Rebuild it (pip install -e .), or set AC2_DIST_PURE_PYTHON=1."
            )
    return _crecord


_C = _c_recorder()
#: The Python method (the C recorder falls back to it for everything but plain ops).
PY_DISPATCH = Tracer.__torch_dispatch__
#: The C recorder's ``__torch_dispatch__`` in use, or None (then it is PY_DISPATCH).
C_DISPATCH = None if _C is None else _C.Dispatch(
    slow=PY_DISPATCH, info=_INFO, tensor=_Tensor, compiler=_COMPILER, inference=_inference_mode,
    recompute=_RECOMPUTE, must_recompute=_MUST_RECOMPUTE, nones=_NONES, no_kwargs=NO_KWARGS, node=Node,
    entry=MapEntry, opinfo=OpInfo, frame=_Frame,
)
if C_DISPATCH is not None:
    Tracer.__torch_dispatch__ = C_DISPATCH


def pack_hook(graph: Graph) -> Callable[[torch.Tensor], Handle]:
    """The region's saved-tensor pack hook: ``graph.pack``, or while the tracer records
    in C the same hook with its forward cases in C."""
    # See Note [The pack hook in C].
    if C_DISPATCH is None or Tracer.__torch_dispatch__ is not C_DISPATCH:
        return graph.pack
    return _C.Pack(graph=graph, handle=Handle, entry=MapEntry, node=Node)


# Note [A graph holds only tracked nodes]
#     The C recorder takes its nodes off the collector's lists (Note [Plain records
#     are not tracked by the collector] in _crecord.c). That is safe only for nodes
#     no object the user can hold reaches through references the collector follows:
#     a user's object that holds the region (or its graph) and that a saved tensor
#     refers to (a parameter's attribute, a hook's closure) would otherwise make a
#     cycle through an untracked node, one the collector cannot free. In forward the
#     graph reaches nodes through the tensor map (the thread's region state holds the
#     graph then: nothing is garbage); after forward only through ``rng_chains``, so
#     at region exit every node reachable from there is tracked again. Nothing else
#     of a graph, a region, a budget or a tracker refers to nodes after forward
#     (test_crecord.py walks them for untracked nodes). The walk runs in C
#     (``_crecord.track_from``, 0.16-0.33 us per recorded op measured), only for regions
#     that recorded random ops with ``rng="replay"``; the nodes it tracks cost the
#     collector what the Python recorder's do.


def track_what_the_graph_holds(graph: Graph) -> None:
    """Forward ended (the tensor map is closed): the nodes the graph itself still holds,
    the random ops' chains, and every node they reach go back on the cyclic collector's
    lists, with their inputs, so that a reference cycle through them can be freed."""
    # See Note [A graph holds only tracked nodes] (above) and, for the chains, Note [One
    # generator state per region] in _graph.py.
    if _C is None or not graph.rng_chains:
        return
    # nodes, their inputs tuples and rare-field dicts, and what those hold (older nodes)
    _C.track_from([n for chain in graph.rng_chains for n in chain.nodes], Node)


@contextlib.contextmanager
def recording_in_python() -> Iterator[None]:
    """Regions entered inside record with the Python recorder (the same graphs as the C
    one): for tests that compare the two and for benchmarks. It swaps a class attribute,
    so it is for one thread, outside any region."""
    Tracer.__torch_dispatch__ = PY_DISPATCH
    try:
        yield
    finally:
        Tracer.__torch_dispatch__ = C_DISPATCH or PY_DISPATCH
