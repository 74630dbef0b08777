"""``MemoryBudget(peak=N)`` on Hugging Face models: is every step within its target?

    python launch/bench_peak_targets.py                      # GPT-2, Llama, BERT, Mixtral; 9 targets; 7 steps
    python launch/bench_peak_targets.py --models gpt2 --targets 19 --json out.json

Each model is built from a small config (random weights, nothing downloaded; GPT-2 and
BERT with dropout 0.1, Llama with grouped-query attention, Mixtral with 4 experts on
transformers' default experts path), its layers checkpointed by
``apply_ac`` on HF's checkpointed layer types. The targets are evenly spaced between the
floor's peak (``"recompute_all"``) and no AC's, both measured here first. For each target
a fresh model and budget run ``--steps`` steps; every step's peak is read from the
allocator's events (bytes above what was allocated when the step began, the scale of a
CPU peak target), not from ac2's reports. Printed per target: each step's peak / target,
the planner's state and its planned steps, the settled plan's recompute as the planner
estimates it (the roofline time it minimizes within the target), and the worst step;
then the worst step and the least settled use (the last step's peak / target) over all. The planner measures
step 1 at the floor, then verifies a plan per step, climbing while a step used less than
97 % of the target (above that, only to a plan that recomputes less and is predicted to
fit), for at most 4 planned steps, and follows one plan from then on. Where
a settled plan uses less than 97 %, the plans one step up its frontier (one block at a
time) are run and measured too ("next plan up"): over 1.0, none fits the target, and the
settled plan is the cheapest that does (the shortfall is the frontier's granularity, not
headroom left unused).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import measure_memory, write_json  # noqa: E402

import ac2_dist as ac  # noqa: E402

V, S, B = 128, 32, 2  # vocab, sequence, batch


def build(name: str) -> torch.nn.Module:
    """A small HF model from its config (``gpt2``, ``llama``, ``bert``, ``mixtral``), in train mode."""
    import transformers as T

    torch.manual_seed(0)
    if name == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=64, n_layer=3, n_head=4, n_positions=64,
                                               resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
    elif name == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=64))
    elif name == "bert":
        model = T.BertForMaskedLM(T.BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=3,
                                               num_attention_heads=4, intermediate_size=128,
                                               max_position_embeddings=64, hidden_dropout_prob=0.1,
                                               attention_probs_dropout_prob=0.1))
    elif name == "mixtral":  # transformers' default experts path (grouped matmul)
        model = T.MixtralForCausalLM(T.MixtralConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                                     num_hidden_layers=3, num_attention_heads=4,
                                                     num_key_value_heads=2, num_local_experts=4,
                                                     num_experts_per_tok=2, max_position_embeddings=64))
    else:
        raise ValueError(f"unknown model {name!r}: gpt2, llama, bert or mixtral")
    return model.train()


def layer_types(model: torch.nn.Module) -> list[type]:
    """The layer types HF's own gradient checkpointing checkpoints."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sorted({type(m) for m in model.modules() if isinstance(m, GradientCheckpointingLayer)},
                  key=lambda t: t.__name__)


def loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float().square().mean()


def peak(model: torch.nn.Module, ids: torch.Tensor) -> int:
    return measure_memory(model, ids, loss)["peak_bytes"]


USE = 0.97  # a settled plan is to use at least this share of its target, where a larger plan fits


def next_plan_use(planner: Any, model: torch.nn.Module, ids: torch.Tensor, target: int) -> float | None:
    """Why a settled plan uses less than ``USE`` of its target: the plans one step up the
    frontier (one block at a time: each block's next saved set that costs less recompute),
    each run for a step and measured; the least of their peaks / the target, None if every
    block already saves all it can. Over 1.0: no cheaper plan fits, the settled one is the
    best there is (its frontier's next step is coarser than the headroom). Run after the
    measured steps: it replaces the planner's plan (private API of a settled planner)."""
    calls = planner.structure or []
    choice = list(planner.choice or [0] * len(calls))
    uses = []
    for k, c in enumerate(calls):
        if choice[k] + 1 < len(planner.options(c.signature)):
            planner._install(tuple(choice[:k] + [choice[k] + 1] + choice[k + 1:]))
            uses.append(peak(model, ids) / target)
    planner._install(tuple(choice) if planner.choice is not None else None)
    return min(uses, default=None)


def sweep(name: str, targets: int, steps: int) -> dict:
    base = build(name)
    types = layer_types(base)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    eager = copy.deepcopy(base)
    floor_model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=types)
    eager_peak = min(peak(eager, ids) for _ in range(2))
    floor_peak = min(peak(floor_model, ids) for _ in range(2))
    rows = []
    for i in range(1, targets + 1):
        fraction = i / (targets + 1)
        target = floor_peak + round(fraction * (eager_peak - floor_peak))
        budget = ac.MemoryBudget(peak=target)
        model = ac.apply_ac(copy.deepcopy(base), budget, modules=types)
        ratios = [peak(model, ids) / target for _ in range(steps)]
        planner = budget.peak_planner
        seconds, flops = planner.recompute()
        row = {"fraction": fraction, "target": target, "peak_over_target": ratios, "state": planner.state,
               "planned_steps": planner.planned_steps, "worst": max(ratios), "settled_use": ratios[-1],
               "recompute_est_us": seconds * 1e6, "recompute_flops": flops}
        line = (f"{name:7} {fraction:4.2f} of the way  target {target:>9} B  steps " + " ".join(f"{r:.3f}" for r in ratios)
                + f"  {planner.state} after {planner.planned_steps} planned; recompute {seconds * 1e6:.1f} us est.")
        if ratios[-1] < USE:
            row["next_plan_use"] = next_plan_use(planner, model, ids, target)
            line += ("; next plan up: " + ("none (every block saves all it can)" if row["next_plan_use"] is None
                                           else f"{row['next_plan_use']:.3f}"))
        rows.append(row)
        print(line, flush=True)
    return {"model": name, "floor_peak": floor_peak, "no_ac_peak": eager_peak, "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt2,llama,bert,mixtral", help="comma-separated: gpt2, llama, bert, mixtral")
    p.add_argument("--targets", type=int, default=9, help="targets between the floor's peak and no AC's")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.targets < 1 or args.steps < 1:
        p.error("--targets and --steps must be at least 1")
    print(f"torch {torch.__version__}; each step's allocator peak / its target ({args.steps} steps per target)")
    results = [sweep(name, args.targets, args.steps) for name in args.models.split(",")]
    worst = max(r["worst"] for res in results for r in res["rows"])
    least = min(r["settled_use"] for res in results for r in res["rows"])
    # where the next plan up fits the target too, the settled use is the planner's shortfall
    fits = [r["settled_use"] for res in results for r in res["rows"] if (r.get("next_plan_use") or 2.0) <= 1.0]
    print(f"worst step over all targets: {worst:.3f} of its target; least settled use: {least:.3f}; "
          f"settled under {USE} of the target with a larger plan that fits: {len(fits)}")
    return write_json(args.json, {"torch": torch.__version__, "steps": args.steps, "models": results, "worst": worst,
                                  "least_settled_use": least, "short_with_a_fitting_plan": len(fits)})


if __name__ == "__main__":
    main()
