"""Hugging Face transformers: checkpoint a ``PreTrainedModel``'s layers with ac2, through
HF's own gradient-checkpointing mechanism.

    from ac2_dist.integrations import hf
    hf.enable(model, policy="recompute_all", every_n_layers=1)   # instead of
    # model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf.disable(model)
"""

# Note [Through HF's own switch]
#     :func:`enable` turns on HF's checkpointing with HF's own method (so everything HF
#     does for checkpointed layers keeps working: ``is_gradient_checkpointing`` is true,
#     caches are disabled in training, ``every_n_layers``, input grads for embeddings,
#     ``save_pretrained``) and then gives every module HF set up the checkpointing
#     function ``ac2_dist.checkpoint_with(...)`` in place of torch's. HF
#     calls it as ``func(partial(layer.forward, **kwargs), *args)`` in training mode
#     only, so generation and evaluation run the plain forward (Note [A second switch
#     keeps ac2] for a Trainer that turns HF's checkpointing on again).
#
# Note [HF's methods, not the instance's]
#     transformers honours ``activation_checkpointing_enable`` /
#     ``gradient_checkpointing_enable`` overridden on the *instance* (the natural way to
#     make Trainer's switch select ac2: ``model.activation_checkpointing_enable = lambda
#     **kw: hf.enable(model)``). HF's class method looks those attributes up on the
#     instance again, so calling it from :func:`enable` would re-enter the override.
#     :func:`enable` and :func:`disable` therefore run the class's methods with the
#     instance's overrides hidden for the duration of the call (restored after), so
#     class-level overrides (custom model code) still run and instance ones do not.
#
# Note [A second switch keeps ac2]
#     A Trainer given ``gradient_checkpointing=True`` calls the model's
#     ``activation_checkpointing_enable`` after the user's :func:`enable`, which would put
#     torch's checkpoint back silently. :func:`enable` therefore sets that method (and the
#     deprecated ``gradient_checkpointing_enable``) on the instance -- unless the user
#     already overrode it there -- to one that re-applies ac2 (honouring
#     ``every_n_layers``) and warns once per model; :func:`disable` removes it. A Trainer
#     that should choose the policy uses ``integrations.torch_checkpoint`` instead.
#
# Note [Model code that calls torch's checkpoint itself]
#     A few models call ``torch.utils.checkpoint.checkpoint`` in their own forward instead
#     of through HF's ``_gradient_checkpointing_func`` (CLVP's conditioning encoder,
#     Grounding DINO's encoder layers). HF's switch turns those calls on too, and
#     :func:`enable` cannot give them ac2's function: they stay torch's checkpoint. So
#     :func:`enable` warns once naming them, :func:`torch_checkpointed` lists them, and
#     :func:`is_enabled` is False while any is on (it says that every checkpointed call
#     of the model is ac2's). ``integrations.torch_checkpoint.enable(...)`` routes those
#     calls to ac2 as well (it patches torch's entry points for the process).
#
# Note [What users hold]
#     ``peft.get_peft_model`` returns a ``PeftModel`` around the ``PreTrainedModel``; HF's
#     own switch works on it (attribute forwarding), so :func:`enable`, :func:`disable` and
#     :func:`is_enabled` accept it too and act on ``get_base_model()``.

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import transformers

from .._dropin import checkpoint_with, is_ac2_checkpoint
from .._groups import _Group, check_groups, group_name, group_of
from .._modules import watch_steps, wrapped_fqns
from .._policy import PolicyLike, PolicySource
from .._rebuild import install as install_rebuild
from .._rebuild import remove as remove_rebuild
from ..replay import check_replay

__all__ = ["enable", "disable", "is_enabled", "torch_checkpointed"]

_SWITCHES = ("activation_checkpointing_enable", "gradient_checkpointing_enable",
             "activation_checkpointing_disable", "gradient_checkpointing_disable")


def _hf_model(model: Any, where: str) -> Any:
    """The ``PreTrainedModel`` to act on: ``model``, or a PEFT model's base (Note [What
    users hold])."""
    if isinstance(model, transformers.PreTrainedModel):
        return model
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else None
    if isinstance(base, transformers.PreTrainedModel):
        return base
    raise TypeError(
        f"ac2_dist.integrations.hf.{where}: model must be a transformers.PreTrainedModel (or a PEFT model "
        f"around one), got {type(model).__name__}; for other modules use "
        "ac2_dist.apply_ac(model, modules=[Block])"
    )


