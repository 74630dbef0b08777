"""Module groups (``apply_ac(..., groups=)``): one region over a causal LM's final norm and
LM head. Gradients bitwise eager's, fewer bytes kept than with the layers alone, and the
region closes whatever runs: the decoder without its head, a forward that raises, no
grad, copies of the model, FSDP2 on two gloo ranks with the head sharded as one unit."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from _dist import run_ranks
from _models import assert_bitwise, grads_of, step_memory

import ac2_dist as ac
from ac2_dist._region import _thread_state

T = pytest.importorskip("transformers", reason="the 'test' extra installs transformers")

V, S, B, H = 128, 32, 2, 64
HIDDEN = B * S * H * 4  # one fp32 hidden-state tensor
HEADS = {"llama": ("model.norm", "lm_head"), "gpt2": ("transformer.ln_f", "lm_head")}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        m = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    else:
        m = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=H, n_layer=2, n_head=4, n_positions=64,
                                           resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
    m.config._attn_implementation = "sdpa"
    return m.train()


def _layers(model: torch.nn.Module) -> list[type]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sorted({type(m) for m in model.modules() if isinstance(m, GradientCheckpointingLayer)}, key=str)


IDS = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))


def _loss(model: torch.nn.Module) -> torch.Tensor:
    return model(input_ids=IDS, use_cache=False).logits.float().square().mean()


def _clean() -> bool:
    st = _thread_state()
    return st.graph is None and not st.owners and not st.frames


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_head_group_keeps_less_with_eagers_gradients(name):
    base = _model(name)
    layers = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=_layers(base))
    head = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=_layers(base), groups=[list(HEADS[name])])
    eager = step_memory(base, _loss, seed=3)
    a = step_memory(layers, _loss, seed=3)
    b = step_memory(head, _loss, seed=3)
    assert_bitwise(eager["grads"], b["grads"])
    assert_bitwise(a["grads"], b["grads"])
    # Llama's RMSNorm: eager keeps the last layer's output, the normalized value and the
    # norm's output (the head's input); GPT-2's LayerNorm: its input and its output
    fewer = 2 if name == "llama" else 1
    assert b["kept"] <= a["kept"] - fewer * HIDDEN, (a["kept"], b["kept"])
    assert b["peak"] <= a["peak"], (a["peak"], b["peak"])
    assert ac.is_checkpointed(head.lm_head) and _clean()


def test_groups_alone_with_a_selector_that_matches_nothing_else():
    """Only groups checkpointed (``modules`` a predicate that selects nothing): the decoder
    stack with its rotary tables as one region, the head as another; eager's gradients, and
    a selector that matches nothing without groups is still refused."""
    base = _model("llama")
    stack = ["model.rotary_emb", "model.layers.0", "model.layers.1"]
    none = lambda fqn, module: False  # noqa: E731
    model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=none, groups=[stack, list(HEADS["llama"])])
    assert ac.is_checkpointed(model.model.layers[1]) and ac.is_checkpointed(model.lm_head)
    assert_bitwise(step_memory(base, _loss, seed=3)["grads"], step_memory(model, _loss, seed=3)["grads"])
    assert _clean()
    with pytest.raises(ValueError, match="no submodule of LlamaForCausalLM matches"):
        ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=none)


def test_group_closes_when_the_decoder_runs_without_its_head():
    base = _model("llama")
    model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=_layers(base), groups=[["model.norm", "lm_head"]])

    def decoder(m):
        return m.model(input_ids=IDS, use_cache=False).last_hidden_state.square().mean()

    expected = step_memory(base, decoder)["grads"]
    got = step_memory(model, decoder)["grads"]
    assert _clean()
    assert [g is None for g in got] == [g is None for g in expected]
    assert_bitwise([g for g in expected if g is not None], [g for g in got if g is not None])
    assert_bitwise(grads_of(base, _loss), grads_of(model, _loss))  # the whole model still runs the group


def test_group_closes_when_a_forward_raises():
    base = _model("llama")
    model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=_layers(base), groups=[["model.norm", "lm_head"]])

    def boom(*_a, **_k):
        raise RuntimeError("lm_head failed")

    model.lm_head.forward = boom
    with pytest.raises(RuntimeError, match="lm_head failed"):
        _loss(model)
    assert _clean()
    del model.lm_head.forward
    assert_bitwise(grads_of(base, _loss), grads_of(model, _loss))
    assert _clean()


def test_group_under_no_grad_records_nothing():
    base = _model("llama")
    model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=_layers(base), groups=[["model.norm", "lm_head"]])
    with torch.no_grad():
        out = model(input_ids=IDS, use_cache=False).logits
    assert _clean() and not out.requires_grad
    with torch.no_grad():
        expected = base(input_ids=IDS, use_cache=False).logits
    assert torch.equal(out, expected)


def test_group_survives_deepcopy_and_torch_save():
    base = _model("llama")
    model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=_layers(base), groups=[["model.norm", "lm_head"]])
    plain = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=_layers(base))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for m in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert ac.is_checkpointed(m.lm_head) and ac.is_checkpointed(m.model.norm)
        got = step_memory(m, _loss)
        assert_bitwise(step_memory(base, _loss)["grads"], got["grads"])
        assert got["kept"] <= step_memory(plain, _loss)["kept"] - 2 * HIDDEN
        assert _clean()
    assert_bitwise(grads_of(base, _loss), grads_of(model, _loss))  # the original is untouched by its copies


def test_unwrap_of_a_member_undoes_the_group():
    base = _model("llama")
    hooks = {n: (len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in base.named_modules()}
    model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=_layers(base), groups=[["model.norm", "lm_head"]])
    ac.unwrap(model.lm_head)
    assert not ac.is_checkpointed(model.lm_head) and not ac.is_checkpointed(model.model.norm)
    assert {n: (len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in model.named_modules()} == hooks
    assert all(not m._forward_hooks_always_called for m in model.modules())
    # unwrapped, the head is kept as eager keeps it again
    plain = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=_layers(base))
    assert step_memory(model, _loss)["kept"] == step_memory(plain, _loss)["kept"]


@pytest.mark.parametrize("groups, error, match", [
    ("model.norm", TypeError, "list of lists"),
    ([["model.norm", "model.norm"]], TypeError, "distinct"),
    ([["model.nrom", "lm_head"]], ValueError, "no submodule 'model.nrom'"),
    ([["", "lm_head"]], ValueError, "the model itself"),
    ([["model.layers.1", "model.norm"]], ValueError, "already checkpointed"),
    ([["model.layers.1.mlp", "model.norm"]], ValueError, "inside 'model.layers.1'"),
    ([["model.norm", "lm_head"], ["lm_head"]], ValueError, "already checkpointed"),
])
def test_bad_groups_are_refused_before_anything_is_wrapped(groups, error, match):
    model = _model("llama")
    with pytest.raises(error, match=match):
        ac.apply_ac(model, "recompute_all", modules=_layers(model), groups=groups)
    assert not any(ac.is_checkpointed(m) for m in model.modules())


def test_group_with_a_peak_target_settles_within_it():
    from _models import peak_from

    base = _model("llama")
    head = [["model.norm", "lm_head"]]
    floor_model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=_layers(base), groups=head)
    floor = max(peak_from(floor_model, floor_model, _loss)[0] for _ in range(2))
    top = max(peak_from(base, base, _loss)[0] for _ in range(2))
    target = floor + (top - floor) // 2
    budget = ac.MemoryBudget(peak=target)
    model = ac.apply_ac(copy.deepcopy(base), budget, modules=_layers(base), groups=head)
    peaks = []
    for _ in range(7):
        p, grads = peak_from(model, model, _loss)
        peaks.append(p)
    assert budget.peak_planner.state == "settled", budget.peak_planner.describe()
    assert [c.fqn for c in budget.peak_planner.structure][-1] == "model.norm+lm_head"  # a block of the plan
    assert all(p <= target for p in peaks[1:]), (target, peaks)
    assert_bitwise(grads_of(base, _loss), grads)


def test_group_under_torch_compile_runs_its_members_plainly():
    import warnings

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    base = _model("llama")
    model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=_layers(base), groups=[["model.norm", "lm_head"]])
    plain = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=_layers(base))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        got = grads_of(torch.compile(model, backend="aot_eager"), _loss)
    torch._dynamo.reset()
    expected = grads_of(torch.compile(plain, backend="aot_eager"), _loss)
    assert_bitwise(expected, got)
    assert any("module group 'model.norm+lm_head'" in str(w.message) for w in caught)
    assert _clean()


def _fsdp_head(rank, world):
    from torch.distributed.fsdp import fully_shard

    from ac2_dist import _groups

    recorded = []  # collectives each group region recorded (its all-gather must run before it opens)
    after = _groups.after_region

    def spy(region, *args, **kwargs):
        recorded.append(region.stats.collectives)
        return after(region, *args, **kwargs)

    _groups.after_region = spy
    results = {}
    for order in ("none", "ac2 first", "fsdp first"):
        torch.manual_seed(0)
        model = _model("llama")

        def checkpoint(model=model):
            ac.apply_ac(model, "recompute_all", modules=_layers(model), groups=[["model.norm", "lm_head"]])

        if order == "ac2 first":
            checkpoint()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard([model.model.norm, model.lm_head])  # FSDP2's own group: one unit over the head
        fully_shard(model)
        if order == "fsdp first":
            checkpoint()
        ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(10 + rank))
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(5)  # the same generator state in every order
            model(input_ids=ids, use_cache=False).logits.float().square().mean().backward()
        results[order] = [p.grad.full_tensor() for p in model.parameters()]
        assert _clean()
    same = all(all(torch.equal(a, b) for a, b in zip(results["none"], results[o])) for o in ("ac2 first", "fsdp first"))
    return same, recorded


def test_group_under_fsdp2_with_the_head_as_one_unit():
    """Either order of apply_ac and fully_shard: eager's gradients, and the head unit's
    all-gather runs before the group's region opens (the region records no collective)."""
    for same, recorded in run_ranks(_fsdp_head):
        assert same
        assert recorded == [0] * 4, recorded  # two orders x two steps


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hf_enable_head_checkpoints_the_final_norm_and_lm_head(name):
    from ac2_dist.integrations import hf

    base = _model(name)
    layers = hf.enable(copy.deepcopy(base), "recompute_all", rng="save")
    head = hf.enable(copy.deepcopy(base), "recompute_all", rng="save", head=True)
    assert ac.is_checkpointed(head.lm_head) and not ac.is_checkpointed(layers.lm_head)
    a, b = step_memory(layers, _loss, seed=3), step_memory(head, _loss, seed=3)
    assert_bitwise(step_memory(base, _loss, seed=3)["grads"], b["grads"])
    assert b["kept"] <= a["kept"] - (2 if name == "llama" else 1) * HIDDEN
    hf.disable(head)
    assert not ac.is_checkpointed(head.lm_head) and _clean()


