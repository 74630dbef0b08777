"""Policies: what a region decides for each op, and how nested regions combine.

A user policy is anything CONTRACT §1/§2 accepts (a string, a callable with torch's
selective-checkpoint signature, an iterable of ``OpOverload`` to save). It is
normalized once, when the region is entered, into a :class:`_Frame`; the tracer
then asks :func:`resolve` for each op and gets back a :data:`Decision`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

__all__ = ["CheckpointPolicy", "SAVE_WITH_HOOKS", "PolicyContext", "PolicyLike"]

_CP = CheckpointPolicy


class SAVE_WITH_HOOKS:  # noqa: N801 - public name fixed by CONTRACT §2
    """Policy result: save the op's output as ``pack(t)``; restore it with ``unpack``.

    Use it to offload or compress selected activations::

        offload = ac.SAVE_WITH_HOOKS(lambda t: t.to("cpu"), lambda t: t.to("cuda"))

        def policy(ctx, op, *args, **kwargs):
            return offload if op == torch.ops.aten.mm.default else "recompute"

    ``unpack`` runs every time backward needs the value and must return a tensor with
    the original's shape, dtype and device.
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
        super().__init__(is_recompute=False, op_output=None)
        self.module_fqn = module_fqn
        self.rank = rank


PolicyFn = Callable[..., CheckpointPolicy | bool | SAVE_WITH_HOOKS]
PolicyLike = str | bool | PolicyFn | Iterable[torch._ops.OpOverload]
Decision = CheckpointPolicy | SAVE_WITH_HOOKS

_STRINGS: dict[str, CheckpointPolicy] = {
    "recompute_all": _CP.PREFER_RECOMPUTE,
    "must_save_all": _CP.MUST_SAVE,
}


# Identity comparisons, not set membership: Enum.__hash__ is a Python call (hot path).
_MS, _PS, _MR = _CP.MUST_SAVE, _CP.PREFER_SAVE, _CP.MUST_RECOMPUTE
_MO, _PO = _CP.MUST_CPU_OFFLOAD, _CP.PREFER_CPU_OFFLOAD


def is_must(d: Decision) -> bool:
    """MUST_* results and SAVE_WITH_HOOKS are never overridden by a PREFER_*."""
    return d is _MS or d is _MR or d is _MO or type(d) is SAVE_WITH_HOOKS


def is_save(d: Decision) -> bool:
    """True for every decision that keeps the output (save, offload, hooks)."""
    return d is _MS or d is _PS or d is _MO or d is _PO or type(d) is SAVE_WITH_HOOKS


def _check_decision(result: Any, frame: _Frame, op: Any) -> Decision:
    if isinstance(result, bool):
        return _CP.MUST_SAVE if result else _CP.PREFER_RECOMPUTE
    if isinstance(result, (CheckpointPolicy, SAVE_WITH_HOOKS)):
        return result
    raise TypeError(
        f"ac2_dist: policy {frame.name} returned {result!r} for {op}; a policy must return "
        "a torch.utils.checkpoint.CheckpointPolicy, a bool or an ac2_dist.SAVE_WITH_HOOKS."
    )


class _Frame:
    """One entered region's policy, normalized.

    Exactly one of ``const`` (the same decision for every op), ``save_set`` (save-list
    form) or ``fn`` (a user callable) is set, so the tracer can skip the Python call
    for the built-in forms (hot path).
    """

    __slots__ = (
        "const", "const_save", "save_set", "fn", "name", "rng", "allow_mutation", "module_fqn",
    )

    def __init__(
        self, policy: PolicyLike, *, rng: str, allow_mutation: bool, module_fqn: str
    ) -> None:
        if rng not in ("save", "replay"):
            raise ValueError(f"ac2_dist: rng must be 'save' or 'replay', got {rng!r}")
        self.const: Decision | None = None
        self.save_set: frozenset | None = None
        self.fn: PolicyFn | None = None
        self.rng = rng
        self.allow_mutation = allow_mutation
        self.module_fqn = module_fqn
        if isinstance(policy, str):
            if policy not in _STRINGS:
                raise ValueError(
                    f"ac2_dist: unknown policy string {policy!r}; use one of {sorted(_STRINGS)}, "
                    "a policy callable or an iterable of OpOverloads to save"
                )
            self.const = _STRINGS[policy]
            self.name = repr(policy)
        elif isinstance(policy, bool):  # True: save everything, False: recompute everything
            self.const = _CP.MUST_SAVE if policy else _CP.PREFER_RECOMPUTE
            self.name = repr(policy)
        elif isinstance(policy, (CheckpointPolicy, SAVE_WITH_HOOKS)):
            self.const = policy
            self.name = repr(policy)
        elif callable(policy):
            self.fn = policy
            self.name = getattr(policy, "__qualname__", None) or repr(policy)
        elif isinstance(policy, Iterable):
            ops = frozenset(policy)
            bad = [o for o in ops if not isinstance(o, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))]
            if bad:
                raise TypeError(
                    f"ac2_dist: a save-list policy must contain OpOverloads, got {bad[0]!r}"
                )
            # An OpOverloadPacket (torch.ops.aten.mm) saves all of its overloads.
            expanded = set()
            for o in ops:
                if isinstance(o, torch._ops.OpOverloadPacket):
                    expanded.update(getattr(o, name) for name in o.overloads())
                else:
                    expanded.add(o)
            self.save_set = frozenset(expanded)
            self.name = f"save-list({', '.join(sorted(str(o) for o in ops))})"
        else:
            raise TypeError(f"ac2_dist: unsupported policy {policy!r}")
        self.const_save = self.const is not None and is_save(self.const)

    def decide(self, ctx: PolicyContext, op: Any, args: tuple, kwargs: dict) -> Decision:
        if self.const is not None:
            return self.const
        if self.save_set is not None:
            return _CP.MUST_SAVE if op in self.save_set else _CP.PREFER_RECOMPUTE
        return _check_decision(self.fn(ctx, op, *args, **kwargs), self, op)


def resolve(frames: list[_Frame], ctx: PolicyContext, op: Any, args: tuple, kwargs: dict) -> Decision:
    """Combine the policies of nested regions, outermost first (CONTRACT §2).

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