def _call_class_method(model: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """``type(model).<name>(model, ...)`` with the instance's overrides of HF's switches
    hidden while it runs (Note [HF's methods, not the instance's])."""
    hidden = {k: model.__dict__.pop(k) for k in _SWITCHES if k in model.__dict__}
    try:
        return getattr(type(model), name)(model, *args, **kwargs)
    finally:
        model.__dict__.update(hidden)


def enable(
    model: Any,
    policy: PolicyLike | None = None,
    every_n_layers: int = 1,
    *,
    policy_factory: Callable[[], PolicyLike] | None = None,
    head: bool = False,
    rebuild: Sequence[str] = (),
    **region_options: Any,
) -> Any:
    """Checkpoint ``model``'s layers with ac2 through HF's mechanism; returns ``model``.

    Args:
        model: a ``transformers.PreTrainedModel`` that supports gradient checkpointing,
            or a PEFT model around one (``peft.get_peft_model``).
        policy: an ac2 policy (as :class:`ac2_dist.apply_ac_policy` takes), default ``"recompute_all"``.
        every_n_layers: checkpoint every n-th layer (HF's own option, where its switch takes it:
            transformers >= 5.17).
        policy_factory: instead of ``policy``, a zero-argument callable called for every
            layer call (a fresh stateful policy per layer).
        head: also checkpoint the decoder's final norm and the LM head as one region
            (``apply_ac``'s ``groups``), under the same policy: only the last layer's
            output is kept for them (eager keeps two or three hidden-state-sized
            tensors there), which pays at long context. The norm is the decoder's
            ``norm``, ``ln_f``, ``final_layer_norm`` or ``norm_f``. Enabling again
            replaces the head's region; ``head=False`` leaves one made before as it is
            (:func:`disable` removes it).
        rebuild: names of modules whose outputs the layers rebuild in backward instead
            of keeping, as ``apply_ac``'s ``rebuild``: ``["model.rotary_emb"]`` for a
            Llama-style model, whose rotary tables every layer reads. Enabling again
            replaces them; :func:`disable` stops them.
        **region_options: ``rng`` (``"replay"`` by default here: dropout masks are
            regenerated, as HF's torch checkpoint does) and ``allow_cache_entry_mutation``.

    Raises TypeError for a model that is not a ``PreTrainedModel`` or a bad option, and
    ValueError for a model without checkpointable layers or a bad ``every_n_layers``.

    Each layer's region carries the layer's path in ``model`` (``model.layers.0``): what a
    policy sees as ``ctx.module_fqn``, what memory reports list per module and what a
    :class:`~ac2_dist.MemoryBudget` plans by.

    Example::

        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from ac2_dist.integrations import hf

        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4)
        model = hf.enable(LlamaForCausalLM(config).train())   # every decoder layer checkpointed by ac2
        ids = torch.randint(0, 256, (2, 32))
        model(input_ids=ids, labels=ids).loss.backward()
        assert hf.is_enabled(model)
    """
    hf_model = _hf_model(model, "enable")
    unknown = sorted(set(region_options) - {"rng", "allow_cache_entry_mutation"})
    if unknown:
        raise TypeError(
            f"ac2_dist.integrations.hf.enable: unknown option(s) {unknown}; region options are "
            "rng and allow_cache_entry_mutation"
        )
    if not isinstance(every_n_layers, int) or isinstance(every_n_layers, bool) or every_n_layers < 1:
        raise ValueError(f"ac2_dist.integrations.hf.enable: every_n_layers must be an int >= 1, got {every_n_layers!r}")
    if not getattr(hf_model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"ac2_dist.integrations.hf.enable: {type(hf_model).__name__} has no checkpointable layers "
            "(supports_gradient_checkpointing is False); use ac2_dist.apply_ac(model, modules=[...])"
        )
    rng = region_options.get("rng", "replay")
    allow = region_options.get("allow_cache_entry_mutation", False)
    PolicySource(policy, policy_factory, rng=rng, allow_mutation=allow, module_fqn="", where="integrations.hf.enable")
    func = checkpoint_with(policy, policy_factory=policy_factory, rng=rng, allow_cache_entry_mutation=allow)
    group = _head_group(hf_model, model) if head else None  # before anything changes
    if group is not None:
        for fqn in group:  # enabling again replaces the head's region (its policy may differ)
            previous = group_of(model.get_submodule(fqn))
            if previous is not None:
                previous.remove()
        check_groups(model, [group], wrapped_fqns(model))
    if rebuild:
        for fqn in rebuild if isinstance(rebuild, (list, tuple)) else ():
            if isinstance(fqn, str) and fqn:  # enabling again replaces them
                with contextlib.suppress(AttributeError):
                    remove_rebuild(model.get_submodule(fqn))
        install_rebuild(model, rebuild, wrapped_fqns(model) | set(group or ()) | _layer_fqns(model))
    _hf_enable(hf_model, every_n_layers)
    _install(hf_model, func, model)
    if group is not None:
        source = PolicySource(policy, policy_factory, rng=rng, allow_mutation=allow, module_fqn=group_name(group),
                              where="integrations.hf.enable")
        _Group(model, group, source, check_replay(None)).install()
    watch_steps(policy, model)  # a peak target's steps begin at the forward of the model users call
    for name in _SWITCHES[:2]:  # Note [A second switch keeps ac2]
        current = hf_model.__dict__.get(name)
        if hasattr(type(hf_model), name) and (current is None or isinstance(current, _KeepAc2)):
            hf_model.__dict__[name] = _KeepAc2(hf_model, func, name, model)
    direct = torch_checkpointed(hf_model)
    if direct:  # Note [Model code that calls torch's checkpoint itself]
        warnings.warn(
            f"ac2_dist.integrations.hf.enable: {type(hf_model).__name__} checkpoints some modules by calling "
            f"torch.utils.checkpoint.checkpoint in their own forward ({', '.join(direct)}); those calls stay "
            "torch's checkpoint (hf.is_enabled(model) is False while they are on). To run them with ac2 too, "
            "use ac2_dist.integrations.torch_checkpoint.enable(policy=...) instead of hf.enable.",
            UserWarning, stacklevel=2,
        )
    return model


_FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "norm_f")


