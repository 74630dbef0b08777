"""ac2_dist.MemoryBudget(peak=...): a physical per-rank peak target for the
whole step. Every figure is the allocator's (tests/_models.peak_from), measured in the same
run beside eager's, independently of the planner's own estimate; gradients are eager's."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from _models import assert_bitwise, peak_from
from models import GPTBlock, GPTStack, Llama, LlamaBlock
from torch.utils.flop_counter import FlopCounterMode

import ac2_dist as ac
from ac2_dist._sizes import parse_size

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)  # of the way from the floor's peak to no-AC's
STEPS = 7  # the floor, up to 4 planned steps (Note [Verify, correct, stay put]), 2 settled
TOLERANCE = 1.02


def _gpt():
    torch.manual_seed(0)
    x = torch.randn(4, 64, 64)
    return GPTStack(4, 64, 4), GPTBlock, (lambda m: m(x).square().mean()), (lambda m: m)


def _llama():
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    model = Llama(vocab=64, dim=64, layers=4, heads=4, max_seq=64)
    return model, LlamaBlock, (lambda m: F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten())), \
        (lambda m: m)


def _measured(model, first, loss_fn, steps):
    return [peak_from(model, first(model), loss_fn) for _ in range(steps)]


def _decisions(budget, fqns):
    return {f: budget.plan(f).decisions for f in fqns}


def _backward_flops(model, loss_fn) -> int:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    counter = FlopCounterMode(display=False)
    with counter:
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
def test_peak_targets_hold_from_step_1_converge_and_order_recompute(make):
    base, block, loss_fn, first = make()
    eager_peak, want = _measured(copy.deepcopy(base), first, loss_fn, 2)[-1]
    floor_model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=[block])
    floor_peak = _measured(floor_model, first, loss_fn, 2)[-1][0]
    assert floor_peak < eager_peak
    fqns = [n for n, m in base.named_modules() if isinstance(m, block)]
    flops, used = [], []
    for f in FRACTIONS:
        target = floor_peak + round(f * (eager_peak - floor_peak))
        budget = ac.MemoryBudget(peak=target)
        model = ac.apply_ac(copy.deepcopy(base), budget, modules=[block])
        plans = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a feasible target never warns
            for step in range(STEPS):
                peak, grads = peak_from(model, first(model), loss_fn)
                assert peak <= target * TOLERANCE, (f, step + 1, peak, target, budget.format_plan(detail=True))
                assert_bitwise(want, grads)
                plans.append(_decisions(budget, fqns))
        # Converged: steps 5-7 follow identical saved sets (a measured step is used when
        # the next one begins, so plans[k] is what step k+1 followed).
        assert plans[4] == plans[5] == plans[6], budget.format_plan(detail=True)
        planner = budget.peak_planner
        assert planner.state == "settled", planner.describe()
        assert planner.floor_peak == floor_peak, planner.describe()  # the planner's own reading
        used.append(peak / target)
        flops.append(_backward_flops(model, loss_fn))
    # A larger target never recomputes more.
    assert all(b <= a for a, b in zip(flops, flops[1:])), flops
    assert flops[0] > flops[-1]
    # The memory is used: the settled plans climb to the target (0.85 before the climb; torch
    # 2.13 measures 0.972-1.0 here).
    assert min(used) >= 0.95, used


def test_infeasible_target_warns_once_with_the_floor_and_runs_at_the_floor():
    base, block, loss_fn, first = _gpt()
    floor_model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=[block])
    floor_peak = _measured(floor_model, first, loss_fn, 2)[-1][0]
    budget = ac.MemoryBudget(peak=floor_peak // 2)
    model = ac.apply_ac(copy.deepcopy(base), budget, modules=[block])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peaks = [peak_from(model, first(model), loss_fn)[0] for _ in range(4)]
    msgs = [str(w.message) for w in caught if "MemoryBudget(peak=" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert f"{floor_peak} bytes" in msgs[0] and "raise the target" in msgs[0] and "strict=True" in msgs[0]
    assert all(p == floor_peak for p in peaks), (peaks, floor_peak)
    assert budget.peak_planner.choice is None

    strict = ac.MemoryBudget(peak=floor_peak // 2, strict=True)
    model = ac.apply_ac(copy.deepcopy(base), strict, modules=[block])
    peak_from(model, first(model), loss_fn)  # step 1 runs (at the floor) and measures it
    with pytest.raises(RuntimeError, match=rf"measured peak .* {floor_peak} bytes.*strict=True"):
        peak_from(model, first(model), loss_fn)


def test_the_planner_measures_on_its_own_and_leaves_no_profiler_running():
    base, block, loss_fn, first = _llama()
    eager_peak = _measured(copy.deepcopy(base), first, loss_fn, 2)[-1][0]
    floor_model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=[block])
    floor_peak = _measured(floor_model, first, loss_fn, 2)[-1][0]
    target = (floor_peak + eager_peak) // 2
    budget = ac.MemoryBudget(peak=target)
    model = ac.apply_ac(copy.deepcopy(base), budget, modules=[block])
    for _ in range(STEPS):  # nobody else traces: the planner traces the floor and its planned steps on its own
        model.zero_grad(set_to_none=True)
        loss_fn(model).backward()
    assert budget.peak_planner.state == "settled", budget.peak_planner.describe()
    assert not torch._C._autograd._profiler_enabled()  # settled: its last trace stopped

    # memory.track started between two measuring steps stops the planner's own trace first.
    other = ac.apply_ac(copy.deepcopy(base), ac.MemoryBudget(peak=target), modules=[block])
    other.zero_grad(set_to_none=True)
    loss_fn(other).backward()
    assert torch._C._autograd._profiler_enabled()  # the planner's trace runs until the next step
    with ac.memory.track(other):
        other.zero_grad(set_to_none=True)
        loss_fn(other).backward()
    assert not torch._C._autograd._profiler_enabled()
    planner = budget.peak_planner
    assert planner.state == "settled" and planner.measured is not None, planner.describe()
    assert planner.measured <= target
    peak, _ = peak_from(model, first(model), loss_fn)  # an independent reading of the settled plan
    assert peak <= target * TOLERANCE
    assert peak >= 0.85 * target
    text = budget.format_plan(detail=True)
    for what in ("peak target", "floor (measured)", "predicted", "measured", "layers.0", "saved"):
        assert what in text, text
    # memory.track reports the target, the predicted and the measured peak per planned module.
    model.zero_grad(set_to_none=True)
    with ac.memory.track(model) as tracker:
        loss_fn(model).backward()
    entry = tracker.report().per_module["layers.0"]
    assert entry["peak_target_bytes"] == target
    assert entry["peak_predicted_bytes"] == planner.predicted
    assert 0 < entry["peak_measured_bytes"] <= target * TOLERANCE
    assert "step peak target" in ac.memory.format_table([tracker.report()])


def test_format_plan_is_a_short_summary_with_the_detail_on_request():
    """Issue 41: format_plan() printed 117 lines for 4 blocks; its summary has the same few
    lines for 4 blocks and for 8, the full text is format_plan(detail=True)."""

    def run(blocks):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[_MLP() for _ in range(blocks)])
        budget = ac.MemoryBudget(peak="3MiB")
        ac.apply_ac(model, budget, modules=[_MLP])
        for _ in range(STEPS):
            model(torch.randn(256, 64)).sum().backward()
        budget.close()
        return budget.format_plan(), budget.format_plan(detail=True)

    (four, four_detail), (eight, eight_detail) = run(4), run(8)
    assert len(four.splitlines()) == len(eight.splitlines()) <= 6, (four, eight)
    for what in ("peak target 3.0 MiB", "settled", "floor (measured)", "predicted", "measured", "saved above the floor",
                 "op outputs saved", "recomputed", "estimated recompute", "detail=True"):
        assert what in four, (what, four)
    assert "4 planned modules" in four and "8 planned modules" in eight
    assert "aten." not in four and "0: budget" not in four
    assert four_detail.startswith(four.splitlines()[0]) and "0: budget" in four_detail and "7: budget" in eight_detail
    assert len(eight_detail.splitlines()) > len(four_detail.splitlines()) > 2 * len(four.splitlines())


def test_the_plan_survives_a_step_in_another_structure():
    base, block, loss_fn, first = _gpt()
    budget = ac.MemoryBudget(peak=3 << 20)
    model = ac.apply_ac(copy.deepcopy(base), budget, modules=[block])
    for _ in range(STEPS):
        peak_from(model, first(model), loss_fn)
    assert budget.peak_planner.state == "settled", budget.peak_planner.describe()
    fqns = [f"blocks.{i}" for i in range(4)]
    settled = _decisions(budget, fqns)
    assert any(ac.CheckpointPolicy.PREFER_SAVE in d for d in settled.values())
    # Under FlopCounterMode ops dispatch differently (another structure: calibrated at the floor) ...
    _backward_flops(model, loss_fn)
    with FlopCounterMode(display=False):
        model.zero_grad(set_to_none=True)
        loss_fn(model).backward()
    # ... and the next plain step follows the peak plan again.
    peak, _ = peak_from(model, first(model), loss_fn)
    assert _decisions(budget, fqns) == settled
    assert peak <= (3 << 20) * TOLERANCE and peak >= 0.85 * (3 << 20)


def test_drop_in_checkpoint_calls_are_planned_by_position():
    """ac.checkpoint(fn) regions have no module name: each call of a step is its own slot."""
    base, block, loss_fn, first = _gpt()
    eager_peak = _measured(copy.deepcopy(base), first, loss_fn, 2)[-1][0]
    x = torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    budget = ac.MemoryBudget(peak=eager_peak * 3 // 4)

    def dropin(m):
        h = x
        for blk in m.blocks:
            h = ac.checkpoint(blk, h, policy=budget)
        return h.square().mean()

    def plain(m):
        h = x
        for blk in m.blocks:
            h = blk(h)
        return h.square().mean()

    model = copy.deepcopy(base)
    reference = copy.deepcopy(base)
    _, want = peak_from(reference, reference.blocks[0], plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        peaks = []
        for _ in range(STEPS):
            peak, grads = peak_from(model, model.blocks[0], dropin)
            assert_bitwise(want, grads)
            peaks.append(peak)
    planner = budget.peak_planner
    assert planner.state == "settled" and planner.choice is not None, planner.describe()
    assert all(p <= budget.peak_planner.target * TOLERANCE for p in peaks), (peaks, planner.describe())
    assert sorted(c.fqn for c in planner.structure) == ["", "[1]", "[2]", "[3]"]


def test_microbatches_in_flight_are_not_measured_and_say_so():
    """Under a pipeline schedule several forwards run before their backwards: no step of
    the planner's can be measured, so it stays at the floor and warns once (README)."""
    base, block, loss_fn, first = _gpt()
    budget = ac.MemoryBudget(peak="64MiB")
    model = ac.apply_ac(copy.deepcopy(base), budget, modules=[block])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # 1F1B-like: F1 F2 B1 B2
            model.zero_grad(set_to_none=True)
            a, b = loss_fn(model), loss_fn(model)
            a.backward()
            b.backward()
    msgs = [str(w.message) for w in caught if "could not be measured" in str(w.message)]
    assert len(msgs) == 1 and "microbatches in flight" in msgs[0], msgs
    planner = budget.peak_planner
    assert planner.choice is None and planner.floor_peak is None, planner.describe()
    assert torch._C._autograd._profiler_enabled()  # the last step's trace waits for a next step ...
    budget.close()
    assert not torch._C._autograd._profiler_enabled()  # ... or for close()


