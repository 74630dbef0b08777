"""Per-rank memory reports: the numbers, not just the fields."""

from __future__ import annotations

import json
import os
import sys

import _hang
import pytest
import torch
import torch.nn as nn
from _dist import run_ranks

import ac2_dist as ac
from ac2_dist import memory
from ac2_dist._region import _thread_state
from ac2_dist._sizes import human_bytes as human
from ac2_dist.report import main as report_main

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

B, D, L = 8, 64, 4
ONE = B * D * 4  # bytes of one activation


def _chain():
    torch.manual_seed(0)
    layers = []
    for _ in range(L):
        layers += [nn.Linear(D, D, bias=False), nn.Tanh()]
    return nn.Sequential(*layers)


def _tracked_step(policy, batch=B):
    model = _chain()
    if policy is not None:
        ac.apply_ac(model, policy)
    x = torch.randn(batch, D)
    with memory.track(model) as tracker:
        model(x).sum().backward()
    return tracker


@pytest.mark.parametrize(
    ("policy", "total", "by_reason"),
    [
        ("recompute_all", ONE, {"boundary": ONE}),  # only the region input
        ("must_save_all", (L + 1) * ONE, {"boundary": ONE, "policy": L * ONE}),  # + every tanh output
        ([torch.ops.aten.mm.default], (L + 1) * ONE, {"boundary": ONE, "policy": L * ONE}),  # + mm outputs
    ],
)
def test_saved_bytes_match_analytic_sizes(policy, total, by_reason):
    report = _tracked_step(policy).report()
    assert abs(report.saved_bytes - total) <= 0.05 * total
    for reason, nbytes in by_reason.items():
        assert report.saved_bytes_by_reason[reason] == nbytes, report.saved_bytes_by_reason
    assert sum(report.saved_bytes_by_reason.values()) == report.saved_bytes
    assert report.per_module[""]["saved_bytes"] == report.saved_bytes


def test_recompute_figures_match_the_graph():
    tracker = _tracked_step("recompute_all")
    report = tracker.report()
    stats = tracker.graph_stats  # every region's counters; its graph was freed by backward
    assert len(stats) == 1 and not list(tracker.graphs)
    # mm and tanh of every layer (tanh_L's backward needs its output; mm_i's needs
    # tanh_{i-1}), and the transposed weight autograd saves for mm: a view of the
    # parameter, replayed from it (Note [Versions of view outputs]; under FSDP the
    # parameter is unsharded again before the view is taken), allocating nothing.
    assert report.recomputed_ops == sum(s.recomputed_ops for s in stats) == 3 * L
    assert report.recomputed_bytes == sum(s.recomputed_bytes for s in stats) == 2 * L * ONE
    assert report.per_module[""]["recomputed_bytes"] == report.recomputed_bytes
    assert report.replay_seconds > 0
    assert _tracked_step("must_save_all").report().recomputed_ops == 0


def test_peak_backward_below_no_ac():
    def blocks(policy):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh()) for _ in range(L)])
        if policy is not None:  # one region per block: backward replays one block at a time
            ac.apply_ac(model, policy, modules=lambda fqn, m: fqn.isdigit())
        x = torch.randn(256, D)
        with memory.track(model) as tracker:
            model(x).sum().backward()
        return tracker.report()

    no_ac, full = blocks(None), blocks("recompute_all")
    assert no_ac.saved_bytes == 0 and no_ac.recomputed_ops == 0
    assert 0 < full.peak_bytes_backward < no_ac.peak_bytes_backward
    assert full.peak_bytes_forward < no_ac.peak_bytes_forward
    assert full.steps == no_ac.steps == 1
    assert set(full.per_module) == {"0", "1", "2", "3"}


def test_tracking_without_a_model_and_multiple_steps():
    model = _chain()
    x = torch.randn(B, D)
    with memory.track() as tracker:
        for _ in range(3):
            with ac.apply_ac_policy("recompute_all"):
                y = model(x).sum()
            y.backward()
    r = tracker.report()
    assert r.recomputed_ops == 3 * 3 * L  # mm, tanh and the weight's t() (above)
    assert r.saved_bytes == ONE and r.peak_bytes_backward > 0 and r.steps == 3
    with pytest.raises(RuntimeError, match="already active"):
        with memory.track(), memory.track():
            pass
    from torch.profiler import profile

    with profile(), pytest.raises(RuntimeError, match="inside another profiler"):
        with memory.track():
            pass
    with memory.track() as again:  # nothing was left behind by the refusals
        pass
    assert again.report().steps == 1