def test_hf_enable_head_again_replaces_the_region_and_refuses_a_checkpointed_head():
    from ac2_dist.integrations import hf

    base = _model("llama")
    from ac2_dist._groups import _Hook

    def ours(m):  # the groups' hooks (HF's switch adds a hook of its own at each enable)
        return {n: sum(isinstance(h, _Hook) for h in [*x._forward_pre_hooks.values(), *x._forward_hooks.values()])
                for n, x in m.named_modules()}

    model = hf.enable(copy.deepcopy(base), "recompute_all", rng="save", head=True)
    hooks = ours(model)
    assert hooks["lm_head"] == 2 and hooks[""] == 2
    recompute = step_memory(model, _loss)["kept"]
    hf.enable(model, "must_save_all", rng="save", head=True)  # a second enable: one group, the new policy
    assert ours(model) == hooks
    got = step_memory(model, _loss)
    assert got["kept"] > recompute
    assert_bitwise(step_memory(base, _loss)["grads"], got["grads"])
    other = copy.deepcopy(base)
    ac.wrap(other.lm_head, "recompute_all")
    with pytest.raises(ValueError, match="already checkpointed"):
        hf.enable(other, head=True)
    assert not hf.is_enabled(other) and not ac.is_checkpointed(other.model.norm)


def test_hf_enable_head_refuses_a_model_without_a_final_norm():
    from ac2_dist.integrations import hf

    model = T.BertForMaskedLM(T.BertConfig(vocab_size=V, hidden_size=H, num_hidden_layers=1, num_attention_heads=4,
                                           intermediate_size=128))
    with pytest.raises(ValueError, match="groups="):
        hf.enable(model, head=True)
    assert not hf.is_enabled(model)