def test_a_foreign_profiler_makes_the_planner_wait_and_say_what_to_do():
    """Note [A profiler session of the user's]: on CPU a user's profiler session cannot
    be read; the planner keeps its plan, warns once with what to do, does not give up
    however long the session runs, and measures once it ended."""
    from ac2_dist._plan._peak_verify import _UNMEASURED

    base, block, loss_fn, first = _gpt()
    budget = ac.MemoryBudget(peak="64MiB")
    model = ac.apply_ac(copy.deepcopy(base), budget, modules=[block])

    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(model).backward()

    planner = budget.peak_planner
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.profiler.profile():
            for _ in range(_UNMEASURED + 2):  # longer than the planner waits for other problems
                step()
        assert planner.state == "floor" and planner.floor_peak is None, planner.describe()
        for _ in range(3):
            step()
    msgs = [str(w.message) for w in caught if "did not start is running" in str(w.message)]
    assert len(msgs) == 1, [str(w.message) for w in caught]
    assert "after your session ends" in msgs[0] and "budget.describe()" in msgs[0] and "memory.track" in msgs[0]
    assert not [w for w in caught if "could not be measured" in str(w.message)]
    assert planner.floor_peak is not None and planner.state != "floor", planner.describe()
    budget.close()


@pytest.mark.parametrize("value,nbytes", [(4096, 4096), ("512MiB", 512 << 20), ("70GiB", 70 << 30),
                                          ("1.5 GB", 1_500_000_000), ("2kib", 2048), ("100", 100)])
