"""One simulated training step of one mode (no AC, full AC, a save list, a plan) for rank
r of a world of W ranks, in this process, holding no data (Note [A step without data]).

Note [A step without data]
    The process joins torch's fake process group (``"fake"``: every collective returns
    at once, allocating what the real one allocates). The model is built on the meta
    device, checkpointed by ac2 and wrapped (FSDP2) as the user's script does, then
    materialized under ``FakeTensorMode`` (``to_empty``): parameters, inputs and every
    op's output are fake tensors (shapes, dtypes, storages; no bytes). Two steps run:
    the first creates the optimizer's states (AdamW's are lazy) and calibrates ac2's
    blocks; the second is the one counted (Note [The simulated step is counted by
    torch's tracker] in _sim/_meter.py). The ops dispatched are the CPU ops of the
    dtype asked for (the simulation runs on CPU kernels' dispatch: on CUDA, attention
    dispatches to other kernels whose saved tensors may differ by a few per cent).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses import FakeTensorMode

from .._modules import _select, apply_ac
from .._plan._block_problem import Plan, _CostModel, _Problem
from .._plan._budget_region import _BudgetRegion
from .._plan._late_buffers import GLOO_THREADS, late_collective_bytes
from ..budget import MemoryBudget
from ._kernels import NarrowFakes
from ._meter import make_meter
from ._policies import _ReplayCost
from ._world import GlooBuffers, eager_collectives

__all__: list[str] = []


@dataclass
class _Spec:
    """What to simulate (built by :func:`ac2_dist.simulate.simulate`)."""

    build: Callable[[], nn.Module]
    blocks: Any  # apply_ac's ``modules``
    shard: Callable[[nn.Module], None] | None
    batch: Callable[[], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None
    rates: tuple[float, float]  # FLOP/s, bytes/s of the device recompute is priced for
    groups: tuple = ()  # apply_ac's ``groups``: modules checkpointed together as one region
    gloo: bool = False  # a CPU job: count gloo's own buffers (Note [gloo's buffers of its own] in _world.py)
    # a pipeline stage's step (Note [A pipeline stage's step] in _pipeline.py): runs the
    # schedule's forwards and backwards; None: one forward of ``loss`` and its backward
    step: Callable[..., None] | None = None


@dataclass
class _Run:
    """What one simulated mode measured (bytes are totals on the rank)."""

    peak: int
    start: int  # alive when the counted step began
    breakdown: dict[str, int]  # category -> bytes at the peak
    when: str
    kept: dict[int, int]  # block -> bytes its forward left alive
    fqns: list[str]  # the checkpointed blocks, forward order (ac2's fqns)
    segments: dict[str, int] = field(default_factory=dict)  # planner segment -> peak total
    fwd0: int = 0  # total when block 0's forward began
    problems: dict[tuple, _Problem] = field(default_factory=dict)  # structure -> its problem (full AC)
    structure: dict[str, tuple] = field(default_factory=dict)  # fqn -> its structure (full AC)
    inputs: dict[int, int] = field(default_factory=dict)  # block -> its inputs' bytes (Offload(block_inputs=True))
    # the peak with the block inputs offloaded (Note [The boundary offloaded, counted
    # from the same step] in _meter.py)
    off_peak: int = 0
    off_when: str = "-"
    # calls answered for a fake kernel narrower than the real one (Note [A fake kernel
    # narrower than the real one] in _kernels.py)
    substituted: set[str] = field(default_factory=set)
    # FLOPs and seconds of the counted step's replays (Note [A mode is any policy] in
    # _sim/_policies.py); None where the mode's recompute is read from the floor's problems
    replayed: tuple[int, float] | None = None
    # the counted step's peak reserved bytes, caching allocator model without and with
    # expandable_segments (Note [Reserved bytes: the allocations through the caching
    # allocator's model] in _sim/_meter.py)
    reserved: tuple[int, int] = (0, 0)
    # the collective buffers gloo may hold past their wait on a CPU job, which a peak target
    # keeps clear (Note [Collective buffers gloo frees late] in _plan/_late_buffers.py)
    late: int = 0


class _Recorder(MemoryBudget):
    """``MemoryBudget(0)`` ("recompute_all") that keeps each block's problem, prices ops
    for the simulated device and marks the planner's segments; with ``plans`` its
    blocks follow them instead (a plan being simulated)."""

    def __init__(self, rates: tuple[float, float], plans: dict[str, Plan] | None = None) -> None:
        super().__init__(0.0)
        self.rates = rates
        self.meter: Any = None
        self.problems: dict[tuple, _Problem] = {}  # structure -> its problem
        self.structure: dict[str, tuple] = {}  # fqn -> the structure its last call ran
        self.order: list[str] = []
        # a pipeline rank's step: "@i" while microbatch i's action runs (Note [A stage's
        # microbatches in flight] in _plan/_stage_model.py); "" otherwise
        self.tag = ""
        if plans:
            self._set_plans(plans)

    def new_region_policy(self, module_fqn: str) -> _BudgetRegion:
        return _SimRegion(self, module_fqn)

    def _adopt(self, fqn: str, problem: _Problem) -> Plan:
        self.problems[problem.signature] = problem
        return super()._adopt(fqn, problem)

    def _cost_model(self, device: torch.device) -> _CostModel:
        return _CostModel(device, *self.rates)


class _SimRegion(_BudgetRegion):
    def region_enter(self, graph: Any) -> None:
        super().region_enter(graph)
        rec = self.budget
        meter = rec.meter  # type: ignore[attr-defined]
        if graph is None or meter is None:
            return
        order = rec.order  # type: ignore[attr-defined]
        if self.fqn not in order:
            order.append(self.fqn)
        k = order.index(self.fqn)
        tag = rec.tag  # type: ignore[attr-defined]
        meter.mark(f"fwd:{k}{tag}")
        graph.on_backward = lambda _g, k=k, tag=tag: meter.mark(f"bwd:{k}{tag}")

    def region_exit(self, graph: Any, failed: bool) -> None:
        super().region_exit(graph, failed)
        signature = self.problem_signature or (self.plan.signature if self.plan is not None else None)
        if signature is not None and not failed:
            self.budget.structure[self.fqn] = signature  # type: ignore[attr-defined]


def _tracker_names(model: nn.Module, fqns: Iterable[str]) -> dict[str, int]:
    root = type(model).__name__
    return {f"{root}.{f}" if f else root: k for k, f in enumerate(fqns)}


def _action_marks(recorder: _Recorder | None, meter: Any) -> Callable[[str, int, int], None] | None:
    """A pipeline step's action callback: marks a segment at each action of the counted
    step (Note [A stage's microbatches in flight] in _plan/_stage_model.py)."""
    if recorder is None:
        return None

    def on_action(kind: str, k: int, i: int) -> None:
        if recorder.meter is meter:
            recorder.tag = f"@{i}"
            meter.mark(f"act:{kind}{k}@{i}")

    return on_action


def run_mode(spec: _Spec, policy: Any, factory: Any = None, count_replays: bool = False) -> _Run:
    """Simulate two steps under ``policy`` (None: no AC; a list of ops; a
    :class:`_Recorder`; any policy ``apply_ac`` takes) or ``factory`` (a policy
    factory) and count the second (Note [A step without data]); ``count_replays``:
    price the second step's replays (Note [A mode is any policy] in _sim/_policies.py)."""
    with torch.device("meta"):
        model = spec.build()
    recorder = policy if isinstance(policy, _Recorder) else None
    if factory is not None:
        apply_ac(model, policy_factory=factory, modules=spec.blocks, groups=spec.groups)
    elif policy is not None:
        apply_ac(model, policy, modules=spec.blocks, groups=spec.groups)
    fqns = [name for name, _ in _select(model, spec.blocks)]
    if spec.shard is not None:
        spec.shard(model)
    modules = dict(model.named_modules())
    meter_ref: list[Any] = []
    hooks = []
    for k, f in enumerate(fqns):
        m = modules[f]
        # after FSDP's pre-forward (its all-gather) and before its post-forward (its reshard)
        hooks.append(m.register_forward_pre_hook(lambda _m, args, k=k: meter_ref[0].block_forward(k, True, args)))
        hooks.append(m.register_forward_hook(lambda *_a, k=k: meter_ref[0].block_forward(k, False), prepend=True))
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    # one more Python mode per op (4 % of a tiny Llama's simulation): only where a refused
    # dtype can occur (Note [A fake kernel narrower than the real one] in _kernels.py)
    narrow = NarrowFakes() if any(p.is_floating_point() and p.dtype != torch.bfloat16
                                  for p in model.parameters()) else contextlib.nullcontext()
    # Note [The simulated collectives complete as eager ones do] (_sim/_world.py)
    with fake, narrow, eager_collectives():
        model.to_empty(device="cpu")
        batch = spec.batch()
        opt = spec.optimizer(model.parameters()) if spec.optimizer is not None else None
        meter = make_meter(model, opt, _tracker_names(model, fqns))
        meter_ref.append(meter)
        if getattr(spec.step, "splits_backward", False):  # Note [Several stages per rank] (_pipeline.py)
            meter.leave_inputs_unwatched()
        meter.track_external(*[t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)])
        replays = _ReplayCost(spec.rates) if count_replays else None
        for step in range(2):
            with meter, (replays if replays is not None and step == 1 else contextlib.nullcontext()), \
                    (GlooBuffers() if spec.gloo else contextlib.nullcontext()):
                if step == 1:
                    meter.begin_step()
                    if recorder is not None:
                        recorder.meter, recorder.order = meter, list(fqns)
                if spec.step is not None:
                    spec.step(model, batch, meter.forget, _action_marks(recorder, meter))
                else:
                    loss = spec.loss(model, batch)
                    loss.backward()
                    del loss
                if opt is not None:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                else:
                    model.zero_grad(set_to_none=True)
                meter.reset_mod_stats()
    for h in hooks:
        h.remove()
    marks = meter.ac2
    run = _Run(marks.peak, marks.start, dict(marks.peak_snap), marks.peak_when, dict(marks.kept), fqns,
               inputs=dict(marks.inputs), off_peak=marks.off_peak, off_when=marks.off_when,
               substituted=set(narrow.used) if isinstance(narrow, NarrowFakes) else set())
    run.reserved = (marks.allocators[0].peak_reserved, marks.allocators[1].peak_reserved)
    if spec.gloo:  # after the steps: FSDP knows its dtypes once it has run
        run.late = late_collective_bytes(model.modules(), threads=GLOO_THREADS)
    if replays is not None:
        run.replayed = (replays.flops, replays.seconds)
    if recorder is not None:
        run.segments = dict(marks.segments)
        run.fwd0 = marks.marks.get("fwd:0", marks.start)
        run.problems = dict(recorder.problems)
        run.structure = dict(recorder.structure)
    return run