def _layer_fqns(model: Any) -> set[str]:
    """The paths of the layers HF's switch checkpoints (its ``GradientCheckpointingLayer``s)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # older transformers: no common layer class
        return set()
    return {name for name, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)}


def _head_group(hf_model: Any, named_from: Any) -> list[str]:
    """The fqns (in ``named_from``) of ``hf_model``'s decoder's final norm and its LM head."""
    where = "ac2_dist.integrations.hf.enable(head=True)"
    head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
    decoder = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else None
    norm = next((getattr(decoder, n) for n in _FINAL_NORMS if isinstance(getattr(decoder, n, None), torch.nn.Module)),
                None) if decoder is not None else None
    if head is None or norm is None:
        missing = "an LM head (get_output_embeddings())" if head is None else \
            f"a final norm ({' / '.join(_FINAL_NORMS)} of its decoder)"
        raise ValueError(f"{where}: {type(hf_model).__name__} has no {missing}; name the modules yourself with "
                         f"ac2_dist.apply_ac(model, policy, modules=..., groups=[[norm, head]])")
    names = {id(m): name for name, m in named_from.named_modules()}
    return [names[id(norm)], names[id(head)]]


def _install(model: Any, func: checkpoint_with, named_from: Any) -> None:
    """Give every module of ``model`` that HF set up ``func``, bound to the module's path
    in ``named_from`` (what the user holds: the PEFT wrapper, or ``model`` itself), so
    its regions carry that name as ``apply_ac``'s do (policies' ``ctx.module_fqn``,
    reports' per-module rows, a budget's plans)."""
    names = {id(m): name for name, m in named_from.named_modules()}
    for m in model.modules():
        if "_gradient_checkpointing_func" in m.__dict__ or hasattr(m, "gradient_checkpointing"):
            m._gradient_checkpointing_func = func._for_module(names.get(id(m), ""))  # Note [Through HF's own switch]


class _KeepAc2:
    """A model's ``activation_checkpointing_enable`` / ``gradient_checkpointing_enable``
    after :func:`enable` (Note [A second switch keeps ac2])."""

    def __init__(self, model: Any, func: checkpoint_with, name: str, named_from: Any) -> None:
        self.model = model
        self.func = func
        self.name = name
        self.named_from = named_from
        self.warned = False

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        every_n_layers = kwargs.get("every_n_layers", 1)
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"ac2_dist.integrations.hf: {type(self.model).__name__}.{self.name}() was called after hf.enable "
                "(e.g. by Trainer(gradient_checkpointing=True)); it would install torch's checkpoint, so ac2's "
                f"is kept (every_n_layers={every_n_layers}; other arguments {sorted(kwargs)} are ignored). To "
                "choose ac2's policy through the Trainer's switch instead, use "
                "ac2_dist.integrations.torch_checkpoint.enable(policy=...) and no hf.enable.",
                UserWarning, stacklevel=2,
            )
        _hf_enable(self.model, every_n_layers)
        _install(self.model, self.func, self.named_from)


def _hf_enable(model: Any, every_n_layers: int) -> None:
    """HF's own switch, found by what the installed transformers offers (Note [Through HF's
    own switch]): ``activation_checkpointing_enable`` (newer transformers) or
    ``gradient_checkpointing_enable``, non-reentrant where it takes kwargs; ``every_n_layers``
    through whichever of them takes it (5.17's ``gradient_checkpointing_enable`` does)."""
    cls = type(model)
    found = []
    for name, kwargs_name in (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
                              ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs")):
        method = getattr(cls, name, None)
        if method is None:
            continue
        params = inspect.signature(method).parameters
        found.append(name)
        if every_n_layers != 1 and "every_n_layers" not in params:
            continue
        kwargs: dict[str, Any] = {kwargs_name: {"use_reentrant": False}} if kwargs_name in params else {}
        if every_n_layers != 1:
            kwargs["every_n_layers"] = every_n_layers
        _call_class_method(model, name, **kwargs)
        return
    raise ValueError(
        f"ac2_dist.integrations.hf.enable: every_n_layers={every_n_layers} needs HF's checkpointing switch to "
        f"take every_n_layers, and {type(model).__name__}'s {' / '.join(found) or 'switch'} does not (transformers "
        f"{transformers.__version__}); pass every_n_layers=1, or pick the layers to checkpoint with "
        "ac2_dist.apply_ac(model, policy, modules=...)"
    )


def disable(model: Any) -> Any:
    """Turn HF's checkpointing off again (HF's own method), the head's region of
    ``enable(head=True)`` and the recording of ``enable(rebuild=...)``; returns ``model``."""
    hf_model = _hf_model(model, "disable")
    for m in model.modules():
        group = group_of(m)
        if group is not None:
            group.remove()
        remove_rebuild(m)
    name = "activation_checkpointing_disable"
    if not hasattr(type(hf_model), name):  # transformers < 5
        name = "gradient_checkpointing_disable"
    for key in _SWITCHES[:2]:
        if isinstance(hf_model.__dict__.get(key), _KeepAc2):
            del hf_model.__dict__[key]
    _call_class_method(hf_model, name)
    return model


def is_enabled(model: Any) -> bool:
    """Whether ``model``'s checkpointing is ac2's: some layer is checkpointed by ac2
    through HF, and no module with checkpointing on calls torch's checkpoint itself
    (:func:`torch_checkpointed`)."""
    # See Note [Model code that calls torch's checkpoint itself].
    model = _hf_model(model, "is_enabled")
    return any(
        getattr(m, "gradient_checkpointing", False) and is_ac2_checkpoint(m.__dict__.get("_gradient_checkpointing_func"))
        for m in model.modules()
    ) and not torch_checkpointed(model)


def torch_checkpointed(model: Any) -> list[str]:
    """Names of the modules of ``model`` whose checkpointing is on and whose forward
    calls ``torch.utils.checkpoint.checkpoint`` itself: :func:`enable` does not reach
    those calls, they run torch's checkpoint (``integrations.torch_checkpoint.enable``
    routes them to ac2). Empty for most models."""
    model = _hf_model(model, "torch_checkpointed")
    found = []
    for name, m in model.named_modules():
        if getattr(m, "gradient_checkpointing", False) is True and _calls_torch_checkpoint(type(m)):
            found.append(name or type(m).__name__)
    return found


def _calls_torch_checkpoint(cls: type) -> bool:
    """``cls.forward`` reads ``torch.utils.checkpoint.checkpoint`` (an attribute chain or
    a name imported from there), rather than HF's ``_gradient_checkpointing_func``."""
    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None:
        return False
    names = code.co_names
    if "checkpoint" not in names or "_gradient_checkpointing_func" in names:
        return False
    module_globals = getattr(forward, "__globals__", {})
    return "utils" in names or module_globals.get("checkpoint") is torch.utils.checkpoint.checkpoint