def test_sizes(value, nbytes):
    assert parse_size(value) == nbytes
    assert repr(ac.MemoryBudget(peak=value)) == f"MemoryBudget(peak={value!r})"


@pytest.mark.parametrize("kwargs,error,match", [
    ({"peak": 0}, ValueError, "peak must be > 0"),
    ({"peak": -5}, ValueError, "peak must be > 0"),
    ({"peak": "0GiB"}, ValueError, "peak must be > 0"),
    ({"peak": "lots"}, ValueError, "peak='lots' is not a size"),
    ({"peak": "12 parsecs"}, ValueError, "is not a size"),
    ({"peak": 1.5e9}, TypeError, "peak must be an int"),
    ({"peak": True}, TypeError, "peak must be an int"),
    ({"peak": "1GiB", "fraction": 0.5}, TypeError, "exactly one of fraction, bytes or peak .got fraction and peak"),
    ({"peak": "1GiB", "bytes": 10}, TypeError, "exactly one"),
    ({"fraction": 0.5, "strict": True}, TypeError, "strict applies to a peak target"),
    ({"peak": "1GiB", "strict": 1}, TypeError, "strict must be a bool"),
    ({"peak": lambda rank: "nope"}, ValueError, r"peak \(returned for rank 0\)='nope' is not a size"),
])
def test_bad_input_is_refused_before_any_forward(kwargs, error, match):
    with pytest.raises(error, match=match):
        ac.MemoryBudget(**kwargs)


