"""A pipeline rank simulated against the same rank run by torch.distributed.pipelining's
schedules on real gloo ranks (tests/_pipeline_case.py says how), the schedules' orders, and
the one-line errors of what cannot be simulated."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")

import _sim_case as case  # noqa: E402
from _pipeline_case import (  # noqa: E402
    LAYERS4,
    MICROBATCHES,
    MODES,
    STAGES,
    compare,
    part_loss,
    parts_batch,
    simulated,
    stage_batch,
    stage_loss,
    stage_module,
    stage_part,
)

from ac2_dist.simulate import Pipeline, simulate  # noqa: E402


# 1F1B and GPipe: one stage a rank (3 layers). Note [Several stages per rank]
# (ac2_dist/_sim/_pipeline.py): DualPipeV, two stages a rank (4 layers) -- V placement, a stage's
# neighbour on the same rank, overlapped forward/backward pairs, full and split backwards; every
# multi-stage schedule in launch/bench_pipeline.py (CI's time).
# Each with a peak target's plan per rank (Note [A stage's microbatches in flight] in
# ac2_dist/_plan/_stage_model.py), followed by the job from the simulation's plan file.
@pytest.fixture(scope="module", params=["1F1B", "GPipe", "DualPipeV"])
def compared(request):
    return compare(request.param, plans=True)


@pytest.mark.parametrize("rank", range(STAGES))
@pytest.mark.parametrize("mode", MODES + ["plan"])
def test_rank_peak_within_1_percent_of_torchs_schedule(compared, rank, mode):
    row = next(r for r in compared["rows"] if r["rank"] == rank and r["mode"] == mode)
    assert abs(row["error"]) <= 0.01, (compared["schedule"], row)


@pytest.mark.parametrize("rank", range(STAGES))
def test_a_stage_plan_keeps_every_step_within_its_target(compared, rank):
    """The simulation's plan for the rank's target (halfway between full AC plus gloo's
    late buffers and no AC): predicted and simulated within the target less those buffers,
    fewer recompute FLOPs than full AC, and the job that follows its plan file under
    torch's schedule -- measured independently from the allocator -- within the target in
    every step, saving more than full AC."""
    row = next(r for r in compared["rows"] if r["rank"] == rank and r["mode"] == "plan")
    full = next(r for r in compared["rows"] if r["rank"] == rank and r["mode"] == "full")
    assert row["highest"] <= row["target"] and row["simulated"] <= row["target"], (compared["schedule"], row)
    assert row["predicted"] <= row["target"] and row["recompute_flops"] < row["full_flops"], row
    assert row["measured"] > full["measured"], (row, full)
    assert "following the simulated plan of pipeline rank" in row["text"], row["text"]


@pytest.mark.parametrize("rank", range(STAGES))
def test_ac_gradients_under_each_schedule_are_no_acs(compared, rank):
    """Full AC and the plan: every stage's gradients bitwise those of the same schedule
    without AC -- under DualPipeV its full backwards, overlapped pairs and zero-bubble
    split backwards (``I`` keeps the graph, ``W`` runs the weights' part) too."""
    grads = compared["grads"][rank]
    assert grads["count"] > 0 and grads["full"] == [] and grads["plan"] == [], (compared["schedule"], rank, grads)


def test_schedule_orders_mirror_torchs():
    """1F1B: ``stages - stage`` forwards first (all of them on a stage that has fewer
    microbatches), then a backward and a forward in turn; GPipe: every forward first.
    The multi-stage schedules: torch's own order for the rank, with the runtime's
    unshard / reshard / gradient reduction of each stage."""
    from ac2_dist._sim._pipeline import actions

    def fb(p):
        return [(kind, i) for kind, _, i in actions(p)]

    assert fb(Pipeline(2, 0, 4)) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert fb(Pipeline(2, 1, 4)) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert fb(Pipeline(4, 0, 2)) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert fb(Pipeline(2, 1, 3, "GPipe")) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    # LoopedBFS on rank 0 of 2 (stages 0 and 2): each stage's forwards, then stage 2's backwards
    # (last microbatch first), its reduction, then stage 0's
    looped = Pipeline(2, 0, 2, "LoopedBFS")
    assert looped.indices == (0, 2) and not looped.last
    compute = [a for a in actions(looped) if a[0] in "FBG"]
    assert compute == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1), ("B", 1, 1), ("B", 1, 0), ("G", 1, 0),
                       ("B", 0, 1), ("B", 0, 0), ("G", 0, 0)], compute
    # zero-bubble: every microbatch's backward split into I and W, each W after its I
    zb = actions(Pipeline(2, 1, 4, "ZBVZeroBubble"))
    assert Pipeline(2, 1, 4, "ZBVZeroBubble").indices == (1, 2)
    for k in range(2):
        for i in range(4):
            done = [a[0] for a in zb if a[0] in "FIW" and a[1:] == (k, i)]
            assert done == ["F", "I", "W"], (k, i, done)


