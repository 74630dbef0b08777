"""Single-process benchmark: ac2_dist vs torch.utils.checkpoint, measured side by side.

Three workloads, each a stack of blocks checkpointed per block (torch: its non-reentrant
``checkpoint`` on the block's forward; ac2: ``apply_ac`` on the block type):

- ``gpt``: GPT blocks (causal SDPA attention, GELU MLP);
- ``gpt-dropout``: the same with dropout 0.1 (ac2 with ``rng="replay"``, torch restores
  the RNG state: both regenerate the masks in backward);
- ``nested``: stages of residual MLP layers, the stage *and* each layer checkpointed (HF
  Swin's layout; no SAC modes there).

Modes: no AC, torch full AC, torch SAC (save mm/addmm), ac2 full AC, ac2 SAC (same save
list). Per mode: peak memory of forward+backward and activations kept after forward
(allocator events via torch.profiler), backward FLOPs (FlopCounterMode, recompute
included) and the median step time. Steps run in rounds, every mode once per round
(interleaved, so machine drift hits all modes alike); the step-time ratio ac2/torch is
taken per round and printed as median (min-max) over the rounds.

With ``--compile`` every mode also runs compiled (``torch.compile`` of the checkpointed
model, Inductor, ``fullgraph=True``; modes named ``<mode>@compiled``), and the ratios add
compiled ac2 vs compiled torch and compiled vs eager ac2. FLOPs are counted for eager
modes only (compiled kernels do not dispatch through FlopCounterMode).

    python launch/bench_core.py                  # D=512, T=256, B=4, 4 blocks, 7 rounds, CPU
    python launch/bench_core.py --compile --workloads gpt
    python launch/bench_core.py --json out.json  # also write the figures
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    MODES,
    PAIRS,
    SAVE_OPS,
    checkpointed,
    forward,
    measure_flops,
    measure_memory,
    plain_backward_flops,
    ratio_stats,
    step,
    timed_rounds,
    write_json,
)
from models import GPTBlock, GPTStack, MLPLayer, Stage, StageStack  # noqa: E402

import ac2_dist as ac  # noqa: E402

COMPILED = "@compiled"
COMPILED_PAIRS = [("ac2-full@compiled", "torch-full@compiled"), ("ac2-sac@compiled", "torch-sac@compiled"),
                  ("ac2-full@compiled", "ac2-full"), ("ac2-sac@compiled", "ac2-sac")]


def _gpt(args: argparse.Namespace, dropout: float = 0.0) -> nn.Module:
    return GPTStack(args.layers, args.dim, args.heads, dropout)


# name -> (model builder, checkpointed block types, ac2 rng mode, modes it runs)
WORKLOADS: dict[str, tuple[Callable, tuple, str, list[str]]] = {
    "gpt": (_gpt, (GPTBlock,), "save", MODES),
    "gpt-dropout": (functools.partial(_gpt, dropout=0.1), (GPTBlock,), "replay", MODES),
    "nested": (lambda a: StageStack(2, a.dim, a.layers), (Stage, MLPLayer), "save",
               ["no-ac", "torch-full", "ac2-full"]),
}




def tracer_overhead_us(n_ops: int = 3000, reps: int = 5) -> dict[str, float]:
    """Forward cost per tiny op (8x8 tensors) above plain eager, in microseconds.

    Isolates the per-op Python cost of each mode's forward machinery: the ac2 tracer
    vs torch SAC's caching dispatch mode (torch full AC has no per-op forward hook).
    """
    x = torch.randn(8, 8, requires_grad=True)

    def chain():
        h = x
        for i in range(n_ops // 2):
            h = (h * 0.5).sin() if i % 2 else h + x
        return h.sum()

    def best(fn):
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return min(out)

    def in_region(policy):
        def run():
            with ac.apply_ac_policy(policy):
                chain()
        return run

    def torch_sac():
        ctx_fn = functools.partial(create_selective_checkpoint_contexts, SAVE_OPS)
        checkpoint(lambda: chain(), use_reentrant=False, context_fn=ctx_fn)

    eager = best(chain)
    cases = {
        "torch-full": lambda: checkpoint(lambda: chain(), use_reentrant=False),
        "torch-sac": torch_sac,
        "ac2-full": in_region("recompute_all"),
        "ac2-sac": in_region(SAVE_OPS),
    }
    return {name: (best(fn) - eager) / n_ops * 1e6 for name, fn in cases.items()}


def _compiled_recompute_flops(model: nn.Module, x: torch.Tensor, fraction: float) -> int:
    """Backward FLOPs of ``model`` compiled with torch's memory-budget partitioner at
    ``fraction`` (AOTAutograd + the min-cut partitioner Inductor uses; the partitioned
    graphs run eagerly so FlopCounterMode sees their ops)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    counted = {"bw": 0}

    def backend(gm, example_inputs):
        def fw(g, inputs):
            return make_boxed_func(g.forward)

        def bw(g, inputs):
            def run(args):
                counter = FlopCounterMode(display=False)
                with counter:
                    out = g(*args)
                counted["bw"] += counter.get_total_flops()
                return out

            run._boxed_call = True
            return run

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw, bw_compiler=bw,
                                     partition_fn=min_cut_rematerialization_partition)

    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=fraction, enable_autograd_cache=False):
        compiled = torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True)
        forward(compiled, x).backward()
    torch._dynamo.reset()
    return counted["bw"]


