"""One switch for every framework: torch's own checkpoint entry points, run by ac2.

::

    from ac2_dist.integrations import torch_checkpoint
    torch_checkpoint.enable(policy="recompute_all")     # process-wide, until disable()
    with torch_checkpoint.enabled(policy=[torch.ops.aten.mm.default]):   # this thread, this block
        trainer.train()                                   # HF / Lightning / accelerate / ...

Frameworks call torch's checkpoint themselves: HF's ``activation_checkpointing_enable``,
``checkpoint_wrapper`` / ``apply_activation_checkpointing`` (Lightning, accelerate,
torchtitan), torchtune's ``set_activation_checkpointing``, torch's composable
``checkpoint(module)``. While the switch is on, those calls run ac2's checkpoint (the
forward once, backward replays only what it needs, never a collective) with the switch's
policy, or with the selective-checkpoint policy a framework passes as ``context_fn``
(fresh per call, as torch does).
"""

# Note [Where the switch reaches torch's checkpoint]
#     Frameworks reach torch's checkpoint three ways, and the switch patches one seam per
#     way (restored exactly -- the same objects -- when it goes off):
#
#     1. By attribute, at call time (``torch.utils.checkpoint.checkpoint(...)``; torch's
#        ``checkpoint_sequential`` looks ``checkpoint`` up in its module too): the
#        attribute is replaced by :func:`_routed_checkpoint`, which has torch's signature.
#     2. By a name captured at import (``from torch.utils.checkpoint import checkpoint``
#        in ``transformers.modeling_utils``, ``checkpoint_wrapper``'s module, Lightning,
#        torchtune, torchtitan): every module already imported whose global of any name
#        *is* torch's function gets :func:`_routed_checkpoint` under that name. A module
#        imported while the switch is on captures the routed function itself; after
#        ``disable()`` it keeps it, and it behaves exactly like torch's (it calls torch's
#        function whenever the switch is off).
#     3. By a function object kept in an object (``functools.partial(checkpoint, ...)``
#        that ``CheckpointWrapper`` or an HF layer made before the switch went on; from
#        torch 2.14 also the decorator ``checkpoint(use_reentrant=False)(fn)``): torch's
#        non-reentrant checkpoint looks its generator up in its module at every call, and
#        so does the composable ``checkpoint(module)``'s forward hook in its own module.
#        That generator is ``_checkpoint_without_reentrant_generator`` up to torch 2.13
#        and ``_checkpoint_without_reentrant_generator_impl`` from 2.14 (the old name
#        stays as a shim that calls the new one, and the composable module imports the
#        new name): the name torch's code calls (:data:`_GENERATOR_SEAM`) gets the routed
#        generator of its signature, in both modules, which opens an ac2 region around the
#        forward instead of torch's.
#
#     Reentrant checkpoint (``use_reentrant=True``) keeps torch's behaviour unless the
#     switch was turned on with ``reentrant=True``; then ways 1 and 2 route it too, and so
#     does ``torch.utils.checkpoint.CheckpointFunction`` (what reentrant calls through a
#     kept function object use), which is :class:`_RoutedCheckpointFunction` while the
#     switch is on (it runs torch's class unless the options say ``reentrant=True``). A call with
#     ``use_reentrant`` unset is ac2's through ways 1 and 2 (torch 2.13 would run it
#     reentrant with a warning); through way 3 it reaches torch's reentrant path, which
#     only ``reentrant=True`` routes.
#
#     Saved-tensor hooks around a routed call (``save_on_cpu``) see what they see under
#     torch: the call's positional tensor arguments, and with
#     ``respect_saved_tensors_hooks=True`` (torch >= 2.14) the values the region saves
#     (Note [The user's saved-tensor hooks] in _region.py).
#
#     Note [The switch checks that torch still calls its seams]
#         Way 3 depends on torch's code calling the generator by its module name; torch
#         2.14 renamed it (keeping the old name as a shim torch itself no longer calls),
#         which silently sent kept function objects to torch's checkpoint: the blocks ran
#         twice and, with ``preserve_rng_state=False``, gradients were not eager's. So the
#         first install reads torch's code: unless ``checkpoint`` (or a function of its
#         module it calls) and the composable ``checkpoint`` (or a hook nested in it) look
#         the seam's name up, ``enable()`` warns that those entry points stay torch's on
#         this torch (:func:`_unreached_seams`).
#
#     Not reached: compiled code (dynamo turns torch's checkpoint into its own
#     higher-order op: the routed functions call torch's when ``torch.compile`` traces,
#     so compiled blocks are torch's selective checkpoint, as ac2's own compiled path is);
#     a framework that copied torch's code or calls ``CheckpointFunction`` subclasses.
#
# Note [Switch state is per process, scopes per thread]
#     The patched attributes are process-wide by nature, so one :class:`_Switchboard`
#     (with a lock) owns them: ``enable()`` sets the process-wide options, ``with
#     enabled()`` pushes options for the calling thread only (nested scopes: the innermost
#     wins; it overrides ``enable()``'s). A routed call asks the calling thread's innermost
#     scope, else the process-wide options, else runs torch's code unchanged -- so another
#     thread's checkpoint calls are untouched by a scope. The patches are installed while
#     any options exist (process-wide or a scope in any thread) and removed when the last
#     goes, also when the ``with`` body raised.
#
# Note [preserve_rng_state under the switch]
#     Either value of ``preserve_rng_state`` regenerates random ops' bits exactly
#     (``rng="replay"``, the switch's default): eager's gradients at torch's memory. torch
#     with ``False`` draws new masks in its recompute; ``enable(rng="save")`` keeps them.

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as _tuc

