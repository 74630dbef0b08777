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


def stage_module(pp: Pipeline, mode, mesh=None) -> torch.nn.Module:
    """The stage's module under ``mode``: ``"none"``, ``"full"`` or ``(target, plan
    file)`` (a peak target following the plan file)."""
    import ac2_dist as ac
    from ac2_dist._sim._pipeline import HFStage

    torch.manual_seed(0)
    stage = HFStage(case.build(), pp)
    if mode == "full":
        ac.apply_ac(stage, "recompute_all", modules=[case.block_type()])
    elif mode != "none":
        target, path = mode
        stage.budget = ac.MemoryBudget(peak=target, plan=path)
        ac.apply_ac(stage, stage.budget, modules=[case.block_type()])
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


def _sim_args(pp: Pipeline) -> dict:
    """``simulate``'s build, batch and loss for the pipeline rank ``pp``."""
    if len(pp.indices) == 1:
        return {"build": lambda: stage_module(pp, "none"), "batch": lambda: stage_batch(pp), "loss": stage_loss(pp)}
    return {"build": lambda: torch.nn.ModuleList([stage_part(pp, i, "none") for i in pp.indices]),
            "batch": lambda: parts_batch(pp), "loss": part_loss}


def simulated(stage: int, schedule: str = "1F1B", folder: str | None = None) -> dict:
    """The simulated rank's ``ModeReport`` per mode (``"none"``, ``"full"``); with
    ``folder`` also ``"plan"``: a peak target halfway between the floor (full AC plus the
    collective buffers gloo may hold late) and no AC, planned (``target``), its plan file
    written in ``folder`` (``path``)."""
    pp = Pipeline(STAGES, stage, MICROBATCHES, schedule)
    a = _sim_args(pp)
    r = simulate(a["build"], batch=a["batch"], blocks=[case.block_type()], world_size=1, modes=MODES,
                 device="cpu", loss=a["loss"], pipeline=pp)
    out = {"none": r.mode("no AC"), "full": r.mode("full AC")}
    if folder is not None:
        floor = out["full"].peak_bytes + r.late_bytes
        out["target"] = int(floor + 0.5 * (out["none"].peak_bytes - floor))
        out["plan"] = r.plan(out["target"])
        out["path"] = os.path.join(folder, f"plan_{schedule}_{stage}.json")
        r.save_plan(out["path"])
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


