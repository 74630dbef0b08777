"""Per-operator facts the tracer needs, computed once per ``OpOverload``.

The tracer runs once per ATen op, so everything that depends only on the operator
(its schema, its tags, its namespace) is derived here once and cached in an
:class:`OpInfo`. The classification answers one question for the tracer: *may this
op be re-executed during backward?* Ops that may not are "side
effects": their outputs are saved whatever the policy says.
"""

# Note [Op-info cache is a memo, not state]
#     ``_INFO`` maps an ``OpOverload`` to immutable facts about its schema. It is the
#     only module-level dictionary in the package and it never holds tensors, regions
#     or per-thread data; clearing it at any time is always safe (it is rebuilt on the
#     next lookup). It is keyed by ``id(op)``: ``OpOverload.__hash__`` is a Python
#     method, one call per recorded op on the tracer's path, ``id`` is not. Every entry
#     holds its op (``OpInfo.op``), so an op in the cache is never freed and its id
#     never reused by another object while the entry lives.

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import SAC_IGNORED_OPS

__all__ = [
    "SideEffect",
    "OpInfo",
    "op_info",
    "register_side_effect",
    "COLLECTIVE_NAMESPACES",
]

#: Namespaces whose ops talk to other ranks or to FSDP's buffers. Never replayed.
COLLECTIVE_NAMESPACES = frozenset(
    {"c10d", "_c10d_functional", "c10d_functional", "_dtensor", "fsdp", "symm_mem"}
)


class SideEffect(enum.Enum):
    """Why an op must not be re-executed during backward (``NONE`` if it may)."""

    NONE = "none"
    COLLECTIVE = "collective"  # c10d / functional collectives / symm_mem
    FSDP = "fsdp"  # FSDP2's own copy-in / copy-out ops
    MUTATION = "mutation"  # writes one of its inputs (in-place or out=)
    RNG = "rng"  # draws from a generator (only a side effect when rng="save")
    OPAQUE = "opaque"  # no schema, or returns objects that are not tensors / numbers
    REGISTERED = "registered side-effect"  # declared with register_side_effect


def _is_tensor_type(t: torch._C.JitType) -> bool:
    return isinstance(t, torch._C.TensorType) or (
        isinstance(t, torch._C.OptionalType) and isinstance(t.getElementType(), torch._C.TensorType)
    )


def _is_tensor_list_type(t: torch._C.JitType) -> bool:
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch._C.ListType) and _is_tensor_type(t.getElementType())


