"""Replay scheduling: prefetching the next unit's replay, the memory
bound, FSDP coordination; the CUDA side-stream executor where a GPU exists."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from _models import assert_bitwise
from models import Llama, LlamaBlock, MLPLayer, Stage, StageStack

import ac2_dist as ac

LAYERS = 4


def _model():
    torch.manual_seed(0)
    return Llama(vocab=64, dim=32, layers=LAYERS, heads=4)


def _loss(model, tokens):
    return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


def _run(prefetch, tokens, log=None, sample=None, stream="inline"):
    model = _model()
    ac.apply_ac(model, "recompute_all", modules=[LlamaBlock], replay=ac.ReplayConfig(stream=stream, prefetch=prefetch, log=log))
    with ac.memory.track(model) as tracker:
        if sample is not None:
            sample.graphs = tracker.graphs
        _loss(model, tokens).backward()
    return [p.grad for p in model.parameters()], tracker


class _Sampler:
    """Log callback: records events and the recomputed bytes alive at each one."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.alive: list[int] = []  # recomputed bytes alive over all units
        self.units_alive: list[int] = []  # units holding recomputed values
        self.largest_unit = 0
        self.largest_value = 0  # the largest prefetched value seen
        self.graphs: list = []

    def __call__(self, event: str, fqn: str) -> None:
        self.events.append((event, fqn))
        per_unit = [g.stats.cached_bytes for g in self.graphs]
        self.alive.append(sum(per_unit))
        self.units_alive.append(sum(1 for b in per_unit if b > 0))
        self.largest_unit = max([self.largest_unit, *per_unit])
        for g in self.graphs:
            for h in g.live_handles():
                if isinstance(h.prefetched, torch.Tensor):
                    self.largest_value = max(self.largest_value, h.prefetched.numel() * h.prefetched.element_size())

    def index(self, event: str, fqn: str) -> int:
        return self.events.index((event, fqn))


def _order_holds(events: _Sampler, depth: int, paced: bool = False) -> None:
    for i in range(LAYERS - 1, 0, -1):
        for k in range(1, depth + 1):
            if i - k < 0:
                continue
            prev = f"layers.{i - k}"
            start = events.index("backward_start", f"layers.{i}")
            # Unit i-k's replay is issued when unit i's backward starts, and is done
            # before unit i's backward ends (so unit i-k's backward never waits for it).
            # Paced by bytes on a side stream (Note [A prefetch holds one unit's values
            # ahead] in _prefetch.py), unit i-2's prefetch goes on as unit i's and i-1's
            # values are used: done before unit i-k's own backward starts.
            if paced:  # started once, when the first unit ahead of it began its backward
                began = events.index("prefetch_start", prev)
                assert events.index("backward_start", f"layers.{min(i - k + depth, LAYERS - 1)}") < began
                assert began < events.index("prefetch_end", prev) < events.index("backward_start", prev)
                continue
            assert start < events.events.index(("prefetch_start", prev), start)
            end = events.events.index(("prefetch_end", prev), start)
            assert end < events.index("backward_end", f"layers.{i}")


@pytest.mark.parametrize("streams", ["inline", "simulated"])
@pytest.mark.parametrize("depth", [1, 2])
def test_prefetch_order_grads_and_memory_bound(depth, streams, request):
    """``streams="simulated"``: replays on the side stream under the simulated CUDA
    (tests/_simcuda.py), which fails the test on a stream hazard."""
    sim = request.getfixturevalue("simcuda") if streams == "simulated" else None
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    ref, base = _run(0, tokens)
    sampler = _Sampler()
    got, tracker = _run(depth, tokens, log=sampler, sample=sampler, stream="inline" if sim is None else "auto")
    if sim is not None:
        assert all(type(g.executor).__name__ == "SideStreamExecutor" for g in tracker.graphs)
        sim.check()
    assert_bitwise(ref, got)
    _order_holds(sampler, depth, paced=sim is not None)
    # At most the current unit's and the prefetched units' recomputed values are alive
    # (the tracer's own accounting, sampled at every scheduling event)...
    assert max(sampler.units_alive) <= 1 + depth
    assert max(sampler.alive) <= (1 + depth) * sampler.largest_unit
    if sim is None:
        # ...and prefetch really ran ahead: more than one unit was alive at some point.
        assert max(sampler.units_alive) == 1 + depth
    else:
        # ...on a side stream, within ``depth`` units' bytes (the budget is checked
        # before each realize: one realize past it at most); each prefetch still ended
        # before its unit's backward began (_order_holds).
        from ac2_dist._prefetch import prefetcher

        values, params = prefetcher().this_backward
        assert params == 0  # no FSDP here: the budget is depth units' recomputed values
        assert max(sampler.alive) <= depth * values + sampler.largest_value, sampler.alive
    assert all(s.cached_bytes == 0 for s in tracker.graph_stats)  # all handed out and freed
    assert tracker.report().recomputed_ops == base.report().recomputed_ops  # nothing replayed twice


