"""Stream semantics of the CUDA paths (ac2_dist/_streams.py, replay.py, offload.py), run
on CPU under the simulated CUDA (tests/_simcuda.py, the ``simcuda`` fixture): the
side-stream executor, the prefetch and the asynchronous offload schedule make no
unsynchronised cross-stream free and no unordered access, give eager's gradients bit
for bit, and make their streams once."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _models import assert_bitwise
from models import Llama, LlamaBlock, MLPLayer, Stage, StageStack

import ac2_dist as ac

CP = torch.utils.checkpoint.CheckpointPolicy
aten = torch.ops.aten
LAYERS = 4


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(vocab=64, dim=32, layers=LAYERS, heads=4)


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(seed))


def _grads(model: torch.nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    return [p.grad for p in model.parameters()]


POLICIES = {"recompute_all": "recompute_all", "save_mm": [aten.mm.default]}


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_side_stream_replays_free_nothing_unsynchronised(simcuda, policy, prefetch):
    """Issue 39 item 2: a value saved on the compute stream (a policy save) and read by a
    replay on the side stream was freed at its last use inside the replay with no
    record_stream on the side stream and before the compute stream waited for it."""
    tokens = _tokens()
    eager = _grads(_model(), tokens)
    model = ac.apply_ac(_model(), POLICIES[policy], modules=[LlamaBlock], replay=ac.ReplayConfig(prefetch=prefetch))
    with ac.memory.track(model) as tracker:
        got = _grads(model, tokens)
    assert_bitwise(eager, got)
    assert all(type(g.executor).__name__ == "SideStreamExecutor" for g in tracker.graphs)
    simcuda.check()
    if prefetch:
        assert simcuda.stats.cross_stream_uses > 0  # the prefetched replays did run on the side stream
    else:  # nothing prefetched: every replay inline, on the stream that consumes it (Note [Nothing
        # waits behind another unit] in replay.py); no side stream is made
        assert simcuda.stats.cross_stream_uses == 0 and simcuda.stats.streams_created == 0
    assert simcuda.stats.unsynchronised_frees == 0 and simcuda.stats.unordered_accesses == 0


def _offload_mm(ctx, op, *args, **kwargs):
    return CP.MUST_CPU_OFFLOAD if op is aten.mm.default else CP.PREFER_RECOMPUTE


needs_offload_policy = pytest.mark.skipif(
    not hasattr(CP, "MUST_CPU_OFFLOAD"), reason=f"CheckpointPolicy.MUST_CPU_OFFLOAD does not exist in torch {torch.__version__}"
)


@needs_offload_policy
@pytest.mark.parametrize("copies", ["auto", "inline"])
@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("defer", [1, 2])
def test_offload_schedule_frees_nothing_unsynchronised(simcuda, defer, prefetch, copies):
    """Issue 39 item 2, offload: with defer >= 2 a kept block other than the last is read
    by the side-stream prefetch, and its device tensors (allocated on the compute stream)
    died in OffloadedTensor.__del__ unguarded. Copies on the Offload's own stream, replays
    on the side stream, two steps (the second reuses the pinned pool); ``copies="inline"``:
    device->host copies on the compute stream."""
    tokens = _tokens()
    eager = _grads(_model(), tokens)
    offload = ac.Offload(defer=defer, stream=copies)
    model = ac.apply_ac(_model(), _offload_mm, modules=[LlamaBlock],
                       replay=ac.ReplayConfig(prefetch=prefetch, offload=offload))
    for _ in range(2):
        assert_bitwise(eager, _grads(model, tokens))
        simcuda.check()
    stats = offload.stats
    assert (stats.units_committed, stats.units_kept) == (2 * (LAYERS - defer), 2 * defer)
    assert stats.d2h_copies > 0 and stats.h2d_copies > 0 and stats.buffers_reused > 0
    # Copies on the compute stream and no prefetch: one stream does everything.
    assert simcuda.stats.cross_stream_uses > 0 or (copies == "inline" and prefetch == 0)
    assert simcuda.stats.unsynchronised_frees == 0 and simcuda.stats.unordered_accesses == 0


class _MaskedBlock(torch.nn.Module):
    """A random op whose output (saved: rng="save") only a replayed op reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 16)
        self.fc2 = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        keep = torch.rand_like(h) > 0.3
        return x + self.fc2(torch.tanh(torch.where(keep, h, 0.0)))


