"""The small case the simulation is checked on: a tiny Llama under FSDP2 per block, its
simulated figures (``ac2_dist.simulate``) and the same step measured on real gloo ranks
(the CPU allocator's events, FLOPs counted by a dispatch mode), independently of ac2's
reports."""

from __future__ import annotations

from typing import Any

import torch

VOCAB, HIDDEN, INTER, LAYERS, HEADS = 512, 128, 384, 3, 4
BATCH, SEQ = 2, 128  # activations enough above gloo's late buffers for a target between (test_simulate.py)
SAVE = [torch.ops.aten.mm.default]  # the save-list mode


def config(layers: int = LAYERS) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers,
                       num_attention_heads=HEADS, num_key_value_heads=HEADS, attn_implementation="sdpa")


def build(layers: int = LAYERS) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(config(layers)).train()


def batch() -> dict:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids}


def block_type() -> type:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def _measure_mode(mode: str, plan: str | None, target: int | None) -> dict:
    from torch.distributed.fsdp import fully_shard

    import ac2_dist as ac

    torch.manual_seed(0)
    model = build()
    budget = None
    if mode == "full":
        ac.apply_ac(model, "recompute_all", modules=[block_type()])
    elif mode == "save":
        ac.apply_ac(model, list(SAVE), modules=[block_type()])
    elif mode == "plan":
        budget = ac.MemoryBudget(peak=target, plan=plan)
        ac.apply_ac(model, budget, modules=[block_type()])
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(1)
    b = batch()

    if mode == "plan":  # steps 1-3 measured: step 1 follows the file, the planner verifies from there
        peaks = []
        for _ in range(3):
            peaks.append(_measured_step(model, opt, b)[1])
            if len(peaks) == 1:
                calibrations = budget._calibrations
        history = [(r.step, r.what, r.predicted, r.measured, r.note) for r in budget.peak_planner.history]
        return {"peaks": peaks, "calibrations": calibrations, "calibrations_after": budget._calibrations,
                "history": history, "state": budget.peak_planner.state}
    return _steps_2_to_6(model, opt, b)


def _measured_step(model: torch.nn.Module, opt: torch.optim.Optimizer, b: dict) -> tuple[int, int]:
    """One training step: (bytes alive at its start, its absolute peak from the allocator)."""
    # launch/'s measuring helpers (tests/conftest.py puts launch/ on sys.path; the
    # factory above is imported without it, by the CLI test)
    from bench_simulate import alive, train_step

    from ac2_dist._measure._alloc import AllocationTrace

    start = alive(model, opt, b)
    with AllocationTrace() as trace:
        train_step(model, opt, b)
    return start, start + trace.whole.peak_bytes


def off_thread_frees(model: torch.nn.Module, opt: torch.optim.Optimizer, b: dict) -> list[int]:
    """One training step under the profiler: the sizes of the blocks a thread other than
    the step's own freed (gloo's worker threads: Note [Collective buffers gloo frees late]
    in ac2_dist/_plan/_late_buffers.py)."""
    from bench_simulate import train_step
    from torch._C._profiler import _ExtraFields_Allocation
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_step(model, opt, b)
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if isinstance(e.extra_fields, _ExtraFields_Allocation) and e.extra_fields.device.type == "cpu":
            events.append((e.start_tid, e.extra_fields.alloc_size))
    counts: dict[int, int] = {}
    for tid, _ in events:
        counts[tid] = counts.get(tid, 0) + 1
    own = max(counts, key=lambda t: counts[t])  # the training thread makes nearly every allocation
    return [-n for tid, n in events if tid != own and n < 0]


def _steps_2_to_6(model: torch.nn.Module, opt: torch.optim.Optimizer, b: dict) -> dict:
    """Step 1 creates the optimizer's states; steps 2-6 are measured (bytes alive at the
    last one's start, the absolute peaks); then the FLOPs of one forward + backward."""
    from bench_common import PlainFlops
    from bench_simulate import train_step

    train_step(model, opt, b)
    steps = [_measured_step(model, opt, b) for _ in range(5)]
    start, peaks = steps[-1][0], [peak for _, peak in steps]
    # Note [A measured CPU step varies with gloo's threads] in tests/test_simulate.py
    out: dict[str, Any] = {"peak": min(peaks), "peaks": peaks, "start": start}
    counter = PlainFlops()
    with counter:
        loss = model(**b).loss
        loss.backward()
    del loss
    out["flops"] = counter.flops
    return out


def measure_rank(rank: int, world: int, modes: list[str], plan: str | None = None,
                 target: int | None = None) -> dict:
    """Per mode: the absolute peaks of steps 2-6 (``"plan"``: of steps 1-3, step 1 the plan
    file's) on this rank, the bytes alive when the last began, and the FLOPs of one
    forward + backward."""
    return {mode: _measure_mode(mode, plan, target) for mode in modes}


