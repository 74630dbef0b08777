"""One stage of a pipeline-parallel job, simulated: the schedule's microbatches in flight.

Note [A pipeline stage's step]
    Under a pipeline schedule a rank runs one stage (a slice of the blocks; the first also
    the embedding, the last also the head and the loss) over ``microbatches`` microbatches
    per step, and holds the activations of every microbatch whose forward has run and
    whose backward has not. The simulated step runs the stage's forwards and backwards in
    the order torch.distributed.pipelining's single-stage schedules run them on that stage
    (:func:`actions`): ``GPipe`` every forward, then every backward; ``1F1B`` ``min(M,
    stages - stage)`` forwards, then a backward and a forward in turn, then the remaining
    backwards -- so the first stage holds up to ``stages`` microbatches, the last one.

    What ``PipelineStage`` holds is held: each forward of a stage after the first reads
    the received activation from its receive buffer (one per microbatch, made by the
    first step and kept; its gradient is the stage's backward output, sent back); each backward of a stage before the last starts from the received
    gradient, in a receive buffer of its own (one per microbatch, kept); the stage's
    output stays in its forward cache until the microbatch's backward (on the last stage,
    the logits the loss was computed from). Around an FSDP2 root, every microbatch's
    backward runs without gradient sync and without resharding after backward (the
    unsharded gradients accumulate over the microbatches and the parameters stay
    gathered), then one reduce-scatter per unit at the end
    (``fsdp.finish_pipelined_backward``).

    What the schedule's sends keep alive is held too (Note [What a schedule's sends
    hold]). Checked against torch's ``Schedule1F1B`` and ``ScheduleGPipe`` on 2 gloo ranks
    (tests/test_simulate_pipeline.py, launch/bench_pipeline.py): every stage within 0.08 %.
    A peak target is planned for the rank from this step (Note [A stage's microbatches in
    flight] in _plan/_stage_model.py) and the job follows its plan file as simulated (Note
    [A pipeline rank's plan is followed as simulated] in _plan/_peak_pipeline.py).

Note [Several stages per rank]
    The multi-stage schedules (``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``,
    ``ZBVZeroBubble``, ``DualPipeV``) put ``stages_per_rank`` stages on every rank: the
    looped ones stage ``rank + k * ranks``, the V-shaped ones ``rank`` and ``2 * ranks - 1 -
    rank``. Their order is torch's own: :func:`actions` builds the schedule class on
    stand-in stages (what its constructor reads: index, count, group size and rank, a
    module) and reads the runtime's lowered order for the rank
    (``pipeline_order_with_comms``: each stage's FSDP unshard and reshard and its gradient
    reduction after its last backward placed among the computations; a torch without it:
    ``pipeline_order``, every reduction at the end), so the simulated rank runs what
    torch's runtime runs, whatever the torch version computes; an ``OVERLAP_F_B`` action
    (DualPipeV) runs its forward, then its backward, as torch's runtime does without a
    custom overlap function. The zero-bubble schedules split a microbatch's backward as
    ``PipelineStage`` does, with torch's own functions: ``I`` computes the input's gradient
    (``stage_backward_input``: nothing on stage 0), keeping the autograd graph for the
    weights, and ``W`` the weights' (``stage_backward_weight``; on stage 0 the whole
    backward), so what the weight gradients need stays alive from ``I`` to ``W``. Two
    things of the simulation itself would change that, and are set aside for these
    schedules: torch's module tracker watches each module's inputs with a hook that holds
    their autograd nodes (``register_multi_grad_hook``'s "all" mode) -- under a graph kept
    by ``I`` and run only in part by ``W`` that hook keeps the whole graph alive, so the
    meter leaves module inputs unwatched (``_StepMeter.leave_inputs_unwatched``: only its
    per-module statistics, which the simulation does not use, lose them); and that hook
    cannot watch a leaf under ``autograd.grad``, so a received activation is a view of its
    buffer. Under FSDP2 the rank's stages are separate roots (each ``fully_shard``-ed, as
    torchtitan shards each model part) inside one container that owns no parameter
    (:class:`RankStages`); every stage's backwards run without sync.
    torch's ``stage_backward_input`` finds a stage's weights among ``submod.parameters()``;
    FSDP2 registers the unsharded parameters there only while they are unsharded, so with
    ``reshard_after_forward=True`` (the parameters resharded after each forward) ``I``
    finds the sharded ones, which the graph does not hold: on 2 gloo ranks, torch 2.13, a
    middle stage's weights got no gradient under the zero-bubble schedules, with or
    without AC (all of them did with ``reshard_after_forward=False``, torchtitan's choice
    under pipelining). The simulation calls the same functions, so it shows the same step.

Note [What a schedule's sends hold]
    A stage sends its output forward and its input's gradient back with ``isend``; gloo's
    send keeps the tensor until the work object dies, and the schedules keep the works
    (or the ops) for a while, so a sent tensor can outlive its use. Modelled from torch's
    schedules, each sent tensor held as long as they hold it: the multi-stage runtime
    keeps every send's work until the step ends (every output sent forward, every
    gradient sent back); ``GPipe`` keeps the forward sends' works and the backward sends'
    works until its loop ends; ``1F1B`` keeps the works of its warmup's last-but-one
    forward until the cooldown begins, and a backward's gradient until the next backward
    has run. An output is held as a detached alias (its bytes, not its autograd graph).
    Without this the stage before the last read 1-5 % low against torch's runtime.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..fsdp import finish_pipelined_backward, is_fsdp_unit, pipelined_backward

__all__ = ["HFStage", "Pipeline", "RankStages", "SCHEDULES", "StageStep", "actions", "rank_stages"]

#: The schedules simulated: torch.distributed.pipelining's ``Schedule<name>``.
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
             "DualPipeV")
_SINGLE = ("1F1B", "GPipe")
_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class Pipeline:
    """The pipeline rank :func:`~ac2_dist.simulate.simulate` runs: rank ``stage``
    (0-based) of ``stages`` pipeline ranks, ``microbatches`` microbatches a step, under
    ``schedule``, torch.distributed.pipelining's ``Schedule<schedule>``: ``"1F1B"`` (stage
    s keeps up to ``stages - s`` microbatches in flight), ``"GPipe"`` (every microbatch's
    forward before any backward), or a schedule with ``stages_per_rank`` stages on each
    rank: ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"`` (rank r holds
    stages ``r + k * stages``), ``"ZBVZeroBubble"``, ``"DualPipeV"`` (exactly 2: stages
    ``r`` and ``2 * stages - 1 - r``). ``stages_per_rank`` defaults to 1 for 1F1B and GPipe,
    2 for the others. Raises ValueError for a rank out of range, a count below 1, another
    schedule, one this torch lacks, or a shape torch's schedule refuses."""

    stages: int
    stage: int
    microbatches: int
    schedule: str = "1F1B"
    stages_per_rank: int | None = None

    def __post_init__(self) -> None:
        for name in ("stages", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ac2_dist.simulate: pipeline {name} must be a positive int, got {value!r}")
        if not isinstance(self.stage, int) or isinstance(self.stage, bool) or not 0 <= self.stage < self.stages:
            raise ValueError(f"ac2_dist.simulate: pipeline stage must be in [0, {self.stages}), got {self.stage!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"ac2_dist.simulate: pipeline schedule must be one of {', '.join(SCHEDULES)}, got "
                             f"{self.schedule!r}")
        per = self.stages_per_rank
        if per is None:
            object.__setattr__(self, "stages_per_rank", per := 1 if self.schedule in _SINGLE else 2)
        if not isinstance(per, int) or isinstance(per, bool) or per < 1:
            raise ValueError(f"ac2_dist.simulate: pipeline stages_per_rank must be a positive int, got {per!r}")
        need = 1 if self.schedule in _SINGLE else 2 if self.schedule in _V_SHAPED else None
        if need is not None and per != need:
            raise ValueError(f"ac2_dist.simulate: the {self.schedule} schedule runs {need} stage"
                             f"{'s' if need > 1 else ''} per rank, got stages_per_rank={per}")
        actions(self)  # torch's schedule refuses a shape here, before any step

    @property
    def indices(self) -> tuple[int, ...]:
        """The stages this rank runs, in the order of ``simulate``'s ``build()`` list."""
        r, n, per = self.stage, self.stages, self.stages_per_rank or 1
        if self.schedule in _V_SHAPED:
            return (r, 2 * n - 1 - r)
        return tuple(r + k * n for k in range(per))

    @property
    def count(self) -> int:
        """Stages in the whole pipeline (``stages * stages_per_rank``)."""
        return self.stages * (self.stages_per_rank or 1)

    @property
    def first(self) -> bool:
        """Whether this rank runs the pipeline's first stage."""
        return 0 in self.indices

    @property
    def last(self) -> bool:
        """Whether this rank runs the pipeline's last stage."""
        return self.count - 1 in self.indices


def actions(p: Pipeline) -> list[tuple[str, int, int]]:
    """The rank's forwards ``("F", k, i)``, backwards ``("B", k, i)`` and, under a
    zero-bubble schedule, input and weight backwards ``("I", k, i)``, ``("W", k, i)`` of
    microbatch ``i`` on its ``k``-th stage (``p.indices[k]``), in the order the schedule
    runs them (Note [A pipeline stage's step], Note [Several stages per rank]); under a
    multi-stage schedule also the runtime's ``("U", k, 0)`` (unshard the stage's FSDP
    units), ``("R", k, 0)`` (reshard them) and ``("G", k, 0)`` (reduce its gradients)."""
    m = p.microbatches
    if p.schedule == "GPipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if p.schedule == "1F1B":
        warmup = min(m, p.stages - p.stage)
        out = [("F", 0, i) for i in range(warmup)]
        fwd, bwd = warmup, 0
        while bwd < m:
            out.append(("B", 0, bwd))
            bwd += 1
            if fwd < m:
                out.append(("F", 0, fwd))
                fwd += 1
        return out
    return _torch_order(p)


_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W",
          "UNSHARD": "U", "RESHARD": "R", "REDUCE_GRAD": "G"}


