"""Policy forms, ctx, nesting resolution, tagging, SAVE_WITH_HOOKS and CPU offload."""

from __future__ import annotations

import pytest
import torch
from _models import OpCounter
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, SelectiveCheckpointContext

import ac2_dist as ac

aten = torch.ops.aten
CP = CheckpointPolicy


def _chain(x):
    # Backward formulas of these ops use their outputs, never call sin/tanh/sigmoid,
    # so any sin/tanh/sigmoid running in backward is a replay.
    return x.sin().tanh().sigmoid().exp().sum()


def _eager_grad(x, fn=_chain):
    x = x.detach().requires_grad_()
    fn(x).backward()
    return x.grad


def _backward_ops(policy, fn=_chain, **region_kwargs):
    x = torch.randn(4, 4, requires_grad=True)
    with ac.apply_ac_policy(policy, **region_kwargs):
        y = fn(x)
    with OpCounter() as counter:
        y.backward()
    assert torch.equal(x.grad, _eager_grad(x, fn))
    return counter


def test_public_api_surface():
    assert ac.CheckpointPolicy is CheckpointPolicy
    for name in ["apply_ac_policy", "apply_ac_policy_fn", "tag_with_policy", "SAVE_WITH_HOOKS", "is_checkpoint_enabled"]:
        assert hasattr(ac, name)
    assert ac.apply_ac_policy.__doc__ and "policy" in ac.apply_ac_policy.__doc__


def test_string_policies_recompute_or_save():
    counter = _backward_ops("recompute_all")
    assert [counter[f"aten.{n}"] for n in ("sin", "tanh", "sigmoid", "exp")] == [1, 1, 1, 1]
    counter = _backward_ops("must_save_all")
    assert [counter[f"aten.{n}"] for n in ("sin", "tanh", "sigmoid", "exp")] == [0, 0, 0, 0]


def test_save_list_policy_accepts_overloads_and_packets():
    counter = _backward_ops([aten.sin.default])
    assert counter["aten.sin"] == 0 and counter["aten.tanh"] == 1
    counter = _backward_ops({aten.tanh})  # OpOverloadPacket saves every overload
    # tanh's output is saved, so nothing upstream of it is needed any more.
    assert counter["aten.sin"] == 0 and counter["aten.tanh"] == 0 and counter["aten.sigmoid"] == 1


@pytest.mark.parametrize(
    ("policy", "replayed"),
    [(True, 0), (False, 1), (CP.MUST_SAVE, 0), (CP.PREFER_RECOMPUTE, 1), ("MUST_CPU_OFFLOAD", 0)],
)
def test_constant_region_policies(policy, replayed):
    if isinstance(policy, str):
        policy = _offload(policy)
    counter = _backward_ops(policy)
    assert counter["aten.sin"] == replayed and counter["aten.tanh"] == replayed


def test_bool_policy_maps_true_to_save():
    counter = _backward_ops(lambda ctx, op, *a, **k: op is aten.tanh.default)
    assert counter["aten.tanh"] == 0 and counter["aten.sigmoid"] == 1


def test_policy_ctx_and_call_count():
    seen = []

    def policy(ctx, op, *args, **kwargs):
        assert isinstance(ctx, SelectiveCheckpointContext)
        assert ctx.is_recompute is False
        assert isinstance(ctx.op_output, torch.Tensor)
        seen.append((op, ctx.module_fqn, ctx.rank))
        return CP.PREFER_RECOMPUTE

    x = torch.randn(4, 4, requires_grad=True)
    with ac.apply_ac_policy(policy, module_fqn="layers.0"):
        y = (x.sin() + x.sin().detach().cos()).sum()
    y.backward()
    ops = [op for op, _, _ in seen]
    # Called once per op in forward, never during recompute; detach is never asked.
    assert ops == [aten.sin.default, aten.sin.default, aten.cos.default, aten.add.Tensor, aten.sum.default]
    assert not any(op in SAC_IGNORED_OPS for op in ops)
    assert all(fqn == "layers.0" and rank == 0 for _, fqn, rank in seen)


def test_invalid_policies_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown policy string"):
        ac.apply_ac_policy("recompute_some")
    with pytest.raises(ValueError, match="rng"):
        ac.apply_ac_policy("recompute_all", rng="sometimes")
    with pytest.raises(TypeError, match="OpOverload"):
        ac.apply_ac_policy(["aten.mm"])
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match=r"returned 'save'.*aten.sin"):
        with ac.apply_ac_policy(lambda ctx, op, *a, **k: "save"):
            x.sin()
    assert not ac.is_checkpoint_enabled()


@pytest.mark.parametrize(
    ("outer", "inner", "expect_saved"),
    [
        (CP.PREFER_RECOMPUTE, CP.PREFER_SAVE, True),  # inner PREFER wins over outer PREFER
        (CP.PREFER_SAVE, CP.PREFER_RECOMPUTE, False),
        (CP.MUST_SAVE, CP.PREFER_RECOMPUTE, True),  # MUST never overridden by PREFER
        (CP.MUST_RECOMPUTE, CP.PREFER_SAVE, False),
        (CP.PREFER_RECOMPUTE, CP.MUST_SAVE, True),
        (CP.MUST_SAVE, CP.MUST_SAVE, True),  # same MUST agrees
        (False, True, True),  # bools: False -> PREFER_RECOMPUTE, True -> MUST_SAVE
        (True, False, True),
    ],
)
def test_nesting_resolution(outer, inner, expect_saved):
    def only_sin(result):
        return lambda ctx, op, *a, **k: result if op is aten.sin.default else CP.PREFER_RECOMPUTE

    with ac.apply_ac_policy(only_sin(outer)):
        counter = _backward_ops(only_sin(inner))
    assert counter["aten.sin"] == (0 if expect_saved else 1)


