"""Executing replays: where and when recorded ops are re-run.

One executor abstraction runs a graph's replays: :class:`InlineExecutor` on the thread
(and, on CUDA, the stream) that runs backward -- the CPU default -- or
:class:`SideStreamExecutor` on a CUDA side stream, handing results to the consuming
stream. :class:`ReplayConfig` chooses the executor and how many checkpointed units
ahead backward replays are prefetched.
"""

# Note [Prefetching the next unit's replay]
#     Backward runs checkpointed modules (units) in reverse forward order. When the
#     backward of unit i starts (a gradient hook on its outputs), the replays that
#     units i-1 .. i-prefetch will need are run ahead: every live handle of their
#     graphs is realized and the value parked on the handle (its pending use is
#     taken then, so the use counts still free every intermediate at its last use).
#     Unpacking a prefetched handle returns the parked value. Parameters a prefetch
#     reads are an FSDP unit's: the first read waits for (or triggers) that unit's
#     unshard (Note [Replays unshard what they read] in fsdp.py), so a replay never
#     reads resharded storage and the unit is still gathered once. At most the current
#     unit's and the prefetched units' recomputed values are alive. On a side stream the
#     prefetch is paced by bytes and unshards its units when it starts (Note [A prefetch
#     holds one unit's values ahead] in _prefetch.py).
#
# Note [Replay environment]
#     A replay re-runs the *post-dispatch* op the tracer recorded, with the recorded
#     non-tensor arguments, so it must not be transformed a second time:
#     - autocast is disabled (the recorded op already has the dtypes autocast chose;
#       backward may run inside a user's ``torch.autocast`` block);
#     - grad mode is off, unless backward runs with ``create_graph=True`` (then the
#       replay is recorded by autograd so higher-order gradients flow to the region
#       inputs);
#     - this thread's tracer, if a region is active here (backward called inside a
#       region), passes replayed ops through without recording them;
#     - an RNG op recorded with ``rng="replay"`` runs with its generator set to the
#       state it had before the forward call (Note [One generator state per region]
#       in _graph.py), then the generator is restored.
#     - with ``create_graph=True`` the saved-tensor hooks of a region active on this
#       thread (backward called inside a region, e.g. a gradient penalty) are lifted
#       for the replay (Note [Replays save natively]).
#     Other dispatch modes the user has active (e.g. ``FlopCounterMode``) still see
#     the replayed ops.
#
# Note [Tensors that cross streams]
#     The caching allocator returns a freed block to the pool of the stream that
#     allocated it, at once, and the next allocation on that stream may take it while a
#     kernel another stream queued earlier still reads it. So a tensor one stream
#     allocated and another reads must be ``record_stream``-ed on the reader (the
#     allocator then reuses the block only once the reader has passed the point of the
#     free), or freed only after its stream waited for the reader. With replays on a
#     side stream (:class:`SideStreamExecutor`):
#
#     - Saved values -- region inputs, parameters, policy saves, side-effect outputs, the
#       device tensors of an offload block backward reads in place (Note [The offload
#       schedule] in offload.py), what a ``SAVE_WITH_HOOKS`` unpack returns -- were
#       allocated on the compute stream. A replay on the side stream reads them, and
#       they can die before the compute stream waits for it: at their last use inside
#       that very replay (Note [Saved values die at their last use] in _graph.py), in
#       a prefetch that runs while the compute stream goes on with the current unit's
#       backward; or with their graph or their offload block. Each saved value a
#       side-stream replay reads is ``record_stream``-ed on the side stream
#       (``Graph._saved_value`` calls ``executor.guard_read``); on a value the side
#       stream allocated itself that is a no-op.
#     - Replays allocate on the side stream. A value handed to the consumer is waited
#       for (the replay's ready event); everything else a replay makes is read and
#       dropped on the side stream only. A host->device copy of an offloaded value is
#       made on the stream that reads it (the side stream, in a prefetch).
#     - A value handed over is *not* ``record_stream``-ed on the consumer when the
#       consumer is the stream the side stream waits for at the start of every replay
#       (``side.wait_stream(consumer)``, the compute stream). Its block goes back to the
#       side stream's pool when autograd drops it, after every kernel reading it was
#       queued; the side stream allocates again only in a later replay, which first
#       waits for the consumer -- so any reuse is ordered after those reads. With
#       ``record_stream`` the block would be held until the consumer's *execution*
#       reached the free, and the host, queuing ahead of the device, frees long before:
#       in a GPU-bound backward the held blocks made the side stream reserve more
#       (Note [What side streams cost] in _streams.py).
#       A consumer that is another stream (a backward op autograd runs on the user's
#       stream of its forward) still gets ``record_stream``.
#     - The offload copy stream reads device tensors the compute stream allocated; its
#       copies are waited for before those are freed, or the tensors are
#       ``record_stream``-ed on it (offload.py).
#
#     The CPU test suite runs these paths under a simulated CUDA that fails a test on
#     any unsynchronised cross-stream free (``tests/_simcuda.py``).
#
# Note [Nothing waits behind another unit]
#     The point of the side stream is that unit i-1's replay runs while the compute
#     stream is busy with unit i's backward. That holds only if nothing the compute
#     stream waits on during unit i's backward is queued behind unit i-1's replay. The
#     side stream is FIFO: an event recorded on it *now* covers everything queued on it
#     so far, the next unit's prefetch included. So:
#
#     - a prefetch records one ready event per replay it runs, right after that replay,
#       and parks it with the value (Note [A prefetch serves every use of a handle] in
#       _graph_backward.py: every unpack of the unit is served from the prefetch);
#     - a value that already exists when it is asked for (made by an earlier replay of
#       the same graph, or a saved value) is handed over with the event of the replay
#       that made it (``Graph.side_ready``, recorded before any later unit's prefetch was
#       queued), never with a new event at the side stream's tail;
#     - an unpack nobody prefetched (the first unit of backward, ``prefetch=0``, a read
#       outside backward) replays inline on the consuming stream: a side stream would
#       make the consumer wait at once for it, and for whatever else was queued there.
#
#     Priority: the side stream has the default priority, like the compute stream it
#     feeds; FSDP2's all-gather and reduce-scatter streams are high priority so that
#     communication is never starved by compute. A replay is compute that is not needed
#     until the next unit's backward begins: at high priority its kernels would take
#     the SMs ahead of the current backward's, which is on the critical path; at the
#     default priority the two share the device and the all-gathers still go first.
#     (CUDA has no priority below the default one.)
#
# Note [Replays save natively]
#     A replay under ``create_graph=True`` is recorded by autograd, which saves
#     tensors for it. Were the saving region's hooks on top of the stack, a replayed
#     output would be packed into a region leaf holding it by identity: tensor ->
#     grad_fn -> saved handle -> graph -> leaf -> tensor, a cycle through C++ autograd
#     nodes that gc cannot collect (the whole region leaked every step). With our
#     hooks lifted autograd saves natively (an output without its grad_fn: no cycle).
#     A user's own hooks on top of ours are left alone.

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.profiler import record_function