def _torch_order(p: Pipeline) -> list[tuple[str, int, int]]:
    """torch's lowered order for rank ``p.stage`` (Note [Several stages per rank])."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules

    kind = getattr(schedules, f"Schedule{p.schedule}", None)
    if kind is None:
        raise ValueError(f"ac2_dist.simulate: this torch ({torch.__version__}) has no Schedule{p.schedule}")
    indices = p.indices
    stand_ins = [SimpleNamespace(stage_index=i, num_stages=p.count, group_size=p.stages, group_rank=p.stage,
                                 is_first=i == 0, is_last=i == p.count - 1, submod=nn.Identity(),
                                 stage_index_to_group_rank=None) for i in indices]
    try:
        schedule = kind(stand_ins, p.microbatches)
        # the runtime's lowered order (with FSDP's unshard/reshard and the gradient reductions)
        # where this torch keeps one; else the compute order, reductions after it
        lowered = getattr(schedule, "pipeline_order_with_comms", None)
        order = lowered[p.stage] if lowered else schedule.pipeline_order[p.stage]
    except (ValueError, RuntimeError, AssertionError) as e:
        raise ValueError(f"ac2_dist.simulate: torch's Schedule{p.schedule} refuses {p.microbatches} microbatches "
                         f"on {p.stages} ranks x {p.stages_per_rank} stages: {str(e).strip().splitlines()[0]}"
                         ) from None
    except (AttributeError, TypeError) as e:  # a torch whose schedule reads more of its stages
        raise ValueError(f"ac2_dist.simulate: this torch's ({torch.__version__}) Schedule{p.schedule} cannot be "
                         f"built on the simulation's stand-in stages ({e}); simulate 1F1B or GPipe") from None
    out: list[tuple[str, int, int]] = []
    for action in order:
        for a in (action.sub_actions or ()) if action is not None and action.sub_actions else (action,):
            if a is None or a.computation_type.name not in _KINDS:
                continue  # an idle slot; the runtime's own communication
            out.append((_KINDS[a.computation_type.name], indices.index(a.stage_index), a.microbatch_index or 0))
    if not any(kind == "G" for kind, _, _ in out):
        out += [("G", k, 0) for k in range(len(indices))]
    return out


class RankStages(nn.Module):
    """The stages of one pipeline rank (``stages``, a ``nn.ModuleList``): the simulated
    model when a schedule puts several on a rank (Note [Several stages per rank]). It
    owns no parameter and is never called: each stage is."""

    def __init__(self, stages: nn.ModuleList) -> None:
        super().__init__()
        self.stages = stages

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline rank's stages are called one by one, by the schedule")


def rank_stages(build: Callable[[], nn.Module], pipeline: Pipeline) -> Callable[[], nn.Module]:
    """``build`` as the simulation calls it: with several stages per rank, its
    ``nn.ModuleList`` of the rank's stages inside a :class:`RankStages`."""
    if len(pipeline.indices) == 1:
        return build

    def stages() -> nn.Module:
        built = build()
        if not isinstance(built, nn.ModuleList) or len(built) != len(pipeline.indices):
            raise ValueError(f"ac2_dist.simulate: {pipeline.schedule} with {len(pipeline.indices)} stages per rank: "
                             f"build() must return an nn.ModuleList of the rank's {len(pipeline.indices)} stage "
                             f"modules (stages {list(pipeline.indices)}), got {type(built).__name__}")
        return RankStages(built)

    return stages


