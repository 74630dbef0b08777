"""The simulated CUDA timeline (tests/_simtime.py, Note [The simulated timeline]) and what it
shows of ac2's side-stream replays (Note [Nothing waits behind another unit] in replay.py):
the simulation on programs whose figures are known by hand, then a Llama-style model
under FSDP2 on an H100's rates. The timeline is deterministic: its figures are asserted."""

from __future__ import annotations

import tempfile
import threading

import _simtime
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _models import assert_bitwise
from _simcuda import SimCuda

import ac2_dist as ac

MiB = 1 << 20
DEV = _simtime.device("h100", host_op_s=1e-6)


def _mm(n: int) -> float:
    """An n x n x n fp32 matmul's duration on DEV."""
    return max(2 * n**3 / DEV.flops32, 3 * n * n * 4 / DEV.hbm, DEV.kernel_s)


# ---- the simulation itself ------------------------------------------------------------------


@pytest.mark.parametrize("contention", [True, False])
def test_two_streams_share_the_device_or_run_in_parallel(contention):
    n = 512
    with SimCuda(timeline=DEV) as sim:
        a, b = torch.randn(n, n), torch.randn(n, n)
        side = sim.new_stream()
        side.wait_stream(sim.default)
        sim.mark("start")
        x = a @ b
        with sim.use(side):
            y = b @ a
        sim.synchronize()
        sim.mark("end")
        del x, y
    sim.check()
    r = sim.timeline(contention=contention)
    one = _mm(n)
    mms = [i for i in r.intervals if r.kernels[i.kernel].name == "aten.mm.default"]
    assert len(mms) == 2 and {i.stream for i in mms} == {0, side.id}
    start = min(i.start for i in mms)  # both wait for the randn kernels queued before them
    # Shared: together the two matmuls take twice one's time; parallel: one's.
    assert max(i.end for i in mms) - start == pytest.approx(2 * one if contention else one, rel=1e-6)
    assert r.marks["end"][0] == pytest.approx(max(i.end for i in mms))  # the host synchronised with both


def test_a_stream_waits_for_an_event_and_the_host_for_a_synchronize():
    n = 512
    with SimCuda(timeline=DEV) as sim:
        a = torch.randn(n, n)
        side = sim.new_stream()
        side.wait_stream(sim.default)
        with sim.use(side):
            y = a @ a  # 1 matmul on the side stream
        sim.default.wait_stream(side)
        z = y + 1  # the default stream waits for it
        sim.mark("issued")
        sim.default.synchronize()
        sim.mark("synced")
        del z
    r = sim.timeline(contention=False)
    # The side stream waited for the randn on the default stream, then the default stream for the matmul.
    assert [(s, src) for s, _, _, src, _ in r.waits] == [(side.id, 0), (0, side.id)]
    assert r.stalls(0) == pytest.approx(_mm(n), rel=0.05)  # idle while the side stream computed
    assert r.marks["synced"][0] - r.marks["issued"][0] >= _mm(n)  # the host waited for the device


def test_record_stream_holds_a_block_until_the_stream_passes_the_free():
    """A block freed while another stream still has work queued on it stays out of its
    pool until that stream gets there: the next allocation reserves a new segment."""
    n = 1024  # 4 MiB
    with SimCuda(timeline=DEV) as sim:
        side = sim.new_stream()
        a = torch.randn(n, n)
        side.wait_stream(sim.default)
        with sim.use(side):
            y = a @ a  # the side stream reads a (for a matmul's time)
        sim.record_stream(a, side)
        del a  # freed now, while the matmul is queued: held
        b = torch.empty(n, n)  # a second 4 MiB block: cannot take a's
        sim.synchronize()
        c = torch.empty(n, n)  # after the synchronize a's block is back
        del b, c, y
    sim.check()
    r = sim.timeline()
    assert r.reserved_by[0] == 20 * MiB  # one 20 MiB segment: a, b, then c in a's block
    held = sim.trace.lanes[0]
    assert any(op[0] == "free" and op[2] for op in held)  # the free carried a hold


