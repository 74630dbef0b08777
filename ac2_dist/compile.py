"""torch.compile: checkpointed modules and functions inside compiled code.

The eager tracer (a TorchDispatchMode, saved-tensor hooks, a module forward hook)
cannot run inside a dynamo-traced frame: dynamo would break the graph at every
region. Inside compiled code a checkpointed call is therefore routed through
``torch.utils.checkpoint.checkpoint(..., context_fn=create_selective_checkpoint_contexts(p))``,
which dynamo captures as one ``tag_activation_checkpoint`` higher-order op, and whose
policy ``p`` AOTAutograd asks for every op of the joint graph; the min-cut
partitioner then saves what ``p`` saves and recomputes the rest in the compiled
backward.
"""

# Note [Tags inside compiled code]
#     ``tag_with_policy(t, p)`` marks ``t``'s node in the eager graph. A compiled graph
#     has no such node to mark at trace time, so inside compiled code the call returns
#     ``torch.ops.ac2_dist.tagged(t, must)`` (a copy of ``t`` whose gradient passes
#     through) and :class:`CompiledPolicy` answers ``MUST_SAVE`` / ``PREFER_SAVE`` for
#     it: the partitioner saves that value. Use the returned tensor: if only ``t`` is
#     used afterwards, the tag is dead code and has no effect (eager code may ignore the
#     return value, compiled code may not).
#
# Note [What only eager ac2 does]
#     ``SAVE_WITH_HOOKS`` and CPU offload need ac2's own saved values: a policy returning
#     them inside compiled code is an error naming the op. Replay scheduling (side
#     stream, prefetch) and ``memory.track``'s per-region figures belong to ac2's eager
#     replays: inside compiled code the compiled backward recomputes, an explicit
#     ``ReplayConfig`` is ignored with a warning (once per process), and ``memory.track``
#     counts compiled blocks in its allocator figures only (peaks, bytes kept).
#
# Note [One policy, two executors]
#     ``p`` is :class:`CompiledPolicy`: the same region frames the eager tracer
#     resolves (``_policy.resolve``), plus the eager side-effect rules (side_effects.py):
#     collectives, FSDP and registered side-effect ops are MUST_SAVE (never recomputed
#     in the compiled backward), and so are random ops (the compiled backward reuses
#     the forward's bits). What only the eager executor can do (``SAVE_WITH_HOOKS``,
#     CPU offload) is refused with an error naming the op and the feature.
#
# Note [Random writes in the dynamo fallback]
#     Where dynamo breaks the graph inside a checkpointed block it runs torch's selective
#     checkpoint eagerly with :class:`CompiledPolicy` (Note [Dynamo fallback of a
#     compiled region]). There an in-place random op (CPU dropout's ``bernoulli_``) must
#     not be saved: torch caches the tensor it returns, the next op writes it in place
#     (``div_``) and torch refuses the mutated cache entry in backward. The policy
#     therefore answers PREFER_RECOMPUTE for random ops that write their argument when it
#     sees real tensors (eager execution, not AOTAutograd's fake ones): torch's checkpoint
#     restores the RNG state before recomputing (``preserve_rng_state=True``, which ac2
#     always passes), so the recomputed bits are the forward's, whatever ``rng`` says.
#     Out-of-place random ops are still saved, and the compiled path is unchanged.

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ._compat import CPU_OFFLOAD
from ._policy import SAVE_WITH_HOOKS, PolicyContext, PolicySource, _Frame, resolve
from .side_effects import SideEffect, op_info

__all__ = [
    "is_compiling", "skip_dynamo", "CompiledPolicy", "checkpoint_compiled", "policy_context_fn", "source_context_fn",
    "tagged", "announce_eager_only", "in_eager_fallback", "is_ac2_context_fn",
]

_CP = CheckpointPolicy
_NEVER_RECOMPUTED = (SideEffect.COLLECTIVE, SideEffect.FSDP, SideEffect.REGISTERED, SideEffect.OPAQUE)


def skip_dynamo(fn: Any) -> Any:
    """Mark ``fn``'s code "skip, recursively" for dynamo (a frame it never converts).

    For ac2's run-time callbacks (dispatch mode, saved-tensor hooks, module hooks,
    region entry): when they run inside a function dynamo gave up on, dynamo would
    otherwise try to compile each of them as a frame of its own and break on ac2's
    thread-local state. Marking is once, at import; a call costs nothing.
    """
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
        return fn
    except (ImportError, AttributeError):  # a torch without code strategies: disable
        return torch._disable_dynamo(fn, recursive=True)