def test_pickles_and_refuses_nesting():
    budget = pickle.loads(pickle.dumps(ac.MemoryBudget(peak="1GiB", strict=True)))
    assert repr(budget) == "MemoryBudget(peak='1GiB', strict=True)"
    base, block, loss_fn, first = _gpt()
    outer = ac.apply_ac(copy.deepcopy(base), "recompute_all")  # the whole model is a region
    model = ac.apply_ac(outer, ac.MemoryBudget(peak="1GiB"), modules=[block])
    with pytest.raises(ValueError, match="blocks.0 runs inside another ac2 region"):
        loss_fn(model)
    assert not torch._C._autograd._profiler_enabled()
    # The refused region left no region behind: a plain forward runs.
    model.zero_grad(set_to_none=True)
    base(torch.randn(2, 8, 64)).sum().backward()


# ---- 2 FSDP2 ranks ------------------------------------------------------------------------


def _dist_run(rank, world, kind, fractions):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (world,))
    # Activations dominate (dim 32, 1024 tokens per rank): FSDP's own buffers, freed when
    # gloo's threads finish a collective, move a step's peak by a few of their sizes.
    tokens = torch.randint(0, 64, (8, 128), generator=torch.Generator().manual_seed(10 + rank))

    def loss_fn(m):
        return F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten())

    def build(policy):
        torch.manual_seed(0)
        model = Llama(vocab=64, dim=32, layers=4, heads=4, max_seq=128)
        if policy is not None:
            ac.apply_ac(model, policy, modules=[LlamaBlock])
        if kind == "ddp":
            return DistributedDataParallel(model)
        for blk in model.layers:
            if kind == "fsdp-nested":  # the block's attention and MLP are units of their own
                fully_shard(blk.attention, mesh=mesh)
                fully_shard(blk.feed_forward, mesh=mesh)
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def local(grads):
        return [g.to_local().clone() if hasattr(g, "to_local") else g.clone() for g in grads]

    def first(m):  # where a step begins: the model apply_ac was given (Note [What a peak target bounds])
        return m.module if kind == "ddp" else m

    eager = _measured(build(None), first, loss_fn, 4)
    want = local(eager[-1][1])
    floor = _measured(build("recompute_all"), first, loss_fn, 4)
    eager_peaks, floor_peaks = [p for p, _ in eager[1:]], [p for p, _ in floor[1:]]
    # The step-to-step spread of a fixed plan under FSDP on gloo, measured in this run.
    spread = max(max(eager_peaks) - min(eager_peaks), max(floor_peaks) - min(floor_peaks))
    out = {"eager_peak": max(eager_peaks), "floor_peak": max(floor_peaks), "spread": spread, "runs": []}
    for f in fractions:
        # The same target on both ranks: the larger of their figures.
        t = torch.tensor([max(floor_peaks) + round(f * (max(eager_peaks) - max(floor_peaks)))])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        target = int(t.item())
        budget = ac.MemoryBudget(peak=target)
        model = build(budget)
        peaks, bitwise, plans = [], [], []
        for _ in range(STEPS):
            peak, grads = peak_from(model, first(model), loss_fn)
            peaks.append(peak)
            bitwise.append(all(torch.equal(a, b) for a, b in zip(want, local(grads))))
            plans.append([budget.plan(f"layers.{i}").decisions for i in range(4)])
        out["runs"].append({"target": target, "peaks": peaks, "bitwise": bitwise,
                            "plans": [[[d.name for d in p] for p in step] for step in plans],
                            "state": budget.peak_planner.state, "describe": budget.format_plan(detail=True)})
    return out


@pytest.mark.parametrize("kind,fractions", [("fsdp", FRACTIONS), ("fsdp-nested", (0.0, 0.5, 1.0)),
                                            ("ddp", (0.0, 0.5, 1.0))])
def test_peak_target_on_two_ranks_same_plan_on_every_rank(kind, fractions):
    """FSDP2 per-block units, FSDP2 units nested in the blocks, DDP: 2 gloo ranks."""
    results = run_ranks(_dist_run, kind, fractions)
    for rank, out in enumerate(results):
        assert out["floor_peak"] < out["eager_peak"]
        assert out["spread"] <= 0.05 * out["floor_peak"], out  # the slack below stays small
        for run in out["runs"]:
            # At every step: within 2% of the target plus the spread FSDP itself showed.
            limit = run["target"] * TOLERANCE + out["spread"]
            assert all(p <= limit for p in run["peaks"]), (rank, run["peaks"], limit, run["describe"])
            assert all(run["bitwise"]), (rank, run["bitwise"])
            # One plan from step 6 on (what the guide promises: the floor, at most 4 planned
            # steps, then the cheapest plan measured within the target, which need not be
            # step 5's: a 4th planned step happens when gloo's timing put a step over).
            assert run["plans"][5] == run["plans"][6], run["describe"]
            assert run["state"] == "settled", run["describe"]
    for a, b in zip(results[0]["runs"], results[1]["runs"]):
        assert a["plans"] == b["plans"]  # Note [One plan on every rank]


