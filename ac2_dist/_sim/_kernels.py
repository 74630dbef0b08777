"""Fake kernels torch's meta registrations refuse for dtypes the real kernels take.

Note [A fake kernel narrower than the real one]
    Under ``FakeTensorMode`` an op runs its meta function, which for some ops checks
    more than the eager kernels do: ``aten._grouped_mm`` (the default experts path of
    Hugging Face MoE models, Mixtral's among them) accepts bfloat16 only in its meta
    function, while the CPU kernel, and CUDA's fallback, take float32 and float16 too.
    A simulation of such a model in float32 died inside the fake step. :class:`NarrowFakes`
    answers those calls itself with the output the meta function would build for
    bfloat16 -- the same shape rules, the caller's dtype (``out_dtype`` if given) -- and
    records that it did, so the report can say so. Nothing else changes: the op's
    FLOPs and its output bytes are the op's; a call the meta function accepts goes to it.
    The mode costs a Python call per op (4 % of a tiny Llama's simulation), so a model
    whose floating parameters are all bfloat16 runs without it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__: list[str] = []

_GROUPED_MM = torch.ops.aten._grouped_mm.default if hasattr(torch.ops.aten, "_grouped_mm") else None


def _grouped_mm_out(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None,
                    out_dtype: torch.dtype | None) -> torch.Tensor:
    """The output ``aten._grouped_mm`` makes (torch's meta function's shape rules)."""
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        if offs is None:
            raise RuntimeError("aten._grouped_mm of two 2D matrices needs offs")
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a2:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    return torch.empty(size, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


class NarrowFakes(TorchDispatchMode):
    """Answers the calls a meta function refuses for a dtype the real kernel takes
    (Note [A fake kernel narrower than the real one]); ``used`` names them."""

    def __init__(self) -> None:
        super().__init__()
        self.used: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _GROUPED_MM and func is not None:
            mat_a, mat_b = args[0], args[1]
            if mat_a.dtype != torch.bfloat16 or mat_b.dtype != torch.bfloat16:
                offs = args[2] if len(args) > 2 else kwargs.get("offs")
                out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
                self.used.add(f"aten._grouped_mm in {str(mat_a.dtype).replace('torch.', '')}")
                return _grouped_mm_out(mat_a, mat_b, offs, out_dtype)
        return func(*args, **kwargs)
