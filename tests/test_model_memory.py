"""Memory on model shapes where ac2 used to keep more than torch.utils.checkpoint:
dropout masks, values produced in place, nested checkpointed modules; and regions
that cost nothing without grad. Every figure is compared with torch's, measured in
the same test from the allocator's own events; every gradient with eager's."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from _models import assert_bitwise, step_memory
from models import GPTBlock, MLPLayer, Stage
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ac2_dist as ac

aten = torch.ops.aten


def _measure(model: nn.Module, x: torch.Tensor, seed: int = 0) -> dict:
    """Bytes kept after forward and backward peak (above the step's start); grads."""
    x = x.detach().requires_grad_()
    return step_memory(model, lambda m: m(x).square().mean(), seed, extra=(x,))


def _torch_ckpt(module: nn.Module) -> nn.Module:
    module.forward = functools.partial(torch_checkpoint, module.forward, use_reentrant=False)
    return module


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _compare(make, block_type, x, *, rng="save", slack_tensors=1):
    """eager / torch per-block checkpoint / ac2 per-block: figures and grads."""
    eager = make()
    tm = _torch_ckpt_blocks(copy.deepcopy(eager), block_type)
    am = ac.apply_ac(copy.deepcopy(eager), "recompute_all", modules=[block_type], rng=rng)
    e, t, a = _measure(eager, x), _measure(tm, x), _measure(am, x)
    boundary = slack_tensors * x.numel() * x.element_size()
    return e, t, a, boundary


def _torch_ckpt_blocks(model: nn.Module, block_type: type) -> nn.Module:
    for m in model.modules():
        if isinstance(m, block_type):
            _torch_ckpt(m)
    return model


def _report(name, e, t, a):
    print(f"\n  {name}: kept eager {e['kept']} torch {t['kept']} ac2 {a['kept']}; "
          f"peak eager {e['peak']} torch {t['peak']} ac2 {a['peak']}")


# ---- dropout -----------------------------------------------------------------------------


def test_dropout_masks_are_replayed_not_kept():
    torch.manual_seed(0)
    x = torch.randn(2, 32, 64)
    e, t, a, boundary = _compare(lambda: _Stack([GPTBlock(64, 4, dropout=0.1) for _ in range(3)]),
                                 GPTBlock, x, rng="replay")
    _report("GPT dropout 0.1", e, t, a)
    assert_bitwise(e["grads"], a["grads"])  # same masks in forward and in the replay
    assert a["kept"] <= t["kept"] + boundary
    assert a["peak"] <= t["peak"]


def test_dropout_replayed_mask_is_bitwise_the_forward_mask():
    drop = nn.Dropout(0.5)
    x = torch.randn(64, 64, requires_grad=True)
    torch.manual_seed(3)
    with ac.apply_ac_policy("recompute_all", rng="replay") as region:
        y = (drop(x.tanh()) * 3).sum()
    with torch.no_grad():
        torch.rand(100)  # the generator moves on before backward
    y.backward()
    xr = x.detach().requires_grad_()
    torch.manual_seed(3)
    (drop(xr.tanh()) * 3).sum().backward()
    assert torch.equal(x.grad, xr.grad)  # grad = mask * scale * 3 * tanh'
    assert region.stats.recomputed_ops >= 2  # the mask was regenerated, not kept


# ---- values produced in place ------------------------------------------------------------


class _InplaceExpert(nn.Module):
    """HF MoE-expert shape: a matmul result gets its bias added in place."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(d, 2 * d) / d**0.5)
        self.b1 = nn.Parameter(torch.randn(2 * d))
        self.w2 = nn.Parameter(torch.randn(2 * d, d) / d**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.matmul(x, self.w1)
        h.add_(self.b1)
        h = torch.relu_(h)  # relu_ on a fresh value
        out = torch.matmul(h, self.w2)
        out.mul_(0.5)
        return x + out


def test_inplace_results_are_recomputed_not_kept():
    torch.manual_seed(0)
    x = torch.randn(4, 32, 64)
    e, t, a, boundary = _compare(lambda: _Stack([_InplaceExpert() for _ in range(3)]), _InplaceExpert, x)
    _report("in-place expert", e, t, a)
    assert_bitwise(e["grads"], a["grads"])
    assert a["kept"] <= t["kept"] + boundary
    assert a["peak"] <= t["peak"]


def test_inplace_write_replays_from_a_clone_when_the_old_value_is_needed():
    x = torch.randn(8, 8, requires_grad=True)

    def fn(x):
        h = x @ x
        s = h.sigmoid()  # reads h before the write ...
        h.mul_(2)  # ... which is a fresh write
        return (h.tanh() * s).sum()

    with ac.apply_ac_policy("recompute_all") as region:
        y = fn(x)
    y.backward()
    xr = x.detach().requires_grad_()
    fn(xr).backward()
    assert torch.equal(x.grad, xr.grad)
    assert region.stats.recomputed_ops > 0


def test_side_effect_writes_stay_never_replayed():
    """Writes to a region input, a parameter's view or BN running stats are not replayed."""
    bn = nn.BatchNorm1d(8)
    x = torch.randn(16, 8, requires_grad=True)
    buf = torch.zeros(16, 8)
    with ac.apply_ac_policy("recompute_all"):
        h = bn(x * 2)
        buf.add_(h.detach())  # a region input written: side effect
        y = (h.tanh() + buf).sum()
    stats = bn.running_mean.clone()
    y.backward()
    assert torch.equal(bn.running_mean, stats)  # not updated again by a replay
    assert bn.num_batches_tracked.item() == 1


# ---- nested checkpointed modules ---------------------------------------------------------


# launch/models.py: Stage (HF Swin's shape: the stage and each of its layers checkpointed)
# of residual MLPLayers.


def test_nested_checkpointed_modules_bound_the_peak_like_torch():
    torch.manual_seed(0)
    x = torch.randn(4, 64, 64)
    eager = _Stack([Stage(64, 4) for _ in range(2)])
    tm = copy.deepcopy(eager)
    for m in tm.modules():
        if isinstance(m, (Stage, MLPLayer)):
            _torch_ckpt(m)
    am = ac.apply_ac(copy.deepcopy(eager), "recompute_all", modules=[Stage, MLPLayer])
    e, t, a = _measure(eager, x), _measure(tm, x), _measure(am, x)
    _report("nested stage/layer", e, t, a)
    assert_bitwise(e["grads"], a["grads"])
    assert a["kept"] <= t["kept"] + x.numel() * 4
    assert a["peak"] <= t["peak"]
    assert a["peak"] < 0.7 * e["peak"]  # and well below no checkpointing


def test_nested_cut_with_retained_second_backward():
    torch.manual_seed(0)
    model = ac.apply_ac(Stage(16, 3), "recompute_all", modules=[Stage, MLPLayer])
    ref = copy.deepcopy(model)
    for m in ref.modules():
        ac.unwrap(m)
    x = torch.randn(4, 16, requires_grad=True)
    params = [x, *model.parameters()]
    y = model(x).square().sum()
    g1 = torch.autograd.grad(y, params, retain_graph=True)
    g2 = torch.autograd.grad(y, params)
    want = torch.autograd.grad(ref(x).square().sum(), [x, *ref.parameters()])
    assert_bitwise(list(want), list(g1))
    assert_bitwise(list(want), list(g2))


# ---- no grad: nothing recorded -----------------------------------------------------------


def test_generate_like_no_grad_loop_records_nothing():
    torch.manual_seed(0)
    model = _Stack([GPTBlock(32, 4) for _ in range(2)]).eval()
    calls = []

    def policy(ctx, op, *args, **kwargs):
        calls.append(op)
        return ac.CheckpointPolicy.PREFER_RECOMPUTE

    ac.apply_ac(model, policy, modules=[GPTBlock])
    x = torch.randn(1, 4, 32)
    with torch.no_grad():
        for _ in range(5):  # a decoding loop: grow the sequence by one step
            y = model(x)
            x = torch.cat([x, y[:, -1:]], dim=1)
    assert calls == []  # the tracer never ran


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_no_grad_region_installs_nothing(ctx):
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    with ctx(), ac.apply_ac_policy("recompute_all") as region:
        assert not _get_current_dispatch_mode_stack()
        assert not torch.nn.modules.module._global_forward_hooks
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        assert ac.is_checkpoint_enabled()
    assert region.graph is None


def test_replayed_dropout_graph_is_freed_by_refcount():
    import gc
    import weakref

    drop = nn.Dropout(0.3)
    x = torch.randn(16, 16, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        with ac.apply_ac_policy("recompute_all", rng="replay") as region:
            y = drop(drop(x.sin()).cos()).sum()
        ref = weakref.ref(region.graph)
        y.backward()
        del y, region
        assert ref() is None  # no cycle through the RNG chain keeps saved values alive
    finally:
        gc.enable()


# ---- batch norm: the running-stats update is the side effect, not the op -------------------


class _LinearBN(nn.Module):
    """Linear -> BatchNorm1d -> Linear (BN's output is the activation that matters)."""

    def __init__(self, d: int = 256, track: bool = True) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d, track_running_stats=track)
        self.b = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.bn(self.a(x)))