def test_each_streams_first_matmul_reserves_a_cublas_workspace():
    with SimCuda(timeline=DEV) as sim:
        side = sim.new_stream()
        a = torch.randn(64, 64)
        side.wait_stream(sim.default)
        b = a @ a
        with sim.use(side):
            c = a @ a
            d = a @ a
        del b, c, d
    r = sim.timeline()
    assert r.reserved_by[0] == DEV.cublas_workspace + 2 * MiB and r.reserved_by[side.id] == DEV.cublas_workspace + 2 * MiB


def test_another_thread_has_its_own_host_lane_and_join_waits_for_it():
    with SimCuda(timeline=DEV) as sim:
        a = torch.randn(256, 256)

        def work() -> None:
            for _ in range(10):
                torch.mm(a, a)

        th = threading.Thread(target=work)
        th.start()
        th.join()
        sim.mark("joined")
    r = sim.timeline()
    assert len(r.lane_end) == 2 and r.marks["joined"][0] >= 10 * DEV.host_op_s


# ---- ac2's side-stream replays on the timeline ---------------------------------------------------


@pytest.fixture(scope="module")
def one_rank():
    """FSDP2 needs a process group: one gloo rank in this process."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


CFG = dict(layers=8, dim=256, heads=4, seq=256, batch=2, host_op_us=0.5)


@pytest.fixture(scope="module")
def runs(one_rank):
    """Each mode of launch/bench_overlap.py on 8 Llama blocks under FSDP2 (one rank,
    collectives priced as on 8 GPUs), a fast host (0.5 us per op: the device is the
    bottleneck), recorded once for the tests below."""
    import bench_overlap as bench

    cfg = bench.Config(**CFG)
    return {mode: bench.run_mode(mode, cfg) for mode in bench.MODES}


def _figures(runs, contention: bool) -> dict:
    import bench_overlap as bench

    return {mode: bench.measure(sim, contention) for mode, sim in runs.items()}


def test_the_compute_stream_never_waits_behind_another_units_replay(runs):
    """Issue 48 item 1: with the CUDA defaults (side stream, prefetch 1) and prefetch 2, no
    wait of the compute stream covers a replay of another unit than the one whose backward
    is running. Before the fix: every unit's backward waited for the previous unit's whole
    prefetched replay (8 such waits per prefetched unit, measured by the review)."""
    for mode in ("ac2 side, prefetch 1", "ac2 side, prefetch 2"):
        r = runs[mode].timeline()
        assert r.late_waits() == [], mode
        assert any(k.unit is not None and r.streams.get(i.stream, "").startswith("stream")
                   for i in r.intervals for k in [r.kernels[i.kernel]]), "replays ran on the side stream"


@pytest.mark.parametrize("contention", [True, False])
def test_backward_time_with_side_prefetch_is_no_worse(runs, contention):
    """Backward wall time with side-stream prefetch is at most inline's and torch's
    checkpoint's x 1.02 (the same saved set: recompute everything)."""
    f = _figures(runs, contention)
    for mode in ("ac2 side, prefetch 1", "ac2 side, prefetch 2"):
        assert f[mode]["backward_ms"] <= f["ac2 inline"]["backward_ms"] * 1.0001, (mode, f)
        assert f[mode]["backward_ms"] <= f["torch checkpoint"]["backward_ms"] * 1.02, (mode, f)
        assert f[mode]["late_waits"] == 0


def test_hidden_replay_time_against_the_ideal(runs):
    """With the device shared, a replay can only hide in the device's idle time of the
    backward (the ideal); with streams in parallel, under the compute stream's work. The
    side stream with prefetch 1 reaches the ideal with the device shared, and hides most
    of the replay with streams in parallel; inline hides only what the ideal allows too."""
    shared, parallel = _figures(runs, True), _figures(runs, False)
    side = "ac2 side, prefetch 1"
    hidden = shared[side]["replay_ms"] - shared[side]["exposed_ms"]
    assert hidden >= 0.8 * shared[side]["ideal_ms"] - 1e-9, shared[side]
    assert parallel[side]["hidden_pct"] >= 50, parallel[side]
    assert parallel[side]["backward_ms"] < parallel["ac2 inline"]["backward_ms"], (parallel[side], parallel["ac2 inline"])


