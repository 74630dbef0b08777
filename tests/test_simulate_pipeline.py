"""A pipeline stage simulated (Note [A pipeline stage's step] in ac2_dist/_sim/_pipeline.py)
against the same stage run by torch.distributed.pipelining's schedules on real gloo ranks:
the tiny Llama of _sim_case.py cut into 2 stages, FSDP2 per block on each stage (a
1-rank data-parallel group), 4 microbatches, no AC and full AC, each rank's peak from
the CPU allocator's events (the lowest of four steps: Note [A measured CPU step varies
with gloo's threads] in test_simulate.py) against the simulated stage's."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))

import _sim_case as case  # noqa: E402
from _dist import run_ranks  # noqa: E402

from ac2_dist.simulate import Pipeline, simulate  # noqa: E402

STAGES, MICROBATCHES = 2, 4
MODES = ["none", "full"]


def _stage(pp: Pipeline, mode: str, mesh=None) -> torch.nn.Module:
    import ac2_dist as ac
    from ac2_dist._sim._pipeline import HFStage

    torch.manual_seed(0)
    stage = HFStage(case.build(), pp)
    if mode == "full":
        ac.apply_ac(stage, "recompute_all", modules=[case.block_type()])
    return stage


def _batch(pp: Pipeline) -> dict:
    ids = torch.randint(0, case.VOCAB, (case.BATCH, case.SEQ))
    x = ids if pp.first else torch.randn(case.BATCH, case.SEQ, case.HIDDEN, requires_grad=True)
    return {"x": x, "labels": ids}


def _loss(pp: Pipeline):
    def loss(model, b):
        out = model(b["x"])
        return model.loss(out, b["labels"]) if pp.last else out

    return loss


def simulated(stage: int, schedule: str = "1F1B") -> dict:
    pp = Pipeline(STAGES, stage, MICROBATCHES, schedule)
    out = {}
    for mode in MODES:
        r = simulate(lambda: _stage(pp, "none"), batch=lambda: _batch(pp), blocks=[case.block_type()],
                     world_size=1, modes=[mode], device="cpu", loss=_loss(pp), pipeline=pp)
        out[mode] = r.modes[0]
    return out


def _stage_buffers(stage) -> int:
    """Bytes of the pipeline stage's receive buffers (activations and gradients): kept
    between steps, so alive when a step begins."""
    seen: dict[int, int] = {}
    for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
        for info in infos:
            buf = getattr(info, "buffer", None)
            if isinstance(buf, torch.Tensor):
                st = buf.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _real_rank(rank: int, world: int, schedule: str) -> dict:
    from bench_simulate import alive
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from ac2_dist._measure._alloc import AllocationTrace

    mesh = init_device_mesh("cpu", (STAGES, 1), mesh_dim_names=("pp", "dp"))
    pp = Pipeline(STAGES, rank, MICROBATCHES, schedule)
    out = {}
    for mode in MODES:
        module = _stage(pp, mode)
        for layer in module.model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
        stage = PipelineStage(module, rank, STAGES, torch.device("cpu"), group=mesh["pp"].get_group())
        kind = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[schedule]
        sched = kind(stage, n_microbatches=MICROBATCHES, loss_fn=module.loss)
        ids = torch.randint(0, case.VOCAB, (MICROBATCHES * case.BATCH, case.SEQ),
                            generator=torch.Generator().manual_seed(1))

        def step(sched=sched, opt=opt, ids=ids):
            if pp.first:
                sched.step(ids, return_outputs=False)
            else:
                sched.step(target=ids, losses=[], return_outputs=False)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # the optimizer's states and the stage's receive buffers
        peaks = []
        for _ in range(4):
            start = alive(module, opt, {"ids": ids}) + _stage_buffers(stage)
            with AllocationTrace() as trace:
                step()
            peaks.append(start + trace.whole.peak_bytes)
        out[mode] = {"peak": min(peaks), "peaks": peaks}
        del sched, stage, module, opt
    return out


@pytest.fixture(scope="module", params=["1F1B", "GPipe"])
def both(request):
    schedule = request.param
    sim = [simulated(s, schedule) for s in range(STAGES)]
    real = run_ranks(_real_rank, schedule, world=STAGES)
    return schedule, sim, real


@pytest.mark.parametrize("stage", range(STAGES))
@pytest.mark.parametrize("mode", MODES)
def test_stage_peak_within_2_percent_of_the_real_schedule(both, stage, mode):
    schedule, sim, real = both
    got = real[stage][mode]
    assert sim[stage][mode].peak_bytes == pytest.approx(got["peak"], rel=0.02), (schedule, stage, mode,
                                                                                 sim[stage][mode].peak_bytes, got)


def test_schedule_orders_mirror_torchs():
    """1F1B: ``stages - stage`` forwards first (all of them on a stage that has fewer
    microbatches), then a backward and a forward in turn; GPipe: every forward first."""
    from ac2_dist._sim._pipeline import actions

    assert actions(Pipeline(2, 0, 4)) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2),
                                          ("B", 3)]
    assert actions(Pipeline(2, 1, 4)) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3),
                                          ("B", 3)]
    assert actions(Pipeline(4, 0, 2)) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert actions(Pipeline(2, 1, 3, "GPipe")) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]


def test_bad_pipelines_are_one_line_errors():
    with pytest.raises(ValueError, match=r"pipeline stage must be in \[0, 2\), got 2"):
        Pipeline(2, 2, 4)
    with pytest.raises(ValueError, match=r"schedule must be one of 1F1B, GPipe, got 'Interleaved1F1B'"):
        Pipeline(2, 0, 4, "Interleaved1F1B")
    with pytest.raises(ValueError, match=r"microbatches must be a positive int, got 0"):
        Pipeline(2, 0, 0)
    pp = Pipeline(2, 0, 4)
    with pytest.raises(ValueError, match=r"a peak target is not planned for a pipeline stage"):
        simulate(lambda: _stage(pp, "none"), batch=lambda: _batch(pp), blocks=[case.block_type()], world_size=1,
                 device="cpu", loss=_loss(pp), pipeline=pp, target="1GiB")


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
    for extra, match in ((["--world-size", "4", "--pp", "3"], r"--pp 3 must be >= 1 and divide --world-size 4"),
                         (["--world-size", "4", "--pp", "2", "--pp-stage", "2"], r"stage must be in \[0, 2\)"),
                         (["--world-size", "4", "--pp", "2", "--target", "1GiB"], r"--target is not simulated"),
                         (["--world-size", "4", "--pp-stage", "1"], r"--pp-stage and --microbatches need --pp"),
                         (["--world-size", "4", "--pp", "2", "--rank", "2"], r"--rank 2: .* in \[0, 2\)"),
                         (["--world-size", "4", "--pp", "4"], r"4 pipeline stages for 3 layers")):
        assert _main([*common, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and re.search(match, err), (extra, err)