from .._dropin import check_flags, eager_scope
from .._policy import PolicyLike, PolicySource
from ..compile import is_ac2_context_fn, is_compiling

__all__ = ["enable", "disable", "enabled", "is_enabled"]

# torch's objects, taken when this module is imported (before any patch).
_TORCH_CHECKPOINT = _tuc.checkpoint
_TORCH_GENERATOR = _tuc._checkpoint_without_reentrant_generator
_TORCH_GENERATOR_IMPL = getattr(_tuc, "_checkpoint_without_reentrant_generator_impl", None)  # torch >= 2.14
_TORCH_CHECKPOINT_FUNCTION = _tuc.CheckpointFunction
# The generator torch's non-reentrant checkpoint calls by module lookup (Note [Where the
# switch reaches torch's checkpoint], way 3): its name, and torch's object under it.
_GENERATOR_SEAM, _TORCH_SEAM_OBJECT = (
    ("_checkpoint_without_reentrant_generator", _TORCH_GENERATOR) if _TORCH_GENERATOR_IMPL is None
    else ("_checkpoint_without_reentrant_generator_impl", _TORCH_GENERATOR_IMPL)
)
# torch >= 2.14's checkpoint option; on older torch the name is an ordinary keyword
# argument of the checkpointed function, as torch treats it there.
_HAS_RESPECT_HOOKS = "respect_saved_tensors_hooks" in inspect.signature(_TORCH_CHECKPOINT).parameters
_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"


@dataclass(frozen=True)
class _Options:
    """What :func:`enable` / :func:`enabled` were given (validated)."""

    policy: Any
    policy_factory: Any
    rng: str
    allow_cache_entry_mutation: bool
    reentrant: bool

    def same(self, other: _Options) -> bool:
        return all(_same(getattr(self, f), getattr(other, f)) for f in self.__dataclass_fields__)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 -- objects whose == does not give a bool
        return False


