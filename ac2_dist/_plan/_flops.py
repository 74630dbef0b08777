"""FLOPs of one ATen op call, from ``torch.utils.flop_counter``'s formula registry: what
the recompute cost model (Note [Cost model] in _block_problem.py) and the benchmarks'
counters read.

Note [FLOPs torch's registry does not give]
    Two kinds of call have no usable formula in torch's registry, and both are common in
    the blocks ac2 plans:

    - CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu``, forward and
      backward) has no formula of its own: it is counted with the CUDA flash kernel's,
      which does the same q/k/v arithmetic on arguments in the same order
      (:data:`FLOP_ALIASES`).
    - Grouped-query attention (key and value with fewer heads than the query: Llama 3,
      Mistral, Qwen) under torch 2.10 and 2.11, whose attention formulas assert equal head
      counts (2.13's broadcast them). The kernel computes as if key and value were repeated
      to the query's heads, so the formula is called again with their shapes widened to
      the query's head count: the FLOPs torch 2.13 counts. Without this the call raised in
      the benchmarks' counter and counted 0 in the cost model, which then priced
      recomputing attention at its bytes alone.

    Any other formula that does not accept its arguments counts 0 FLOPs (the cost model
    prices the op by its bytes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

__all__: list[str] = []

_aten = torch.ops.aten

#: Ops without a formula of their own, counted with the formula of an op that does the
#: same arithmetic on arguments in the same order (Note [FLOPs torch's registry does not give]).
FLOP_ALIASES = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention,
}
if hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
    FLOP_ALIASES[_aten._scaled_dot_product_flash_attention_for_cpu_backward] = (
        _aten._scaled_dot_product_flash_attention_backward)

# The scaled_dot_product attention ops (arguments laid out (batch, heads, seq, dim)) and
# the position of the query among their arguments; key and value follow it.
_QUERY_AT = {f"_scaled_dot_product_{kind}_attention{end}": int(bool(end))
             for kind in ("flash", "efficient", "cudnn") for end in ("", "_backward")}


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any, strict: bool = False) -> int:
    """FLOPs of ``func(*args, **kwargs)`` returning ``out`` (0 for an op without a formula).
    A formula that does not accept the arguments counts 0, or raises if ``strict``."""
    packet = getattr(func, "_overloadpacket", None)
    if packet is None:
        return 0
    packet = FLOP_ALIASES.get(packet, packet)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:
        wide = _grouped_query(packet, args)
        if wide is not None:
            return int(formula(*wide, **kwargs, out_val=out))
        if strict:
            raise
        return 0


def _grouped_query(packet: Any, args: tuple) -> tuple | None:
    """``args`` with a grouped-query call's key and value shapes widened to the query's head
    count (Note [FLOPs torch's registry does not give]); None if this is not one. The
    formulas read shapes, so ``torch.Size`` stands in for the tensors."""
    q_at = _QUERY_AT.get(getattr(packet, "__name__", ""))
    if q_at is None or len(args) < q_at + 3:
        return None
    q, k, v = args[q_at:q_at + 3]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return None
    # (batch, heads, seq, dim): the layout of the scaled_dot_product ops' formulas.
    hq, hk = q.shape[1], k.shape[1]
    if hk == hq or hk == 0 or hq % hk != 0 or v.shape[1] != hk:
        return None
    k_wide = torch.Size((k.shape[0], hq, k.shape[2], k.shape[3]))
    v_wide = torch.Size((v.shape[0], hq, v.shape[2], v.shape[3]))
    return (*args[:q_at], q, k_wide, v_wide, *args[q_at + 3:])
