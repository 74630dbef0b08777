"""Frameworks' own checkpointing entry points run by ac2 through
``integrations.torch_checkpoint`` (issue 20): per framework its real entry point on a small
model; ac2 ran (the checkpointed layer's Python runs once per step, torch's runs it twice),
parameters bitwise equal to the framework's own checkpointing after 3 steps, kept memory at
most theirs."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T  # noqa: E402  (the test extra)
from _models import step_memory

from ac2_dist.integrations import torch_checkpoint as switch


def _forward_counter(modules) -> list[int]:
    """Counts forward calls of ``modules`` (pre-hooks fire in torch's recompute too)."""
    count = [0]

    def hook(module, args):
        count[0] += 1

    for m in modules:
        m.register_forward_pre_hook(hook)
    return count


# ---- HF Trainer ------------------------------------------------------------------------------

V = 128


def _llama(layers: int = 2):
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1))


def _trainer_run(model, out, use_switch: bool, **options):
    from transformers import Trainer, TrainingArguments

    data = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, V, (12, 16), generator=torch.Generator().manual_seed(5))]
    args = TrainingArguments(
        output_dir=str(out), max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        data_seed=0, dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=True, **options,
    )
    layers = model.get_base_model().model.layers if hasattr(model, "get_base_model") else model.model.layers
    calls = _forward_counter(layer.mlp for layer in layers)  # inside the checkpointed forward
    trainer = Trainer(model=model, args=args, train_dataset=data)
    if use_switch:
        with switch.enabled():
            trainer.train()
    else:
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, calls[0]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "peft-lora"])
def test_hf_trainer_gradient_checkpointing_runs_ac2_under_the_switch(tmp_path, lora):
    base = _llama()
    if lora:
        import peft

        base = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                         lora_dropout=0.1))
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
    want, torch_calls = _trainer_run(theirs, tmp_path / "torch", use_switch=False,
                                     gradient_checkpointing_kwargs={"use_reentrant": False})
    got, ac2_calls = _trainer_run(ours, tmp_path / "ac2", use_switch=True,
                                  gradient_checkpointing_kwargs={"use_reentrant": False})
    layers, micro = 2, 3 * 2  # 3 optimizer steps x 2 accumulated microbatches
    assert torch_calls == 2 * layers * micro  # torch's checkpoint re-runs each layer's Python
    assert ac2_calls == layers * micro  # ac2 runs it once
    assert got == want
    for (n, p), q in zip(theirs.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), n

    # kept memory of one training step: ac2 (switch) vs HF's own torch checkpoint
    ids = torch.randint(0, V, (4, 32), generator=torch.Generator().manual_seed(9))
    theirs.train()
    ours.train()

    def loss(m):
        return m(input_ids=ids, labels=ids).loss

    torch_side = step_memory(theirs, loss, seed=1)
    with switch.enabled():
        ac2_side = step_memory(ours, loss, seed=1)
    print(f"\n  trainer {'lora' if lora else 'full'}: kept torch {torch_side['kept']} ac2 {ac2_side['kept']}; "
          f"peak torch {torch_side['peak']} ac2 {ac2_side['peak']}")
    assert ac2_side["kept"] <= torch_side["kept"]