from ._streams import StreamBackend
from ._trace._graph import Graph
from ._trace._graph_backward import _MISSING as _MISSING_VALUE
from .offload import Offload

_NULL = contextlib.nullcontext()


def trace_range(name: str) -> Any:
    """A profiler range named ``name`` while a profiler runs; free otherwise (~20 us saved
    per replay: ``record_function`` costs that even with no profiler attached)."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else _NULL


if TYPE_CHECKING:
    from ._trace._nodes import Node, RngChain


class _OwnHooksLifted:
    """Pop this thread's top saved-tensor hooks for a replay if they are a region's
    (Note [Replays save natively]); push them back afterwards."""

    __slots__ = ("_top",)

    def __enter__(self) -> None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._top = top if top is not None and getattr(top[1], "__func__", None) is Graph.unpack else None
        if self._top is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()

    def __exit__(self, *exc: Any) -> None:
        if self._top is not None:
            torch._C._autograd._push_saved_tensors_default_hooks(*self._top)


class _NoAutocast:
    """Disable autocast for every device type for the duration of a replay."""

    __slots__ = ("_guard",)

    def __enter__(self) -> None:
        self._guard = torch._C._DisableAutocast()
        self._guard.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._guard.__exit__(*exc)


@dataclass(frozen=True)
class ReplayConfig:
    """How replays run. Pass to :func:`ac2_dist.apply_ac`, :func:`ac2_dist.wrap` or
    :class:`ac2_dist.apply_ac_policy` (``replay=``).

    Args:
        stream: ``"auto"`` (a side stream on CUDA, inline on CPU), ``"inline"``, or a
            ``torch.cuda.Stream`` to replay on. The ``"auto"`` side stream is made once
            per device and per thread that runs backward (autograd's CUDA worker: one
            per GPU), at the first replay, and reused by every region and every step
            until the thread ends -- for autograd's worker threads, until the process
            does: each CUDA stream keeps a cuBLAS workspace and an allocator pool of
            its own.
        prefetch: how many checkpointed modules ahead backward replays are run when a
            module's backward starts (0, 1 or 2). ``None``: 1 on CUDA, 0 on CPU. Only
            modules checkpointed with ``apply_ac`` / ``wrap`` are prefetched (the order
            of units is known there). On a side stream the prefetch is paced, from a
            module's second backward on: the recomputed values and gathered parameters of
            the current and the prefetched modules are kept to ``prefetch`` modules'
            values and parameters plus the current module's parameters, and the prefetch
            goes on as the current module's backward frees its values.
        log: called as ``log(event, module_fqn)`` for ``backward_start``,
            ``prefetch_start``, ``prefetch_end``, ``unshard`` (a replay unsharded an
            FSDP unit), ``unsharded`` (it found the unit gathered) and
            ``backward_end``: for tests and debugging; ``None`` costs nothing.
        offload: an :class:`ac2_dist.Offload`, the asynchronous schedule CPU-offloaded
            saves follow; its host->device
            copies are issued by the prefetch above. ``None``: ``apply_ac`` gives the
            modules it wraps one ``Offload()`` of their own; other regions copy
            synchronously.
    """

    stream: Any = "auto"
    prefetch: int | None = None
    log: Callable[[str, str], None] | None = None
    offload: Offload | None = None

    def __post_init__(self) -> None:
        if self.prefetch is not None and self.prefetch not in (0, 1, 2):
            raise ValueError(f"ac2_dist.ReplayConfig: prefetch must be 0, 1, 2 or None, got {self.prefetch!r}")
        if not (self.stream in ("auto", "inline", None) or _is_stream(self.stream)):
            raise ValueError(
                f"ac2_dist.ReplayConfig: stream must be 'auto', 'inline' or a torch.cuda.Stream, got {self.stream!r}"
            )
        if self.offload is not None and not isinstance(self.offload, Offload):
            raise TypeError(
                f"ac2_dist.ReplayConfig: offload takes an ac2_dist.Offload or None, got {self.offload!r}; "
                "e.g. offload=ac2_dist.Offload(defer=1)"
            )

    def explicit_scheduling(self) -> bool:
        """A side stream or a prefetch depth asked for (not left to ``"auto"``/``None``)."""
        return bool(self.prefetch) or _is_stream(self.stream)

    def prefetch_depth(self, on_cuda: bool) -> int:
        if self.prefetch is not None:
            return self.prefetch
        return 1 if on_cuda else 0

    def executor(self, thread_state: Any, streams: StreamBackend | None) -> InlineExecutor:
        """The executor of one region's graph; ``streams``: the region's stream backend,
        None on CPU."""
        if self.stream in ("inline", None) or streams is None:
            return InlineExecutor(thread_state)
        stream = self.stream if _is_stream(self.stream) else None
        return SideStreamExecutor(thread_state, streams, stream)


DEFAULT_CONFIG = ReplayConfig()


def check_replay(replay: Any) -> ReplayConfig:
    """``replay=`` argument: a :class:`ReplayConfig` or ``None`` (the default)."""
    if replay is None:
        return DEFAULT_CONFIG
    if not isinstance(replay, ReplayConfig):
        raise TypeError(
            f"ac2_dist: replay= takes an ac2_dist.ReplayConfig or None, got {replay!r}; e.g. "
            "replay=ac2_dist.ReplayConfig(stream='inline', prefetch=1)"
        )
    return replay


def _is_stream(s: Any) -> bool:
    return hasattr(torch, "cuda") and isinstance(s, torch.cuda.Stream)


class InlineExecutor:
    """Runs replays on the calling thread, in stream order (CPU, or when disabled)."""

    # See Note [Unpacking a value that exists] in _graph_backward.py.
    #: A value that exists needs no executor: the graph hands it over itself. Not on a
    #: side stream.
    takes_existing = True
    # See Note [Tensors that cross streams].
    #: Called with every saved value a replay or an unpack reads, or None: on the
    #: calling stream there is nothing to guard.
    guard_read: Callable[[Any], None] | None = None
    # See Note [The plain replay path] in _replayer.py.
    #: ``run`` of a node without an RNG chain only calls the op: the plain replay path
    #: calls it itself, as the tracer did in forward (``OpInfo.call``, what ``op(...)``
    #: ends in), two Python frames less per op. An executor whose ``run`` does more per
    #: op sets this False.
    calls_ops_directly = True
    # See Note [A prefetch holds one unit's values ahead] in _prefetch.py.
    #: Prefetches are paced by a byte budget: not on the calling stream (one pool).
    paced_prefetch = False

    def __init__(self, thread_state: Any) -> None:
        self._state_of_thread = thread_state

    def realize(self, graph: Graph, node: Node, idx: int) -> Any:
        """Value of ``node[idx]`` for a consumer on the calling thread / stream."""
        with trace_range("ac2::replay"):
            return self._realize(graph, node, idx)

    def prefetch(self, graph: Graph, node: Node, idx: int) -> tuple[Any, Any]:
        """Realize ahead of use; returns (value, ready event or None)."""
        return self._realize(graph, node, idx), None

    def hand_over(self, value: Any, ready: Any) -> Any:
        """Make a prefetched value usable by the calling stream."""
        return value

    def ahead(self, graph: Graph, fn: Callable[[], Any]) -> Any:
        """Call ``fn`` where this executor's prefetches run (the FSDP all-gathers a
        prefetch issues ahead of its replays)."""
        # See Note [A prefetch holds one unit's values ahead] in _prefetch.py.
        return fn()

    def _realize(self, graph: Graph, node: Node, idx: int) -> Any:
        replaying = self._state_of_thread().replaying
        create_graph = torch.is_grad_enabled()
        replaying.depth += 1
        outer, replaying.graph = replaying.graph, graph
        graph.create_graph = create_graph
        t0 = time.perf_counter()
        try:
            with torch.autograd.grad_mode.set_grad_enabled(create_graph), _NoAutocast():
                if not create_graph:
                    return graph.realize(node, idx)
                with _OwnHooksLifted():
                    return graph.realize(node, idx)
        finally:
            graph.stats.replay_seconds += time.perf_counter() - t0
            replaying.depth -= 1
            replaying.graph = outer

    def run(self, node: Node, args: list, kwargs: dict, chain: RngChain | None = None) -> Any:
        """Run a recorded op; a random one on ``chain``, which Graph._advance brought to
        the state right before it."""
        if chain is None:
            return node.op(*args, **kwargs)
        k = node.rng[1]
        gen = chain.generator
        current = gen.get_state()
        gen.set_state(chain.state)
        try:
            out = node.op(*args, **kwargs)
            chain.cursor = k + 1
            # The state after the chain's last op is never needed: do not keep it.
            chain.state = gen.get_state() if chain.cursor < len(chain.nodes) else None
            return out
        finally:
            gen.set_state(current)


class SideStreamExecutor(InlineExecutor):
    """Runs prefetched replays on a CUDA side stream: the one given, or the side stream of
    the device and the thread that runs backward, made once and shared by every graph
    and every step.

    A prefetch waits for the consuming stream (replay inputs may have been produced
    there), replays on the side stream and records the replay's ready event; the
    consumer waits on that event only when it unpacks the value. A value that already
    exists is handed over with the event of the replay that made it. An unpack nobody
    prefetched replays inline, on the consuming stream. Memory read across the two
    streams is guarded: every saved value a side-stream replay reads is
    ``record_stream``-ed on the side stream and every tensor handed over on the
    consumer, so the caching allocator reuses neither before the stream reading it is
    done with it.
    """

    # See Note [Nothing waits behind another unit].
    takes_existing = False  # an existing value may have been made on the side stream
    paced_prefetch = True  # its own allocator pool (Note [A prefetch holds one unit's values ahead])

    def __init__(self, thread_state: Any, streams: StreamBackend, stream: Any = None) -> None:
        super().__init__(thread_state)
        self._streams = streams  # torch.cuda, or the test suite's simulation (_streams.py)
        self._stream = stream
        self._waits_for: Any = None  # the stream every replay on the side stream waits for first
        self.guard_read = self._read_on_side

    def _read_on_side(self, value: Any) -> None:
        """A saved value (allocated on the compute stream in forward) is read by a replay
        on the side stream, and may be dropped before the compute stream waits for it."""
        if isinstance(value, torch.Tensor) and self._streams.on_device(value):
            self._streams.record_stream(value, self._side())

    def _side(self) -> Any:
        if self._stream is None:  # this thread's, shared by every graph and step
            self._stream = self._streams.side_stream()
        return self._stream

    def realize(self, graph: Graph, node: Node, idx: int) -> Any:
        """An unpack nobody prefetched: replayed inline on the consuming stream, after
        any side-stream replay of this graph (whose values it may read)."""
        if graph.side_ready is not None:
            self._streams.current_stream().wait_event(graph.side_ready)
        self.guard_read = None  # read on the stream that made it: nothing to guard
        try:
            return super().realize(graph, node, idx)
        finally:
            self.guard_read = self._read_on_side

    def prefetch(self, graph: Graph, node: Node, idx: int) -> tuple[Any, Any]:
        value = graph._existing(node, idx)  # takes the use if it runs no op
        if value is not _MISSING_VALUE:
            return value, graph.side_ready  # made by an earlier replay of this graph, or saved
        streams = self._streams
        side = self._side()
        self._waits_for = consumer = streams.current_stream()
        side.wait_stream(consumer)
        with streams.use(side), trace_range("ac2::replay"):
            value = self._realize(graph, node, idx)
        graph.side_ready = ready = side.record_event()
        return value, ready

    def ahead(self, graph: Graph, fn: Callable[[], Any]) -> Any:
        # On the side stream, as the replays that read what it makes: an FSDP unshard's
        # parameters are then allocated from the side pool, as when a replay unshards.
        streams = self._streams
        side = self._side()
        self._waits_for = consumer = streams.current_stream()
        side.wait_stream(consumer)
        with streams.use(side):
            out = fn()
        graph.side_ready = side.record_event()
        return out

    def hand_over(self, value: Any, ready: Any) -> Any:
        streams = self._streams
        consumer = streams.current_stream()
        if ready is not None:
            consumer.wait_event(ready)
        # See Note [Tensors that cross streams]: the stream every replay waits for first
        # needs no record_stream (and its holds); any other consumer does.
        if consumer is not self._waits_for and isinstance(value, torch.Tensor) and streams.on_device(value):
            streams.record_stream(value, consumer)
        return value
