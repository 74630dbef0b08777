"""Policies: what a region decides for each op, and how nested regions combine.

A user policy is anything a region accepts (``ACCEPTED_FORMS``: a string, a callable
with torch's selective-checkpoint signature, an iterable of ``OpOverload`` to save, a
region-scoped policy such as a ``MemoryBudget``). It is normalized once, when the
region is entered, into a :class:`_Frame`; the tracer then asks :func:`resolve` for
each op and gets back a :data:`Decision`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from ._compat import MUST_CPU_OFFLOAD, PREFER_CPU_OFFLOAD

__all__ = ["CheckpointPolicy", "SAVE_WITH_HOOKS", "PolicyContext", "PolicyLike", "PolicySource"]

_CP = CheckpointPolicy


class SAVE_WITH_HOOKS:  # noqa: N801 - a public name, spelled as a policy's answers are
    """Policy result: save the op's output as ``pack(t)``; restore it with ``unpack``.

    Use it to offload or compress selected activations::

        offload = ac.SAVE_WITH_HOOKS(lambda t: t.to("cpu"), lambda t: t.to("cuda"))

        def policy(ctx, op, *args, **kwargs):
            return offload if op == torch.ops.aten.mm.default else "recompute"

    ``unpack`` runs when backward needs the value (once per saved use of it; a prefetch
    ahead of backward runs it once for all of them) and must return a tensor with the
    original's shape, dtype and device.
    """

    __slots__ = ("pack", "unpack")

    def __init__(
        self, pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]
    ) -> None:
        if not callable(pack) or not callable(unpack):
            raise TypeError("SAVE_WITH_HOOKS(pack, unpack) needs two callables")
        self.pack = pack
        self.unpack = unpack

    def __repr__(self) -> str:
        return f"SAVE_WITH_HOOKS(pack={self.pack!r}, unpack={self.unpack!r})"


class PolicyContext(SelectiveCheckpointContext):
    """The ``ctx`` a policy receives; a :class:`SelectiveCheckpointContext`.

    Attributes:
        is_recompute: always ``False`` (policies run once per op, in forward).
        op_output: the output of the op being decided.
        module_fqn: innermost module path when the region knows it, else ``""``.
        rank: ``torch.distributed`` rank (0 when not initialized).
    """

    __slots__ = ("module_fqn", "rank")

    def __init__(self, module_fqn: str = "", rank: int = 0) -> None:
        super().__init__(is_recompute=False)  # torch < 2.12 has no op_output argument
        self.op_output = None
        self.module_fqn = module_fqn
        self.rank = rank


PolicyFn = Callable[..., CheckpointPolicy | bool | SAVE_WITH_HOOKS]
OpLike = torch._ops.OpOverload | torch._ops.OpOverloadPacket | torch._ops.HigherOrderOperator


class RegionScopedPolicy(Protocol):
    """A policy that makes a fresh per-op policy for every region entry (an
    :class:`ac2_dist.MemoryBudget`): what a region asks of it, named here so that the
    policy stage never imports the planner (Note [Region-scoped policies])."""

    def new_region_policy(self, module_fqn: str) -> PolicyFn: ...


# Every form _Frame accepts.
PolicyLike = (
    str | bool | CheckpointPolicy | SAVE_WITH_HOOKS | PolicyFn | Iterable[OpLike] | Mapping[OpLike, CheckpointPolicy]
    | RegionScopedPolicy
)
Decision = CheckpointPolicy | SAVE_WITH_HOOKS

_STRINGS: dict[str, CheckpointPolicy] = {
    "recompute_all": _CP.PREFER_RECOMPUTE,
    "must_save_all": _CP.MUST_SAVE,
}

ACCEPTED_FORMS = (
    "'recompute_all', 'must_save_all', a bool, a CheckpointPolicy, an ac2_dist.SAVE_WITH_HOOKS, "
    "a policy callable (ctx, op, *args, **kwargs), an iterable of ops to save (OpOverload, "
    "OpOverloadPacket or HigherOrderOperator), a dict {op: CheckpointPolicy} or an ac2_dist.MemoryBudget"
)


# Identity comparisons, not set membership: Enum.__hash__ is a Python call (hot path).
_MS, _PS, _MR = _CP.MUST_SAVE, _CP.PREFER_SAVE, _CP.MUST_RECOMPUTE
_MO, _PO = MUST_CPU_OFFLOAD, PREFER_CPU_OFFLOAD  # None before torch 2.11 (_compat.py)
_PR = _CP.PREFER_RECOMPUTE


def is_must(d: Decision) -> bool:
    """MUST_* results and SAVE_WITH_HOOKS are never overridden by a PREFER_*."""
    return d is _MS or d is _MR or d is _MO or type(d) is SAVE_WITH_HOOKS


def is_save(d: Decision) -> bool:
    """True for every decision that keeps the output (save, offload, hooks)."""
    return d is _MS or d is _PS or d is _MO or d is _PO or type(d) is SAVE_WITH_HOOKS


def _as_decision(result: Any) -> Decision | None:
    if isinstance(result, bool):
        return _MS if result else _PR
    if isinstance(result, (CheckpointPolicy, SAVE_WITH_HOOKS)):
        return result
    return None


def _check_decision(result: Any, frame: _Frame, op: Any) -> Decision:
    d = _as_decision(result)
    if d is None:
        raise TypeError(
            f"ac2_dist: policy {frame.name} returned {result!r} for {op}; a policy must return "
            "a torch.utils.checkpoint.CheckpointPolicy, a bool or an ac2_dist.SAVE_WITH_HOOKS."
        )
    return d


_OP_TYPES = (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)


def _expand_op(op: Any) -> list[Any]:
    """An op of a save-list / dict key: a packet (``torch.ops.aten.mm``) stands for
    all of its overloads."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    if isinstance(op, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return [op]
    raise TypeError(
        f"ac2_dist: a save-list or dict policy must name ops (OpOverload, OpOverloadPacket "
        f"or HigherOrderOperator), got {op!r} ({type(op).__name__})"
    )