def _tracked_fsdp_run(rank, world):
    """A peak target under FSDP2 per-block units: steps 1-5 untracked (the planner traces
    them itself: the floor and up to 4 planned steps), steps 6-8 each under memory.track."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    tokens = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(10 + rank))

    def build(policy):
        torch.manual_seed(0)
        model = ac.apply_ac(Llama(vocab=256, dim=128, layers=4, heads=4, max_seq=128), policy, modules=[LlamaBlock])
        for blk in model.layers:
            fully_shard(blk, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def step(model, tracked):
        model.zero_grad(set_to_none=True)
        if not tracked:
            F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            return None
        with ac.memory.track(model) as tracker:
            F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        r = tracker.report()
        return max(r.peak_bytes_forward, r.peak_bytes_backward)

    ends = []
    for policy in ("recompute_all", "must_save_all"):  # the report's peaks at both ends
        model = build(policy)
        ends.append(max(step(model, True) for _ in range(2)))
    # One target for both ranks, half-way: a plan that saves some blocks' values, not all.
    t = torch.tensor([(ends[0] + ends[1]) // 2])
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    target = int(t.item())
    budget = ac.MemoryBudget(peak=target)
    model = build(budget)
    planner = budget.peak_planner
    states, reports, planned = [], [], []
    for k in range(8):
        reports.append(step(model, tracked=k >= 5))
        states.append(planner.state)  # as of this step's start (a step is used at the next one's)
        planned.append(planner.last_seen)
    budget.close()
    return {"target": target, "ends": ends, "states": states, "reports": reports, "planned": planned,
            "plan": budget.format_plan(detail=True)}


def test_memory_track_sees_the_peak_target_met_under_fsdp():
    """Issue 41: under FSDP2 the planner said 54.6 MiB (within 55 MiB) while memory.track
    reported 62.6 MiB for the same steps: the planner's step began at the first block,
    after FSDP's root all-gather and the embedding. Both now begin at the model's
    forward: once the plan settles, each rank's report peak is within the target, and
    the planner's figure is the report's."""
    for rank, out in enumerate(run_ranks(_tracked_fsdp_run)):
        target, plan = out["target"], out["plan"]
        assert out["ends"][0] < target < out["ends"][1], out
        assert out["states"][5:] == ["settled"] * 3, (rank, out["states"], plan)
        for peak, planned in zip(out["reports"][5:], out["planned"][5:]):
            assert peak <= target * TOLERANCE, (rank, out["reports"], target, plan)
            assert abs(planned - peak) <= 0.01 * peak, (rank, out["reports"], out["planned"], plan)


# ---- no hang: pipeline stages and per-rank targets --------------------------------------------


class _MLP(torch.nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def _pipeline_rank(rank, world, schedule, plan=None):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(rank)
    budget = ac.MemoryBudget(peak=plan[0], plan=plan[1]) if plan else ac.MemoryBudget(peak="1GiB")
    installed = budget.peak_planner.choice
    stage_module = ac.apply_ac(torch.nn.Sequential(_MLP(), _MLP()), budget, modules=[_MLP])
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    pipe = cls(stage, 4, loss_fn=lambda out, target: (out - target).square().mean())
    x, target = torch.randn(32, 64), torch.randn(32, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            if rank == 0:
                pipe.step(x)
            else:
                pipe.step(target=target, losses=[])
            stage_module.zero_grad(set_to_none=True)
    planner = budget.peak_planner
    return {"state": planner.state, "choice": planner.choice, "installed": installed,
            "profiler": torch._C._autograd._profiler_enabled(),
            "warnings": [str(w.message) for w in caught if "pipeline schedule" in str(w.message)],
            "plan": budget.format_plan(detail=True)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_stages_stay_at_the_floor_without_collectives(schedule):
    """Stages reach a step's first region at different times: the planner of a pipeline
    stage measures nothing and issues no collective (it would deadlock), says so once."""
    for out in run_ranks(_pipeline_rank, schedule):
        assert out["state"] == "pipelined" and out["choice"] is None, out
        assert len(out["warnings"]) == 1 and not out["profiler"], out
        assert "at the floor: a torch.distributed.pipelining stage" in out["plan"], out["plan"]


def test_a_plan_file_for_one_microbatch_a_step_is_not_followed_under_a_pipeline(tmp_path):
    """A plan file simulated without ``pipeline=`` plans one microbatch's saves; under a
    schedule each microbatch in flight would hold them, so the stage drops it for the
    floor (Note [A pipeline rank's plan is followed as simulated] in
    ac2_dist/_plan/_peak_pipeline.py), and says so once."""
    from ac2_dist.simulate import simulate

    report = simulate(lambda: torch.nn.Sequential(_MLP(), _MLP()), batch=lambda: torch.randn(8, 64), blocks=[_MLP],
                      world_size=1, fsdp=None, device="cpu", modes=["none", "full"])
    target = report.mode("no AC").peak_bytes
    report.plan(target)
    path = str(tmp_path / "plan.json")
    report.save_plan(path)
    for out in run_ranks(_pipeline_rank, "1f1b", (target, path)):
        assert out["installed"] is not None, out  # the file's plan saves something
        assert out["state"] == "pipelined" and out["choice"] is None, out
        assert len(out["warnings"]) == 1 and "at the floor" in out["plan"], out


def _per_rank_targets(rank, world):
    from torch.nn.parallel import DistributedDataParallel

    base, block, loss_fn, first = _gpt()
    floor_model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=[block])
    floor_peak = _measured(floor_model, first, loss_fn, 2)[-1][0]
    # Rank 0 below its floor (settles at once), rank 1 planning for a few steps: the ranks
    # settle at different steps and must still issue the same collectives.
    budget = ac.MemoryBudget(peak=lambda r: floor_peak // 2 if r == 0 else floor_peak * 2)
    model = DistributedDataParallel(ac.apply_ac(copy.deepcopy(base), budget, modules=[block]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS + 1):
            model.zero_grad(set_to_none=True)
            loss_fn(model.module).backward()
    budget.close()
    planner = budget.peak_planner
    return {"state": planner.state, "choice": planner.choice, "all_settled": planner.all_settled, "plan": planner.describe(),
            "infeasible": sum("above the target" in str(w.message) for w in caught)}


def test_per_rank_targets_settle_at_different_steps_without_a_hang():
    r0, r1 = run_ranks(_per_rank_targets)
    assert r0["state"] == "settled" and r0["choice"] is None and r0["infeasible"] == 1, r0
    assert r1["state"] == "settled" and r1["choice"] is not None and r1["infeasible"] == 0, r1
    assert r0["all_settled"] and r1["all_settled"]


# ---- third-party models ------------------------------------------------------------------------


def _hf_model(name):
    T = pytest.importorskip("transformers", reason="the 'test' extra installs transformers")
    import test_hf_models as H

    torch.manual_seed(0)
    if name == "resnet":  # BatchNorm CNN: each basic layer is a block
        model = T.ResNetForImageClassification(T.ResNetConfig(
            num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[2, 2], layer_type="basic",
            num_labels=10))
        types = [type(model.resnet.encoder.stages[0].layers[0])]
    else:
        model = H.MODELS[name]()
        types = H._layer_types(model)
    return model.train(), types, H._inputs(model)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "mixtral", "resnet"])
def test_third_party_models_meet_the_target(name):
    """Hugging Face models from small configs (GPT-2/BERT with dropout 0.1, Mixtral MoE, a
    BatchNorm ResNet), HF's checkpointed layer types: at the floor, midway and no-AC's peak,
    every step's allocator peak <= target x 1.02 and gradients bitwise eager's."""
    base, types, inputs = _hf_model(name)

    def first(m):  # where a step begins: the model apply_ac was given (Note [What a peak target bounds])
        return m

    def loss_fn(m):
        return m(**inputs).logits.float().square().mean()

    eager_peak, want = _measured(copy.deepcopy(base), first, loss_fn, 2)[-1]
    floor_peak = _measured(ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=types), first, loss_fn, 2)[-1][0]
    assert floor_peak < eager_peak
    for f in (0.0, 0.5, 1.0):
        target = floor_peak + round(f * (eager_peak - floor_peak))
        budget = ac.MemoryBudget(peak=target)
        model = ac.apply_ac(copy.deepcopy(base), budget, modules=types)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            for step in range(STEPS):
                peak, grads = peak_from(model, first(model), loss_fn)
                assert peak <= target * TOLERANCE, (name, f, step + 1, peak, target, budget.format_plan(detail=True))
                assert_bitwise(want, grads)
        assert budget.peak_planner.state == "settled", budget.format_plan(detail=True)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hf_enable_with_a_peak_target_bounds_the_step_from_the_models_forward(name):
    """``hf.enable(model, MemoryBudget(peak=...))``: the target bounds the step as it does
    through ``apply_ac`` -- from the model's forward (its embeddings, masks and position
    tensors are made before the first layer), every step's allocator peak <= target x 1.02,
    gradients bitwise eager's."""
    from ac2_dist.integrations import hf

    base, _, inputs = _hf_model(name)

    def first(m):
        return m

    def loss_fn(m):
        return m(**inputs).logits.float().square().mean()

    eager_peak, want = _measured(copy.deepcopy(base), first, loss_fn, 2)[-1]
    floor_peak = _measured(hf.enable(copy.deepcopy(base), "recompute_all"), first, loss_fn, 2)[-1][0]
    assert floor_peak < eager_peak
    for f in (0.0, 0.5):
        target = floor_peak + round(f * (eager_peak - floor_peak))
        budget = ac.MemoryBudget(peak=target)
        model = hf.enable(copy.deepcopy(base), budget)
        peaks = []
        for step in range(STEPS):
            peak, grads = peak_from(model, first(model), loss_fn)
            peaks.append(peak)
            assert peak <= target * TOLERANCE, (name, f, step + 1, peak, target, budget.format_plan(detail=True))
            assert_bitwise(want, grads)
            if step == 1:  # step 2 began by reading step 1, measured where the allocator's figure begins
                assert budget.peak_planner.floor_peak == peaks[0], (budget.peak_planner.floor_peak, peaks[0])
        assert budget.peak_planner.state == "settled", budget.format_plan(detail=True)


