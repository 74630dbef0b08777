"""FSDP2 under the simulated CUDA (tests/_simcuda.py): its own streams and events mapped.

FSDP2 reaches a device's streams through ``_get_device_handle(device.type)`` (for a CPU
mesh, ``torch.cpu``, whose streams do nothing). :func:`fsdp_on` hands it a device handle
of the simulation instead, so a CPU FSDP2 job runs its copy-in, all-gather,
reduce-scatter and all-reduce streams, its events and its waits as it does on a GPU:
the collectives are kernels on FSDP2's streams, the unsharded parameters are allocated
by ``resize_`` on the stream that copies them out and freed by ``resize_(0)`` at the
reshard, and the checker sees every cross-stream use. On the timeline, the streams are
named after their role (``fsdp-all-gather`` ...).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_ROLES = ("fsdp-copy-in", "fsdp-all-gather", "fsdp-reduce-scatter", "fsdp-all-reduce")


class _Event:
    """``device_handle.Event()``: recorded later, on the current stream or one given."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.clock: dict[int, int] = {}
        self.eid = 0

    def record(self, stream: Any = None) -> None:
        ev = (stream or self.sim.current_stream()).record_event()
        self.clock, self.eid = ev.clock, ev.eid

    def wait(self, stream: Any = None) -> None:
        (stream or self.sim.current_stream()).wait_event(self)

    def synchronize(self) -> None:
        from _simcuda import SimEvent

        SimEvent(self.sim, self.clock, self.eid).synchronize()

    def query(self) -> bool:
        return True


class SimDeviceHandle:
    """What FSDP2 calls on ``torch.cuda`` (or ``torch.cpu``), answered by the simulation."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.made = 0

    def Stream(self, priority: int = 0, **kwargs: Any) -> Any:  # noqa: N802 - torch's name
        name = _ROLES[self.made] if self.made < len(_ROLES) else f"fsdp-stream{self.made}"
        self.made += 1
        return self.sim.new_stream(name)

    def Event(self, **kwargs: Any) -> _Event:  # noqa: N802 - torch's name
        return _Event(self.sim)

    def current_stream(self, device: Any = None) -> Any:
        return self.sim.current_stream()

    def stream(self, stream: Any) -> Any:
        return self.sim.use(stream) if stream is not None else contextlib.nullcontext()

    def synchronize(self, device: Any = None) -> None:
        self.sim.synchronize()

    def current_device(self) -> int:
        return 0

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1


@contextlib.contextmanager
def fsdp_on(sim: Any) -> Iterator[SimDeviceHandle]:
    """FSDP2 modules (made and run inside the block) take ``sim``'s streams for a CPU mesh."""
    from torch.distributed.fsdp._fully_shard import (
        _fsdp_collectives,
        _fsdp_param_group,
        _fsdp_state,
    )

    handle = SimDeviceHandle(sim)
    modules = (_fsdp_collectives, _fsdp_param_group, _fsdp_state)
    originals = [m._get_device_handle for m in modules]

    def get(device_type: str = "cuda") -> Any:
        return handle if device_type == "cpu" else originals[0](device_type)

    for m in modules:
        m._get_device_handle = get
    try:
        yield handle
    finally:
        for m, original in zip(modules, originals):
            m._get_device_handle = original


def fsdp_model(layers: int, dim: int, heads: int, vocab: int = 256, max_seq: int = 512) -> torch.nn.Module:
    """The Llama-style model of launch/models.py, each block and the root ``fully_shard``-ed
    (call inside :func:`fsdp_on`, after the process group is up)."""
    from models import Llama
    from torch.distributed.fsdp import fully_shard

    model = Llama(vocab=vocab, dim=dim, layers=layers, heads=heads, max_seq=max_seq)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model