def test_json_round_trip_table_cli_and_png(tmp_path, capsys):
    reports = [_tracked_step("recompute_all").report(), _tracked_step("must_save_all").report()]
    reports[1].rank = 1
    for r in reports:
        r.world_size = 2
    path = os.path.join(tmp_path, "run.json")
    memory.save_run(reports, path)
    data = json.load(open(path))
    assert data["schema_version"] == memory.SCHEMA_VERSION and len(data["ranks"]) == 2
    required = {"schema_version", "rank", "world_size", "device", "peak_bytes_forward", "peak_bytes_backward",
                "saved_bytes", "saved_bytes_by_reason", "recomputed_ops", "recomputed_bytes", "replay_seconds",
                "collectives_not_replayed", "allgathers_backward", "per_module"}
    assert required <= set(data["ranks"][0])
    assert memory.load_run(path) == reports
    with pytest.raises(ValueError, match="schema_version"):
        memory.RankReport.from_dict({**reports[0].to_dict(), "schema_version": 99})
    png = os.path.join(tmp_path, "run.png")
    if _has_matplotlib():
        assert report_main([path, "--png", png]) == 0
        assert os.path.getsize(png) > 1000
    else:
        assert report_main([path]) == 0
    out = capsys.readouterr().out
    assert "saved after forward" in out and "rank 1" in out and "imbalance" in out
    assert report_main([os.path.join(tmp_path, "missing.json")]) == 2


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib (the 'plot' extra) not installed")
def test_plot_writes_png(tmp_path):
    path = os.path.join(tmp_path, "r.png")
    memory.plot([_tracked_step("recompute_all").report()], path)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _ranks_with_different_batches(rank, world):
    model = _chain()
    ac.apply_ac(model, "must_save_all")
    x = torch.randn(4 if rank == 0 else 12, D)
    with memory.track(model) as tracker:
        loss = model(x).sum()
        stat = loss.detach().clone()
        torch.distributed.all_reduce(stat)  # outside any region: not counted
        loss.backward()
    reports = memory.gather(tracker.report())
    return None if reports is None else (memory.format_table(reports), [r.to_dict() for r in reports])


def test_gather_on_two_ranks_shows_imbalance():
    results = run_ranks(_ranks_with_different_batches)
    assert results[1] is None  # gathered on rank 0 only
    table, dicts = results[0]
    reports = [memory.RankReport.from_dict(d) for d in dicts]
    assert [r.rank for r in reports] == [0, 1] and all(r.world_size == 2 for r in reports)
    assert reports[1].saved_bytes == 3 * reports[0].saved_bytes  # 12 vs 4 rows
    saved_row = next(line for line in table.splitlines() if line.startswith("saved after forward"))
    assert saved_row.rstrip().endswith("1.50x")  # max / mean = 3 / 2
    print("\n" + table)


def test_multi_step_figures_are_per_step_and_tracker_is_single_use(tmp_path):
    def run(steps):
        model = _chain()
        ac.apply_ac(model, "recompute_all")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(B, D)
        with memory.track(model) as tracker:
            for _ in range(steps):
                model(x).sum().backward()
                opt.step()  # momentum buffers appear after step 1: not activations
                opt.zero_grad(set_to_none=True)
        return tracker

    one, three = run(1).report(), run(3).report()
    assert three.steps == 3
    assert three.peak_bytes_forward == one.peak_bytes_forward
    assert three.live_bytes_after_forward == one.live_bytes_after_forward
    assert three.recomputed_ops == 3 * one.recomputed_ops
    tracker = run(1)
    with pytest.raises(RuntimeError, match="single-use"):
        with tracker:
            pass
    bad = os.path.join(tmp_path, "list.json")
    with open(bad, "w") as f:
        f.write("[]")
    assert report_main([bad]) == 2


def _gather_without_numpy(rank, world):
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("numpy is importable: the test's sitecustomize did not run")
    return _ranks_with_different_batches(rank, world)


_CHILD = """
import json, sys
from _dist import run_ranks
import test_memory_report as t
results = run_ranks(t._gather_without_numpy)
assert results[1] is None
print(json.dumps(results[0][1]))
"""


