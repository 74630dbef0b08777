"""Module API: checkpoint modules in place.

``wrap`` replaces a module's ``forward`` (an instance attribute, so the module tree,
its FQNs and state-dict keys do not change) with a :class:`_CheckpointedForward` that
runs the original forward inside a region. FSDP2's hooks live around ``forward`` (in
``__call__``), so a wrapped module composes with ``fully_shard`` applied before or
after: FSDP's all-gather runs outside the region and its unsharded parameters are
region inputs; FSDP units called *inside* the region (nested units) are handled by
the boundary hook (Note [FSDP units are region boundaries] in fsdp.py).

Note [The wrapper holds its module weakly]
    ``module.forward`` is an instance attribute, so a strong reference from it to the
    module would be a cycle (module -> __dict__ -> forward -> module): a model would
    only be freed when gc runs. The wrapper keeps a weak reference; ``deepcopy``
    re-points the copy's wrapper at the copied module (through the deepcopy memo) and
    pickling stores the module by reference, so ``copy.deepcopy(model)`` and
    ``torch.save(model)`` keep working.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.nn as nn

from ._device import device_of
from ._dropin import is_ac2_checkpoint
from ._groups import _Group, check_groups, group_name, group_of
from ._policy import PolicyLike, PolicySource
from ._rebuild import install as install_rebuild
from ._rebuild import remove as remove_rebuild
from ._region import _thread_state, apply_ac_policy
from ._units import after_region, needs_region
from .compile import (
    announce_eager_only,
    checkpoint_compiled,
    is_compiling,
    refuse_budget_compiled,
    source_context_fn,
)
from .fsdp import is_fsdp_unit, unsharded_params
from .offload import Offload
from .replay import ReplayConfig, check_replay

__all__ = ["apply_ac", "wrap", "unwrap", "is_checkpointed"]

_ATTR = "_ac2_wrap"  # the module's _CheckpointedForward (also its ``forward``)

ModuleSelector = type | tuple | list | Callable[[str, nn.Module], bool] | None


class _CheckpointedForward:
    """``module.forward`` of a checkpointed module (Note [The wrapper holds its module weakly])."""

    __slots__ = ("_module", "previous", "source", "config", "context_fn", "__weakref__")

    def __init__(self, module: nn.Module, previous: Any, source: PolicySource, config: ReplayConfig) -> None:
        self._module = weakref.ref(module)
        self.previous = previous  # an instance-level forward from before wrapping, or None
        self.source = source  # the policy, or a policy_factory (Note [Policy factories])
        self.config = config
        self.context_fn = source_context_fn(source)  # the policy inside torch.compile (compile.py)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if module is None:
            raise RuntimeError("ac2_dist: the checkpointed module this forward belongs to was freed")
        previous = self.previous
        if is_compiling():  # traced by dynamo: one checkpointed region of the compiled graph
            if self.source.frame is not None and self.source.frame.per_region is not None:
                refuse_budget_compiled()
            if self.config.explicit_scheduling():
                announce_eager_only("an explicit ReplayConfig (side stream, prefetch)")
            if previous is not None:
                return checkpoint_compiled(previous, self.context_fn, *args, **kwargs)
            return checkpoint_compiled(type(module).forward, self.context_fn, module, *args, **kwargs)
        if not needs_region(module, args, kwargs):  # Note [No grad, no region] (_region.py)
            if previous is not None:
                return previous(*args, **kwargs)
            return type(module).forward(module, *args, **kwargs)
        # Note [The device comes from the tensors] (_device.py)
        device = device_of(args, kwargs, module=module)
        region = apply_ac_policy._from_frame(self.source.new_frame(), self.config, device=device, inputs=args)
        with region:
            if previous is not None:
                out = previous(*args, **kwargs)
            else:
                out = type(module).forward(module, *args, **kwargs)
            if is_fsdp_unit(module):  # our region runs inside FSDP's pre/post-forward
                _thread_state().graph.mark_fsdp_params(unsharded_params(module), module)
        after_region(region, self.config, self.source.module_fqn, args, kwargs, out, device.type == "cuda", self)
        return out

    def __deepcopy__(self, memo: dict) -> _CheckpointedForward:
        module = self._module()
        copied = memo.get(id(module), module)  # the module being copied, if it is
        return _CheckpointedForward(
            copied, copy.deepcopy(self.previous, memo), copy.deepcopy(self.source, memo), self.config
        )

    def __reduce__(self) -> tuple:
        module = self._module()
        what_policy = "policy" if self.source.frame is not None else "policy_factory"
        for what, obj in ((what_policy, self.source.user_callable), ("replay config", self.config)):
            if obj is None:
                continue
            try:
                pickle.dumps(obj)
            except Exception as e:
                fqn = self.source.module_fqn or type(module).__name__
                raise pickle.PicklingError(
                    f"ac2_dist: the {what} of the checkpointed module '{fqn}' ({obj!r}) cannot be "
                    f"pickled ({e}). Use a module-level function or a built-in policy form "
                    "(string, op list, dict), or call ac2_dist.unwrap on the module before saving."
                ) from e
        return (_CheckpointedForward, (module, self.previous, self.source, self.config))

    def __repr__(self) -> str:
        module = self._module()
        name = type(module).__name__ if module is not None else "<freed>"
        return f"<ac2_dist checkpointed forward of {name}, policy {self.source.name}>"


def wrap(
    module: nn.Module,
    policy: PolicyLike | None = None,
    *,
    policy_factory: Callable[[], PolicyLike] | None = None,
    rng: str = "save",
    allow_cache_entry_mutation: bool = False,
    module_fqn: str = "",
    replay: ReplayConfig | None = None,
) -> nn.Module:
    """Checkpoint ``module``: its forward runs inside ``apply_ac_policy(policy, ...)``.

    In place; returns ``module``. Wrapping an already wrapped module replaces its
    policy. ``policy`` defaults to ``"recompute_all"``; ``policy_factory`` (instead of
    ``policy``) is a zero-argument callable called at every forward for a fresh
    policy (stateful policies, e.g. "save every second matmul" counted per call).
    ``module_fqn`` is what policies see as ``ctx.module_fqn``; ``replay`` a
    :class:`ReplayConfig` (side stream, prefetch depth). Under ``torch.no_grad()`` /
    ``torch.inference_mode()``, or when no input and no parameter requires grad, the
    module runs its plain forward (nothing is recorded).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"ac2_dist.wrap: module must be a torch.nn.Module, got {type(module).__name__}; "
            "use ac2_dist.apply_ac_policy_fn(fn, *args) to checkpoint a function"
        )
    source = PolicySource(policy, policy_factory, rng=rng, allow_mutation=allow_cache_entry_mutation,
                          module_fqn=module_fqn, where="wrap")
    config = check_replay(replay)
    wrapped = module.__dict__.get(_ATTR)
    if wrapped is not None:  # re-wrap: keep what forward was before the first wrap
        previous = wrapped.previous
    else:
        previous = module.__dict__.get("forward")  # an instance-level forward, if any
    forward = _CheckpointedForward(module, previous, source, config)
    module.__dict__["forward"] = forward
    module.__dict__[_ATTR] = forward
    return module