@dataclass(frozen=True, slots=True)
class OpInfo:
    """Immutable facts about one ``OpOverload``, cached by :func:`op_info`."""

    op: torch._ops.OpOverload
    #: ``torch.utils.checkpoint.SAC_IGNORED_OPS``: metadata ops, policy not consulted.
    ignored: bool
    #: Side-effect class from the namespace / schema (RNG is reported separately).
    side_effect: SideEffect
    #: Positions of written arguments: ``int`` for ``args[i]``, ``str`` for ``kwargs[name]``.
    #: A written argument may be a single tensor or a list of tensors.
    written: tuple[int | str, ...]
    #: ``torch.Tag.nondeterministic_seeded``: consumes random numbers.
    is_rng: bool
    #: Where ``dropout_p`` is passed (index, name); an RNG op with ``dropout_p == 0`` is
    #: deterministic (e.g. SDPA without dropout).
    dropout_arg: tuple[int, str] | None
    #: Where a ``generator`` argument is passed (index, name), if the schema has one.
    generator_arg: tuple[int, str] | None
    # See Note [Schemas that hide writes].
    #: If set, ``written`` only applies when ``args[write_flag]`` is true (an op whose
    #: schema declares a write it makes only when a flag argument says so).
    write_flag: int | None
    # See Note [Versions of written tensors] in _tracer.py.
    #: The writes are declared in the schema (``(a!)``): autograd's ADInplaceOrView
    #: kernel bumps each written tensor's version once *after* the tracer saw the op.
    #: Hidden writes bump nothing.
    declared_writes: bool
    #: Some argument is a ``Tensor[]`` / ``Tensor?[]`` (slower argument walk).
    has_tensor_lists: bool
    #: Some return aliases an input (view ops): saved outputs are detached.
    returns_alias: bool
    # See Note [Versions of view outputs] in _tracer.py.
    #: For view ops, the argument the outputs are views of: they share its version
    #: counter once the op returns.
    view_src: int | None = None
    # See Note [Higher-order operators].
    #: A ``HigherOrderOperator`` (no schema).
    higher_order: bool = False
    # See Note [Statistics an op accumulates].
    #: Positions of arguments the op folds statistics into without its outputs depending
    #: on them (batch-norm running stats).
    accumulators: tuple[int, ...] = ()
    #: If set, the op accumulates only when ``args[accumulate_flag]`` is true (training).
    accumulate_flag: int | None = None
    # See Note [Aliases a schema does not declare] in _tracer.py.
    #: An ATen pointwise op that neither writes nor declares an alias: its output is new
    #: storage (TensorIterator allocates it), so the tracer skips the check for outputs
    #: that alias an input undeclared. ``_unsafe_view`` and ``unsafe_split``, the ATen ops
    #: that do alias undeclared, are not pointwise; composite pointwise ops
    #: (``conj_physical`` returns a real input itself) and other namespaces (custom ops)
    #: are always checked.
    fresh_output: bool = False
    # See Note [The plain-op path] in _tracer.py (``plain`` and ``call``).
    #: A ``fresh_output`` op that returns one tensor and is nothing else the tracer
    #: decides about: no side effect, no random draw, not ignored, no ``Tensor[]``
    #: argument. The tracer records it on its short path.
    plain: bool = False
    #: ``"output of <op>"``: what error messages call a value this op saved.
    owner: str = ""
    #: What the tracer calls to run the op (both paths; not under a tensor subclass's
    #: probe): the C++ callable ``OpOverload.__call__`` ends in (``op._op``; on torch
    #: 2.14+ ``op._cpp_dispatch_handle``, see ``guarded``), one Python frame less per op,
    #: where ``__call__`` does nothing else; otherwise ``op`` itself. None for
    #: higher-order ops.
    call: Any = None
    #: ``call`` runs the op only while ``op._op is call`` (torch >= 2.14: a custom op's
    #: Python dispatcher rebinds ``_op``); the tracer checks that per call, else calls ``op``.
    guarded: bool = False
    # See Note [Writes inside a region] in _writes.py.
    #: A written argument is a ``Tensor[]`` (``_foreach_*_``, list collectives): such a
    #: write is never replayed. Index lists (``index_put_``'s ``Tensor?[]``) are read,
    #: not written.
    written_lists: bool = False
    # See Note [Arguments read for their shape] in _writes.py.
    #: Positions of tensor arguments the op reads only for their sizes, strides, dtype
    #: and device (``empty_like``, ``new_zeros``, ``rand_like`` ...): a later write to
    #: them does not change this op's output.
    shape_only: tuple[int, ...] = ()
    # See Note [Writes that overwrite] in _writes.py.
    #: The op writes every element of ``self`` (its one written argument) without reading
    #: what was there (``copy_``, ``fill_``, ``zero_``): its replay writes into a new
    #: tensor.
    overwrites: bool = False

    @property
    def aliases(self) -> bool:
        """The output is (a view of) an input's storage: it allocates nothing."""
        return self.returns_alias or self.view_src is not None

    def writes(self, args: tuple) -> bool:
        """True if this call writes one of its arguments."""
        if not self.written:
            return False
        return self.write_flag is None or bool(args[self.write_flag])

    def accumulates(self, args: tuple) -> bool:
        """True if this call's only writes fold statistics into its accumulator
        arguments (batch norm's running statistics)."""
        # See Note [Statistics an op accumulates].
        if not self.accumulators:
            return False
        flag = self.accumulate_flag
        return flag is None or bool(args[flag] if flag < len(args) else False)

    def is_random(self, args: tuple, kwargs: dict) -> bool:
        """True if this call draws random numbers (``dropout_p == 0`` does not)."""
        if not self.is_rng:
            return False
        if self.dropout_arg is not None:
            idx, name = self.dropout_arg
            p = args[idx] if idx < len(args) else kwargs.get(name, 0.0)
            return bool(p)
        return True

    def generator(self, args: tuple, kwargs: dict) -> torch.Generator | None:
        if self.generator_arg is None:
            return None
        idx, name = self.generator_arg
        return args[idx] if idx < len(args) else kwargs.get(name)


