"""ac2_dist.simulate against real runs: the simulated rank-0 peak of a tiny Llama under
FSDP2 per block on 2 ranks (no AC, full AC, a save list) against the same step measured
on 2 gloo ranks from the CPU allocator's events; the simulated recompute FLOPs against
FLOPs counted by a dispatch mode; a plan file followed by the real job's first step.

Note [A measured CPU step varies with gloo's threads]
    gloo runs a collective on a worker thread that holds its tensors until it lets the
    work go; an FSDP2 all-gather's output (one block's unsharded parameters) is then
    freed by that thread, sometimes after the next block's all-gather has allocated
    its own. So a measured step's peak is sometimes one or two such buffers higher
    (here 833 KiB each, +7 % to +16 %), and it varies from step to step and run to run
    (10.58 / 11.44 / 12.29 MiB for full AC in three runs). The simulation counts a
    collective's buffers, gloo's own among them (Note [gloo's buffers of its own] in
    ac2_dist/_sim/_world.py), until its wait returns, so it is compared with the lowest
    of five measured steps; the spread is printed with the figures and named among what
    the simulation does not count. A peak target is planned clear of it (gloo's two
    worker threads times the largest unit's buffer: Note [Collective buffers gloo frees
    late] in ac2_dist/_plan/_late_buffers.py), so every step of a plan's job is compared
    with the target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import _hang
import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import _sim_case as case  # noqa: E402
from _dist import run_ranks  # noqa: E402

import ac2_dist as ac  # noqa: E402
from ac2_dist.simulate import simulate  # noqa: E402

MODES = ["none", "full", case.SAVE]
NAMES = ["none", "full", "save"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """The simulation, a plan for a target between full AC and no AC, and the real
    2-rank runs of every mode and of the plan (one spawn)."""
    report = case.simulated(MODES)
    none, full = report.mode("no AC").peak_bytes, report.mode("full AC").peak_bytes
    # half-way between the lowest target a plan exists for on gloo and no AC (Note
    # [Collective buffers gloo frees late] in ac2_dist/_plan/_late_buffers.py)
    assert 0 < report.late_bytes < none - full
    target = full + report.late_bytes + (none - full - report.late_bytes) // 2
    planned = report.plan(target)
    path = str(tmp_path_factory.mktemp("plan") / "plan.json")
    report.save_plan(path)
    # the job gets the simulation's target as it is: the plan file's start is the CPU
    # planner's origin (Note [What a peak target bounds] in _peak.py)
    real = run_ranks(case.measure_rank, NAMES + ["plan"], path, target, world=2)
    return report, real, target, planned, path


@pytest.mark.parametrize("k", range(3), ids=NAMES)
def test_predicted_peak_within_5_percent_of_measured(measured, k):
    report, real, *_ = measured
    sim = report.modes[k]
    got = real[0][NAMES[k]]
    # the lowest of five steps: Note [A measured CPU step varies with gloo's threads]
    assert sim.peak_bytes == pytest.approx(got["peak"], rel=0.05), (sim.name, sim.peak_bytes, got)
    assert sim.start_bytes == pytest.approx(got["start"], rel=0.01), (sim.name, sim.start_bytes, got)


@pytest.mark.parametrize("k", [1, 2], ids=NAMES[1:])
def test_recompute_flops_within_1_percent_of_counted(measured, k):
    report, real, *_ = measured
    counted = real[0][NAMES[k]]["flops"] - real[0]["none"]["flops"]
    assert counted > 0
    assert report.modes[k].recompute_flops == pytest.approx(counted, rel=0.01)


def test_plan_file_runs_in_the_first_step_within_the_target(measured):
    report, real, target, planned, _ = measured
    got = real[0]["plan"]
    assert got["calibrations"] == 0  # step 1 followed the file: no calibration at the floor
    assert planned.predicted_bytes <= target
    # every step: the plan keeps clear of the target the buffers gloo's threads may free late
    # (Note [Collective buffers gloo frees late] in ac2_dist/_plan/_late_buffers.py), in the
    # simulation and in the job's planner alike
    assert max(got["peaks"]) <= target, (got, target)
    # the plan saves something (a later step may be corrected down to the floor when a gloo
    # buffer freed late puts a step over the target: what the steady step saves is not asserted)
    assert planned.predicted_bytes > report.mode("full AC").peak_bytes
    first = got["history"][0]
    assert first[0] == 0 and first[1] != "floor" and first[3] is not None, got["history"]
    # the planner's figures are on the simulation's scale: its first prediction is the
    # simulation's; what it measured of step 2 (optimizer states made, as in the simulated
    # step) is the absolute peak measured here (step 1 has no states yet: it reads high)
    assert first[2] == planned.predicted_bytes, (first, planned.predicted_bytes)
    second = got["history"][1]
    # (within 5% and one block's all-gather output, 833 KiB here, which gloo's thread frees
    # late in some steps, inside one measurement's window and outside the other's: seen once
    # under the whole suite's load, +0.82 MB; counting the root all-gather twice was +2.3 MB)
    assert second[0] == 1, got["history"]
    assert abs(second[3] - got["peaks"][1]) <= 0.05 * got["peaks"][1] + 2**20, (got["history"], got["peaks"])
    assert got["calibrations_after"] == 0


def _tiny_budget_model(path: str, seq: int, layers: int = case.LAYERS) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = case.config()
    cfg = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": layers})
    model = LlamaForCausalLM(cfg).train()
    budget = ac.MemoryBudget(peak=1 << 40, plan=path)
    ac.apply_ac(model, budget, modules=[case.block_type()])
    ids = torch.randint(0, case.VOCAB, (case.BATCH, seq))
    model(input_ids=ids, labels=ids).loss.backward()


def test_plan_for_other_shapes_is_refused_naming_the_first_difference(measured):
    *_, path = measured
    with pytest.raises(ValueError, match=r"module 'model.layers.0', op \d+: the plan expects .* the job ran"):
        _tiny_budget_model(path, seq=case.SEQ * 2)
    with pytest.raises(ValueError, match=r"'model.layers.3' is not in it"):
        _tiny_budget_model(path, seq=case.SEQ, layers=case.LAYERS + 1)


def test_plan_file_errors():
    with pytest.raises(ValueError, match="cannot read the plan file"):
        ac.MemoryBudget(peak="1GiB", plan="/nonexistent/plan.json")
    with pytest.raises(TypeError, match="plan applies to a peak target"):
        ac.MemoryBudget(0.5, plan="x.json")


def test_plan_file_version_is_checked(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"format": "ac2_dist.plan", "version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        ac.MemoryBudget(peak="1GiB", plan=str(bad))


def test_bad_inputs_are_refused_before_any_step():
    calls = []

    def build():
        calls.append(1)
        return case.build()

    kw = dict(batch=case.batch, blocks=[case.block_type()])
    with pytest.raises(ValueError, match="world_size=6 is not a multiple of shard_size=4"):
        simulate(build, world_size=6, shard_size=4, **kw)
    with pytest.raises(ValueError, match="rank must be in"):
        simulate(build, world_size=2, rank=2, **kw)
    with pytest.raises(ValueError, match="unknown device 'tpu9'"):
        simulate(build, world_size=2, device="tpu9", **kw)
    with pytest.raises(ValueError, match="not a size"):
        simulate(build, world_size=2, target="lots", **kw)
    assert not calls


def test_target_below_the_floor_names_both():
    with pytest.raises(ValueError, match=r"target='1MiB' \(1048576 bytes\) less the \d+ bytes of collective "
                                         r"buffers gloo may hold past their wait is below the simulated floor"):
        case.simulated(["full"], target="1MiB")
    assert not torch.distributed.is_initialized()


def _cli(*args: str) -> subprocess.CompletedProcess:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return _hang.run([sys.executable, "-m", "ac2_dist.simulate", *args], cwd=root)


def test_cli_prints_the_table_and_writes_a_loadable_plan(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": case.VOCAB, "hidden_size": case.HIDDEN,
                               "intermediate_size": case.INTER, "num_hidden_layers": case.LAYERS,
                               "num_attention_heads": case.HEADS, "num_key_value_heads": case.HEADS}))
    plan = tmp_path / "plan.json"
    done = _cli("--hf-config", str(cfg), "--world-size", "2", "--batch", str(case.BATCH), "--seq", str(case.SEQ),
                "--device", "cpu", "--target", "15MiB", "--plan-out", str(plan))
    assert done.returncode == 0, done.stderr
    assert "peak on the rank" in done.stdout and "NCCL" in done.stdout and "target 15MiB" in done.stdout
    assert "planned for the target less" in done.stdout, done.stdout
    budget = ac.MemoryBudget(peak="15MiB", plan=str(plan))
    assert [c.fqn for c in budget._loaded.calls] == [f"model.layers.{k}" for k in range(case.LAYERS)]
    bad = _cli("--hf-config", str(tmp_path / "missing.json"), "--world-size", "2")
    assert bad.returncode == 2 and "missing.json" in bad.stderr and "cannot build a config" in bad.stderr
    bad = _cli("--hf-config", str(cfg), "--world-size", "6", "--shard-size", "4")
    assert bad.returncode == 2 and "world_size=6 is not a multiple of shard_size=4" in bad.stderr


def test_hsdp_shards_over_the_shard_group_only():
    """World 4 sharded over groups of 2 holds what world 2 holds; plain world 4 holds less."""
    kw = dict(batch=case.batch, blocks=[case.block_type()], modes=["full"], device="cpu")
    two = simulate(case.build, world_size=2, **kw).modes[0]
    hsdp = simulate(case.build, world_size=4, shard_size=2, **kw).modes[0]
    four = simulate(case.build, world_size=4, **kw).modes[0]
    assert (hsdp.peak_bytes, hsdp.start_bytes) == (two.peak_bytes, two.start_bytes)
    assert four.start_bytes < two.start_bytes and four.peak_bytes < two.peak_bytes


def test_cli_takes_a_factory_of_the_users(tmp_path):
    env_path = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(env_path)
    done = _hang.run([sys.executable, "-m", "ac2_dist.simulate", "--model", "_sim_case:build", "--world-size",
                           "2", "--batch", str(case.BATCH), "--seq", str(case.SEQ), "--device", "cpu", "--modes",
                           "full", "--save-ops", "mm"], cwd=root,
                          env={**os.environ, "PYTHONPATH": env_path})
    assert done.returncode == 0, done.stderr
    assert "full AC" in done.stdout and "save: mm" in done.stdout


def test_recompute_is_priced_at_the_devices_rates():
    """With unbounded bandwidth the roofline is FLOPs / FLOP rate; a named device's rate
    is its datasheet figure for the dtype."""
    kw = dict(batch=case.batch, blocks=[case.block_type()], world_size=2, modes=["full"])
    custom = simulate(case.build, device=(1e12, 1e30), **kw).modes[0]
    assert custom.recompute_flops > 0
    assert custom.recompute_seconds * 1e12 == pytest.approx(custom.recompute_flops, rel=1e-9)
    from ac2_dist.simulate import DEVICES

    h100 = simulate(case.build, device="h100", **kw).modes[0]
    assert h100.recompute_flops == custom.recompute_flops
    assert h100.recompute_seconds >= h100.recompute_flops / DEVICES["h100"][1]  # fp32: no TF32


def test_block_input_offload_saves_what_a_run_on_the_simulated_cuda_saves():
    """The same step with ``Offload(block_inputs=True)`` (Note [The boundary offloaded,
    counted from the same step] in ac2_dist/_sim/_meter.py): a 4-block Llama whose peak
    is in the head's backward. The simulation's saving at the peak is exactly the 3
    inputs the schedule moves, as the real step's device peak on the simulated CUDA
    (its allocator's live blocks, host buffers apart) drops by; the copies are priced
    at the host link."""
    import gc

    from models import Llama, LlamaBlock

    from ac2_dist.simulate import HOST_LINKS

    layers, dim, seq, vocab = 4, 64, 512, 2048
    boundary = seq * dim * 4

    def build():
        torch.manual_seed(0)
        return Llama(vocab=vocab, dim=dim, layers=layers, heads=4, max_seq=seq)

    report = simulate(build, batch=lambda: torch.randint(0, vocab, (1, seq)), blocks=[LlamaBlock], world_size=1,
                      fsdp=None, modes=["none", "full"], device="h100")
    full = report.mode("full AC")
    assert report.mode("no AC").offload_peak_bytes is None  # no checkpointed block: nothing to offload
    assert full.boundary_bytes == (layers - 1) * boundary
    assert full.peak_bytes - full.offload_peak_bytes == (layers - 1) * boundary
    assert full.boundary_copy_seconds == pytest.approx(boundary / HOST_LINKS["h100"])
    assert 0 < full.block_backward_seconds
    assert "moved to host memory" in report.format()

    tokens = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    peaks = {}
    from _simcuda import SimCuda

    with SimCuda() as sim:  # after the simulation: its regions must not take the simulated streams
        for inputs in (False, True):
            model = ac.apply_ac(build(), "recompute_all", modules=[LlamaBlock],
                                replay=ac.ReplayConfig(stream="auto", prefetch=0,
                                                       offload=ac.Offload(block_inputs=inputs)))
            for _ in range(2):  # the second step is measured (the pool is filled)
                gc.collect()
                base = sim.device_now
                sim.reset_peak()
                model(tokens).float().mean().backward()
                model.zero_grad(set_to_none=True)
            peaks[inputs] = sim.device_peak - base
            del model
        sim.check()
    assert peaks[False] - peaks[True] == (layers - 1) * boundary, peaks


@pytest.fixture(scope="module", params=[("gpt2", 2), ("llama", 4)], ids=["gpt2-2ranks", "llama-4ranks"])
def bench_rows(request):
    """launch/bench_simulate.py's rows for a tiny GPT-2 on 2 ranks and the tiny Llama on 4:
    no AC, full AC, a save list and a peak target a tenth of the way from the lowest a
    gloo job can plan for (full AC and gloo's late buffers) to no AC (one that recomputes
    something in both)."""
    import bench_simulate as bench

    model, world = request.param
    return bench.run_case(bench.Case(model), world, steps=5, fractions=(0.1,))


def test_gpt2_and_4_ranks_and_a_peak_target_within_5_and_1_percent(bench_rows):
    assert [r["mode"].split()[0] for r in bench_rows] == ["no", "full", "save:", "target"]
    for r in bench_rows:
        # the lowest of five steps: Note [A measured CPU step varies with gloo's threads]
        assert r["predicted"] == pytest.approx(r["measured"], rel=0.05), r
        assert r["flops_predicted"] == pytest.approx(r["flops_counted"], rel=0.01), r
    target = bench_rows[-1]
    assert target["flops_counted"] > 0 and target["measured"] <= target["target"] * 1.02, target
    # the plan the file holds is where the job's planner would settle (Note [A plan file
    # climbs as the job would] in ac2_dist/_sim/_climb.py): its simulated step uses the target less
    # gloo's late buffers (Note [Collective buffers gloo frees late] in
    # ac2_dist/_plan/_late_buffers.py), and the peak model, priced from the simulated
    # steps, is within 5 % of it; no step of the plan's job on any rank is over the target
    planned = target["target"] - target["late"]
    assert 0.97 * planned <= target["predicted"] <= planned, target
    assert target["highest_any_rank"] <= target["target"], target
    assert target["predicted"] <= target["peak_model"] <= 1.05 * target["predicted"], target
    assert bench_rows[1]["flops_counted"] > target["flops_counted"] > bench_rows[0]["flops_counted"] == 0


@pytest.mark.parametrize("world", [2, 4])
def test_moe_plans_use_the_target_and_the_peak_model_is_within_5_percent(world):
    """HF Mixtral, its default experts path: the plan's simulated step uses at least 97 %
    (95 % once it replays no matmul) of each target less gloo's late buffers (a quarter, half and three quarters of the way
    from the lowest target a gloo job can plan for to no AC),
    and the planner's prediction for it is within 5 % (before the file's plan climbed as the
    job's does: 2.6 % to 8.0 % high, the plan using 0.92-0.97 of the target)."""
    import bench_simulate as bench

    c = bench.Case("mixtral")
    report = simulate(c.build, batch=c.batch, blocks=[c.block_type()], world_size=world, rank=0,
                      modes=["none", "full"], device="cpu")
    none, full = report.mode("no AC").peak_bytes, report.mode("full AC").peak_bytes
    low = full + report.late_bytes
    for f in (0.25, 0.5, 0.75):
        target = low + int(f * (none - low))
        planned = report.plan(target)
        room = target - report.late_bytes
        # where the plan already replays no matmul, what is left to save is memory-bound ops
        # whose frontier steps can be coarser than 3 % of the room here (the MoE's expert
        # outputs): at 0.75 of the way on 2 ranks the plan of 0.5 stays, 0.965 of the room
        assert planned.peak_bytes <= room, (f, target, planned.peak_bytes)
        assert planned.peak_bytes >= (0.97 if planned.recompute_flops else 0.95) * room, (f, target, planned)
        assert planned.peak_bytes <= planned.predicted_bytes <= 1.05 * planned.peak_bytes, (f, planned)


