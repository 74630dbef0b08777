"""Module API: checkpoint modules in place (CONTRACT §6).

``wrap`` replaces a module's ``forward`` (an instance attribute, so the module tree,
its FQNs and state-dict keys do not change) with one that runs the original forward
inside a region. FSDP2's hooks live around ``forward`` (in ``__call__``), so a wrapped
module composes with ``fully_shard`` applied before or after: FSDP's all-gather runs
outside the region and its unsharded parameters are region inputs; FSDP units called
*inside* the region (nested units) are handled by the boundary hook (Note [FSDP units
are region boundaries] in fsdp.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch.nn as nn

from ._policy import PolicyLike, _Frame
from ._region import apply_ac_policy

__all__ = ["apply_ac", "wrap", "unwrap"]

_ATTR = "_ac2_wrapped_forward"

ModuleSelector = type | tuple | list | Callable[[str, nn.Module], bool] | None


def wrap(
    module: nn.Module,
    policy: PolicyLike = "recompute_all",
    *,
    rng: str = "save",
    allow_cache_entry_mutation: bool = False,
    module_fqn: str = "",
) -> nn.Module:
    """Checkpoint ``module``: its forward runs inside ``apply_ac_policy(policy, ...)``.

    In place; returns ``module``. Wrapping an already wrapped module replaces its
    policy. ``module_fqn`` is what policies see as ``ctx.module_fqn``.
    """
    frame = _Frame(policy, rng=rng, allow_mutation=allow_cache_entry_mutation, module_fqn=module_fqn)
    original = getattr(module, _ATTR, None) or module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with apply_ac_policy._from_frame(frame):
            return original(*args, **kwargs)

    module.forward = forward
    setattr(module, _ATTR, original)
    return module


def unwrap(module: nn.Module) -> nn.Module:
    """Undo :func:`wrap` (no-op for a module that is not wrapped)."""
    original = module.__dict__.pop(_ATTR, None)
    if original is not None:
        module.__dict__.pop("forward", None)
    return module


def _select(model: nn.Module, modules: ModuleSelector) -> list[tuple[str, nn.Module]]:
    if modules is None:
        return [("", model)]
    if isinstance(modules, type) or (
        isinstance(modules, (tuple, list)) and all(isinstance(m, type) for m in modules)
    ):
        types = tuple(modules) if isinstance(modules, (tuple, list)) else (modules,)
        return [(n, m) for n, m in model.named_modules() if isinstance(m, types)]
    if callable(modules):
        return [(n, m) for n, m in model.named_modules() if modules(n, m)]
    raise TypeError(
        "ac2_dist.apply_ac: modules must be a module type, a list of types, a predicate "
        f"(fqn, module) -> bool, or None; got {modules!r}"
    )


def apply_ac(
    model: nn.Module,
    policy: PolicyLike = "recompute_all",
    modules: ModuleSelector | Iterable[type] = None,
    *,
    rng: str = "save",
    allow_cache_entry_mutation: bool = False,
) -> nn.Module:
    """Checkpoint the selected submodules of ``model`` in place; returns ``model``.

    Args:
        model: the model (plain or already ``fully_shard``-ed; ``fully_shard`` may
            also be applied afterwards).
        policy: as for :class:`apply_ac_policy`.
        modules: module types (``[TransformerBlock]``), a predicate
            ``(fqn, module) -> bool``, or ``None`` for ``model`` itself.

    Raises ValueError if nothing matches (a typo in ``modules`` should not silently
    checkpoint nothing).
    """
    selected = _select(model, modules)
    if not selected:
        raise ValueError(f"ac2_dist.apply_ac: no submodule of {type(model).__name__} matches {modules!r}")
    for fqn, module in selected:
        wrap(module, policy, rng=rng, allow_cache_entry_mutation=allow_cache_entry_mutation, module_fqn=fqn)
    return model