_INFO: dict[int, OpInfo] = {}  # id(op) -> facts (Note [Op-info cache is a memo, not state])


class _Registry:
    """Ops and namespaces users declared as side effects (``register_side_effect``).

    Note [The side-effect registry is process-wide]
        Like ``torch.library`` registrations, declaring that an op talks to the
        outside world is a fact about the op, not about a thread or a region, so the
        registry is one object per process. Registering clears the op-info memo so the
        next lookup sees the new class.
    """

    def __init__(self) -> None:
        self.namespaces: set[str] = set()
        self.ops: set[str] = set()  # "ns::name" (all overloads) or "ns::name.overload"

    def matches(self, op: torch._ops.OpOverload) -> bool:
        if not (self.namespaces or self.ops):
            return False
        name = op._schema.name
        return (
            op.namespace in self.namespaces
            or name in self.ops
            or f"{name}.{op._overloadname}" in self.ops
        )


_REGISTRY = _Registry()


def register_side_effect(op_or_namespace: torch._ops.OpOverload | torch._ops.OpOverloadPacket | str) -> None:
    """Declare an op (or every op of a namespace) a side effect: never replayed.

    Use it for custom ops that talk to other ranks, devices or the outside world
    (e.g. a hand-written collective registered with ``torch.library``)::

        ac.register_side_effect(torch.ops.mylib.all_to_all.default)  # one overload
        ac.register_side_effect(torch.ops.mylib.all_to_all)          # all overloads
        ac.register_side_effect("mylib")                             # a namespace
        ac.register_side_effect("mylib::all_to_all")                 # by name

    Their outputs are saved whatever the policy says, like built-in collectives.
    """
    if isinstance(op_or_namespace, torch._ops.OpOverload):
        _REGISTRY.ops.add(f"{op_or_namespace._schema.name}.{op_or_namespace._overloadname}")
    elif isinstance(op_or_namespace, torch._ops.OpOverloadPacket):
        _REGISTRY.ops.add(op_or_namespace._qualified_op_name)
    elif isinstance(op_or_namespace, str) and op_or_namespace:
        if "::" in op_or_namespace:
            _REGISTRY.ops.add(op_or_namespace)
        else:
            _REGISTRY.namespaces.add(op_or_namespace)
    else:
        raise TypeError(
            "ac2_dist.register_side_effect takes an OpOverload, an OpOverloadPacket, an op "
            f"name 'ns::op' or a namespace 'ns', got {op_or_namespace!r}"
        )
    _INFO.clear()

# Note [Schemas that hide writes]
#     Some ops write an argument without an ``(a!)`` annotation in their schema: the
#     batch-norm family updates ``running_mean`` / ``running_var`` in place when
#     training (below), legacy c10d collectives write their first argument (in
#     ``_build``). Replaying them would write twice, so the tracer treats those
#     arguments as written (``OpInfo.written``) with ``declared_writes=False``: no
#     version bump follows the op.
#
# Note [Statistics an op accumulates]
#     Batch norm in training mode normalizes with the batch's own statistics and, as a
#     side effect, folds them into ``running_mean`` / ``running_var``. Its outputs
#     (output, batch mean, inverse std) do not depend on the running statistics'
#     values: the write is the side effect, the op is not. So when such an op
#     accumulates (``OpInfo.accumulates``), the tracer records it as an ordinary
#     recomputable op whose accumulator arguments are *scratch*: forward updated the
#     real buffers once; a replay passes fresh zero buffers of the same shape, dtype
#     and device, which it writes and drops. The same kernel runs on the same inputs,
#     so the outputs are bitwise forward's (a replay with ``None`` statistics could take
#     another kernel path; scratch buffers cannot). The written buffers still become
#     new versions in the graph. ``None`` statistics (``track_running_stats=False``)
#     write nothing and need no scratch. Entries: op name -> (accumulator positions,
#     position of the ``training`` flag or None when the op always accumulates);
#     default overloads only (``.out`` overloads also write their outputs: side effects).
_ACCUMULATES: dict[str, tuple[tuple[int, ...], int | None]] = {
    "aten::native_batch_norm": ((3, 4), 5),
    "aten::cudnn_batch_norm": ((3, 4), 5),
    "aten::miopen_batch_norm": ((3, 4), 5),
    "aten::_batch_norm_impl_index": ((3, 4), 5),
    "aten::_native_batch_norm_legit": ((3, 4), 5),  # declared (a!): version bumped even in eval
    "aten::_batch_norm_with_update": ((3, 4), None),
    "aten::batch_norm_update_stats": ((1, 2), None),
    "aten::batch_norm_gather_stats": ((3, 4), None),  # SyncBatchNorm
    "aten::batch_norm_gather_stats_with_counts": ((3, 4), None),  # SyncBatchNorm
}