def test_saved_random_outputs_read_on_the_side_stream(simcuda):
    """A saved value that is not a policy's: a random op's output (rng="save"), read by a
    side-stream replay (the comparison the mask comes from) and dropped at its last use
    inside the prefetch of the block before."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(*[_MaskedBlock() for _ in range(3)])
    model = ac.apply_ac(copy.deepcopy(eager), "recompute_all", modules=[_MaskedBlock])
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    ref, got = [], []
    for m, out in ((eager, ref), (model, got)):
        torch.manual_seed(2)  # the same masks
        xi = x.clone().requires_grad_()
        m(xi).square().sum().backward()
        out.extend([p.grad for p in m.parameters()] + [xi.grad])
    assert_bitwise(ref, got)
    simcuda.check()
    assert simcuda.stats.guarded_by_record_stream > 0


class _ConvBNBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)), inplace=True)


def test_side_effects_under_side_stream_replays(simcuda):
    """Batch norm's running-statistics update and an in-place ReLU are side effects the
    replays do not re-run; with the first block's replay prefetched onto the side stream by
    the second block's backward, the gradients and the statistics are eager's bit for bit,
    with no stream hazard."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), _ConvBNBlock(), _ConvBNBlock())
    model = ac.apply_ac(copy.deepcopy(eager), "recompute_all", modules=[_ConvBNBlock],
                        replay=ac.ReplayConfig(prefetch=1))
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    ref, got = [], []
    for m, out in ((eager, ref), (model, got)):
        xi = x.clone().requires_grad_()
        m(xi).square().sum().backward()
        out.extend([p.grad for p in m.parameters()] + [xi.grad])
    assert_bitwise(ref, got)
    assert_bitwise(list(eager.buffers()), list(model.buffers()))  # running statistics updated once
    simcuda.check()
    assert simcuda.stats.cross_stream_uses > 0  # block 1's replay ran on the side stream


@pytest.mark.parametrize("policy", ["recompute_all", "offload_mm"])
def test_streams_are_made_once_not_per_block_or_step(simcuda, policy):
    """Issue 39 item 3: ReplayConfig(stream="auto") made a side stream per graph -- 4, 8,
    12 after three steps of a 4-block model, each with a cuBLAS workspace and an
    allocator pool of its own on a GPU. One replay side stream per device (and one copy
    stream per Offload) from the first step on (Note [One side stream per device])."""
    if policy == "offload_mm" and not hasattr(CP, "MUST_CPU_OFFLOAD"):
        pytest.skip(f"CheckpointPolicy.MUST_CPU_OFFLOAD does not exist in torch {torch.__version__}")
    tokens = _tokens()
    model = ac.apply_ac(_model(), "recompute_all" if policy == "recompute_all" else _offload_mm,
                       modules=[LlamaBlock])  # the CUDA defaults: side stream, prefetch 1, one Offload()
    made = []
    for _ in range(3):
        _grads(model, tokens)
        made.append(simcuda.stats.streams_created)
    expected = 1 if policy == "recompute_all" else 2  # + the Offload's copy stream
    assert made == [expected] * 3
    simcuda.check()


@pytest.mark.parametrize("prefetch", [None, 2])
def test_nested_modules_under_simulated_streams(simcuda, prefetch):
    """Issue 39 item 1 with the CUDA executor: stages x layers checkpointed, prefetch 1
    (the default) or 2: eager's gradients bit for bit. A graph with nested modules is not
    prefetched (Note [Prefetch stops at nested modules] in _graph.py), so its replays run
    inline on the consuming stream (Note [Nothing waits behind another unit] in replay.py)."""
    torch.manual_seed(0)
    eager = StageStack(2, 16, 3)
    model = ac.apply_ac(copy.deepcopy(eager), "recompute_all", modules=[Stage, MLPLayer],
                        replay=ac.ReplayConfig(prefetch=prefetch))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    xe, xa = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager(xe).square().sum().backward()
    model(xa).square().sum().backward()
    assert_bitwise([p.grad for p in eager.parameters()] + [xe.grad], [p.grad for p in model.parameters()] + [xa.grad])
    simcuda.check()
    assert simcuda.stats.cross_stream_uses == 0 and simcuda.stats.streams_created == 0