def unwrap(module: nn.Module) -> nn.Module:
    """Undo :func:`wrap` (no-op for a module that is not wrapped). For a member of a
    module group (``apply_ac(..., groups=)``) the whole group is undone; a module named
    in ``apply_ac(..., rebuild=)`` stops being recorded."""
    remove_rebuild(module)
    group = group_of(module)
    if group is not None:
        group.remove()
    wrapped = module.__dict__.pop(_ATTR, None)
    if wrapped is not None:
        if wrapped.previous is not None:
            module.__dict__["forward"] = wrapped.previous
        else:
            module.__dict__.pop("forward", None)
    return module


def _select(model: nn.Module, modules: ModuleSelector) -> list[tuple[str, nn.Module]]:
    if modules is None:
        return [("", model)]
    if isinstance(modules, type) or (
        isinstance(modules, (tuple, list)) and modules and all(isinstance(m, type) for m in modules)
    ):
        types = tuple(modules) if isinstance(modules, (tuple, list)) else (modules,)
        return [(n, m) for n, m in model.named_modules() if isinstance(m, types)]
    if isinstance(modules, nn.Module) or (
        isinstance(modules, (tuple, list)) and any(isinstance(m, nn.Module) for m in modules)
    ):
        raise TypeError(
            "ac2_dist.apply_ac: modules takes module *types* (e.g. modules=[nn.Linear]) or a "
            f"predicate (fqn, module) -> bool, not a module instance ({modules!r}); to "
            "checkpoint one module use ac2_dist.wrap(module)"
        )
    if callable(modules):
        return [(n, m) for n, m in model.named_modules() if modules(n, m)]
    raise TypeError(
        "ac2_dist.apply_ac: modules must be a module type, a list of types, a predicate "
        f"(fqn, module) -> bool, or None; got {modules!r}"
    )