def real_rank(rank: int, world: int, schedule: str, plans: list | None = None) -> dict:
    """Each mode's peak on this rank under torch's runtime (the lowest of four steps and
    all four); with ``plans`` (a ``(target, plan file)`` per rank) the mode ``"plan"``
    too and its ``format_plan()`` (``text``); ``grads``: per mode, the gradients of the
    first step that are not bitwise no AC's (:func:`differing`)."""
    from bench_simulate import alive
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from ac2_dist._measure._alloc import AllocationTrace

    mesh = init_device_mesh("cpu", (STAGES, 1), mesh_dim_names=("pp", "dp"))
    pp = Pipeline(STAGES, rank, MICROBATCHES, schedule)
    out: dict = {}
    grads: dict = {}
    for mode in MODES + (["plan"] if plans else []):
        module = stage_module(pp, plans[rank] if mode == "plan" else mode)
        for layer in module.model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
        stage = PipelineStage(module, rank, STAGES, torch.device("cpu"), group=mesh["pp"].get_group())
        kind = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[schedule]
        sched = kind(stage, n_microbatches=MICROBATCHES, loss_fn=module.loss)
        ids = torch.randint(0, case.VOCAB, (MICROBATCHES * case.BATCH, case.SEQ),
                            generator=torch.Generator().manual_seed(1))

        def step(sched=sched, opt=opt, ids=ids, update=True):
            if pp.first:
                sched.step(ids, return_outputs=False)
            else:
                sched.step(target=ids, losses=[], return_outputs=False)
            if update:
                opt.step()
                opt.zero_grad(set_to_none=True)

        step(update=False)  # the optimizer's states and the stage's receive buffers
        grads[mode] = {n: p.grad.full_tensor().clone() for n, p in module.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mode == "plan":
            out["text"] = module.budget.format_plan()
        peaks = []
        for _ in range(4):
            start = alive(module, opt, {"ids": ids}) + stage_buffers(stage)
            with AllocationTrace() as trace:
                step()
            peaks.append(start + trace.whole.peak_bytes)
        out[mode] = {"peak": min(peaks), "peaks": peaks}
        del sched, stage, module, opt
    out["grads"] = differing(grads)
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


def real_multi_rank(rank: int, world: int, schedule: str, plans: list | None = None) -> dict:
    """Each mode's peak under torch's runtime with FSDP2 per block and per stage, and
    which of its stages' gradients differ from no AC's in a run without FSDP (torch's
    split backward finds a middle stage's weights among the sharded parameters, so under
    FSDP2 it computes none: Note [Several stages per rank]), as :func:`real_rank`
    returns them; a plan mode's budget is applied to an ``nn.ModuleList`` of the rank's
    stages, the fqns the simulation's plan file names."""
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
    out: dict = {}
    grads: dict = {}
    for mode in MODES + (["plan"] if plans else []):
        for fsdp in (True, False):
            parts = [stage_part(pp, i, "none" if mode == "plan" else mode) for i in pp.indices]
            if mode == "plan":
                import ac2_dist as ac

                budget = ac.MemoryBudget(peak=plans[rank][0], plan=plans[rank][1])
                ac.apply_ac(torch.nn.ModuleList(parts), budget, modules=[case.block_type()])
                out["text"] = budget.format_plan()
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
                grads[mode] = {f"{i}.{n}": p.grad.clone() for part, i in zip(parts, pp.indices)
                               for n, p in part.named_parameters()}
                continue
            step()  # the optimizer's states and the stages' receive buffers
            peaks = []
            for _ in range(4):
                start = alive(torch.nn.ModuleList(parts), opt, {"ids": ids}) + sum(stage_buffers(s) for s in stages)
                with AllocationTrace() as trace:
                    step()
                peaks.append(start + trace.whole.peak_bytes)
            out[mode] = {"peak": min(peaks), "peaks": peaks}
            del sched, stages, parts, opt
    out["grads"] = differing(grads)
    return out


def differing(grads: dict) -> dict:
    """Per mode but no AC, the gradients (by name) that are not bitwise no AC's, or
    missing or extra; ``"count"``: how many no AC has. Compared on the rank: tensors do
    not travel back from it."""
    none = grads["none"]
    out: dict = {"count": len(none)}
    for mode, g in grads.items():
        if mode != "none":
            out[mode] = sorted(n for n in none.keys() | g.keys()
                               if n not in none or n not in g or not torch.equal(none[n], g[n]))
    return out


def compare(schedule: str, plans: bool = False) -> dict:
    """Simulated and measured peaks of both ranks under ``schedule``, no AC and full AC,
    and with ``plans`` each rank's peak target's plan (``simulated``' target, followed by
    the job from its plan file): ``rows`` (rank, mode, simulated, measured, error; for a
    plan also its target and the highest measured step), and per rank which gradients
    differ from no AC's (``grads``: :func:`differing`)."""
    import tempfile

    from _dist import run_ranks

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        sim = [simulated(r, schedule, folder if plans else None) for r in range(STAGES)]
        t1 = time.perf_counter()
        got = run_ranks(real_rank if schedule in SINGLE else real_multi_rank, schedule,
                        [(s["target"], s["path"]) for s in sim] if plans else None, world=STAGES)
    rows = []
    for r in range(STAGES):
        for m in MODES + (["plan"] if plans else []):
            row = {"rank": r, "mode": m, "simulated": sim[r][m].peak_bytes, "measured": got[r][m]["peak"],
                   "error": sim[r][m].peak_bytes / got[r][m]["peak"] - 1}
            if m == "plan":
                row.update(target=sim[r]["target"], highest=max(got[r][m]["peaks"]),
                           predicted=sim[r][m].predicted_bytes, recompute_flops=sim[r][m].recompute_flops,
                           full_flops=sim[r]["full"].recompute_flops, text=got[r]["text"])
            rows.append(row)
    return {"schedule": schedule, "rows": rows, "grads": [g["grads"] for g in got], "simulate_s": t1 - t0,
            "real_s": time.perf_counter() - t1}
