"""Steps of ``ac2_dist.memory.track`` (issue 19 items 5 and 6).

A tracker keeps no region's graph alive past its step, and a pipeline schedule step (or
any run of microbatches whose forwards wait for their backwards) is one step. Figures are
checked against the allocator's own events (``AllocationTrace``, torch.profiler memory
events) around an identical *untracked* step in the same process: a measuring tool must
not change what it measures.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
from _dist import run_ranks
from torch._subclasses.fake_tensor import is_fake

import ac2_dist as ac
from ac2_dist import memory
from ac2_dist._measure._alloc import AllocationTrace
from ac2_dist._trace._graph import Graph

D, B = 64, 32


def _close(got: int, want: int, rel: float = 0.02) -> bool:
    return abs(got - want) <= rel * want


# ---- item 5: a tracker keeps no graph alive ------------------------------------------


class _DropBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, hidden)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(hidden, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.tanh(self.fc1(x))))


def _dropout_model() -> nn.Module:
    # The first block is the widest: its backward (the last one) is the peak, reached
    # when the later blocks' graphs are gone, unless something keeps them alive.
    torch.manual_seed(0)
    model = nn.Sequential(*[_DropBlock(h) for h in (512, 64, 64, 64)])
    return ac.apply_ac(model, "recompute_all", modules=[_DropBlock], rng="replay")  # hf.enable's default


def _untracked_figures(model: nn.Module, x: torch.Tensor, steps: int) -> tuple[int, int, int]:
    """Largest step's forward peak, bytes alive when forward returned, and backward peak,
    each above the bytes allocated when that step began: allocator events, with marks
    where the tracker's hooks are (the model's call and its return)."""
    with AllocationTrace() as trace:
        for i in range(steps):
            trace.mark(f"forward:{i}")
            out = model(x)
            trace.mark(f"backward:{i}")
            loss = out.sum()
            del out
            loss.backward()
            del loss
    fwd = [trace.phases[f"forward:{i}"] for i in range(steps)]
    bwd = [trace.phases[f"backward:{i}"] for i in range(steps)]
    return (
        max(f.peak_bytes - f.start_bytes for f in fwd),
        max(b.start_bytes - f.start_bytes for f, b in zip(fwd, bwd)),
        max(b.peak_bytes - f.start_bytes for f, b in zip(fwd, bwd)),
    )


def _alive() -> tuple[int, int]:
    """(ac2 graphs alive, bytes of the unique storages of all tensors alive), from gc."""
    gc.collect()
    graphs, storages = 0, {}
    for o in gc.get_objects():
        kind = type(o)
        if kind is Graph:
            graphs += 1
        elif issubclass(kind, torch.Tensor) and not is_fake(o) and o.device.type == "cpu":
            s = o.untyped_storage()  # (fake tensors another test left in gc have no data)
            storages[s.data_ptr()] = s.nbytes()
    return graphs, sum(storages.values())


def _bytes_freed_by(fn) -> int:
    """Bytes the CPU allocator frees while ``fn`` runs (torch.profiler memory events; the
    allocator reports frees of blocks allocated during an earlier profiling session, such
    as a tracker's, with their size)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return -sum(e.cpu_memory_usage for e in prof.events() if e.name == "[memory]" and e.cpu_memory_usage < 0)


def test_tracked_steps_keep_no_graph_alive_and_match_untracked_figures():
    model = _dropout_model()
    x = torch.randn(B, D)
    model(x).sum().backward()  # warm-up: gradients exist from here on
    untracked = _untracked_figures(model, x, steps=4)
    before = _alive()
    after_each_step = []
    with memory.track(model) as tracker:
        for _ in range(4):
            model(x).sum().backward()
            after_each_step.append(_alive())
    report = tracker.report()
    assert report.steps == 4
    # Nothing of a step survives it: no graph, and not one byte more alive step over step.
    assert after_each_step == [before] * 4, (before, after_each_step)
    # ... and the tracker holds nothing the allocator would free when it is dropped.
    holder = [tracker]
    del tracker
    assert _bytes_freed_by(lambda: (holder.clear(), gc.collect())) == 0
    got = (report.peak_bytes_forward, report.live_bytes_after_forward, report.peak_bytes_backward)
    assert all(_close(g, w) for g, w in zip(got, untracked)), (got, untracked)
    assert report.recomputed_ops > 0


# ---- item 6: steps of microbatched and pipelined training ----------------------------


class _Block(nn.Module):
    def __init__(self, hidden: int = 256) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, hidden)
        self.fc2 = nn.Linear(hidden, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def _blocks(seed: int, n: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(*[_Block() for _ in range(n)])
    # Saving the matmuls keeps memory per microbatch in flight, so "after forward" differs
    # between one microbatch and all of them.
    return ac.apply_ac(model, [torch.ops.aten.addmm.default], modules=[_Block])


class _Marks:
    """Marks an AllocationTrace at the start and the end of every forward of a module,
    and when each of its backwards starts (the reference's own phase boundaries; marks
    allocate nothing)."""

    def __init__(self, module: nn.Module, backward: bool = False) -> None:
        self.trace: AllocationTrace | None = None
        self.n = self.nb = 0
        self.last_was_forward, self.switches, self.out_bytes = False, [], 0
        self.hooks = [module.register_forward_pre_hook(self._start), module.register_forward_hook(self._end)]
        if backward:  # a full backward hook wraps the module's outputs: only where asked
            self.hooks.append(module.register_full_backward_pre_hook(self._backward))

    def _backward(self, *args) -> None:
        name = f"backward:{self.nb}"
        self.trace.mark(name)
        if self.last_was_forward:  # a backward right after a forward: a forward phase ends here
            self.switches.append(name)
        self.last_was_forward = False
        self.nb += 1

    def _start(self, *args) -> None:
        self.trace.mark(f"forward:{self.n}")

    def _end(self, module, args, output) -> None:
        self.trace.mark(f"after:{self.n}")
        self.out_bytes = max(self.out_bytes, output.nbytes)
        self.last_was_forward = True
        self.n += 1

    def measure(self, step) -> dict[str, int]:
        """One untracked ``step()`` under the allocator's trace: its peak, the peaks of its
        forward and backward phases, and the bytes alive at each forward's end (above
        the bytes allocated when the step began)."""
        self.n = self.nb = 0
        self.last_was_forward, self.switches, self.out_bytes = False, [], 0
        with AllocationTrace() as trace:
            self.trace = trace
            step()
        for h in self.hooks:
            h.remove()
        forwards = [trace.phases[f"forward:{k}"] for k in range(self.n)]
        others = [trace.phases[f"after:{k}"] for k in range(self.n)]  # to the next mark
        backwards = [trace.phases[f"backward:{k}"] for k in range(self.nb)]
        base = forwards[0].start_bytes
        return {
            "peak": trace.whole.peak_bytes - base,
            "forward": max(p.peak_bytes for p in forwards) - base,
            "backward": max(p.peak_bytes for p in others + backwards) - base,
            "after_forward": [p.start_bytes - base for p in others],
            # the most bytes alive when a backward starts right after a forward (the first
            # replay after forwards: where a tracker without a model ends a forward phase)
            "at_backward": max(trace.phases[n].start_bytes for n in self.switches) - base if self.switches else None,
            "out_bytes": self.out_bytes,  # the largest forward output: its gradient arrives before a replay
        }


def _check(report: memory.RankReport, ref: dict, steps: int, exact_phases: bool) -> None:
    assert report.steps == steps, report
    peak = max(report.peak_bytes_forward, report.peak_bytes_backward)
    assert _close(peak, ref["peak"]), (peak, ref)
    if exact_phases:  # the tracker's phases are the reference's: the model's call and return
        assert _close(report.peak_bytes_forward, ref["forward"]), (report, ref)
        assert _close(report.peak_bytes_backward, ref["backward"]), (report, ref)
        assert _close(report.live_bytes_after_forward, max(ref["after_forward"])), (report, ref)
    else:  # without a model a forward phase ends at the first replay, when the first backward starts
        # (torch 2.15's GPipe frees its forward send buffers before that: not the last after_forward)
        # (the first replay follows the backward's start by the output's gradient at most)
        live, start = report.live_bytes_after_forward, ref["at_backward"]
        assert 0.98 * start <= live <= start + ref["out_bytes"], (report, ref)


def _one_f_one_b(model: nn.Module, xs: list[torch.Tensor], order: str) -> None:
    """Microbatches by hand in a pipeline order, e.g. "FFBFBFBB" (1F1B's first stage)."""
    losses, f = [], 0
    for op in order:
        if op == "F":
            losses.append(model(xs[f]).square().mean())
            f += 1
        else:
            losses.pop(0).backward()


@pytest.mark.parametrize("order", ["FFFFBBBB", "FFBFBFBB"], ids=["gpipe", "1f1b"])
@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no_model"])
def test_microbatches_in_flight_make_one_step(order, with_model):
    """Forwards waiting for their backwards are one step (a new step starts at a
    forward only when none is in flight); peaks are from that step's start."""
    model = _blocks(0)
    xs = list(torch.randn(4 * 8, D).chunk(4))

    def step():
        _one_f_one_b(model, xs, order)
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    ref = _Marks(model, backward=True).measure(step)
    if order == "FFFFBBBB":  # all four microbatches are alive after the last forward
        assert ref["after_forward"][3] > 3 * ref["after_forward"][0] > 0
    with memory.track(model if with_model else None) as tracker:
        step()
        step()
    _check(tracker.report(), ref, steps=2, exact_phases=with_model)


def _pipeline_rank(rank: int, world: int, schedule: str, variants: tuple[str, ...]) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage_module = _blocks(rank)
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    pipe = cls(stage, 4, loss_fn=lambda out, target: (out - target).square().mean())
    torch.manual_seed(100)
    x, target = torch.randn(B, D), torch.randn(B, D)

    def step():
        if rank == 0:
            pipe.step(x)
        else:
            pipe.step(target=target, losses=[])
        stage_module.zero_grad(set_to_none=True)

    step()  # warm-up: the stage allocates its send/receive buffers on its first step
    ref = _Marks(stage_module, backward=True).measure(step)  # an identical untracked schedule step
    reports = {}
    for name in variants:
        with memory.track(None if name == "no_model" else stage_module) as tracker:
            for _ in range(2):
                if name == "explicit":
                    tracker.step()
                step()
        reports[name] = tracker.report()
    return {"ref": ref, **reports}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_schedule_step_is_one_step(schedule):
    """torch.distributed.pipelining on 2 gloo ranks, 4 microbatches, each stage's blocks
    checkpointed: one step per schedule step, with a model and without."""
    for rank, result in enumerate(run_ranks(_pipeline_rank, schedule, ("model", "no_model"))):
        ref = result["ref"]
        if schedule == "gpipe":  # all 4 microbatches are in flight after the last forward
            assert ref["after_forward"][3] > 3 * ref["after_forward"][0] > 0, (rank, ref)
        _check(result["model"], ref, steps=2, exact_phases=True)
        _check(result["no_model"], ref, steps=2, exact_phases=False)


def test_pipeline_steps_by_hand():
    """``tracker.step()`` before each schedule step: the same steps and figures (1F1B,
    whose last stage finishes each microbatch before the next one starts)."""
    for result in run_ranks(_pipeline_rank, "1f1b", ("explicit",)):
        _check(result["explicit"], result["ref"], steps=2, exact_phases=True)


# ---- step boundaries ----------------------------------------------------------------


def test_forward_whose_graph_is_freed_is_not_in_flight():
    """A forward whose output is dropped without backward (an evaluation with grad
    enabled) does not hold the next forward in its step; one kept and differentiated
    later does (gradient accumulation over two losses)."""
    model = _blocks(0)
    x = torch.randn(8, D)
    with memory.track(model) as tracker:
        for _ in range(2):
            model(x)  # freed at once: its own step, as any model forward before
            model(x).sum().backward()
    assert tracker.report().steps == 4
    with memory.track(model) as tracker:
        for _ in range(2):
            first = model(x).sum()
            (first + model(x).sum()).backward()
    assert tracker.report().steps == 2
    with memory.track(model) as tracker:
        with torch.no_grad():  # never in flight
            model(x)
            model(x)
    assert tracker.report().steps == 2


def test_explicit_step_turns_detection_off():
    model = _blocks(0)
    x = torch.randn(8, D)
    with memory.track(model) as tracker:
        for _ in range(3):
            tracker.step()
            for _ in range(2):  # two micro-iterations of gradient accumulation
                model(x).sum().backward()
    assert tracker.report().steps == 3
    with memory.track() as tracker:  # without a model a step is open from the start
        for _ in range(3):
            tracker.step()  # the first one restarts that step instead of leaving it empty
            with ac.apply_ac_policy("recompute_all"):
                loss = model(x).sum()
            loss.backward()
    assert tracker.report().steps == 3
    with pytest.raises(RuntimeError, match="while the tracker is active"):
        tracker.step()


def test_no_hook_outlives_the_tracker():
    """An output kept past the block carries no tracker hook; backward through it later
    changes nothing in the report."""
    model = _blocks(0)
    x = torch.randn(8, D)
    with memory.track(model) as tracker:
        out = model(x)
    before = tracker.report().to_dict()
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is memory._Forward]  # its pre-hook was removed
    assert not model._forward_pre_hooks and not model._forward_hooks
    out.sum().backward()
    assert tracker.report().to_dict() == before
