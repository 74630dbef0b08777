"""Per-rank memory reports (CONTRACT §8): the numbers, not just the fields."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn
from _dist import run_ranks

import ac2_dist as ac
from ac2_dist import memory
from ac2_dist.report import main as report_main

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
    stats = [g.stats for g in tracker.graphs]
    # mm and tanh of every layer (tanh_L's backward needs its output; mm_i's needs
    # tanh_{i-1}). The transposed weight autograd saves for mm is a view of the
    # parameter that the pack hook sees as a region input: not replayed.
    assert report.recomputed_ops == sum(s.recomputed_ops for s in stats) == 2 * L
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
    assert r.recomputed_ops == 3 * 2 * L
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