def test_hf_swin_stages_and_layers_with_cuda_defaults(simcuda):
    """HF Swin (built from a small SwinConfig, no weights) with its stages and their layers
    checkpointed by apply_ac and the CUDA defaults (side-stream executor, prefetch 1):
    eager's gradients bit for bit, no stream hazard. The stages hold nested layers, so
    nothing is replayed ahead: every replay runs inline on the consuming stream."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.swin.modeling_swin import SwinLayer, SwinStage

    config = transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4,
        drop_path_rate=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    eager = transformers.SwinModel(config).train()
    model = copy.deepcopy(eager)
    events: list[tuple[str, str]] = []
    ac.apply_ac(model, "recompute_all", modules=[SwinStage, SwinLayer],
                replay=ac.ReplayConfig(log=lambda e, f: events.append((e, f))))
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))

    def grads(m: torch.nn.Module) -> list[torch.Tensor]:
        out = m(pixel_values=pixels)
        (out.last_hidden_state.square().mean() + out.pooler_output.sum()).backward()
        return [p.grad for p in m.parameters() if p.grad is not None]

    ref = grads(eager)
    got = grads(model)
    assert len(ref) == len(list(eager.parameters()))
    assert_bitwise(ref, got)
    assert ("prefetch_end", "encoder.layers.0") in events  # stage 1's backward asked for stage 0's prefetch
    simcuda.check()
    assert simcuda.stats.cross_stream_uses == 0  # ...which a graph with nested modules skips


def test_one_side_stream_per_thread_and_backend():
    """Note [One side stream per device]: a backend's side stream is made once per thread
    (autograd's CUDA worker: once per device) and per backend object, not per call."""
    import threading

    from _simcuda import SimCuda

    a, b = SimCuda(), SimCuda()
    assert a.side_stream() is a.side_stream()
    assert b.side_stream() is not a.side_stream()
    other: list = []
    t = threading.Thread(target=lambda: other.append(a.side_stream()))
    t.start()
    t.join()
    assert other[0] is not a.side_stream() and a.stats.streams_created == 2


def _offload_addmm(ctx, op, *args, **kwargs):
    return CP.MUST_CPU_OFFLOAD if op is aten.addmm.default else CP.PREFER_RECOMPUTE


@needs_offload_policy
def test_a_with_block_takes_the_asynchronous_offload_path(simcuda, monkeypatch):
    """Issue 48 item 4: a ``with apply_ac_policy(..., replay=ReplayConfig(offload=...))``
    block does not know its device when it opens (on a GPU ``region_streams`` gives it no
    streams then), so its OffloadUnit refused CUDA values and they fell back to a
    per-tensor copy, while under the simulation (which answers for an unknown device) the
    asynchronous path ran. The block now takes its streams from its first CUDA value."""
    import ac2_dist._region as region_mod
    import ac2_dist.offload as offload_mod

    monkeypatch.setattr(region_mod, "region_streams", lambda on_cuda: simcuda if on_cuda else None)  # as on a GPU
    monkeypatch.setattr(offload_mod, "_device_streams", lambda t: simcuda)  # these tensors are "CUDA"
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)) for _ in range(4)]
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    offload = ac.Offload(defer=1)

    def run(checkpointed: bool) -> list[torch.Tensor]:
        for b in blocks:
            b.zero_grad(set_to_none=True)
        h = x.clone().requires_grad_()
        out = h
        for b in blocks:
            if checkpointed:
                with ac.apply_ac_policy(_offload_addmm, replay=ac.ReplayConfig(offload=offload)):
                    out = b(out)
            else:
                out = b(out)
        out.square().sum().backward()
        return [p.grad.clone() for b in blocks for p in b.parameters()] + [h.grad]

    eager = run(False)
    assert_bitwise(eager, run(True))
    simcuda.check()
    stats = offload.stats
    assert stats.d2h_copies > 0 and stats.units_committed > 0  # the schedule's copies, on its copy stream
    assert simcuda.stats.streams_created == 1 and simcuda.stats.cross_stream_uses > 0
