"""Small real models shared by the tests."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from models import GPTBlock  # launch/models.py (tests/conftest.py puts launch/ on the path)


class MLP(nn.Module):
    def __init__(self, d: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(torch.relu(self.fc1(x)))))


class GPT(nn.Module):
    def __init__(self, layers: int = 2, d: int = 32, heads: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(GPTBlock(d, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        return F.relu(self.bn2(self.conv2(x)), inplace=True).mean(dim=(2, 3))


class DropoutMLP(nn.Module):
    def __init__(self, d: int = 32, p: float = 0.3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 64)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(64, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def grads_of(model: nn.Module, run: Callable[[nn.Module], torch.Tensor], *extra: torch.Tensor):
    """Zero grads, run ``run(model)`` to a scalar, backward, return all grads."""
    model.zero_grad(set_to_none=True)
    for t in extra:
        t.grad = None
    run(model).backward()
    return [p.grad.clone() for p in model.parameters()] + [t.grad.clone() for t in extra]


def step_memory(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], seed: int = 0,
                extra: tuple[torch.Tensor, ...] = ()) -> dict:
    """One forward+backward: bytes kept after forward and the peak of the step (both
    above what was allocated when it began, allocator events) and the gradients of
    ``extra`` tensors and the parameters. ``seed`` is set first (equal dropout masks)."""
    from ac2_dist._measure._alloc import AllocationTrace

    model.zero_grad(set_to_none=True)
    for t in extra:
        t.grad = None
    torch.manual_seed(seed)
    with AllocationTrace() as trace:
        trace.mark("forward")
        loss = loss_fn(model)
        trace.mark("backward")
        loss.backward()
        del loss
    fwd, bwd = trace.phases["forward"], trace.phases["backward"]
    return {
        "kept": bwd.start_bytes - fwd.start_bytes,
        "peak": max(fwd.peak_bytes, bwd.peak_bytes) - fwd.start_bytes,
        "grads": [t.grad for t in extra] + [p.grad for p in model.parameters()],
    }


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        assert torch.equal(x, y), f"tensor {i} differs: max abs diff {(x - y).abs().max().item()}"


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ATen ops that run while it is active (e.g. during backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    def __getitem__(self, name: str) -> int:
        return self.counts.get(name, 0)


def peak_from(model: nn.Module, first: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor],
              seed: int = 0) -> tuple[int, list[torch.Tensor]]:
    """One forward+backward: the peak allocated above what was allocated when ``first``
    began its forward (before its other pre-hooks) -- the scale of
    ``MemoryBudget(peak=...)`` on CPU: ``first`` is the model ``apply_ac`` was given, or
    without one the first checkpointed module -- from the allocator's events, and the grads."""
    from ac2_dist._measure._alloc import AllocationTrace

    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    marked: list[bool] = []

    def mark(*_: object) -> None:
        if not marked:
            marked.append(True)
            trace.mark("start")

    hook = first.register_forward_pre_hook(mark, prepend=True)
    try:
        with AllocationTrace() as trace:
            loss = loss_fn(model)
            loss.backward()
            del loss
    finally:
        hook.remove()
    start = next(p for name, p in trace.segments if name == "start")
    return start.peak_bytes - start.start_bytes, [p.grad for p in model.parameters()]


def live_instances(cls: type) -> int:
    """Instances of ``cls`` alive now, counted whether or not the cyclic collector tracks
    them: the C recorder's nodes are not on its lists (Note [Plain records are not tracked
    by the collector] in ac2_dist/_trace/_crecord.c), so ``gc.get_objects()`` alone misses them.
    An untracked object is found through the references of the objects that hold it
    (tracked ones, or untracked nodes and tuples reached from those)."""
    found: dict[int, object] = {}
    frontier = gc.get_objects()
    while frontier:
        nxt = []
        for o in gc.get_referents(*frontier):
            if not gc.is_tracked(o) and type(o) in (cls, tuple) and id(o) not in found:
                found[id(o)] = o
                nxt.append(o)
        frontier = nxt
    tracked = sum(1 for o in gc.get_objects() if type(o) is cls)
    return tracked + sum(1 for o in found.values() if type(o) is cls)
