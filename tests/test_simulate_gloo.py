"""gloo's own buffers (Note [gloo's buffers of its own] in ac2_dist/_sim/_world.py): what a
real gloo all-gather and reduce-scatter allocate on the calling thread, against what the
simulation of a CPU job counts for the same calls, and what it does not add for a GPU job."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from _dist import run_ranks
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import ac2_dist.simulate  # noqa: F401  (what a simulation imports: on torch 2.10 the fake c10d kernels among it)
from ac2_dist._sim._world import GlooBuffers, fake_world

SHARD = 1000  # float32 elements per rank


def _collectives() -> None:
    """What FSDP2 issues per block: an all-gather of the shards and a reduce-scatter of the
    unsharded gradients (both waited for on return, as FSDP2's own prefetches are)."""
    world = dist.get_world_size()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the name FSDP2 calls
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    out, shard = torch.empty(world * SHARD), torch.ones(SHARD)
    gather(out, shard)
    grads, reduced = torch.ones(world * SHARD), torch.empty(SHARD)
    scatter(reduced, grads)


def _real(rank: int, world: int) -> list[tuple[str, int]]:
    """(c10d op, bytes) of every allocation made on this thread inside a c10d op."""
    from torch._C._profiler import _ExtraFields_Allocation
    from torch.profiler import ProfilerActivity, profile

    _collectives()  # gloo's first collective sets up its context
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _collectives()
    found = []

    def walk(event, op):
        if isinstance(event.extra_fields, _ExtraFields_Allocation):
            if op is not None and event.extra_fields.alloc_size > 0:
                found.append((op, event.extra_fields.alloc_size))
            return
        name = event.name
        inside = name.removeprefix("c10d::") if name.startswith("c10d::") else op
        for child in event.children:
            walk(child, inside)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, None)
    return found


class _Allocations(TorchDispatchMode):
    """(c10d op, bytes) of the tensors made while a c10d op runs, as the simulation's meter
    would see them (it sits below GlooBuffers as this mode does)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, int]] = []
        self.op: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).removeprefix("c10d.")
        if func.namespace == "c10d":
            outer, self.op = self.op, name
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.op = outer
        out = func(*args, **(kwargs or {}))
        if self.op is not None and isinstance(out, torch.Tensor):
            self.found.append((self.op, out.untyped_storage().nbytes()))
        return out


def _simulated(gloo: bool) -> list[tuple[str, int]]:
    seen = _Allocations()
    with fake_world(2, 0), FakeTensorMode(allow_non_fake_inputs=True):  # as the simulated step runs
        # GlooBuffers' own buffer is made inside its handler: the mode below sees it as a
        # tensor made before the c10d op reaches it; attribute it by the op being handled
        class _Named(GlooBuffers):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "c10d":
                    seen.op = str(func.overloadpacket).removeprefix("c10d.")
                try:
                    return super().__torch_dispatch__(func, types, args, kwargs)
                finally:
                    seen.op = None

        with seen, (_Named() if gloo else contextlib.nullcontext()):
            _collectives()
    return seen.found


def test_the_simulation_counts_the_buffers_a_real_gloo_collective_makes():
    real = run_ranks(_real, world=2)
    # checked on the real backend: gloo's flat all-gather output and its reduce-scatter's
    # clone of the input, each the size of one block's unsharded tensor here
    assert real[0] == real[1] == [("_allgather_base_", 2 * SHARD * 4), ("_reduce_scatter_base_", 2 * SHARD * 4)], real
    assert _simulated(gloo=True) == real[0]
    assert _simulated(gloo=False) == []  # NCCL (a GPU job) copies in place