def test_bad_multi_stage_pipelines_are_one_line_errors():
    with pytest.raises(ValueError, match=r"the ZBVZeroBubble schedule runs 2 stages per rank, got stages_per_rank=3"):
        Pipeline(2, 0, 4, "ZBVZeroBubble", 3)
    with pytest.raises(ValueError, match=r"the 1F1B schedule runs 1 stage per rank, got stages_per_rank=2"):
        Pipeline(2, 0, 4, "1F1B", 2)
    with pytest.raises(ValueError, match=r"stages_per_rank must be a positive int, got 0"):
        Pipeline(2, 0, 4, "Interleaved1F1B", 0)
    with pytest.raises(ValueError, match=r"torch's ScheduleDualPipeV refuses 1 microbatches on 2 ranks x 2 stages: "
                                         r"DualPipeV requires at least as many microbatches as stages"):
        Pipeline(2, 0, 1, "DualPipeV")
    pp = Pipeline(2, 0, 4, "InterleavedZeroBubble")
    with pytest.raises(ValueError, match=r"build\(\) must return an nn.ModuleList of the rank's 2 stage modules"):
        simulate(lambda: stage_part(pp, 0, "none"), batch=lambda: parts_batch(pp), blocks=[case.block_type()],
                 world_size=1, device="cpu", loss=part_loss, pipeline=pp)


def test_bad_pipelines_are_one_line_errors():
    with pytest.raises(ValueError, match=r"pipeline stage must be in \[0, 2\), got 2"):
        Pipeline(2, 2, 4)
    with pytest.raises(ValueError, match=r"schedule must be one of 1F1B, GPipe, Interleaved1F1B, .*, got '1f1b'"):
        Pipeline(2, 0, 4, "1f1b")
    with pytest.raises(ValueError, match=r"microbatches must be a positive int, got 0"):
        Pipeline(2, 0, 0)
    pp = Pipeline(2, 0, 4)
    with pytest.raises(ValueError, match=r"target='1MiB' \(1048576 bytes\) less the \d+ bytes of collective "
                                         r"buffers gloo may hold past their wait is below the simulated floor"):
        simulate(lambda: stage_module(pp, "none"), batch=lambda: stage_batch(pp), blocks=[case.block_type()],
                 world_size=1, device="cpu", loss=stage_loss(pp), pipeline=pp, target="1MiB")