def apply_ac(
    model: nn.Module,
    policy: PolicyLike | None = None,
    modules: ModuleSelector | Iterable[type] = None,
    *,
    policy_factory: Callable[[], PolicyLike] | None = None,
    rng: str = "save",
    allow_cache_entry_mutation: bool = False,
    replay: ReplayConfig | None = None,
    groups: Sequence[Sequence[str]] = (),
    rebuild: Sequence[str] = (),
) -> nn.Module:
    """Checkpoint the selected submodules of ``model`` in place; returns ``model``.

    Args:
        model: the model (plain or already ``fully_shard``-ed; ``fully_shard`` may
            also be applied afterwards).
        policy: as for :class:`apply_ac_policy` (default ``"recompute_all"``).
        modules: module types (``[TransformerBlock]``), a predicate
            ``(fqn, module) -> bool``, or ``None`` for ``model`` itself.
        policy_factory: instead of ``policy``, a zero-argument callable called at
            every forward of every selected module for a fresh policy (stateful
            policies such as torchtitan's "save every second matmul").
        rng: what backward does with random ops (dropout): ``"save"`` (the default)
            keeps their outputs (a dropout mask is kept, as torch's selective checkpoint
            keeps it); ``"replay"`` regenerates their bits exactly from the generator
            state forward saw, keeping nothing (torch's full checkpoint's memory).
            Gradients are eager's either way.
        allow_cache_entry_mutation: let a value the region saved be changed in place
            after forward (backward then reads the changed value, as eager would not);
            by default such a change raises at backward, naming the op.
        replay: a :class:`ReplayConfig`: where replays run and how many modules
            ahead backward prefetches them. Without an ``offload`` in it, the selected
            modules share one new :class:`ac2_dist.Offload` (CPU-offloaded saves on
            CUDA follow its asynchronous schedule).
        groups: lists of module names (fqns) each checkpointed as *one* region under
            the same policy: it opens when the first of them begins its forward and
            closes when all of them have run, recording what runs in between. For a
            causal LM, ``[["model.norm", "lm_head"]]`` keeps only the last layer's
            output for the final norm and the LM head, where separate regions (or
            none) keep two or three hidden-state-sized tensors; it pays at long
            context. If not every member runs (the decoder called without its head),
            the region closes when the outermost of the members' enclosing modules
            that was running returns. Eager only: under ``torch.compile`` a group's
            members run unchecked (a warning says so). To checkpoint the groups
            alone, pass a ``modules`` predicate that selects nothing else
            (``modules=lambda fqn, m: False``).
        rebuild: names (fqns) of modules that run outside every region and make what
            several regions read, such as a causal LM's rotary embedding
            (``["model.rotary_emb"]``, whose cos and sin every layer reads). Their
            forward's ATen ops are recorded, and a region reading one of their outputs
            keeps what those ops read (the positions) instead of the output and replays
            the ops in backward. It applies to outputs that do not require grad, made by
            ops without random draws, collectives or in-place writes, and whose recipe
            reads fewer bytes (the module's parameters and buffers aside) than the outputs
            hold; otherwise the outputs are kept as before. Gradients are unchanged. Eager
            only: under ``torch.compile`` nothing is recorded (a warning says so).

    Raises TypeError for arguments of the wrong kind and ValueError if nothing
    matches (a typo in ``modules`` should not silently checkpoint nothing).

    Example::

        import torch
        import ac2_dist as ac

        Layer = torch.nn.TransformerEncoderLayer
        model = torch.nn.Sequential(*[Layer(64, 4, 256, dropout=0.1, batch_first=True) for _ in range(4)])
        ac.apply_ac(model, "recompute_all", modules=[Layer], rng="replay")  # dropout masks regenerated
        model(torch.randn(2, 16, 64)).sum().backward()   # each layer replays only the ops backward needs
        assert ac.is_checkpointed(model[0])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"ac2_dist.apply_ac: model must be a torch.nn.Module, got {type(model).__name__}; "
            "use ac2_dist.apply_ac_policy_fn(fn, *args) to checkpoint a function"
        )
    PolicySource(policy, policy_factory, rng=rng, allow_mutation=allow_cache_entry_mutation, module_fqn="",
                 where="apply_ac")  # validate first
    config = check_replay(replay)
    selected = _select(model, modules)
    if not selected and not groups:  # groups alone: a predicate that selects nothing else
        raise ValueError(f"ac2_dist.apply_ac: no submodule of {type(model).__name__} matches {modules!r}")
    if config.offload is None:  # one schedule for the blocks of this model (offload.py)
        config = dataclasses.replace(config, offload=Offload())
    if groups:
        # validated before any module is wrapped: a bad group changes nothing
        check_groups(model, groups, {fqn for fqn, _ in selected} | wrapped_fqns(model))
    if rebuild:  # validated before any module is wrapped
        install_rebuild(model, rebuild, {fqn for fqn, _ in selected} | wrapped_fqns(model)
                        | {f for g in groups for f in g})
    for fqn, module in selected:
        wrap(module, policy, policy_factory=policy_factory, rng=rng,
             allow_cache_entry_mutation=allow_cache_entry_mutation, module_fqn=fqn, replay=config)
    for group in groups:
        source = PolicySource(policy, policy_factory, rng=rng, allow_mutation=allow_cache_entry_mutation,
                              module_fqn=group_name(group), where="apply_ac")
        _Group(model, group, source, config).install()
    watch_steps(policy, model)
    return model


def wrapped_fqns(model: nn.Module) -> set[str]:
    """The paths in ``model`` of the modules :func:`wrap` checkpointed."""
    return {n for n, m in model.named_modules() if m.__dict__.get(_ATTR) is not None}


def watch_steps(policy: Any, model: nn.Module) -> None:
    """A ``MemoryBudget(peak=...)`` given to :func:`apply_ac` or ``hf.enable``: its steps
    begin at ``model``'s forward, where ``memory.track(model)``'s do, so that what the model
    makes before its first checkpointed block (embeddings, masks) counts toward the target."""
    watch = getattr(policy, "_watch_model", None)
    if callable(watch):
        watch(model)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module``'s forward runs in an ac2 region: wrapped by :func:`wrap` /
    :func:`apply_ac`, or a Hugging Face layer whose checkpointing function is ac2's
    (:func:`ac2_dist.integrations.hf.enable`)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"ac2_dist.is_checkpointed: expected a torch.nn.Module, got {type(module).__name__}")
    if module.__dict__.get(_ATTR) is not None or group_of(module) is not None:
        return True
    # transformers' GradientCheckpointingLayer: a flag and the function it calls.
    func = module.__dict__.get("_gradient_checkpointing_func")
    return bool(getattr(module, "gradient_checkpointing", False)) and is_ac2_checkpoint(func)
