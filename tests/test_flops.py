"""FLOPs of attention calls torch's formula registry does not count by itself (Note [FLOPs
torch's registry does not give] in ac2_dist/_plan/_flops.py): CPU flash attention, and
grouped-query attention on torch 2.10-2.11 (whose formulas assert equal head counts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ac2_dist._plan._block_problem import _CostModel
from ac2_dist._plan._flops import _grouped_query, op_flops


class _Calls(TorchDispatchMode):
    """Every ATen call of a region: (func, args, kwargs, out)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, kwargs or {}, out))
        return out


def _attention_calls(q, k, v, **kw):
    with _Calls() as mode:
        out = F.scaled_dot_product_attention(q, k, v, **kw)
        out.sum().backward()
    return [c for c in mode.calls if "attention" in c[0].__name__]


def test_grouped_query_attention_counts_as_with_repeated_key_and_value():
    """8 query heads over 2 key/value heads: forward and backward FLOPs are those of the
    same call with key and value repeated to 8 heads (what the kernel computes)."""
    torch.manual_seed(0)
    q = torch.randn(2, 8, 16, 32, requires_grad=True)
    k = torch.randn(2, 2, 16, 32, requires_grad=True)
    v = torch.randn(2, 2, 16, 32, requires_grad=True)
    grouped = _attention_calls(q, k, v, enable_gqa=True)
    repeated = _attention_calls(q, k.detach().repeat_interleave(4, 1).requires_grad_(),
                                v.detach().repeat_interleave(4, 1).requires_grad_())
    assert [c[0] for c in grouped] == [c[0] for c in repeated] and len(grouped) == 2  # forward, backward
    counts = [op_flops(*c, strict=True) for c in grouped]
    assert counts == [op_flops(*c, strict=True) for c in repeated]
    b, h, s, d = q.shape
    assert counts[0] == 2 * (2 * b * h * s * s * d)  # q @ k^T and scores @ v
    assert counts[1] > counts[0]
    # The cost model prices the recompute of the forward call by these FLOPs, not by bytes alone.
    model = _CostModel(torch.device("cpu"), 1e12, 1e15)
    flops, seconds = model.estimate(*grouped[0])
    assert flops == counts[0] and seconds == flops / 1e12


def test_the_shapes_widened_for_a_grouped_query_call():
    q, k = torch.empty(2, 8, 16, 32), torch.empty(2, 2, 16, 32)
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention
    wide = _grouped_query(sdpa, (q, k, k, 0.0, True))
    assert wide[0] is q and wide[1] == wide[2] == torch.Size((2, 8, 16, 32)) and wide[3:] == (0.0, True)
    back = torch.ops.aten._scaled_dot_product_flash_attention_backward
    assert _grouped_query(back, (q, q, k, k))[2] == torch.Size((2, 8, 16, 32))  # the query follows grad_out
    assert _grouped_query(sdpa, (q, q, q)) is None  # equal heads: nothing to widen
    assert _grouped_query(sdpa, (q, torch.empty(2, 3, 16, 32), torch.empty(2, 3, 16, 32))) is None  # 8 % 3
    assert _grouped_query(torch.ops.aten.mm, (q, k, k)) is None


def test_a_formula_that_fails_counts_zero_or_raises_when_strict():
    bad = (torch.empty(2, 8, 16, 32), torch.empty(3, 8, 16, 32), torch.empty(3, 8, 16, 32))
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention.default  # batch 2 against 3
    assert op_flops(sdpa, bad, {}, None) == 0
    with pytest.raises(AssertionError, match="sdpa"):
        op_flops(sdpa, bad, {}, None, strict=True)
    assert op_flops(torch.ops.aten.relu.default, (torch.empty(4),), {}, torch.empty(4)) == 0  # no formula