def test_conflicting_musts_name_both_policies_and_op():
    def outer_policy(ctx, op, *a, **k):
        return CP.MUST_SAVE

    def inner_policy(ctx, op, *a, **k):
        return CP.MUST_RECOMPUTE

    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError) as info:
        with ac.apply_ac_policy(outer_policy):
            with ac.apply_ac_policy(inner_policy):
                x.sin()
    msg = str(info.value)
    assert "outer_policy" in msg and "inner_policy" in msg and "aten.sin" in msg
    assert not ac.is_checkpoint_enabled()


def test_must_recompute_of_side_effect_is_an_error():
    x = torch.randn(4)
    with pytest.raises(RuntimeError, match=r"MUST_RECOMPUTE for aten.add_.Tensor.*mutation"):
        with ac.apply_ac_policy(lambda ctx, op, *a, **k: CP.MUST_RECOMPUTE):
            x.add_(1)  # writes a region input: a side effect
    # A write to a value the region created is replayable (Note [Replaying writes to
    # fresh tensors]), so it may be MUST_RECOMPUTE.
    with ac.apply_ac_policy(lambda ctx, op, *a, **k: CP.MUST_RECOMPUTE):
        y = x * 2
        y.add_(1)
    with pytest.raises(RuntimeError, match=r"aten.rand.default, which is a rng op.*rng='replay'"):
        with ac.apply_ac_policy(lambda ctx, op, *a, **k: CP.MUST_RECOMPUTE):
            torch.rand(3)
    # With rng="replay" a random op may be recomputed.
    with ac.apply_ac_policy(lambda ctx, op, *a, **k: CP.MUST_RECOMPUTE, rng="replay"):
        torch.rand(3)


def test_tag_with_policy_saves_one_tensor():
    def fn(x):
        a = x.sin()
        assert ac.tag_with_policy(a, CP.MUST_SAVE) is a
        b = a.tanh()
        ac.tag_with_policy(b, True)
        return b.sigmoid().exp().sum()

    counter = _backward_ops("recompute_all", fn)
    assert counter["aten.sin"] == 0 and counter["aten.tanh"] == 0 and counter["aten.sigmoid"] == 1


def test_tag_with_policy_rejects_recompute_and_is_a_noop_outside_regions():
    x = torch.randn(3)
    assert ac.tag_with_policy(x) is x
    with pytest.raises(ValueError, match="not a save policy"):
        ac.tag_with_policy(x, CP.MUST_RECOMPUTE)
    with ac.apply_ac_policy("must_save_all"):
        with pytest.raises(ValueError, match="not a save policy"):
            ac.tag_with_policy(x.sin(), CP.PREFER_RECOMPUTE)


def test_save_with_hooks_policy_and_tag():
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.shape)
        return t.clone()  # a CPU -> CPU "offload"

    def unpack(t):
        unpacked.append(t.shape)
        return t

    hooks = ac.SAVE_WITH_HOOKS(pack, unpack)
    counter = _backward_ops(lambda ctx, op, *a, **k: hooks if op is aten.sin.default else CP.PREFER_RECOMPUTE)
    assert counter["aten.sin"] == 0 and counter["aten.tanh"] == 1
    assert len(packed) == 1 and len(unpacked) == 1

    def fn(x):
        s = x.sin()
        ac.tag_with_policy(s, hooks)
        return s.tanh().sigmoid().exp().sum()

    counter = _backward_ops("recompute_all", fn)
    assert counter["aten.sin"] == 0 and len(packed) == 2 and len(unpacked) == 2
    with pytest.raises(TypeError):
        ac.SAVE_WITH_HOOKS(pack, None)


def _offload(name):
    """A CPU-offload member of CheckpointPolicy (torch >= 2.11; Note [Supported torch versions])."""
    if not hasattr(CP, name):
        pytest.skip(f"CheckpointPolicy.{name} does not exist in torch {torch.__version__}")
    return getattr(CP, name)


@pytest.mark.parametrize("name", ["MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"])
def test_cpu_offload_policies_are_saves(name):
    policy = _offload(name)
    counter = _backward_ops(lambda ctx, op, *a, **k: policy if op is aten.sin.default else CP.PREFER_RECOMPUTE)
    assert counter["aten.sin"] == 0 and counter["aten.tanh"] == 1


def test_apply_ac_policy_fn_and_is_checkpoint_enabled():
    x = torch.randn(4, 4, requires_grad=True)
    states = []

    def fn(x, scale=1.0):
        states.append(ac.is_checkpoint_enabled())
        return (x.sin() * scale).sum()

    assert not ac.is_checkpoint_enabled()
    y = ac.apply_ac_policy_fn(fn, x, policy_fn=[aten.sin.default], scale=2.0)
    assert states == [True] and not ac.is_checkpoint_enabled()
    y.backward()
    assert torch.equal(x.grad, 2.0 * x.cos())
