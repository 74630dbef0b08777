"""Asynchronous CPU offload (ac2_dist/offload.py): the schedule's order of
copies and waits, the lifetimes of device tensors and host copies, and values.

On CPU the schedule runs with the inline copy engine (``Offload(stream="inline")``: the
"device" tensors are CPU tensors, copied into host buffers from the pool) and the inline
replay executor, exactly the steps a GPU runs with streams; the CUDA tests (marked
``cuda``) run the same checks with side streams and pinned memory.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from _models import assert_bitwise
from models import Llama, LlamaBlock
from torch.multiprocessing.reductions import StorageWeakRef

import ac2_dist as ac

CP = torch.utils.checkpoint.CheckpointPolicy
aten = torch.ops.aten
LAYERS = 4
UNITS = [f"layers.{i}" for i in range(LAYERS)]

if not hasattr(CP, "MUST_CPU_OFFLOAD"):  # torch < 2.11 (Note [Supported torch versions])
    pytest.skip(f"CheckpointPolicy.MUST_CPU_OFFLOAD does not exist in torch {torch.__version__}",
                allow_module_level=True)


def _model(device: str = "cpu") -> Llama:
    torch.manual_seed(0)
    return Llama(vocab=64, dim=32, layers=LAYERS, heads=4).to(device)


def _tokens(device: str = "cpu", seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(seed)).to(device)


def _loss(model, tokens):
    return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


def _grads(model, tokens):
    model.zero_grad(set_to_none=True)
    _loss(model, tokens).backward()
    return [p.grad.clone() for p in model.parameters()]


class _Recorder:
    """Policy and log callback in one: offloads every ``mm`` output, keeps a weak
    reference to its storage per block, and at every scheduling event records how many
    of each block's offloaded device storages are still alive."""

    def __init__(self) -> None:
        self.storages: dict[str, list[StorageWeakRef]] = {}
        self.events: list[tuple[str, str]] = []
        self.alive: list[dict[str, int]] = []

    def policy(self, ctx, op, *args, **kwargs):
        if op is aten.mm.default:
            self.storages.setdefault(ctx.module_fqn, []).append(StorageWeakRef(ctx.op_output.untyped_storage()))
            return CP.MUST_CPU_OFFLOAD
        return CP.PREFER_RECOMPUTE

    def live(self) -> dict[str, int]:
        return {u: sum(not r.expired() for r in refs) for u, refs in self.storages.items()}

    def __call__(self, event: str, fqn: str) -> None:
        self.events.append((event, fqn))
        self.alive.append(self.live())

    def at(self, event: str, fqn: str) -> int:
        return self.events.index((event, fqn))

    def all(self, event: str, fqn: str) -> list[int]:
        return [k for k, e in enumerate(self.events) if e == (event, fqn)]


def _offloaded(rec: _Recorder, offload: ac.Offload, depth: int, device: str = "cpu", stream="inline") -> Llama:
    model = _model(device)
    return ac.apply_ac(model, rec.policy, modules=[LlamaBlock],
                       replay=ac.ReplayConfig(stream=stream, prefetch=depth, log=rec, offload=offload))


