"""Autograd modes inside a region (issue 50 items 2 and 3): values made under
``torch.inference_mode()`` are remade, not kept (Note [What inference mode records] in
ac2_dist/_trace/_tracer.py), and a saved value with no autograd history (made under
``no_grad``, a saved random op's mask) serves a ``create_graph=True`` backward as eager's
constant does. Eager's gradients bit for bit; kept bytes from the allocator against
torch's checkpoint in the same run."""

from __future__ import annotations

import pytest
import torch
from _models import assert_bitwise, step_memory
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ac2_dist as ac

N = 256


def _inference_constant(x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        noise = torch.randn(N, 1024)  # a constant the region makes (1 MiB)
        ramp = torch.arange(1024, dtype=torch.float32) / 1024
    return (x + noise * ramp).sin()


class _Model(torch.nn.Module):
    def __init__(self, call) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1024))
        self.call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(_inference_constant, x * self.w)


@pytest.mark.parametrize("rng", ["replay", "save"])
def test_inference_mode_values_are_remade_not_kept(rng):
    """Before: the inference tensors became region inputs and were kept (1 MiB here) where
    torch's checkpoint keeps nothing of them (its recompute draws them again)."""
    x = torch.randn(N, 1024, generator=torch.Generator().manual_seed(1)).requires_grad_()
    runs = {
        "eager": _Model(lambda f, h: f(h)),
        "torch": _Model(lambda f, h: torch_checkpoint(f, h, use_reentrant=False)),
        "ac2": _Model(lambda f, h: ac.checkpoint_with(rng=rng)(f, h, use_reentrant=False)),
    }
    got = {name: step_memory(m, lambda m: m(x).sum(), seed=3, extra=(x,)) for name, m in runs.items()}
    assert_bitwise(got["eager"]["grads"], got["ac2"]["grads"])
    if rng == "replay":
        assert got["ac2"]["kept"] <= got["torch"]["kept"] * 1.01, {k: v["kept"] for k, v in got.items()}
    else:  # rng="save" keeps what a random op draws, as it keeps dropout masks: the noise, 1 MiB
        assert got["ac2"]["kept"] <= got["torch"]["kept"] + N * 1024 * 4 + 1024


def _no_history(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        c = (x * 2).exp()  # no history, in eager too
    return ((x @ w) * c).tanh()


def _masked(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout((x @ w).tanh(), 0.3, training=True) * x


def _penalty(run, x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """A gradient penalty: the gradient's norm differentiated again."""
    x.grad = w.grad = None
    torch.manual_seed(5)
    y = run()
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    g.square().sum().backward()
    return [x.grad, w.grad]


@pytest.mark.parametrize("fn", [_no_history, _masked], ids=["no_grad value", "saved random mask"])
@pytest.mark.parametrize("policy", ["save values", "recompute_all"])
def test_double_backward_through_saved_values_without_history(fn, policy):
    """Item 3: a saved value that has no history even in eager (made under no_grad; a
    random op's output kept with rng="save") was refused in a create_graph=True backward,
    though eager uses exactly that constant."""
    torch.manual_seed(0)
    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    eager = _penalty(lambda: fn(x, w), x, w)
    aten = torch.ops.aten
    policies = {  # keep the history-less values, recompute the rest from the region inputs
        "save values": [aten.exp.default, aten.bernoulli_.float, aten.bernoulli.p, aten.native_dropout.default],
        "recompute_all": "recompute_all",
    }
    ckpt = ac.checkpoint_with(policies[policy], rng="save")
    assert_bitwise(eager, _penalty(lambda: ckpt(fn, x, w, use_reentrant=False), x, w))


def _literal_block(x: torch.Tensor) -> torch.Tensor:
    table = torch.tensor([float(i % 7) for i in range(4096)], dtype=torch.float64)  # 32 KiB made by Python
    return (x.double() * table).float().sin()


def test_a_literal_of_any_size_is_kept_no_more_than_torch_keeps_it():
    """Item 4: a 4096-entry literal was kept as a tensor (33,792 B against torch's 1,024 B);
    it is remembered by its bytes, outside the allocator, as small ones were."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)).requires_grad_()

    class M(torch.nn.Module):
        def __init__(self, call):
            super().__init__()
            self.call = call

        def forward(self, h):
            return self.call(_literal_block, h)

    got = {name: step_memory(M(call), lambda m: m(x).sum(), extra=(x,)) for name, call in (
        ("eager", lambda f, h: f(h)),
        ("torch", lambda f, h: torch_checkpoint(f, h, use_reentrant=False)),
        ("ac2", lambda f, h: ac.checkpoint(f, h, use_reentrant=False)))}
    assert_bitwise(got["eager"]["grads"], got["ac2"]["grads"])
    assert got["ac2"]["kept"] <= got["torch"]["kept"] * 1.01, {k: v["kept"] for k, v in got.items()}