def _steps_at(base, types, loss_fn, fraction):
    """A fresh copy of ``base`` under a peak target ``fraction`` of the way from the floor's
    peak to no AC's, run for ``STEPS`` steps, each one's gradients bitwise eager's:
    (target, the steps' peaks, the budget)."""
    eager_peak, want = _measured(copy.deepcopy(base), lambda m: m, loss_fn, 2)[-1]
    floor_peak = _measured(ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=types), lambda m: m,
                           loss_fn, 2)[-1][0]
    target = floor_peak + round(fraction * (eager_peak - floor_peak))
    budget = ac.MemoryBudget(peak=target)
    model = ac.apply_ac(copy.deepcopy(base), budget, modules=types)
    peaks = []
    for _ in range(STEPS):
        peak, grads = peak_from(model, model, loss_fn)
        peaks.append(peak)
        assert_bitwise(want, grads)
    return target, peaks, budget


@pytest.mark.parametrize("fraction", [0.2, 0.3, 0.7])
def test_a_corrected_plan_stays_within_the_target(fraction):
    """HF GPT-2 (dropout 0.1), 3 blocks, targets 20/30/70 % of the way from the floor's
    peak to no AC's: the first plan measures well under its target, so step 3 runs a
    corrected plan. Priced from the bases step 2 implied (its peaks less all of its
    ``dk``) the corrected plan for 30 % moved saves from the last block to the first two
    and measured 3.6 % over the target at step 3; priced from step 2's peaks up (Note [A
    correction adds to what was measured]), every step is within it."""
    base, types, inputs = _hf_model("gpt2")
    target, peaks, budget = _steps_at(base, types, lambda m: m(**inputs).logits.float().square().mean(), fraction)
    detail = budget.format_plan(detail=True)
    assert max(peaks) <= target * TOLERANCE, (fraction, [p / target for p in peaks], detail)
    assert budget.peak_planner.state == "settled" and peaks[4] == peaks[5] == peaks[6], detail
    assert peaks[1] < 0.97 * target, "the first plan no longer leaves room: this test no longer corrects"


