"""Plan a W-rank FSDP2 step from one CPU: what rank r holds at its peak, for no AC, full
AC, a save list or a peak target, without a GPU and without the data::

    from ac2_dist.simulate import simulate

    report = simulate(build_model, batch=make_batch, blocks=[Block], world_size=64,
                      modes=["none", "full"], target="70GiB", device="h100")
    print(report.format())
    report.save_plan("plan.json")   # the job: MemoryBudget(peak="70GiB", plan="plan.json")

or from the shell::

    python -m ac2_dist.simulate --hf-config config.json --world-size 64 --batch 2 \\
        --seq 8192 --dtype bf16 --target 70GiB --device h100 --plan-out plan.json

The step runs in this process on fake tensors under torch's fake process group; torch's
memory tracker (``torch.distributed._tools``) counts what it holds.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._plan import _plan_file
from ._sim import _report
from ._sim._climb import OneStep, climb
from ._sim._pipeline import Pipeline, StageStep, rank_stages
from ._sim._policies import normalize
from ._sim._report import ModeReport, format_table
from ._sim._run import _Recorder, _Run, _Spec, run_mode
from ._sim._stage_plan import StageModel, file_fqns, plan_meta
from ._sim._world import ddp_refused, fake_world, per_block_shard, tp_styles
from ._sizes import human_bytes, parse_size

__all__ = ["DEVICES", "HOST_LINKS", "NOT_COUNTED", "ModeReport", "Pipeline", "SimulationReport", "simulate"]

#: The named devices whose rates price recompute (``device=`` here, ``--device`` on the
#: command line), each name with its 16-bit and 32-bit dense matmul FLOP/s and its memory
#: bytes/s, from the vendors' datasheets (SXM parts; fp32 without TF32, torch's default).
DEVICES = _report.DEVICES

#: Host <-> device bytes/s (one direction) of the named devices' host link, which
#: block-input offload (``Offload(block_inputs=True)``) is priced at: PCIe Gen5 x16 for
#: H100/H200, Gen4 for A100, as pinned copies achieve it.
HOST_LINKS = _report.HOST_LINKS

#: What the simulation does not count, each a pair of what and its typical size on a
#: GPU. The report's figures are allocated bytes, ``torch.cuda.max_memory_allocated``'s
#: scale; add these to compare with what ``nvidia-smi`` shows.
NOT_COUNTED = _report.NOT_COUNTED


class SimulationReport:
    """What :func:`simulate` found for one rank: one :class:`ModeReport` per mode.

    ``format()`` renders the table; ``plan(target)`` solves the peak planner's problem
    on the simulated blocks; ``save_plan(path)`` writes the plan for
    ``MemoryBudget(peak=..., plan=path)``.
    """

    def __init__(self, spec: _Spec, world_size: int, rank: int, device: str, modes: list[ModeReport],
                 floor: _Run | None, host_link: float = 50e9) -> None:
        self.world_size = world_size
        self.rank = rank
        #: How many ranks the tensor-parallel dimension has; 1 without tensor parallelism.
        self.tp_size = 1
        #: The pipeline stage simulated (``simulate(..., pipeline=...)``), or None.
        self.pipeline: Pipeline | None = None
        self.device = device
        self.modes = modes
        self._spec = spec
        self._floor = floor
        self._link = host_link
        self._plan: dict[str, Any] | None = None
        #: Ops whose fake kernel refused the dtype and whose output the simulation made from
        #: the op's shapes (``aten._grouped_mm`` in float32: its meta function takes bfloat16 only).
        self.substituted: set[str] = set()

    @property
    def late_bytes(self) -> int:
        """Bytes of collective buffers a gloo job's worker threads may hold past their wait
        at any moment of the step (``device="cpu"``; 0 for a GPU): :meth:`plan` keeps them
        clear of the target, as the job's ``MemoryBudget(peak=...)`` does, so the lowest
        target a plan exists for is the floor plus this."""
        return self._floor.late if self._floor is not None else 0

    def mode(self, name: str) -> ModeReport:
        """The report of the mode named ``name`` (``"no AC"``, ``"full AC"``, ...)."""
        for m in self.modes:
            if m.name == name:
                return m
        raise KeyError(f"ac2_dist.simulate: no mode {name!r} in this report (it has "
                       f"{', '.join(m.name for m in self.modes)})")

    def format(self) -> str:
        """The table: per mode the rank's peak, its breakdown, when it happens, the
        recompute FLOPs and their estimated time, and what is not counted."""
        tp = self.tp_size
        mesh = f" (dp {self.world_size // tp} x tp {tp})" if tp > 1 else ""
        pp = self.pipeline
        stage = "" if pp is None else (
            f", pipeline stage {pp.stage} of {pp.stages} ({pp.schedule}, {pp.microbatches} microbatches a step)"
            if len(pp.indices) == 1 else f", pipeline rank {pp.stage} of {pp.stages}, stages "
            f"{', '.join(map(str, pp.indices))} of {pp.count} ({pp.schedule}, {pp.microbatches} microbatches a step)")
        head = (f"ac2_dist.simulate: rank {self.rank} of {self.world_size}{mesh}{stage}, recompute priced for "
                f"{self.device}")
        table = format_table(self.modes, head, has_head=pp is None or pp.last)
        late = self.late_bytes
        if late and any(m.name.startswith("target") for m in self.modes):
            table += (f"\n\na gloo job: its peak target is planned for the target less {human_bytes(late)}, the "
                      "collective buffers gloo's worker threads may hold past their wait (2 threads x the largest "
                      "FSDP unit's all-gather / reduce-scatter buffer)")
        if self.substituted:
            table += ("\n\nsimulated from the op's shapes (torch's fake kernel takes bfloat16 only; the real "
                      "kernel takes this dtype): " + ", ".join(sorted(self.substituted)))
        return table

    def plan(self, target: int | str, *, check: bool = True) -> ModeReport:
        """Solve for a peak ``target`` (bytes or ``"70GiB"``) on the simulated blocks
        (the planner of ``MemoryBudget(peak=...)``, from the simulated floor step) and,
        with ``check``, simulate the steps the job's planner would verify and correct it
        with (up to 4 planned steps, as the job): while a step leaves more than 3 % of
        the target unused the next plan saves more, within 3 % it changes only to a plan
        with less recompute that is predicted to fit, while one is over the target the
        next saves less; the plan is where they end (the cheapest within the target
        after 4).
        The plan is what
        :meth:`save_plan` writes. Raises ValueError if the target is below the
        simulated floor, naming both."""
        floor = self._floor
        if floor is None or not floor.problems:
            raise ValueError("ac2_dist.simulate: no checkpointed block was simulated (pass blocks=...)")
        nbytes = parse_size(target, "target")
        fqns = floor.fqns
        options = [_options(floor, f) for f in fqns]
        # Segment bases above the step's start, where the job's planner begins its step
        # after apply_ac(model, budget): the model's forward (Note [What a peak target
        # bounds] in _peak.py), before FSDP's root all-gather.
        origin = floor.start
        bases = {s: v - origin for s, v in floor.segments.items()}
        floor_peak = origin + max(bases.values())
        # a gloo job keeps its late collective buffers clear of the target, as its planner
        # does (Note [Collective buffers gloo frees late] in _plan/_late_buffers.py)
        late = floor.late
        planned = nbytes - late
        # a pipeline rank holds each plan once per microbatch in flight (Note [A stage's
        # microbatches in flight] in _plan/_stage_model.py)
        several = self.pipeline is not None and len(self.pipeline.indices) > 1
        model = StageModel(floor, several) if self.pipeline is not None else OneStep()
        choice = model.solve(options, bases, planned - origin)
        if choice is None or floor_peak > planned:
            less = (f" less the {late} bytes of collective buffers gloo may hold past their wait" if late else "")
            raise ValueError(
                f"ac2_dist.simulate: target={target!r} ({nbytes} bytes){less} is below the simulated floor of rank "
                f"{self.rank} ({human_bytes(floor_peak)}, {floor_peak} bytes: full AC in every block). Raise the "
                f"target to at least {floor_peak + late} bytes, shard over more ranks, or lower the batch size or "
                f"sequence length")
        name = f"target {target}" if isinstance(target, str) else f"target {human_bytes(nbytes)}"
        run, guard = None, {}
        if check:  # Note [A plan file climbs as the job would] in _sim/_climb.py
            problems = [floor.problems[floor.structure[f]] for f in fqns]
            choice, bases, guard, run = climb(model, options, problems, tuple(choice), bases, planned, origin,
                                              lambda c: self._simulate_plan(options, c))
        dks = [o[i].dk for o, i in zip(options, choice)]
        predicted = origin + model.predict(bases, dks)
        chosen = [o[i] for o, i in zip(options, choice)]
        report = ModeReport(name, predicted, floor.start, {}, "predicted (peak model)",
                            sum(o.flops for o in chosen), sum(o.seconds for o in chosen), {}, predicted)
        if run is not None:
            report.peak_bytes, report.breakdown, report.when = run.peak, run.breakdown, run.when
            report.kept_bytes = {fqns[k]: v for k, v in run.kept.items()}
            report.reserved_bytes, report.reserved_expandable_bytes = run.reserved
            if self.pipeline is None:
                _boundary(report, run, floor, self._spec.rates, self._link)
        meta = {"target": nbytes, "predicted_peak": predicted, "step_start": origin,
                "world_size": self.world_size, "rank": self.rank,
                "device": self.device, "torch": torch.__version__, "guard": guard, "late": late}
        if self.pipeline is not None:
            meta["pipeline"] = plan_meta(self.pipeline)
        names = file_fqns(fqns, several)  # Note [A pipeline rank's plan file names its stages]
        self._plan = _plan_file.dump(names, {n: floor.structure[f] for n, f in zip(names, fqns)}, floor.problems,
                                     tuple(choice), bases, meta)
        self.modes = [m for m in self.modes if m.name != name] + [report]
        return report

    def _simulate_plan(self, options: list, choice: tuple[int, ...]) -> _Run:
        floor = self._floor
        assert floor is not None
        plans = {f: floor.problems[floor.structure[f]].make_plan(_NoBudget(), o[i].saved)
                 for f, o, i in zip(floor.fqns, options, choice)}
        with fake_world(self.world_size, self.rank):
            return run_mode(self._spec, _Recorder(self._spec.rates, plans))

    def save_plan(self, path: str, target: int | str | None = None) -> None:
        """Write the plan of the last :meth:`plan` call (or of ``target``: solved from the
        simulated floor step, without the simulated steps that verify and correct it) as
        a JSON file for ``MemoryBudget(peak=..., plan=path)`` (versioned; keyed by module
        fqn and block structure)."""
        if target is not None:
            self.plan(target, check=False)
        if self._plan is None:
            raise ValueError("ac2_dist.simulate: no plan to save; call report.plan(target) first or pass target=")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self._plan, f)


class _NoBudget:
    """The budget a plan is made for outside a job (a plan file's blocks)."""

    _planner = None


def _options(floor: _Run, fqn: str) -> list:
    problem = floor.problems[floor.structure[fqn]]
    opts = getattr(problem, "_sim_options", None)
    if opts is None:
        opts = problem.frontier()
        problem._sim_options = opts  # type: ignore[attr-defined]
    return opts


def _report(name: str, run: _Run) -> ModeReport:
    return ModeReport(name, run.peak, run.start, run.breakdown, run.when,
                      kept_bytes={run.fqns[k]: v for k, v in run.kept.items()},
                      reserved_bytes=run.reserved[0], reserved_expandable_bytes=run.reserved[1])


def _boundary(r: ModeReport, run: _Run, floor: _Run | None, rates: tuple[float, float], link: float) -> None:
    """Fill in ``r``'s block-input offload figures from its step (Note [The boundary
    offloaded, counted from the same step] in _sim/_meter.py), priced at ``link``
    bytes/s and the device's FLOP rate."""
    if not run.inputs:
        return
    last = len(run.fqns) - 1
    r.boundary_bytes = sum(v for k, v in run.inputs.items() if k != last)
    r.offload_peak_bytes, r.offload_when = run.off_peak, run.off_when
    r.boundary_copy_seconds = max(run.inputs.values()) / link
    if floor is not None:
        flops = [sum(rec.flops for rec in floor.problems[floor.structure[f]].records.values())
                 for f in floor.fqns if floor.structure.get(f) in floor.problems]
        if flops:
            r.block_backward_seconds = 2 * min(flops) / rates[0]


def _rates(device: str | tuple[float, float], dtype: torch.dtype) -> tuple[float, float]:
    if isinstance(device, tuple):
        if len(device) != 2 or not all(isinstance(v, (int, float)) and v > 0 for v in device):
            raise ValueError(f"ac2_dist.simulate: device=(FLOP/s, bytes/s) must be two positive numbers, got {device!r}")
        return float(device[0]), float(device[1])
    rates = DEVICES.get(str(device).lower())
    if rates is None:
        raise ValueError(f"ac2_dist.simulate: unknown device {device!r}; name one of {', '.join(DEVICES)} or pass "
                         f"(FLOP/s, bytes/s)")
    half = dtype in (torch.bfloat16, torch.float16)
    return rates[0] if half else rates[1], rates[2]


def _default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    out = model(**batch) if isinstance(batch, dict) else model(*batch) if isinstance(batch, (tuple, list)) \
        else model(batch)
    loss = getattr(out, "loss", None)
    if loss is None:
        loss = (out[0] if isinstance(out, (tuple, list)) else out).float().mean()
    return loss


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def _check_shard_group(build: Callable[[], nn.Module], blocks: Any, group: int) -> None:
    """Refuse a shard group larger than every block parameter's first dimension, before
    any step: FSDP2 pads each parameter to a multiple of the group, so most ranks would
    hold padding and every all-gather would move the padding (a world size given wrong;
    100000 ranks took minutes to simulate a tiny model at 1.4 GiB a rank)."""
    from ._modules import _select

    with torch.device("meta"):
        probe = build()
    rows = max((p.shape[0] for _, m in _select(probe, blocks) for p in m.parameters() if p.dim() > 0), default=0)
    if rows and group > rows:
        raise ValueError(f"ac2_dist.simulate: FSDP2 would shard each block's parameters over {group} ranks, more "
                         f"than the rows of the largest one ({rows}): ranks past its last row would hold only "
                         f"padding and each all-gather would move {group / rows:.0f}x the parameters. Give the "
                         f"world size the job runs; a job this large shards over groups (HSDP: shard_size, "
                         f"--shard-size)")


def simulate(
    build: Callable[[], nn.Module],
    *,
    batch: Callable[[], Any],
    blocks: Any,
    world_size: int,
    rank: int = 0,
    fsdp: str | Callable[[nn.Module], None] | None = "per-block",
    shard_size: int | None = None,
    loss: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = _adamw,
    modes: Sequence[Any] = ("none", "full"),
    target: int | str | None = None,
    device: str | tuple[float, float] = "h100",
    dtype: torch.dtype = torch.float32,
    host_link: float | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool | str = True,
    tp_size: int | None = None,
    tp_plan: Mapping[str, Any] | None = None,
    groups: Sequence[Sequence[str]] = (),
    pipeline: Pipeline | None = None,
) -> SimulationReport:
    """Simulate one training step of rank ``rank`` of a ``world_size``-rank job.

    Args:
        build: builds the model (called on the meta device: nothing is allocated).
        batch: builds one batch (called under fake tensors): a tensor, a tuple of
            positional inputs or a dict of keyword inputs.
        blocks: the modules to checkpoint, as ``apply_ac``'s ``modules`` (types or a
            predicate).
        world_size: ranks of the job; ``rank``: the rank simulated.
        fsdp: ``"per-block"`` (``fully_shard`` each block, then the root), a function
            that wraps the model as the job's script does, or None (no sharding).
            ``"ddp"`` is refused: torch's DDP does not run under the fake process
            group.
        shard_size: with ``"per-block"``, shard over groups of this many ranks and
            replicate across groups (HSDP); ``world_size`` must be a multiple of it.
        loss: ``(model, batch) -> loss`` (default: the output's ``.loss``, else the mean
            of the output).
        optimizer: ``params -> optimizer`` (default AdamW), or None.
        modes: any of ``"none"``, ``"full"``, ``"titan"`` (torchtitan's op-level
            selective checkpointing: the attention ops, ``reduce_scatter``, ``abs``,
            ``max`` and every second matmul saved), a list of ops to save, a policy
            callable ``(ctx, op, *args, **kwargs) -> decision``, a policy factory (a
            zero-argument callable returning a fresh policy per block call) or a
            bytes/fraction ``MemoryBudget`` (a peak target is ``target``). A policy
            that decides while it runs has its recompute counted from the simulated
            step's replays.
        target: a peak target (bytes or ``"70GiB"``): adds the planned mode
            (:meth:`SimulationReport.plan`).
        device: a named device (a key of ``DEVICES``) or ``(FLOP/s, bytes/s)``: the rates
            recompute is priced with. ``"cpu"`` simulates a CPU job, whose collectives
            are gloo's: the buffers gloo makes inside an all-gather (one of the output's
            size) and a reduce-scatter (a clone of the input) are counted; a GPU's NCCL
            collectives make none (rates given as numbers are a GPU's).
        dtype: the dtype the model is built in (its parameters, gradients and
            optimizer states); without ``param_dtype`` also the one it computes in
            (picks the device's FLOP rate).
        param_dtype, reduce_dtype: FSDP2's ``MixedPrecisionPolicy`` (``fsdp="per-block"``):
            the dtype the unsharded parameters compute in and the one gradients are
            reduced in (torchtitan's default: ``dtype=torch.float32``,
            ``param_dtype=torch.bfloat16``, ``reduce_dtype=torch.float32``).
        reshard_after_forward: ``fsdp="per-block"``'s ``fully_shard`` option for every
            block: ``True``, ``False``, or ``"all-but-last"`` (torchtitan's: the last
            block keeps its parameters unsharded after forward, as backward starts
            with it); the root is resharded.
        tp_size, tp_plan: tensor parallelism inside each block (``fsdp="per-block"``):
            the ranks form a ``(world_size / tp_size, tp_size)`` mesh ``("dp", "tp")``;
            each block is parallelized over ``"tp"`` with ``tp_plan`` (submodule path
            inside the block -> ``"colwise"``, ``"rowwise"`` or a torch ``ParallelStyle``,
            applied with ``parallelize_module``), then sharded by FSDP2 over ``"dp"``, as
            torchtitan does; the embeddings and the head stay replicated over ``"tp"``.
            Rank ``r`` is ``(r // tp_size, r % tp_size)`` on the mesh. The blocks'
            attention must read its head count from the projected tensors (Hugging
            Face's models do) and ``tp_size`` must divide the heads.
        groups: modules checkpointed together as one region in every checkpointed mode,
            as ``apply_ac``'s ``groups`` (``[["model.norm", "lm_head"]]``: a causal LM's
            final norm and head, what ``hf.enable(..., head=True)`` does).
        host_link: host <-> device bytes/s, one direction, that block-input offload
            is priced at (default: the named device's in ``HOST_LINKS``; 50 GB/s for
            ``(FLOP/s, bytes/s)``).
        pipeline: a :class:`~ac2_dist.simulate.Pipeline` (``stages``, ``stage``,
            ``microbatches``, ``schedule``, ``stages_per_rank``): simulate that pipeline
            rank's step, its forwards and backwards in torch's schedule's order with the
            microbatches it keeps in flight, as ``PipelineStage`` runs them around an
            FSDP2 root (gradients accumulated unsharded over the microbatches, reduced
            after the last; zero-bubble schedules split each backward into the input's
            and the weights'). ``build`` builds the stage's module, ``batch`` one
            microbatch's inputs (on a stage after the first, the received activation: a
            tensor that requires grad), ``loss`` returns the loss on the last stage and
            the stage's output on the others; with several stages per rank ``build``
            returns an ``nn.ModuleList`` of the rank's stages (``Pipeline.indices``'
            order), ``batch`` a list of inputs, one per stage, and ``loss`` is called
            per stage module. ``world_size`` is then the ranks FSDP
            shards the stage over (the data-parallel group); a ``target`` is planned
            for the rank with every microbatch the schedule keeps in flight holding its
            saves, and the job follows the plan file as it is (its steps cannot be
            measured; with several stages per rank, give ``apply_ac`` an
            ``nn.ModuleList`` of the stage modules in ``Pipeline.indices``' order and
            the budget); no block-input offload figures.

    Every checkpointed mode also reports the same step with its block inputs offloaded
    (``Offload(block_inputs=True)``: every block's input but the last's in host memory
    between its block's forward and backward, on the offload schedule with the CUDA
    prefetch of one block): the bytes moved, that step's peak, and one input's copy
    time against a block's backward, the window the prefetch hides it in.

    Raises ValueError before any step runs for a world size, rank, shard size, device,
    target or ``fsdp`` that cannot be used (DDP included), and after the floor step for a target below it.

    Example::

        import torch
        from ac2_dist.simulate import simulate

        Layer = torch.nn.TransformerEncoderLayer
        report = simulate(lambda: torch.nn.Sequential(*[Layer(256, 4, 1024, batch_first=True) for _ in range(4)]),
                          batch=lambda: torch.randn(8, 512, 256), blocks=[Layer], world_size=8,
                          target="600MiB")   # rank 0 of 8, FSDP2 per layer: no AC, full AC, the target
        print(report.format())
        report.save_plan("plan.json")   # the job: MemoryBudget(peak="600MiB", plan="plan.json")
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"ac2_dist.simulate: world_size must be a positive int, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"ac2_dist.simulate: rank must be in [0, {world_size}), got {rank!r}")
    if shard_size is not None:
        if fsdp != "per-block":
            raise ValueError("ac2_dist.simulate: shard_size applies to fsdp='per-block'")
        if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1 \
                or world_size % shard_size:
            raise ValueError(f"ac2_dist.simulate: world_size={world_size} is not a multiple of shard_size="
                             f"{shard_size!r}: the mesh would be ({world_size} / {shard_size}) x {shard_size}; "
                             f"pick a shard size that divides the world size")
    if fsdp == "ddp":
        raise ValueError(ddp_refused())
    if tp_size is not None:
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1 or world_size % tp_size:
            raise ValueError(f"ac2_dist.simulate: tp_size must be a positive int that divides world_size="
                             f"{world_size}, got {tp_size!r}")
        if fsdp != "per-block" or shard_size is not None:
            raise ValueError("ac2_dist.simulate: tp_size applies to fsdp='per-block' without shard_size (a 2D "
                             "mesh dp x tp; a function given as fsdp can build any mesh)")
        if tp_size > 1:
            tp_styles(tp_plan if tp_plan is not None else {}, "tp_plan")  # checked before any step
    elif tp_plan is not None:
        raise ValueError("ac2_dist.simulate: tp_plan needs tp_size")
    if fsdp is not None and fsdp != "per-block" and not callable(fsdp):
        raise ValueError(f"ac2_dist.simulate: fsdp must be 'per-block', a function or None, got {fsdp!r}")
    for what, value in (("dtype", dtype), ("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise ValueError(f"ac2_dist.simulate: {what} must be a floating torch.dtype, got {value!r}")
    if reshard_after_forward not in (True, False, "all-but-last"):
        raise ValueError(f"ac2_dist.simulate: reshard_after_forward must be True, False or 'all-but-last', got "
                         f"{reshard_after_forward!r}")
    if (param_dtype is not None or reduce_dtype is not None or reshard_after_forward is not True) \
            and fsdp != "per-block":
        raise ValueError("ac2_dist.simulate: param_dtype, reduce_dtype and reshard_after_forward apply to "
                         "fsdp='per-block'; a function given as fsdp wraps the model as it likes")
    rates = _rates(device, param_dtype or dtype)
    if host_link is not None and (isinstance(host_link, bool) or not isinstance(host_link, (int, float))
                                  or host_link <= 0):
        raise ValueError(f"ac2_dist.simulate: host_link must be a positive number of bytes/s, got {host_link!r}")
    link = float(host_link) if host_link is not None else HOST_LINKS.get(str(device).lower(), 50e9)
    nbytes = parse_size(target, "target") if target is not None else None
    if isinstance(modes, (str, bytes)):
        raise ValueError(f"ac2_dist.simulate: modes is a list of modes, got the string {modes!r} (write "
                         f"modes=[{modes!r}])")
    wanted = [normalize(m) for m in modes]  # Note [A mode is any policy] (_sim/_policies.py)
    if not wanted and nbytes is None:
        raise ValueError("ac2_dist.simulate: modes is empty and there is no target: nothing to simulate (give "
                         "'none', 'full', a list of ops to save, a policy, or a target)")
    if fsdp == "per-block":
        _check_shard_group(build, blocks, shard_size or world_size // (tp_size or 1))
    shard = fsdp if callable(fsdp) else (
        per_block_shard(blocks, world_size, shard_size, param_dtype, reduce_dtype, reshard_after_forward, tp_size,
                        tp_plan)
        if fsdp == "per-block" else None)
    if pipeline is not None:
        if not isinstance(pipeline, Pipeline):
            raise ValueError(f"ac2_dist.simulate: pipeline must be an ac2_dist.simulate.Pipeline, got {pipeline!r}")
        build = rank_stages(build, pipeline)
    spec = _Spec(build, blocks, shard, batch, loss or _default_loss, optimizer, rates,
                 tuple(tuple(g) for g in groups), gloo=str(device).lower() == "cpu",
                 step=StageStep(pipeline, loss or _default_loss) if pipeline is not None else None)
    reports: list[ModeReport] = []
    floor: _Run | None = None
    # the floor step records the blocks' problems for a target's plan (and is the full-AC step)
    need_floor = nbytes is not None or any(m.kind != "none" for m in wanted)
    runs: list[_Run] = []
    with fake_world(world_size, rank):
        if need_floor:
            floor = run_mode(spec, _Recorder(rates), count_replays=True)
            runs.append(floor)
        for m in wanted:
            if m.kind == "full" and floor is not None:
                run = floor
            else:
                policy = "recompute_all" if m.kind == "full" else m.policy
                run = run_mode(spec, policy, m.factory, count_replays=m.kind != "none")
                runs.append(run)
            r = _report(m.name, run)
            if m.kind != "none":
                assert run.replayed is not None
                r.recompute_flops, r.recompute_seconds = run.replayed
                if floor is not None and pipeline is None:
                    _boundary(r, run, floor, rates, link)
            reports.append(r)
    report = SimulationReport(spec, world_size, rank, device if isinstance(device, str) else "custom", reports,
                              floor, link)
    report.substituted = set().union(*(r.substituted for r in runs)) if runs else set()
    report.tp_size = tp_size or 1
    report.pipeline = pipeline
    if nbytes is not None:
        report.plan(target)  # type: ignore[arg-type]
    return report


def _main(argv: list[str] | None = None) -> int:
    """``python -m ac2_dist.simulate``: the command line (``--help`` lists it)."""
    from ._sim._cli import main

    return main(simulate, argv)


if __name__ == "__main__":
    raise SystemExit(_main())
