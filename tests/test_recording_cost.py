"""What recording keeps per op (issue 23): one handle per saved value, the objects
the garbage collector tracks, and the semantics the sharing must not change."""

from __future__ import annotations

import gc

import pytest
import torch

import ac2_dist as ac


def _chain(x: torch.Tensor, w: torch.Tensor, n_ops: int) -> torch.Tensor:
    h = x
    for _ in range(n_ops // 2):
        h = torch.tanh(h) * w
    return h


def _eager_grads(x, w, n_ops):
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    return torch.autograd.grad(_chain(xr, wr, n_ops).sum(), (xr, wr))


class _CountSaves(torch.autograd.graph.saved_tensors_hooks):
    """Counts the saved variables autograd creates for a function run outside a region."""

    def __init__(self) -> None:
        self.n = 0

        def pack(t):
            self.n += 1
            return t

        super().__init__(pack, lambda t: t)


def test_one_handle_per_saved_value_and_every_save_counted():
    # Note [One handle per saved value]: tanh's result is saved by tanh and by mul;
    # w by every mul. One handle each, whose count is the number of saves.
    x = torch.randn(16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    n = 200
    saves = _CountSaves()
    with saves:
        _chain(x, w, n)
    with ac.apply_ac_policy("recompute_all") as region:
        y = _chain(x, w, n).sum()
    graph = region.graph
    handles = graph.live_handles()
    assert sum(h.count for h in handles) == saves.n == 3 * (n // 2)
    assert len(handles) == n // 2 + 1  # each tanh result, and w
    gx, gw = torch.autograd.grad(y, (x, w))
    rx, rw = _eager_grads(x, w, n)
    assert torch.equal(gx, rx) and torch.equal(gw, rw)
    # Every op backward needs ran once (all but the last mul, whose output only sum
    # reads), and every cached value was dropped at its last use.
    assert region.stats.recomputed_ops == n - 1
    assert region.stats.cached_bytes == 0


def test_shared_handles_across_retained_and_partial_backwards():
    x = torch.randn(16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    n = 40
    with ac.apply_ac_policy("recompute_all") as region:
        y = _chain(x, w, n).sum()
    rx, rw = _eager_grads(x, w, n)
    # Only x: MulBackward never reads tanh's result for w's gradient, so part of each
    # shared handle's uses stay untaken in this backward.
    (gx,) = torch.autograd.grad(y, x, retain_graph=True)
    gx2, gw = torch.autograd.grad(y, (x, w), retain_graph=True)
    gx3, gw3 = torch.autograd.grad(y, (x, w))
    assert torch.equal(gx, rx) and torch.equal(gx2, rx) and torch.equal(gx3, rx)
    assert torch.equal(gw, rw) and torch.equal(gw3, rw)
    assert region.stats.backward_epochs == 2
    assert region.stats.cached_bytes == 0


def test_shared_handle_read_twice_by_one_saved_variable():
    class ReadTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return a * 3

        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            (b,) = ctx.saved_tensors
            return g * 3 + 0 * (a + b)

    def fn(x):
        a = x.sin().tanh()  # tanh saves its result; ReadTwice saves the same tensor
        return (ReadTwice.apply(a) * a).sum()

    x = torch.randn(5, requires_grad=True)
    (ref,) = torch.autograd.grad(fn(x), x)
    with ac.apply_ac_policy("recompute_all") as region:
        y = fn(x)
    assert max(h.count for h in region.graph.live_handles()) == 3  # tanh, ReadTwice, mul
    (g1,) = torch.autograd.grad(y, x, retain_graph=True)
    (g2,) = torch.autograd.grad(y, x)
    assert torch.equal(g1, ref) and torch.equal(g2, ref)
    assert region.stats.cached_bytes == 0


def test_a_save_after_a_backward_inside_the_region_gets_its_own_handle():
    # A handle a backward already read is not shared by later saves of the same tensor.
    x = torch.randn(8, requires_grad=True)

    def fn(x):
        a = x.sin()
        b = a.tanh()
        (g,) = torch.autograd.grad(b.sum(), x, retain_graph=True)
        return (b * b).sum() + g.sum()

    (ref,) = torch.autograd.grad(fn(x), x)
    with ac.apply_ac_policy("recompute_all") as region:
        y = fn(x)
    (got,) = torch.autograd.grad(y, x)
    assert torch.equal(got, ref)
    assert region.stats.cached_bytes == 0


@pytest.mark.parametrize("policy", ["recompute_all", [torch.ops.aten.mul.Tensor]])
def test_gc_tracked_objects_per_recorded_op(policy):
    # Objects the cyclic garbage collector tracks, kept per recorded op by a forward
    # whose graph is alive: the node and its inputs tuple, and one handle (with its weak
    # reference) per saved value; use counts are one array per graph. Before issue 23:
    # 7.5 per op (3.0 now for recompute_all, 4.0 with the save list).
    x = torch.randn(16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    n = 2000

    def region():
        with ac.apply_ac_policy(policy):
            return _chain(x, w, n)

    region().sum().backward()
    gc.collect()
    before = len(gc.get_objects())
    out = region()
    gc.collect()
    per_op = (len(gc.get_objects()) - before) / n
    del out
    limit = 3.1 if policy == "recompute_all" else 4.1  # a saved mul also keeps its Saved and tensor
    assert per_op <= limit, per_op


def test_only_aten_pointwise_ops_skip_the_undeclared_alias_check():
    # Note [Aliases a schema does not declare]: the tracer compares storages of an op's
    # output and first argument unless the op is an ATen pointwise op that neither
    # writes nor declares an alias (OpInfo.fresh_output). The ATen ops that do alias
    # undeclared (_unsafe_view, unsafe_split) must never be among those.
    from ac2_dist.side_effects import op_info

    aten = torch.ops.aten
    for op in (aten.tanh.default, aten.mul.Tensor, aten.add.Tensor, aten.where.self, aten.clone.default):
        assert op_info(op).fresh_output, op
    for op in (
        aten._unsafe_view.default, aten.unsafe_split.Tensor, aten.unsafe_chunk.default, aten.mm.default,
        aten.add_.Tensor, aten.mul.out, aten.t.default, aten.alias.default, aten.positive.default,
        aten.native_dropout.default, aten._to_copy.default, aten.conj_physical.default,
    ):
        assert not op_info(op).fresh_output, op


def test_op_facts_are_cached_per_op_object():
    # Note [Op-info cache is a memo, not state]: keyed by id(op), each entry holding
    # its op, so two ops never share an entry and a cleared cache is rebuilt.
    from ac2_dist import side_effects

    aten = torch.ops.aten
    a, b = side_effects.op_info(aten.tanh.default), side_effects.op_info(aten.mul.Tensor)
    assert a.op is aten.tanh.default and b.op is aten.mul.Tensor
    assert side_effects.op_info(aten.tanh.default) is a
    assert a.owner == "output of aten.tanh.default"
    side_effects._INFO.clear()
    assert side_effects.op_info(aten.tanh.default) == a
