"""Regions: the user-facing entry points and the per-thread state behind them.

Note [Per-thread state]
    Everything a region installs is thread-local in torch (dispatch modes and
    saved-tensor hooks) and so is ours: :class:`_ThreadState` holds the stack of
    entered policy frames and the graph of the outermost region of *this* thread.
    Backward may unpack on autograd worker threads; a handle carries its graph, so
    unpacking needs no thread state except the ``replaying`` flag of the thread that
    replays (Note [Replay environment] in replay.py).

Note [Outermost region owns the graph]
    Only the outermost region of a thread installs the tracer and the saved-tensor
    hooks and owns a :class:`Graph`; nested regions push a policy frame that is
    combined with the outer ones per op. What it installed lives in the thread state
    (``_ThreadState.install``), not on the region object, so one object may be active
    on several threads at once (each thread records its own graph). On exit the
    outermost region drops the tensor -> node map, so after forward the graph is
    reachable only from the handles autograd holds: nothing of a region outlives its
    autograd graph.

Note [Regions inside compiled code]
    The tracer, the saved-tensor hooks and the module hook cannot live inside a graph
    that dynamo captures. Checkpointed modules (``apply_ac``/``wrap``) and
    :func:`apply_ac_policy_fn` take the compiled path there (``compile.py``: one
    ``tag_activation_checkpoint`` region of the compiled graph, no graph break). A
    ``with apply_ac_policy(...)`` block has no function to hand to that path. While
    dynamo traces its ``__enter__``, :func:`_announce_split` runs for real (dynamo
    calls ``assume_constant_result`` functions at trace time) and warns, once per
    process; then :func:`_eager_enter`, a ``torch.compiler.disable``d call, breaks the
    graph (under ``fullgraph=True`` dynamo's error carries the same text) and the
    block runs as an eager region. Everything ac2 runs at run time (entry, exit,
    hooks, the tracer) is marked skipped for dynamo (``compile.skip_dynamo``), so the
    eager fallback does not make dynamo compile ac2's own frames.

Note [No grad, no region]
    A region entered while grad mode is off (``torch.no_grad()``,
    ``torch.inference_mode()``) installs nothing and records nothing: no op of it can
    be differentiated. If grad mode is turned on again inside it, autograd saves
    what it needs as usual (not checkpointed). Checkpointed modules also skip the
    region when no input and no parameter requires grad.

Note [The user's saved-tensor hooks]
    Saved-tensor hooks around a region (``torch.autograd.graph.save_on_cpu``, a user's
    compression) see what torch's non-reentrant checkpoint passes them:

    - the call's positional tensor arguments, its inputs: torch saves them as autograd
      saved tensors, so through the hooks. The recording region packs each when it
      opens and holds only what the pack returned; backward and the replays read the
      input through the unpack. ``save_on_cpu`` around checkpointed blocks thus moves
      the block boundary off the device, as under torch. Keyword arguments,
      parameters and other tensors the region reads are not inputs (torch's recompute
      reads them again): held as before.
    - with ``respect_saved_tensors_hooks=True`` (torch >= 2.14's opt-in for selective
      checkpoint), also every op output the region saves (what torch's selective
      checkpoint caches), packed when it is saved (``Graph.user_hooks``); a policy's
      own ``SAVE_WITH_HOOKS`` or CPU-offload answer keeps its path.

    Everything else ac2 keeps bypasses the hooks, as torch's legacy behaviour does. A
    ``with apply_ac_policy(...)`` block has no call arguments: nothing is packed at entry.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ._compat import MUST_CPU_OFFLOAD
from ._device import device_of, recorded_device
from ._policy import SAVE_WITH_HOOKS, PolicyContext, PolicyLike, PolicySource, _Frame, is_save
from ._rebuild import rebuilder
from ._streams import region_streams
from ._trace._graph import Graph
from ._trace._graph_stats import GraphStats
from ._trace._tracer import Tracer, pack_hook, track_what_the_graph_holds
from .compile import (
    checkpoint_compiled,
    in_eager_fallback,
    is_region_scoped,
    policy_context_fn,
    refuse_budget_compiled,
    refuse_compiled_tag,
    skip_dynamo,
    tagged,
)
from .compile import (
    is_compiling as _compiling,
)
from .fsdp import is_fsdp_unit, unsharded_params
from .replay import ReplayConfig, check_replay

__all__ = [
    "apply_ac_policy",
    "apply_ac_policy_fn",
    "tag_with_policy",
    "is_checkpoint_enabled",
]

T = TypeVar("T")
_CP = torch.utils.checkpoint.CheckpointPolicy
_COMPILED_REGION = (
    "ac2_dist: a `with ac2_dist.apply_ac_policy(...)` block inside torch.compile is a graph "
    "break: the block runs eagerly as an ac2 region (dynamo may run the whole function that "
    "contains it eagerly). To checkpoint inside compiled code with no graph break, use ac2_dist.apply_ac(model, ...) / ac2_dist.wrap(module) or "
    "ac2_dist.apply_ac_policy_fn(fn, *args, policy_fn=...)"
)


class _Install:
    """What the outermost region of a thread installed (Note [Outermost region owns the graph])."""

    __slots__ = ("owner", "graph", "tracer", "hooks", "module_hook")

    def __init__(self, owner: apply_ac_policy, graph: Graph, tracer: Tracer, hooks: Any, module_hook: Any) -> None:
        self.owner, self.graph, self.tracer, self.hooks, self.module_hook = owner, graph, tracer, hooks, module_hook


class _Replaying:
    """How many replays run on a thread right now (Note [Replay environment] in
    replay.py). A slotted object the tracer holds: a ``threading.local`` attribute
    lookup per recorded op costs several times a slot read."""

    __slots__ = ("depth", "graph")

    def __init__(self) -> None:
        self.depth = 0
        self.graph: Any = None  # the graph whose replay runs now (the innermost; for tools)


class _ThreadState(threading.local):
    def __init__(self) -> None:
        # Mutated in place, never rebound: the tracer and the graph keep this list.
        self.frames: list[_Frame] = []
        self.owners: list[apply_ac_policy] = []
        self.graph: Graph | None = None
        self.install: _Install | None = None
        self.replaying = _Replaying()
        self.tracker: Any = None  # ac2_dist.memory.Tracker active on this thread


_STATE = _ThreadState()


def _thread_state() -> _ThreadState:
    return _STATE


def _rank() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


class apply_ac_policy:  # noqa: N801 - a public name, used as a function (a context manager)
    """Checkpoint the ops run inside this ``with`` block under ``policy``.

    Every ATen op in the block is recorded; autograd's saved tensors are replaced by
    handles into that record, and backward recomputes only the ops it needs, starting
    from the nearest saved values. Collectives, ops that write their inputs, opaque
    ops and (with ``rng="save"``) random ops are never re-executed.

    Args:
        policy: ``"recompute_all"``, ``"must_save_all"``, a bool (``True`` saves
            everything, ``False`` recomputes everything), a ``CheckpointPolicy`` or
            ``SAVE_WITH_HOOKS`` applied to every op, a policy callable
            ``(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool | SAVE_WITH_HOOKS``
            (torch's selective-checkpoint signature), or an iterable of ``OpOverload``
            whose outputs are saved (everything else is recomputed).
        rng: ``"save"`` keeps the outputs of random ops; ``"replay"`` stashes the
            generator state per op and regenerates the same bits in backward.
        allow_cache_entry_mutation: accepted for compatibility with torch's
            checkpoint; changes nothing. In-place writes inside the region (to the
            region's own values, its inputs, parameters, saved values, through any
            view) are always replayed exactly: what a replay still needs is copied
            before the write. A tensor held for recompute that is modified where
            ac2_dist does not record it (after the region's forward, before backward)
            raises on use either way, because gradients from the modified value
            would not be the forward's.
        module_fqn: reported to policies as ``ctx.module_fqn``.
        replay: a :class:`ReplayConfig` (where replays run); default: inline on CPU,
            a CUDA side stream when the block computes on CUDA tensors (the device
            comes from the block's tensors, not from the current device).

    Regions nest; the outermost one records, inner ones add their policy.
    The object is also a decorator-free context manager for one thread at a time;
    ``stats`` (a :class:`GraphStats`) describes the last outermost use: an empty one
    before the first use, for a region nested in another one (the outer region records),
    and for a use under ``torch.no_grad()`` / ``torch.inference_mode()`` (nothing recorded).
    """

    def __init__(
        self,
        policy: PolicyLike = "recompute_all",
        *,
        rng: str = "save",
        allow_cache_entry_mutation: bool = False,
        module_fqn: str = "",
        replay: ReplayConfig | None = None,
    ) -> None:
        self._frame = _Frame(
            policy, rng=rng, allow_mutation=allow_cache_entry_mutation, module_fqn=module_fqn
        )
        self._replay = check_replay(replay)
        self._module_region = False  # a checkpointed module's region (Note [FSDP units are region boundaries])
        self._device: torch.device | None = None  # None: decided at exit (Note [The device comes from the tensors])
        self._inputs: tuple = ()  # a call's positional arguments (Note [The user's saved-tensor hooks])
        self._respect_hooks = False
        self.stats = GraphStats()
        self.graph: Graph | None = None  # the graph of the last outermost use that recorded

    @classmethod
    def _from_frame(cls, frame: _Frame, replay: ReplayConfig, module_region: bool = True,
                    device: torch.device | None = None, inputs: tuple = (),
                    respect_hooks: bool = False) -> apply_ac_policy:
        """A region for an already validated policy frame (no re-parse): a checkpointed
        module's, or (``module_region=False``) a function region's. ``device``: the one
        its tensors are on, if known (Note [The device comes from the tensors]).
        ``inputs``: the call's positional arguments, ``respect_hooks``: torch's
        ``respect_saved_tensors_hooks=True`` (Note [The user's saved-tensor hooks])."""
        self = cls.__new__(cls)
        self._frame = frame
        self._replay = replay
        self._module_region = module_region
        self._device = device
        self._inputs = inputs
        self._respect_hooks = respect_hooks
        self.stats = GraphStats()
        self.graph = None
        return self

    def __enter__(self) -> apply_ac_policy:
        if _compiling():  # Note [Regions inside compiled code]
            _announce_split()
            return _eager_enter(self)
        return self._enter()

    @skip_dynamo
    def _enter(self) -> apply_ac_policy:
        st = _thread_state()
        if any(o is self for o in st.owners):
            raise RuntimeError(
                "ac2_dist: this apply_ac_policy object is already active on this thread; "
                "nest a new apply_ac_policy(...) instead of re-entering the same one"
            )
        if st.graph is None:
            if torch.is_grad_enabled():
                st.install = self._install(st)
                st.graph = st.install.graph
            else:  # Note [No grad, no region]: an outermost use that records nothing
                self.stats, self.graph = GraphStats(), None
        depth, owners = len(st.frames), len(st.owners)
        try:
            frame = self._frame.for_region()  # Note [Region-scoped policies] (_policy.py)
            st.frames.append(frame)
            st.owners.append(self)
            enter = getattr(frame.fn, "region_enter", None)
            if enter is not None:
                enter(st.graph)
        except BaseException as e:  # a policy refused the region: leave no region behind
            del st.frames[depth:]
            del st.owners[owners:]
            install = st.install
            if install is not None and install.owner is self:
                self._uninstall(st, install, type(e), e, e.__traceback__)
            raise
        return self

    def _install(self, st: _ThreadState) -> _Install:
        # Note [The device comes from the tensors] (_device.py): a `with` block's device
        # is unknown until it exits (None here); it replays inline until then (unless a
        # simulated CUDA is installed: Note [Stream backends] in _streams.py), and an
        # Offload it was given decides per tensor (Offload.takes).
        device = self._device
        streams = region_streams(device is not None and device.type == "cuda")
        graph = Graph(self._replay.executor(_thread_state, streams), st.frames)
        graph.device = device
        graph.save_unit_outputs = not self._module_region
        graph.rebuild = rebuilder()  # Note [A region rebuilds an input from its recipe] (_rebuild.py)
        user = user_saved_tensors_hooks()  # before ours go on top
        if user is not None:  # Note [The user's saved-tensor hooks]
            if self._respect_hooks:
                graph.user_hooks = SAVE_WITH_HOOKS(*user)
            for t in self._inputs:
                if isinstance(t, torch.Tensor) and graph.map.get(t) is None:
                    graph.leaf(t, SAVE_WITH_HOOKS(*user), "boundary", self._frame.allow_mutation,
                               "region input, packed by the saved-tensor hooks around the region")
        offload = self._replay.offload
        if offload is not None and offload.applies(device is None or streams is not None):  # Note [The offload schedule] (offload.py)
            graph.offload = offload.open_unit(self._frame.module_fqn, streams)
            if offload.block_inputs:  # Note [Offloaded block inputs] (offload.py)
                for t in self._inputs:
                    if offload.is_block_input(t) and graph.map.get(t) is None and graph.offload.takes(t):
                        graph.leaf(t, MUST_CPU_OFFLOAD, "boundary", self._frame.allow_mutation,
                                   "block input (offloaded to the CPU)")
        if st.tracker is not None:
            graph.tracker = st.tracker
            st.tracker._add_graph(graph)
        ctx = PolicyContext(self._frame.module_fqn, _rank())
        tracer = Tracer(graph, st, ctx)
        hooks = torch.autograd.graph.saved_tensors_hooks(pack_hook(graph), graph.unpack)
        hooks.__enter__()
        try:
            module_hook = torch.nn.modules.module.register_module_forward_hook(_unit_boundary)
            try:
                tracer.__enter__()
            except BaseException:
                module_hook.remove()
                raise
        except BaseException:
            hooks.__exit__(None, None, None)
            raise
        self.graph = graph
        self.stats = graph.stats
        return _Install(self, graph, tracer, hooks, module_hook)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if _compiling():  # Note [Regions inside compiled code]
            return _eager_exit(self, exc_type, exc, tb)
        return self._exit(exc_type, exc, tb)

    @skip_dynamo
    def _exit(self, exc_type: Any, exc: Any, tb: Any) -> None:
        st = _thread_state()
        if not st.owners or st.owners[-1] is not self:
            raise RuntimeError(
                "ac2_dist: apply_ac_policy regions exited out of order; nest them with 'with'"
            )
        st.owners.pop()
        install = st.install
        if install is not None and install.owner is self and install.graph.device is None:
            self._decide_device(install.graph)  # before anything reads it (a policy's region_exit)
        frame = st.frames.pop()
        leave = getattr(frame.fn, "region_exit", None)
        if leave is not None:
            leave(st.graph, exc_type is not None)
        if install is not None and install.owner is self:
            self._uninstall(st, install, exc_type, exc, tb)

    def _decide_device(self, graph: Graph) -> None:
        """A `with` block exits: its device, from the tensors it recorded (Note [The device
        comes from the tensors]); on CUDA its replays take the configured executor."""
        graph.device = recorded_device(graph)
        if graph.device.type == "cuda":
            graph.executor = self._replay.executor(_thread_state, region_streams(True))

    @staticmethod
    def _uninstall(st: _ThreadState, install: _Install, exc_type: Any, exc: Any, tb: Any) -> None:
        st.install = None
        st.graph = None
        if install.graph.tracker is not None:
            install.graph.tracker._region_device(install.graph.device)
        install.graph.close_map()
        track_what_the_graph_holds(install.graph)  # Note [A graph holds only tracked nodes]
        try:
            install.tracer.__exit__(exc_type, exc, tb)
        finally:
            install.module_hook.remove()
            install.hooks.__exit__(exc_type, exc, tb)
            if install.graph.offload is not None:
                install.graph.offload.close()


@torch._dynamo.assume_constant_result
def _announce_split() -> bool:
    """Warn that dynamo splits the graph at a region; runs while dynamo traces (its
    result is taken as a constant). The default warning filter shows it once per
    process (one call site)."""
    warnings.warn(_COMPILED_REGION, UserWarning, stacklevel=1)
    return True


@torch.compiler.disable(reason=_COMPILED_REGION)
def _eager_enter(region: apply_ac_policy) -> apply_ac_policy:
    """Enter ``region`` outside dynamo (Note [Regions inside compiled code])."""
    return region._enter()


@torch.compiler.disable(reason=_COMPILED_REGION)
def _eager_exit(region: apply_ac_policy, exc_type: Any, exc: Any, tb: Any) -> None:
    return region._exit(exc_type, exc, tb)


@skip_dynamo
def _unit_boundary(module: torch.nn.Module, args: Any, output: Any) -> None:
    """Global forward hook while a region is active (process-wide, filtered by thread).

    Runs after an FSDP unit's forward and before FSDP's own post-forward reshards it:
    marks the unit's unsharded parameters and, in a bare region, saves the unit's
    outputs (Note [FSDP units are region boundaries] in fsdp.py).
    """
    graph = _thread_state().graph
    if graph is None or graph.map is None or not is_fsdp_unit(module):
        return
    graph.mark_fsdp_params(unsharded_params(module), module)
    if graph.save_unit_outputs:
        for t in torch.utils._pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor):
                graph.boundary(t)


def apply_ac_policy_fn(
    fn: Callable[..., T],
    *args: Any,
    policy_fn: PolicyLike | None = None,
    policy_factory: Callable[[], PolicyLike] | None = None,
    rng: str = "save",
    allow_cache_entry_mutation: bool = False,
    **kwargs: Any,
) -> T:
    """Call ``fn(*args, **kwargs)`` inside ``apply_ac_policy(policy_fn, ...)``.

    ``policy_fn`` defaults to ``"recompute_all"``; ``policy_factory`` (instead of it)
    is a zero-argument callable called at every call for a fresh policy. Inside
    ``torch.compile`` the call becomes one checkpointed region of the compiled graph
    with the same policy (no graph break).
    """
    return function_region(fn, args, kwargs, policy_fn, policy_factory, rng, allow_cache_entry_mutation,
                           "apply_ac_policy_fn")


def function_region(fn: Callable[..., T], args: tuple, kwargs: dict, policy: Any, policy_factory: Any,
                    rng: str, allow_mutation: bool, where: str, module_fqn: str = "",
                    respect_hooks: bool = False) -> T:
    """``fn(*args, **kwargs)`` in a function region: eager, or inside ``torch.compile`` one
    checkpointed region of the compiled graph. ``module_fqn``: the module ``fn`` is the
    forward of, when the caller knows it (policies see it, reports and budgets key on it)."""
    # See Note [Regions inside compiled code].
    if _compiling():  # the policy is built when AOTAutograd asks (compile.policy_context_fn)
        if is_region_scoped(policy):
            refuse_budget_compiled()
        context_fn = policy_context_fn(policy, policy_factory, rng, allow_mutation)
        return checkpoint_compiled(fn, context_fn, *args, **kwargs)
    source = PolicySource(policy, policy_factory, rng=rng, allow_mutation=allow_mutation, module_fqn=module_fqn,
                          where=where)
    return eager_region(fn, source, args, kwargs, respect_hooks)


def eager_region(fn: Callable[..., T], source: PolicySource, args: tuple, kwargs: dict,
                 respect_hooks: bool = False) -> T:
    """``fn(*args, **kwargs)`` in an eager function region (a fresh frame from ``source``)."""
    with region_scope(source, device_of(args, kwargs), args, respect_hooks):
        return fn(*args, **kwargs)


def region_scope(source: PolicySource, device: torch.device | None = None, inputs: tuple = (),
                 respect_hooks: bool = False) -> apply_ac_policy:
    """An eager function region (a fresh frame from ``source``) as a context manager;
    ``device``: its tensors' device if known, else decided when it exits; ``inputs``:
    the call's positional arguments (Note [The user's saved-tensor hooks])."""
    # See Note [The device comes from the tensors] in _device.py.
    return apply_ac_policy._from_frame(source.new_frame(), check_replay(None), module_region=False, device=device,
                                       inputs=inputs, respect_hooks=respect_hooks)


def user_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """The user's saved-tensor hooks (``save_on_cpu``, ...) a tensor saved now would go
    through, or ``None``: torch's checkpoint-internal hooks are looked through as torch
    does, and an enclosing ac2 region's own hooks are not the user's."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    while hooks is not None and getattr(hooks[0], "_checkpoint_internal", False):
        hooks = getattr(hooks[0], "_user_hooks", None)
    if hooks is None or isinstance(getattr(hooks[1], "__self__", None), Graph):  # ours: graph.unpack
        return None
    return hooks


def is_checkpoint_enabled() -> bool:
    """True while this thread is inside any :class:`apply_ac_policy` region."""
    return bool(_thread_state().frames)


def tag_with_policy(
    t: torch.Tensor, policy: _CP | bool | SAVE_WITH_HOOKS = _CP.MUST_SAVE
) -> torch.Tensor:
    """Save ``t`` (a tensor computed in the current region) instead of recomputing it.

    ``policy`` must be a save policy (``MUST_SAVE``, ``PREFER_SAVE``, ``True``, a
    ``*_CPU_OFFLOAD``) or a :class:`SAVE_WITH_HOOKS`. Returns ``t`` for chaining.
    Outside any region there is nothing to save into and the call does nothing, so a
    model that tags its tensors also runs without checkpointing.

    Inside ``torch.compile`` it returns a tagged copy of ``t`` that the compiled graph
    saves: use the returned tensor there (if only ``t`` is used afterwards, the tag
    has no effect). Hooks and CPU offload cannot be tagged in compiled code.
    """
    if policy is True:
        policy = _CP.MUST_SAVE
    if not is_save(policy):
        raise ValueError(
            f"ac2_dist.tag_with_policy: {policy!r} is not a save policy; use MUST_SAVE, "
            "PREFER_SAVE, a *_CPU_OFFLOAD policy or SAVE_WITH_HOOKS"
        )
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ac2_dist.tag_with_policy expects a tensor, got {type(t).__name__}")
    eager_only = not (policy is _CP.MUST_SAVE or policy is _CP.PREFER_SAVE)
    if _compiling():
        if eager_only:
            refuse_compiled_tag(policy)
        return tagged(t, policy is _CP.MUST_SAVE)
    st = _thread_state()
    if st.graph is None:
        if eager_only and in_eager_fallback():  # Note [Dynamo fallback of a compiled region]
            refuse_compiled_tag(policy)
        return t
    st.graph.tag(t, policy, st.frames[-1].allow_mutation)
    return t