def test_what_side_streams_cost_in_memory(runs):
    """Note [What side streams cost] in ac2_dist/_streams.py, bounded part by part against
    torch's checkpoint. Allocated: the side stream's cuBLAS workspace, and what prefetch 1
    holds beyond inline: paced by bytes (Note [A prefetch holds one unit's values ahead] in
    _prefetch.py), at most one block's no-AC activations (unpaced it was two: 143.1 MiB
    allocated here against 134.7). Reserved: the same, plus the granularity of the side
    stream's own pool (a 20 MiB segment for its large blocks, another for the rest).
    Before the hand-over stopped using record_stream, a replayed value was held until the
    compute stream's execution reached its free (4 blocks of 1024 wide: 1590 MiB reserved
    with the holds, 1366 without, 856 inline)."""
    f = _figures(runs, True)
    torch_, inline, side = f["torch checkpoint"], f["ac2 inline"], f["ac2 side, prefetch 1"]
    block = _block_activations(runs) / MiB
    workspace = DEV.cublas_workspace / MiB
    assert inline["allocated_mib"] <= torch_["allocated_mib"] and inline["reserved_mib"] <= torch_["reserved_mib"]
    assert side["allocated_mib"] <= torch_["allocated_mib"] + workspace + block, (side, torch_, block)
    assert side["reserved_mib"] <= torch_["reserved_mib"] + workspace + block + 2 * 20, (side, torch_, block)


def _block_activations(runs) -> int:
    """One block's saved activations without AC: (no AC's peak allocated - inline's) over
    the blocks whose activations no AC keeps and inline does not (all but the last)."""
    none, inline = runs["no AC"].timeline(), runs["ac2 inline"].timeline()
    return (none.peak_allocated - inline.peak_allocated) // (CFG["layers"] - 1)


def test_every_mode_is_eagers_gradients_and_green_under_the_checker(one_rank):
    """The runs above checked streams (run_mode calls check()); here the gradients of the
    side-stream prefetch under FSDP2 and the simulation are eager's, bit for bit."""
    import bench_overlap as bench
    from _simfsdp import fsdp_model, fsdp_on
    from models import LlamaBlock

    cfg = bench.Config(layers=3, dim=64, heads=4, seq=32, batch=2)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(1))
    grads = []
    for use_ac in (False, True):
        torch.manual_seed(0)
        with SimCuda(timeline=DEV) as sim, fsdp_on(sim):
            model = fsdp_model(cfg.layers, cfg.dim, cfg.heads, cfg.vocab, max_seq=cfg.seq)
            if use_ac:
                ac.apply_ac(model, "recompute_all", modules=[LlamaBlock])  # CUDA defaults under the simulation
            F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            grads.append([p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()])
        sim.check()
    assert_bitwise(grads[0], grads[1])


def test_backward_on_autograd_s_device_thread(one_rank):
    """On a GPU, backward runs on autograd's device thread: there the side stream is that
    thread's (Note [One side stream per device] in _streams.py), its host lane its own.
    Run so here: green, eager's gradients, the replays on a side stream made by that thread."""
    from models import Llama, LlamaBlock

    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))

    def model():
        torch.manual_seed(0)
        return Llama(vocab=64, dim=32, layers=4, heads=4)

    eager = model()
    F.cross_entropy(eager(tokens).flatten(0, 1), tokens.flatten()).backward()
    with SimCuda(timeline=DEV) as sim:
        m = ac.apply_ac(model(), "recompute_all", modules=[LlamaBlock])
        loss = F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten())
        th = threading.Thread(target=loss.backward)
        th.start()
        th.join()
    sim.check()
    assert_bitwise([p.grad for p in eager.parameters()], [p.grad for p in m.parameters()])
    r = sim.timeline()
    side_streams = {i.stream for i in r.intervals if r.kernels[i.kernel].unit is not None} - {0}
    assert len(side_streams) == 1 and sim.stats.streams_created == 1 and len(r.lane_end) == 2