def test_gather_without_numpy(tmp_path):
    """torch does not depend on numpy; dist.gather_object does (tensor.numpy())."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['numpy'] = None  # as if not installed\n")
    path = [str(site), TESTS, ROOT, os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    proc = _hang.run([sys.executable, "-c", _CHILD], env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    reports = [memory.RankReport.from_dict(d) for d in json.loads(proc.stdout.splitlines()[-1])]
    assert [r.rank for r in reports] == [0, 1]
    assert reports[1].saved_bytes == 3 * reports[0].saved_bytes > 0


def test_gather_json_without_a_process_group():
    assert memory._gather_json({"a": (1, 2)}) == [{"a": [1, 2]}]  # JSON round trip, as on ranks
    r = memory.RankReport(saved_bytes=5)
    assert memory.gather(r) == [r]


@pytest.mark.parametrize("bad", [[nn.Linear(2, 2)], "model", 3, {"m": nn.Linear(2, 2)}],
                         ids=["list", "str", "int", "dict"])
def test_track_rejects_a_non_module_and_leaves_nothing_behind(bad):
    with pytest.raises(TypeError, match=r"track\(model\): model must be a torch.nn.Module or None, got "):
        with memory.track(bad):
            pass
    assert _thread_state().tracker is None
    with memory.track(_chain()) as tracker:  # not "already active"
        pass
    assert tracker.report().steps == 0


class _BrokenParameters(nn.Module):
    def parameters(self, recurse: bool = True):
        raise RuntimeError("parameters() failed")


def test_failed_start_is_undone():
    model = _BrokenParameters()
    with pytest.raises(RuntimeError, match="parameters\\(\\) failed"):
        with memory.track(model):
            pass
    assert _thread_state().tracker is None
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not torch._C._autograd._profiler_enabled()
    chain = _chain()
    with ac.apply_ac_policy("recompute_all"):  # no dead tracker collects this graph
        chain(torch.randn(B, D)).sum().backward()
    with memory.track() as tracker:
        pass
    assert tracker.graphs == []


def test_report_is_final_when_the_block_exits():
    """A replay after the block (backward outside it) does not call back into the tracker."""
    model = _chain()
    x = torch.randn(B, D)
    with memory.track() as tracker:
        with ac.apply_ac_policy("recompute_all"):
            y = model(x).sum()
    before = tracker.report().to_dict()
    graphs = list(tracker.graphs)  # alive while y is
    assert len(graphs) == 1 and all(g.tracker is None for g in graphs)
    y.backward()
    assert tracker.report().to_dict() == before
    assert all(g.tracker is None for g in tracker.graphs)


def test_frees_of_blocks_from_an_earlier_trace_do_not_count():
    """Figures do not depend on what an earlier profiling session left behind: a block
    allocated in an earlier trace and freed mid-forward (as garbage collection of an
    earlier test's graphs does) is not this step's memory."""
    ref = _tracked_step("recompute_all").report()
    with memory.track():
        old = [torch.empty(64 * ONE, dtype=torch.uint8)]  # outlives its trace
    model = _chain()
    ac.apply_ac(model, "recompute_all")
    model[0].register_forward_pre_hook(lambda *args: old.clear())
    x = torch.randn(B, D)
    with memory.track(model) as tracker:
        model(x).sum().backward()
    r = tracker.report()
    assert not old
    assert r.peak_bytes_forward == ref.peak_bytes_forward > 0
    assert r.live_bytes_after_forward == ref.live_bytes_after_forward > 0
    assert r.peak_bytes_backward == ref.peak_bytes_backward > 0


def test_offloaded_values_in_host_memory_are_not_device_bytes():
    """saved_bytes is what ac2 holds in the device's memory after forward; an offloaded
    value whose host copy is the one kept counts in saved_host_bytes instead (the
    schedule's CPU test mode: stream="inline" copies CPU tensors into host buffers)."""
    CP = torch.utils.checkpoint.CheckpointPolicy
    if not hasattr(CP, "MUST_CPU_OFFLOAD"):
        pytest.skip(f"CheckpointPolicy.MUST_CPU_OFFLOAD does not exist in torch {torch.__version__}")
    from models import Llama, LlamaBlock

    def offload_mm(ctx, op, *args, **kwargs):
        return CP.MUST_CPU_OFFLOAD if op is torch.ops.aten.mm.default else CP.PREFER_RECOMPUTE

    def run(offload):
        torch.manual_seed(0)
        model = ac.apply_ac(Llama(vocab=64, dim=32, layers=4, heads=4), offload_mm, modules=[LlamaBlock],
                            replay=ac.ReplayConfig(stream="inline", prefetch=0, offload=offload))
        tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
        with ac.memory.track(model) as tracker:
            torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        return tracker.report()

    kept = run(ac.Offload(defer=1, stream="inline", log=lambda e, f: None))
    # defer=1: when forward ends, blocks 0-2 were committed (their host copies kept), the last kept on the device
    host = {fqn: m.get("saved_host_bytes", 0) for fqn, m in kept.per_module.items()}
    assert host["layers.0"] > 0 and host["layers.1"] > 0 and host["layers.2"] > 0 and host["layers.3"] == 0, host
    assert kept.saved_host_bytes == sum(host.values())
    assert kept.saved_bytes == sum(kept.saved_bytes_by_reason.values())
    assert kept.saved_bytes_by_reason["offloaded"] > 0  # the last block's, still on the device
    # The same values without the schedule (a region copies nothing on CPU): all device bytes.
    plain = run(None)
    assert plain.saved_host_bytes == 0
    # What left the device is in host buffers of the pool's size classes (Note [Pinned
    # buffer pool] in offload.py: at most a quarter more than asked, in 512-byte steps).
    moved = plain.saved_bytes - kept.saved_bytes
    assert moved <= kept.saved_host_bytes <= 1.25 * moved, (kept, plain)
    table = ac.memory.format_table([kept])
    assert "saved in host memory" in table and "in host memory)" in table
    assert ac.memory.RankReport.from_dict(kept.to_dict()) == kept


def test_save_run_on_a_rank_without_reports_writes_nothing(tmp_path):
    """Every rank calls gather() and save_run() (README); the ranks where gather returned
    None write nothing, and rank 0's file is not touched by them."""
    path = os.path.join(tmp_path, "run.json")
    memory.save_run(None, path)
    assert not os.path.exists(path)
    memory.save_run([memory.RankReport(rank=0, world_size=2), memory.RankReport(rank=1, world_size=2)], path)
    memory.save_run(None, path)
    assert [r.rank for r in memory.load_run(path)] == [0, 1]


def test_a_single_rank_table_has_one_value_column():
    """Issue 41: a world-size-1 report prints its own column only (min / max / imbalance
    of one value say nothing); two ranks still get the cross-rank columns."""
    report = _tracked_step("recompute_all").report()
    assert report.world_size == 1 and report.peak_bytes_backward > 0
    lines = memory.format_table([report]).splitlines()
    assert lines[0].split() == ["metric", "rank", "0"], lines[0]
    peak = next(line for line in lines if line.startswith("peak backward"))
    assert peak.split("peak backward")[1].split() == human(report.peak_bytes_backward).split(), peak
    assert not any(word in lines[0] for word in ("min", "max", "imbalance"))
    assert "per module (saved / recomputed):" in lines
    other = memory.RankReport.from_dict({**report.to_dict(), "rank": 1, "world_size": 2})
    two = memory.format_table([memory.RankReport.from_dict({**report.to_dict(), "world_size": 2}), other])
    assert two.splitlines()[0].split()[-3:] == ["min", "max", "imbalance"]
    assert "per module (saved / recomputed), by rank:" in two


def test_what_is_not_a_report_is_refused_at_the_door(tmp_path):
    """Issue 47: gather(tracker) without .report() was accepted and failed only at the next
    call; format_table took anything. Each now raises TypeError at once, naming the call,
    what it got and (for a tracker) the fix; one RankReport is a one-rank table."""
    tracker = _tracked_step("recompute_all")
    report = tracker.report()
    for call in (lambda: memory.gather(tracker), lambda: memory.format_table(tracker),
                 lambda: memory.save_run(tracker, str(tmp_path / "run.json")), lambda: memory.plot(tracker, "x.png")):
        with pytest.raises(TypeError, match=r"got a Tracker \(call its \.report\(\) for this rank's RankReport\)"):
            call()
    assert not (tmp_path / "run.json").exists()
    with pytest.raises(TypeError, match=r"memory\.format_table takes a list of RankReport .* got a dict"):
        memory.format_table(report.to_dict())
    with pytest.raises(TypeError, match=r"memory\.format_table: item 1 of the list is a str, not a RankReport"):
        memory.format_table([report, "rank 1"])
    with pytest.raises(TypeError, match=r"memory\.gather takes this rank's RankReport .* got a list"):
        memory.gather([report])
    assert memory.format_table(report) == memory.format_table([report])
    assert memory.format_table(None) == memory.format_table([]) == "(no reports)"
    assert memory.gather(report) == [report]