def test_prefetch_default_is_off_on_cpu_and_config_validates():
    assert ac.ReplayConfig().prefetch_depth(on_cuda=False) == 0
    assert ac.ReplayConfig().prefetch_depth(on_cuda=True) == 1
    with pytest.raises(ValueError, match="prefetch"):
        ac.ReplayConfig(prefetch=3)
    with pytest.raises(ValueError, match="stream"):
        ac.ReplayConfig(stream="sideways")
    # A region takes the config too (inline on CPU whatever it says).
    x = torch.randn(4, 4, requires_grad=True)
    with ac.apply_ac_policy("recompute_all", replay=ac.ReplayConfig(stream="auto")):
        y = x.sin().tanh().sum()
    y.backward()
    xr = x.detach().requires_grad_()
    xr.sin().tanh().sum().backward()
    assert torch.equal(x.grad, xr.grad)


def test_retained_second_backward_after_prefetch():
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model = _model()
    ac.apply_ac(model, "recompute_all", modules=[LlamaBlock], replay=ac.ReplayConfig(stream="inline", prefetch=1))
    loss = _loss(model, tokens)
    g1 = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    g2 = torch.autograd.grad(loss, list(model.parameters()))
    fresh = _model()
    ref = torch.autograd.grad(_loss(fresh, tokens), list(fresh.parameters()))
    assert_bitwise(list(ref), list(g1))
    assert_bitwise(list(g1), list(g2))