def op_name(op: Any) -> str:
    """A stable, picklable name: ``aten::mm.default`` or ``higher_order::flex_attention``."""
    if isinstance(op, torch._ops.HigherOrderOperator):
        return f"higher_order::{op.name()}"
    return f"{op._schema.name}.{op._overloadname}"


def op_from_name(name: str) -> Any:
    """Inverse of :func:`op_name`."""
    # See Note [Policies pickle by op name].
    ns, _, rest = name.partition("::")
    if ns == "higher_order":
        return getattr(torch.ops.higher_order, rest)
    packet, _, overload = rest.rpartition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), packet), overload)
    except (AttributeError, RuntimeError) as e:
        raise RuntimeError(
            f"ac2_dist: cannot restore the policy op {name!r}: it is not registered in this process "
            "(import the library that defines it before loading the model)"
        ) from e


def _by_id(table: dict[Any, Decision] | None) -> dict[int, tuple[Decision, bool]] | None:
    """A table's answers keyed by ``id(op)``, with ``is_save`` of each (the tracer's
    lookup: ``OpOverload.__hash__`` is a Python call per op, ``id`` is not). The table
    holds its ops, so no listed op's id is reused while the frame lives."""
    if table is None:
        return None
    return {id(op): (d, is_save(d)) for op, d in table.items()}


