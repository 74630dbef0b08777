"""ac2's peak-target planner on the peak-vs-recompute plane, beside its peers, in one run.

    python launch/bench_pareto.py                                  # HF GPT-2 and Llama, 6 x 512, seq 512, batch 4
    python launch/bench_pareto.py --models gpt2 --layers 2 --seq 128 --json out.json --png out.png

Models are built from configs (random weights, nothing downloaded, dropout 0), their
decoder layers checkpointed. Every system runs the same step (``logits.float().square()
.mean()``, backward) on the same model, in one process:

- ``no-ac``; ``torch-full``: ``torch.utils.checkpoint`` on every layer;
- ``titan-torch`` / ``titan-ac2``: torchtitan's op-level SAC rule (save the attention
  op, and every second matmul of a layer) under torch's SAC and under ac2;
- ``compile-B``: ``torch.compile`` with AOTAutograd, Inductor's decompositions and the
  min-cut partitioner at ``activation_memory_budget`` B (``aot_eager``: the partitioned
  graphs run op by op, so the allocator and the FLOP counter see them);
- ``sac_milp-M``: torch's optimal SAC solver (``torch.distributed._tools``'s
  ``sac_milp`` on ``SACEstimator``/``MemTracker`` statistics of a fake step, then its
  per-module op knapsack) at budget M MiB of its own model of the step, run under
  torch's SAC; where ``pulp`` and ``pwlf`` are installed (``--sac-milp N`` budgets,
  evenly spaced from the least it finds feasible to its no-AC peak; see
  ``sac_milp_peer.py`` for the CPU roofline its runtime estimates use);
- ``ac2-floor``: ac2 ``"recompute_all"``; ``ac2@X``: ``MemoryBudget(peak=X)`` with X each
  compile point's measured peak (``@compile-B``) and evenly spaced targets from the floor
  to no AC (``@10%``...``@90%``), each on a fresh copy, run ``--steps`` steps (the planner
  measures, corrects and settles) before it is measured. ``--head``: ac2 also checkpoints
  the final norm and the LM head as one region (``apply_ac(..., groups=[[norm,
  "lm_head"]])``; compile partitions the whole model, and without a head region eager
  autograd keeps the last layer's output, the norm's normalized value and its output).
  ``--rebuild``: ac2's Llama layers do not keep the rotary tables (cos, sin) they all
  read; they replay the rotary embedding's ops from the positions in backward
  (``apply_ac(..., rebuild=["model.rotary_emb"])``), as compile's partition does.

Measured, never read from ac2's reports: the step's peak from the allocator's events
(bytes above what was allocated when the step began: the scale of a CPU peak target,
the smallest of two steps), recompute FLOPs (the step's counted FLOPs, forward and
backward, minus no AC's; matmuls and attention, torch's formulas), the step time (median
of ``--rounds`` interleaved rounds). Printed: the table, the Pareto front (a point no
other point beats on both peak and recompute; where both replay no matmul, the step time
says what the larger peak bought), each compile point against ac2 at its peak, each
target's settled use and planned steps. ``--png`` plots peak against recompute.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sac_milp_peer  # noqa: E402
from bench_common import PlainFlops, measure_memory, timed_rounds, write_json  # noqa: E402

import ac2_dist as ac  # noqa: E402

aten = torch.ops.aten
_MM = (aten.mm.default, aten.addmm.default)
_ATTN = tuple(getattr(aten, n).default for n in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention")
    if hasattr(aten, n))


def build(name: str, layers: int, dim: int, seq: int, vocab: int) -> torch.nn.Module:
    """An HF model from its config, random weights, dropout 0, SDPA attention."""
    import transformers as T

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = T.GPT2Config(vocab_size=vocab, n_embd=dim, n_layer=layers, n_head=dim // 64, n_positions=seq,
                           bos_token_id=0, eos_token_id=0,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = T.GPT2LMHeadModel(cfg)
    elif name == "llama":
        cfg = T.LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=dim * 8 // 3 // 64 * 64,
                            num_hidden_layers=layers, num_attention_heads=dim // 64,
                            num_key_value_heads=max(1, dim // 256), max_position_embeddings=seq)
        model = T.LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"unknown model {name!r}: gpt2 or llama")
    model.config._attn_implementation = "sdpa"
    return model.train()


def layer_types(model: torch.nn.Module) -> list[type]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sorted({type(m) for m in model.modules() if isinstance(m, GradientCheckpointingLayer)},
                  key=lambda t: t.__name__)


def loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float().square().mean()


class TitanPolicy:
    """torchtitan's op-level SAC rule: save the attention op; of the matmuls, save every
    second one (counted per layer call; forward and torch's recompute counted apart)."""

    def __init__(self) -> None:
        self.seen = {False: 0, True: 0}

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in _ATTN:
            return CheckpointPolicy.MUST_SAVE
        if op in _MM:
            again = bool(getattr(ctx, "is_recompute", False))
            self.seen[again] += 1
            return CheckpointPolicy.MUST_SAVE if self.seen[again] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE


def with_torch_checkpoint(model: torch.nn.Module, types: list[type], titan: bool) -> torch.nn.Module:
    model = copy.deepcopy(model)
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if titan:
        kwargs["context_fn"] = lambda: create_selective_checkpoint_contexts(TitanPolicy())
    for m in model.modules():
        if isinstance(m, tuple(types)):
            m.forward = functools.partial(checkpoint, m.forward, **kwargs)
    return model


def compiled(model: torch.nn.Module, budget: float, counter: dict) -> torch.nn.Module:
    """``model`` compiled with the min-cut partitioner at ``budget`` (Inductor's
    decompositions, graphs run op by op); while ``counter["on"]`` the backward graph's
    FLOPs are added to ``counter["flops"]``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    def fw(gm, _inputs):
        return make_boxed_func(gm.forward)

    def bw(gm, _inputs):
        def run(args):
            if not counter["on"]:
                return gm(*args)
            mode = PlainFlops()
            with mode:
                out = gm(*args)
            counter["flops"] += mode.flops
            return out

        run._boxed_call = True
        return run

    inner = aot_autograd(fw_compiler=fw, bw_compiler=bw, partition_fn=min_cut_rematerialization_partition,
                         decompositions=select_decomp_table())

    def backend(gm, example_inputs):
        with torch._functorch.config.patch(activation_memory_budget=budget, enable_autograd_cache=False):
            return inner(gm, example_inputs)

    return torch.compile(copy.deepcopy(model), backend=backend, fullgraph=False)


def step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    loss(model, ids).backward()


def peak(model: torch.nn.Module, ids: torch.Tensor) -> int:
    return measure_memory(model, ids, loss)["peak_bytes"]


def counted_flops(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """FLOPs of one forward and backward (torch's formulas, every op dispatched unchanged)."""
    model.zero_grad(set_to_none=True)
    mode = PlainFlops()
    with mode:
        loss(model, ids).backward()
    return mode.flops


def dominated(p: dict, points: list[dict]) -> str | None:
    for q in points:
        if q is p:
            continue
        if (q["peak"] <= p["peak"] and q["recompute"] <= p["recompute"]
                and (q["peak"] < p["peak"] or q["recompute"] < p["recompute"])):
            return q["mode"]
    return None


def sweep(name: str, args: argparse.Namespace) -> dict:
    mib, gf = 1 / 2**20, 1e-9
    base = build(name, args.layers, args.dim, args.seq, args.vocab)
    types = layer_types(base)
    ac2_modules: Any = types
    groups = [["transformer.ln_f" if name == "gpt2" else "model.norm", "lm_head"]] if args.head else []
    rebuild = ["model.rotary_emb"] if args.rebuild and name == "llama" else []
    ac2 = functools.partial(ac.apply_ac, modules=ac2_modules, groups=groups, rebuild=rebuild)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    models: dict[str, torch.nn.Module] = {
        "no-ac": copy.deepcopy(base),
        "torch-full": with_torch_checkpoint(base, types, titan=False),
        "titan-torch": with_torch_checkpoint(base, types, titan=True),
        "ac2-floor": ac2(copy.deepcopy(base), "recompute_all"),
        "titan-ac2": ac2(copy.deepcopy(base), policy_factory=TitanPolicy),
    }
    rows: dict[str, dict] = {}
    no_ac_flops = counted_flops(models["no-ac"], ids)

    def measure(mode: str, model: torch.nn.Module, flops: int | None = None, **extra: Any) -> dict:
        step(model, ids)
        p = min(peak(model, ids) for _ in range(2))
        if flops is None:
            flops = counted_flops(model, ids) - no_ac_flops
        rows[mode] = {"mode": mode, "peak": p, "recompute": flops, **extra}
        print(f"  {mode:<18} peak {p * mib:8.1f} MiB  recompute {flops * gf:8.2f} GFLOP", flush=True)
        return rows[mode]

    print(f"{name}: {args.layers} layers x {args.dim}, seq {args.seq}, batch {args.batch}, vocab {args.vocab}; "
          f"no AC's step {no_ac_flops * gf:.1f} GFLOP")
    for mode, model in models.items():
        measure(mode, model)
    if args.sac_milp:
        build_fn = functools.partial(build, name, args.layers, args.dim, args.seq, args.vocab)
        for plan in sac_milp_peer.plans(build_fn, loss, ids, tuple(types), args.sac_milp):
            mode = f"sac_milp-{plan['budget_gib'] * 1024:.0f}"
            models[mode] = sac_milp_peer.checkpointed(base, plan)
            measure(mode, models[mode], budget_gib=plan["budget_gib"], discard=plan["discard"],
                    solver_peak_gib=plan["solver_peak_gib"])
    counter = {"on": False, "flops": 0}
    fwd = PlainFlops()  # no AC's backward FLOPs: the whole step's minus its forward's
    with fwd:
        loss(models["no-ac"], ids)
    no_ac_backward = no_ac_flops - fwd.flops
    for b in args.budgets:
        torch._dynamo.reset()
        model = compiled(base, b, counter)
        step(model, ids)  # compiles
        counter.update(on=True, flops=0)
        step(model, ids)
        counter["on"] = False
        models[f"compile-{b}"] = model
        measure(f"compile-{b}", model, flops=counter["flops"] - no_ac_backward)
    floor, top = rows["ac2-floor"]["peak"], rows["no-ac"]["peak"]
    targets = [(f"@compile-{b}", rows[f"compile-{b}"]["peak"]) for b in args.budgets]
    targets += [(f"@{k * 10}%", floor + round(k / 10 * (top - floor))) for k in range(1, 10)]
    for label, target in targets:
        budget = ac.MemoryBudget(peak=target)
        model = ac2(copy.deepcopy(base), budget)
        use = [peak(model, ids) / target for _ in range(args.steps)]
        planner = budget.peak_planner
        extra = {"target": target, "use": use, "state": planner.state, "planned_steps": planner.planned_steps,
                 "estimated_recompute": planner.recompute()[1], "reason": planner.reason}
        models[f"ac2{label}"] = model
        r = measure(f"ac2{label}", model, **extra)
        print(f"    target {target * mib:.1f} MiB: steps " + " ".join(f"{u:.3f}" for u in use)
              + f"  {planner.state} after {planner.planned_steps} planned steps ({planner.reason});"
              f" ac2's estimate {r['estimated_recompute'] * gf:.2f} GFLOP", flush=True)
    times = timed_rounds({m: functools.partial(step, model, ids) for m, model in models.items()},
                         args.rounds, warmup=1)
    for m, r in rows.items():
        r["step_s"] = statistics.median(times[m])
    points = list(rows.values())
    ref = rows["no-ac"]["step_s"]
    print(f"\n{name}: peak (allocator), recompute (counted), step time (median of {args.rounds}, / no AC)")
    print(f"{'mode':<20} {'peak MiB':>9} {'GFLOP':>8} {'step':>7}  dominated by")
    for p in sorted(points, key=lambda p: p["peak"]):
        p["dominated_by"] = by = dominated(p, points)
        note = "-" if by is None else by
        if by is not None and p["recompute"] == 0:
            # both replay no matmul: what the larger peak buys is memory-bound replays not run
            note += f" (0 GFLOP both; its step {rows[by]['step_s'] / ref:.3f})"
        print(f"{p['mode']:<20} {p['peak'] * mib:9.1f} {p['recompute'] * gf:8.2f} {p['step_s'] / ref:7.3f}  {note}")
    verdicts = []
    for b in args.budgets:
        c, a = rows[f"compile-{b}"], rows[f"ac2@compile-{b}"]
        ok = a["peak"] <= c["peak"] and a["recompute"] <= c["recompute"] * 1.01 + 1e6
        verdicts.append({"budget": b, "compile_peak": c["peak"], "ac2_peak": a["peak"],
                         "compile_recompute": c["recompute"], "ac2_recompute": a["recompute"], "ok": ok})
        print(f"compile {b}: {c['peak'] * mib:.1f} MiB, {c['recompute'] * gf:.2f} GFLOP; ac2 at that target "
              f"{a['peak'] * mib:.1f} MiB, {a['recompute'] * gf:.2f} GFLOP  {'ok' if ok else 'BEHIND'}")
    settled = [rows[f"ac2@{k * 10}%"] for k in range(1, 10)]
    print("settled use of the target (10%..90% of the way from the floor to no AC): "
          + " ".join(f"{r['use'][-1]:.3f}" for r in settled)
          + f"; worst step {max(max(r['use']) for r in settled):.3f}; planned steps "
          + " ".join(str(r["planned_steps"]) for r in settled))
    return {"model": name, "no_ac_flops": no_ac_flops, "rows": points, "vs_compile": verdicts}


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    style = {"ac2@": ("o", "C0", "ac2 MemoryBudget(peak=...)"), "compile-": ("s", "C1", "compile min-cut"),
             "torch-full": ("^", "C2", "torch checkpoint"), "titan-torch": ("v", "C3", "torchtitan SAC, torch"),
             "titan-ac2": ("D", "C4", "torchtitan SAC, ac2"), "sac_milp-": ("P", "C5", "torch sac_milp"), "ac2-floor": ("*", "C0", "ac2 recompute_all"),
             "no-ac": ("x", "k", "no AC")}
    for ax, res in zip(axes[0], results):
        for prefix, (marker, color, label) in style.items():
            pts = [p for p in res["rows"] if p["mode"].startswith(prefix)]
            if pts:
                ax.scatter([p["peak"] / 2**20 for p in pts], [p["recompute"] / 1e9 for p in pts],
                           marker=marker, color=color, label=label, s=36)
        ax.set_title(res["model"])
        ax.set_xlabel("step peak, MiB (allocator)")
        ax.set_ylabel("recompute, GFLOP (counted)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt2,llama", help="comma-separated: gpt2, llama")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--budgets", default="1.0,0.8,0.6,0.4,0.2,0.0", help="compile's activation_memory_budget points")
    p.add_argument("--steps", type=int, default=6, help="steps each ac2 target runs before it is measured")
    p.add_argument("--head", action="store_true",
                   help="ac2 also checkpoints the final norm and the LM head, as one region")
    p.add_argument("--rebuild", action="store_true",
                   help="ac2's Llama layers rebuild the rotary tables from the positions in backward")
    p.add_argument("--sac-milp", type=int, default=None,
                   help="budgets for torch's sac_milp (default 6 where pulp and pwlf are installed, else 0)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)
    args.budgets = [float(b) for b in args.budgets.split(",") if b]
    if args.sac_milp is None:
        args.sac_milp = 6 if sac_milp_peer.available() else 0
        if not args.sac_milp:
            print("sac_milp left out: pulp or pwlf is not installed (pip install pulp pwlf)")
    elif args.sac_milp and not sac_milp_peer.available():
        p.error("--sac-milp needs pulp and pwlf (pip install pulp pwlf)")
    if args.dim % 64 or args.steps < 1 or args.rounds < 1:
        p.error("--dim must be a multiple of 64; --steps and --rounds at least 1")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = [sweep(name, args) for name in args.models.split(",")]
    if args.png:
        plot(results, args.png)
        print(f"wrote {args.png}")
    return write_json(args.json, {"torch": torch.__version__, "args": vars(args),
                                  "models": results})


if __name__ == "__main__":
    main()