class _Switchboard:
    """The patches and the options (Note [Switch state is per process, scopes per thread])."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.process: _Options | None = None
        self.scopes = 0  # `with enabled()` blocks open, in all threads
        self.local = threading.local()
        self.patched: list[tuple[Any, str, Any]] = []  # (owner, name, torch's object)
        self.checked = False  # Note [The switch checks that torch still calls its seams]

    def current(self) -> _Options | None:
        stack = getattr(self.local, "stack", None)
        return stack[-1] if stack else self.process

    # ---- patches (Note [Where the switch reaches torch's checkpoint]) ----------------------
    def sync(self) -> None:
        """Install the patches while options exist, remove them when none do; and
        (re)patch ``CheckpointFunction`` by whether some options route reentrant calls."""
        with self.lock:
            wanted = self.process is not None or self.scopes > 0
            if wanted and not self.patched:
                self._install()
            elif not wanted and self.patched:
                self._restore()

    def _install(self) -> None:
        routed_generator = _routed_generator if _TORCH_GENERATOR_IMPL is None else _routed_generator_impl
        patches: list[tuple[Any, str, Any]] = [
            (_tuc, "checkpoint", _routed_checkpoint),
            (_tuc, _GENERATOR_SEAM, routed_generator),
            (_tuc, "CheckpointFunction", _RoutedCheckpointFunction),
        ]
        composable = _import_composable()
        if composable is not None and composable.__dict__.get(_GENERATOR_SEAM) is _TORCH_SEAM_OBJECT:
            patches.append((composable, _GENERATOR_SEAM, routed_generator))
        if not self.checked:
            self.checked = True
            for problem in _unreached_seams(_TORCH_CHECKPOINT, vars(_tuc), composable):
                warnings.warn(f"ac2_dist.integrations.torch_checkpoint (torch {torch.__version__}): {problem}",
                              UserWarning, stacklevel=4)
        for key, module in list(sys.modules.items()):  # names captured at import (way 2)
            namespace = getattr(module, "__dict__", None)
            if module is _tuc or not isinstance(namespace, dict) or key.split(".")[0] == "ac2_dist":
                continue  # (ac2's own references to torch's function must stay torch's)
            for name, value in list(namespace.items()):
                if value is _TORCH_CHECKPOINT:
                    patches.append((module, name, _routed_checkpoint))
        for owner, name, routed in patches:
            self.patched.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, routed)

    def _restore(self) -> None:
        for owner, name, original in reversed(self.patched):
            setattr(owner, name, original)
        self.patched = []


def _unreached_seams(torch_checkpoint: Callable, namespace: dict, composable: Any) -> list[str]:
    """What of way 3 this torch's code does not reach (Note [The switch checks that
    torch still calls its seams]): ``torch_checkpoint`` is torch's function, ``namespace``
    its module's globals, ``composable`` the composable checkpoint module or ``None``."""
    problems = []
    if not _looks_up(inspect.unwrap(torch_checkpoint).__code__, _GENERATOR_SEAM, namespace, calls=2):
        problems.append(
            f"torch's checkpoint no longer calls {_GENERATOR_SEAM}: checkpoint function objects made before "
            "the switch went on (checkpoint_wrapper, accelerate's FSDP2 plugin, functools.partial) run "
            "torch's checkpoint, not ac2's; call checkpoint by name, or check for a newer ac2_dist"
        )
    if composable is not None and not (
        composable.__dict__.get(_GENERATOR_SEAM) is _TORCH_SEAM_OBJECT
        and _looks_up(inspect.unwrap(composable.checkpoint).__code__, _GENERATOR_SEAM, vars(composable), calls=0)
    ):
        problems.append(
            f"the composable checkpoint(module) does not call {_GENERATOR_SEAM} from its module: modules "
            "checkpointed that way run torch's checkpoint, not ac2's; check for a newer ac2_dist"
        )
    return problems


def _looks_up(code: types.CodeType, name: str, namespace: dict, calls: int) -> bool:
    """Whether ``code``, a function nested in it, or a function of ``namespace`` it
    calls (``calls`` levels deep) reads the global ``name``."""
    if name in code.co_names:
        return True
    if any(isinstance(c, types.CodeType) and _looks_up(c, name, namespace, calls) for c in code.co_consts):
        return True
    if calls:
        for called in code.co_names:
            fn = namespace.get(called)
            inner = getattr(inspect.unwrap(fn), "__code__", None) if isinstance(fn, types.FunctionType) else None
            if inner is not None and _looks_up(inner, name, namespace, calls - 1):
                return True
    return False


def _import_composable() -> Any:
    if not torch.distributed.is_available():
        return None
    try:
        return __import__(_COMPOSABLE, fromlist=["checkpoint"])
    except ImportError:
        return None


_BOARD = _Switchboard()  # Note [Switch state is per process, scopes per thread]


def _options(policy: Any, policy_factory: Any, rng: str, allow_cache_entry_mutation: bool, reentrant: bool,
             where: str) -> _Options:
    if rng not in ("replay", "save"):
        raise ValueError(f"ac2_dist.integrations.torch_checkpoint.{where}: rng must be 'replay' or 'save', got {rng!r}")
    for name, flag in (("allow_cache_entry_mutation", allow_cache_entry_mutation), ("reentrant", reentrant)):
        if not isinstance(flag, bool):
            raise TypeError(f"ac2_dist.integrations.torch_checkpoint.{where}: {name} must be a bool, got {flag!r}")
    PolicySource(policy, policy_factory, rng=rng, allow_mutation=allow_cache_entry_mutation, module_fqn="",
                 where=f"integrations.torch_checkpoint.{where}")  # validates now, not at the first call
    return _Options(policy, policy_factory, rng, allow_cache_entry_mutation, reentrant)