@pytest.mark.parametrize("streams", ["inline", "simulated"])
@pytest.mark.parametrize("defer,depth", [(1, 1), (2, 1), (1, 0), (1, 2)])
def test_schedule_order_lifetimes_and_values(defer, depth, streams, request):
    """``streams="simulated"``: the CUDA path -- copies on the Offload's stream, replays on
    the side stream -- under the simulated CUDA (tests/_simcuda.py), which fails the test
    on an unsynchronised cross-stream free or an unordered access."""
    sim = request.getfixturevalue("simcuda") if streams == "simulated" else None
    tokens = _tokens()
    eager = _grads(_model(), tokens)
    rec = _Recorder()
    stream = "inline" if sim is None else "auto"
    offload = ac.Offload(defer, stream=stream, log=rec)
    model = _offloaded(rec, offload, depth, stream=stream)
    got = _grads(model, tokens)
    assert_bitwise(eager, got)  # copies are exact: gradients are eager's bit for bit

    ev, alive = rec.events, rec.alive
    # Offloaded values backward needs, per block (an mm output nothing reads in backward,
    # the attention output projection's, dies at once: it is never copied).
    per_block = alive[rec.at("close", "layers.0")]["layers.0"]
    assert per_block > 0 and all(alive[rec.at("close", u)][u] == per_block for u in UNITS)
    committed = UNITS[:LAYERS - defer]  # waited for and freed in forward
    kept = UNITS[LAYERS - defer:]  # the last `defer` blocks: read on the device in backward
    backward = ev.index(("backward_start", UNITS[-1]))
    for i, unit in enumerate(UNITS):
        opened, closed = rec.at("open", unit), rec.at("close", unit)
        assert opened < closed < backward
        # Copies are issued when the next block opens (never for the last block)...
        if i + 1 < LAYERS:
            assert ev[rec.at("open", UNITS[i + 1]) + 1] == ("d2h", unit)
        else:
            assert ("d2h", unit) not in ev
        # ...and waited for when block i+defer closes, then the device tensors are freed.
        if unit in committed:
            wait = rec.at("wait", unit)
            assert wait == rec.at("close", UNITS[i + defer]) + 1
            assert ev[wait + 1] == ("free_device", unit)
            assert all(a[unit] == per_block for a in alive[closed:wait + 1])  # alive until the wait...
            assert all(a[unit] == 0 for a in alive[wait + 1:])  # ...freed from then on
            # Host copies come back ahead of this block's backward (with prefetch: while
            # the next block's backward runs), one per value, each buffer released after it.
            h2d = rec.all("h2d", unit)
            assert len(h2d) == per_block
            if depth:  # inside the block's prefetch, which a later block's backward start runs
                lo, hi = rec.at("prefetch_start", unit), rec.at("prefetch_end", unit)
                assert rec.at("backward_start", UNITS[min(i + depth, LAYERS - 1)]) < lo
                assert hi < rec.at("backward_start", unit)
            else:  # when its backward unpacks the values
                lo, hi = rec.at("backward_start", unit), len(ev)
            assert all(lo < k < hi for k in h2d)
            released = rec.all("release_host", unit)
            assert len(released) == per_block and min(released) > min(h2d)
        else:
            assert ("wait", unit) not in ev and ("h2d", unit) not in ev
            keep = rec.at("keep", unit)
            assert keep > backward
            assert all(a[unit] == per_block for a in alive[closed:keep + 1])  # never left the device
    # At most defer + 1 blocks' offloaded values are on the device during forward.
    assert max(sum(1 for n in a.values() if n) for a in alive[:backward]) == defer + 1
    assert all(n == 0 for n in rec.live().values())  # nothing of the step is alive after it

    stats = offload.stats
    assert (stats.units_committed, stats.units_kept) == (len(committed), len(kept))
    copied = LAYERS - 1  # every block but the last
    assert stats.d2h_copies == stats.buffers_allocated == copied * per_block
    assert stats.h2d_copies == len(committed) * per_block
    assert offload.pool_held()[0] == stats.buffers_allocated  # every buffer back in the pool

    # A second step reuses the pool: no host memory is allocated again.
    got2 = _grads(model, tokens)
    assert_bitwise(eager, got2)
    assert offload.stats.buffers_allocated == copied * per_block
    assert offload.stats.buffers_reused == copied * per_block
    if sim is not None:
        sim.check()
        # the copy stream, and the side stream where a prefetch replays (none without one)
        assert sim.stats.cross_stream_uses > 0 and sim.stats.streams_created == (2 if depth else 1)


