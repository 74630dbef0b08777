"""ac2_dist.integrations.hf: ac2 through Hugging Face's own checkpointing switch.
Models from small configs, random weights, nothing downloaded."""

from __future__ import annotations

import copy
import sys
import warnings

import _hang
import pytest
import torch
from _dist import run_ranks

import ac2_dist as ac

T = pytest.importorskip("transformers", reason="the 'test' extra installs transformers")
from ac2_dist.integrations import hf  # noqa: E402

V = 128


def _llama(layers: int = 4):
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def _gpt2(layers: int = 3):
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=V, n_embd=64, n_layer=layers, n_head=4, n_positions=64, resid_pdrop=0.1, embd_pdrop=0.1,
        attn_pdrop=0.1))


def _ids(seed: int = 1, shape=(2, 24)) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


def _layers(model) -> list:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _is_checkpointing(model) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the alias is deprecated in transformers 5
        return model.is_gradient_checkpointing


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # the same dropout masks
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), [p.grad for p in model.parameters()]


def _assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    assert torch.equal(la, lb)
    for i, (x, y) in enumerate(zip(ga, gb)):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), f"grad {i} differs"


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_enable_matches_eager_bitwise_through_hf_switch(make):
    eager = make().train()
    model = hf.enable(copy.deepcopy(eager))
    assert _is_checkpointing(model) and hf.is_enabled(model)
    assert all(ac.is_checkpointed(layer) for layer in _layers(model))
    ids = _ids()
    _assert_same(_grads(eager, ids), _grads(model, ids))
    # HF's own path is what users switch from: same gradients there too.
    theirs = copy.deepcopy(eager)
    theirs.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _assert_same(_grads(theirs, ids), _grads(model, ids))
    assert not any(ac.is_checkpointed(layer) for layer in _layers(theirs))  # torch's, not ac2's


def test_every_n_layers_and_disable():
    eager = _llama(4).train()
    model = hf.enable(copy.deepcopy(eager), every_n_layers=2)
    assert [ac.is_checkpointed(layer) for layer in _layers(model)] == [True, False, True, False]
    ids = _ids()
    _assert_same(_grads(eager, ids), _grads(model, ids))
    hf.disable(model)
    assert not _is_checkpointing(model) and not hf.is_enabled(model)
    assert not any(ac.is_checkpointed(layer) for layer in _layers(model))
    _assert_same(_grads(eager, ids), _grads(model, ids))


def _with_switch(model, switch):
    """``model`` as an instance of a subclass whose only checkpointing switch is ``switch``
    (``gradient_checkpointing_enable``'s signature of some transformers release)."""
    cls = type(model)
    model.__class__ = type(cls.__name__, (cls,), {"activation_checkpointing_enable": None,
                                                  "gradient_checkpointing_enable": switch})
    return model


def test_every_n_layers_through_whichever_switch_takes_it():
    """transformers 5.17 has no activation_checkpointing_enable, but its
    gradient_checkpointing_enable takes every_n_layers: found by what the class offers."""
    base = type(_llama(1))
    impl = getattr(base, "_activation_checkpointing_enable", None)  # what newer releases' switches call
    calls = []

    def like_5_17(self, gradient_checkpointing_kwargs=None, every_n_layers: int = 1, offload: bool = False):
        calls.append((gradient_checkpointing_kwargs, every_n_layers))
        if impl is not None:
            impl(self, gradient_checkpointing_kwargs, every_n_layers, offload)
        else:  # transformers 5.17 itself
            base.gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=gradient_checkpointing_kwargs,
                                               every_n_layers=every_n_layers)

    eager = _llama(4).train()
    model = hf.enable(_with_switch(copy.deepcopy(eager), like_5_17), every_n_layers=2)
    assert calls == [({"use_reentrant": False}, 2)]
    assert [ac.is_checkpointed(layer) for layer in _layers(model)] == [True, False, True, False]
    ids = _ids()
    _assert_same(_grads(eager, ids), _grads(model, ids))

    def without_every_n_layers(self, gradient_checkpointing_kwargs=None):
        raise AssertionError("not called: it cannot checkpoint every second layer")

    older = _with_switch(_llama(4), without_every_n_layers)
    with pytest.raises(ValueError, match=r"every_n_layers=2 needs HF's checkpointing switch to take every_n_layers.*"
                                         r"gradient_checkpointing_enable does not.*pass every_n_layers=1"):
        hf.enable(older, every_n_layers=2)
    assert not hf.is_enabled(older)