@torch.library.custom_op("ac2_dist::tagged", mutates_args=())
def tagged(t: torch.Tensor, must: bool) -> torch.Tensor:
    """A copy of ``t`` the compiled graph saves; its gradient passes through."""
    # See Note [Tags inside compiled code].
    return t.clone()


@tagged.register_fake
def _tagged_fake(t: torch.Tensor, must: bool) -> torch.Tensor:
    return torch.empty_like(t)


def _tagged_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


tagged.register_autograd(_tagged_backward)
_TAGGED = torch.ops.ac2_dist.tagged.default


@torch._dynamo.assume_constant_result
def announce_eager_only(what: str) -> bool:
    """Warn, while dynamo traces, that ``what`` does not apply inside compiled code
    (it belongs to ac2's eager replays); the default filter shows each once."""
    # See Note [What only eager ac2 does].
    warnings.warn(f"ac2_dist: {what} applies to eager ac2 regions only; inside torch.compile the "
                  "compiled backward recomputes, so it is ignored there", UserWarning, stacklevel=1)
    return True


_EAGER_ONLY_TAG = (
    "ac2_dist.tag_with_policy with SAVE_WITH_HOOKS or a CPU-offload policy is eager-only; inside "
    "torch.compile tag with MUST_SAVE or PREFER_SAVE, or do not compile this block"
)


@torch.compiler.disable(reason=_EAGER_ONLY_TAG)
def refuse_compiled_tag(policy: Any) -> None:
    """A graph break whose reason (the fullgraph=True error) and error (otherwise, when
    the call runs) say what is refused."""
    # See Note [What only eager ac2 does].
    raise RuntimeError(f"{_EAGER_ONLY_TAG} (got {policy!r})")


_BUDGET_REFUSED = (
    "ac2_dist.MemoryBudget plans from ac2's eager graph and cannot run inside torch.compile; for "
    "compiled blocks use torch._functorch.config.activation_memory_budget (torch's own memory-budget "
    "partitioner), or do not compile these blocks"
)


@torch.compiler.disable(reason=_BUDGET_REFUSED)
def refuse_budget_compiled() -> None:
    """Refuse a MemoryBudget region while dynamo traces, before torch's checkpoint starts
    (an error raised from inside its selective-checkpoint mode leaves that mode on the
    dispatch stack in torch < 2.13): a graph break whose reason (the fullgraph error) and
    error (otherwise) say why."""
    raise RuntimeError(_BUDGET_REFUSED)


def is_region_scoped(policy: Any) -> bool:
    """A policy planned per region from the eager graph (a MemoryBudget)."""
    return hasattr(policy, "new_region_policy")


#: True while dynamo traces the calling frame (then ac2 takes the compiled path). The
#: function itself, not a wrapper: one call less on the tracer's path, and dynamo
#: constant-folds it.
is_compiling = torch.compiler.is_compiling


class _CompilerFlag:
    """``torch.compiler._is_compiling_flag`` for a torch that has none."""

    @property
    def _is_compiling_flag(self) -> bool:
        return torch.compiler.is_compiling()


# See Note [Dynamo inside a region] in _tracer.py.
#: ``COMPILER_STATE._is_compiling_flag`` is what :func:`is_compiling` returns in a frame
#: dynamo does not trace (``torch.jit.is_scripting()`` is False there), read as an
#: attribute: the tracer's check per op costs no Python call.
COMPILER_STATE: Any = torch.compiler if hasattr(torch.compiler, "_is_compiling_flag") else _CompilerFlag()