def simulated(modes: list[Any], target: Any = None) -> Any:
    from ac2_dist.simulate import simulate

    return simulate(build, batch=batch, blocks=[block_type()], world_size=2, rank=0, modes=modes, target=target,
                    device="cpu")


def save_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    """A policy callable (the save list [mm] written as a function)."""
    return op is torch.ops.aten.mm.default


#: name -> (policy, policy factory name, FSDP2 mixed precision, reshard_after_forward of the blocks)
POLICY_CASES = {
    "titan": (None, "titan", False, True),
    "fn": ("save_mm", None, False, True),
    "mp-none": (None, None, True, True),
    "mp-full": ("recompute_all", None, True, True),
    "abl-full": ("recompute_all", None, False, "all-but-last"),
    "none": (None, None, False, True),
    "head-full": ("recompute_all", None, False, True),  # and the final norm + LM head as one region
}
HEAD = ["model.norm", "lm_head"]  # the group of the "head-" cases


def _measure_policy(name: str) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import ac2_dist as ac
    from ac2_dist._sim._policies import TorchtitanOpSAC

    policy, factory, mp, reshard = POLICY_CASES[name]
    groups = [HEAD] if name.startswith("head-") else []
    torch.manual_seed(0)
    model = build()
    if factory == "titan":
        ac.apply_ac(model, policy_factory=TorchtitanOpSAC, modules=[block_type()])
    elif policy is not None:
        ac.apply_ac(model, save_mm if policy == "save_mm" else policy, modules=[block_type()], groups=groups)
    kwargs: dict[str, Any] = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                reduce_dtype=torch.float32)} if mp else {}
    layers = list(model.model.layers)
    for k, layer in enumerate(layers):
        fully_shard(layer, reshard_after_forward=reshard if reshard != "all-but-last" else k < len(layers) - 1,
                    **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(1)
    return _steps_2_to_6(model, opt, batch())


def measure_policies_rank(rank: int, world: int, names: list[str]) -> dict:
    """Per name of :data:`POLICY_CASES`: the lowest absolute peak of steps 2-6 on this rank
    and the FLOPs of one forward + backward."""
    return {name: _measure_policy(name) for name in names}


#: the blocks' tensor-parallel plan (Hugging Face's Llama plan, per block)
TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
           "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
           "mlp.down_proj": "rowwise"}


def _measure_tp(mode: str, world: int, tp: int, plan: str | None = None, target: int | None = None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import ac2_dist as ac

    torch.manual_seed(0)
    model = build()
    budget = None
    if mode == "full":
        ac.apply_ac(model, "recompute_all", modules=[block_type()])
    elif mode == "plan":
        budget = ac.MemoryBudget(peak=target, plan=plan)
        ac.apply_ac(model, budget, modules=[block_type()])
    elif mode == "torch":  # torch's checkpoint, each block (non-reentrant)
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, block_type()))
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in model.model.layers:  # torchtitan's order: TP, then FSDP2 over dp
        inner = getattr(layer, "_checkpoint_wrapped_module", layer)  # torch's wrapper: its paths are inside
        parallelize_module(inner, mesh["tp"], {k: styles[v]() for k, v in TP_PLAN.items()})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(1)
    b = batch()
    if budget is not None:  # steps 1-3: step 1 follows the file, the planner verifies from there
        peaks = [_measured_step(model, opt, b)[1] for _ in range(3)]
        history = [(r.step, r.what, r.predicted, r.measured, r.note) for r in budget.peak_planner.history]
        return {"peaks": peaks, "history": history, "state": budget.peak_planner.state}
    out = _steps_2_to_6(model, opt, b)
    if mode == "full":  # what gloo's threads free: tensor parallelism's collectives among them?
        from ac2_dist.fsdp import collective_buffers

        out["off_thread_frees"] = [n for _ in range(2) for n in off_thread_frees(model, opt, b)]
        out["fsdp_buffers"] = sorted({found[1] for m in model.modules()
                                      if (found := collective_buffers(m)) is not None})
    return out


def measure_tp_rank(rank: int, world: int, modes: list[str], tp: int, plan: str | None = None,
                    target: int | None = None) -> dict:
    """Per mode, FSDP2 over dp and tensor parallelism over tp (a (world / tp, tp) mesh):
    the lowest absolute peak of steps 2-6 on this rank and the FLOPs of one forward +
    backward (``"plan"``: the peaks of steps 1-3 following the plan file ``plan``; ``"full"``
    also: the blocks two more steps' gloo threads freed, and FSDP's collective buffer sizes)."""
    return {mode: _measure_tp(mode, world, tp, plan, target) for mode in modes}
