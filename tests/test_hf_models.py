"""Hugging Face models built from small configs (random weights, nothing downloaded),
checkpointed per layer by ac2 and by HF's own gradient checkpointing (torch's
non-reentrant checkpoint) in the same test: ac2 keeps no more after forward and peaks no
higher in backward, and its gradients are bitwise eager's.

The shapes that used to cost ac2 more than torch: dropout masks (GPT-2, BERT, ViT),
values produced in place (gpt-oss's experts add their bias with ``add_``), nested
checkpointed modules (Swin checkpoints its stages and their layers), a key buffer filled
through slices of it (DeepSeek-V3), batch norm (ResNet), saved values only replays read
(BERT with dropout under a save-list).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from _models import step_memory

import ac2_dist as ac

T = pytest.importorskip("transformers", reason="the 'test' extra installs transformers")
from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: E402

V, S, B = 128, 32, 2  # vocab, sequence, batch


def _llama():
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def _gpt2():
    return T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=V, n_embd=64, n_layer=3, n_head=4, n_positions=64, resid_pdrop=0.1, embd_pdrop=0.1,
        attn_pdrop=0.1))


def _bert():
    return T.BertForMaskedLM(T.BertConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))


def _vit():
    return T.ViTForImageClassification(T.ViTConfig(
        image_size=32, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=128, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))


def _mixtral():
    return T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64))


def _gpt_oss():
    return T.GptOssForCausalLM(T.GptOssConfig(
        vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, layer_types=["full_attention", "full_attention"]))


def _swin():
    return T.SwinForImageClassification(T.SwinConfig(
        image_size=32, patch_size=2, num_channels=3, embed_dim=16, depths=[2, 2], num_heads=[2, 2],
        window_size=4, drop_path_rate=0.0))


def _deepseek_v3():
    return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64, n_group=1, topk_group=1))


def _deepseek_v2():
    """Routed experts that write a buffer they made. transformers 4.57's ``moe()``
    scatters the expert outputs into ``torch.empty_like`` and weighs them through a view
    of it (issue 44: ac2 raised in backward); 5.x adds them with ``index_add_`` into
    ``zeros_like``. tests/test_view_writes.py has the 4.57 pattern itself."""
    return T.DeepseekV2ForCausalLM(T.DeepseekV2Config(
        vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, head_dim=8, max_position_embeddings=64))


def _nllb_moe():
    """Encoder-decoder with sparse MLPs every second layer, top-2 routing and token
    dropout in the experts. transformers 4.57 writes ``masked[idx, tok] =
    expert(masked[idx, tok])`` into an einsum-made buffer (issue 44: ac2 raised in
    backward); 5.x adds the outputs with ``index_add_``."""
    return T.NllbMoeForConditionalGeneration(T.NllbMoeConfig(
        vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
        encoder_attention_heads=4, decoder_attention_heads=4, num_experts=4, expert_capacity=16,
        encoder_sparse_step=2, decoder_sparse_step=2, max_position_embeddings=64, encoder_layerdrop=0.0,
        decoder_layerdrop=0.0, dropout=0.1, attention_dropout=0.1, moe_token_dropout=0.2))


MODELS = {"llama": _llama, "gpt2": _gpt2, "bert": _bert, "vit": _vit, "mixtral": _mixtral,
          "gpt-oss": _gpt_oss, "swin": _swin, "deepseek-v3": _deepseek_v3, "deepseek-v2": _deepseek_v2,
          "nllb-moe": _nllb_moe}


def _inputs(model) -> dict:
    g = torch.Generator().manual_seed(1)
    if "pixel_values" in model.main_input_name:
        return {"pixel_values": torch.randn(B, 3, 32, 32, generator=g)}
    inputs = {"input_ids": torch.randint(0, V, (B, S), generator=g)}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = torch.randint(0, V, (B, S // 2), generator=g)
    return inputs


def _layer_types(model) -> list[type]:
    """What HF's gradient checkpointing checkpoints (Swin: stages and their layers)."""
    return sorted({type(m) for m in model.modules() if isinstance(m, GradientCheckpointingLayer)},
                  key=lambda t: t.__name__)