def test_cli_simulates_a_stage_of_a_hugging_face_model(tmp_path, capsys):
    """``--pp``: the stage cut from the config's model, the stage's figures equal the
    Python API's on the same stage, and what cannot be simulated is a one-line error."""
    import json

    from ac2_dist.simulate import _main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": case.VOCAB, "hidden_size": case.HIDDEN,
                               "intermediate_size": case.INTER, "num_hidden_layers": case.LAYERS,
                               "num_attention_heads": case.HEADS, "num_key_value_heads": case.HEADS}))
    common = ["--hf-config", str(cfg), "--batch", str(case.BATCH), "--seq", str(case.SEQ), "--device", "cpu"]
    assert _main([*common, "--world-size", "2", "--pp", "2", "--pp-stage", "1", "--microbatches",
                  str(MICROBATCHES), "--modes", "none,full"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 of 1, pipeline stage 1 of 2 (1F1B, 4 microbatches a step)" in out, out
    api = simulated(1)
    for mode in MODES:
        assert f"{api[mode].peak_bytes / 2**20:.1f} MiB" in out.splitlines()[3], (out, api[mode].peak_bytes)
    # a peak target for the stage, and its plan file naming the pipeline rank it is for
    target, plan = api["none"].peak_bytes, tmp_path / "stage.json"
    assert _main([*common, "--world-size", "2", "--pp", "2", "--pp-stage", "1", "--microbatches",
                  str(MICROBATCHES), "--modes", "full", "--target", str(target), "--plan-out", str(plan)]) == 0
    out = capsys.readouterr().out
    assert f"plan written to {plan}: MemoryBudget(peak='{target}', plan='{plan}') on the stage's module, followed " \
           "as simulated" in out, out
    doc = json.loads(plan.read_text())
    assert doc["pipeline"] == {"stages": 2, "stage": 1, "microbatches": MICROBATCHES, "schedule": "1F1B",
                               "stages_per_rank": 1} and doc["predicted_peak"] <= target, doc["pipeline"]
    for extra, match in ((["--world-size", "4", "--pp", "3"], r"--pp 3 must be >= 1 and divide --world-size 4"),
                         (["--world-size", "4", "--pp", "2", "--pp-stage", "2"], r"stage must be in \[0, 2\)"),
                         (["--world-size", "4", "--pp", "2", "--head"], r"--head is not simulated"),
                         (["--world-size", "4", "--pp-stage", "1"],
                          r"--pp-stage, --microbatches and --stages-per-rank need --pp"),
                         (["--world-size", "4", "--pp", "2", "--rank", "2"], r"--rank 2: .* in \[0, 2\)"),
                         (["--world-size", "4", "--pp", "4"], r"4 pipeline stages for 3 layers")):
        assert _main([*common, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and re.search(match, err), (extra, err)


def test_cli_simulates_a_rank_of_a_multi_stage_schedule(tmp_path, capsys):
    """``--schedule InterleavedZeroBubble``: the rank's two stages cut from the config's
    model, the same figure as the Python API's, and a one-line error for what cannot be
    cut or given."""
    import json

    from ac2_dist.simulate import _main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": case.VOCAB, "hidden_size": case.HIDDEN,
                               "intermediate_size": case.INTER, "num_hidden_layers": LAYERS4,
                               "num_attention_heads": case.HEADS, "num_key_value_heads": case.HEADS}))
    common = ["--hf-config", str(cfg), "--batch", str(case.BATCH), "--seq", str(case.SEQ), "--device", "cpu"]
    assert _main([*common, "--world-size", "2", "--pp", "2", "--pp-stage", "1", "--microbatches",
                  str(MICROBATCHES), "--schedule", "InterleavedZeroBubble", "--modes", "none"]) == 0
    out = capsys.readouterr().out
    assert ("rank 0 of 1, pipeline rank 1 of 2, stages 1, 3 of 4 (InterleavedZeroBubble, 4 microbatches a step)"
            in out), out
    pp = Pipeline(STAGES, 1, MICROBATCHES, "InterleavedZeroBubble")
    api = simulate(lambda: torch.nn.ModuleList([stage_part(pp, i, "none") for i in pp.indices]),
                   batch=lambda: parts_batch(pp), blocks=[case.block_type()], world_size=1, modes=["none"],
                   device="cpu", loss=part_loss, pipeline=pp).modes[0].peak_bytes
    assert f"{api / 2**20:.1f} MiB" in out.splitlines()[3], (out, api)
    for extra, match in ((["--stages-per-rank", "2"], r"--pp-stage, --microbatches and --stages-per-rank need --pp"),
                         (["--pp", "2", "--schedule", "ZBVZeroBubble", "--stages-per-rank", "3"],
                          r"the ZBVZeroBubble schedule runs 2 stages per rank, got stages_per_rank=3"),
                         (["--pp", "2", "--schedule", "LoopedBFS", "--stages-per-rank", "3"],
                          r"6 pipeline stages for 4 layers: each stage needs one")):
        assert _main([*common, "--world-size", "2", *extra]) == 2, extra
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and re.search(match, err), (extra, err)