class CompiledPolicy:
    """ac2's policy as a torch selective-checkpoint policy: the same decisions as in
    eager regions, and collectives, side-effect ops and random ops always saved."""

    # See Note [One policy, two executors].

    def __init__(self, frames: list[_Frame]) -> None:
        self.frames = list(frames)
        # A region-scoped policy (a MemoryBudget) plans from ac2's eager graph: refused
        # when torch builds a compiled graph with it (wrapping itself is fine: eager use).
        self.refused = next((f.name for f in frames if f.per_region is not None), None)
        self.ctx: PolicyContext | None = None  # made when AOTAutograd first asks (rank known then)
        # What dynamo sees: built here, outside the traced frame.
        self.context_fn = functools.partial(create_selective_checkpoint_contexts, self)

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if self.refused is not None:
            raise RuntimeError(
                f"ac2_dist: {self.refused} plans from ac2's eager graph and cannot run inside torch.compile; "
                "for compiled blocks use torch._functorch.config.activation_memory_budget (torch's own "
                "memory-budget partitioner), or do not compile these blocks"
            )
        if op is _TAGGED:  # Note [Tags inside compiled code]
            return _CP.MUST_SAVE if args[1] else _CP.PREFER_SAVE
        info = op_info(op)
        if info.ignored:
            return _CP.PREFER_RECOMPUTE
        mine = self.ctx
        if mine is None:
            mine = self.ctx = PolicyContext(self.frames[-1].module_fqn, _rank())
        mine.op_output = getattr(ctx, "op_output", None)
        try:
            decision = resolve(self.frames, mine, op, args, kwargs)
        finally:
            mine.op_output = None
        if isinstance(decision, SAVE_WITH_HOOKS) or decision in CPU_OFFLOAD:
            raise RuntimeError(
                f"ac2_dist: the policy returned {decision!r} for {op} inside torch.compile; "
                "SAVE_WITH_HOOKS and CPU offload run only in eager mode. Return a save or "
                "recompute policy for compiled blocks (or do not compile this block)."
            )
        never = info.side_effect in _NEVER_RECOMPUTED or (info.is_rng and info.is_random(args, kwargs))
        if never:
            if decision is _CP.MUST_RECOMPUTE:
                raise RuntimeError(
                    f"ac2_dist: the policy returned MUST_RECOMPUTE for {op}, which is a "
                    f"{'random' if info.is_rng else info.side_effect.value} op and is never "
                    "recomputed: its output is kept from forward. Return a save or PREFER_* policy for it."
                )
            if info.is_rng and info.written and _real(args):  # Note [Random writes in the dynamo fallback]
                return _CP.PREFER_RECOMPUTE
            return _CP.MUST_SAVE
        return decision


def _real(args: tuple) -> bool:
    """Whether the first tensor argument is a real tensor (not AOTAutograd's fake one)."""
    from torch._subclasses.fake_tensor import is_fake

    for a in args:
        if isinstance(a, torch.Tensor):
            return not is_fake(a)
    return False


def in_eager_fallback() -> bool:
    """Whether this (eager) code runs in a checkpointed block dynamo could not trace.

    When dynamo breaks the graph inside a checkpointed block, it runs the ``torch.utils.checkpoint`` call it was building
    eagerly: torch's own selective checkpoint, with ac2's policy
    (:class:`CompiledPolicy`: collectives and random ops saved). ac2's eager region
    does not run there, so what only it does is refused loudly.
    """
    # Note [Dynamo fallback of a compiled region]: the docstring above.
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from torch.utils.checkpoint import _CachingTorchDispatchMode

    return any(isinstance(m, _CachingTorchDispatchMode) and isinstance(m.policy_fn, CompiledPolicy)
               for m in _get_current_dispatch_mode_stack())


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def source_context_fn(source: PolicySource) -> Any:
    """The ``context_fn`` that gives torch's checkpoint ``source``'s policy.

    Dynamo hands ``context_fn`` to the checkpoint higher-order op only if it is a
    Python constant: a :class:`CompiledPolicy` built outside the traced frame (a fixed
    policy: built once, here) or a partial of this module's function (a
    ``policy_factory``, called when AOTAutograd builds the graph).
    """
    # See Note [Policy factories] in _policy.py.
    if source.frame is not None:
        return CompiledPolicy([source.frame]).context_fn
    return functools.partial(_factory_contexts, source)


def policy_context_fn(policy: Any, policy_factory: Any, rng: str, allow_mutation: bool) -> Any:
    """A ``context_fn`` for policy arguments given inside traced code (function syntax).

    A partial of this module's function over the user's arguments is a Python constant
    to dynamo, where an object built in the traced frame is not. The policy is
    validated and normalized when AOTAutograd calls it.
    """
    return functools.partial(_contexts, policy, policy_factory, rng, allow_mutation)


def _contexts(policy: Any, policy_factory: Any, rng: str, allow_mutation: bool) -> Any:
    source = PolicySource(policy, policy_factory, rng=rng, allow_mutation=allow_mutation, module_fqn="",
                          where="checkpoint")
    return _factory_contexts(source)


def is_ac2_context_fn(context_fn: Any) -> bool:
    """Whether ``context_fn`` is one ac2's compiled path made (for torch's checkpoint,
    which ``integrations.torch_checkpoint`` must then leave to torch)."""
    if not isinstance(context_fn, functools.partial):
        return False
    if context_fn.func is create_selective_checkpoint_contexts:
        return bool(context_fn.args) and isinstance(context_fn.args[0], CompiledPolicy)
    return context_fn.func is _contexts or context_fn.func is _factory_contexts


def _factory_contexts(source: PolicySource) -> Any:
    return create_selective_checkpoint_contexts(CompiledPolicy([source.new_frame()]))


def checkpoint_compiled(fn: Callable[..., Any], context_fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` as one checkpointed region of the compiled graph."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
