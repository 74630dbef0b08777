"""Hugging Face transformers: checkpoint a ``PreTrainedModel``'s layers with ac2, through
HF's own gradient-checkpointing mechanism (CONTRACT §9).

    from ac2_dist.integrations import hf
    hf.enable(model, policy="recompute_all", every_n_layers=1)   # instead of
    # model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf.disable(model)

Note [Through HF's own switch]
    :func:`enable` turns on HF's checkpointing with HF's own method (so everything HF
    does for checkpointed layers keeps working: ``is_gradient_checkpointing`` is true,
    caches are disabled in training, ``every_n_layers``, input grads for embeddings,
    ``save_pretrained``) and then gives every module HF set up the checkpointing
    function ``functools.partial(ac2_dist.checkpoint, ...)`` in place of torch's. HF
    calls it as ``func(partial(layer.forward, **kwargs), *args)`` in training mode
    only, so generation and evaluation run the plain forward. Do not also set
    ``TrainingArguments(gradient_checkpointing=True)``: the Trainer would switch the
    model back to torch's checkpoint (the model already reports checkpointing on).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import transformers

from .._dropin import checkpoint, is_ac2_checkpoint
from .._policy import PolicyLike, PolicySource

__all__ = ["enable", "disable", "is_enabled"]



def _check_model(model: Any, where: str) -> None:
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(
            f"ac2_dist.integrations.hf.{where}: model must be a transformers.PreTrainedModel, got "
            f"{type(model).__name__}; for other modules use ac2_dist.apply_ac(model, modules=[Block])"
        )


def enable(
    model: Any,
    policy: PolicyLike | None = None,
    every_n_layers: int = 1,
    *,
    policy_factory: Callable[[], PolicyLike] | None = None,
    **region_options: Any,
) -> Any:
    """Checkpoint ``model``'s layers with ac2 through HF's mechanism; returns ``model``.

    Args:
        model: a ``transformers.PreTrainedModel`` that supports gradient checkpointing.
        policy: an ac2 policy (CONTRACT §2), default ``"recompute_all"``.
        every_n_layers: checkpoint every n-th layer (HF's own option; transformers >= 5).
        policy_factory: instead of ``policy``, a zero-argument callable called for every
            layer call (a fresh stateful policy per layer).
        **region_options: ``rng`` (``"replay"`` by default here: dropout masks are
            regenerated, as HF's torch checkpoint does) and ``allow_cache_entry_mutation``.

    Raises TypeError for a model that is not a ``PreTrainedModel`` or a bad option, and
    ValueError for a model without checkpointable layers or a bad ``every_n_layers``.
    """
    _check_model(model, "enable")
    unknown = sorted(set(region_options) - {"rng", "allow_cache_entry_mutation"})
    if unknown:
        raise TypeError(
            f"ac2_dist.integrations.hf.enable: unknown option(s) {unknown}; region options are "
            "rng and allow_cache_entry_mutation"
        )
    if not isinstance(every_n_layers, int) or isinstance(every_n_layers, bool) or every_n_layers < 1:
        raise ValueError(f"ac2_dist.integrations.hf.enable: every_n_layers must be an int >= 1, got {every_n_layers!r}")
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"ac2_dist.integrations.hf.enable: {type(model).__name__} has no checkpointable layers "
            "(supports_gradient_checkpointing is False); use ac2_dist.apply_ac(model, modules=[...])"
        )
    rng = region_options.get("rng", "replay")
    allow = region_options.get("allow_cache_entry_mutation", False)
    PolicySource(policy, policy_factory, rng=rng, allow_mutation=allow, module_fqn="", where="integrations.hf.enable")
    func = functools.partial(
        checkpoint, use_reentrant=False, preserve_rng_state=rng == "replay", policy=policy,
        policy_factory=policy_factory, allow_cache_entry_mutation=allow,
    )
    _hf_enable(model, every_n_layers)
    for m in model.modules():
        if "_gradient_checkpointing_func" in m.__dict__ or hasattr(m, "gradient_checkpointing"):
            m._gradient_checkpointing_func = func  # Note [Through HF's own switch]
    return model


def _hf_enable(model: Any, every_n_layers: int) -> None:
    enable_fn = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5
    if enable_fn is not None:
        enable_fn(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every_n_layers)
        return
    if every_n_layers != 1:
        raise ValueError(
            f"ac2_dist.integrations.hf.enable: every_n_layers={every_n_layers} needs transformers >= 5 "
            f"(installed: {transformers.__version__})"
        )
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    if "gradient_checkpointing_kwargs" not in inspect.signature(model.gradient_checkpointing_enable).parameters:
        kwargs = {}
    model.gradient_checkpointing_enable(**kwargs)


def disable(model: Any) -> Any:
    """Turn HF's checkpointing off again (HF's own method); returns ``model``."""
    _check_model(model, "disable")
    disable_fn = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    disable_fn()
    return model


def is_enabled(model: Any) -> bool:
    """Whether some layer of ``model`` is checkpointed by ac2 through HF."""
    _check_model(model, "is_enabled")
    return any(
        getattr(m, "gradient_checkpointing", False) and is_ac2_checkpoint(m.__dict__.get("_gradient_checkpointing_func"))
        for m in model.modules()
    )
