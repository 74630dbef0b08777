"""Hugging Face Llama: each way of checkpointing its layers, side by side in one run.

    python launch/bench_hf.py                 # hidden 512, 4 layers, seq 256, batch 4, CPU

Modes: no AC; HF's own gradient checkpointing (torch's non-reentrant checkpoint);
``ac2_dist.integrations.hf.enable`` (ac2 through HF's switch); ``ac2_dist.apply_ac`` on the
decoder-layer class; and, as a reference, no AC with every decoder layer's forward run under
a Python ``TorchDispatchMode`` that only calls each op (``no-ac+noop-mode``): what running
the layers' ops through any Python dispatch mode costs on this model, the floor under
ac2's recording (ac2 records the same ops; its backward replays them without a mode). Per
mode: peak memory of forward+backward and bytes kept after
forward (allocator events via torch.profiler), the median step time over interleaved
rounds, and the per-round step-time ratio against HF's own checkpointing: median
(min-max). Needs transformers (the ``hf`` extra: ``pip install -e '.[hf]'``). Random weights from a
config: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import measure_memory, ratio_stats, step, timed_rounds, write_json  # noqa: E402

import ac2_dist as ac  # noqa: E402

MODES = ["no-ac", "hf-torch", "ac2-hf-enable", "ac2-apply_ac", "no-ac+noop-mode"]


class _NoopMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # as ac2's tracer: no per-call dynamo shim
        return False


def _under_noop_mode(layer: torch.nn.Module) -> None:
    """Run ``layer``'s forward under a fresh no-op dispatch mode (``no-ac+noop-mode``)."""
    modes: list[_NoopMode] = []

    def enter(module, args):
        modes.append(_NoopMode())
        modes[-1].__enter__()

    def leave(module, args, output):
        modes.pop().__exit__(None, None, None)

    layer.register_forward_pre_hook(enter)
    layer.register_forward_hook(leave)


def build(args: argparse.Namespace, mode: str):
    import transformers as T
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from ac2_dist.integrations import hf

    torch.manual_seed(0)
    # Optional fields (launch/gpu_check.py's ~1B config): FFN width, KV heads, device, dtype.
    intermediate = getattr(args, "intermediate", None) or 4 * args.dim
    kv_heads = getattr(args, "kv_heads", None) or args.heads
    device = getattr(args, "device", "cpu")
    with torch.device(device):  # initialized where it runs
        model = T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=intermediate,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=kv_heads,
            max_position_embeddings=args.seq))
    model.to(dtype=getattr(args, "dtype", torch.float32))
    model.train()
    if mode == "hf-torch":
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif mode == "ac2-hf-enable":
        hf.enable(model)
    elif mode == "ac2-apply_ac":
        ac.apply_ac(model, modules=[LlamaDecoderLayer])
    elif mode == "no-ac+noop-mode":
        for layer in model.modules():
            if isinstance(layer, LlamaDecoderLayer):
                _under_noop_mode(layer)
    return model


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    models = {m: build(args, m) for m in MODES}
    results = {m: measure_memory(models[m], ids, lm_loss) for m in MODES}
    times = timed_rounds({m: functools.partial(step, models[m], ids, lm_loss) for m in MODES}, args.rounds,
                         args.warmup)
    mib = 1 / 2**20
    print(f"bench_hf: Llama {args.layers}x{args.dim}, seq {args.seq}, batch {args.batch}, {args.rounds} rounds, "
          f"CPU threads={torch.get_num_threads()}, torch {torch.__version__}")
    print(f"{'mode':<16} {'peak MiB':>9} {'kept MiB':>9} {'step s':>8}  step vs hf-torch, median (min-max)")
    for m in MODES:
        r = results[m]
        r["step_seconds_median"] = statistics.median(times[m])
        r["step_seconds_all"] = times[m]
        r["step_vs_hf_torch"] = ratio_stats(times[m], times["hf-torch"])
        st = r["step_vs_hf_torch"]
        print(f"{m:<16} {r['peak_bytes'] * mib:9.2f} {r['kept_after_forward_bytes'] * mib:9.2f} "
              f"{r['step_seconds_median']:8.3f}  {st['median']:.3f} ({st['min']:.3f}-{st['max']:.3f})")
    return write_json(args.json, {"config": vars(args), "results": results, "torch": torch.__version__})


if __name__ == "__main__":
    main()
