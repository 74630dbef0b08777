"""``python -m ac2_dist.simulate``: the simulation from the shell (a Hugging Face config
file or a factory of the user's), printing the table and writing the plan."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._sizes import parse_size
from ._pipeline import SCHEDULES

__all__: list[str] = []

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


class _Refused(Exception):
    """Bad input: the message is printed, exit status 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ac2_dist.simulate", description=(
        "Predict what one rank of a W-rank FSDP2 job holds at its peak (no AC, full AC, a save list, a peak "
        "target), on this CPU, without the data; write the plan for MemoryBudget(peak=..., plan=...)."))
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-config", help="a Hugging Face config.json (AutoModelForCausalLM.from_config; nothing "
                                         "is downloaded)")
    src.add_argument("--model", help="pkg.module:factory; factory() returns a model, or (model, batch_fn)")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--batch", type=int, default=1, help="per-rank batch size")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES))
    p.add_argument("--param-dtype", default=None, choices=sorted(_DTYPES),
                   help="FSDP2 mixed precision: the dtype the blocks compute in (--dtype: parameters, gradients, "
                        "optimizer states)")
    p.add_argument("--reduce-dtype", default=None, choices=sorted(_DTYPES),
                   help="FSDP2 mixed precision: the dtype gradients are reduced in")
    p.add_argument("--reshard-after-forward", default="true", choices=["true", "false", "all-but-last"],
                   help="fully_shard's option for every block (all-but-last: torchtitan's, the last block stays "
                        "unsharded after forward)")
    p.add_argument("--fsdp", default="per-block", choices=["per-block", "none"])
    p.add_argument("--ddp", action="store_true", help="a DDP job: refused (torch's DDP does not run under the "
                                                       "fake process group); the message says what to run instead")
    p.add_argument("--shard-size", type=int, default=None, help="HSDP: shard over groups of this many ranks")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor parallelism inside each block over this many ranks (a dp x tp mesh, FSDP2 over dp); "
                        "the plan is the Hugging Face config's base_model_tp_plan, or --tp-plan")
    p.add_argument("--tp-plan", default=None,
                   help="the blocks' tensor-parallel plan: comma-separated path=colwise|rowwise, paths inside a "
                        "block (self_attn.q_proj=colwise,...,mlp.down_proj=rowwise)")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline parallelism: this many stages (--hf-config, Llama-style models); --world-size counts "
                        "every rank, --batch is a microbatch")
    p.add_argument("--pp-stage", type=int, default=0,
                   help="the pipeline rank simulated (0 .. --pp - 1): its stage, or its stages under a schedule with "
                        "several per rank")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches per step (default: --pp)")
    p.add_argument("--schedule", default="1F1B", choices=list(SCHEDULES),
                   help="the pipeline schedule (torch.distributed.pipelining's Schedule<name>)")
    p.add_argument("--stages-per-rank", type=int, default=None,
                   help="pipeline stages on each rank (default 1 for 1F1B and GPipe, 2 for the others): the model is "
                        "cut into --pp x this many stages")
    p.add_argument("--head", action="store_true",
                   help="also checkpoint the final norm and the LM head as one region (hf.enable(head=True))")
    p.add_argument("--blocks", default=None, help="comma-separated class names of the blocks to checkpoint "
                                                  "(default: the model's _no_split_modules)")
    p.add_argument("--modes", default="none,full", help="comma-separated: none, full, titan (torchtitan's op-level "
                                                        "SAC: attention, reduce_scatter, abs, max and every second "
                                                        "matmul saved)")
    p.add_argument("--save-ops", default=None, help="adds a save-list mode: comma-separated aten ops "
                                                    "(mm, addmm, aten.mm.default, ...)")
    p.add_argument("--target", default=None, help="a peak target, e.g. 70GiB: adds the planned mode")
    p.add_argument("--device", default="h100", help="h100, h200, a100, cpu: the rates recompute is priced at")
    p.add_argument("--host-link", type=float, default=None,
                   help="host<->device GB/s (one direction) block-input offload is priced at (default: the device's)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "none"])
    p.add_argument("--plan-out", default=None, help="write the plan (needs --target) to this JSON file")
    return p


def _hf(path: str, dtype: torch.dtype) -> tuple[Callable[[], nn.Module], Any]:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise _Refused("--hf-config needs transformers (pip install 'ac2-dist[hf]')") from e
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        model_type = doc.pop("model_type")
    except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
        raise _Refused(f"--hf-config {path!r}: cannot build a config from it ({type(e).__name__}: {_line(e)}); "
                       "it must be a Hugging Face config.json with a model_type") from e
    try:
        config = AutoConfig.for_model(model_type, **doc)
    except Exception as e:  # transformers' own validation (its error classes vary by release)
        raise _Refused(f"--hf-config {path!r}: transformers rejects this config: {_line(e)}") from e
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab < 1:
        raise _Refused(f"--hf-config {path!r}: vocab_size must be >= 1, got {vocab}")

    def build() -> nn.Module:
        return AutoModelForCausalLM.from_config(config).to(dtype).train()

    return build, config


def _line(e: BaseException) -> str:
    """An exception's message on one line (transformers' validation errors span several)."""
    return " ".join(part.strip() for part in str(e).splitlines() if part.strip()) or type(e).__name__


def _check_plan_out(path: str) -> None:
    """``--plan-out``'s folder exists and is writable: checked before the simulation runs."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise _Refused(f"--plan-out {path!r}: the folder {folder!r} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise _Refused(f"--plan-out {path!r}: the folder {folder!r} is not writable")
    if os.path.isdir(path):
        raise _Refused(f"--plan-out {path!r} is a folder; name a file (plan.json)")


def _tp_plan(text: str) -> dict[str, str]:
    """``--tp-plan``: ``path=style,...`` -> a block's plan."""
    plan: dict[str, str] = {}
    for item in text.split(","):
        path, sep, style = (part.strip() for part in item.partition("="))
        if not sep or not path or style not in ("colwise", "rowwise"):
            raise _Refused(f"--tp-plan: {item.strip()!r} is not path=colwise or path=rowwise (a path inside a block, "
                           "e.g. self_attn.q_proj=colwise)")
        plan[path] = style
    return plan


def _hf_tp_plan(config: Any) -> dict[str, str]:
    from ._world import hf_tp_plan

    try:
        return hf_tp_plan(config)
    except ValueError as e:
        raise _Refused(str(e).removeprefix("ac2_dist.simulate: ")) from e


def _factory(spec: str) -> Callable[[], Any]:
    mod, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise _Refused(f"--model {spec!r}: cannot import it ({e}); write pkg.module:factory") from e


def _ops(text: str) -> list[Any]:
    out = []
    for name in text.split(","):
        parts = name.strip().split(".")
        if parts[0] == "aten":
            parts = parts[1:]
        try:
            packet = getattr(torch.ops.aten, parts[0])
            out.append(getattr(packet, parts[1]) if len(parts) > 1 else packet.default)
        except (AttributeError, IndexError) as e:
            raise _Refused(f"--save-ops: {name!r} is not an aten op (write mm, addmm or aten.mm.default)") from e
    return out


def main(simulate: Callable[..., Any], argv: list[str] | None = None) -> int:
    """Run the command line with ``simulate`` (``ac2_dist.simulate.simulate``); returns
    the exit status."""
    args = _parser().parse_args(argv)
    try:
        return _run(args, simulate)
    except _Refused as e:
        print(f"ac2_dist.simulate: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, simulate: Callable[..., Any]) -> int:
    dtype = _DTYPES[args.dtype]
    if args.ddp:
        from ._world import ddp_refused

        raise ValueError(ddp_refused())
    for name in ("batch", "seq"):
        if getattr(args, name) < 1:
            raise _Refused(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.plan_out and not args.target:
        raise _Refused("--plan-out needs --target (the plan is the peak target's)")
    if args.plan_out:
        _check_plan_out(args.plan_out)
    modes: list[Any] = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes and not args.save_ops and not args.target:
        raise _Refused(f"--modes {args.modes!r} names no mode: give none, full, titan (comma-separated), --save-ops "
                       "or --target")
    unknown = [m for m in modes if m not in ("none", "full", "titan")]
    if unknown:
        raise _Refused(f"--modes: {unknown[0]!r} is not a mode; name none, full or titan (a save list: --save-ops)")
    if args.fsdp == "none" and (args.param_dtype or args.reduce_dtype or args.reshard_after_forward != "true"):
        raise _Refused("--param-dtype, --reduce-dtype and --reshard-after-forward apply to --fsdp per-block")
    if args.tp_plan and not args.tp:
        raise _Refused("--tp-plan needs --tp")
    pipeline, world = _pipeline(args)
    if args.tp is not None and (args.tp < 1 or world % args.tp):
        per = f" / --pp {args.pp} = {world}" if pipeline is not None else ""
        raise _Refused(f"--tp {args.tp} must be >= 1 and divide --world-size {args.world_size}{per}")
    tp_plan = _tp_plan(args.tp_plan) if args.tp_plan else None
    batch_fn = None
    if args.hf_config:
        build, config = _hf(args.hf_config, dtype)
        if args.tp and args.tp > 1:
            tp_plan = tp_plan or _hf_tp_plan(config)
            for name in ("num_attention_heads", "num_key_value_heads"):
                heads = getattr(config, name, None)
                if isinstance(heads, int) and heads % args.tp:
                    raise _Refused(f"--tp {args.tp} does not divide the config's {name} ({heads}): each rank of "
                                   "the tensor-parallel dimension takes whole heads")
        vocab = getattr(config, "vocab_size", None)
        longest = getattr(config, "max_position_embeddings", None)
        if isinstance(longest, int) and args.seq > longest:
            raise _Refused(f"--seq {args.seq} is longer than the config's max_position_embeddings ({longest}); "
                           "raise it in the config if the model is meant to run that long")
    else:
        factory = _factory(args.model)

        def build() -> nn.Module:
            made = factory()
            return made[0] if isinstance(made, tuple) else made

        with torch.device("meta"):
            made = factory()
        if isinstance(made, tuple):
            batch_fn = made[1]
        vocab = getattr(getattr(made[0] if isinstance(made, tuple) else made, "config", None), "vocab_size", None)
    try:
        with torch.device("meta"):
            probe = build()
    except Exception as e:
        raise _Refused(f"the model cannot be built from {args.hf_config or args.model!r} ({type(e).__name__}: "
                       f"{e})") from e
    names = args.blocks.split(",") if args.blocks else list(getattr(probe, "_no_split_modules", None) or [])
    block_types = sorted({type(m) for m in probe.modules() if type(m).__name__ in names}, key=lambda t: t.__name__)
    if not block_types:
        raise _Refused(f"no module of the model is a block to checkpoint (looked for {names or 'nothing'}); "
                       "name their classes with --blocks")
    groups: list[list[str]] = []
    if args.head:
        from ..integrations.hf import _head_group

        try:
            groups.append(_head_group(probe, probe))
        except ValueError as e:
            raise _Refused(f"--head: {_line(e)}") from e
    loss = None
    if pipeline is not None:
        build, batch_fn, loss = _stage(build, config, pipeline, args, dtype)
    if batch_fn is None:
        if vocab is None:
            raise _Refused("the model has no config.vocab_size: return (model, batch_fn) from --model's factory")
        if not isinstance(vocab, int) or vocab < 1:
            raise _Refused(f"the model's config.vocab_size must be a positive int, got {vocab!r}")
        b, s = args.batch, args.seq

        def batch_fn() -> dict:
            ids = torch.randint(0, vocab, (b, s))
            return {"input_ids": ids, "labels": ids}

    if args.save_ops:
        modes.append(_ops(args.save_ops))
    target = parse_size(args.target, "--target") if args.target else None
    report = simulate(build, batch=batch_fn, blocks=block_types, world_size=world, rank=args.rank, loss=loss,
                      fsdp=None if args.fsdp == "none" else "per-block", shard_size=args.shard_size,
                      optimizer=None if args.optimizer == "none" else _adamw_default(), modes=modes,
                      target=args.target if target is not None else None, device=args.device, dtype=dtype,
                      host_link=args.host_link * 1e9 if args.host_link is not None else None,
                      param_dtype=_DTYPES[args.param_dtype] if args.param_dtype else None,
                      reduce_dtype=_DTYPES[args.reduce_dtype] if args.reduce_dtype else None,
                      reshard_after_forward={"true": True, "false": False}.get(args.reshard_after_forward,
                                                                                args.reshard_after_forward),
                      tp_size=args.tp, tp_plan=tp_plan if args.tp and args.tp > 1 else None, groups=groups,
                      pipeline=pipeline)
    print(report.format())
    if args.plan_out:
        report.save_plan(args.plan_out)
        where = ""
        if pipeline is not None:  # Note [A pipeline rank's plan file names its stages] in _stage_plan.py
            where = (" on the stage's module, followed as simulated" if len(pipeline.indices) == 1 else
                     f" on an nn.ModuleList of the rank's stage modules (stages {', '.join(map(str, pipeline.indices))}"
                     "), followed as simulated")
        print(f"\nplan written to {args.plan_out}: MemoryBudget(peak={args.target!r}, plan={args.plan_out!r}){where}")
    return 0


def _pipeline(args: argparse.Namespace) -> tuple[Any, int]:
    """``--pp``'s stage and the ranks one stage is sharded over (``--world-size / --pp``)."""
    if args.pp is None:
        if args.microbatches is not None or args.pp_stage or args.stages_per_rank is not None:
            raise _Refused("--pp-stage, --microbatches and --stages-per-rank need --pp")
        return None, args.world_size
    from ._pipeline import Pipeline

    if args.pp < 1 or args.world_size % args.pp:
        raise _Refused(f"--pp {args.pp} must be >= 1 and divide --world-size {args.world_size}")
    if not args.hf_config:
        raise _Refused("--pp cuts a Hugging Face model into stages (--hf-config); with --model, call "
                       "ac2_dist.simulate.simulate(..., pipeline=Pipeline(...)) on your stage's module")
    if args.head:
        raise _Refused("--pp: --head is not simulated for a pipeline stage (the last stage's head is its own)")
    try:
        pipeline = Pipeline(args.pp, args.pp_stage, args.microbatches or args.pp, args.schedule,
                            args.stages_per_rank)
    except ValueError as e:
        raise _Refused(str(e).removeprefix("ac2_dist.simulate: ")) from e
    world = args.world_size // args.pp
    if not 0 <= args.rank < world:
        raise _Refused(f"--rank {args.rank}: with --pp {args.pp} it is the rank within the stage's "
                       f"{world} ranks, in [0, {world})")
    return pipeline, world


def _stage(build: Callable[[], nn.Module], config: Any, pipeline: Any, args: argparse.Namespace,
           dtype: torch.dtype) -> tuple[Callable[[], nn.Module], Callable[[], Any], Callable[..., torch.Tensor]]:
    """The stage's module, one microbatch's inputs (token ids on the first stage, the
    received hidden state, in the dtype the blocks compute in, on the others) and its loss
    (the logits' on the last stage, the output on the others)."""
    from ._pipeline import HFStage

    several = len(pipeline.indices) > 1
    try:
        with torch.device("meta"):
            HFStage(build(), pipeline, pipeline.indices[0])
    except ValueError as e:
        raise _Refused(str(e).removeprefix("ac2_dist.simulate: ")) from e
    vocab, hidden = config.vocab_size, config.hidden_size
    act_dtype = _DTYPES[args.param_dtype] if args.param_dtype else dtype
    b, s = args.batch, args.seq

    def stage() -> nn.Module:
        # Note [Several stages per rank] (_sim/_pipeline.py): a list of the rank's stages
        parts = [HFStage(build(), pipeline, i) for i in pipeline.indices]
        return nn.ModuleList(parts) if several else parts[0]

    def batch() -> Any:
        ids = torch.randint(0, vocab, (b, s))
        inputs = [{"x": ids if i == 0 else torch.empty(b, s, hidden, dtype=act_dtype, requires_grad=True),
                   "labels": ids} for i in pipeline.indices]
        return inputs if several else inputs[0]

    def loss(model: nn.Module, mb: dict) -> torch.Tensor:
        out = model(mb["x"])
        return model.loss(out, mb["labels"]) if model.last else out

    return stage, batch, loss


def _adamw_default() -> Callable[[Any], torch.optim.Optimizer]:
    def make(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-4)

    return make
