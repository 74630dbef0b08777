"""A drop-in for ``torch.utils.checkpoint.checkpoint`` / ``checkpoint_sequential``.

Same signature, ac2 semantics: the function runs once, inside an ac2 region, and
backward replays only the recorded ops it needs (never the Python function, never a
collective). torch's arguments map onto ac2's:

Note [torch's checkpoint arguments in ac2]
    - ``use_reentrant``: ac2 has one implementation, which behaves like torch's
      non-reentrant one. ``None`` and ``False`` are that; ``True`` gets ac2's
      behaviour too, with a warning once per process (reentrant checkpoint's
      limitations -- no ``torch.autograd.grad``, no kwargs, inputs must require grad
      -- do not apply to ac2).
    - ``context_fn``: called at every call, as torch does. A pair made by
      ``create_selective_checkpoint_contexts(policy)`` gives its policy to the region
      (fresh per call: a stateful policy starts over in every block) and its
      ``allow_cache_entry_mutation``. Any other pair: the forward context is entered
      around the function inside the region; the recompute context is never used
      (ac2 never re-runs Python code).
    - ``preserve_rng_state``: either value is ``rng="replay"``: random ops' bits are
      regenerated exactly in backward, so gradients are eager's and nothing random is
      kept -- torch's memory. With ``True`` torch does the same; with ``False`` (what
      accelerate's FSDP2 path and older torchtitan pass, to save the RNG-state
      bookkeeping) torch draws *new* masks in recompute and its gradients differ from
      eager's; ac2 has no state to stash (it regenerates from the recorded generator
      offsets), so it gives eager's gradients at torch's memory. Keeping the masks
      instead is ``checkpoint_with(rng="save")``.
    - ``determinism_check`` (``"default"`` or ``"none"``), ``debug`` and ``early_stop``
      are accepted and validated like torch: ac2 replays the recorded ops, so a
      recompute cannot differ from forward (nothing to check or to trace) and always
      stops as early as possible.
    - Saved-tensor hooks around the call (``torch.autograd.graph.save_on_cpu``) see
      what they see under torch's checkpoint: the call's positional tensor arguments,
      packed when the region opens and unpacked when backward reads them (``save_on_cpu``
      moves the block's input off the device). ``respect_saved_tensors_hooks`` (torch >=
      2.14; accepted on every torch): ``None`` / ``False`` is torch's legacy behaviour,
      under which the values the region saves bypass the hooks; ``True`` routes every
      value the region saves through them too.
    - ``function`` omitted: the decorator form of torch >= 2.14
      (``checkpoint(use_reentrant=False)(fn)``, also on methods), on every torch.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import (
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    noop_context_fn,
)

from ._policy import PolicyLike, PolicySource
from ._region import function_region, region_scope, user_saved_tensors_hooks
from .compile import (
    is_compiling,
)

__all__ = ["checkpoint", "checkpoint_sequential", "checkpoint_with", "is_ac2_checkpoint", "user_saved_tensors_hooks",
           "check_flags"]

_DETERMINISM = ("default", "none")
_REENTRANT = (
    "ac2_dist.checkpoint(use_reentrant=True): ac2 has a single implementation, which works like "
    "torch's non-reentrant checkpoint (autograd.grad, keyword arguments and inputs that do not "
    "require grad all work); use_reentrant is ignored. Pass use_reentrant=False to silence this."
)


class _Unset:
    """The default of an ac2 keyword of :func:`checkpoint`: not passed."""

    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()
_AC2_KEYWORDS = ("policy", "policy_factory", "allow_cache_entry_mutation")
_TO_FUNCTION = (
    "ac2_dist.checkpoint: {fn} accepts **kwargs, so the keyword {name!r} was passed to it, as "
    "torch.utils.checkpoint.checkpoint does with every keyword it does not know. To give ac2 a "
    "{name} for this call, use ac2_dist.checkpoint_with({name}=...)(function, *args, **kwargs); "
    "to pass it to the function without this warning, do the same with no ac2 option."
)


def checkpoint(
    function: Callable[..., Any] | None = None,
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    determinism_check: str = "default",
    debug: bool = False,
    preserve_rng_state: bool = True,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    policy: PolicyLike | None = _UNSET,
    policy_factory: Callable[[], PolicyLike] | None = _UNSET,
    allow_cache_entry_mutation: bool = _UNSET,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)`` checkpointed by ac2; a drop-in for
    ``torch.utils.checkpoint.checkpoint``.

    Args:
        function: what to run; it runs once, in forward. Omitted (no arguments either):
            a decorator, ``checkpoint(use_reentrant=False, policy=...)(fn)``, whose calls
            are checkpointed with these options (their keywords all go to ``fn``).
        use_reentrant: ``None``/``False``; ``True`` is accepted with a one-time warning
            and behaves the same (ac2 has one, non-reentrant, implementation).
        context_fn: torch's; a ``create_selective_checkpoint_contexts(policy_fn)``
            pair makes ``policy_fn`` this call's policy (called per call: fresh).
        determinism_check: ``"default"`` or ``"none"`` (nothing to check: ac2 replays
            the recorded ops).
        debug: accepted (bool); a replay cannot diverge from forward, so there is no
            trace to print.
        preserve_rng_state: accepted (bool); either value regenerates random ops'
            bits in backward (``rng="replay"``: eager's gradients, nothing kept).
        early_stop: accepted (bool); ac2 always replays only what backward needs.
        respect_saved_tensors_hooks: ``None``/``False`` (the values the region saves
            bypass saved-tensor hooks around the call; its positional tensor arguments go
            through them) or ``True`` (the saved values go through them too).
        policy: an ac2 policy (any form :func:`ac2_dist.apply_ac` accepts); default
            ``"recompute_all"``.
        policy_factory: instead of ``policy``, a zero-argument callable called per call.
        allow_cache_entry_mutation: as for :class:`ac2_dist.apply_ac_policy`.
        **kwargs: passed to ``function``.

    Keywords: torch passes every keyword it does not know to ``function``; so does this
    drop-in, also for ``policy``, ``policy_factory`` and ``allow_cache_entry_mutation``
    whenever ``function`` can take them: a parameter of that name (silently, as torch), or
    ``**kwargs`` (with a warning naming the keyword). ac2 takes them only from a function
    that cannot. ``checkpoint_with(policy=...)`` binds ac2's options outside the call, so
    nothing the function receives can collide with them.

    Returns:
        What ``function`` returns. Inside ``torch.compile`` the call is one
        checkpointed region of the compiled graph with the same policy.

    Example::

        import torch
        import ac2_dist as ac

        block = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        x = torch.randn(8, 64, requires_grad=True)
        y = ac.checkpoint(block, x, use_reentrant=False)   # where torch.utils.checkpoint.checkpoint was
        y.sum().backward()
        keep_mm = ac.checkpoint(block, x, use_reentrant=False, policy=[torch.ops.aten.addmm.default])
    """
    # Note [The function's keywords are the function's]: the docstring's "Keywords"
    # paragraph (torch's rule: a keyword the function can take is the function's).
    options = {"policy": policy, "policy_factory": policy_factory,
               "allow_cache_entry_mutation": allow_cache_entry_mutation}
    ac2: dict[str, Any] = {}
    decorator = function is None and not args
    for name, value in options.items():
        if value is _UNSET:
            continue
        if not decorator and _function_takes(function, name):  # Note [The function's keywords are the function's]
            kwargs[name] = value
        else:
            ac2[name] = value
    bound = (use_reentrant, context_fn, determinism_check, debug, preserve_rng_state, early_stop,
             respect_saved_tensors_hooks, ac2.get("policy"), ac2.get("policy_factory"), None,
             bool(ac2.get("allow_cache_entry_mutation", False)))
    if decorator:
        return _decorator(bound, kwargs)
    return _checkpoint(function, args, kwargs, *bound, stacklevel=3)


