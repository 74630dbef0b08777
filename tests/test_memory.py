"""Memory is asserted, not assumed: what forward keeps, when backward frees, no leaks."""

from __future__ import annotations

import gc

import pytest
import torch
from _models import GPT, OpCounter, live_instances

import ac2_dist as ac
from ac2_dist._measure._alloc import AllocationTrace
from ac2_dist._trace._nodes import Node

N = 256


def _chain(x, n=20):
    h = x
    for i in range(n):
        h = h.sin() if i % 2 == 0 else h.tanh()
    return h


def _forward_kept_bytes(policy):
    x = torch.randn(N, N, requires_grad=True)
    with AllocationTrace() as trace:
        trace.mark("forward")
        if policy is None:
            y = _chain(x)
        else:
            with ac.apply_ac_policy(policy):
                y = _chain(x)
        trace.mark("after")
    kept = trace.phases["after"].start_bytes
    y.sum().backward()
    return kept, y


def test_recompute_all_chain_keeps_only_boundary_tensors():
    one = N * N * 4
    kept, y = _forward_kept_bytes("recompute_all")
    assert kept == one  # the output; the input existed before; nothing else
    eager_kept, _ = _forward_kept_bytes(None)
    assert eager_kept == 10 * one  # tanh outputs h2..h18 that autograd saves + the output h20
    saved_kept, _ = _forward_kept_bytes("must_save_all")
    assert saved_kept == eager_kept  # saving everything costs exactly what eager costs


def test_intermediates_freed_as_soon_as_consumed():
    """Backward of op k consumes the last cached value it needs; the cache shrinks by
    exactly one tensor per step and is empty at the end (Note [Use counts ...])."""
    n = 12
    x = torch.randn(64, 64, requires_grad=True)
    one = 64 * 64 * 4
    samples = []
    with ac.apply_ac_policy("recompute_all") as region:
        h = x
        for _ in range(n):
            h = h.sin()
            # Fires when the gradient w.r.t. this intermediate is ready, i.e. right after
            # the backward of the *next* op consumed its saved input.
            h.register_hook(lambda g: samples.append(region.stats.cached_bytes))
        y = h.sum()
    y.backward()
    # Replays run when the first saved input is unpacked: inputs of sin_2..sin_n are
    # a_1..a_{n-1}; all are recomputed at once, then handed out one by one.
    assert region.stats.recomputed_ops == n - 1
    assert region.stats.peak_cached_bytes == (n - 1) * one  # a_1..a_{n-1}, before the first take
    # The hook on a_n fires before anything is replayed; the hook on a_{n-k} fires right
    # after sin_{n-k+1}'s backward took a_{n-k}, whose cached copy is then gone.
    assert samples == [0] + [(n - 2 - k) * one for k in range(n - 1)]
    assert region.stats.cached_bytes == 0


def test_shared_intermediate_recomputed_once_dropped_after_last_user():
    x = torch.randn(32, 32, requires_grad=True)
    with ac.apply_ac_policy("recompute_all") as region:
        b = x.exp()  # B feeds two consumers
        c = b.sin()
        e = b.tanh()
        y = (c.sigmoid() + e.sigmoid()).sum()
    with OpCounter() as counter:
        y.backward()
    assert counter["aten.exp"] == 1  # recomputed once although two chains need it
    assert region.stats.cached_bytes == 0


@pytest.mark.parametrize("policy", ["recompute_all", [torch.ops.aten.addmm.default]])
def test_each_op_replayed_at_most_once_per_backward_gpt(policy):
    torch.manual_seed(0)
    model = GPT(layers=2)
    x = torch.randn(2, 16, 32, requires_grad=True)
    with ac.apply_ac_policy(policy) as region:
        y = model(x).sum()
    y.backward()
    assert 0 < region.stats.recomputed_ops <= region.stats.nodes - region.stats.saved_nodes
    assert region.stats.cached_bytes == 0


def _live_nodes(collect: bool = True) -> int:
    if collect:
        gc.collect()
    return live_instances(Node)  # the C recorder's nodes are not gc-tracked


