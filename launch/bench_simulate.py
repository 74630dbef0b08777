"""ac2_dist.simulate against real gloo runs: the predicted-vs-measured table.

    python launch/bench_simulate.py                       # llama and gpt2, 2 and 4 ranks
    python launch/bench_simulate.py --models gpt2 --worlds 2 --json out.json
    python launch/bench_simulate.py --models llama,gpt2,qwen2,gptneox,mixtral

Per model (a tiny Llama and a tiny GPT-2 by default; also Qwen2, GPT-NeoX and Mixtral with
its default experts path, all built with ``from_config``: nothing is
downloaded) and world size W (gloo ranks spawned as tests/_dist.py does, each on one
thread), FSDP2 per block, AdamW: rank 0's step simulated by ``ac2_dist.simulate`` and
the same step run on W real ranks, for no AC, full AC, a save list and three peak
targets (a quarter, half and three quarters of the way from the lowest target a gloo job
can plan for -- full AC plus the collective buffers gloo's threads may hold late,
``SimulationReport.late_bytes`` -- to no AC; the real job runs
``MemoryBudget(peak=target, plan=file)`` with the simulation's plan file and is measured
in its first step, which follows the file).

Measured independently of ac2's reports: the peak is the bytes of every storage alive
when the step began (parameter shards, optimizer states, the batch) plus the CPU
allocator's peak above them during the step (allocator events); FLOPs are counted by a
dispatch mode over one forward + backward, recompute being the difference from no AC.
A measured step varies by a gloo buffer or two (tests/test_simulate.py's docstring says
why: gloo's threads free collective buffers late): the lowest of ``--steps`` steps is compared
with the simulation, and every step of a plan's job with its target. A peak target's step 1 runs on fresh models ``--steps`` times
(optimizer states made first, so that it holds what the simulated step holds).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from bench_common import PlainFlops, write_json  # noqa: E402

VOCAB, HIDDEN, INTER, LAYERS, HEADS = 512, 128, 384, 3, 4
BATCH, SEQ = 2, 128
FRACTIONS = (0.25, 0.5, 0.75)  # the peak targets, from the lowest on gloo (0: full AC + late buffers) to no AC (1)
PEAK_TOL, FLOPS_TOL = 0.05, 0.01
MODELS = ("llama", "gpt2", "qwen2", "gptneox", "mixtral")


@dataclass(frozen=True)
class Case:
    """A tiny test model (``"llama"`` or ``"gpt2"``), its batch and its blocks."""

    model: str = "llama"

    def build(self) -> torch.nn.Module:
        if self.model == "llama":
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                              num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
                              attn_implementation="sdpa")
            return LlamaForCausalLM(cfg).train()
        if self.model == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                             attn_implementation="sdpa")
            return GPT2LMHeadModel(cfg).train()
        if self.model == "qwen2":
            from transformers import Qwen2Config, Qwen2ForCausalLM

            cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                              num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, attn_implementation="sdpa")
            return Qwen2ForCausalLM(cfg).train()
        if self.model == "gptneox":
            from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

            cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                                num_hidden_layers=LAYERS, num_attention_heads=HEADS, hidden_dropout=0.0,
                                attention_dropout=0.0, attn_implementation="sdpa")
            return GPTNeoXForCausalLM(cfg).train()
        if self.model == "mixtral":  # the default experts path (aten._grouped_mm)
            from transformers import MixtralConfig, MixtralForCausalLM

            cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER // 2,
                                num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
                                num_local_experts=4, num_experts_per_tok=2, attn_implementation="sdpa")
            return MixtralForCausalLM(cfg).train()
        raise ValueError(f"bench_simulate: unknown model {self.model!r} ({', '.join(MODELS)})")

    def batch(self) -> dict:
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        return {"input_ids": ids, "labels": ids}

    def block_type(self) -> type:
        if self.model == "llama":
            from transformers.models.llama.modeling_llama import LlamaDecoderLayer

            return LlamaDecoderLayer
        if self.model == "qwen2":
            from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

            return Qwen2DecoderLayer
        if self.model == "gptneox":
            from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer

            return GPTNeoXLayer
        if self.model == "mixtral":
            from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

            return MixtralDecoderLayer
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return GPT2Block

    def save_ops(self) -> list:
        # GPT-2's projections are Conv1D and GPT-NeoX's Linear layers have biases: addmm
        aten = torch.ops.aten
        return [aten.addmm.default] if self.model in ("gpt2", "gptneox") else [aten.mm.default]

    def blocks(self, model: torch.nn.Module) -> list:
        if self.model == "gpt2":
            return list(model.transformer.h)
        if self.model == "gptneox":
            return list(model.gpt_neox.layers)
        return list(model.model.layers)


# ---- the real step ---------------------------------------------------------------------------
def alive(model: torch.nn.Module, opt: torch.optim.Optimizer, b: dict) -> int:
    """Bytes of every storage the step starts with: parameters (local shards), buffers,
    gradients, optimizer states, the batch (each storage once)."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            if hasattr(t, "to_local"):
                t = t.to_local()
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for buf in model.buffers():
        add(buf)
    for state in opt.state.values():
        for v in state.values():
            add(v)
    for v in b.values():
        add(v)
    return sum(seen.values())


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, b: dict) -> None:
    loss = model(**b).loss
    loss.backward()
    del loss
    opt.step()
    opt.zero_grad(set_to_none=True)