def enable(
    policy: PolicyLike | None = None,
    *,
    policy_factory: Callable[[], PolicyLike] | None = None,
    rng: str = "replay",
    allow_cache_entry_mutation: bool = False,
    reentrant: bool = False,
) -> None:
    """Run torch's checkpoint entry points with ac2, in every thread, until :func:`disable`.

    Args:
        policy: an ac2 policy (any form :func:`ac2_dist.apply_ac` accepts) for calls that pass no selective-checkpoint
            ``context_fn``; default ``"recompute_all"``.
        policy_factory: instead of ``policy``, a zero-argument callable called per call.
        rng: ``"replay"`` (default: random bits regenerated, eager's gradients, nothing
            kept, whatever a call's ``preserve_rng_state``) or ``"save"``.
        allow_cache_entry_mutation: as for :class:`ac2_dist.apply_ac_policy`.
        reentrant: also route ``use_reentrant=True`` calls (default: they stay torch's).

    Enabling again with the same arguments does nothing; with other arguments it raises
    (call :func:`disable` first, or use ``with enabled(...)`` for a scope).
    """
    options = _options(policy, policy_factory, rng, allow_cache_entry_mutation, reentrant, "enable")
    with _BOARD.lock:
        if _BOARD.process is not None and not _BOARD.process.same(options):
            raise RuntimeError(
                "ac2_dist.integrations.torch_checkpoint.enable: the switch is already on with other "
                f"arguments ({_BOARD.process}); call disable() first, or use `with enabled(...)` for "
                "a scope with other arguments"
            )
        _BOARD.process = options
        _BOARD.sync()


def disable() -> None:
    """Undo :func:`enable`: torch's functions are back (the same objects) once no
    ``with enabled()`` block is open in any thread. Disabling twice is fine."""
    with _BOARD.lock:
        _BOARD.process = None
        _BOARD.sync()


@contextlib.contextmanager
def enabled(
    policy: PolicyLike | None = None,
    *,
    policy_factory: Callable[[], PolicyLike] | None = None,
    rng: str = "replay",
    allow_cache_entry_mutation: bool = False,
    reentrant: bool = False,
) -> Iterator[None]:
    """:func:`enable` for the calling thread and the ``with`` body only (arguments as
    :func:`enable`'s; an inner block's win; other threads keep what they had)."""
    options = _options(policy, policy_factory, rng, allow_cache_entry_mutation, reentrant, "enabled")
    stack = getattr(_BOARD.local, "stack", None)
    if stack is None:
        stack = _BOARD.local.stack = []
    with _BOARD.lock:
        _BOARD.scopes += 1
        stack.append(options)
        try:
            _BOARD.sync()
        except BaseException:
            stack.pop()
            _BOARD.scopes -= 1
            raise
    try:
        yield
    finally:
        with _BOARD.lock:
            stack.pop()
            _BOARD.scopes -= 1
            _BOARD.sync()


def is_enabled() -> bool:
    """Whether torch's checkpoint calls made by this thread now run with ac2."""
    return _BOARD.current() is not None


# ---- the routed entry points ---------------------------------------------------------------


def _route(use_reentrant: Any) -> _Options | None:
    """The options a call runs with, or ``None``: torch's code."""
    options = _BOARD.current()
    if options is None or (use_reentrant and not options.reentrant):
        return None
    return options


@functools.wraps(_TORCH_CHECKPOINT)  # __wrapped__: inspect.signature shows torch's
def _routed_checkpoint(function: Any = None, *args: Any, use_reentrant: bool | None = None,
                       context_fn: Any = _tuc.noop_context_fn, determinism_check: str = "default",
                       debug: bool = False, early_stop: bool = True, **kwargs: Any) -> Any:
    def torchs() -> Any:
        positional = () if function is None and not args else (function, *args)  # torch's own error if it needs one
        return _TORCH_CHECKPOINT(*positional, use_reentrant=use_reentrant, context_fn=context_fn,
                                 determinism_check=determinism_check, debug=debug, early_stop=early_stop, **kwargs)

    # dynamo makes torch's checkpoint its own higher-order op; torch >= 2.14's decorator
    # form (no function) returns a wrapper whose calls reach the generator seam (way 3).
    if is_compiling() or (function is None and not args):
        return torchs()
    options = _route(use_reentrant)
    if options is None or is_ac2_context_fn(context_fn) or _tracing(args):
        return torchs()
    respect = kwargs.get("respect_saved_tensors_hooks") if _HAS_RESPECT_HOOKS else None
    if respect is not None and use_reentrant:
        return torchs()  # torch refuses the option with reentrant checkpoint
    preserve = kwargs.pop("preserve_rng_state", True)
    if _HAS_RESPECT_HOOKS:
        kwargs.pop("respect_saved_tensors_hooks", None)
    _check_flags(determinism_check, debug, early_stop, preserve, respect)
    with _scope(options, context_fn, args, respect is True):
        return function(*args, **kwargs)


