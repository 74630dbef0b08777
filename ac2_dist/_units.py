"""What every checkpointed unit (a wrapped module, a module group) does around its
region: whether it needs one, and the data-flow links backward prefetches along.

Note [Prefetch follows data flow]
    Backward reaches checkpointed modules in reverse data-flow order. Each wrapped
    forward tags its outputs' autograd nodes (``grad_fn.metadata``) with its graph,
    and links its own graph to the graphs whose tagged outputs its inputs came from
    (a bounded walk up the autograd graph from the inputs). So the unit prefetched
    when a unit's backward starts is the one that produced its inputs in *this*
    forward, never a unit of an older forward still alive (a kept eval output, a
    retained loss), and the order is the program's, the same on every rank.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn

from ._prefetch import prefetcher
from ._region import _thread_state
from ._streams import region_streams
from .replay import ReplayConfig, trace_range

__all__: list[str] = []

_UNIT_KEY = "ac2_dist.unit"  # grad_fn.metadata key: weakref to the producing unit's graph
_MAX_WALK = 512  # autograd nodes visited to find a unit's producers (Note [Prefetch follows data flow])


def needs_region(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Grad mode on and some input or parameter requires grad (Note [No grad, no region])."""
    if not torch.is_grad_enabled():
        return False
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                return True
        elif isinstance(a, (list, tuple, dict)) and _any_requires_grad(a):
            return True
    for a in kwargs.values():
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                return True
        elif isinstance(a, (list, tuple, dict)) and _any_requires_grad(a):
            return True
    return any(p.requires_grad for p in module.parameters())


def _any_requires_grad(tree: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in torch.utils._pytree.tree_leaves(tree))


def _producers(inputs: list[torch.Tensor]) -> list[weakref.ref]:
    """Graphs of the checkpointed units whose outputs ``inputs`` were computed from,
    in a deterministic (breadth-first, argument) order (Note [Prefetch follows data flow])."""
    found: list[weakref.ref] = []
    seen_graphs: set[int] = set()
    visited: set[int] = set()
    frontier = [t.grad_fn for t in inputs if t.grad_fn is not None]
    while frontier and len(visited) < _MAX_WALK:
        nxt = []
        for fn in frontier:
            if id(fn) in visited:
                continue
            visited.add(id(fn))
            ref = fn.metadata.get(_UNIT_KEY)
            if ref is not None:
                graph = ref()
                if graph is not None and id(graph) not in seen_graphs:
                    seen_graphs.add(id(graph))
                    found.append(ref)
                continue  # do not look past a unit
            nxt.extend(f for f, _ in fn.next_functions if f is not None)
        frontier = nxt
    return found


def link_for_prefetch(graph: Any, config: ReplayConfig, fqn: str, args: Any, kwargs: Any, out: Any,
                       on_cuda: bool, key: Any = None) -> None:
    """Note [Prefetching the next unit's replay] (replay.py), linked by data flow (Note
    [Prefetch follows data flow]): prefetch this unit's producers when its backward starts.
    ``on_cuda``: the unit runs on CUDA (Note [The device comes from the tensors])."""
    depth = config.prefetch_depth(region_streams(on_cuda) is not None)  # Note [Stream backends] (_streams.py)
    log = config.log
    if depth == 0 and log is None:
        return
    leaves = torch.utils._pytree.tree_leaves
    inputs = [t for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    outputs = [t for t in leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    graph.prev, graph.fqn, graph.log = _producers(inputs), fqn, log
    graph.unit_key = key  # Note [A prefetch holds one unit's values ahead] (_prefetch.py)
    this = weakref.ref(graph)
    for t in outputs:
        if t.grad_fn is not None:
            t.grad_fn.metadata[_UNIT_KEY] = this

    def backward_starts(_grads: Any) -> None:
        if log is not None:
            log("backward_start", fqn)
        g = this()
        pacer = prefetcher()  # Note [A prefetch holds one unit's values ahead] (_prefetch.py)
        if g is not None:
            pacer.begin(g)
        level = list(g.prev) if g is not None else []
        done: set[int] = set()
        for _ in range(depth):
            nxt: list[weakref.ref] = []
            for ref in level:
                unit = ref()
                if unit is None or id(unit) in done:
                    continue
                done.add(id(unit))
                with trace_range("ac2::prefetch"):
                    pacer.start(unit, depth)
                nxt.extend(unit.prev)
            level = nxt

    if outputs:
        torch.autograd.graph.register_multi_grad_hook(outputs, backward_starts, mode="any")
    if log is not None and inputs:
        torch.autograd.graph.register_multi_grad_hook(inputs, lambda _g: log("backward_end", fqn), mode="any")


def after_region(region: Any, config: ReplayConfig, fqn: str, args: Any, kwargs: Any, out: Any, on_cuda: bool,
                 key: Any = None) -> None:
    """A unit's region has exited without error: link its graph for prefetch, or, nested
    in a recording region (the outer one records), make its outputs recompute
    boundaries of the outer one (Note [Nested modules cut the replay] in _graph.py)."""
    if region.graph is not None:
        link_for_prefetch(region.graph, config, fqn, args, kwargs, out, on_cuda, key)
        return
    graph = _thread_state().graph
    if graph is not None and graph.map is not None:
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                graph.cut(t)
