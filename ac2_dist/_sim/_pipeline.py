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
    first step and kept; its gradient is the stage's backward output, sent back and
    dropped); each backward of a stage before the last starts from the received
    gradient, in a receive buffer of its own (one per microbatch, kept); the stage's
    output stays in its forward cache until the microbatch's backward (on the last stage,
    the logits the loss was computed from). Around an FSDP2 root, every microbatch's
    backward runs without gradient sync and without resharding after backward (the
    unsharded gradients accumulate over the microbatches and the parameters stay
    gathered), then one reduce-scatter per unit at the end
    (``fsdp.finish_pipelined_backward``).

    Checked against torch's ``Schedule1F1B`` and ``ScheduleGPipe`` on 2 gloo ranks
    (tests/test_simulate_pipeline.py): every stage within 1.34 %; where it reads low, the
    real stage holds one more microbatch activation at its peak, in a buffer of the
    schedule's not identified. Not simulated: interleaved and zero-bubble schedules
    (several stages per rank, the weight gradient apart from the input's), whose
    in-flight counts differ; and a peak target, whose planner stays at the floor under a
    pipeline schedule (it cannot tell one microbatch's step from another's).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..fsdp import finish_pipelined_backward, pipelined_backward

__all__ = ["HFStage", "Pipeline", "SCHEDULES", "StageStep", "actions"]

#: The schedules simulated (torch.distributed.pipelining's single-stage ones).
SCHEDULES = ("1F1B", "GPipe")


@dataclass(frozen=True)
class Pipeline:
    """The pipeline stage :func:`~ac2_dist.simulate.simulate` runs: stage ``stage``
    (0-based) of ``stages``, ``microbatches`` microbatches a step, under ``schedule``:
    ``"1F1B"`` (``Schedule1F1B``: stage s keeps up to ``stages - s`` microbatches in
    flight) or ``"GPipe"`` (``ScheduleGPipe``: every microbatch's forward before any
    backward). Raises ValueError for a stage out of range, a count below 1 or another
    schedule."""

    stages: int
    stage: int
    microbatches: int
    schedule: str = "1F1B"

    def __post_init__(self) -> None:
        for name in ("stages", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ac2_dist.simulate: pipeline {name} must be a positive int, got {value!r}")
        if not isinstance(self.stage, int) or isinstance(self.stage, bool) or not 0 <= self.stage < self.stages:
            raise ValueError(f"ac2_dist.simulate: pipeline stage must be in [0, {self.stages}), got {self.stage!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"ac2_dist.simulate: pipeline schedule must be one of {', '.join(SCHEDULES)}, got "
                             f"{self.schedule!r} (interleaved and zero-bubble schedules are not simulated)")

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


def actions(p: Pipeline) -> list[tuple[str, int]]:
    """The stage's forwards ``("F", i)`` and backwards ``("B", i)`` in the order the
    schedule runs them (Note [A pipeline stage's step])."""
    m = p.microbatches
    if p.schedule == "GPipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(m, p.stages - p.stage)
    out = [("F", i) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while bwd < m:
        out.append(("B", bwd))
        bwd += 1
        if fwd < m:
            out.append(("F", fwd))
            fwd += 1
    return out


class StageStep:
    """The step of one pipeline stage (Note [A pipeline stage's step]), called as
    ``step(model, batch, before_forward)``: ``forward(model, inputs)`` returns the loss on
    the last stage and the stage's output on the others; ``batch`` is one microbatch's
    inputs, a tensor of it that requires grad being the received activation.
    ``before_forward`` is called before each microbatch's forward (the meter forgets the
    modules' previous call there: torch's FSDP memory tracker refuses a module called
    twice in one step otherwise)."""

    def __init__(self, pipeline: Pipeline, forward: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        self.pipeline = pipeline
        self.forward = forward
        # per stage module: the receive buffers, one per microbatch, made by its first step
        # and kept (Note [A pipeline stage's step])
        self._buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, model: nn.Module, batch: Any, before_forward: Callable[[], None]) -> None:
        p = self.pipeline
        bufs = self._buffers.setdefault(model, {"act": {}, "grad": {}})
        # the stage's forward cache: what backward starts from, the module's output (the last
        # stage's logits, which its loss was computed from), the inputs
        in_flight: dict[int, tuple[torch.Tensor, Any, Any]] = {}
        outputs: list[Any] = []
        hook = model.register_forward_hook(lambda _m, _a, out: outputs.append(out))
        try:
            for kind, i in actions(p):
                if kind == "F":
                    before_forward()
                    inputs = _received(batch, bufs["act"], i)
                    result = self.forward(model, inputs)
                    in_flight[i] = (result, outputs[-1] if outputs else None, inputs)
                    outputs.clear()
                    del result, inputs
                    continue
                out, _output, inputs = in_flight.pop(i)
                with pipelined_backward(model):
                    if p.last:
                        out.backward()
                    else:
                        grad = bufs["grad"].get(i)
                        if grad is None:  # the gradient the next stage sends: its receive buffer
                            grad = bufs["grad"][i] = torch.empty_like(out)
                        torch.autograd.backward(out, grad)
                del out, _output
                _drop_grads(inputs)  # the input's gradient, sent to the previous stage
                del inputs
        finally:
            hook.remove()
        finish_pipelined_backward(model)


def _received(batch: Any, buffers: dict, i: int) -> Any:
    """``batch`` with each tensor that requires grad (the received activation) replaced by
    microbatch ``i``'s receive buffer of its shape, made once and reused by later steps."""
    leaves, spec = torch.utils._pytree.tree_flatten(batch)
    out = []
    for k, t in enumerate(leaves):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            buf = buffers.get((i, k))
            if buf is None:
                buf = buffers[(i, k)] = torch.empty_like(t).requires_grad_()
            out.append(buf)
        else:
            out.append(t)
    return torch.utils._pytree.tree_unflatten(out, spec)


def _drop_grads(inputs: Any) -> None:
    for t in torch.utils._pytree.tree_leaves(inputs):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.grad = None


class HFStage(nn.Module):
    """One pipeline stage of a Hugging Face decoder-only causal LM whose layers are
    ``model.model.layers`` (with ``embed_tokens``, ``norm`` and ``lm_head``: Llama,
    Mistral, Qwen2, Mixtral, ...), split as evenly as the layers allow: the first stage
    takes the token ids, the last returns the logits, every other stage maps the hidden
    state it receives to the one it sends. Built from a whole model (its other layers,
    and the embedding, final norm and head where the stage has none, are dropped)."""

    def __init__(self, model: nn.Module, pipeline: Pipeline) -> None:
        super().__init__()
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if not isinstance(layers, nn.ModuleList) or not all(hasattr(inner, a) for a in ("embed_tokens", "norm")) \
                or not hasattr(model, "lm_head"):
            raise ValueError(f"ac2_dist.simulate: a pipeline stage of {type(model).__name__} cannot be built: the "
                             "stages are cut from model.model.layers with model.model.embed_tokens, model.model.norm "
                             "and model.lm_head (Llama-style models); build the stage yourself and pass it as build")
        n, p = len(layers), pipeline
        if n < p.stages:
            raise ValueError(f"ac2_dist.simulate: {p.stages} pipeline stages for {n} layers: each stage needs one")
        lo, hi = p.stage * n // p.stages, (p.stage + 1) * n // p.stages
        inner.layers = nn.ModuleList(list(layers)[lo:hi])
        if not p.first:
            inner.embed_tokens = None
        if not p.last:
            inner.norm = nn.Identity()
            model.lm_head = None
        self.model = model
        self.pipeline = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.model.model  # type: ignore[union-attr]
        hidden = inner(**({"input_ids": x} if self.pipeline.first else {"inputs_embeds": x})).last_hidden_state
        return self.model.lm_head(hidden) if self.pipeline.last else hidden  # type: ignore[operator]

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The causal LM loss of the last stage's logits (the model's own loss function)."""
        vocab = logits.shape[-1]
        return self.model.loss_function(logits, labels, vocab)  # type: ignore[operator]