def _routed_generator(function: Any, preserve_rng_state: bool, context_fn: Any, determinism_check: str,
                      debug: bool, early_stop: bool, *args: Any, **kwargs: Any) -> Iterator[None]:
    """torch's ``_checkpoint_without_reentrant_generator`` protocol (one ``yield``: the
    forward runs there), with an ac2 region around the forward when the switch is on."""
    options = _route(False)
    if options is None or is_compiling() or is_ac2_context_fn(context_fn) or _tracing(args):
        yield from _TORCH_GENERATOR(function, preserve_rng_state, context_fn, determinism_check, debug,
                                    early_stop, *args, **kwargs)
        return
    _check_flags(determinism_check, debug, early_stop, preserve_rng_state)
    with _scope(options, context_fn, args):
        yield


def _routed_generator_impl(function: Any, args: tuple, kwargs: dict, *, preserve_rng_state: bool = True,
                           context_fn: Any = _tuc.noop_context_fn, determinism_check: str = "default",
                           debug: bool = False, early_stop: bool = True,
                           respect_saved_tensors_hooks: bool | None = None) -> Iterator[None]:
    """torch >= 2.14's ``_checkpoint_without_reentrant_generator_impl`` protocol (one
    ``yield``: the forward runs there), with an ac2 region around the forward when the
    switch is on."""
    options = _route(False)
    if options is None or is_compiling() or is_ac2_context_fn(context_fn) or _tracing(args):
        yield from _TORCH_GENERATOR_IMPL(function, args, kwargs, preserve_rng_state=preserve_rng_state,
                                         context_fn=context_fn, determinism_check=determinism_check, debug=debug,
                                         early_stop=early_stop, respect_saved_tensors_hooks=respect_saved_tensors_hooks)
        return
    _check_flags(determinism_check, debug, early_stop, preserve_rng_state, respect_saved_tensors_hooks)
    with _scope(options, context_fn, args, respect_saved_tensors_hooks is True):
        yield


class _RoutedCheckpointFunction:
    """Stands for ``torch.utils.checkpoint.CheckpointFunction`` while the switch is on:
    reentrant calls through a kept function object (Note [Where the switch reaches
    torch's checkpoint])."""

    @staticmethod
    def apply(function: Any, preserve_rng_state: bool, *args: Any) -> Any:
        options = _route(True)
        if options is None or is_compiling() or _tracing(args):
            return _TORCH_CHECKPOINT_FUNCTION.apply(function, preserve_rng_state, *args)
        with _scope(options, None, args):
            return function(*args)


def _scope(options: _Options, context_fn: Any, inputs: tuple = (),
           respect_hooks: bool = False) -> contextlib.AbstractContextManager:
    return eager_scope(context_fn, options.policy, options.policy_factory, options.rng,
                       options.allow_cache_entry_mutation, where="integrations.torch_checkpoint",
                       inputs=inputs, respect_hooks=respect_hooks)


def _check_flags(determinism_check: Any, debug: Any, early_stop: Any, preserve: Any, respect: Any = None) -> None:
    """torch's argument checks (ac2 has nothing to do for these flags)."""
    check_flags("torch.utils.checkpoint (ac2 switch)", determinism_check, debug, early_stop, preserve, respect)


def _tracing(args: tuple) -> bool:
    """A graph is being traced (make_fx / AOTAutograd: a proxy or fake mode is active, or
    the arguments are fake tensors): torch's checkpoint is what tracing expects."""
    from torch._subclasses.fake_tensor import is_fake

    keys = torch._C._TorchDispatchModeKey
    if torch._C._get_dispatch_mode(keys.PROXY) is not None or torch._C._get_dispatch_mode(keys.FAKE) is not None:
        return True
    return any(isinstance(a, torch.Tensor) and is_fake(a) for a in args)