def _inductor_with_budget(fraction: float) -> Callable:
    """Inductor with torch's memory-budget partitioner at ``fraction`` (a distinct backend
    object: modules of one class otherwise share one compiled graph)."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        with torch._functorch.config.patch(activation_memory_budget=fraction, enable_autograd_cache=False), \
                torch._inductor.config.patch(fx_graph_cache=False):
            return compile_fx(gm, example_inputs)

    return backend


def budget_sweep(args: argparse.Namespace) -> dict:
    """ac2_dist.MemoryBudget at several fractions beside no AC, torch full AC, torch SAC and
    torch compile's own memory-budget partitioner at the same fractions (Inductor)."""
    fractions = [float(f) for f in args.budgets.split(",")]
    torch.manual_seed(0)
    base = _gpt(args)
    x = torch.randn(args.batch, args.seq, args.dim, requires_grad=True)
    models = {m: checkpointed(base, m, (GPTBlock,)) for m in ("no-ac", "torch-full", "torch-sac")}
    budgets = {}
    for f in fractions:
        budgets[f] = ac.MemoryBudget(f)
        models[f"ac2-budget-{f}"] = ac.apply_ac(copy.deepcopy(base), budgets[f], modules=[GPTBlock])
        step(models[f"ac2-budget-{f}"], x)  # calibration
    # Compile's recompute FLOPs first: counting them resets dynamo.
    compiled_flops = {f: _compiled_recompute_flops(base, x, f) for f in fractions}
    torch._dynamo.reset()
    for f in fractions:  # a backend of its own per budget: dynamo does not share the graphs
        compiled = torch.compile(copy.deepcopy(base), backend=_inductor_with_budget(f), fullgraph=True)
        step(compiled, x)
        models[f"compile-budget-{f}"] = compiled
    results: dict[str, dict] = {}
    no_ac_flops = measure_flops(models["no-ac"], x)
    for m, model in models.items():
        results[m] = measure_memory(model, x)
        if m.startswith("compile-budget-"):
            flops = compiled_flops[float(m[len("compile-budget-"):])]
        else:
            if m.startswith("ac2-budget-"):
                # Ops dispatch differently under FlopCounterMode (layer_norm decomposes):
                # the first count calibrates that structure, the second follows its plan.
                measure_flops(model, x)
            flops = measure_flops(model, x)
        results[m]["recompute_flops"] = flops - no_ac_flops
    for f, budget in budgets.items():
        model = models[f"ac2-budget-{f}"]
        predicted = sum(budget.plan(f"blocks.{i}").recompute_seconds for i in range(args.layers))
        measured = []
        for _ in range(3):
            with ac.memory.track(model) as tracker:
                forward(model, x).backward()
            measured.append(tracker.report().replay_seconds)
        results[f"ac2-budget-{f}"]["predicted_recompute_s"] = predicted
        results[f"ac2-budget-{f}"]["measured_replay_s"] = statistics.median(measured)
    times = timed_rounds({m: functools.partial(step, model, x) for m, model in models.items()}, args.rounds,
                         args.warmup)
    for m in models:
        results[m]["step_seconds_median"] = statistics.median(times[m])
        results[m]["step_seconds_all"] = times[m]
    mib = 1 / 2**20
    print(f"\n[budget sweep] {args.layers} GPT blocks, D={args.dim}, T={args.seq}, B={args.batch}")
    print(f"{'mode':<22} {'peak MiB':>9} {'kept MiB':>9} {'recompute GFLOP':>16} {'step s':>8}  "
          "predicted / measured recompute ms")
    for m, r in results.items():
        extra = ""
        if "predicted_recompute_s" in r:
            extra = f"  {r['predicted_recompute_s'] * 1e3:.2f} / {r['measured_replay_s'] * 1e3:.2f}"
        print(f"{m:<22} {r['peak_bytes'] * mib:9.1f} {r['kept_after_forward_bytes'] * mib:9.1f} "
              f"{r['recompute_flops'] / 1e9:16.2f} {r['step_seconds_median']:8.3f}{extra}")
    comparisons = {}
    for f in fractions:
        a, c = results[f"ac2-budget-{f}"], results[f"compile-budget-{f}"]
        comparisons[f] = {"recompute_flops_vs_compile": (a["recompute_flops"] / c["recompute_flops"]
                                                         if c["recompute_flops"] else None),
                          "peak_vs_compile": a["peak_bytes"] / c["peak_bytes"],
                          "step_vs_compile": ratio_stats(times[f"ac2-budget-{f}"], times[f"compile-budget-{f}"])}
        cf = comparisons[f]
        ratio = "n/a (compile recomputes nothing)" if cf["recompute_flops_vs_compile"] is None else f"{cf['recompute_flops_vs_compile']:.3f}x"
        print(f"fraction {f}: ac2 / compile recompute FLOPs {ratio}, peak {cf['peak_vs_compile']:.3f}x")
    sac = results["torch-sac"]
    within = [f for f in fractions if results[f"ac2-budget-{f}"]["peak_bytes"] <= sac["peak_bytes"]]
    at_sac = None
    if within:
        f = max(within, key=lambda f: results[f"ac2-budget-{f}"]["peak_bytes"])
        at_sac = {"fraction": f, "peak_vs_sac": results[f"ac2-budget-{f}"]["peak_bytes"] / sac["peak_bytes"],
                  "step_vs_sac": ratio_stats(times[f"ac2-budget-{f}"], times["torch-sac"])}
        st = at_sac["step_vs_sac"]
        print(f"at torch SAC's peak ({sac['peak_bytes'] * mib:.1f} MiB): budget {f} peaks at "
              f"{at_sac['peak_vs_sac']:.3f}x, step {st['median']:.3f}x ({st['min']:.3f}-{st['max']:.3f}) of torch SAC")
    if args.png:
        _pareto_png(results, args.png)
        print(f"wrote {args.png}")
    return {"modes": results, "vs_compile": comparisons, "at_torch_sac": at_sac}