def _classify_namespace(ns: str) -> SideEffect:
    if ns == "fsdp":
        return SideEffect.FSDP
    if ns in COLLECTIVE_NAMESPACES:
        return SideEffect.COLLECTIVE
    return SideEffect.NONE


# Note [Higher-order operators]
#     A ``HigherOrderOperator`` (flex_attention in eager, cond, ...) reaches the tracer
#     as one call whose arguments may be nested tuples, callables and graph modules.
#     It is recorded as a saved node: its outputs are kept and it is never replayed
#     (its subgraph ran below the tracer, with the mode popped, so nothing inside it
#     is in the graph). torch declares a HOP without ``gen_schema`` functional (it
#     mutates nothing); one whose generated schema writes an argument makes every
#     tensor argument a new version (we do not map schema positions to nested
#     tensors), which is conservative.


def _composite(op: torch._ops.OpOverload) -> bool:
    """The op has a CompositeImplicitAutograd kernel: Python code that may return its
    input itself (``conj_physical`` of a real tensor does, on an inference tensor, the one
    case where such an op reaches a dispatch mode undecomposed)."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
    except (AttributeError, RuntimeError):  # no such query: assume it may alias
        return True


def _build(op: torch._ops.OpOverload) -> OpInfo:
    schema = getattr(op, "_schema", None)
    if schema is None:  # a higher-order op (Note [Higher-order operators]): never replayed
        return OpInfo(
            op, False, SideEffect.OPAQUE, (), False, None, None, None, False, True, True,
            higher_order=isinstance(op, torch._ops.HigherOrderOperator), owner=f"output of {op}",
        )
    written: list[int | str] = []
    dropout_arg = generator_arg = None
    has_lists = written_lists = False
    for i, arg in enumerate(schema.arguments):
        pos: int | str = arg.name if arg.kwarg_only else i
        is_list = _is_tensor_list_type(arg.type)
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.append(pos)
            written_lists = written_lists or is_list
        if is_list:
            has_lists = True
        if arg.name == "dropout_p":
            dropout_arg = (i, arg.name)
        elif arg.name == "generator":
            generator_arg = (i, arg.name)
    write_flag = None
    declared = bool(written)
    accumulators: tuple[int, ...] = ()
    accumulate_flag = None
    stats = _ACCUMULATES.get(schema.name) if not schema.overload_name else None
    if stats is not None:  # Note [Statistics an op accumulates]
        accumulators, accumulate_flag = stats
        if not declared:  # Note [Schemas that hide writes]: written only while accumulating
            written, write_flag = list(accumulators), accumulate_flag
    elif op.namespace == "c10d" and schema.name.endswith("_") and schema.arguments:
        # Legacy in-place collectives (allreduce_, broadcast_, _allgather_base_, ...) write
        # their first argument (a tensor, a list or a list of lists) without an (a!)
        # annotation: that argument gets a new version (Note [Schemas that hide writes]).
        written = [0]
        declared = False
    returns_alias = any(r.alias_info is not None for r in schema.returns)
    view_src = None
    if returns_alias and not written and getattr(op, "is_view", False):
        view_src = next(
            (i for i, a in enumerate(schema.arguments) if a.alias_info is not None and not a.alias_info.is_write),
            None,
        )
    side_effect = _classify_namespace(op.namespace)
    if side_effect is SideEffect.NONE and _REGISTRY.matches(op):
        side_effect = SideEffect.REGISTERED
    if side_effect is SideEffect.NONE and any(
        isinstance(r.type, (torch._C.ClassType, torch._C.AnyType)) for r in schema.returns
    ):
        side_effect = SideEffect.OPAQUE
    if side_effect is SideEffect.NONE and written and write_flag is None:
        side_effect = SideEffect.MUTATION
    fresh = (op.namespace == "aten" and torch.Tag.pointwise in op.tags and not returns_alias and not written
             and not _composite(op))
    is_rng = torch.Tag.nondeterministic_seeded in op.tags
    ignored = op in SAC_IGNORED_OPS
    call, guarded = _direct_call(op)
    return OpInfo(
        op=op,
        ignored=ignored,
        side_effect=side_effect,
        written=tuple(written),
        is_rng=is_rng,
        dropout_arg=dropout_arg,
        generator_arg=generator_arg,
        write_flag=write_flag,
        declared_writes=declared,
        has_tensor_lists=has_lists,
        returns_alias=returns_alias,
        view_src=view_src,
        accumulators=accumulators,
        accumulate_flag=accumulate_flag,
        fresh_output=fresh,
        plain=(fresh and side_effect is SideEffect.NONE and not is_rng and not ignored and not has_lists
               and not accumulators and len(schema.returns) == 1
               and isinstance(schema.returns[0].type, torch._C.TensorType)),
        owner=f"output of {op}",
        call=call,
        guarded=guarded,
        written_lists=written_lists,
        shape_only=(0,) if op.namespace == "aten" and schema.name in _SHAPE_ONLY else (),
        overwrites=op.namespace == "aten" and (schema.name, schema.overload_name) in _OVERWRITES,
    )


# Ops whose ``self`` is read only for its metadata (Note [Arguments read for their shape]
# in _writes.py); every overload takes ``self`` first.
_SHAPE_ONLY = frozenset(f"aten::{name}" for name in (
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
))

# Ops that write all of ``self`` from their other arguments alone (Note [Writes that
# overwrite] in _writes.py).
_OVERWRITES = frozenset({("aten::copy_", ""), ("aten::fill_", "Scalar"), ("aten::fill_", "Tensor"),
                         ("aten::zero_", "")})


# What ``OpOverload.__call__`` reads, in the two shapes the tracer skips (Note [The
# plain-op path] in _tracer.py): torch <= 2.13 only forwards to ``self._op``; torch 2.14
# calls ``self._cpp_dispatch_handle`` or ``self._op``, which is that same callable unless
# the op has a Python dispatcher (custom ops: ``_op`` is rebound to it).
_FORWARDS = ("_op",)
_FORWARDS_UNLESS_DISPATCHER = (
    "_pyobj_dispatcher", "torch", "_C", "_peek_should_skip_torch_function", "_cpp_dispatch_handle", "_op",
)


def _direct_call(op: torch._ops.OpOverload) -> tuple[Any, bool]:
    """``(call, guarded)``: the C++ callable ``OpOverload.__call__`` ends in, where that
    method does nothing else, else ``op`` itself. ``guarded`` (torch >= 2.14): ``call``
    is ``op._cpp_dispatch_handle``, which is what ``__call__`` runs whenever ``op._op``
    is that same object; the tracer checks that identity per call."""
    forwarder = torch._ops.OpOverload.__call__
    if type(op).__call__ is not forwarder:
        return op, False
    names = forwarder.__code__.co_names
    if names == _FORWARDS and hasattr(op, "_op"):
        return op._op, False
    if names == _FORWARDS_UNLESS_DISPATCHER and hasattr(op, "_cpp_dispatch_handle"):
        return op._cpp_dispatch_handle, True
    return op, False


def hop_writes(op: torch._ops.HigherOrderOperator, args: tuple, kwargs: dict) -> bool:
    """True if ``op``'s generated schema for this call writes an argument; HOPs without
    ``gen_schema`` are functional."""
    # See Note [Higher-order operators].
    try:
        schema = op.gen_schema(*args, **kwargs)
    except NotImplementedError:
        return False
    except Exception:  # a schema generator that cannot handle these arguments
        return True
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def op_info(op: torch._ops.OpOverload) -> OpInfo:
    """Return the cached :class:`OpInfo` of ``op`` (built on first use)."""
    info = _INFO.get(id(op))
    if info is None:
        info = _INFO[id(op)] = _build(op)
    return info
