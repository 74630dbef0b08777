"""The fake world a simulation runs in: torch's fake process group for W ranks in this
process (Note [A step without data] in _sim/_run.py), and the per-block FSDP2 wrapping
of the command line (with tensor parallelism inside each block on a 2D mesh)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__: list[str] = []


def ddp_refused() -> str:
    """Why a DDP job is not simulated, and what to do instead."""
    # Checked with torch 2.13: DistributedDataParallel(init_sync=False) builds and runs its
    # forward on fake parameters under the fake process group, but its reducer's bucket
    # all-reduce gets a future whose value is None from the fake backend and backward stops at
    # an internal assert ("expected the hook result is either a Tensor or a TensorList found
    # None", c10d/comm.cpp); with init_sync, construction fails on fake parameters' data.
    # Making it run would need a comm hook standing in for the all-reduce: not torch's DDP.
    return (f"ac2_dist.simulate: DDP is not simulated: torch's DistributedDataParallel does not run under the fake "
            f"process group (torch {torch.__version__}: its reducer expects each gradient bucket's all-reduce to "
            f"complete with the reduced bucket; the fake backend's completes with nothing and backward stops at an "
            f"internal assert in c10d/comm.cpp). Simulate the step without DDP (fsdp=None, --fsdp none: the job "
            f"holds up to the gradients' bytes more, DDP's buckets, none with gradient_as_bucket_view=True) or "
            f"sharded with FSDP2 (fsdp='per-block')")


@contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world_size`` under the ``"fake"`` backend
    (collectives return at once); the group is destroyed on exit."""
    if dist.is_initialized():
        raise RuntimeError("ac2_dist.simulate: a process group is already initialized in this process; the "
                           "simulation creates its own fake one: run it in a process of its own (not inside "
                           "the training job)")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


#: the style names of a tensor-parallel plan (Hugging Face's ``base_model_tp_plan`` uses
#: them) that the simulation applies, as torch's ``parallelize_module`` styles
TP_STYLES = ("colwise", "rowwise")


def tp_styles(plan: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A block's tensor-parallel plan (submodule path inside the block -> a
    ``ParallelStyle`` or ``"colwise"``/``"rowwise"``) as torch's styles; ValueError
    naming the entry that is neither."""
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(f"ac2_dist.simulate: {where} must be a non-empty mapping of submodule paths inside a block "
                         f"to 'colwise', 'rowwise' or a ParallelStyle, got {plan!r}")
    out: dict[str, Any] = {}
    for path, style in plan.items():
        if isinstance(style, ParallelStyle):
            out[path] = style
        elif style == "colwise":
            out[path] = ColwiseParallel()
        elif style == "rowwise":
            out[path] = RowwiseParallel()
        else:
            raise ValueError(f"ac2_dist.simulate: {where}: {path!r} -> {style!r} is not simulated; the styles are "
                             f"{', '.join(TP_STYLES)} or a torch ParallelStyle")
    return out


def hf_tp_plan(config: Any) -> dict[str, str]:
    """The per-block part of a Hugging Face config's ``base_model_tp_plan``
    (``"layers.*.self_attn.q_proj": "colwise"`` -> ``"self_attn.q_proj": "colwise"``);
    ValueError for an entry the simulation does not apply (packed or expert styles)."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    out: dict[str, str] = {}
    for key, style in plan.items():
        head, sep, rest = key.partition(".*.")
        if not sep:
            continue  # outside the blocks (embeddings, the head): replicated, as torchtitan's blocks-only plans
        if style not in TP_STYLES:
            raise ValueError(f"ac2_dist.simulate: the config's tensor-parallel plan has {key!r}: {style!r}; the "
                             f"simulation applies {', '.join(TP_STYLES)} only (write the plan with "
                             f"simulate(tp_plan=...))")
        out[rest] = style
    if not out:
        raise ValueError(f"ac2_dist.simulate: the config ({type(config).__name__}) has no tensor-parallel plan "
                         "for its blocks (base_model_tp_plan); give one with simulate(tp_plan=...) / --tp-plan")
    return out


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


@contextmanager
def eager_collectives() -> Iterator[None]:
    """Note [The simulated collectives complete as eager ones do]
        torch's functional collectives (what DTensor's redistributions, tensor parallelism's
        all-reduces among them, issue) complete differently when they think they are being
        traced: under a fake tensor mode ``_are_we_tracing()`` is true and each one ends in a
        ``wait_tensor`` op, where an eager job wraps its output for a later wait
        (``_wrap_tensor_autograd`` on torch >= 2.11, no op before). The blocks' op sequence
        is the structure a plan file is matched against, so the simulated step must run the
        job's sequence: while it runs, the check answers as eagerly unless torch.compile is
        tracing. Restored on exit; the simulation runs in a process of its own."""
    import torch.distributed._functional_collectives as funcol

    traced = getattr(funcol, "_are_we_tracing", None)
    if traced is None:
        yield
        return

    def _eagerly() -> bool:
        return bool(torch.compiler.is_compiling())

    funcol._are_we_tracing = _eagerly  # type: ignore[assignment]
    try:
        yield
    finally:
        funcol._are_we_tracing = traced  # type: ignore[assignment]