def _compile_curve(base: nn.Module, x: torch.Tensor, fractions: list[float]) -> dict[float, dict]:
    """torch compile's memory-budget partitioner (Inductor) at ``fractions``: measured
    peak, recompute FLOPs and the compiled model per fraction."""
    out: dict[float, dict] = {}
    flops = {f: _compiled_recompute_flops(base, x, f) for f in fractions}  # resets dynamo
    no_ac_flops = measure_flops(copy.deepcopy(base), x)
    torch._dynamo.reset()
    for f in fractions:
        compiled = torch.compile(copy.deepcopy(base), backend=_inductor_with_budget(f), fullgraph=True)
        step(compiled, x)
        out[f] = {"model": compiled, "peak_bytes": measure_memory(compiled, x)["peak_bytes"],
                  "recompute_flops": flops[f] - no_ac_flops}
    return out


def peak_sweep(args: argparse.Namespace) -> dict:
    """``MemoryBudget(peak=N)`` at targets from the floor (ac2 "recompute_all") to no-AC's
    peak: per target the measured peak, recompute FLOPs and step time, beside torch full
    AC, torch SAC and torch compile's ``activation_memory_budget`` at the same peaks."""
    torch.manual_seed(0)
    base = _gpt(args)
    x = torch.randn(args.batch, args.seq, args.dim, requires_grad=True)
    models = {m: checkpointed(base, m, (GPTBlock,)) for m in ("no-ac", "torch-full", "torch-sac", "ac2-full")}
    results: dict[str, dict] = {}
    no_ac_flops = plain_backward_flops(models["no-ac"], x)
    for m, model in models.items():
        step(model, x)
        results[m] = measure_memory(model, x)
        results[m]["recompute_flops"] = plain_backward_flops(model, x) - no_ac_flops
    floor, top = results["ac2-full"]["peak_bytes"], results["no-ac"]["peak_bytes"]
    n = args.peaks
    targets = [floor + round(k * (top - floor) / (n - 1)) for k in range(n)]
    budgets = {}
    for t in targets:
        name = f"ac2-peak-{t / 2**20:.2f}MiB"
        budgets[name] = (t, ac.MemoryBudget(peak=t))
        models[name] = ac.apply_ac(copy.deepcopy(base), budgets[name][1], modules=[GPTBlock])
        steps = []
        for _ in range(5):  # the planner measures, corrects, settles (Note [Verify, correct, stay put])
            steps.append(measure_memory(models[name], x)["peak_bytes"])
        r = results[name] = measure_memory(models[name], x)
        r["target_bytes"] = t
        r["peak_by_step"] = steps + [r["peak_bytes"]]
        r["peak_vs_target"] = r["peak_bytes"] / t
        r["max_step_vs_target"] = max(r["peak_by_step"]) / t
        r["recompute_flops"] = plain_backward_flops(models[name], x) - no_ac_flops
        r["plan"] = budgets[name][1].peak_planner.describe()
    compile_fractions = [float(f) for f in args.compile_fractions.split(",")] if args.compile_fractions else []
    curve = _compile_curve(base, x, compile_fractions) if compile_fractions else {}
    for f, c in curve.items():
        models[f"compile-budget-{f}"] = c.pop("model")
    times = timed_rounds({m: functools.partial(step, model, x) for m, model in models.items()}, args.rounds,
                         args.warmup)
    for f, c in curve.items():
        results[f"compile-budget-{f}"] = c
    for m in models:
        results[m]["step_seconds_median"] = statistics.median(times[m])
        results[m]["step_seconds_all"] = times[m]
    mib = 1 / 2**20
    print(f"\n[peak sweep] {args.layers} GPT blocks, D={args.dim}, T={args.seq}, B={args.batch}: "
          f"targets from ac2's floor ({floor * mib:.2f} MiB) to no-AC's peak ({top * mib:.2f} MiB)")
    print(f"{'mode':<24} {'target MiB':>10} {'peak MiB':>9} {'peak/target':>11} {'max step/target':>15} "
          f"{'recompute GFLOP':>16} {'step s':>8}")
    for m, r in results.items():
        target = f"{r['target_bytes'] * mib:10.2f}" if "target_bytes" in r else f"{'':>10}"
        ratio = f"{r['peak_vs_target']:11.3f} {r['max_step_vs_target']:15.3f}" if "target_bytes" in r else \
            f"{'':>11} {'':>15}"
        print(f"{m:<24} {target} {r['peak_bytes'] * mib:9.2f} {ratio} {r['recompute_flops'] / 1e9:16.3f} "
              f"{r['step_seconds_median']:8.3f}")
    # Recompute FLOPs beside compile's at an equal measured peak: compile's cheapest point
    # whose peak is at most ours.
    vs_compile = {}
    for name in budgets:
        r = results[name]
        fits = [c for c in curve.values() if c["peak_bytes"] <= r["peak_bytes"]]
        if fits:
            c = min(fits, key=lambda c: c["recompute_flops"])
            vs_compile[name] = {"compile_peak_bytes": c["peak_bytes"], "compile_recompute_flops": c["recompute_flops"],
                                "ratio": (r["recompute_flops"] / c["recompute_flops"]) if c["recompute_flops"] else None}
            ratio = vs_compile[name]["ratio"]
            print(f"{name}: recompute FLOPs vs compile's at a peak <= ours "
                  f"({c['peak_bytes'] * mib:.2f} MiB): "
                  + ("compile recomputes nothing" if ratio is None else f"{ratio:.3f}x"))
        else:
            vs_compile[name] = None
            print(f"{name}: no compile point peaks at or below {r['peak_bytes'] * mib:.2f} MiB")
    sac = results["torch-sac"]
    at_sac = None
    fast = [n_ for n_ in budgets if results[n_]["step_seconds_median"] <= sac["step_seconds_median"]]
    if fast:
        best = min(fast, key=lambda n_: results[n_]["peak_bytes"])
        at_sac = {"point": best, "peak_vs_sac": results[best]["peak_bytes"] / sac["peak_bytes"],
                  "step_vs_sac": ratio_stats(times[best], times["torch-sac"])}
        st = at_sac["step_vs_sac"]
        print(f"at torch SAC's step time: {best} peaks at {at_sac['peak_vs_sac']:.3f}x torch SAC's peak, "
              f"step {st['median']:.3f}x ({st['min']:.3f}-{st['max']:.3f})")
    else:
        print("no target's step time is at or below torch SAC's")
    if args.png:
        _recompute_png(results, args.png)
        print(f"wrote {args.png}")
    return {"modes": results, "targets": targets, "vs_compile": vs_compile, "at_torch_sac_step_time": at_sac}


