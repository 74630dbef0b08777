"""Time for the simulated CUDA (tests/_simcuda.py): what a step would cost on a named GPU.

Note [The simulated timeline]
    While a :class:`SimCuda` runs with ``timeline=...``, every host thread's program is
    recorded as a :class:`Trace`: host work (a fixed cost per dispatched op, and the ops
    that run on host memory), kernels queued on streams, events recorded and waited
    for by streams, host synchronisations, allocations and frees (with the streams a
    block was ``record_stream``-ed on), threads started and joined, and marks a test
    sets. :func:`simulate` then replays the trace as a discrete-event simulation:

    - the host lanes run their programs in order; a kernel is queued at its lane's
      time and starts when its stream reaches it, after every event the stream waits
      for; an event completes when its stream has done what was queued before it;
    - a kernel's duration is the planner's cost model at the device's rates: FLOPs at
      the matmul rate of its dtype, bytes read and written at the memory bandwidth, at
      least ``kernel_s``; a collective moves its bytes over the link (an all-gather's
      or reduce-scatter's (W-1)/W of the full tensor, an all-reduce twice that); a
      host<->device copy moves over PCIe on the copy engine of its direction; views
      are no kernel;
    - compute kernels on different streams share the device: with ``contention`` (the
      default) the ones running at once each get an equal share of it (processor
      sharing), so overlap only helps where the device would otherwise idle; without,
      streams run in parallel at full speed (an upper bound on overlap). Copy engines
      and the link are separate resources, each serving one transfer at a time;
    - the caching allocator is ac2_dist/_sim/_allocator.py's model, driven at the host
      times of the allocations and frees: per-stream pools, and a block
      ``record_stream``-ed on another stream held until that stream has passed the
      point of the free. Each stream's first matmul reserves a cuBLAS workspace
      (``cublas_workspace``, 32 MiB on Hopper).

    Everything is deterministic: the same trace gives the same figures on any machine,
    so tests may assert them.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from ac2_dist._plan._flops import op_flops
from ac2_dist._sim._allocator import CachingAllocator

MiB = 1 << 20


@dataclass(frozen=True)
class Device:
    """A GPU's rates (the vendors' datasheet figures; ``ac2_dist.simulate.DEVICES``)."""

    name: str
    flops16: float
    flops32: float
    hbm: float  # bytes/s
    link: float = 450e9  # bytes/s per direction between GPUs (NVLink 4 on an H100/H200 SXM)
    pcie: float = 50e9  # bytes/s per direction, host <-> device (PCIe 5 x16, pinned)
    host_bytes: float = 10e9  # bytes/s of a memcpy on the host
    kernel_s: float = 3e-6  # the shortest kernel
    host_op_s: float = 5e-6  # host time per dispatched op (eager PyTorch)
    cublas_workspace: int = 32 * MiB  # per (handle, stream), reserved at a stream's first matmul
    world: int = 8  # ranks a collective spans, for its duration


def device(name: str = "h100", **overrides: Any) -> Device:
    from ac2_dist.simulate import DEVICES

    f16, f32, hbm = DEVICES[name]
    return Device(name, f16, f32, hbm, **overrides)


# ---- the trace ------------------------------------------------------------------------------

KINDS = ("compute", "h2d", "d2h", "comm")
_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "_scaled_dot_product", "linear", "convolution")


@dataclass
class Kernel:
    name: str
    kind: str  # one of KINDS
    work: float  # seconds at full device speed
    unit: str | None  # the graph whose replay queued it (None: not a replay)
    matmul: bool


@dataclass
class Trace:
    """What the host threads did, in their program order (Note [The simulated timeline])."""

    lanes: dict[int, list[tuple]] = field(default_factory=lambda: defaultdict(list))
    kernels: list[Kernel] = field(default_factory=list)
    streams: dict[int, str] = field(default_factory=dict)  # id -> name
    events = 0
    blocks = 0

    def add(self, lane: int, action: tuple) -> None:
        self.lanes[lane].append(action)


def _nbytes(tree: Any) -> int:
    total = 0
    for t in torch.utils._pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            total += t.numel() * t.element_size()
    return total


def duration(func: Any, args: tuple, kwargs: dict, out: Any, dev: Device, copy: str | None) -> tuple[str, float]:
    """(kind, seconds) of one op: ``copy`` is ``"h2d"``/``"d2h"`` for a copy between host
    and device memory (the caller knows which tensors are host memory), else None."""
    name = str(func)
    if copy is not None:
        return copy, max(dev.kernel_s, _nbytes(out if out is not None else args) / dev.pcie)
    namespace = name.split(".", 1)[0]
    if namespace in ("c10d", "_c10d_functional", "c10d_functional", "_dtensor"):
        moved = max(_nbytes(out), _nbytes(args))
        w = dev.world
        share = (w - 1) / w if w > 1 else 0.0
        if "all_reduce" in name or "allreduce" in name:
            share *= 2
        return "comm", max(dev.kernel_s, share * moved / dev.link) if share else dev.kernel_s
    try:
        flops = op_flops(func, args, kwargs, out)
    except Exception:
        flops = 0
    dtypes = {t.dtype for t in torch.utils._pytree.tree_leaves((args, out)) if isinstance(t, torch.Tensor)}
    rate = dev.flops16 if dtypes & {torch.bfloat16, torch.float16} else dev.flops32
    moved = _nbytes((args, kwargs)) + _nbytes(out)
    return "compute", max(dev.kernel_s, flops / rate, moved / dev.hbm)


def is_matmul(func: Any) -> bool:
    name = str(func)
    return any(f".{m}" in name or name.startswith(f"aten.{m}") for m in _MATMULS)


# ---- the simulation -------------------------------------------------------------------------


@dataclass
class Interval:
    stream: int
    start: float
    end: float
    kernel: int


@dataclass
class Result:
    """What :func:`simulate` found."""

    intervals: list[Interval]
    kernels: list[Kernel]
    streams: dict[int, str]
    marks: dict[str, list[float]]  # name -> host times it was set at
    lane_end: dict[int, float]
    waits: list[tuple[int, float, float, int, str | None]]  # (stream, blocked from, until, event's stream, phase)
    waited_units: list[tuple[str | None, frozenset]]  # (phase of the wait, units of the replays it waited for)
    peak_reserved: int
    peak_allocated: int
    end: float
    reserved_by: dict[int, int] = field(default_factory=dict)  # stream -> bytes its pools reserved

    def busy(self, stream: int, lo: float = 0.0, hi: float = math.inf) -> float:
        return sum(max(0.0, min(i.end, hi) - max(i.start, lo)) for i in self.intervals if i.stream == stream)

    def replay_seconds(self, lo: float = 0.0, hi: float = math.inf) -> float:
        """Work of the replays' compute kernels that started in [lo, hi) (an all-gather a
        replay's unshard issued is FSDP2's communication, not recompute)."""
        return sum(self.kernels[i.kernel].work for i in self.intervals
                   if self.kernels[i.kernel].unit is not None and self.kernels[i.kernel].kind == "compute"
                   and lo <= i.start < hi)

    def stalls(self, stream: int = 0, lo: float = 0.0, hi: float = math.inf) -> float:
        """Time ``stream`` sat idle in [lo, hi) waiting for another stream's event."""
        return sum(max(0.0, min(until, hi) - max(since, lo)) for s, since, until, _, _ in self.waits if s == stream)

    def late_waits(self, stream: int = 0) -> list[str]:
        """Each time ``stream`` (the compute stream) waited for replays of a unit other than
        the one whose backward queued the wait (``"phase:<unit>"`` marks): the serialised
        prefetch of Note [Nothing waits behind another unit] in replay.py."""
        out = []
        for (s, since, until, src, phase), (_, units) in zip(self.waits, self.waited_units):
            others = sorted(u for u in units if u is not None and u != phase)
            if s == stream and others:
                out.append(f"{self.streams.get(s, s)} waited {(until - since) * 1e6:.1f} us in {phase}'s backward for "
                           f"the replay of {others} on {self.streams.get(src, src)}")
        return out