def test_policy_and_policy_factory_reach_the_layers():
    seen = []

    def factory():
        def policy(ctx, op, *args, **kwargs):
            seen.append(op)
            return ac.CheckpointPolicy.PREFER_RECOMPUTE

        return policy

    eager = _llama(2).train()
    model = hf.enable(copy.deepcopy(eager), policy_factory=factory)
    ids = _ids()
    _assert_same(_grads(eager, ids), _grads(model, ids))
    assert seen  # the factory's policies decided the layers' ops
    saved = hf.enable(copy.deepcopy(eager), policy=[torch.ops.aten.mm.default])
    _assert_same(_grads(eager, ids), _grads(saved, ids))


def _tracked(model, ids):
    from ac2_dist import memory

    model.zero_grad(set_to_none=True)
    with memory.track(model) as tracker:
        model(input_ids=ids, labels=ids).loss.backward()
    return tracker.report()


def test_regions_carry_the_layers_names_as_after_apply_ac():
    """Under hf.enable a layer's region is named by its path in the model the user holds,
    as apply_ac names it: policies see it as ctx.module_fqn, the report's per-module rows
    and a budget's plans are keyed by it (before, every layer was one unnamed region)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    names = [f"model.layers.{i}" for i in range(3)]
    seen = set()

    def policy(ctx, op, *args, **kwargs):
        seen.add(ctx.module_fqn)
        return ac.CheckpointPolicy.PREFER_RECOMPUTE

    eager = _llama(3).train()
    ids = _ids()
    model = hf.enable(copy.deepcopy(eager), policy)
    report = _tracked(model, ids)
    assert sorted(report.per_module) == names and seen == set(names)
    assert all(report.per_module[n]["recomputed_bytes"] > 0 for n in names)
    applied = copy.deepcopy(eager)
    ac.apply_ac(applied, "recompute_all", modules=[LlamaDecoderLayer])
    reference = _tracked(applied, ids)
    assert sorted(reference.per_module) == names
    for n in names:  # the same layers keep the same bytes (what they replay differs: HF's switch
        # turns the KV cache off in training, so under apply_ac each layer also records its cache's cats)
        kept = {k: v for k, v in report.per_module[n].items() if k != "recomputed_bytes"}
        assert kept == {k: v for k, v in reference.per_module[n].items() if k != "recomputed_bytes"}, n
    # A second switch (a Trainer's gradient_checkpointing=True) keeps the names.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model.gradient_checkpointing_enable()
    assert sorted(_tracked(model, ids).per_module) == names
    budget = ac.MemoryBudget(0.5)
    planned = hf.enable(copy.deepcopy(eager), budget)
    _tracked(planned, ids)
    assert all(budget.plan(n) is not None for n in names)


def test_regions_under_a_peft_model_are_named_from_the_peft_model():
    import peft  # the test extra has it

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = hf.enable(peft.get_peft_model(_llama(2), config).train())
    assert sorted(_tracked(model, _ids()).per_module) == [f"base_model.model.model.layers.{i}" for i in range(2)]


def test_training_disables_the_cache_and_generation_is_unchanged():
    eager = _llama(2)
    model = hf.enable(copy.deepcopy(eager))
    model.train()
    out = model(input_ids=_ids(), use_cache=True)  # HF turns the cache off under checkpointing
    cache = out.past_key_values
    assert cache is None or cache.get_seq_length() == 0
    model.eval()
    eager.eval()
    prompt = _ids(3, (1, 6))
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(prompt, **kwargs), eager.generate(prompt, **kwargs))


def test_save_pretrained_and_from_pretrained(tmp_path):
    model = hf.enable(_llama(2))
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    for (n, p), (m, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(p, q)
    hf.enable(loaded).train()
    ids = _ids()
    _assert_same(_grads(model.train(), ids), _grads(loaded, ids))


def test_trainer_two_steps_match_an_unchecked_trainer(tmp_path):
    from transformers import Trainer, TrainingArguments

    data = [{"input_ids": ids, "labels": ids} for ids in _ids(5, (8, 16))]

    def run(model, name, **options):
        args = TrainingArguments(
            output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
            dataloader_num_workers=0, disable_tqdm=True, **options,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], model

    base = _llama(2)
    want, plain = run(copy.deepcopy(base), "eager")
    got, ours = run(hf.enable(copy.deepcopy(base)), "ac2")
    assert len(got) == 2 and got == want
    assert hf.is_enabled(ours)  # the Trainer kept ac2's checkpointing
    for p, q in zip(plain.parameters(), ours.parameters()):
        assert torch.equal(p, q)
    # The Trainer's own switch would put torch's checkpoint back: ac2 is kept, with one warning.
    with pytest.warns(UserWarning, match=r"was called after hf.enable .* so ac2's is kept") as caught:
        again, switched = run(hf.enable(copy.deepcopy(base)), "switched", gradient_checkpointing=True)
    assert sum("was called after hf.enable" in str(w.message) for w in caught) == 1
    assert hf.is_enabled(switched) and _is_checkpointing(switched) and again == want
    hf.disable(switched)
    assert "activation_checkpointing_enable" not in switched.__dict__


class _NoCheckpointing(T.LlamaForCausalLM):
    supports_gradient_checkpointing = False


def test_bad_input_is_named():
    with pytest.raises(TypeError, match=r"model must be a transformers.PreTrainedModel \(or a PEFT model around one\), got Linear"):
        hf.enable(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model must be a transformers.PreTrainedModel"):
        hf.disable("model")
    with pytest.raises(ValueError, match="_NoCheckpointing has no checkpointable layers"):
        hf.enable(_NoCheckpointing(_llama(1).config))
    with pytest.raises(TypeError, match="pass either policy or policy_factory"):
        hf.enable(_llama(1), policy="recompute_all", policy_factory=lambda: "recompute_all")
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['replay_stream'\]"):
        hf.enable(_llama(1), replay_stream="inline")
    with pytest.raises(ValueError, match="every_n_layers must be an int >= 1"):
        hf.enable(_llama(1), every_n_layers=0)
    with pytest.raises(ValueError, match="unknown policy string"):
        hf.enable(_llama(1), policy="save_some")


def test_peft_model_is_accepted_and_lora_grads_match_eager():
    import peft  # the test extra has it
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    eager = peft.get_peft_model(_llama(2), config).train()
    model = copy.deepcopy(eager)
    assert hf.enable(model) is model
    assert hf.is_enabled(model) and _is_checkpointing(model.get_base_model())
    ids = _ids()
    _assert_same(_grads(eager, ids), _grads(model, ids))
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    assert hf.disable(model) is model
    assert not hf.is_enabled(model) and not _is_checkpointing(model.get_base_model())


@pytest.mark.parametrize("name", ["activation_checkpointing_enable", "gradient_checkpointing_enable"])
def test_enable_from_an_instance_override_of_hfs_switch(name):
    """Trainer's switch selects ac2 when the switch is overridden on the instance: no recursion."""
    if not hasattr(T.PreTrainedModel, name):
        pytest.skip(f"transformers {T.__version__} has no {name}")
    eager = _llama(2).train()
    model = copy.deepcopy(eager)
    calls = []

    def override(*args, **kwargs):
        calls.append(kwargs)
        return hf.enable(model, policy=[torch.ops.aten.mm.default])

    setattr(model, name, override)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated alias
        getattr(model, name)()
    assert len(calls) == 1 and hf.is_enabled(model)
    assert getattr(model, name) is override  # the instance's override is back in place
    ids = _ids()
    _assert_same(_grads(eager, ids), _grads(model, ids))
    hf.disable(model)
    assert not hf.is_enabled(model)