def _hf_checkpointing(model):
    """HF's own per-layer checkpointing with torch's non-reentrant checkpoint."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _measure(model, inputs: dict) -> dict:
    """Bytes kept after forward, peak of the step above its start, gradients (the same
    dropout masks in every variant: seed 0)."""
    return step_memory(model, lambda m: m(**inputs).logits.float().square().mean())


@pytest.mark.parametrize("name", list(MODELS))
def test_per_layer_checkpointing_keeps_and_peaks_no_more_than_torch(name):
    torch.manual_seed(0)
    eager = MODELS[name]().train()
    inputs = _inputs(eager)
    types = _layer_types(eager)
    assert types, f"{name}: no checkpointable layer"
    hf = _hf_checkpointing(copy.deepcopy(eager))
    ours = ac.apply_ac(copy.deepcopy(eager), "recompute_all", modules=types, rng="replay")
    e, t, a = _measure(eager, inputs), _measure(hf, inputs), _measure(ours, inputs)
    print(f"\n  {name}: kept eager {e['kept']} torch {t['kept']} ac2 {a['kept']}; "
          f"peak eager {e['peak']} torch {t['peak']} ac2 {a['peak']}")
    for i, (x, y) in enumerate(zip(e["grads"], a["grads"])):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), f"{name}: grad {i} differs"
    assert a["kept"] <= t["kept"] < e["kept"]
    assert a["peak"] <= t["peak"]


def test_generate_with_checkpointed_layers_records_nothing():
    """HF generate() runs under no_grad: the checkpointed layers run their plain forward
    (no tracer, no policy call), and the tokens are the unwrapped model's."""
    torch.manual_seed(0)
    model = _llama().eval()
    calls = []

    def policy(ctx, op, *args, **kwargs):
        calls.append(op)
        return ac.CheckpointPolicy.PREFER_RECOMPUTE

    ours = ac.apply_ac(copy.deepcopy(model), policy, modules=_layer_types(model))
    ids = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(2))
    kwargs = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    t0 = time.process_time()
    want = model.generate(ids, **kwargs)
    t1 = time.process_time()
    got = ours.generate(ids, **kwargs)
    t2 = time.process_time()
    print(f"\n  generate CPU time: plain {t1 - t0:.3f}s, ac2-wrapped {t2 - t1:.3f}s")
    assert torch.equal(got, want)
    assert calls == []


def test_resnet_basic_layers_keep_and_peak_no_more_than_torch_checkpoint_wrapper():
    """HF ResNet (no HF checkpointing): each basic layer checkpointed by torch's
    ``checkpoint_wrapper`` and by ac2. Batch norm used to be a saved side effect (kept
    1.47x, peak 1.13x torch's); now only its running-stats update is."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    torch.manual_seed(0)
    eager = T.ResNetForImageClassification(T.ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[2, 2], layer_type="basic",
        num_labels=10)).train()
    layer = type(eager.resnet.encoder.stages[0].layers[0])
    torch_model = copy.deepcopy(eager)
    apply_activation_checkpointing(
        torch_model, check_fn=lambda m: isinstance(m, layer),
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    ours = ac.apply_ac(copy.deepcopy(eager), "recompute_all", modules=[layer])
    inputs = {"pixel_values": torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))}
    e, t, a = _measure(eager, inputs), _measure(torch_model, inputs), _measure(ours, inputs)
    print(f"\n  resnet: kept eager {e['kept']} torch {t['kept']} ac2 {a['kept']}; "
          f"peak eager {e['peak']} torch {t['peak']} ac2 {a['peak']}")
    for i, (x, y) in enumerate(zip(e["grads"], a["grads"])):
        assert torch.equal(x, y), f"grad {i} differs"
    for x, y in zip(eager.buffers(), ours.buffers()):  # running stats: updated once
        assert torch.equal(x, y)
    assert a["kept"] <= t["kept"] < e["kept"]
    assert a["peak"] <= t["peak"]


def test_bert_with_dropout_save_list_keeps_and_peaks_no_more_than_torch_sac():
    """BERT with dropout under a matmul save-list: torch's selective checkpoint (through
    HF's own switch) against ac2 with the same list. Saved values that only replays read
    (the attention scores feeding softmax and dropout) used to live until the region's
    backward ended (peak 1.034x torch SAC)."""
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = [aten.mm.default, aten.addmm.default, aten.bmm.default]
    torch.manual_seed(0)
    eager = _bert().train()
    inputs = _inputs(eager)
    sac = copy.deepcopy(eager)
    kwargs = {"use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, save)}
    enable = getattr(sac, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        sac.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    ours = ac.apply_ac(copy.deepcopy(eager), save, modules=_layer_types(eager), rng="replay")
    e, t, a = _measure(eager, inputs), _measure(sac, inputs), _measure(ours, inputs)
    print(f"\n  bert SAC: kept eager {e['kept']} torch {t['kept']} ac2 {a['kept']}; "
          f"peak eager {e['peak']} torch {t['peak']} ac2 {a['peak']}")
    for i, (x, y) in enumerate(zip(e["grads"], a["grads"])):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), f"grad {i} differs"
    assert a["kept"] <= t["kept"]
    assert a["peak"] <= t["peak"]