def test_a_correction_prices_options_from_the_measured_plan():
    """``_solve_from``: each option costs what it holds beyond the measured saved set (what it
    stops saving frees nothing); the measured plan stays when nothing else fits; the bases
    returned predict the chosen plan as priced."""
    from ac2_dist._plan._block_problem import _Option
    from ac2_dist._plan._peak_model import _solve, _solve_from

    class Problem:  # held bytes = the sum of the saved values' sizes
        def __init__(self, sizes):
            self.sizes = sizes

        def evaluate(self, saved):
            return sum(self.sizes[s] for s in saved), 0.0, set()

    sizes = {1: 100, 2: 300}
    opts = [_Option(0, 3.0, 0, frozenset()), _Option(100, 2.0, 0, frozenset({1})),
            _Option(300, 1.0, 0, frozenset({2})), _Option(400, 0.0, 0, frozenset({1, 2}))]
    problems = [Problem(sizes), Problem(sizes)]
    peaks = {"fwd:0": 500, "fwd:1": 700, "bwd:1": 900, "bwd:0": 800}
    # Measured: block 0 saved {2}, block 1 saved {1}. Block 0's options cost 0 ({}, {2}) or
    # 100 ({1}, {1, 2}); block 1's 0 ({}, {1}) or 300 ({2}, {1, 2}). Caps: block 0 1100 - 800,
    # blocks 0+1 1100 - 900 = 200. The bases' model (peaks less dk) would allow block 0 {2}
    # with block 1 {2} (300 + 300 <= 1100 - 500); priced from the peaks, block 1 {2} costs 300.
    choice, bases = _solve_from([opts, opts], problems, (2, 1), peaks, 1100)
    assert choice == (3, 1)  # {1, 2} (+100, cost 0) and {1} (+0, cost 2)
    # The bases predict the chosen plan as priced: each peak plus what the plan adds to it.
    assert bases == {"fwd:0": 500 + 100 - 400, "bwd:0": 800 + 100 - 400,
                     "fwd:1": 700 + 100 - 500, "bwd:1": 900 + 100 - 500}
    # Nothing fits (below the measured peak): the measured plan stays, with the bases its step implies.
    choice, bases = _solve_from([opts, opts], problems, (2, 1), peaks, 850)
    assert choice == (2, 1) and bases == {"fwd:0": 200, "bwd:0": 500, "fwd:1": 300, "bwd:1": 500}
    # A floor step (no measured plan): options cost their dk, as the bases' model prices them.
    for target in (900, 1000, 1200, 1300, 1700):
        choice, bases = _solve_from([opts, opts], problems, None, peaks, target)
        assert choice == (_solve([opts, opts], peaks, target) or (0, 0)) and bases == peaks, target