class checkpoint_with:  # noqa: N801 -- used like a function: checkpoint_with(policy=...)(fn, x)
    """``torch.utils.checkpoint.checkpoint``'s signature, run by ac2 with the options
    bound here; every keyword of a call except torch's own goes to the function.

    ::

        ckpt = ac2_dist.checkpoint_with(policy=["mm"], rng="replay")
        y = ckpt(block, x, use_reentrant=False, policy=1)   # block receives policy=1

    Args:
        policy: an ac2 policy (any form :func:`ac2_dist.apply_ac` accepts); default
            ``"recompute_all"``.
        policy_factory: instead of ``policy``, a zero-argument callable called per call.
        rng: ``"replay"`` (regenerate random ops' bits in backward) or ``"save"``
            (keep their outputs); ``None`` (the default) is ``"replay"``, as for
            :func:`checkpoint`, whatever a call's ``preserve_rng_state``.
        allow_cache_entry_mutation: as for :class:`ac2_dist.apply_ac_policy`.

    Instances are picklable (when the policy is) and recognized by frameworks as ac2's
    checkpoint (``integrations.hf`` installs one per model).
    """

    def __init__(
        self,
        policy: PolicyLike | None = None,
        *,
        policy_factory: Callable[[], PolicyLike] | None = None,
        rng: str | None = None,
        allow_cache_entry_mutation: bool = False,
    ) -> None:
        if rng is not None and rng not in ("replay", "save"):
            raise ValueError(f"ac2_dist.checkpoint_with: rng must be 'replay', 'save' or None, got {rng!r}")
        if not isinstance(allow_cache_entry_mutation, bool):
            raise TypeError(
                f"ac2_dist.checkpoint_with: allow_cache_entry_mutation must be a bool, got {allow_cache_entry_mutation!r}"
            )
        PolicySource(policy, policy_factory, rng=rng or "replay", allow_mutation=allow_cache_entry_mutation,
                     module_fqn="", where="checkpoint_with")  # validates now, not at the first call
        self.policy = policy
        self.policy_factory = policy_factory
        self.rng = rng
        self.allow_cache_entry_mutation = allow_cache_entry_mutation
        self._module_fqn = ""  # the module whose forward this instance checkpoints (_for_module)

    def _for_module(self, module_fqn: str) -> checkpoint_with:
        """This instance's options for the calls of one module: its regions carry the
        module's path (``ctx.module_fqn``, reports' per-module rows, a budget's plans)."""
        bound = copy.copy(self)
        bound._module_fqn = module_fqn
        return bound

    def __call__(
        self,
        function: Callable[..., Any] | None = None,
        *args: Any,
        use_reentrant: bool | None = None,
        context_fn: Callable[[], tuple[Any, Any]] | None = None,
        determinism_check: str = "default",
        debug: bool = False,
        preserve_rng_state: bool = True,
        early_stop: bool = True,
        respect_saved_tensors_hooks: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """``function(*args, **kwargs)`` checkpointed with this object's options; without
        ``function`` (and arguments), a decorator, as :func:`checkpoint`'s."""
        bound = (use_reentrant, context_fn, determinism_check, debug, preserve_rng_state, early_stop,
                 respect_saved_tensors_hooks, self.policy, self.policy_factory, self.rng,
                 self.allow_cache_entry_mutation)
        if function is None and not args:
            return _decorator(bound, kwargs)
        return _checkpoint(function, args, kwargs, *bound, stacklevel=3, module_fqn=self._module_fqn)

    def __repr__(self) -> str:
        return (f"ac2_dist.checkpoint_with(policy={self.policy!r}, policy_factory={self.policy_factory!r}, "
                f"rng={self.rng!r}, allow_cache_entry_mutation={self.allow_cache_entry_mutation!r})")


def _decorator(bound: tuple, kwargs: dict) -> Callable[[Callable[..., Any]], _Checkpointed]:
    """``checkpoint(**options)`` without a function: torch >= 2.14's decorator form."""
    if kwargs:  # torch's error: a decorator's keywords are all checkpoint options
        raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
    return functools.partial(_Checkpointed, bound=bound)


class _Checkpointed:
    """``function`` wrapped by ``checkpoint(**options)``: every call is checkpointed with
    those options and passes all its arguments to ``function``. A method decorator too
    (bound on attribute access, the options carried over)."""

    def __init__(self, function: Callable[..., Any], *, bound: tuple) -> None:
        self.function = function
        self.bound = bound
        functools.update_wrapper(self, function, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _checkpoint(self.function, args, kwargs, *self.bound, stacklevel=3)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        get = getattr(self.function, "__get__", None)
        if instance is None or get is None:
            return self
        return type(self)(get(instance, owner), bound=self.bound)


def check_flags(who: str, determinism_check: Any, debug: Any, early_stop: Any, preserve_rng_state: Any,
                respect_saved_tensors_hooks: Any) -> None:
    """torch's checks of its checkpoint flags (ac2 has nothing to do for them: it
    replays the recorded ops, so a recompute cannot differ from forward); errors name
    ``who`` was called."""
    # See Note [torch's checkpoint arguments in ac2].
    if determinism_check not in _DETERMINISM:
        raise ValueError(f"{who}: determinism_check should be one of {list(_DETERMINISM)}, but got {determinism_check!r}")
    for name, flag in (("debug", debug), ("early_stop", early_stop), ("preserve_rng_state", preserve_rng_state)):
        if not isinstance(flag, bool):
            raise TypeError(f"{who}: {name} must be a bool, got {flag!r}")
    if respect_saved_tensors_hooks is not None and not isinstance(respect_saved_tensors_hooks, bool):
        raise TypeError(
            f"{who}: respect_saved_tensors_hooks must be a bool or None, got {respect_saved_tensors_hooks!r}"
        )


def _function_takes(function: Any, name: str) -> bool:
    """Whether ``function`` can receive the keyword ``name`` (Note [The function's
    keywords are the function's]); warns when only through ``**kwargs``."""
    target = function.forward if isinstance(function, torch.nn.Module) else function
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin without a signature: it takes no such keyword
        return False
    param = params.get(name)
    if param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
        return True
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        fn_name = getattr(function, "__qualname__", None) or type(function).__name__
        warnings.warn(_TO_FUNCTION.format(fn=fn_name, name=name), UserWarning, stacklevel=3)
        return True
    return False


def _checkpoint(
    function: Callable[..., Any], args: tuple, kwargs: dict, use_reentrant: Any, context_fn: Any,
    determinism_check: Any, debug: Any, preserve_rng_state: Any, early_stop: Any, respect_hooks: Any,
    policy: Any, policy_factory: Any, rng: str | None, allow_cache_entry_mutation: bool, stacklevel: int,
    module_fqn: str = "",
) -> Any:
    """:func:`checkpoint` and :class:`checkpoint_with`, their arguments sorted out;
    ``module_fqn``: the module whose forward ``function`` runs, if known."""
    if use_reentrant not in (None, False, True):
        raise TypeError(f"ac2_dist.checkpoint: use_reentrant must be a bool or None, got {use_reentrant!r}")
    if use_reentrant:
        warnings.warn(_REENTRANT, UserWarning, stacklevel=stacklevel)  # the default filter: once per call site
    check_flags("ac2_dist.checkpoint", determinism_check, debug, early_stop, preserve_rng_state, respect_hooks)
    if context_fn is noop_context_fn:
        context_fn = None
    if context_fn is not None and (policy is not None or policy_factory is not None):
        raise TypeError(
            "ac2_dist.checkpoint: pass a policy either as context_fn (torch's selective checkpoint) "
            "or as policy / policy_factory, not both"
        )
    if rng is None:  # Note [torch's checkpoint arguments in ac2]: preserve_rng_state
        rng = "replay"
    if context_fn is not None:
        if not callable(context_fn):
            raise TypeError(f"ac2_dist.checkpoint: context_fn must be a callable returning two contexts, got {context_fn!r}")
        if is_compiling():  # torch makes the pair when AOTAutograd builds the graph; so do we
            policy_factory = functools.partial(_policy_of_context_fn, context_fn)
        else:
            return _with_context_fn(function, args, kwargs, context_fn, rng, allow_cache_entry_mutation,
                                    respect_hooks is True)
    return function_region(function, args, kwargs, policy, policy_factory, rng, allow_cache_entry_mutation,
                           "checkpoint", module_fqn, respect_hooks is True)


def _with_context_fn(function, args, kwargs, context_fn, rng, allow_mutation, respect_hooks) -> Any:
    """Note [torch's checkpoint arguments in ac2]: ``context_fn`` (eager)."""
    with eager_scope(context_fn, None, None, rng, allow_mutation, inputs=args, respect_hooks=respect_hooks):
        return function(*args, **kwargs)


@contextlib.contextmanager
def eager_scope(context_fn: Any, policy: Any, policy_factory: Any, rng: str, allow_mutation: bool,
                where: str = "checkpoint", inputs: tuple = (), respect_hooks: bool = False) -> Iterator[None]:
    """An eager ac2 region for one checkpoint call, as torch's arguments describe it:
    a selective-checkpoint ``context_fn`` gives the region its policy
    (``policy``/``policy_factory`` are then ignored), any other one's forward context is
    entered inside the region (its recompute context is never used)."""
    # See Note [torch's checkpoint arguments in ac2].
    forward_ctx = None
    if context_fn is not None and context_fn is not noop_context_fn:
        pair = context_fn()
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(f"ac2_dist.{where}: context_fn must return a tuple of two context managers, got {pair!r}")
        forward_ctx, recompute_ctx = pair
        if isinstance(forward_ctx, _CachingTorchDispatchMode):  # torch's selective checkpoint
            if isinstance(recompute_ctx, _CachedTorchDispatchMode):
                allow_mutation = allow_mutation or bool(getattr(recompute_ctx, "allow_cache_entry_mutation", False))
            policy, policy_factory, forward_ctx = forward_ctx.policy_fn, None, None
    source = PolicySource(policy, policy_factory, rng=rng, allow_mutation=allow_mutation, module_fqn="",
                          where=where)
    with region_scope(source, None, inputs, respect_hooks), (
            forward_ctx if forward_ctx is not None else contextlib.nullcontext()):
        yield


def _policy_of_context_fn(context_fn: Callable[[], tuple[Any, Any]]) -> Any:
    forward_ctx, _ = context_fn()
    if not isinstance(forward_ctx, _CachingTorchDispatchMode):
        raise RuntimeError(
            "ac2_dist.checkpoint inside torch.compile takes a context_fn only from "
            "torch.utils.checkpoint.create_selective_checkpoint_contexts (a policy); got a context "
            f"{forward_ctx!r}. Pass policy= instead, or call the function outside torch.compile."
        )
    return forward_ctx.policy_fn


def checkpoint_sequential(
    functions: torch.nn.Sequential | Iterable[Callable[[Any], Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """A drop-in for ``torch.utils.checkpoint.checkpoint_sequential``.

    Splits ``functions`` (an ``nn.Sequential`` or a list of callables) into ``segments``
    chunks as torch does and checkpoints every chunk but the last with
    :func:`checkpoint`. Keyword arguments: ``preserve_rng_state`` and the ac2 ones
    of :func:`checkpoint` (``policy``, ``policy_factory``, ...).
    """
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    else:
        functions = list(functions)
    if not isinstance(segments, int) or isinstance(segments, bool) or segments < 1:
        raise ValueError(f"ac2_dist.checkpoint_sequential: segments must be a positive int, got {segments!r}")
    allowed = {"preserve_rng_state", "policy", "policy_factory", "determinism_check", "debug",
               "allow_cache_entry_mutation"}
    unexpected = sorted(set(kwargs) - allowed)
    if unexpected:
        raise ValueError("Unexpected keyword arguments: " + ",".join(unexpected))

    def run(start: int, end: int) -> Callable[[Any], Any]:
        def forward(x: Any) -> Any:
            for j in range(start, end + 1):
                x = functions[j](x)
            return x

        return forward

    size = len(functions) // segments
    end = -1
    for start in range(0, size * (segments - 1), size):  # torch's split: the last chunk runs plainly
        end = start + size - 1
        input = checkpoint(run(start, end), input, use_reentrant=use_reentrant, **kwargs)
    return run(end + 1, len(functions) - 1)(input)


def is_ac2_checkpoint(func: Any) -> bool:
    """Whether ``func`` is :func:`checkpoint` or a :class:`checkpoint_with` (possibly a
    ``functools.partial`` of either)."""
    while isinstance(func, functools.partial):
        func = func.func
    return func is checkpoint or isinstance(func, checkpoint_with)
