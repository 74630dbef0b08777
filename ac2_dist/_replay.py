"""Executing replays: the environment a recorded op is re-run in.

Note [Replay environment]
    A replay re-runs the *post-dispatch* op the tracer recorded, with the recorded
    non-tensor arguments, so it must not be transformed a second time:
    - autocast is disabled (the recorded op already has the dtypes autocast chose;
      backward may run inside a user's ``torch.autocast`` block);
    - grad mode is off, unless backward runs with ``create_graph=True`` (then the
      replay is recorded by autograd so higher-order gradients flow to the region
      inputs);
    - this thread's tracer, if a region is active here (backward called inside a
      region), passes replayed ops through without recording them;
    - an RNG op recorded with ``rng="replay"`` runs with its generator set to the
      state stashed before the forward call, then the generator is restored.
    Other dispatch modes the user has active (e.g. ``FlopCounterMode``) still see
    the replayed ops.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ._graph import Graph, Node


def default_generator(device: torch.device) -> torch.Generator:
    """The default generator an op without ``generator=`` draws from on ``device``."""
    if device.type == "cpu":
        return torch.default_generator
    mod = getattr(torch, device.type)
    index = device.index if device.index is not None else mod.current_device()
    return mod.default_generators[index]


class _NoAutocast:
    """Disable autocast for every device type for the duration of a replay."""

    __slots__ = ("_guard",)

    def __enter__(self) -> None:
        self._guard = torch._C._DisableAutocast()
        self._guard.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._guard.__exit__(*exc)


class InlineExecutor:
    """Runs replays on the calling thread, in stream order (CPU, or when disabled)."""

    def __init__(self, thread_state: Any) -> None:
        self._state_of_thread = thread_state

    def realize(self, graph: Graph, node: Node, idx: int) -> Any:
        state = self._state_of_thread()
        create_graph = torch.is_grad_enabled()
        state.replaying += 1
        graph.create_graph = create_graph
        t0 = time.perf_counter()
        try:
            with torch.autograd.grad_mode.set_grad_enabled(create_graph), _NoAutocast():
                return graph.realize(node, idx)
        finally:
            graph.stats.replay_seconds += time.perf_counter() - t0
            state.replaying -= 1

    def run(self, node: Node, args: list, kwargs: dict) -> Any:
        if node.rng is None:
            return node.op(*args, **kwargs)
        gen, stashed = node.rng
        current = gen.get_state()
        gen.set_state(stashed)
        try:
            return node.op(*args, **kwargs)
        finally:
            gen.set_state(current)