def test_importing_ac2_dist_never_imports_transformers():
    code = "import sys, ac2_dist, ac2_dist.integrations; print('transformers' in sys.modules)"
    out = _hang.run([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


# ---- FSDP2 on 2 ranks ---------------------------------------------------------------------


def _fsdp_losses(rank, world, use_ac):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _llama(2).train()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if use_ac:
        hf.enable(model)
        assert all(ac.is_checkpointed(layer) for layer in model.model.layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        ids = _ids(10 * step + rank, (2, 16))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _both(rank, world):
    return {"ac2": _fsdp_losses(rank, world, True), "none": _fsdp_losses(rank, world, False)}


def test_fsdp2_with_hf_enable_matches_no_ac_losses():
    results = run_ranks(_both)
    for rank, r in enumerate(results):
        print(f"\n  rank {rank}: losses ac2 {r['ac2']} no AC {r['none']}")
        assert r["ac2"] == r["none"]


def test_model_code_calling_torchs_checkpoint_is_named_and_not_claimed():
    """CLVP's conditioning encoder calls torch.utils.checkpoint.checkpoint in its own
    forward: hf.enable cannot reach those calls. It warns naming the module, and
    is_enabled does not claim the model is ac2's while they are on."""
    cfg = T.ClvpConfig()
    for c in (cfg.text_config, cfg.speech_config):
        c.hidden_size, c.intermediate_size, c.num_attention_heads, c.projection_dim = 32, 64, 2, 16
        c.num_hidden_layers = 1
    cfg.decoder_config.hidden_size, cfg.decoder_config.num_attention_heads = 32, 2
    cfg.decoder_config.num_hidden_layers = 1
    model = T.ClvpModelForConditionalGeneration(cfg)
    with pytest.warns(UserWarning, match=r"conditioning_encoder.*stay torch's checkpoint"):
        hf.enable(model)
    assert hf.torch_checkpointed(model) == ["conditioning_encoder"]
    assert not hf.is_enabled(model)
    hf.disable(model)
    assert hf.torch_checkpointed(model) == []

    llama = _llama(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a model HF's switch reaches fully
        hf.enable(llama)
    assert hf.is_enabled(llama) and hf.torch_checkpointed(llama) == []
