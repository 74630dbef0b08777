"""A dispatch mode that watches what a tensor subclass's ``__torch_dispatch__`` runs
underneath (Note [Subclasses hide collectives]); the tracer runs ops with subclass
arguments under it. Moved verbatim from _tracer.py (which still exports the name)."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from ..compile import skip_dynamo as _skip_dynamo
from ..side_effects import _INFO, SideEffect, op_info

__all__: list[str] = []


try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # torch built without distributed
    _DTensor = None


_COMMUNICATING = (SideEffect.COLLECTIVE, SideEffect.FSDP, SideEffect.REGISTERED)


class _CollectiveProbe(TorchDispatchMode):
    """Watches what a tensor subclass's ``__torch_dispatch__`` runs underneath.

    Note [Subclasses hide collectives]
        The tracer sees ``aten.tanh(DTensor)``; DTensor's own dispatch then may
        redistribute (issue collectives) before the local op. Replaying the recorded
        op would issue those collectives again in backward. So ops with subclass
        arguments (``types`` non-empty; plain tensors pass an empty tuple) run under
        this probe, and one that issued a collective is recorded as a side effect.
        The probe answers ``NotImplemented`` for DTensor-typed calls: DTensor's
        handler then runs *with the probe still active*, so the probe sees the ops it
        issues underneath (a mode that handled the call itself would be popped while
        the subclass runs, and would see nothing). Other subclasses (fake tensors of
        DTensor's sharding propagation, AsyncCollectiveTensor, TwoTensor...) are run
        directly: the probe only looks through DTensor.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self) -> None:
        super().__init__()
        self.hit: Any = None

    @_skip_dynamo
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if types and _DTensor is not None and any(issubclass(t, _DTensor) for t in types):
            return NotImplemented
        if self.hit is None:
            info = _INFO.get(id(func)) or op_info(func)
            if info.side_effect in _COMMUNICATING:
                self.hit = func
        return func(*args, **(kwargs or {}))

