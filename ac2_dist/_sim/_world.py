"""The fake world a simulation runs in: torch's fake process group for W ranks in this
process (Note [A step without data] in _sim/_run.py), and the per-block FSDP2 wrapping
of the command line."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

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


def per_block_shard(blocks: Any, world_size: int, shard_size: int | None, param_dtype: torch.dtype | None = None,
                    reduce_dtype: torch.dtype | None = None,
                    reshard_after_forward: bool | str = True) -> Callable[[nn.Module], None]:
    """``fully_shard`` each selected block, then the root (HSDP over a
    ``(world_size / shard_size, shard_size)`` mesh when ``shard_size`` is given), with
    FSDP2's mixed precision and, per block, ``reshard_after_forward`` (``"all-but-last"``:
    the last block's is False, torchtitan's choice)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .._modules import _select

    def shard(model: nn.Module) -> None:
        kwargs: dict[str, Any] = {}
        if shard_size is not None and shard_size != world_size:
            from torch.distributed.device_mesh import init_device_mesh

            kwargs["mesh"] = init_device_mesh("cpu", (world_size // shard_size, shard_size),
                                              mesh_dim_names=("replicate", "shard"))
        if param_dtype is not None or reduce_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        selected = _select(model, blocks)
        for k, (_, m) in enumerate(selected):
            reshard = reshard_after_forward if reshard_after_forward != "all-but-last" else k < len(selected) - 1
            fully_shard(m, reshard_after_forward=reshard, **kwargs)
        fully_shard(model, **kwargs)

    return shard


