"""Op kinds: multi-output, kwargs, views, non-tensor results, in-place and out=,
tensor subclasses, SDPA, identity and version checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _models import OpCounter
from torch.testing._internal.two_tensor import TwoTensor

import ac2_dist as ac

aten = torch.ops.aten


def _check(fn, *inputs, policy="recompute_all", **region):
    """fn under the region gives bitwise-equal grads to eager; returns the counter."""
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    ref_in = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    ref = torch.autograd.grad(fn(*ref_in), [t for t in ref_in if t.requires_grad])
    with ac.apply_ac_policy(policy, **region):
        y = fn(*inputs)
    with OpCounter() as counter:
        got = torch.autograd.grad(y, [t for t in inputs if t.requires_grad])
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    return counter


@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all", [aten.split.Tensor]])
def test_multi_output_split_unbind_chunk(policy):
    def fn(x):
        a, b, c = x.sin().split(4, dim=1)
        d, e = x.cos().unbind(0)
        f, g = (x * 3).chunk(2, dim=1)
        return (a.tanh() * b.tanh() + c.exp()).sum() + (d.sigmoid() * e).sum() + (f * g.exp()).sum()

    _check(fn, torch.randn(2, 12), policy=policy)


def test_multi_output_op_is_replayed_once():
    def fn(x):
        values, indices = x.exp().max(dim=1)  # aten.max.dim: two outputs
        return (values.tanh() * x.sum(1)).sum() + indices.sum()

    counter = _check(fn, torch.randn(6, 5))
    assert counter["aten.exp"] == 1  # max's backward needs indices; tanh its input


def test_kwargs_and_scalar_args_replayed_exactly():
    def fn(x, w):
        y = torch.addmm(x[:, :4], x, w, beta=0.5, alpha=2.0)
        z = torch.clamp(y, min=-0.3, max=0.4).tanh()
        s = torch.sum(z * y, dim=1, keepdim=True, dtype=torch.float64)
        return F.layer_norm(z, (4,), eps=1e-3).pow(3).sum() + s.sum()

    _check(fn, torch.randn(5, 6), torch.randn(6, 4))


def test_views_and_view_chains():
    def fn(x):
        v = x.exp().view(4, 6).t().contiguous().view(-1)[::2]
        w = x.tanh().transpose(0, 1).unsqueeze(0).expand(3, -1, -1)
        return (v.sin() ** 2).sum() + (w.sigmoid() * w).sum() + x.diagonal().exp().sum()

    _check(fn, torch.randn(6, 4))


def test_non_tensor_outputs_are_not_replayed():
    def fn(x):
        y = x.exp()
        scale = y.max().item()  # aten._local_scalar_dense: a Python number
        n = y.shape[0] * y.numel()
        return (y.tanh() * scale * n).sum()

    counter = _check(fn, torch.randn(3, 3))
    assert counter["aten._local_scalar_dense"] == 0


def test_in_place_chain_on_fresh_values_is_replayed_once():
    """Every in-place op here writes a value the region created and nothing saved
    (Note [Replaying writes to fresh tensors]): each is replayed, once."""

    def fn(x):
        a = x * 2
        a.add_(1).mul_(3)
        b = a.relu_()
        c = b.tanh() * 2
        c.sub_(x.detach())
        return (c.sigmoid() * a.exp()).sum()

    counter = _check(fn, torch.randn(4, 4))
    for op in ("aten.add_", "aten.mul_", "aten.relu_", "aten.sub_", "aten.tanh", "aten.sigmoid", "aten.exp"):
        assert counter[op] == 1, op


@pytest.mark.parametrize("policy", ["recompute_all", [aten.mm.default], "must_save_all"])
@pytest.mark.parametrize("second_reader", [False, True])
def test_write_to_an_undeclared_alias_of_a_saved_or_read_value(policy, second_reader):
    """torch.matmul of a 3-d input is view + mm + _unsafe_view, whose output shares mm's
    storage without being a view (Note [Aliases a schema does not declare]). A write to
    it is replayed only while mm's output is a recomputed value nothing else reads; when
    mm's output is saved, the write is a side effect and the saved value is snapshotted
    first (a reader of the alias replays from the value before the write)."""
    w = torch.randn(6, 5)
    b = torch.randn(5)

    def fn(x):
        h = torch.matmul(x, w)  # 3-d @ 2-d
        s = h.sigmoid() if second_reader else 0
        h.add_(b)
        return (h.relu() * 2 + s).sum()

    counter = _check(fn, torch.randn(2, 3, 6), policy=policy)
    if policy == "recompute_all":
        assert counter["aten.add_"] == 1  # replayed with its producer (into a copy for the reader)
    else:
        assert counter["aten.add_"] == 0


def test_in_place_writes_to_region_inputs_are_never_replayed():
    bufs = [torch.zeros(4, 4), torch.zeros(4, 4)]  # made outside the region: region inputs

    def fn(x):
        a = x * 2
        buf = bufs.pop()
        buf.add_(a.detach())  # a side effect
        return (a.tanh() * buf).sum()

    counter = _check(fn, torch.randn(4, 4))
    assert counter["aten.add_"] == 0 and counter["aten.tanh"] == 1


def test_out_overloads_every_written_argument_versioned():
    givens = [torch.zeros(4), torch.zeros(4)]  # made outside the region: region inputs

    def fn(x):
        given = givens.pop()
        a = x.exp()
        out = torch.empty(4, 4)
        with torch.no_grad():
            torch.mul(a, 2, out=out)  # writes `out`, whose first use is after the op
        m, i = torch.empty(4), torch.empty(4, dtype=torch.long)
        torch.max(a.detach(), dim=1, out=(m, i))  # two written arguments, neither first
        torch.min(a.detach(), dim=1, out=(given, torch.empty(4, dtype=torch.long)))
        return (a * out).tanh().sum() + (a * m.unsqueeze(1)).sum() + i.sum() + (a * given.unsqueeze(1)).sum()

    counter = _check(fn, torch.randn(4, 4))
    assert counter["aten.mul"] >= 1  # tanh/mul backward
    # m and i are fresh buffers of the region: their out= op is replayed (once);
    # `given` is a region input: min, which writes it, is never replayed.
    assert counter["aten.max"] == 1 and counter["aten.min"] == 0


def test_write_through_a_view_is_seen_by_the_base():
    def fn(x):
        base = x * 3
        base.detach()[0].zero_()  # writes base through a view created outside autograd
        return (base.tanh() * 2).sum()

    counter = _check(fn, torch.randn(3, 3))
    # tanh is replayed from the written version of base, not from a replayed x * 3.
    assert counter["aten.tanh"] == 1 and counter["aten.zero_"] == 0


@pytest.mark.parametrize("allow", [False, True])
def test_held_tensor_modified_after_the_region_raises_even_when_allowed(allow):
    """A region input modified between forward and backward: the bytes forward read are
    gone and gradients from the modified value would not be the forward's (eager raises
    here too: mul saved buf). allow_cache_entry_mutation=True must not turn that into
    silently different gradients, and the message must not suggest it."""
    x = torch.randn(4, requires_grad=True)
    buf = torch.ones(4)
    with ac.apply_ac_policy("recompute_all", allow_cache_entry_mutation=allow):
        y = (x * buf).exp().sum()  # exp is recomputed from x * buf, which needs buf
    buf.add_(1)  # outside the region: the region input changed
    with pytest.raises(RuntimeError, match=r"region input.*modified in place after the region") as info:
        y.backward()
    assert "pass allow_cache_entry_mutation" not in str(info.value)


def test_identity_preserved_for_saved_non_differentiable_tensors():
    seen = {}

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, idx):
            ctx.save_for_backward(idx)
            seen["fwd"] = idx
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (idx,) = ctx.saved_tensors
            seen["bwd"] = idx
            return g * 2, None

    x = torch.randn(4, requires_grad=True)
    with ac.apply_ac_policy("must_save_all"):
        idx = torch.arange(4) * 2  # produced in the region, non-differentiable, not a view
        y = Keep.apply(x, idx).sum()
    y.backward()
    assert seen["bwd"] is seen["fwd"]


def test_two_tensor_subclass():
    def fn(a):
        return (a.sin() * a.cos()).exp().sum()

    a = TwoTensor(torch.randn(3, 3), torch.randn(3, 3)).requires_grad_()
    ref_a = TwoTensor(a.a.clone(), a.b.clone()).requires_grad_()
    (ref,) = torch.autograd.grad(fn(ref_a), ref_a)
    for policy in ("recompute_all", [aten.sin.default]):
        with ac.apply_ac_policy(policy):
            y = fn(a)
        (got,) = torch.autograd.grad(y, a)
        assert isinstance(got, TwoTensor)
        assert torch.equal(got.a, ref.a) and torch.equal(got.b, ref.b)


def test_sdpa_without_dropout_is_recomputed_with_dropout_saved():
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))

    def attn(p):
        def fn(q, k, v):
            torch.manual_seed(3)
            return F.scaled_dot_product_attention(q.sin(), k, v, dropout_p=p, is_causal=True).pow(2).sum()

        return fn

    counter = _check(attn(0.0), q, k, v)
    sdpa = "aten._scaled_dot_product_flash_attention_for_cpu"
    assert counter[sdpa] == 1  # dropout_p == 0: deterministic, recomputed
    counter = _check(attn(0.0), q, k, v, policy="must_save_all")
    assert counter[sdpa] == 0
    # With dropout, CPU SDPA takes the math path (bernoulli_ fills a fresh mask buffer):
    # saved with rng="save", regenerated with rng="replay"; gradients bitwise equal.
    for rng, draws in (("save", 0), ("replay", 1)):
        counter = _check(attn(0.3), q, k, v, rng=rng)
        assert counter["aten.bernoulli_"] == draws and counter["aten.bmm"] >= 1
    # The fused kernels are random exactly when dropout_p != 0.
    from ac2_dist.side_effects import op_info

    for op in (
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
    ):
        info = op_info(op)
        idx = info.dropout_arg[0]
        args = [None] * idx + [0.0]
        assert info.is_rng and not info.is_random(tuple(args), {})
        args[idx] = 0.1
        assert info.is_random(tuple(args), {})
        assert info.is_random((None,) * 3, {"dropout_p": 0.5})


def test_rng_replay_uses_explicit_generator():
    gen = torch.Generator().manual_seed(5)

    def fn(x):
        noise = torch.rand(x.shape, generator=gen)
        return (x.exp() * noise).sigmoid().sum()

    x = torch.randn(4, 4)
    gen.manual_seed(5)
    xr = x.clone().requires_grad_()
    (ref,) = torch.autograd.grad(fn(xr), xr)
    gen.manual_seed(5)
    xa = x.clone().requires_grad_()
    with ac.apply_ac_policy("recompute_all", rng="replay"):
        y = fn(xa)
    gen.manual_seed(99)  # state changed before backward: replay restores its own
    state = gen.get_state()
    with OpCounter() as counter:
        (got,) = torch.autograd.grad(y, xa)
    assert counter["aten.rand"] == 1 and torch.equal(got, ref)
    assert torch.equal(gen.get_state(), state)  # and puts the caller's state back


_TICKS = []


@torch.library.custom_op("ac2test::tick", mutates_args=())
def _tick(x: torch.Tensor) -> torch.Tensor:
    _TICKS.append(1)  # an effect the op has on the outside world
    return x * 2


_tick.register_autograd(lambda ctx, g: g * 2)


def test_register_side_effect_custom_op_never_replayed():
    from ac2_dist.side_effects import SideEffect, op_info

    def fn(x):
        return torch.ops.ac2test.tick(x.sin()).tanh().sum()

    x = torch.randn(4, requires_grad=True)
    with ac.apply_ac_policy("recompute_all"):
        y = fn(x)
    _TICKS.clear()
    y.backward()
    assert len(_TICKS) == 1  # unregistered: an ordinary op, replayed for tanh's backward

    ac.register_side_effect("ac2test::tick")
    assert op_info(torch.ops.ac2test.tick.default).side_effect is SideEffect.REGISTERED
    x.grad = None
    with ac.apply_ac_policy("recompute_all"):
        y = fn(x)
    _TICKS.clear()
    y.backward()
    assert _TICKS == []  # registered: its output is saved
    with pytest.raises(RuntimeError, match="MUST_RECOMPUTE for ac2test.tick"):
        with ac.apply_ac_policy(lambda ctx, op, *a, **k: ac.CheckpointPolicy.MUST_RECOMPUTE):
            fn(x)
    with pytest.raises(TypeError):
        ac.register_side_effect(42)


def test_side_effect_classification():
    from ac2_dist.side_effects import SideEffect, op_info

    c10d = torch.ops.c10d
    assert op_info(torch.ops._c10d_functional.all_reduce.default).side_effect is SideEffect.COLLECTIVE
    assert op_info(torch.ops._c10d_functional.wait_tensor.default).side_effect is SideEffect.COLLECTIVE
    assert op_info(c10d.allreduce_.default).written == (0,)  # schema hides the write
    assert op_info(c10d._allgather_base_.default).written == (0,)
    assert op_info(aten.add_.Tensor).side_effect is SideEffect.MUTATION
    assert op_info(aten.add.out).written == ("out",)
    assert op_info(aten.native_batch_norm.default).writes((None,) * 5 + (True,))
    assert not op_info(aten.native_batch_norm.default).writes((None,) * 5 + (False,))
    assert op_info(aten.sin.default).side_effect is SideEffect.NONE
    assert op_info(aten.detach.default).ignored
    assert op_info(aten.split.Tensor).returns_alias


def test_saved_output_written_in_place_after_a_replay_read_it():
    """A policy-saved output, read by a recomputable op, then written in place in the
    region: the replay must see the value before the write (it is snapshotted)."""

    def fn(x, w):
        h = x @ w  # saved by the save-list policy
        q = (h * 2).exp()  # recomputed from h in backward
        h.relu_()  # eager: fine, autograd did not save h
        return (q + h).sum()

    _check(fn, torch.randn(8, 16), torch.randn(16, 16), policy=[aten.mm.default])


@pytest.mark.parametrize("allow", [False, True])
def test_in_place_op_needing_original_self_on_a_region_input(allow):
    """mul_(w) saves self.clone() *before* writing self: the clone's replay must read
    the pre-write value of the region input."""
    x = torch.randn(4, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    ref = torch.autograd.grad((x * 1.0).mul_(w).sin().sum(), (x, w))
    h = x * 1.0  # produced before the region
    with ac.apply_ac_policy("recompute_all", allow_cache_entry_mutation=allow):
        y = h.mul_(w).sin().sum()
    got = torch.autograd.grad(y, (x, w))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_saved_tensors_read_twice_in_one_backward():
    class ReadTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return a * 3

        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            (b,) = ctx.saved_tensors  # legal in eager
            return g * 3 + 0 * (a + b)

    def fn(x):
        return ReadTwice.apply(x.sin().tanh()).exp().sum()

    x = torch.randn(5, requires_grad=True)
    (ref,) = torch.autograd.grad(fn(x), x)
    with ac.apply_ac_policy("recompute_all") as region:
        y = fn(x)
    (g1,) = torch.autograd.grad(y, x, retain_graph=True)
    (g2,) = torch.autograd.grad(y, x)
    assert torch.equal(g1, ref) and torch.equal(g2, ref)
    assert region.stats.cached_bytes == 0 and region.stats.backward_epochs == 1
