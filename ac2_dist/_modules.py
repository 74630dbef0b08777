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
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from ._policy import PolicyLike, _Frame
from ._region import _thread_state, apply_ac_policy
from .fsdp import is_fsdp_unit, unsharded_params
from .replay import DEFAULT_CONFIG, ReplayConfig, trace_range

__all__ = ["apply_ac", "wrap", "unwrap"]

_ATTR = "_ac2_wrap"  # (forward before wrapping or None, policy frame, ReplayConfig)

ModuleSelector = type | tuple | list | Callable[[str, nn.Module], bool] | None


def wrap(
    module: nn.Module,
    policy: PolicyLike = "recompute_all",
    *,
    rng: str = "save",
    allow_cache_entry_mutation: bool = False,
    module_fqn: str = "",
    replay: ReplayConfig | None = None,
) -> nn.Module:
    """Checkpoint ``module``: its forward runs inside ``apply_ac_policy(policy, ...)``.

    In place; returns ``module``. Wrapping an already wrapped module replaces its
    policy. ``module_fqn`` is what policies see as ``ctx.module_fqn``; ``replay`` a
    :class:`ReplayConfig` (side stream, prefetch depth).
    """
    frame = _Frame(policy, rng=rng, allow_mutation=allow_cache_entry_mutation, module_fqn=module_fqn)
    config = replay or DEFAULT_CONFIG
    if _ATTR in module.__dict__:  # re-wrap: keep what forward was before the first wrap
        previous = module.__dict__[_ATTR][0]
    else:
        previous = module.__dict__.get("forward")  # an instance-level forward, if any
    # A partial over a module-level function (not a closure): copy.deepcopy maps the
    # module argument to the copy, and torch.save can pickle it.
    module.forward = functools.partial(_checkpointed_forward, module)
    module.__dict__[_ATTR] = (previous, frame, config)
    return module


def _checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    previous, frame, config = module.__dict__[_ATTR]
    region = apply_ac_policy._from_frame(frame, config)
    with region:
        if previous is not None:
            out = previous(*args, **kwargs)
        else:
            out = type(module).forward(module, *args, **kwargs)
        if is_fsdp_unit(module):  # our region runs inside FSDP's pre/post-forward
            _thread_state().graph.mark_fsdp_params(unsharded_params(module), module)
    if region.graph is not None and torch.is_grad_enabled():
        _link_for_prefetch(region.graph, config, frame.module_fqn, args, kwargs, out)
    return out


def _link_for_prefetch(graph: Any, config: ReplayConfig, fqn: str, args: Any, kwargs: Any, out: Any) -> None:
    """Note [Prefetching the next unit's replay] (replay.py): chain this unit's graph
    to the previous one and prefetch that one when this unit's backward starts."""
    on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    depth = config.prefetch_depth(on_cuda)
    log = config.log
    if depth == 0 and log is None:
        return
    st = _thread_state()
    graph.prev, graph.fqn, graph.log = st.last_graph, fqn, log
    this = weakref.ref(graph)
    st.last_graph = this

    def backward_starts(_grads: Any) -> None:
        if log is not None:
            log("backward_start", fqn)
        g = this()
        prev = g.prev if g is not None else None
        for _ in range(depth):
            unit = prev() if prev is not None else None
            if unit is None:
                break
            if log is not None:
                log("prefetch_start", unit.fqn)
            with trace_range("ac2::prefetch"):
                unit.prefetch()
            if log is not None:
                log("prefetch_end", unit.fqn)
            prev = unit.prev

    outputs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if outputs:
        torch.autograd.graph.register_multi_grad_hook(outputs, backward_starts, mode="any")
    if log is not None:
        inputs = [
            t for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if inputs:
            torch.autograd.graph.register_multi_grad_hook(inputs, lambda _g: log("backward_end", fqn), mode="any")


def unwrap(module: nn.Module) -> nn.Module:
    """Undo :func:`wrap` (no-op for a module that is not wrapped)."""
    wrapped = module.__dict__.pop(_ATTR, None)
    if wrapped is not None:
        previous = wrapped[0]
        if previous is not None:
            module.__dict__["forward"] = previous
        else:
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
    replay: ReplayConfig | None = None,
) -> nn.Module:
    """Checkpoint the selected submodules of ``model`` in place; returns ``model``.

    Args:
        model: the model (plain or already ``fully_shard``-ed; ``fully_shard`` may
            also be applied afterwards).
        policy: as for :class:`apply_ac_policy`.
        modules: module types (``[TransformerBlock]``), a predicate
            ``(fqn, module) -> bool``, or ``None`` for ``model`` itself.
        replay: a :class:`ReplayConfig`: where replays run and how many modules
            ahead backward prefetches them.

    Raises ValueError if nothing matches (a typo in ``modules`` should not silently
    checkpoint nothing).
    """
    selected = _select(model, modules)
    if not selected:
        raise ValueError(f"ac2_dist.apply_ac: no submodule of {type(model).__name__} matches {modules!r}")
    for fqn, module in selected:
        wrap(module, policy, rng=rng, allow_cache_entry_mutation=allow_cache_entry_mutation,
             module_fqn=fqn, replay=replay)
    return model