def test_retained_graph_reads_host_copies_twice():
    tokens = _tokens(seed=1)
    rec = _Recorder()
    offload = ac.Offload(stream="inline", log=rec)
    model = _offloaded(rec, offload, depth=1)
    params = list(model.parameters())
    loss = _loss(model, tokens)
    g1 = torch.autograd.grad(loss, params, retain_graph=True)
    assert ("release_host", "layers.0") not in rec.events  # retained: host copies kept
    g2 = torch.autograd.grad(loss, params)
    fresh = _model()
    ref = torch.autograd.grad(_loss(fresh, tokens), list(fresh.parameters()))
    assert_bitwise(list(ref), list(g1))
    assert_bitwise(list(ref), list(g2))
    needed = len(rec.all("h2d", "layers.0")) // 2
    assert needed > 0 and len(rec.all("h2d", "layers.0")) == 2 * needed  # each backward copies them back
    del loss
    assert offload.pool_held()[0] == offload.stats.buffers_allocated


def test_gradient_accumulation_two_forwards_one_backward():
    """Two microbatches' forwards before one backward: the first microbatch's last block is
    copied and committed during the second one's forward (blocks count across forwards)."""
    rec = _Recorder()
    offload = ac.Offload(stream="inline", log=rec)
    model = _offloaded(rec, offload, depth=1)
    a, b = _tokens(seed=2), _tokens(seed=3)
    model.zero_grad(set_to_none=True)
    (_loss(model, a) + _loss(model, b)).backward()
    got = [p.grad for p in model.parameters()]
    fresh = _model()
    (_loss(fresh, a) + _loss(fresh, b)).backward()
    assert_bitwise([p.grad for p in fresh.parameters()], got)
    assert offload.stats.units_committed == 2 * LAYERS - 1 and offload.stats.units_kept == 1


def _offload_matmul(ctx, op, *args, **kwargs):
    return CP.MUST_CPU_OFFLOAD if op is aten.mm.default else CP.PREFER_RECOMPUTE