class _Frame:
    """One entered region's policy, normalized.

    Exactly one of ``const`` (the same decision for every op), ``table`` (save-list
    and dict forms: op -> decision, unlisted ops PREFER_RECOMPUTE) or ``fn`` (a user
    callable) is set, so the tracer can skip the Python call for the built-in forms
    (hot path).

    Note [Region-scoped policies]
        A policy object with a ``new_region_policy(module_fqn)`` method (a
        :class:`ac2_dist.MemoryBudget`) is not asked per op itself: every region entry
        makes a fresh per-region policy from it (:meth:`for_region`), which may also
        define ``region_enter(graph)`` and ``region_exit(graph, failed)``; the region
        calls them when it pushes and pops the frame (graph ``None`` under no_grad).

    Note [Policies pickle by op name]
        A checkpointed module keeps its frame, so ``torch.save(model)`` pickles it.
        ``OpOverload`` objects are not picklable; a table is stored as op names
        (:func:`op_name`) and resolved again on load.
    """

    __slots__ = (
        "const", "const_save", "table", "by_id", "fn", "name", "rng", "allow_mutation", "module_fqn", "per_region",
    )

    def __init__(
        self, policy: PolicyLike, *, rng: str, allow_mutation: bool, module_fqn: str
    ) -> None:
        if rng not in ("save", "replay"):
            raise ValueError(f"ac2_dist: rng must be 'save' or 'replay', got {rng!r}")
        self.const: Decision | None = None
        self.table: dict[Any, Decision] | None = None
        self.fn: PolicyFn | None = None
        self.per_region: Any = None  # Note [Region-scoped policies]
        self.rng = rng
        self.allow_mutation = bool(allow_mutation)
        self.module_fqn = module_fqn
        if isinstance(policy, str):
            if policy not in _STRINGS:
                raise ValueError(
                    f"ac2_dist: unknown policy string {policy!r}; accepted policies: {ACCEPTED_FORMS}"
                )
            self.const = _STRINGS[policy]
            self.name = repr(policy)
        elif isinstance(policy, (bool, CheckpointPolicy, SAVE_WITH_HOOKS)):
            # True: save everything, False: recompute everything.
            self.const = _as_decision(policy)
            self.name = repr(policy)
        elif isinstance(policy, Mapping):
            table: dict[Any, Decision] = {}
            for op, value in policy.items():
                d = _as_decision(value)
                if d is None:
                    raise TypeError(
                        f"ac2_dist: a dict policy maps ops to a CheckpointPolicy (or a bool / "
                        f"SAVE_WITH_HOOKS); {op!r} maps to {value!r}"
                    )
                for o in _expand_op(op):
                    table[o] = d
            self.table = table
            self.name = "dict(" + ", ".join(f"{op_name(o)}: {d!r}" for o, d in table.items()) + ")"
        elif isinstance(policy, _OP_TYPES):
            raise TypeError(
                f"ac2_dist: a single op {policy!r} is not a policy; pass a list of ops to save, "
                f"e.g. [{policy!r}]. Accepted policies: {ACCEPTED_FORMS}"
            )
        elif hasattr(policy, "new_region_policy"):  # Note [Region-scoped policies]
            self.per_region = policy
            self.name = repr(policy)
        elif callable(policy):
            self.fn = policy
            self.name = getattr(policy, "__qualname__", None) or repr(policy)
        elif isinstance(policy, Iterable) and not isinstance(policy, (bytes, torch.Tensor)):
            ops = list(policy)
            self.table = {o: _MS for op in ops for o in _expand_op(op)}
            self.name = f"save-list({', '.join(sorted(op_name(o) for o in self.table))})"
        else:
            raise TypeError(f"ac2_dist: unsupported policy {policy!r}; accepted policies: {ACCEPTED_FORMS}")
        self.const_save = self.const is not None and is_save(self.const)
        self.by_id = _by_id(self.table)

    def for_region(self) -> _Frame:
        """The frame one region entry uses: this one, or for a region-scoped policy a
        copy with that policy's per-region object (Note [Region-scoped policies])."""
        if self.per_region is None:
            return self
        frame = _Frame.__new__(_Frame)
        frame.const, frame.const_save, frame.table, frame.by_id, frame.per_region = None, False, None, None, None
        frame.fn = self.per_region.new_region_policy(self.module_fqn)
        frame.name, frame.rng, frame.allow_mutation, frame.module_fqn = (
            self.name, self.rng, self.allow_mutation, self.module_fqn)
        return frame

    def decide(self, ctx: PolicyContext, op: Any, args: tuple, kwargs: dict) -> Decision:
        if self.const is not None:
            return self.const
        if self.table is not None:
            return self.table.get(op, _PR)
        return _check_decision(self.fn(ctx, op, *args, **kwargs), self, op)

    def __reduce__(self) -> tuple:
        table = None if self.table is None else [(op_name(o), d) for o, d in self.table.items()]
        return (_restore_frame, (self.const, table, self.fn, self.name, self.rng, self.allow_mutation,
                                 self.module_fqn, self.per_region))


