"""apply_ac / wrap / unwrap on a single process (module selection)."""

from __future__ import annotations

import copy

import pytest
import torch
from _models import OpCounter, assert_bitwise
from models import Llama, LlamaBlock

import ac2_dist as ac

aten = torch.ops.aten


def _grads(model, tokens):
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("policy", ["recompute_all", [aten.mm.default]])
def test_apply_ac_blocks_bitwise_and_recomputes(policy):
    torch.manual_seed(0)
    model = Llama(vocab=64, dim=32, layers=2, heads=4)
    tokens = torch.randint(0, 64, (2, 16))
    ref = _grads(copy.deepcopy(model), tokens)
    assert ac.apply_ac(model, policy, modules=[LlamaBlock]) is model
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in copy.deepcopy(model).named_parameters()]
    with OpCounter() as counter:
        got = _grads(model, tokens)
    assert_bitwise(ref, got)
    assert counter["aten.silu"] >= 2  # SwiGLU activations were replayed in backward
    ac.unwrap(model.layers[0])
    ac.unwrap(model.layers[1])
    assert "forward" not in model.layers[0].__dict__
    assert_bitwise(ref, _grads(model, tokens))


def test_module_selectors_and_fqn_in_ctx():
    model = Llama(vocab=64, dim=32, layers=2, heads=4)
    fqns = set()

    def policy(ctx, op, *args, **kwargs):
        fqns.add(ctx.module_fqn)
        return ac.CheckpointPolicy.PREFER_RECOMPUTE

    ac.apply_ac(model, policy, modules=lambda fqn, m: fqn.endswith("feed_forward"))
    model(torch.randint(0, 64, (1, 8))).sum().backward()
    assert fqns == {"layers.0.feed_forward", "layers.1.feed_forward"}
    with pytest.raises(ValueError, match="no submodule"):
        ac.apply_ac(model, "recompute_all", modules=[torch.nn.Conv2d])
    with pytest.raises(TypeError, match="modules must be"):
        ac.apply_ac(model, "recompute_all", modules="LlamaBlock")
    whole = ac.apply_ac(Llama(vocab=64, dim=32, layers=1, heads=4))  # modules=None: the model
    assert "forward" in whole.__dict__


def test_wrap_twice_replaces_policy():
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    ac.wrap(block, "recompute_all")
    ac.wrap(block, "must_save_all")
    y = block(x).sum()
    with OpCounter() as counter:
        y.backward()
    assert counter["aten.tanh"] == 0  # the second policy (save everything) is in force


def test_wrapped_model_deepcopies_and_pickles():
    import io

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    ac.apply_ac(model, "recompute_all")
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    x = torch.randn(2, 8)
    assert clone(x).abs().sum().item() == 0.0  # the copy runs its own weights
    assert model(x).abs().sum().item() > 0.0
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded(x), model(x))


def test_unwrap_restores_an_instance_level_forward():
    m = torch.nn.Linear(4, 4)
    m.forward = lambda x: "custom"
    ac.wrap(m, "recompute_all")
    ac.wrap(m, "must_save_all")  # re-wrap keeps the forward from before the first wrap
    assert m(torch.randn(1, 4)) == "custom"
    ac.unwrap(m)
    assert m(torch.randn(1, 4)) == "custom" and "_ac2_wrap" not in m.__dict__
