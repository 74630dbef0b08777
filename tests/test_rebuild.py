"""Region inputs rebuilt from a recipe (``apply_ac(..., rebuild=)``): a causal LM's rotary
tables are not kept (the positions are), gradients bitwise eager's; recipes refused for
random draws and for inputs larger than the outputs; an in-place change of the recipe's
input before backward raises; bad names are refused before anything is wrapped; FSDP2
on two gloo ranks gives the same gradients."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn as nn
from _dist import run_ranks
from _models import assert_bitwise, grads_of, step_memory

import ac2_dist as ac
from ac2_dist._region import _thread_state

T = pytest.importorskip("transformers", reason="the 'test' extra installs transformers")

V, S, B, H, HEADS = 128, 32, 2, 64, 4
IDS = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))


def _llama() -> nn.Module:
    torch.manual_seed(0)
    m = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64))
    m.config._attn_implementation = "sdpa"
    return m.train()


def _layers(model: nn.Module) -> list[type]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sorted({type(m) for m in model.modules() if isinstance(m, GradientCheckpointingLayer)}, key=str)


def _loss(model: nn.Module) -> torch.Tensor:
    return model(input_ids=IDS, use_cache=False).logits.float().square().mean()


def _watch(module: nn.Module) -> list[weakref.ref]:
    """Weak references to what ``module``'s next forwards return."""
    refs: list[weakref.ref] = []
    module.register_forward_hook(lambda m, a, out: refs.extend(weakref.ref(o) for o in out))
    return refs


def test_rebuilt_rotary_tables_are_not_kept_and_gradients_are_eagers():
    base = _llama()
    kept = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=_layers(base))
    rebuilt = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=_layers(base),
                          rebuild=["model.rotary_emb"])
    eager = step_memory(base, _loss, seed=3)
    a, b = step_memory(kept, _loss, seed=3), step_memory(rebuilt, _loss, seed=3)
    assert_bitwise(eager["grads"], b["grads"])
    assert_bitwise(a["grads"], b["grads"])
    tables = 2 * S * (H // HEADS) * 4  # cos and sin, fp32
    positions = S * 8  # what the layers hold instead (int64)
    assert b["kept"] <= a["kept"] - (tables - positions), (a["kept"], b["kept"])
    refs = _watch(rebuilt.model.rotary_emb)
    loss = _loss(rebuilt)
    assert refs and all(r() is None for r in refs)  # freed with the forward: no region holds them
    loss.backward()
    refs = _watch(kept.model.rotary_emb)
    loss = _loss(kept)
    assert refs and all(r() is not None for r in refs)
    loss.backward()
    st = _thread_state()
    assert st.graph is None and not st.frames


class _Tables(nn.Module):
    """cos/sin tables from positions; ``noise``: with a random draw (no recipe)."""

    def __init__(self, noise: bool = False) -> None:
        super().__init__()
        self.noise = noise
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 8), persistent=False)

    @torch.no_grad()
    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = pos[..., None].float() * self.freq
        if self.noise:
            x = x + 0.01 * torch.rand_like(x)
        return x.cos(), x.sin()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h) * cos + h * sin)


class _Net(nn.Module):
    def __init__(self, noise: bool = False) -> None:
        super().__init__()
        self.tables = _Tables(noise)
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])

    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = self.tables(pos)
        for b in self.blocks:
            h = b(h, cos, sin)
        return h


POS = torch.arange(16)


def _net_loss(h: torch.Tensor, pos: torch.Tensor = POS):
    return lambda m: m(h, pos).square().sum()


@pytest.mark.parametrize("noise", [False, True], ids=["recipe", "random draw"])
def test_a_recipe_is_used_only_for_pure_ops(noise):
    torch.manual_seed(0)
    base = _Net(noise)
    model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=[_Block], rebuild=["tables"])
    h = torch.randn(4, 16, 8, requires_grad=True)
    torch.manual_seed(1)
    expected = grads_of(base, _net_loss(h), h)
    torch.manual_seed(1)
    refs = _watch(model.tables)
    got = grads_of(model, _net_loss(h), h)
    assert_bitwise(expected, got)
    torch.manual_seed(1)
    loss = _net_loss(h)(model)
    # a random draw is never replayed: its tables are kept, as without rebuild
    assert all((r() is not None) == noise for r in refs[-2:])
    loss.backward()


