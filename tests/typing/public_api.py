"""Type-checked by mypy in CI (pyproject.toml [tool.mypy]), never run: the public API as
users call it. A public signature that rejects a documented call, or a return type a user
cannot use without a cast, fails CI here."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import ac2_dist as ac
from ac2_dist.integrations import hf, torch_checkpoint


class Block(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def regions(model: torch.nn.Module, block: Block, x: torch.Tensor) -> torch.Tensor:
    ac.apply_ac(model, "recompute_all", modules=[Block])
    ac.apply_ac(model, [torch.ops.aten.mm.default], modules=lambda fqn, m: isinstance(m, Block),
                rng="replay", replay=ac.ReplayConfig(stream="inline", prefetch=0))
    ac.apply_ac(model, policy_factory=lambda: {torch.ops.aten.mm.default: CheckpointPolicy.MUST_SAVE})
    ac.wrap(block, "must_save_all")
    ac.unwrap(block)
    checked: bool = ac.is_checkpointed(block) and ac.is_checkpoint_enabled()
    with ac.apply_ac_policy("recompute_all", rng="replay", allow_cache_entry_mutation=checked) as _:
        y = block(x)
    ac.tag_with_policy(y, CheckpointPolicy.MUST_SAVE)
    ac.tag_with_policy(y, ac.SAVE_WITH_HOOKS(lambda t: t.cpu(), lambda t: t))
    y = ac.apply_ac_policy_fn(block, x, policy_fn="recompute_all")
    y = ac.checkpoint(block, x, use_reentrant=False)
    y = ac.checkpoint(block, x, use_reentrant=False,
                      context_fn=lambda: create_selective_checkpoint_contexts([torch.ops.aten.mm.default]))
    ckpt = ac.checkpoint_with(policy=[torch.ops.aten.mm.default], rng="replay")
    y = ckpt(block, x, use_reentrant=False)
    y = ac.checkpoint_sequential(torch.nn.Sequential(block), 1, x, use_reentrant=False)
    ac.register_side_effect("mylib")
    return y


def policies(ctx: ac.PolicyContext, op: torch._ops.OpOverload) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE if ctx.rank == 0 and ctx.module_fqn else CheckpointPolicy.MUST_SAVE


def budgets(model: torch.nn.Module) -> str:
    budget = ac.MemoryBudget(0.5)
    ac.MemoryBudget(bytes=256 << 20)
    ac.MemoryBudget(lambda rank: 0.2 if rank < 4 else 0.8)
    peak = ac.MemoryBudget(peak="70GiB", strict=True)
    ac.apply_ac(model, peak, modules=[Block])
    plan = budget.plan("layers.0")
    text = budget.format_plan() + budget.format_plan("layers.0", detail=True) + (plan.format("layers.0") if plan is not None else "")
    peak.close()
    return text


def offload(model: torch.nn.Module) -> int:
    schedule = ac.Offload(defer=1, stream="inline", log=lambda event, block: None)
    ac.apply_ac(model, policies, modules=[Block], replay=ac.ReplayConfig(prefetch=1, offload=schedule))
    schedule.empty_pool()
    stats: ac.offload.OffloadStats = schedule.stats
    return stats.buffers_allocated


def reports(model: torch.nn.Module, x: torch.Tensor) -> int:
    with ac.memory.track(model) as tracker:
        model(x).sum().backward()
        tracker.step()
    report: ac.memory.RankReport = tracker.report()
    stats: list[ac.GraphStats] = tracker.graph_stats
    reports = ac.memory.gather(report)
    ac.memory.save_run(reports, "run.json")
    if reports is not None:
        print(ac.memory.format_table(reports))
        ac.memory.plot(reports, "run.png")
    loaded = ac.memory.load_run("run.json")
    problems: list[str] = ac.memory.run_warnings(loaded)
    return loaded[0].peak_bytes_backward + len(stats) + len(problems) + report.to_dict()["rank"]


def integrations(model: torch.nn.Module) -> bool:
    hf.enable(model, policy="recompute_all", every_n_layers=1)
    names: list[str] = hf.torch_checkpointed(model)
    hf.disable(model)
    torch_checkpoint.enable(policy="recompute_all")
    torch_checkpoint.disable()
    with torch_checkpoint.enabled(policy=[torch.ops.aten.mm.default], rng="replay"):
        pass
    return torch_checkpoint.is_enabled() and hf.is_enabled(model) and not names


def end_of_job() -> str:
    ac.distributed.shutdown()
    ac.distributed.shutdown(after_error=True)
    return ac.__version__
