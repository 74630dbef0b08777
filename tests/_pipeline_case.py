"""A pipeline rank simulated (Note [A pipeline stage's step], Note [Several stages per rank]
in ac2_dist/_sim/_pipeline.py) and the same rank run by torch.distributed.pipelining's
schedules on real gloo ranks: the tiny Llama of _sim_case.py cut into stages (2 ranks; 1
stage a rank under 1F1B / GPipe, 2 under the multi-stage schedules with 4 layers), FSDP2
per block and per stage (a 1-rank data-parallel group), 4 microbatches, no AC and full
AC, each rank's peak from the CPU allocator's events (the lowest of four steps: Note [A
measured CPU step varies with gloo's threads] in test_simulate.py). Used by
tests/test_simulate_pipeline.py and launch/bench_pipeline.py."""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))

import _sim_case as case  # noqa: E402

from ac2_dist.simulate import Pipeline, simulate  # noqa: E402

STAGES, MICROBATCHES = 2, 4
SINGLE = ["1F1B", "GPipe"]
MULTI = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
MODES = ["none", "full"]
#: The multi-stage schedules' tests run on a 4-layer model (2 ranks x 2 stages).


def stage_module(pp: Pipeline, mode: str, mesh=None) -> torch.nn.Module:
    import ac2_dist as ac
    from ac2_dist._sim._pipeline import HFStage

    torch.manual_seed(0)
    stage = HFStage(case.build(), pp)
    if mode == "full":
        ac.apply_ac(stage, "recompute_all", modules=[case.block_type()])
    return stage


def stage_batch(pp: Pipeline) -> dict:
    ids = torch.randint(0, case.VOCAB, (case.BATCH, case.SEQ))
    x = ids if pp.first else torch.randn(case.BATCH, case.SEQ, case.HIDDEN, requires_grad=True)
    return {"x": x, "labels": ids}


def stage_loss(pp: Pipeline):
    def loss(model, b):
        out = model(b["x"])
        return model.loss(out, b["labels"]) if pp.last else out

    return loss


def simulated(stage: int, schedule: str = "1F1B") -> dict:
    pp = Pipeline(STAGES, stage, MICROBATCHES, schedule)
    out = {}
    for mode in MODES:
        r = simulate(lambda: stage_module(pp, "none"), batch=lambda: stage_batch(pp), blocks=[case.block_type()],
                     world_size=1, modes=[mode], device="cpu", loss=stage_loss(pp), pipeline=pp)
        out[mode] = r.modes[0]
    return out


def stage_buffers(stage) -> int:
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


def real_rank(rank: int, world: int, schedule: str) -> dict:
    from bench_simulate import alive
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from ac2_dist._measure._alloc import AllocationTrace

    mesh = init_device_mesh("cpu", (STAGES, 1), mesh_dim_names=("pp", "dp"))
    pp = Pipeline(STAGES, rank, MICROBATCHES, schedule)
    out = {}
    for mode in MODES:
        module = stage_module(pp, mode)
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
            start = alive(module, opt, {"ids": ids}) + stage_buffers(stage)
            with AllocationTrace() as trace:
                step()
            peaks.append(start + trace.whole.peak_bytes)
        out[mode] = {"peak": min(peaks), "peaks": peaks}
        del sched, stage, module, opt
    return out


LAYERS4 = 4


def stage_part(pp: Pipeline, index: int, mode: str) -> torch.nn.Module:
    import ac2_dist as ac
    from ac2_dist._sim._pipeline import HFStage

    torch.manual_seed(0)
    stage = HFStage(case.build(LAYERS4), pp, index)
    if mode == "full":
        ac.apply_ac(stage, "recompute_all", modules=[case.block_type()])
    return stage


def parts_batch(pp: Pipeline) -> list:
    ids = torch.randint(0, case.VOCAB, (case.BATCH, case.SEQ))
    return [{"x": ids if i == 0 else torch.randn(case.BATCH, case.SEQ, case.HIDDEN, requires_grad=True),
             "labels": ids} for i in pp.indices]


def part_loss(model, b):
    out = model(b["x"])
    return model.loss(out, b["labels"]) if model.last else out


def multi_simulated(rank: int, schedule: str) -> dict:
    pp = Pipeline(STAGES, rank, MICROBATCHES, schedule)
    out = {}
    for mode in MODES:
        r = simulate(lambda: torch.nn.ModuleList([stage_part(pp, i, "none") for i in pp.indices]),
                     batch=lambda: parts_batch(pp), blocks=[case.block_type()], world_size=1, modes=[mode],
                     device="cpu", loss=part_loss, pipeline=pp)
        out[mode] = r.modes[0].peak_bytes
    return out