def _recompute_png(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    series: dict[str, list[tuple[float, float]]] = {}
    for m, r in results.items():
        kind = "ac2 peak target" if m.startswith("ac2-peak") else "compile budget" if m.startswith("compile") else m
        series.setdefault(kind, []).append((r["peak_bytes"] / 2**20, r["recompute_flops"] / 1e9))
    # compile's points unjoined: its peak is not monotone in its budget fraction
    style = {"ac2 peak target": ("o-", "tab:blue"), "compile budget": ("s", "tab:orange")}
    for kind, pts in series.items():
        pts.sort()
        fmt, color = style.get(kind, ("^", None))
        ax.plot([p for p, _ in pts], [f for _, f in pts], fmt, color=color, label=kind)
    for m, r in results.items():
        if m.startswith("ac2-peak") and "target_bytes" in r:
            ax.axvline(r["target_bytes"] / 2**20, color="tab:blue", alpha=0.15, lw=1)
    ax.legend(fontsize=8)
    ax.set_xlabel("measured peak of a step (MiB, allocator)")
    ax.set_ylabel("recompute (GFLOP per step, backward minus no-AC's)")
    ax.set_title("recompute vs measured peak (faint lines: ac2's targets)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class _ScheduleLog:
    """A ``log`` callback: (event, block, resident bytes, resident blocks) at each event."""

    def __init__(self, resident: Callable[[], tuple[int, int]]) -> None:
        self.resident = resident
        self.events: list[tuple[str, str, int, int]] = []

    def __call__(self, event: str, fqn: str) -> None:
        self.events.append((event, fqn, *self.resident()))


def offload_schedule(args: argparse.Namespace) -> dict:
    """The CPU-offload schedule (ac2_dist/offload.py) on the ``gpt`` workload, on CPU: the
    inline copy engine (``Offload(stream="inline")``) runs the GPU's schedule with host
    copies. Per ``defer``: the schedule's events in order, the bytes of offloaded values
    still on the "device" (their original storages alive) at every event, copies, host
    buffers allocated in steps 1 and 2 (the pool), gradients against saving the same
    values; step time against saving them (on CPU that is the cost of the copies alone:
    no device memory is saved). Offloaded: matmul outputs (mm/addmm), the rest recomputed."""
    from torch.multiprocessing.reductions import StorageWeakRef

    cp = torch.utils.checkpoint.CheckpointPolicy
    torch.manual_seed(0)
    base = _gpt(args)
    x = torch.randn(args.batch, args.seq, args.dim, requires_grad=True)
    live: list[tuple[str, Any, int]] = []  # (block, storage ref, bytes) of this step's offloaded outputs

    def policy_of(decision: Any) -> Callable:
        def policy(ctx, op, *a, **k):
            if op in SAVE_OPS:
                out = ctx.op_output
                live.append((ctx.module_fqn, StorageWeakRef(out.untyped_storage()), out.numel() * out.element_size()))
                return decision
            return cp.PREFER_RECOMPUTE
        return policy

    def resident() -> tuple[int, int]:
        alive = [(f, n) for f, r, n in live if not r.expired()]
        return sum(n for _, n in alive), len({f for f, _ in alive})

    def grads(model: nn.Module) -> list[torch.Tensor]:
        live.clear()
        step(model, x)
        return [p.grad.clone() for p in model.parameters()]

    saved = ac.apply_ac(copy.deepcopy(base), policy_of(cp.MUST_SAVE), modules=[GPTBlock])
    live.clear()
    loss = forward(saved, x)
    saved_after_forward = resident()
    loss.backward()
    del loss
    ref = grads(saved)
    results: dict[str, Any] = {"save": {"resident_after_forward_bytes": saved_after_forward[0],
                                        "resident_after_forward_blocks": saved_after_forward[1]}}
    models = {"save": saved}
    for defer in [int(d) for d in args.offload_defers.split(",")]:
        log = _ScheduleLog(resident)  # the offload's and the replays' events, in one order
        events = log.events
        offload = ac.Offload(defer, stream="inline", log=log)
        model = ac.apply_ac(copy.deepcopy(base), policy_of(cp.MUST_CPU_OFFLOAD), modules=[GPTBlock],
                            replay=ac.ReplayConfig(stream="inline", prefetch=1, log=log, offload=offload))
        got = grads(model)
        step1 = dataclasses.replace(offload.stats)
        events.clear()
        got2 = grads(model)
        stats = offload.stats
        fwd_end = next(i for i, e in enumerate(events) if e[0] == "backward_start")
        results[f"offload-defer{defer}"] = {
            "grads_bitwise_vs_save": all(torch.equal(a, b) for a, b in zip(ref, got))
            and all(torch.equal(a, b) for a, b in zip(ref, got2)),
            "forward_max_resident_bytes": max(e[2] for e in events[:fwd_end]),
            "forward_max_resident_blocks": max(e[3] for e in events[:fwd_end]),
            "resident_after_forward_bytes": events[fwd_end][2],
            "resident_after_forward_blocks": events[fwd_end][3],
            "d2h_bytes_per_step": stats.d2h_bytes - step1.d2h_bytes,
            "h2d_bytes_per_step": stats.h2d_bytes - step1.h2d_bytes,
            "host_buffers_step1": step1.buffers_allocated,
            "host_buffers_step2": stats.buffers_allocated - step1.buffers_allocated,
            "blocks_committed_kept_per_step": (stats.units_committed - step1.units_committed,
                                               stats.units_kept - step1.units_kept),
            "events": " ".join(f"{e}({f})" for e, f, _, _ in events
                               if e in ("open", "close", "d2h", "wait", "free_device", "keep",
                                        "backward_start", "prefetch_start")),
        }
        models[f"offload-defer{defer}"] = model
    models["recompute-all"] = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=[GPTBlock])
    times = timed_rounds({m: functools.partial(step, model, x) for m, model in models.items()}, args.rounds,
                         args.warmup)
    for m in models:
        results.setdefault(m, {})["step_seconds_median"] = statistics.median(times[m])
        results[m]["step_vs_save"] = ratio_stats(times[m], times["save"])
    mib = 1 / 2**20
    print(f"\n[offload schedule] {args.layers} GPT blocks, D={args.dim}, T={args.seq}, B={args.batch}, CPU "
          "(inline copy engine); offloaded: mm/addmm outputs")
    for m, r in results.items():
        st = r["step_vs_save"]
        line = f"{m:<16} step {r['step_seconds_median']:.3f} s ({st['median']:.3f}x save)"
        if "forward_max_resident_bytes" in r:
            line += (f"  resident in forward <= {r['forward_max_resident_bytes'] * mib:.1f} MiB "
                     f"({r['forward_max_resident_blocks']} blocks), after forward "
                     f"{r['resident_after_forward_bytes'] * mib:.1f} MiB ({r['resident_after_forward_blocks']}), "
                     f"d2h {r['d2h_bytes_per_step'] * mib:.1f} / h2d {r['h2d_bytes_per_step'] * mib:.1f} MiB per step, "
                     f"host buffers {r['host_buffers_step1']} then {r['host_buffers_step2']}, "
                     f"bitwise {r['grads_bitwise_vs_save']}")
        else:
            line += (f"  resident after forward {r.get('resident_after_forward_bytes', 0) * mib:.1f} MiB "
                     f"({r.get('resident_after_forward_blocks', 0)} blocks)" if m == "save" else "")
        print(line)
        if "events" in r:
            print(f"  {r['events']}")
    return results


def _pareto_png(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    style = {"ac2 budget": ("o", "tab:blue"), "compile budget": ("s", "tab:orange"), "no-ac": ("^", "tab:gray"),
             "torch-full": ("^", "tab:green"), "torch-sac": ("v", "tab:green")}
    for m, r in results.items():
        kind = "ac2 budget" if m.startswith("ac2-budget") else "compile budget" if m.startswith("compile") else m
        marker, color = style.get(kind, ("^", "tab:red"))
        ax.scatter(r["step_seconds_median"], r["peak_bytes"] / 2**20, marker=marker, color=color, label=kind)
        ax.annotate(m.replace("-budget-", " "), (r["step_seconds_median"], r["peak_bytes"] / 2**20), fontsize=7)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set_xlabel("step time (s, median)")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title("peak memory vs step time: one point per mode")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_workload(name: str, args: argparse.Namespace, modes: list[str]) -> dict:
    """Memory, FLOPs and interleaved step times of one workload; its ac2/torch ratios."""
    build, types, rng, supported = WORKLOADS[name]
    modes = [m for m in modes if m in supported]
    torch.manual_seed(0)
    base = build(args)
    x = torch.randn(args.batch, args.seq, args.dim, requires_grad=True)
    models = {m: checkpointed(base, m, types, rng) for m in modes}
    if args.compile:
        for m in list(modes):
            models[m + COMPILED] = torch.compile(checkpointed(base, m, types, rng), backend=args.compile_backend,
                                                 fullgraph=True)
        modes = modes + [m + COMPILED for m in modes]
    results: dict[str, dict] = {m: {} for m in modes}
    for m in modes:
        if m.endswith(COMPILED):
            step(models[m], x)  # compile outside the measured window
        torch.manual_seed(1)  # the same dropout masks in every mode
        results[m].update(measure_memory(models[m], x))
        torch.manual_seed(1)
        results[m]["backward_flops"] = None if m.endswith(COMPILED) else measure_flops(models[m], x)
    times = timed_rounds({m: functools.partial(step, models[m], x) for m in modes}, args.rounds, args.warmup)
    for m in modes:
        results[m]["step_seconds_median"] = statistics.median(times[m])
        results[m]["step_seconds_all"] = times[m]
    ratios = {}
    for ours, theirs in PAIRS + COMPILED_PAIRS:
        if ours in results and theirs in results:
            a, b = results[ours], results[theirs]
            flops = None if a["backward_flops"] is None or b["backward_flops"] is None else \
                a["backward_flops"] / b["backward_flops"]
            ratios[f"{ours}/{theirs}"] = {
                "peak": a["peak_bytes"] / b["peak_bytes"],
                "kept_after_forward": a["kept_after_forward_bytes"] / max(b["kept_after_forward_bytes"], 1),
                "backward_flops": flops,
                "step_time": ratio_stats(times[ours], times[theirs]),
            }
    return {"modes": results, "ratios": ratios}


def print_workload(name: str, out: dict) -> None:
    mib = 1 / 2**20
    print(f"\n[{name}]")
    print(f"{'mode':<20} {'peak MiB':>9} {'kept MiB':>9} {'bwd GFLOP':>10} {'step s':>8}")
    for m, r in out["modes"].items():
        flops = "n/a" if r["backward_flops"] is None else f"{r['backward_flops'] / 1e9:.2f}"
        print(f"{m:<20} {r['peak_bytes'] * mib:9.1f} {r['kept_after_forward_bytes'] * mib:9.1f} "
              f"{flops:>10} {r['step_seconds_median']:8.3f}")
    for pair, r in out["ratios"].items():
        st = r["step_time"]
        flops = "n/a" if r["backward_flops"] is None else f"{r['backward_flops']:.3f}x"
        print(f"{pair:<40} peak {r['peak']:.3f}x  kept {r['kept_after_forward']:.3f}x  "
              f"bwd FLOPs {flops}  step {st['median']:.3f}x ({st['min']:.3f}-{st['max']:.3f})")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="blocks per stack (nested: layers per stage)")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (every mode once per round)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--no-micro", action="store_true", help="skip the per-op overhead micro-benchmark")
    p.add_argument("--compile", action="store_true", help="also run every mode compiled (<mode>@compiled)")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--budgets", default="", help="run the MemoryBudget sweep at these fractions (gpt workload), "
                   "e.g. 0,0.25,0.5,0.75,1; with torch compile's activation_memory_budget beside it")
    p.add_argument("--png", default=None, help="with --budgets: write the peak-vs-step-time plot here; with "
                   "--peaks: the recompute-vs-peak plot")
    p.add_argument("--peaks", type=int, default=0, help="run the MemoryBudget(peak=N) sweep at this many targets "
                   "from ac2's floor to no-AC's peak (gpt workload), beside torch full AC / SAC and compile")
    p.add_argument("--compile-fractions", default="0,0.1,0.25,0.5,0.75,1",
                   help="with --peaks: compile's activation_memory_budget points ('' to skip compile)")
    p.add_argument("--offload-schedule", action="store_true",
                   help="run the CPU-offload schedule on the gpt workload (inline copies; order, lifetimes, pool)")
    p.add_argument("--offload-defers", default="1,2", help="with --offload-schedule: the defer values")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")

    print(f"bench_core: {args.layers} blocks, D={args.dim}, T={args.seq}, B={args.batch}, {args.rounds} rounds, "
          f"CPU threads={torch.get_num_threads()}, torch {torch.__version__}, {platform.machine()}")
    if args.offload_schedule:
        return write_json(args.json, {"config": vars(args), "offload_schedule": offload_schedule(args),
                                      "torch": torch.__version__})
    if args.peaks:
        if args.peaks < 2:
            p.error("--peaks needs at least 2 targets (the floor and no-AC's peak)")
        return write_json(args.json, {"config": vars(args), "peak_sweep": peak_sweep(args),
                                      "torch": torch.__version__})
    if args.budgets:
        return write_json(args.json, {"config": vars(args), "budget_sweep": budget_sweep(args),
                                      "torch": torch.__version__})
    workloads = {}
    for name in args.workloads.split(","):
        workloads[name] = run_workload(name, args, modes)
        print_workload(name, workloads[name])
    overhead = {} if args.no_micro else tracer_overhead_us()
    if overhead:
        print("forward overhead per tiny op above eager (us): "
              + ", ".join(f"{k} {v:.1f}" for k, v in overhead.items()))
    return write_json(args.json, {"config": vars(args), "workloads": workloads, "overhead_us_per_op": overhead,
                                  "torch": torch.__version__, "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