def _fsdp_prefetch(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils._python_dispatch import TorchDispatchMode

    class Gathers(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) == "c10d._allgather_base_.default":
                Gathers.count += 1
            return func(*args, **(kwargs or {}))

    model = _model()
    ref = copy.deepcopy(model)
    sampler = _Sampler()
    ac.apply_ac(model, "recompute_all", modules=[LlamaBlock],
                replay=ac.ReplayConfig(stream="inline", prefetch=1, log=sampler))
    mesh = init_device_mesh("cpu", (world,))
    for blk in model.layers:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    results = []
    for step in range(2):
        tokens = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world)]
        sampler.events.clear()
        loss = _loss(model, tokens[rank])
        with Gathers():
            Gathers.count = 0
            loss.backward()
        ref_loss = sum(_loss(ref, t) for t in tokens) / world
        ref_loss.backward()
        err = max((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
        model.zero_grad()
        ref.zero_grad()
        results.append({"events": list(sampler.events), "gathers": Gathers.count, "err": err})
    return results


def test_fsdp_prefetch_after_unshard_before_backward_ends():
    for rank_results in run_ranks(_fsdp_prefetch):
        for r in rank_results:
            assert r["err"] < 1e-5, r["err"]
            assert r["gathers"] <= LAYERS  # still at most one all-gather per unit
            ev = r["events"]
            for i in range(LAYERS - 1, 0, -1):
                prev = f"layers.{i - 1}"
                start = ev.index(("backward_start", f"layers.{i}"))
                p_start = ev.index(("prefetch_start", prev), start)
                p_end = ev.index(("prefetch_end", prev), start)
                unshard = next(k for k, e in enumerate(ev) if k > p_start and e[0] in ("unshard", "unsharded") and e[1] == prev)
                # The replay reads unit i-1's parameters only once they are gathered...
                assert p_start < unshard < p_end, ev
                # ...and it is done before unit i's backward ends.
                assert p_end < ev.index(("backward_end", f"layers.{i}")), ev


def _nested(stages=2, layers=3):
    """Stages of layers, both checkpointed (HF Swin's shape: Note [Nested modules cut the replay])."""
    torch.manual_seed(0)
    return StageStack(stages, 16, layers)


@pytest.mark.parametrize("depth", [1, 2])
def test_nested_modules_with_prefetch_match_eager_bitwise(depth):
    """Item 1 of issue 39: stages x layers checkpointed, prefetch 1 or 2 (the CUDA
    default is 1) crashed in backward ("Expected a proper Tensor but got None"): a
    layer output was dropped at its last pending use before the next layer's private
    replay read it (Note [A private replay holds what it reads])."""
    eager = _nested()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    xe = x.clone().requires_grad_()
    eager(xe).square().sum().backward()
    ops, peak = {}, {}
    for prefetch in (0, depth):
        model = _nested()
        sampler = _Sampler()
        ac.apply_ac(model, "recompute_all", modules=[Stage, MLPLayer],
                    replay=ac.ReplayConfig(stream="inline", prefetch=prefetch, log=sampler))
        xa = x.clone().requires_grad_()
        with ac.memory.track(model) as tracker:
            model(xa).square().sum().backward()
        assert_bitwise([p.grad for p in eager.parameters()] + [xe.grad],
                       [p.grad for p in model.parameters()] + [xa.grad])
        assert all(s.cached_bytes == 0 for s in tracker.graph_stats)
        ops[prefetch] = tracker.report().recomputed_ops
        peak[prefetch] = max(s.peak_cached_bytes for s in tracker.graph_stats)
        if prefetch:
            assert ("prefetch_end", "blocks.0") in sampler.events  # the earlier stage's prefetch ran
    # Prefetching recomputes nothing that backward without it does not, and a stage of
    # nested layers is not realized all at once (Note [Prefetch stops at nested modules]).
    assert ops[depth] == ops[0]
    assert peak[depth] == peak[0]


@pytest.mark.parametrize("order", ["pack", "reverse"])
def test_private_replays_hold_what_they_read_in_any_order(order):
    """Note [A private replay holds what it reads]: a region's handles realized in
    pack order (the prefetch's old walk: the layers' handles take a layer output to
    zero uses before the next layer's private fill reads it) or in reverse give the
    values backward without prefetch gets."""
    torch.manual_seed(0)
    stage = ac.apply_ac(Stage(16, 3), "recompute_all", modules=[MLPLayer])
    x = torch.randn(4, 16, requires_grad=True)
    got = []
    for walk in ("reverse", order):
        with ac.apply_ac_policy("recompute_all") as region:
            y = stage(x)  # y keeps the handles alive
        graph = region.graph
        assert graph.has_cuts
        handles = graph.live_handles()
        with graph.lock:
            graph.settle()
            seq = handles if walk == "pack" else handles[::-1]
            values = {id(h): graph.executor.realize(graph, h.node, h.idx) for h in seq}
        got.append([values[id(h)] for h in handles])
        del y
    assert_bitwise(*got)


cuda = pytest.mark.cuda  # skips without a device (conftest.py); launch/gpu_check.py runs it on a GPU


@pytest.fixture
def math_attention():
    """SDPA's math backend: CUDA's fused attention backward may accumulate atomically (not
    bitwise repeatable run to run); the comparisons here are bitwise."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


@cuda
def test_side_stream_matches_inline_and_bounds_memory(math_attention):
    """On a GPU: the side-stream executor gives the inline executor's gradients bit for
    bit, and prefetch 1 holds at most one more unit's replayed values (allocated). Each
    configuration runs once before it is measured, so that its streams already have their
    cuBLAS workspace and pools (Note [What side streams cost] in ac2_dist/_streams.py):
    the figures are a step's, not a stream's first use."""
    tokens = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(0)).cuda()

    def run(config):
        model = _model().cuda()
        ac.apply_ac(model, "recompute_all", modules=[LlamaBlock], replay=config)
        model.zero_grad(set_to_none=True)
        _loss(model, tokens).backward()  # warm-up: the side stream is made and used once
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with ac.memory.track(model) as tracker:
            _loss(model, tokens).backward()
        torch.cuda.synchronize()
        unit = max(s.peak_cached_bytes for s in tracker.graph_stats)  # the graphs died with backward
        return ([p.grad for p in model.parameters()], torch.cuda.max_memory_allocated() - base, unit,
                torch.cuda.max_memory_reserved())

    inline, peak_inline, unit, _ = run(ac.ReplayConfig(stream="inline", prefetch=0))
    side, peak_side, _, _ = run(ac.ReplayConfig(stream=torch.cuda.Stream(), prefetch=0))  # nothing prefetched: inline
    prefetched, peak_prefetch, _, reserved = run(ac.ReplayConfig(prefetch=1))
    again, _, _, _ = run(ac.ReplayConfig(stream="inline", prefetch=0))
    assert_bitwise(inline, again)  # the noise floor: the same executor twice is bitwise
    assert_bitwise(inline, side)
    assert_bitwise(inline, prefetched)
    slack = 2 * 2**20  # allocator rounding: 2 MiB blocks per stream pool
    assert peak_side <= peak_inline + slack
    assert peak_prefetch <= peak_inline + unit + slack
    assert reserved > 0


@cuda
@pytest.mark.skipif(not hasattr(torch.utils.checkpoint.CheckpointPolicy, "MUST_CPU_OFFLOAD"),
                    reason="CheckpointPolicy.MUST_CPU_OFFLOAD exists from torch 2.11")
def test_a_with_block_offloads_asynchronously_on_cuda(math_attention):
    """Issue 48 item 4 on a GPU: ``with apply_ac_policy(..., replay=ReplayConfig(offload=
    Offload()))`` blocks take the schedule's asynchronous path (copies on the Offload's
    stream into pinned buffers), not a per-tensor copy; gradients are eager's."""
    cp = torch.utils.checkpoint.CheckpointPolicy

    def offload_addmm(ctx, op, *args, **kwargs):
        return cp.MUST_CPU_OFFLOAD if op is torch.ops.aten.addmm.default else cp.PREFER_RECOMPUTE

    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
              for _ in range(4)]
    x = torch.randn(32, 64, device="cuda")
    offload = ac.Offload()

    def run(checkpointed):
        for b in blocks:
            b.zero_grad(set_to_none=True)
        out = x.clone().requires_grad_()
        for b in blocks:
            if checkpointed:
                with ac.apply_ac_policy(offload_addmm, replay=ac.ReplayConfig(offload=offload)):
                    out = b(out)
            else:
                out = b(out)
        out.square().sum().backward()
        torch.cuda.synchronize()
        return [p.grad.clone() for b in blocks for p in b.parameters()]

    assert_bitwise(run(False), run(True))
    assert offload.stats.d2h_copies > 0 and offload.stats.units_committed > 0
    assert all(buf.is_pinned() for bufs in offload._pool._free.values() for buf, _ in bufs)