def _live_tensors() -> list[torch.Tensor]:
    """Every tensor alive now. Holding the list also keeps tensors of earlier tests
    (compile caches, ...) alive, so a later count is not lowered by their release."""
    gc.collect()
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]


def test_nothing_of_a_region_outlives_its_autograd_graph():
    torch.manual_seed(0)
    model = GPT(layers=1)
    x = torch.randn(2, 8, 32)
    base = _live_nodes()
    with ac.apply_ac_policy([torch.ops.aten.addmm.default]):
        y = model(x).sum()
    assert _live_nodes() > base
    del y  # autograd graph freed without backward
    assert _live_nodes() == base
    with ac.apply_ac_policy("recompute_all"):
        y = model(x).sum()
    y.backward()
    del y
    assert _live_nodes() == base


def test_graph_freed_by_refcount_alone():
    """No reference cycle: dropping the outputs frees every node without the cyclic gc
    (a cycle would hold saved activations until some later collection)."""
    model = GPT(layers=1)
    x = torch.randn(2, 8, 32)
    base = _live_nodes()
    gc.disable()
    try:
        for policy in ("recompute_all", [torch.ops.aten.addmm.default], "must_save_all"):
            with ac.apply_ac_policy(policy):
                y = model(x).sum()
            del y
            assert _live_nodes(collect=False) == base
            with ac.apply_ac_policy(policy):
                y = model(x).sum()
            y.backward()
            del y
            assert _live_nodes(collect=False) == base
    finally:
        gc.enable()


def test_no_leak_over_500_iterations():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    policies = ["recompute_all", "must_save_all", [torch.ops.aten.addmm.default]]

    def step(i):
        with ac.apply_ac_policy(policies[i % 3]):
            with ac.apply_ac_policy("recompute_all"):
                y = model(x).tanh().sum()
        y.backward(retain_graph=i % 5 == 0)
        model.zero_grad(set_to_none=True)
        x.grad = None

    for i in range(10):  # warm up caches (op info, allocator)
        step(i)
    tensors, nodes = _live_tensors(), _live_nodes()
    for i in range(500):
        step(i)
    assert _live_nodes() == nodes == 0
    assert len(_live_tensors()) == len(tensors)


def test_in_place_ops_leave_no_reference_cycle():
    """Written tensors are recorded at the version autograd gives them after the op, so
    the next use does not re-wrap the live tensor in a leaf (which would form the cycle
    tensor -> grad_fn -> handle -> leaf -> tensor and keep the graph after a dropped
    forward)."""
    base = _live_nodes()
    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    for _ in range(3):
        h = x * 1.0
        with ac.apply_ac_policy("recompute_all"):
            y = (x @ x).relu_().mul_(w).sum() + h.mul_(w).sum()
        del y, h  # no backward (validation with grad on, an exception, a dropped loss)
    assert _live_nodes() == base


def test_allocation_trace_segments_repeat_marks_and_count_calls():
    """A name marked again starts another segment (``phases[name]`` is the last one);
    each segment has its own figures and watched calls."""
    n = 4096
    with AllocationTrace(watch=frozenset({"aten::ones"})) as trace:
        for k in (1, 2):
            trace.mark("a")
            x = torch.ones(k * n, dtype=torch.uint8)
            trace.mark("b")
            del x
    assert [name for name, _ in trace.segments] == ["a", "b", "a", "b"]
    (_, a1), (_, b1), (_, a2), (_, b2) = trace.segments
    assert (a1.start_bytes, a1.peak_bytes, a1.end_bytes, a1.calls) == (0, n, n, 1)
    assert (b1.start_bytes, b1.peak_bytes, b1.end_bytes, b1.calls) == (n, n, 0, 0)
    assert (a2.start_bytes, a2.peak_bytes, a2.end_bytes, a2.calls) == (0, 2 * n, 2 * n, 1)
    assert trace.phases["a"] is a2 and trace.phases["b"] is b2
    assert trace.whole.peak_bytes == 2 * n and trace.whole.calls == 2
