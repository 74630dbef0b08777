"""What ac2 reads from the CUDA caching allocator, on a simulated one (tests/_sim_allocator.py):

* ``memory.track`` reads no allocator statistic and resets none: a user's
  ``max_memory_allocated()`` around a tracked step reads the step's true peak;
* ``MemoryBudget(peak=...)`` on CUDA measures with no profiler session, from the
  allocator's memory history and counters (Note [Measuring a CUDA step without a
  profiler] in ac2_dist/_measure/_alloc_history.py), exactly when blocks are what the history
  says, and leaves the statistics and a user's own recording as it found them."""

from __future__ import annotations

import copy

import pytest
import torch
from _sim_allocator import SimAllocator
from models import GPTBlock, GPTStack

import ac2_dist as ac
import ac2_dist._modules as modules_mod
import ac2_dist._plan._peak as peak_mod
import ac2_dist.memory as memory_mod
from ac2_dist._measure._alloc_history import AllocatorHistory

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def sim(monkeypatch):
    return SimAllocator().install(monkeypatch)


def _history(sim, script):
    """Run ``script`` (alloc sizes > 0, frees < 0 as -index of an earlier alloc, or a
    mark name) in an AllocatorHistory; returns it and the true (live, peak) per mark."""
    keys = []
    truth: dict[str, list[int]] = {}
    current = None
    meter = AllocatorHistory(CUDA0)
    with meter:
        for item in script:
            if isinstance(item, str):
                meter.plan_mark(item)
                current = truth.setdefault(item, [sim.current, sim.current])
            elif item > 0:
                keys.append(sim.alloc(item))
            else:
                sim.free(keys[-item])
            if current is not None:
                current[1] = max(current[1], sim.current)
    return meter, {k: tuple(v) for k, v in truth.items()}


def test_history_spans_are_the_allocators_figures(sim):
    before = sim.alloc(4096)  # allocated before the step: part of every figure, never freed in it
    script = ["a", 1 << 20, 3 << 20, -0, 512, "b", 100, -1, 7 << 20, -3, "c", -2, -4, 2048]
    meter, truth = _history(sim, script)
    assert meter.problem is None
    assert meter.spans(["a", "b", "c"]) == truth
    # an unwanted mark does not split a span; a wanted one marked twice keeps its first mark
    spans = meter.spans(["a", "c"])
    assert spans["a"] == (truth["a"][0], max(truth["a"][1], truth["b"][1])) and spans["c"] == truth["c"]
    assert sim.history is None  # it switched the recording on, and off again
    assert sim.calls["reset_peak_memory_stats"] == 0 and sim.calls["reset_accumulated_memory_stats"] == 0
    sim.free(before)


def test_requested_sizes_are_rounded_like_the_allocators_blocks(sim):
    meter, truth = _history(sim, ["a", 1, 513, 100_000, -1, "b", -0, -2, 7])
    assert meter.problem is None and meter.spans(["a", "b"]) == truth


def test_a_users_recording_is_read_and_left_running(sim):
    torch.cuda.memory._record_memory_history(enabled="all", context="all", max_entries=10_000)
    early = sim.alloc(1000)  # recorded before the step: not part of it
    meter, truth = _history(sim, ["a", 4096, 8192, -0, "b", -1])
    assert meter.problem is None and meter.spans(["a", "b"]) == truth
    assert sim.history is not None and sim.history[0]["size"] == 1000  # theirs, untouched
    sim.free(early)


def test_a_history_that_lost_entries_or_reset_counters_is_not_read(sim):
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=3)  # someone's short recording
    meter, _ = _history(sim, ["a", 512, 512, 512, -0, -1, "b", -2])
    assert meter.problem is not None and "kept 3 of the step's 6" in meter.problem
    assert meter.spans(["a", "b"]) == {}
    torch.cuda.memory._record_memory_history(enabled=None)
    meter = AllocatorHistory(CUDA0)
    with meter:
        meter.plan_mark("a")
        sim.alloc(512)
        torch.cuda.reset_accumulated_memory_stats()
        meter.plan_mark("b")
    assert meter.problem == "the allocator's counters were reset during the step"


def test_the_async_allocator_keeps_no_history(sim):
    sim.backend = "cudaMallocAsync"
    seen = []
    meter = AllocatorHistory(CUDA0)
    meter.on_exit.append(seen.append)
    with meter:
        meter.plan_mark("a")
        sim.alloc(512)
    assert seen == [meter] and "'cudaMallocAsync', which keeps no memory history" in meter.problem
    assert sim.calls["_record_memory_history"] == 0 and meter.spans(["a"]) == {}


def _cuda_budget_model(monkeypatch):
    """A CPU GPT whose regions decide CUDA (the planner measures the CUDA way); replays
    inline (nothing else of CUDA runs)."""
    monkeypatch.setattr(modules_mod, "device_of", lambda *a, **k: CUDA0)
    monkeypatch.setattr(peak_mod, "device_of", lambda *a, **k: CUDA0)  # a step begun at the model's forward
    torch.manual_seed(0)
    base = GPTStack(3, 64, 4)
    x = torch.randn(4, 64, 64)
    budget = ac.MemoryBudget(peak="64MiB")
    model = ac.apply_ac(copy.deepcopy(base), budget, modules=[GPTBlock],
                        replay=ac.ReplayConfig(stream="inline", prefetch=0))
    return model, x, budget


def test_the_peak_planner_on_cuda_measures_without_a_profiler(sim, monkeypatch):
    model, x, budget = _cuda_budget_model(monkeypatch)
    profiled = []

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        profiled.append(torch._C._autograd._profiler_enabled())
        loss.backward()
        profiled.append(torch._C._autograd._profiler_enabled())

    truths = []
    with sim.feeding():
        for _ in range(4):
            sim.true_peak = sim.current
            step()
            truths.append(sim.true_peak)
    planner = budget.peak_planner
    assert planner.device == CUDA0
    assert profiled and not any(profiled)  # no profiler session at any point of a step
    measured = [r for r in planner.history if r.measured is not None]
    assert measured, planner.describe()
    # step 1 (the floor) measured as the allocator saw it: its peak from the model's forward on
    assert planner.history[0].step == 0 and planner.history[0].measured == truths[0], (planner.describe(), truths)
    assert sim.calls["reset_peak_memory_stats"] == 0 and sim.calls["reset_accumulated_memory_stats"] == 0
    budget.close()
    assert sim.history is None  # its recording is off once it stopped measuring


def test_memory_track_leaves_max_memory_allocated_to_the_user(sim, monkeypatch):
    monkeypatch.setattr(memory_mod, "module_cuda_device", lambda m: CUDA0)  # the tracker takes its CUDA path
    torch.manual_seed(0)
    model = ac.apply_ac(GPTStack(3, 64, 4), "recompute_all", modules=[GPTBlock])
    x = torch.randn(4, 64, 64)
    with sim.feeding():
        for tracked in (False, True):
            model.zero_grad(set_to_none=True)
            torch.cuda.reset_peak_memory_stats()  # the user's
            sim.true_peak = sim.current
            if tracked:
                with ac.memory.track(model) as tracker:
                    model(x).square().mean().backward()
            else:
                model(x).square().mean().backward()
            assert torch.cuda.max_memory_allocated() == sim.true_peak  # the step's true peak
    assert tracker.report().device == "cuda"
    assert sim.calls["reset_peak_memory_stats"] == 2  # the user's two, none of the tracker's
    assert sim.calls["memory_stats"] == 0 and sim.calls["memory_allocated"] == 0