@pytest.mark.parametrize("track", [True, False], ids=["running_stats", "no_stats"])
def test_batchnorm_output_is_recomputed_not_kept(track):
    """Two Linear->BN->Linear blocks: ac2 used to keep every BN output (training-mode BN
    was a saved side effect, even without running stats): kept 4.00 vs 2.01 MiB. Now
    the op replays with scratch statistics; the running stats are updated once."""
    torch.manual_seed(0)
    x = torch.randn(1024, 256)
    e, t, a, _ = _compare(lambda: _Stack([_LinearBN(track=track) for _ in range(2)]), _LinearBN, x)
    _report(f"Linear-BN-Linear x2 (track_running_stats={track})", e, t, a)
    assert_bitwise(e["grads"], a["grads"])
    assert a["kept"] <= t["kept"]
    assert a["peak"] <= t["peak"]


def test_batchnorm_running_stats_match_eager_after_steps():
    torch.manual_seed(0)
    eager = _Stack([_LinearBN(64) for _ in range(2)])
    ours = ac.apply_ac(copy.deepcopy(eager), "recompute_all", modules=[_LinearBN])
    for step in range(3):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        for m in (eager, ours):
            m(x).square().mean().backward()
    assert_bitwise(list(eager.buffers()), list(ours.buffers()))  # stats updated once per step
    assert_bitwise([p.grad for p in eager.parameters()], [p.grad for p in ours.parameters()])


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_variants_with_declared_or_hidden_stat_writes(training):
    """``_native_batch_norm_legit`` declares its stat writes (a!), ``batch_norm_update_stats``
    (SyncBatchNorm's building block) hides them: recomputed while they accumulate,
    statistics written once; eval-mode legit BN (which bumps the stats' versions) stays
    a saved side effect."""
    x = torch.randn(16, 8)
    w = torch.randn(8, requires_grad=True)

    def fn(x, w, rm, rv):
        out = torch.ops.aten._native_batch_norm_legit(x.tanh(), w, None, rm, rv, training, 0.1, 1e-5)[0]
        mean, var = torch.batch_norm_update_stats(out.detach(), rm, rv, 0.1)  # no derivative
        return (out.sin() * var).sum() + mean.sum()

    stats = []
    grads = []
    for checkpointed in (False, True):
        rm, rv = torch.zeros(8), torch.ones(8)
        xr, wr = x.clone().requires_grad_(), w.detach().requires_grad_()
        if checkpointed:
            with ac.apply_ac_policy("recompute_all") as region:
                y = fn(xr, wr, rm, rv)
        else:
            y = fn(xr, wr, rm, rv)
        y.backward()
        stats.append([rm, rv])
        grads.append([xr.grad, wr.grad])
    assert_bitwise(stats[0], stats[1])
    assert_bitwise(grads[0], grads[1])
    legit = aten._native_batch_norm_legit.default
    replayed = region.stats.recomputed_ops
    assert replayed >= (3 if training else 2), replayed  # tanh (+ the legit op) + update_stats
    assert ac.side_effects.op_info(legit).accumulates((x, w, None, None, None, training)) is training