def real_multi_rank(rank: int, world: int, schedule: str) -> dict:
    """Each rank's peak under torch's runtime with FSDP2 per block and per stage, and
    its stages' gradients without FSDP (torch's split backward finds a middle stage's
    weights among the sharded parameters, so under FSDP2 it computes none: Note [Several
    stages per rank]) -- no AC and full AC."""
    from bench_simulate import alive
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    from ac2_dist._measure._alloc import AllocationTrace

    mesh = init_device_mesh("cpu", (STAGES, 1), mesh_dim_names=("pp", "dp"))
    pp = Pipeline(STAGES, rank, MICROBATCHES, schedule)
    ids = torch.randint(0, case.VOCAB, (MICROBATCHES * case.BATCH, case.SEQ),
                        generator=torch.Generator().manual_seed(1))
    out: dict = {"peak": {}, "grads": {}}
    for mode in MODES:
        for fsdp in (True, False):
            parts = [stage_part(pp, i, mode) for i in pp.indices]
            if fsdp:
                for part in parts:
                    for layer in part.model.model.layers:
                        fully_shard(layer, mesh=mesh["dp"])
                    fully_shard(part, mesh=mesh["dp"])
            opt = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=1e-4)
            stages = [PipelineStage(part, i, pp.count, torch.device("cpu"), group=mesh["pp"].get_group())
                      for part, i in zip(parts, pp.indices)]
            last = [part for part in parts if part.last]
            sched = getattr(torch_schedules, f"Schedule{schedule}")(
                stages, n_microbatches=MICROBATCHES, loss_fn=(last or parts)[0].loss)

            def step(sched=sched, opt=opt, update=True):
                sched.step(*((ids,) if pp.first else ()), **({"target": ids, "losses": []} if pp.last else {}),
                           return_outputs=False)
                if update:
                    opt.step()
                    opt.zero_grad(set_to_none=True)

            if not fsdp:
                step(update=False)
                out["grads"][mode] = {(i, n): p.grad.clone() for part, i in zip(parts, pp.indices)
                                      for n, p in part.named_parameters()}
                continue
            step()  # the optimizer's states and the stages' receive buffers
            peaks = []
            for _ in range(4):
                start = alive(torch.nn.ModuleList(parts), opt, {"ids": ids}) + sum(stage_buffers(s) for s in stages)
                with AllocationTrace() as trace:
                    step()
                peaks.append(start + trace.whole.peak_bytes)
            out["peak"][mode] = {"peak": min(peaks), "peaks": peaks}
            del sched, stages, parts, opt
    none, full = out.pop("grads").values()  # compared here: tensors do not travel back from a rank
    out["grads"] = {"count": len(none), "same_keys": none.keys() == full.keys(),
                    "differ": [str(k) for k in none if k in full and not torch.equal(none[k], full[k])]}
    return out


def compare(schedule: str) -> dict:
    """Simulated and measured peaks of both ranks under ``schedule``, no AC and full AC
    (``rows``: rank, mode, simulated, measured, error), and under a multi-stage schedule
    whether full AC's gradients equal no AC's (``grads``, per rank; None otherwise)."""
    from _dist import run_ranks

    t0 = time.perf_counter()
    if schedule in SINGLE:
        sim = [{m: r.peak_bytes for m, r in simulated(s, schedule).items()} for s in range(STAGES)]
        t1 = time.perf_counter()
        real = [{m: v["peak"] for m, v in rank.items()} for rank in run_ranks(real_rank, schedule,
                                                                               world=STAGES)]
        grads = None
    else:
        sim = [multi_simulated(r, schedule) for r in range(STAGES)]
        t1 = time.perf_counter()
        got = run_ranks(real_multi_rank, schedule, world=STAGES)
        real = [{m: v["peak"] for m, v in rank["peak"].items()} for rank in got]
        grads = [rank["grads"] for rank in got]
    rows = [{"rank": r, "mode": m, "simulated": sim[r][m], "measured": real[r][m],
             "error": sim[r][m] / real[r][m] - 1} for r in range(STAGES) for m in MODES]
    return {"schedule": schedule, "rows": rows, "grads": grads, "simulate_s": t1 - t0,
            "real_s": time.perf_counter() - t1}