def _restore_frame(const, table, fn, name, rng, allow_mutation, module_fqn, per_region=None) -> _Frame:
    frame = _Frame.__new__(_Frame)
    frame.const, frame.fn, frame.name, frame.per_region = const, fn, name, per_region
    frame.table = None if table is None else {op_from_name(n): d for n, d in table}
    frame.by_id = _by_id(frame.table)
    frame.rng, frame.allow_mutation, frame.module_fqn = rng, allow_mutation, module_fqn
    frame.const_save = const is not None and is_save(const)
    return frame


def resolve(frames: list[_Frame], ctx: PolicyContext, op: Any, args: tuple, kwargs: dict) -> Decision:
    """Combine the policies of nested regions, outermost first.

    Start at PREFER_SAVE; each frame's decision replaces the current one unless the
    current one is a MUST_* (then a PREFER_* is ignored, the same MUST_* agrees, and
    a different MUST_* is an error naming both policies and the op).
    """
    current: Decision = _CP.PREFER_SAVE
    current_frame: _Frame | None = None
    for frame in frames:
        d = frame.decide(ctx, op, args, kwargs)
        if d is current:
            continue
        if is_must(current):
            if is_must(d):
                raise RuntimeError(
                    f"ac2_dist: conflicting policies for {op}: outer region policy "
                    f"{current_frame.name} says {current!r} but inner region policy "
                    f"{frame.name} says {d!r}. Make one of them return a PREFER_* value."
                )
            continue
        current, current_frame = d, frame
    return current


class PolicySource:
    """Where a region's policy comes from: ``policy`` (validated once into one frame) or
    ``policy_factory`` (called at every region entry).

    Note [Policy factories]
        A stateful policy (torchtitan's "save every second matmul" counts the matmuls
        it has seen) must start fresh in every region: one policy object shared by all
        blocks drifts (3, 2, 3, 2 saves instead of 3, 3, 3, 3). ``policy_factory`` is a
        zero-argument callable; each region entry (each call of a checkpointed module,
        each ``apply_ac_policy_fn`` / ``checkpoint`` call) calls it and normalizes its
        result into a fresh frame. Inside ``torch.compile`` it is called when the
        compiled graph is built (once per compilation, as torch's ``context_fn`` is).
    """

    __slots__ = ("frame", "factory", "rng", "allow_mutation", "module_fqn")

    def __init__(
        self,
        policy: PolicyLike | None,
        policy_factory: Callable[[], PolicyLike] | None,
        *,
        rng: str,
        allow_mutation: bool,
        module_fqn: str,
        where: str,
    ) -> None:
        self.rng, self.allow_mutation, self.module_fqn = rng, bool(allow_mutation), module_fqn
        self.factory = policy_factory
        self.frame: _Frame | None = None
        if policy_factory is None:
            self.frame = _Frame("recompute_all" if policy is None else policy, rng=rng,
                                allow_mutation=allow_mutation, module_fqn=module_fqn)
            return
        if policy is not None:
            raise TypeError(
                f"ac2_dist.{where}: pass either policy or policy_factory, not both (got policy={policy!r} "
                f"and policy_factory={policy_factory!r})"
            )
        if not callable(policy_factory):
            raise TypeError(
                f"ac2_dist.{where}: policy_factory must be a zero-argument callable returning a policy, "
                f"got {policy_factory!r}"
            )
        if rng not in ("save", "replay"):
            raise ValueError(f"ac2_dist: rng must be 'save' or 'replay', got {rng!r}")

    def new_frame(self) -> _Frame:
        """The frame for one region entry (a factory's policy is made afresh)."""
        # See Note [Policy factories] (above).
        if self.frame is not None:
            return self.frame
        factory = self.factory
        policy = factory()
        try:
            return _Frame(policy, rng=self.rng, allow_mutation=self.allow_mutation, module_fqn=self.module_fqn)
        except (TypeError, ValueError) as e:
            name = getattr(factory, "__qualname__", None) or repr(factory)
            raise TypeError(
                f"ac2_dist: policy_factory {name} returned {policy!r}, which is not a policy ({e})"
            ) from None

    @property
    def name(self) -> str:
        if self.frame is not None:
            return self.frame.name
        return f"policy_factory {getattr(self.factory, '__qualname__', None) or self.factory!r}"

    @property
    def user_callable(self) -> Any:
        """The user's callable stored in this source (pickled with a checkpointed module)."""
        return self.factory if self.frame is None else self.frame.fn