# ---- a fresh buffer filled through views of it ------------------------------------------------


class _SliceFilled(nn.Module):
    """HF DeepSeek-V3's key layout: ``kv = a.new_empty(..); kv[..., :d].copy_(a);
    kv[..., d:].copy_(b)``, then read as a whole."""

    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x * self.w
        kv = a.new_empty(*x.shape[:-1], 2 * x.shape[-1])
        kv[..., : x.shape[-1]].copy_(a)
        kv[..., x.shape[-1]:].copy_(x.sin())
        return (kv * kv).tanh()


def test_buffer_filled_through_slices_is_recomputed_not_kept():
    """ac2 kept the buffer (2.00 MiB; torch keeps nothing): a write through a view made
    it a written tensor. Now allocation and writes replay (Note [Writes through views
    of fresh tensors])."""
    torch.manual_seed(0)
    x = torch.randn(1024, 256, requires_grad=True)
    eager = _SliceFilled()
    ours = ac.wrap(copy.deepcopy(eager))

    def run(fn):  # a loss whose backward keeps nothing itself: kept = what checkpointing holds
        return step_memory(eager, lambda m: fn(x).sum(), extra=(x,))

    e, t = run(eager), run(lambda x: torch_checkpoint(eager, x, use_reentrant=False))
    a = step_memory(ours, lambda m: m(x).sum(), extra=(x,))
    _report("slice-filled buffer", e, t, a)
    assert a["kept"] <= t["kept"] and a["kept"] < 1024  # the loss scalar; torch: + its RNG state
    assert a["peak"] <= t["peak"]
    assert_bitwise(e["grads"], a["grads"])