def _fsdp_rank(rank: int, world: int) -> dict:
    import _simtime
    from _simcuda import SimCuda
    from _simfsdp import fsdp_model, fsdp_on
    from models import LlamaBlock

    import ac2_dist as ac

    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(rank))
    out = {}
    for mode in ("no AC", "ac2"):
        torch.manual_seed(0)
        with SimCuda(timeline=_simtime.device("h100")) as sim, fsdp_on(sim):
            model = fsdp_model(3, 32, 4, 64, max_seq=32)
            if mode == "ac2":
                ac.apply_ac(model, "recompute_all", modules=[LlamaBlock])  # CUDA defaults: side stream, prefetch 1
            losses = []
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
                loss.backward()
                losses.append(loss.item())
            sim.synchronize()
        sim.check()
        names = {s.name for s in sim.streams}
        out[mode] = {"losses": losses, "grads": [p.grad.to_local().clone() for p in model.parameters()],
                     "streams": sorted(names), "late": sim.timeline().late_waits()}
    # Tensors do not cross the process boundary well: compare here.
    same = len(out["ac2"]["grads"]) == len(out["no AC"]["grads"]) and all(
        torch.equal(a, b) for a, b in zip(out["ac2"]["grads"], out["no AC"]["grads"]))
    for r in out.values():
        del r["grads"]
    out["bitwise"] = same
    return out


def test_fsdp2_on_two_ranks_under_the_simulation():
    """FSDP2 on 2 gloo ranks with its own streams mapped (tests/_simfsdp.py) and ac2's CUDA
    defaults: no stream hazard on either rank, no late wait, and every rank's gradients
    bitwise those of the same run without AC."""
    from _dist import run_ranks

    for rank, r in enumerate(run_ranks(_fsdp_rank)):
        assert r["ac2"]["losses"] == r["no AC"]["losses"], rank
        assert r["bitwise"], rank
        assert {"fsdp-all-gather", "fsdp-reduce-scatter"} <= set(r["ac2"]["streams"])
        assert r["ac2"]["late"] == []


def _overlap(r, kind: str, with_stream: int, lo: float = 0.0, hi: float = float("inf")) -> tuple[float, float]:
    """(seconds of ``kind`` transfers in [lo, hi), of which ``with_stream`` was computing at the same time)."""
    busy = sorted((i.start, i.end) for i in r.intervals if i.stream == with_stream and r.kernels[i.kernel].kind == "compute")
    total = hidden = 0.0
    for i in r.intervals:
        if r.kernels[i.kernel].kind != kind or not lo <= i.start < hi:
            continue
        total += i.end - i.start
        hidden += sum(max(0.0, min(e, i.end) - max(s, i.start)) for s, e in busy)
    return total, hidden


@pytest.mark.skipif(not hasattr(torch.utils.checkpoint.CheckpointPolicy, "MUST_CPU_OFFLOAD"),
                    reason="CheckpointPolicy.MUST_CPU_OFFLOAD exists from torch 2.11")
def test_offload_copies_overlap_compute_on_the_timeline():
    """The offload schedule (Note [The offload schedule] in offload.py) on the timeline: the
    device->host copies of block i run on the copy engine while block i+1 computes, and
    the host->device copies come back during the previous block's backward (prefetch 1)."""
    from models import Llama, LlamaBlock

    cp = torch.utils.checkpoint.CheckpointPolicy

    def offload_mm(ctx, op, *args, **kwargs):
        return cp.MUST_CPU_OFFLOAD if op is torch.ops.aten.mm.default else cp.PREFER_RECOMPUTE

    tokens = torch.randint(0, 64, (2, 256), generator=torch.Generator().manual_seed(0))
    with SimCuda(timeline=_simtime.device("h100", host_op_s=0.5e-6)) as sim:
        torch.manual_seed(0)
        model = ac.apply_ac(Llama(vocab=64, dim=256, layers=6, heads=4), offload_mm, modules=[LlamaBlock])
        sim.mark("forward")
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        sim.mark("backward")
        loss.backward()
        sim.synchronize()
    sim.check()
    r = sim.timeline()
    fwd, bwd = r.marks["forward"][0], r.marks["backward"][0]
    d2h, d2h_hidden = _overlap(r, "d2h", 0, fwd, bwd)
    h2d, h2d_hidden = _overlap(r, "h2d", 0, bwd)
    assert d2h > 0 and h2d > 0
    assert d2h_hidden >= 0.8 * d2h, (d2h, d2h_hidden)
    assert h2d_hidden >= 0.5 * h2d, (h2d, h2d_hidden)