class _Mean(nn.Module):
    @torch.no_grad()
    def forward(self, big: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = big.mean(0)
        return m.cos(), m.sin()


def test_a_recipe_reading_more_than_its_outputs_is_not_used():
    """Holding the recipe's input (a 64 x 16 x 8 tensor) would cost more than the two
    16 x 8 outputs: they are kept instead."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tables = _Mean()
            self.blocks = nn.ModuleList([_Block() for _ in range(2)])

        def forward(self, h, big):
            cos, sin = self.tables(big)
            for b in self.blocks:
                h = b(h, cos, sin)
            return h

    base = Net()
    model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=[_Block], rebuild=["tables"])
    h = torch.randn(4, 16, 8, requires_grad=True)
    big = torch.randn(64, 16, 8)
    refs = _watch(model.tables)

    def run(m):
        return m(h, big.clone()).square().sum()  # the clone dies with the forward

    loss = run(model)
    assert len(refs) == 2 and all(r() is not None for r in refs)
    loss.backward()
    assert_bitwise(grads_of(base, run, h), grads_of(model, run, h))


def test_changing_the_positions_before_backward_raises():
    """The replay would read the changed positions: backward refuses, naming the change
    (without rebuild the tables, computed before the change, are kept)."""
    torch.manual_seed(0)
    model = ac.apply_ac(_Net(), "recompute_all", modules=[_Block], rebuild=["tables"])
    pos = torch.arange(16)
    loss = model(torch.randn(4, 16, 8, requires_grad=True), pos).square().sum()
    pos.add_(1)
    with pytest.raises(RuntimeError, match="modified|changed|in place|in-place"):
        loss.backward()
    plain = ac.apply_ac(_Net(), "recompute_all", modules=[_Block])
    pos = torch.arange(16)
    loss = plain(torch.randn(4, 16, 8, requires_grad=True), pos).square().sum()
    pos.add_(1)
    loss.backward()


def test_bad_rebuild_names_are_refused_before_anything_is_wrapped():
    net = _Net()
    with pytest.raises(ValueError, match="has no submodule 'nope'"):
        ac.apply_ac(net, "recompute_all", modules=[_Block], rebuild=["nope"])
    with pytest.raises(ValueError, match="checkpointed"):
        ac.apply_ac(net, "recompute_all", modules=[_Block], rebuild=["blocks.0"])
    with pytest.raises(TypeError, match="list of module names"):
        ac.apply_ac(net, "recompute_all", modules=[_Block], rebuild="tables")
    assert not any(ac.is_checkpointed(b) for b in net.blocks)
    ac.apply_ac(net, "recompute_all", modules=lambda fqn, m: fqn == "blocks.0", rebuild=["tables"])
    with pytest.raises(ValueError, match="already rebuilt"):
        ac.apply_ac(net, "recompute_all", modules=lambda fqn, m: fqn == "blocks.1", rebuild=["tables"])
    ac.unwrap(net.tables)  # stops recording: named again, it is accepted
    ac.apply_ac(net, "recompute_all", modules=lambda fqn, m: fqn == "blocks.1", rebuild=["tables"])
    assert len(net.tables._forward_pre_hooks) == 1


def test_under_compile_nothing_is_recorded():
    torch.manual_seed(0)
    base = _Net()
    model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=[_Block], rebuild=["tables"])
    h = torch.randn(4, 16, 8, requires_grad=True)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="rebuild"):
        got = grads_of(torch.compile(model, backend="aot_eager"), _net_loss(h), h)
    torch._dynamo.reset()
    assert_bitwise(grads_of(base, _net_loss(h), h), got)


def _fsdp_rebuild(rank, world):
    from torch.distributed.fsdp import fully_shard

    results = {}
    for rebuild in ((), ("model.rotary_emb",)):
        model = _llama()
        ac.apply_ac(model, "recompute_all", modules=_layers(model), rebuild=list(rebuild))
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(10 + rank))
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, use_cache=False).logits.float().square().mean().backward()
        results[rebuild] = [p.grad.full_tensor() for p in model.parameters()]
    a, b = results.values()
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_rebuild_under_fsdp2_gives_the_same_gradients():
    assert all(run_ranks(_fsdp_rebuild))


def test_hf_enable_rebuild_frees_the_tables_and_disable_stops_it():
    from ac2_dist.integrations import hf

    base = _llama()
    model = hf.enable(copy.deepcopy(base), "recompute_all", head=True, rebuild=["model.rotary_emb"])
    hf.enable(model, "recompute_all", head=True, rebuild=["model.rotary_emb"])  # enabling again replaces it
    assert len(model.model.rotary_emb._forward_pre_hooks) == 1
    assert_bitwise(step_memory(base, _loss, seed=3)["grads"], step_memory(model, _loss, seed=3)["grads"])
    refs = _watch(model.model.rotary_emb)
    loss = _loss(model)
    assert refs and all(r() is None for r in refs)
    loss.backward()
    with pytest.raises(ValueError, match="checkpointed"):
        hf.enable(copy.deepcopy(base), rebuild=["model.layers.0.self_attn"])
    hf.disable(model)
    assert not model.model.rotary_emb._forward_pre_hooks