class GlooBuffers(TorchDispatchMode):
    """Note [gloo's buffers of its own]
        Simulating a CPU job (``device="cpu"``) simulates a gloo job, and gloo allocates
        buffers FSDP2 does not see: its all-gather (``c10d._allgather_base_``) gathers into
        a flat buffer of the output's size and copies it out, and its reduce-scatter
        (``c10d._reduce_scatter_base_``) reduces in a clone of its input. Both are made
        on the calling thread when the collective is issued (checked with torch 2.10, 2.13
        and 2.14: the allocator's events name them inside the c10d op), so the step holds
        one more block's unsharded parameters (or gradients) at each FSDP collective: in a
        no-AC step the peak is at one (a backward all-gather, with the activations still
        alive). Under this mode, the innermost one during a simulated step, each such op
        makes a buffer of that size first and drops it when the op returns; the meter counts
        it as the real allocator does. gloo lets go of them when its worker thread releases
        the collective, sometimes after the next ops have run, so a real step can hold one
        longer: that stays outside the count (the report's "collective buffers held past
        their wait"), as does an all-gather issued with ``async_op=True`` holding its
        buffer until its wait (FSDP2's own all-gathers on CPU return waited). Not counted
        either: the functional collectives' (``_c10d_functional.*``, what DTensor
        redistributions such as sequence parallelism issue), which run as gloo's coalesced
        collectives with buffers of their own; tensor parallelism's default colwise and
        rowwise styles only all-reduce, which allocates nothing. NCCL copies in place: no
        such buffers, and nothing is added when the simulated device is a GPU (a named
        GPU, or rates given as numbers)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        which = _GLOO_BUFFER_OF.get(func)
        if which is None:
            return func(*args, **kwargs)
        held = torch.empty_like(args[which])  # gloo's flat output / its input's clone
        try:
            return func(*args, **kwargs)
        finally:
            del held


#: c10d ops gloo makes a buffer for, and which argument's size (Note [gloo's buffers of its own])
_GLOO_BUFFER_OF = {torch.ops.c10d._allgather_base_.default: 0, torch.ops.c10d._reduce_scatter_base_.default: 1} \
    if dist.is_available() else {}


def per_block_shard(blocks: Any, world_size: int, shard_size: int | None, param_dtype: torch.dtype | None = None,
                    reduce_dtype: torch.dtype | None = None, reshard_after_forward: bool | str = True,
                    tp_size: int | None = None, tp_plan: Mapping[str, Any] | None = None
                    ) -> Callable[[nn.Module], None]:
    """``fully_shard`` each selected block, then the root (HSDP over a
    ``(world_size / shard_size, shard_size)`` mesh when ``shard_size`` is given), with
    FSDP2's mixed precision and, per block, ``reshard_after_forward`` (``"all-but-last"``:
    the last block's is False, torchtitan's choice). With ``tp_size``: a
    ``(world_size / tp_size, tp_size)`` mesh ``("dp", "tp")``; each block is first
    parallelized over ``"tp"`` with ``tp_plan`` (torch's ``parallelize_module``), then
    sharded over ``"dp"``, in torchtitan's order. A :class:`RankStages` model is a
    pipeline rank's stages: each is sharded as a root of its own, then the container."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .._modules import _select
    from ._pipeline import RankStages

    def shard(model: nn.Module) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs: dict[str, Any] = {}
        tp_mesh = None
        if tp_size is not None and tp_size > 1:
            mesh = init_device_mesh("cpu", (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
            kwargs["mesh"], tp_mesh = mesh["dp"], mesh["tp"]
        elif shard_size is not None and shard_size != world_size:
            kwargs["mesh"] = init_device_mesh("cpu", (world_size // shard_size, shard_size),
                                              mesh_dim_names=("replicate", "shard"))
        if param_dtype is not None or reduce_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        selected = _select(model, blocks)
        if tp_mesh is not None:
            from torch.distributed.tensor.parallel import parallelize_module

            assert tp_plan is not None
            for fqn, m in selected:
                for path in tp_plan:  # parallelize_module only warns for a path that matches nothing
                    if "*" not in path and not _has_submodule(m, path):
                        raise ValueError(f"ac2_dist.simulate: tp_plan: block {fqn!r} ({type(m).__name__}) has no "
                                         f"submodule {path!r}; the plan's paths are inside a block")
                parallelize_module(m, tp_mesh, tp_styles(tp_plan, "tp_plan"))
        for k, (_, m) in enumerate(selected):
            reshard = reshard_after_forward if reshard_after_forward != "all-but-last" else k < len(selected) - 1
            fully_shard(m, reshard_after_forward=reshard, **kwargs)
        if isinstance(model, RankStages):  # a pipeline rank's stages: each a root of its own
            for stage in model.stages:     # (Note [Several stages per rank] in _pipeline.py)
                fully_shard(stage, **kwargs)
        fully_shard(model, **kwargs)

    return shard


