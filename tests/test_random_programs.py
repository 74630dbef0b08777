"""Property test: random straight-line programs over ~30 ops, random policies (nested,
tags, RNG modes) give bitwise-equal gradients to eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("hypothesis", reason="hypothesis (the 'test' extra) is not installed: the property tests need it")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import CheckpointPolicy as CP

import ac2_dist as ac

aten = torch.ops.aten
SHAPE = (4, 6)


def _inplace_add(a, b):
    c = a.clone()
    c.add_(b)
    return c


def _inplace_chain(a, b):
    c = a * 1.5
    c.mul_(0.5).relu_()
    return c


def _split_cat(a, b):
    x, y, z = a.split([1, 2, 3], dim=1)
    return torch.cat([z, x, y], dim=1)


def _unbind_stack(a, b):
    return torch.stack(list(a.unbind(0))[::-1], dim=0)


def _max_center(a, b):
    values, _ = a.max(dim=1, keepdim=True)
    return a - values


# name -> (arity, fn(a, b, w)); every fn maps SHAPE tensors to a SHAPE tensor.
OPS = {
    "sin": (1, lambda a, b, w: a.sin()),
    "cos": (1, lambda a, b, w: a.cos()),
    "tanh": (1, lambda a, b, w: a.tanh()),
    "sigmoid": (1, lambda a, b, w: torch.sigmoid(a)),
    "exp": (1, lambda a, b, w: a.clamp(-3, 3).exp()),
    "relu": (1, lambda a, b, w: F.relu(a)),
    "gelu": (1, lambda a, b, w: F.gelu(a)),
    "softplus": (1, lambda a, b, w: F.softplus(a)),
    "square": (1, lambda a, b, w: a * a),
    "neg_scale": (1, lambda a, b, w: -0.5 * a + 0.25),
    "log_softmax": (1, lambda a, b, w: F.log_softmax(a, dim=-1)),
    "softmax0": (1, lambda a, b, w: F.softmax(a, dim=0)),
    "cumsum": (1, lambda a, b, w: a.cumsum(dim=1)),
    "layer_norm": (1, lambda a, b, w: F.layer_norm(a, (SHAPE[1],))),
    "transpose": (1, lambda a, b, w: a.t().contiguous().t()),
    "flip_roll": (1, lambda a, b, w: a.flip(0).roll(1, dims=1)),
    "view": (1, lambda a, b, w: a.reshape(-1).view(SHAPE)),
    "expand_sum": (1, lambda a, b, w: a.unsqueeze(0).expand(3, -1, -1).sum(0)),
    "split_cat": (1, lambda a, b, w: _split_cat(a, b)),
    "unbind_stack": (1, lambda a, b, w: _unbind_stack(a, b)),
    "max_center": (1, lambda a, b, w: _max_center(a, b)),
    "sort": (1, lambda a, b, w: a.sort(dim=1).values),
    "inplace_chain": (1, lambda a, b, w: _inplace_chain(a, b)),
    "dropout": (1, lambda a, b, w: F.dropout(a, 0.3, training=True)),
    "rand_mul": (1, lambda a, b, w: a * torch.rand_like(a)),
    "add": (2, lambda a, b, w: a + b),
    "mul": (2, lambda a, b, w: a * b),
    "sub": (2, lambda a, b, w: a - b),
    "maximum": (2, lambda a, b, w: torch.maximum(a, b)),
    "where": (2, lambda a, b, w: torch.where(a > b, a, b * 0.5)),
    "inplace_add": (2, lambda a, b, w: _inplace_add(a, b)),
    "matmul": (1, lambda a, b, w: a @ w),
    "addmm": (2, lambda a, b, w: torch.addmm(b, a, w, beta=0.5)),
}
NAMES = sorted(OPS)
SAVE_CANDIDATES = [aten.mm.default, aten.addmm.default, aten.sin.default, aten.tanh.default,
                   aten.exp.default, aten.mul.Tensor, aten.add.Tensor, aten._softmax.default,
                   aten.cumsum.default, aten.gelu.default]


@st.composite
def programs(draw):
    steps = draw(st.lists(
        st.tuples(st.sampled_from(NAMES), st.integers(0, 10**6), st.integers(0, 10**6), st.booleans()),
        min_size=1, max_size=14,
    ))
    return steps


@st.composite
def policies(draw):
    kind = draw(st.sampled_from(["recompute_all", "must_save_all", "save_list", "callable"]))
    if kind in ("recompute_all", "must_save_all"):
        return kind
    ops = draw(st.sets(st.sampled_from(SAVE_CANDIDATES), max_size=5))
    if kind == "save_list":
        return list(ops)
    prefer = draw(st.sampled_from([CP.PREFER_RECOMPUTE, CP.PREFER_SAVE]))
    saver = draw(st.sampled_from([CP.MUST_SAVE, CP.PREFER_SAVE, True]))

    def policy(ctx, op, *args, **kwargs):
        return saver if op in ops else prefer

    policy.__qualname__ = f"random_policy(save={sorted(map(str, ops))}, else={prefer.name})"
    return policy


def _run(program, inputs, regions, tag_outputs):
    x, y, w = inputs
    vals = [x, y]
    for name, i, j, tag in program:
        arity, fn = OPS[name]
        a = vals[i % len(vals)]
        b = vals[j % len(vals)] if arity == 2 else None
        out = fn(a, b, w)
        if tag and tag_outputs:
            ac.tag_with_policy(out, CP.MUST_SAVE)
        vals.append(out)
    return sum((v.pow(2).mean() * (n + 1)) for n, v in enumerate(vals)) + w.square().mean()


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(program=programs(), outer=policies(), inner=st.none() | policies(),
       rng=st.sampled_from(["save", "replay"]), tag=st.booleans(), seed=st.integers(0, 2**16))
def test_random_program_grads_bitwise(program, outer, inner, rng, tag, seed):
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen),
            torch.randn(SHAPE[1], SHAPE[1], generator=gen)]

    ref_in = [t.clone().requires_grad_() for t in base]
    torch.manual_seed(seed)
    ref = torch.autograd.grad(_run(program, ref_in, None, False), ref_in)

    got_in = [t.clone().requires_grad_() for t in base]
    torch.manual_seed(seed)
    try:
        with ac.apply_ac_policy(outer, rng=rng):
            if inner is None:
                loss = _run(program, got_in, None, tag)
            else:
                with ac.apply_ac_policy(inner, rng=rng):
                    loss = _run(program, got_in, None, tag)
    except RuntimeError as e:
        # The only legal refusal: two nested policies issue different MUST_* results.
        assert "conflicting policies" in str(e), e
        return
    torch.manual_seed(seed + 1)  # backward must not depend on the global RNG state
    got = torch.autograd.grad(loss, got_in)
    for a, b in zip(ref, got):
        assert torch.equal(a, b), (a - b).abs().max()