def _setup(case: Case, policy: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    from torch.distributed.fsdp import fully_shard

    import ac2_dist as ac

    torch.manual_seed(0)
    model = case.build()
    if policy is not None:
        ac.apply_ac(model, policy, modules=[case.block_type()])
    for block in case.blocks(model):
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(1)
    return model, opt, case.batch()


def _measured_step(model: torch.nn.Module, opt: torch.optim.Optimizer, b: dict) -> int:
    from ac2_dist._measure._alloc import AllocationTrace

    start = alive(model, opt, b)
    with AllocationTrace() as trace:
        train_step(model, opt, b)
    return start + trace.whole.peak_bytes


def _counted_flops(model: torch.nn.Module, b: dict) -> int:
    counter = PlainFlops()
    with counter:
        loss = model(**b).loss
        loss.backward()
    del loss
    return counter.flops


def _measure_mode(case: Case, mode: str, steps: int, plan: str | None, target: int | None) -> dict:
    """Steps 2..steps+1 of a mode (step 1 creates the optimizer's states); for ``"plan"``
    step 1 of ``steps`` fresh jobs following the plan file, their optimizer states made
    first (a zero-gradient AdamW step)."""
    import ac2_dist as ac

    if mode == "plan":
        peaks, flops = [], 0
        for rep in range(steps + 1):
            budget = ac.MemoryBudget(peak=target, plan=plan)
            model, opt, b = _setup(case, budget)
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if rep < steps:
                peaks.append(_measured_step(model, opt, b))
                assert budget._calibrations == 0, "step 1 calibrated instead of following the plan file"
            else:
                flops = _counted_flops(model, b)  # a fresh job's step 1: the file's plan
        return {"peak": min(peaks), "peaks": peaks, "flops": flops}
    policy = {"none": None, "full": "recompute_all", "save": case.save_ops()}[mode]
    model, opt, b = _setup(case, policy)
    train_step(model, opt, b)
    peaks = [_measured_step(model, opt, b) for _ in range(steps)]
    return {"peak": min(peaks), "peaks": peaks, "flops": _counted_flops(model, b)}


def measure_rank(rank: int, world: int, case: Case, modes: list[str], steps: int,
                 plans: dict[str, tuple[str, int]] | None = None) -> dict:
    """Per mode (``none``, ``full``, ``save``, or a key of ``plans``: (file, target)) the
    lowest and every measured peak of this rank and the FLOPs of one forward + backward."""
    torch.set_num_threads(1)
    plans = plans or {}
    out = {}
    for m in modes:
        path, target = plans.get(m, (None, None))
        out[m] = _measure_mode(case, "plan" if m in plans else m, steps, path, target)
    return out


# ---- the simulation and the table -----------------------------------------------------------
def simulated(case: Case, world: int, fractions: tuple[float, ...] = FRACTIONS) -> tuple[Any, list]:
    """The simulation of rank 0 (no AC, full AC, the save list) and its plans for the
    peak targets: (report, [(name, target, ModeReport, plan dict)])."""
    from ac2_dist.simulate import simulate

    report = simulate(case.build, batch=case.batch, blocks=[case.block_type()], world_size=world, rank=0,
                      modes=["none", "full", case.save_ops()], device="cpu")
    none, full = report.mode("no AC").peak_bytes, report.mode("full AC").peak_bytes
    low = full + report.late_bytes  # the lowest target a gloo job can plan for
    targets = []
    for f in fractions:
        target = low + int(f * (none - low))
        planned = report.plan(target)
        targets.append((f"target {f:.2f}", target, planned, dict(report._plan or {})))
    return report, targets


def run_case(case: Case, world: int, steps: int = 5, fractions: tuple[float, ...] = FRACTIONS) -> list[dict]:
    """The rows of one (model, world): simulated against measured (the real run waited for
    until it ends or stops making progress, as tests/_hang.py waits: a hang fails, a slow run does not)."""
    import json

    from _dist import run_ranks

    report, targets = simulated(case, world, fractions)
    with tempfile.TemporaryDirectory() as tmp:
        plans = {}
        for k, (_, target, _, doc) in enumerate(targets):
            path = os.path.join(tmp, f"plan{k}.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(doc, f)
            plans[f"plan{k}"] = (path, target)
        every = run_ranks(measure_rank, case, ["none", "full", "save", *plans], steps, plans, world=world)
    real = every[0]
    base = real["none"]["flops"]
    rows = []
    sims = [(report.modes[0], "none", None), (report.modes[1], "full", None), (report.modes[2], "save", None)]
    sims += [(planned, f"plan{k}", target) for k, (_, target, planned, _) in enumerate(targets)]
    for sim, key, target in sims:
        got = real[key]
        name = sim.name if target is None else f"{sim.name.split()[0]} {target / 2**20:.2f} MiB"
        rows.append({"model": case.model, "world": world, "mode": name, "target": target, "late": report.late_bytes,
                     "predicted": sim.peak_bytes, "peak_model": sim.predicted_bytes if target else None,
                     "measured": got["peak"], "measured_max": max(got["peaks"]),
                     # a plan's job: its highest step on any rank (it must stay within the target)
                     "highest_any_rank": max(max(r[key]["peaks"]) for r in every),
                     "flops_predicted": sim.recompute_flops, "flops_counted": got["flops"] - base})
    return rows


def _rel(a: int, b: int) -> float | None:
    return None if b == 0 else a / b - 1


def table(rows: list[dict]) -> str:
    head = ("| model | W | mode | predicted peak, B | peak model, B | measured (lowest), B | highest, B "
            "| predicted / measured - 1 | recompute FLOPs predicted | counted | FLOPs error | within 5 % / 1 % "
            "| highest on any rank / target |")
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        dp = _rel(r["predicted"], r["measured"])
        fp, fc = r["flops_predicted"], r["flops_counted"]
        df = 0.0 if fp == fc else _rel(fp, fc)
        ok = dp is not None and abs(dp) <= PEAK_TOL and df is not None and abs(df) <= FLOPS_TOL
        r["peak_error"], r["flops_error"], r["ok"] = dp, df, ok
        model = "-" if r["peak_model"] is None else f"{r['peak_model']:,}"
        lines.append(f"| {r['model']} | {r['world']} | {r['mode']} | {r['predicted']:,} | {model} | {r['measured']:,} | "
                     f"{r['measured_max']:,} | {dp * 100:+.2f} % | {fp:,} | {fc:,} | "
                     f"{'-' if df is None else f'{df * 100:+.2f} %'} | {'yes' if ok else 'NO'} | "
                     f"{'-' if not r['target'] else format(r['highest_any_rank'] / r['target'], '.4f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama,gpt2", help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--worlds", default="2,4", help="comma-separated world sizes (gloo ranks)")
    p.add_argument("--steps", type=int, default=5, help="measured steps per mode (the lowest is compared)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    t0 = time.time()
    rows: list[dict] = []
    for model in args.models.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            t = time.time()
            rows += run_case(Case(model.strip()), world, args.steps)
            print(f"# {model} W={world}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    print(f"bench_simulate: {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}; rank 0; batch {BATCH} x seq {SEQ} per rank, {LAYERS} layers, dim {HIDDEN}, "
          f"vocab {VOCAB}, fp32, FSDP2 per block, AdamW; {time.time() - t0:.0f} s\n")
    print(table(rows))
    bad = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} points within {PEAK_TOL:.0%} peak and {FLOPS_TOL:.0%} FLOPs")
    planned = [r for r in rows if r["target"]]
    over = [r for r in planned if r["highest_any_rank"] > r["target"]]
    print(f"{len(over)} of {len(planned)} plan files' jobs had a step over the target on some rank (every "
          f"measured step of every fresh job, every rank)")
    write_json(args.json, {"rows": rows, "torch": torch.__version__})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
