"""Which device a region, a module or a model runs on: from the tensors it sees.

Note [The device comes from the tensors]
    Whether a region replays on a CUDA side stream, prefetches by default, opens a
    block of a CUDA offload schedule, and whether memory is read from the CUDA caching
    allocator is decided by the devices of the tensors it sees, never by the process
    state ``torch.cuda.is_initialized()``: torch.compile initialises CUDA on any
    machine with a GPU (dynamo saves and restores the CUDA RNG state around every
    frame it converts), and from then on a CPU job would take the CUDA paths for CPU
    tensors (a side stream for CPU replays, CUDA memory statistics reading 0).

    * A checkpointed module's region: its parameters and buffers and the call's
      tensor arguments (known when it enters).
    * A function region (``apply_ac_policy_fn``, the drop-in ``checkpoint(fn, ...)``):
      the call's tensor arguments.
    * A ``with apply_ac_policy(...)`` block: nothing is known when it enters, so it
      is decided when it exits, before any backward can read what it recorded, from
      the tensors it recorded that are still alive (its outputs at least). Until then
      it replays inline (a backward run inside the block itself replays inline).
    * ``memory.track(model)``: the model's parameters and buffers; without a model,
      or a model without tensors, the regions it sees (any of them on CUDA).
    * ``MemoryBudget(peak=...)``: the regions of its steps.

    Any CUDA tensor among them makes the decision CUDA (a CUDA job also holds CPU
    tensors: indices, masks, host copies); no CUDA tensor, CPU. DTensors (FSDP2's
    sharded parameters) answer for their mesh's device.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

__all__ = ["CPU", "cuda_device_of", "device_of", "module_cuda_device", "recorded_device"]

CPU = torch.device("cpu")

# A `with` block's decision reads at most this many of the live tensors it recorded,
# the most recent first (its outputs are among them): bounded work at every exit.
_RECORDED_SCAN = 256


def _first_cuda(tensors: Iterable[Any]) -> torch.device | None:
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            return t.device
    return None


def module_cuda_device(module: nn.Module) -> torch.device | None:
    """The CUDA device of ``module``'s first CUDA parameter or buffer, else ``None``."""
    found = _first_cuda(module.parameters())
    return found if found is not None else _first_cuda(module.buffers())


def cuda_device_of(*trees: Any, module: nn.Module | None = None) -> torch.device | None:
    """The CUDA device of the first CUDA tensor among ``trees`` (pytrees of call
    arguments) and ``module``'s parameters and buffers; ``None`` if there is none."""
    # See Note [The device comes from the tensors].
    found = _first_cuda(torch.utils._pytree.tree_leaves(trees))
    if found is None and module is not None:
        found = module_cuda_device(module)
    return found


def device_of(*trees: Any, module: nn.Module | None = None) -> torch.device:
    """:func:`cuda_device_of`, or the CPU device if there is no CUDA tensor."""
    found = cuda_device_of(*trees, module=module)
    return CPU if found is None else found


def recorded_device(graph: Any) -> torch.device:
    """A ``with`` block's device, from its graph's tensor map: the CUDA device of one of
    the ``_RECORDED_SCAN`` most recently recorded tensors still alive, else the CPU
    device (also once the map is gone)."""
    refs = graph.map.recent(_RECORDED_SCAN) if graph.map is not None else []
    found = _first_cuda(ref() for ref in refs)
    return CPU if found is None else found


def default_generator(device: torch.device) -> torch.Generator:
    """The default generator an op without ``generator=`` draws from on ``device``."""
    if device.type == "cpu":
        return torch.default_generator
    mod = getattr(torch, device.type)
    index = device.index if device.index is not None else mod.current_device()
    return mod.default_generators[index]