def test_writes_through_views_chain_and_keep_what_is_read_before_the_write():
    """The same view written twice; a slice read before its write (from a clone, as a
    direct write would); the whole buffer written after the slices; views of the
    buffer taken before a write read afterwards (a stale view: kept, still right)."""
    def fn(x):
        buf = x.new_zeros(8, 16)
        left = buf[:, :8]
        early = (left + 1).exp()  # reads the slice before it is written
        left.copy_(x.tanh())
        left.mul_(2)  # the same view written again
        right = buf[:, 8:]
        right.copy_(x.cos())
        buf.add_(0.5)  # the whole buffer, directly
        stale = left * 3  # left's version moved on with buf's: a new value, read as such
        return (buf.sin() * early.sum() + stale.sum()).sum()

    x = torch.randn(8, 8, requires_grad=True)
    (ref,) = torch.autograd.grad(fn(x), x)
    with ac.apply_ac_policy("recompute_all") as region:
        y = fn(x)
    (got,) = torch.autograd.grad(y, x)
    assert torch.equal(ref, got)
    assert region.stats.recomputed_ops > 0


def test_write_through_a_view_of_a_value_something_else_read_stays_a_side_effect():
    """A buffer read by a non-view op before the write is not "fresh": the write stays a
    side effect (saved) and the gradients stay eager's."""
    def fn(x):
        buf = x * 2
        s = buf.sum()  # a non-view read of the base
        buf[:4].copy_(x[:4].tanh())
        return (buf.sin() * s).sum()

    x = torch.randn(8, requires_grad=True)
    (ref,) = torch.autograd.grad(fn(x), x)
    with ac.apply_ac_policy("recompute_all"):
        y = fn(x)
    (got,) = torch.autograd.grad(y, x)
    assert torch.equal(ref, got)


# ---- saved values that only replays read ----------------------------------------------------


class _Attention(nn.Module):
    """softmax((x @ W) @ x^T) @ x: the scores (a bmm output) are saved by a save-list and
    read only by softmax's replay."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax((x @ self.w) @ x.transpose(-1, -2), -1) @ x


def test_saved_value_read_only_by_replays_is_freed_after_its_last_replay():
    """torch's SAC drops its cached scores once recompute used them; ac2 held them until
    the region's backward ended: peak 17.0 vs 13.5 MiB (x 4x512x64, scores 4 MiB)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    save = [aten.mm.default, aten.bmm.default]
    torch.manual_seed(0)
    x = torch.randn(4, 512, 64)
    eager = _Attention()
    sac = _torch_ckpt(copy.deepcopy(eager))
    sac.forward = functools.partial(
        torch_checkpoint, sac.forward.args[0], use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, save))
    ours = ac.wrap(copy.deepcopy(eager), save)
    e, t, a = _measure(eager, x), _measure(sac, x), _measure(ours, x)
    _report("attention, save mm/bmm", e, t, a)
    assert_bitwise(e["grads"], a["grads"])
    assert a["peak"] <= t["peak"]
    assert a["kept"] <= t["kept"]


def test_retained_graph_keeps_saved_values_for_the_next_backward():
    save = [aten.mm.default, aten.bmm.default]
    torch.manual_seed(0)
    model = _Attention(16)
    ref = copy.deepcopy(model)
    ac.wrap(model, save)
    x = torch.randn(2, 8, 16, requires_grad=True)
    params = [x, *model.parameters()]
    y = model(x).square().sum()
    g1 = torch.autograd.grad(y, params, retain_graph=True)
    g2 = torch.autograd.grad(y, params)
    want = torch.autograd.grad(ref(x).square().sum(), [x, *ref.parameters()])
    assert_bitwise(list(want), list(g1))
    assert_bitwise(list(want), list(g2))