class _PS:
    """Processor sharing of the device among running compute kernels (virtual time)."""

    def __init__(self, contention: bool) -> None:
        self.contention = contention
        self.v = 0.0  # virtual time: work done by each running kernel
        self.t = 0.0
        self.running: dict[int, float] = {}  # kernel id -> virtual finish
        self.version = 0

    def advance(self, t: float) -> None:
        n = len(self.running)
        if n and self.contention:
            self.v += (t - self.t) / n
        elif n:
            self.v += t - self.t
        self.t = t

    def add(self, k: int, work: float) -> None:
        self.running[k] = self.v + work
        self.version += 1

    def next_finish(self) -> tuple[float, int] | None:
        if not self.running:
            return None
        k, vf = min(self.running.items(), key=lambda kv: (kv[1], kv[0]))
        n = len(self.running) if self.contention else 1
        return self.t + (vf - self.v) * n, k


def simulate(trace: Trace, dev: Device, contention: bool = True, free_replays: bool = False,
             expandable_segments: bool = False) -> Result:
    """Run ``trace`` on ``dev`` (Note [The simulated timeline]). ``free_replays``: replay
    kernels take no time (the counterfactual that prices what replays cost)."""
    kernels = trace.kernels
    work = [0.0 if free_replays and k.unit is not None else k.work for k in kernels]
    queues: dict[int, list[tuple]] = defaultdict(list)  # stream -> items (kind, payload, issue time, phase)
    head: dict[int, int] = defaultdict(int)
    busy: dict[int, bool] = defaultdict(bool)
    blocked_since: dict[int, float] = {}
    event_done: dict[int, float] = {}
    event_stream: dict[int, int] = {}
    waiting_streams: dict[int, list[int]] = defaultdict(list)
    waiting_lanes: dict[int, list[int]] = defaultdict(list)
    lane_pos = {lane: 0 for lane in trace.lanes}
    lane_end: dict[int, float] = {}
    joiners: dict[int, list[int]] = defaultdict(list)
    phase: dict[int, str | None] = defaultdict(lambda: None)  # lane -> last "phase:" mark
    intervals: list[Interval] = []
    marks: dict[str, list[float]] = defaultdict(list)
    waits: list[tuple] = []
    waited_units: list[tuple] = []
    fifo_free = {"h2d": 0.0, "d2h": 0.0, "comm": 0.0}  # when each copy engine / the link is next free
    ps = _PS(contention)
    alloc = CachingAllocator(expandable_segments)
    blocks: dict[int, Any] = {}
    held: list[tuple[frozenset, Any]] = []  # (event ids, block) freed with record_stream holds
    workspaces: set[int] = set()
    heap: list[tuple] = []
    seq = 0
    kernel_stream: dict[int, int] = {}
    started: dict[int, float] = {}

    def push(t: float, kind: str, payload: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, payload))

    spawned = {lane for actions in trace.lanes.values() for a in actions if a[0] == "spawn" for lane in (a[1],)}
    for lane in trace.lanes:
        if lane not in spawned:
            push(0.0, "lane", lane)

    def complete_event(e: int, t: float) -> None:
        event_done[e] = t
        for s in waiting_streams.pop(e, []):
            push(t, "stream", s)
        for lane in waiting_lanes.pop(e, []):
            push(t, "lane", lane)

    def finish(k: int, t: float) -> None:
        s = kernel_stream[k]
        intervals.append(Interval(s, started[k], t, k))
        busy[s] = False
        advance_stream(s, t)

    def start_kernel(s: int, k: int, t: float) -> None:
        busy[s] = True
        kernel_stream[k] = s
        started[k] = t
        kind = kernels[k].kind
        if kind == "compute":
            if work[k] <= 0:
                push(t, "done", k)
                return
            ps.advance(t)
            ps.add(k, work[k])
            nf = ps.next_finish()
            assert nf is not None
            push(nf[0], "ps", ps.version)
        else:
            begin = max(t, fifo_free[kind])
            fifo_free[kind] = begin + work[k]
            started[k] = begin
            push(begin + work[k], "done", k)

    def advance_stream(s: int, t: float) -> None:
        q = queues[s]
        while not busy[s] and head[s] < len(q):
            item, payload, issued, ph = q[head[s]]
            if item == "record":
                complete_event(payload, t)
            elif item == "wait":
                if payload not in event_done:
                    blocked_since.setdefault(s, t)
                    waiting_streams[payload].append(s)
                    return
                since = blocked_since.pop(s, None)
                if since is not None and event_done[payload] > since:
                    src = event_stream.get(payload, -1)
                    waits.append((s, since, event_done[payload], src, ph))
                    units = frozenset(kernels[i.kernel].unit for i in intervals
                                      if i.stream == src and i.end > since and i.end <= event_done[payload])
                    waited_units.append((ph, units))
            else:  # a kernel
                head[s] += 1
                start_kernel(s, payload, t)
                return
            head[s] += 1

    def run_lane(lane: int, t: float) -> None:
        actions = trace.lanes[lane]
        i = lane_pos[lane]
        while i < len(actions):
            a = actions[i]
            op = a[0]
            if op == "host":
                lane_pos[lane] = i + 1
                push(t + a[1], "lane", lane)
                return
            if op == "issue":
                _, s, item, payload = a
                queues[s].append((item, payload, t, phase[lane]))
                if item == "record":
                    event_stream[payload] = s
                if item == "kernel" and kernels[payload].matmul and s not in workspaces:
                    workspaces.add(s)
                    alloc.malloc(dev.cublas_workspace, s, t)
                advance_stream(s, t)
            elif op == "sync":
                if a[1] not in event_done:
                    lane_pos[lane] = i
                    waiting_lanes[a[1]].append(lane)
                    return
                t = max(t, event_done[a[1]])
            elif op == "malloc":
                release(t)
                blocks[a[1]] = alloc.malloc(a[2], a[3], t)
            elif op == "free":
                block = blocks.pop(a[1], None)
                if block is not None:
                    if a[2]:  # record_stream'ed: held until those streams pass this point
                        alloc.free(block, t, hold=True)
                        held.append((frozenset(a[2]), block))
                    else:
                        alloc.free(block, t)
            elif op == "spawn":
                push(t, "lane", a[1])
            elif op == "join":
                if a[1] not in lane_end:
                    lane_pos[lane] = i
                    joiners[a[1]].append(lane)
                    return
                t = max(t, lane_end[a[1]])
            elif op == "mark":
                marks[a[1]].append(t)
                if a[1].startswith("phase:"):
                    phase[lane] = a[1][6:] or None
            i += 1
        lane_pos[lane] = i
        lane_end[lane] = t
        for j in joiners.pop(lane, []):
            push(t, "lane", j)

    def release(t: float) -> None:
        keep = []
        for evs, block in held:
            if all(e in event_done and event_done[e] <= t for e in evs):
                alloc.release(block)
            else:
                keep.append((evs, block))
        held[:] = keep

    last = 0.0
    while heap:
        t, _, kind, payload = heapq.heappop(heap)
        last = max(last, t)
        if kind == "lane":
            run_lane(payload, t)
        elif kind == "stream":
            advance_stream(payload, t)
        elif kind == "done":
            finish(payload, t)
        elif kind == "ps":
            if payload != ps.version:
                continue  # superseded by a later start or finish
            ps.advance(t)
            nf = ps.next_finish()
            if nf is None:
                continue
            t_fin, k = nf
            if t_fin > t + 1e-15:
                push(t_fin, "ps", ps.version)
                continue
            del ps.running[k]
            ps.version += 1
            nxt = ps.next_finish()
            if nxt is not None:
                push(nxt[0], "ps", ps.version)
            finish(k, t)
    stuck = [lane for lane in trace.lanes if lane not in lane_end]
    assert not stuck, f"simulated timeline: host lanes {stuck} never finished (a wait on an event never recorded?)"
    return Result(intervals, kernels, dict(trace.streams), dict(marks), lane_end, waits, waited_units,
                  alloc.peak_reserved, alloc.peak_allocated, last, dict(alloc.reserved_by))
