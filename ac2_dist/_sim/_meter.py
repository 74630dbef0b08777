"""What a simulated step holds, counted by torch's own tracker: :class:`_StepMeter` is
``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (``MemTracker`` for a
model without FSDP) with three additions the simulation reports: when the step's peak
happens, the peak of each planner segment, and the bytes each block keeps.

Note [The simulated step is counted by torch's tracker]
    ``MemTracker`` is a dispatch mode that registers the storage of every tensor an op
    returns (a weak reference per storage: freed when the storage dies) under a
    category (parameters, gradients, optimizer states, activations, temporaries; FSDP's
    tracker adds sharded / unsharded parameters and gradients, all-gather and
    reduce-scatter buffers), and the tensors of the modules and optimizer it was given.
    It counts storage bytes, as the allocator hands them out on CPU (on CUDA it rounds
    to 512 B blocks as the caching allocator does). ac2's tracer is a dispatch mode
    above it: the ops it runs and replays reach the tracker as any op does. What it
    cannot see -- the allocator's fragmentation and reserved-but-free blocks, the
    kernels' internal workspaces, NCCL's buffers, the CUDA context -- is not counted
    (:data:`NOT_COUNTED` in _sim/_report.py names each with a typical size).
    The meter reads the tracker's running total after every op (``_update_peak_stats``
    is called there, replaced by the meter's own: the tracker's walks every module it
    has seen, after every op, for per-module peaks the simulation does not use -- with
    126 blocks it took two thirds of the CPU time: 92 s, 31 s without it): the step's
    peak, with the phase it happened in, and the peak of
    each segment between the marks a ``MemoryBudget(peak=...)`` planner would set
    (Note [The peak model] in _peak_model.py): ``fwd:k`` where block k's forward
    begins (after FSDP's all-gather, as the region enters) and ``bwd:k`` where its
    backward first reads a saved value.

Note [Reserved bytes: the allocations through the caching allocator's model]
    torchtitan and ``nvidia-smi``-minded users read *reserved* memory
    (``torch.cuda.max_memory_reserved``): what the caching allocator took from the
    device, allocated or cached free. The meter sends every storage the tracker sees
    appear, die or resize (FSDP2's reshard frees by ``resize_(0)``) through two models of
    the allocator (Note [The caching allocator, modelled] in _sim/_allocator.py), one
    with ``expandable_segments`` and one without, in the order the step makes them,
    from the first step on (segments reserved in step 1 stay reserved); the counted
    step's peak reserved is each model's high-water mark during it. On a GPU FSDP2 runs
    its all-gathers and reduce-scatters on streams of their own, whose blocks come from
    those streams' pools: the tracker's all-gather and reduce-scatter buffers are
    allocated on such streams here, the rest on the default stream. What the model
    leaves out: the kernels' workspaces and the CUDA context (not allocations the
    tracker sees), blocks ``record_stream`` holds past a free (the fake step has no
    time), ``max_split_size_mb`` and the other allocator settings.

Note [The boundary offloaded, counted from the same step]
    ``Offload(block_inputs=True)`` moves block inputs off the device on a fixed schedule
    (Note [Offloaded block inputs] in offload.py), so the step it would run is this
    step minus, at each moment, the inputs that are on the host then. The meter
    records each block's input bytes as its forward begins and, after every op,
    subtracts those off the device at that moment: in the forward of block k the
    inputs of blocks 0..k-2 (block i's copies are waited for when block i+1 closes);
    after the last block's forward and in the backward before the blocks', every input
    but the last; in the backward of block k the inputs of blocks 0..k-1 (block k's came
    back at its first unpack: the simulated step replays as on CPU, without the
    prefetch -- with CUDA's prefetch of one block, block k-1's input and replay come
    back during block k's backward, one block's worth more than this step shows); none
    after block 0's backward and in the optimizer step. Only inputs the step holds then
    are subtracted (a block input lives from its block's forward to its backward). The
    result, ``off_peak``, is the peak of that step; the copies' time is priced apart
    (``ac2_dist.simulate``). Checked against a run on the simulated CUDA (the tests'
    stream and allocator model): a 4-block Llama whose peak is in the head's backward
    saves exactly the 3 inputs, there and here.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _UpdateType

from ..offload import Offload
from ._allocator import CachingAllocator

__all__: list[str] = []

_TOTAL = "Total"


def _meter_class(model: nn.Module) -> type:
    from torch.distributed.fsdp import FSDPModule

    return FSDPMemTracker if isinstance(model, FSDPModule) else MemTracker


class _Marks:
    """The meter's additions (kept apart from the tracker's own state)."""

    def __init__(self, blocks: dict[str, int]) -> None:
        self.blocks = blocks  # the tracker's module names of the checkpointed blocks -> index
        self.peak = 0
        self.peak_snap: dict[str, int] = {}
        self.peak_when = "-"
        self.segment: str | None = None
        self.segments: dict[str, int] = {}  # segment -> peak total bytes
        self.marks: dict[str, int] = {}  # segment -> total bytes when it began
        self.kept: dict[int, int] = {}  # block -> bytes alive after its forward minus before
        self.fwd_start: dict[int, int] = {}
        self.start = 0
        # Note [The boundary offloaded, counted from the same step]
        self.inputs: dict[int, int] = {}  # block -> bytes of its inputs (as Offload(block_inputs=True) picks them)
        self.prefetch = 0  # the simulated step replays as on CPU, without prefetch
        self.bwd_low: int | None = None  # the lowest block whose backward ran this step
        self.off_peak = 0
        self.off_when = "-"
        # Note [Reserved bytes: the allocations through the caching allocator's model]
        self.allocators = (CachingAllocator(), CachingAllocator(expandable_segments=True))
        self.live: dict[int, list] = {}  # id(tracker's storage info) -> its block in each model


def _stream(reftype: Any) -> str:
    """The stream a storage of the tracker's category ``reftype`` is allocated on (Note
    [Reserved bytes: the allocations through the caching allocator's model])."""
    name = str(getattr(reftype, "value", reftype))
    return name if name in ("All Gather", "Reduce Scatter") else "default"


def _total(snap: dict[Any, dict[str, int]]) -> int:
    return sum(dev.get(_TOTAL, 0) for dev in snap.values())


def make_meter(model: nn.Module, optimizer: torch.optim.Optimizer | None, blocks: dict[str, int]) -> Any:
    """A tracker of ``model`` (and ``optimizer``) that also records the additions of
    Note [The simulated step is counted by torch's tracker]."""
    base = _meter_class(model)

    class _StepMeter(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            if base is FSDPMemTracker:
                super().__init__(model, optimizer)
            else:
                super().__init__()
            self.ac2 = _Marks(blocks)

        def forget(self, module: nn.Module) -> None:
            """Forget ``module``'s and its submodules' previous call (torch's tracker
            refuses a module called twice in one step): before each microbatch's forward
            of a pipeline stage, the other stages' calls kept for their backwards."""
            for m in module.modules():
                self.memory_tracking.pop(m, None)

        def leave_inputs_unwatched(self) -> None:
            """Stop torch's module tracker from hooking each module's inputs' gradients
            (Note [Several stages per rank] in _pipeline.py): the hook holds the inputs'
            autograd nodes, which keeps a graph alive that a zero-bubble ``W`` runs only
            in part. Only the per-module statistics lose the inputs."""
            tracker = getattr(self, "_mod_tracker", None)
            hook = getattr(type(tracker), "_fw_pre_hook", None)
            if tracker is None or hook is None:
                raise RuntimeError("ac2_dist.simulate: this torch's memory tracker has no module tracker pre-forward "
                                   "hook to adapt; zero-bubble schedules cannot be simulated with it")
            tracker._fw_pre_hook = lambda mod, _inputs: hook(tracker, mod, ())

        def begin_step(self) -> None:
            marks = self.ac2
            marks.start = self.total()
            marks.peak, marks.peak_snap, marks.peak_when = marks.start, self._flat(), "start of the step"
            marks.segment, marks.segments, marks.marks = None, {}, {}
            marks.kept, marks.fwd_start = {}, {}
            marks.inputs, marks.bwd_low, marks.off_peak, marks.off_when = {}, None, marks.start, "start of the step"
            for a in marks.allocators:  # the counted step's high-water marks
                a.peak_reserved, a.peak_allocated = a.reserved, a.allocated

        def _update_snap(self, u_type: Any, winfo: Any, old_mem_consumed: int | None = None,
                         old_reftype: Any = None) -> None:
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            # Note [Reserved bytes: the allocations through the caching allocator's model]
            if u_type == _UpdateType.REF:  # a category change: the same block
                return
            marks = self.ac2
            old = marks.live.pop(id(winfo), None)
            if old is not None:
                for a, block in zip(marks.allocators, old):
                    a.free(block)
            if u_type != _UpdateType.DEL and winfo.mem_consumed > 0:  # ADD, or SIZE: the new size
                stream = _stream(winfo.reftype)
                marks.live[id(winfo)] = [a.malloc(winfo.mem_consumed, stream) for a in marks.allocators]

        def total(self) -> int:
            return _total(self._curr_mem_snap)

        def _flat(self) -> dict[str, int]:
            out: dict[str, int] = {}
            for dev in self._curr_mem_snap.values():
                for k, v in dev.items():
                    name = str(getattr(k, "value", k))  # a category enum, or "Total"
                    out[name] = out.get(name, 0) + v
            return out

        def mark(self, segment: str) -> None:
            now = self.total()
            marks = self.ac2
            marks.segment = segment
            marks.marks.setdefault(segment, now)
            marks.segments[segment] = max(marks.segments.get(segment, now), now)

        def block_forward(self, k: int, begins: bool, args: tuple = ()) -> None:
            now = self.total()
            if begins:
                self.ac2.fwd_start[k] = now
                self.ac2.inputs[k] = sum(t.numel() * t.element_size() for t in args if Offload.is_block_input(t))
            elif k in self.ac2.fwd_start:
                self.ac2.kept[k] = now - self.ac2.fwd_start[k]

        def _where(self) -> str:
            if self._in_opt:
                return "optimizer step"
            tracker = self._mod_tracker
            found = [self.ac2.blocks[p] for p in tracker.parents if p in self.ac2.blocks]
            phase = "backward" if tracker.is_bw else "forward"
            if found:
                return f"{phase} of block {max(found) if phase == 'forward' else min(found)}"
            return f"{phase}, outside the blocks"

        def _off_device(self) -> int:
            """Bytes of block inputs on the host now under ``Offload(block_inputs=True)``
            (Note [The boundary offloaded, counted from the same step])."""
            marks = self.ac2
            if self._in_opt or not marks.inputs:
                return 0
            tracker = self._mod_tracker
            found = [marks.blocks[p] for p in tracker.parents if p in marks.blocks]
            last = len(marks.blocks) - 1
            if tracker.is_bw:
                if found:
                    low = min(found)
                    marks.bwd_low = low if marks.bwd_low is None else min(marks.bwd_low, low)
                    upto = low - marks.prefetch
                else:
                    upto = last if marks.bwd_low is None else marks.bwd_low - marks.prefetch
            else:
                upto = max(found) - 1 if found else min(max(marks.fwd_start, default=0), last)
            return sum(marks.inputs.get(i, 0) for i in range(max(upto, 0)))

        def _update_peak_stats(self, peak_state: Any) -> None:
            # Not the tracker's own: it walks every module it has seen after every op (to
            # keep per-module peaks, which the simulation does not read), quadratic in the
            # number of blocks (Note [The simulated step is counted by torch's tracker]).
            now = self.total()
            marks = self.ac2
            if marks.inputs and now > marks.off_peak:
                off = now - self._off_device()
                if off > marks.off_peak:
                    marks.off_peak, marks.off_when = off, self._where()
            if marks.segment is not None and now > marks.segments.get(marks.segment, 0):
                marks.segments[marks.segment] = now
            if now > marks.peak:
                marks.peak, marks.peak_snap, marks.peak_when = now, deepcopy(self._flat()), self._where()

    return _StepMeter()
