"""Real models: gradients under every policy form are bitwise equal to eager on CPU."""

from __future__ import annotations

import pytest
import torch
from _models import GPT, MLP, ConvBN, DropoutMLP, OpCounter, assert_bitwise, grads_of, twin
from torch.utils.checkpoint import CheckpointPolicy

import ac2_dist as ac

aten = torch.ops.aten
SAVE_MM = [aten.mm.default, aten.addmm.default]


def torch_style_sac(ctx, op, *args, **kwargs):
    if op in (aten.mm.default, aten.addmm.default, aten._scaled_dot_product_flash_attention_for_cpu.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def bool_policy(ctx, op, *args, **kwargs):
    return op is aten.addmm.default


POLICIES = {
    "recompute_all": "recompute_all",
    "must_save_all": "must_save_all",
    "save_list": SAVE_MM,
    "torch_sac": torch_style_sac,
    "bool": bool_policy,
}


def _under(policy, model, x):
    with ac.apply_ac_policy(policy):
        return model(x)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_grads_bitwise(kind, policy):
    torch.manual_seed(0)
    if kind == "mlp":
        model, x = MLP(), torch.randn(8, 32, requires_grad=True)
    else:
        model, x = GPT(layers=2), torch.randn(2, 16, 32, requires_grad=True)
    ref = grads_of(model, lambda m: m(x).pow(2).sum(), x)
    got = grads_of(model, lambda m: _under(POLICIES[policy], m, x).pow(2).sum(), x)
    assert_bitwise(ref, got)


def test_nested_policies_gpt():
    torch.manual_seed(0)
    model, x = GPT(layers=2), torch.randn(2, 16, 32, requires_grad=True)
    ref = grads_of(model, lambda m: m(x).sum(), x)

    def run(m):
        with ac.apply_ac_policy("recompute_all"):
            h = x
            for blk in m.blocks:
                with ac.apply_ac_policy(SAVE_MM):
                    h = blk(h)
            return m.norm(h).sum()

    assert_bitwise(ref, grads_of(model, run, x))


def test_per_block_regions_recompute_from_nearest_save():
    """SAC saves matmuls, so replays start there: fewer ops than recompute_all."""
    torch.manual_seed(0)
    model, x = GPT(layers=1), torch.randn(2, 16, 32, requires_grad=True)
    counts = {}
    for name, pol in [("full", "recompute_all"), ("sac", SAVE_MM)]:
        with ac.apply_ac_policy(pol) as region:
            y = model(x)
        y.sum().backward()
        counts[name] = region.stats.recomputed_ops
    assert 0 < counts["sac"] < counts["full"]


@pytest.mark.parametrize("policy", ["recompute_all", "save_list", "torch_sac"])
def test_conv_batchnorm_running_stats_updated_once(policy):
    torch.manual_seed(0)
    model = ConvBN()
    ref_model = twin(model)
    x = torch.randn(4, 3, 16, 16)
    ref = grads_of(ref_model, lambda m: m(x).sum())
    got = grads_of(model, lambda m: _under(POLICIES[policy], m, x).sum())
    assert_bitwise(ref, got)
    for bn, ref_bn in [(model.bn1, ref_model.bn1), (model.bn2, ref_model.bn2)]:
        assert torch.equal(bn.running_mean, ref_bn.running_mean)
        assert torch.equal(bn.running_var, ref_bn.running_var)
        assert bn.num_batches_tracked.item() == 1


@pytest.mark.parametrize("train", [True, False])
def test_batchnorm_recomputed_running_stats_updated_once(train):
    """Batch norm is recomputed in both modes; in training mode the running-stats update
    is the side effect: done once, in forward, never by the replay (which writes scratch
    buffers: Note [Statistics an op accumulates])."""
    torch.manual_seed(0)
    model = ConvBN().train(train)
    ref_model = twin(model)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    ref = grads_of(ref_model, lambda m: m(x).sum(), x)
    with ac.apply_ac_policy("recompute_all"):
        y = model(x)
    stats = [t.clone() for t in model.buffers()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    with OpCounter() as counter:
        y.sum().backward()
    assert counter["aten.native_batch_norm"] == 2
    assert counter["aten.convolution"] == 2  # recomputed (the second conv feeds BN backward)
    assert_bitwise(ref, [p.grad for p in model.parameters()] + [x.grad])
    assert_bitwise(stats, list(model.buffers()))  # backward wrote no running statistic
    assert_bitwise(list(ref_model.buffers()), list(model.buffers()))  # forward: once, as eager


@pytest.mark.parametrize("rng", ["save", "replay"])
@pytest.mark.parametrize("policy", ["recompute_all", "save_list"])
def test_dropout_masks_match_eager(rng, policy):
    torch.manual_seed(0)
    model, x = DropoutMLP(), torch.randn(16, 32, requires_grad=True)

    def eager(m):
        torch.manual_seed(123)
        return m(x).sum()

    def checkpointed(m):
        torch.manual_seed(123)
        with ac.apply_ac_policy(POLICIES[policy], rng=rng):
            return m(x).sum()

    ref = grads_of(model, eager, x)
    # A different global RNG state in backward must not matter either way.
    got = grads_of(model, lambda m: (lambda y: (torch.rand(7), y)[1])(checkpointed(m)), x)
    assert_bitwise(ref, got)


def test_gpt_with_attention_dropout_rng_replay():
    torch.manual_seed(0)
    model, x = GPT(layers=2, dropout=0.2), torch.randn(2, 16, 32, requires_grad=True)

    def run(m, region):
        torch.manual_seed(7)
        if region is None:
            return m(x).sum()
        with ac.apply_ac_policy("recompute_all", rng=region):
            return m(x).sum()

    ref = grads_of(model, lambda m: run(m, None), x)
    for rng in ("save", "replay"):
        assert_bitwise(ref, grads_of(model, lambda m, r=rng: run(m, r), x))


def test_autocast_bf16_cpu():
    torch.manual_seed(0)
    model, x = GPT(layers=2), torch.randn(2, 16, 32, requires_grad=True)

    def eager(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x).float().sum()

    def checkpointed(m):
        with torch.autocast("cpu", dtype=torch.bfloat16), ac.apply_ac_policy("recompute_all"):
            return m(x).float().sum()

    ref = grads_of(model, eager, x)
    assert_bitwise(ref, grads_of(model, checkpointed, x))

    # Backward run *inside* an autocast block: replays must not be re-autocast.
    def backward_in_autocast(m):
        m.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with ac.apply_ac_policy("recompute_all"):
                y = m(x).float().sum()
            y.backward()
        return [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]

    assert_bitwise(ref, backward_in_autocast(model))


def test_two_training_steps_with_optimizer():
    torch.manual_seed(0)
    model = GPT(layers=2)
    ref_model = twin(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    for step in range(2):
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(step))
        ref_opt.zero_grad()
        ref_model(x).pow(2).mean().backward()
        ref_opt.step()
        opt.zero_grad()
        with ac.apply_ac_policy(torch_style_sac):
            loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