def test_profiler_shows_replay_and_prefetch_ranges():
    from torch.profiler import ProfilerActivity, profile

    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    model = _model()
    ac.apply_ac(model, "recompute_all", modules=[LlamaBlock], replay=ac.ReplayConfig(stream="inline", prefetch=1))
    loss = _loss(model, tokens)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    names = {e.name for e in prof.events()}
    assert {"ac2::replay", "ac2::prefetch"} <= names


def test_partial_retained_backward_with_prefetch_frees_everything():
    """A backward that stops early leaves what it prefetched parked; the next backward
    over the retained graph uses it (no replay twice), and after full backwards
    nothing is cached or parked."""
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    model = _model()
    ac.apply_ac(model, "recompute_all", modules=[LlamaBlock], replay=ac.ReplayConfig(stream="inline", prefetch=1))
    params = list(model.parameters())
    with ac.memory.track(model) as tracker:
        loss = _loss(model, tokens)
        last = list(model.layers[-1].parameters())
        torch.autograd.grad(loss, last, retain_graph=True)  # stops inside the last block
        assert any(g._parked for g in tracker.graphs)  # the block before it was prefetched
        g1 = torch.autograd.grad(loss, params, retain_graph=True)
        assert all(not g._parked for g in tracker.graphs)
        g2 = torch.autograd.grad(loss, params)
    fresh = _model()
    ref = torch.autograd.grad(_loss(fresh, tokens), list(fresh.parameters()))
    assert_bitwise(list(ref), list(g1))
    assert_bitwise(list(ref), list(g2))
    assert all(s.cached_bytes == 0 for s in tracker.graph_stats)


def test_two_losses_prefetch_is_not_wasted():
    """Two forwards, then two separate backwards: B's backward prefetches A (chained in
    forward order); A's backward then uses those values instead of replaying again."""
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
    b = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
    base_ops = {}
    for prefetch in (0, 1):
        ac.apply_ac(a, "recompute_all", replay=ac.ReplayConfig(stream="inline", prefetch=prefetch))
        ac.apply_ac(b, "recompute_all", replay=ac.ReplayConfig(stream="inline", prefetch=prefetch))
        x = torch.randn(4, 16)
        with ac.memory.track() as tracker:
            la = a(x).sum()
            lb = b(x).sum()
            lb.backward()
            la.backward()
        base_ops[prefetch] = tracker.report().recomputed_ops
        assert all(s.cached_bytes == 0 for s in tracker.graph_stats)
    assert base_ops[1] == base_ops[0]