def test_a_correction_prices_a_blocks_own_saves_replay_by_replay():
    """``_solve_from`` with sub-segments of a block's backward (Note [A block's backward,
    replay by replay]): at ``bwd:k/i`` an option of block k adds only what the measured
    plan had not replayed by then; the earlier blocks' options add in full; the bases
    returned predict the chosen plan as priced."""
    from types import SimpleNamespace

    from ac2_dist._plan._block_problem import _Option
    from ac2_dist._plan._peak_model import _solve_from, block_of

    class Problem:  # held bytes = the sum of the saved values' sizes; seq s is policy call s + 10
        def __init__(self, sizes):
            self.sizes = sizes
            self.records = {s: SimpleNamespace(seq=s, call=s - 10) for s in sizes}

        def evaluate(self, saved):
            return sum(self.sizes[s] for s in saved), 0.0, set()

    sizes = {11: 100, 12: 300}
    opts = [_Option(0, 3.0, 0, frozenset()), _Option(100, 2.0, 0, frozenset({11})),
            _Option(300, 1.0, 0, frozenset({12})), _Option(400, 0.0, 0, frozenset({11, 12}))]
    problems = [Problem(sizes), Problem(sizes)]
    # Measured: block 0 saved {12}, block 1 saved {11}; block 1's backward peaked at
    # 1050 after a replay that made call 2 (seq 12), 600 before it.
    peaks = {"fwd:0": 500, "bwd:0": 800, "fwd:1": 700, "bwd:1": 600, "bwd:1/1": 1050}
    made = {1: [frozenset({2})]}
    whole = {**peaks, "bwd:1": 1050}
    del whole["bwd:1/1"]
    # Whole segments: saving seq 12 in block 1 adds 300 at 1050: over 1100, block 1 stays.
    assert _solve_from([opts, opts], problems, (2, 1), whole, 1100)[0] == (2, 1)
    # Replay by replay: after its replay, seq 12 is alive either way; before it (600 + 300,
    # and 700 + 300 in the forward) it fits. Block 0 may add at most 50 (1050 + x <= 1100).
    choice, bases = _solve_from([opts, opts], problems, (2, 1), peaks, 1100, made=made)
    assert choice == (2, 3)
    dks = [opts[2].dk, opts[3].dk]
    predicted = {s: b + sum(dks[:block_of(s) + 1]) for s, b in bases.items()}
    assert predicted == {"fwd:0": 500, "bwd:0": 800, "fwd:1": 1000, "bwd:1": 900, "bwd:1/1": 1050}
    # A value made by a replay in another block's sub-segment is not this block's.
    assert _solve_from([opts, opts], problems, (2, 1), peaks, 1100, made={0: [frozenset({2})]})[0] == (2, 1)


def test_a_climb_uses_the_target_where_a_blocks_own_saves_add_nothing_at_its_peak():
    """HF Mixtral from config (3 x 64, 4 experts, transformers' default experts path), 90 %
    of the way from the floor's peak to no AC's: the step's peak is inside block 0's backward,
    after the replays that make what larger plans save, so those plans add nothing there.
    Priced per whole backward segment the planner settled at 0.941 of the target (each
    larger plan predicted over it); priced replay by replay it climbs to >= 0.97, no step
    over the target, gradients bitwise eager's."""
    T = pytest.importorskip("transformers", reason="the 'test' extra installs transformers")
    from transformers.modeling_layers import GradientCheckpointingLayer

    torch.manual_seed(0)
    base = T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)).train()
    types = sorted({type(m) for m in base.modules() if isinstance(m, GradientCheckpointingLayer)},
                   key=lambda t: t.__name__)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    target, peaks, budget = _steps_at(base, types, lambda m: m(input_ids=ids).logits.float().square().mean(), 0.9)
    detail = budget.format_plan(detail=True)
    assert max(peaks) <= target, ([p / target for p in peaks], detail)
    assert budget.peak_planner.state == "settled" and peaks[-1] >= 0.97 * target, ([p / target for p in peaks], detail)