def test_ddp_is_refused_saying_why_and_what_to_run():
    with pytest.raises(ValueError, match=r"DDP is not simulated: .*fake process group.*fsdp=None, --fsdp none"):
        simulate(case.build, batch=case.batch, blocks=[case.block_type()], world_size=2, fsdp="ddp")
    assert not torch.distributed.is_initialized()
    done = _cli("--hf-config", "unused.json", "--world-size", "2", "--ddp")
    assert done.returncode == 2 and "DDP is not simulated" in done.stderr, done.stderr


def test_torchs_ddp_does_not_run_under_the_fake_process_group():
    """Why fsdp="ddp" is refused: torch's DDP builds and runs forward on fake parameters,
    but its bucket all-reduce fails under the fake backend. A torch where this passes
    lets the simulation run DDP: lift the refusal then."""
    from torch._subclasses import FakeTensorMode
    from torch.nn.parallel import DistributedDataParallel

    from ac2_dist._sim._world import fake_world

    with fake_world(2, 0):
        with torch.device("meta"):
            m = nn.Linear(8, 8)
        with FakeTensorMode(allow_non_fake_inputs=True):
            m.to_empty(device="cpu")
            ddp = DistributedDataParallel(m, init_sync=False)
            out = ddp(torch.randn(2, 8)).sum()
            with pytest.raises(RuntimeError, match="hook result is either a Tensor"):
                out.backward()