class StageStep:
    """The step of one pipeline rank (Note [A pipeline stage's step], Note [Several
    stages per rank]), called as ``step(model, batch, before_forward, on_action)``; ``model`` is the
    stage's module, or with several stages per rank a :class:`RankStages`, ``batch`` one
    microbatch's inputs (a list: one per stage). ``forward(module, inputs)`` returns the
    loss on the last stage and the stage's output on the others; a tensor of ``inputs``
    that requires grad is the received activation. ``before_forward(stage)`` is called
    before each microbatch's forward (the meter forgets the stage's modules' previous call
    there: torch's FSDP memory tracker refuses a module called twice in one step
    otherwise). ``on_action(kind, k, i)``, if given, is called before each of
    :func:`actions`' entries and with ``("E", 0, 0)`` after the last (the planner's
    segments: Note [A stage's microbatches in flight] in _plan/_stage_model.py)."""

    def __init__(self, pipeline: Pipeline, forward: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        self.pipeline = pipeline
        self.forward = forward
        # per stage module: the receive buffers, one per microbatch, made by its first step
        # and kept (Note [A pipeline stage's step])
        self._buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs a microbatch's backward as ``I`` and ``W``."""
        return self.pipeline.schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

    def __call__(self, model: nn.Module, batch: Any, before_forward: Callable[[nn.Module], None],
                 on_action: Callable[[str, int, int], None] | None = None) -> None:
        p = self.pipeline
        several = len(p.indices) > 1
        mods = list(model.stages) if isinstance(model, RankStages) else [model]
        batches = list(batch) if several and isinstance(batch, (list, tuple)) else [batch]
        if len(batches) != len(mods):
            raise ValueError(f"ac2_dist.simulate: {p.schedule} with {len(p.indices)} stages per rank: batch() must "
                             f"return a list of {len(p.indices)} inputs, one per stage, got {type(batch).__name__}")
        bufs = [self._buffers.setdefault(m, {"act": {}, "grad": {}}) for m in mods]
        # the stage's forward cache: what backward starts from, the module's output (the last
        # stage's logits, which its loss was computed from), the inputs
        in_flight: dict[tuple[int, int], tuple[torch.Tensor, Any, Any]] = {}
        split: dict[tuple[int, int], Any] = {}  # between I and W (zero-bubble)
        outputs: list[Any] = []
        # what the schedule's sends still hold (Note [What a schedule's sends hold])
        sent: list[torch.Tensor] = []
        held_to_end, split_backward = p.schedule != "1F1B", self.splits_backward
        # 1F1B: the send of its warmup's last-but-one forward, held until the cooldown begins
        early: list[torch.Tensor] = []
        forwards, warmup = 0, min(p.microbatches, p.stages - p.stage)
        hooks = [m.register_forward_hook(lambda _m, _a, out: outputs.append(out)) for m in mods]
        try:
            for kind, k, i in actions(p):
                if on_action is not None:
                    on_action(kind, k, i)
                if kind == "F":
                    before_forward(mods[k])
                    inputs = _received(batches[k], bufs[k]["act"], i, view=split_backward)
                    result = self.forward(mods[k], inputs)
                    in_flight[(k, i)] = (result, outputs[-1] if outputs else None, inputs)
                    if p.indices[k] != p.count - 1:  # its bytes, not its graph
                        if held_to_end:
                            sent.append(result.detach())
                        elif i == warmup - 2:
                            early[:] = [result.detach()]
                    forwards += 1
                    outputs.clear()
                    del result, inputs
                    continue
                if kind == "W":
                    with pipelined_backward(mods[k]):
                        _weights(mods[k], p.indices[k] == 0, *split.pop((k, i)))
                    continue
                if kind in "URG":
                    _runtime(kind, mods[k])
                    continue
                out, _output, inputs = in_flight.pop((k, i))
                last = p.indices[k] == p.count - 1
                grad = None
                if not last:
                    grad = bufs[k]["grad"].get(i)
                    if grad is None:  # the gradient the next stage sends: its receive buffer
                        grad = bufs[k]["grad"][i] = torch.empty_like(out)
                with pipelined_backward(mods[k]):
                    if kind == "B":
                        torch.autograd.backward(out, grad)
                        grads = _take_grads(inputs)  # the input's gradient, sent to the previous stage
                    else:
                        split[(k, i)], grads = _inputs(mods[k], p.indices[k] == 0, out, grad, inputs)
                del out, _output, grad
                if p.schedule == "1F1B":
                    sent[:] = grads  # the previous microbatch's is dropped after this backward
                    if forwards == p.microbatches:
                        early.clear()
                elif p.indices[k] != 0:
                    sent.extend(grads)
                del inputs, grads
        finally:
            for h in hooks:
                h.remove()
        sent.clear()
        early.clear()
        if on_action is not None:
            on_action("E", 0, 0)
        if p.schedule in _SINGLE:  # the multi-stage runtime reduces each stage after its last backward
            finish_pipelined_backward(mods[0])


def _runtime(kind: str, module: nn.Module) -> None:
    """The multi-stage runtime's own actions on a stage: ``U`` unshards every FSDP unit in
    it, ``R`` reshards them, ``G`` reduces its gradients (as ``PipelineStage.perform_reduce_grad``)."""
    if kind == "G":
        finish_pipelined_backward(module)
        return
    for unit in module.modules():
        if is_fsdp_unit(unit):
            getattr(unit, "unshard" if kind == "U" else "reshard")()


def _inputs(module: nn.Module, first: bool, out: torch.Tensor, grad: torch.Tensor | None, inputs: Any
            ) -> tuple[tuple, list[torch.Tensor]]:
    """A zero-bubble ``I``: the input's gradient, as ``PipelineStage`` computes it
    (Note [Several stages per rank]); returns what its ``W`` needs and the gradients
    sent."""
    from torch.distributed.pipelining._backward import stage_backward_input

    values = [t for t in torch.utils._pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    if first:  # torch leaves stage 0's whole backward to its W
        return (out, grad, values, None), []
    with warnings.catch_warnings():  # it reads the received view's .grad (Note [Several stages per rank])
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        dinputs, groups = stage_backward_input((out,), None if grad is None else [grad], values,
                                               module.parameters())
    return (out, grad, values, groups), [g for g in dinputs if g is not None]


def _weights(module: nn.Module, first: bool, out: torch.Tensor, grad: torch.Tensor | None, values: list,
             groups: Any) -> None:
    """A zero-bubble ``W``: the weights' gradients (on stage 0 the whole backward)."""
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_weight

    if first:
        stage_backward(out, grad, values)
    else:
        stage_backward_weight(module.parameters(), groups)


def _received(batch: Any, buffers: dict, i: int, view: bool = False) -> Any:
    """``batch`` with each tensor that requires grad (the received activation) replaced by
    microbatch ``i``'s receive buffer of its shape, made once and reused by later steps;
    with ``view``, a view of it (Note [Several stages per rank]: torch's module tracker
    cannot watch a leaf's gradient under ``autograd.grad``)."""
    leaves, spec = torch.utils._pytree.tree_flatten(batch)
    out = []
    for k, t in enumerate(leaves):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            buf = buffers.get((i, k))
            if buf is None:
                buf = buffers[(i, k)] = torch.empty_like(t).requires_grad_()
            out.append(buf.view_as(buf) if view else buf)
        else:
            out.append(t)
    return torch.utils._pytree.tree_unflatten(out, spec)


def _take_grads(inputs: Any) -> list[torch.Tensor]:
    """The gradients of the received activations in ``inputs``, taken off them (off the
    receive buffer a received view was made from)."""
    out = []
    for t in torch.utils._pytree.tree_leaves(inputs):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            leaf = t if t.is_leaf else t._base  # a view of its receive buffer: the buffer's
            if leaf is not None and leaf.grad is not None:
                out.append(leaf.grad)
                leaf.grad = None
    return out


class HFStage(nn.Module):
    """One pipeline stage of a Hugging Face decoder-only causal LM whose layers are
    ``model.model.layers`` (with ``embed_tokens``, ``norm`` and ``lm_head``: Llama,
    Mistral, Qwen2, Mixtral, ...), split as evenly as the layers allow into
    ``pipeline.count`` stages: stage ``index`` (default: the rank's only stage). The first
    stage takes the token ids, the last returns the logits, every other stage maps the
    hidden state it receives to the one it sends. Built from a whole model (its other
    layers, and the embedding, final norm and head where the stage has none, are
    dropped)."""

    def __init__(self, model: nn.Module, pipeline: Pipeline, index: int | None = None) -> None:
        super().__init__()
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if not isinstance(layers, nn.ModuleList) or not all(hasattr(inner, a) for a in ("embed_tokens", "norm")) \
                or not hasattr(model, "lm_head"):
            raise ValueError(f"ac2_dist.simulate: a pipeline stage of {type(model).__name__} cannot be built: the "
                             "stages are cut from model.model.layers with model.model.embed_tokens, model.model.norm "
                             "and model.lm_head (Llama-style models); build the stage yourself and pass it as build")
        if index is None:
            if len(pipeline.indices) != 1:
                raise ValueError(f"ac2_dist.simulate: {pipeline.schedule} runs {len(pipeline.indices)} stages per "
                                 "rank: build each with its index")
            index = pipeline.indices[0]
        n, count = len(layers), pipeline.count
        if n < count:
            raise ValueError(f"ac2_dist.simulate: {count} pipeline stages for {n} layers: each stage needs one")
        lo, hi = index * n // count, (index + 1) * n // count
        inner.layers = nn.ModuleList(list(layers)[lo:hi])
        #: Whether this stage is the pipeline's first (takes token ids) / last (returns logits).
        self.first, self.last = index == 0, index == count - 1
        if not self.first:
            inner.embed_tokens = None
        if not self.last:
            inner.norm = nn.Identity()
            model.lm_head = None
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.model.model  # type: ignore[union-attr]
        hidden = inner(**({"input_ids": x} if self.first else {"inputs_embeds": x})).last_hidden_state
        return self.model.lm_head(hidden) if self.last else hidden  # type: ignore[operator]

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The causal LM loss of the last stage's logits (the model's own loss function)."""
        vocab = logits.shape[-1]
        return self.model.loss_function(logits, labels, vocab)  # type: ignore[operator]