def test_write_before_copy_copies_first():
    """Note [Offloaded values that are written]: a value a replay reads, written in place
    in its region before its block's copies are issued, is copied before the write."""
    events = []
    offload = ac.Offload(stream="inline", log=lambda e, f: events.append(e))
    w = torch.randn(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def fn(x):
        h = x @ w  # offloaded
        y = h.relu()  # a replay reads h (autograd saves relu's output, not h)
        h.add_(1.0)  # written before the copy would be issued
        return (y * h).sum()

    with ac.apply_ac_policy(_offload_matmul, replay=ac.ReplayConfig(stream="inline", offload=offload)):
        out = fn(x)
    assert events[:3] == ["open", "d2h", "close"]  # copied inside the block, before the write
    out.backward()
    assert "h2d" in events
    xr = x.detach().requires_grad_()
    fn(xr).backward()
    assert torch.equal(x.grad, xr.grad)


def test_write_after_save_is_an_error_on_use():
    offload = ac.Offload(stream="inline")
    w = torch.randn(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    config = ac.ReplayConfig(stream="inline", offload=offload)
    with ac.apply_ac_policy(_offload_matmul, replay=config):
        h = x @ w
        y = h.sin()  # autograd saves h (a handle: read directly, not by a replay)
    h.mul_(2.0)  # after the region, before its copies were waited for
    with ac.apply_ac_policy("recompute_all", replay=config):
        z = y.cos()
    with ac.apply_ac_policy("recompute_all", replay=config):  # commits the first block
        z = z.tanh().sum()
    with pytest.raises(RuntimeError, match=r"offloaded to the CPU\) was modified in place"):
        z.backward()


def test_tag_with_policy_offloads_through_the_schedule():
    events = []
    offload = ac.Offload(stream="inline", log=lambda e, f: events.append((e, f)))

    class Tagged(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = torch.tanh(self.lin(x))
            ac.tag_with_policy(h, CP.MUST_CPU_OFFLOAD)
            return h.sigmoid()

    torch.manual_seed(0)
    model = torch.nn.Sequential(Tagged(), Tagged(), Tagged())
    ref = copy.deepcopy(model)
    ac.apply_ac(model, "recompute_all", modules=[Tagged], replay=ac.ReplayConfig(stream="inline", offload=offload))
    x = torch.randn(4, 8)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert_bitwise([p.grad for p in ref.parameters()], [p.grad for p in model.parameters()])
    assert [f for e, f in events if e == "d2h"] == ["0", "1"]
    assert [f for e, f in events if e == "keep"] == ["2"]


def test_auto_on_cpu_saves_by_reference_and_apply_ac_shares_one_schedule():
    model = _model()
    ac.apply_ac(model, _offload_matmul, modules=[LlamaBlock])
    configs = {id(layer.forward.config.offload) for layer in model.layers}
    assert len(configs) == 1  # one Offload for the blocks of this model
    offload = model.layers[0].forward.config.offload
    assert isinstance(offload, ac.Offload) and offload.stream == "auto"
    tokens = _tokens(seed=4)
    assert_bitwise(_grads(_model(), tokens), _grads(model, tokens))
    assert offload.stats == ac.offload.OffloadStats()  # CPU tensors: nothing to offload them to
    # wrap alone gets no schedule; an explicit one is shared as given.
    assert ac.wrap(torch.nn.Linear(2, 2)).forward.config.offload is None
    shared = ac.Offload(defer=2)
    model2 = ac.apply_ac(_model(), _offload_matmul, modules=[LlamaBlock], replay=ac.ReplayConfig(offload=shared))
    assert all(layer.forward.config.offload is shared for layer in model2.layers)


def test_config_validation_pickle_and_deepcopy():
    with pytest.raises(ValueError, match="defer must be an int >= 1"):
        ac.Offload(defer=0)
    with pytest.raises(ValueError, match="defer must be an int >= 1"):
        ac.Offload(defer=True)
    with pytest.raises(ValueError, match="stream must be"):
        ac.Offload(stream="sideways")
    with pytest.raises(TypeError, match="offload takes an ac2_dist.Offload"):
        ac.ReplayConfig(offload="cpu")
    model = ac.apply_ac(_model(), _offload_matmul, modules=[LlamaBlock],
                        replay=ac.ReplayConfig(offload=ac.Offload(defer=2, stream="inline")))
    restored = pickle.loads(pickle.dumps(model))
    offload = restored.layers[0].forward.config.offload
    assert (offload.defer, offload.stream) == (2, "inline")
    assert all(layer.forward.config.offload is offload for layer in restored.layers)
    copied = copy.deepcopy(model)
    tokens = _tokens(seed=5)
    assert_bitwise(_grads(_model(), tokens), _grads(copied, tokens))


def test_memory_report_counts_offloaded_bytes():
    rec = _Recorder()
    offload = ac.Offload(stream="inline", log=rec)
    model = _offloaded(rec, offload, depth=0)
    with ac.memory.track(model) as tracker:
        _loss(model, _tokens(seed=6)).backward()
    report = tracker.report()
    assert report.saved_bytes_by_reason["offloaded"] > 0


# ---- CUDA: the same schedule on streams, pinned memory (skips without a device) ----------------


@pytest.fixture
def math_attention():
    """SDPA's math backend: CUDA's fused attention backward kernels may accumulate
    atomically (not bitwise repeatable); the comparisons here are bitwise."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


@pytest.mark.cuda
def test_cuda_schedule_values_memory_and_pool(math_attention):
    tokens = _tokens("cuda")

    def run(offload: ac.Offload | None, policy, depth=1, stream="auto"):
        model = _model("cuda")
        ac.apply_ac(model, policy, modules=[LlamaBlock],
                    replay=ac.ReplayConfig(stream=stream, prefetch=depth, offload=offload))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        loss = _loss(model, tokens)
        torch.cuda.synchronize()
        after_forward = torch.cuda.memory_allocated() - base
        loss.backward()
        torch.cuda.synchronize()
        return [p.grad for p in model.parameters()], after_forward, model

    def save_matmul(ctx, op, *args, **kwargs):
        return CP.MUST_SAVE if op is aten.mm.default else CP.PREFER_RECOMPUTE

    saved, kept_saved, _ = run(None, save_matmul)
    rec = _Recorder()
    offload = ac.Offload(stream="auto", log=rec)
    side, kept_side, model = run(offload, rec.policy)
    inline, _, _ = run(ac.Offload(stream="inline"), _offload_matmul, stream="inline", depth=0)
    assert_bitwise(saved, side)  # same kernels, exact copies: bit for bit
    assert_bitwise(saved, inline)
    # Three of four blocks' matmul outputs left the device after forward: what was
    # copied is what the device holds less than when they are saved.
    assert offload.stats.units_committed == LAYERS - 1 and offload.stats.units_kept == 1
    assert offload.stats.d2h_bytes > 0
    assert kept_side <= kept_saved - offload.stats.d2h_bytes + 2**20
    # Pinned buffers, reused by the next step.
    buffers = offload.stats.buffers_allocated
    pool = offload._pool._free
    assert all(buf.is_pinned() for entries in pool.values() for buf, _ in entries)
    model.zero_grad(set_to_none=True)
    _loss(model, tokens).backward()
    torch.cuda.synchronize()
    assert offload.stats.buffers_allocated == buffers
    assert all(n == 0 for n in rec.live().values())


@pytest.mark.cuda
def test_cuda_schedule_order_matches_cpu(math_attention):
    def order(device: str, stream) -> list[tuple[str, str]]:
        rec = _Recorder()
        model = _offloaded(rec, ac.Offload(stream=stream, log=rec), depth=1, device=device,
                           stream="auto" if device == "cuda" else "inline")
        _grads(model, _tokens(device))
        return [e for e in rec.events if e[0] in ("open", "close", "d2h", "wait", "free_device", "keep")]

    assert order("cuda", "auto") == order("cpu", "inline")


def test_the_pool_stays_bounded_when_shapes_vary():
    """Issue 48 item 3: keyed by exact size, 12 steps at sequence lengths 24..35 kept 216
    buffers, 5.06 MB against 0.50 MB for the largest step, growing with every new length.
    Size classes and a cap at the most bytes ever in use at once (Note [Pinned buffer
    pool] in offload.py) keep it within 2x the largest step's bytes, every step; the
    values stay eager's."""
    offload = ac.Offload(defer=1, stream="inline")
    model = ac.apply_ac(_model(), _offload_mm, modules=[LlamaBlock], replay=ac.ReplayConfig(offload=offload))
    eager = _model()
    largest = 0
    held = []
    for step, seq in enumerate(range(24, 36)):
        tokens = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(step))
        before = offload.stats.d2h_bytes
        assert_bitwise(_grads(eager, tokens), _grads(model, tokens))
        largest = max(largest, offload.stats.d2h_bytes - before)
        n, nbytes = offload.pool_held()
        held.append(nbytes)
        assert nbytes <= 2 * largest, (step, seq, nbytes, largest)
    stats = offload.stats
    assert stats.buffers_reused > 0 and stats.buffers_dropped > 0  # both happened
    assert max(held) <= 2 * largest and held[-1] <= 2 * largest


def _offload_mm(ctx, op, *args, **kwargs):
    return CP.MUST_CPU_OFFLOAD if op is aten.mm.default else CP.PREFER_RECOMPUTE


def test_size_classes():
    from ac2_dist._offload_copies import _size_class

    assert [_size_class(n) for n in (1, 512, 513, 4096)] == [512, 512, 1024, 4096]
    assert [_size_class(n) for n in (4097, 5120, 5121, 8192, 8193)] == [5120, 5120, 6144, 8192, 10240]
    for n in (5000, 123_457, 10**6, 10**8 + 7):
        c = _size_class(n)
        assert n <= c < 1.25 * n + 512 and c % 512 == 0
