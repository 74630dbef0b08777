"""The one place that reads FSDP2 (``fully_shard``) state.

ac2_dist needs three facts from FSDP2: which modules are FSDP units, which tensors
are a unit's unsharded parameters, and whether a unit is currently unsharded; and one
action: unshard a unit. They go through FSDP2's public ``FSDPModule`` API where it
exists (``unshard``) and through the private state below otherwise, so a torch upgrade
that moves FSDP2 internals touches this file only.
"""

# Note [FSDP units are region boundaries]
#     Inside a bare region that encloses FSDP unit calls (one ``apply_ac_policy``
#     around a whole FSDP model), the outputs of every unit are saved. Recompute
#     therefore never runs past a unit boundary: the ops a handle of unit U replays
#     read U's parameters only, and U is unsharded while its backward runs (FSDP's
#     pre-backward), so no unit is gathered early or twice. A policy that says
#     MUST_RECOMPUTE for the op producing a unit output overrides this (the replay may
#     then need another unit's parameters: see Note [Replays unshard what they read]).
#     Inside a checkpointed *module* (``apply_ac``/``wrap``; e.g. a block whose
#     attention and MLP are their own units) unit outputs are not saved: the module
#     keeps only its inputs, as torch's checkpoint does, and a replay that reads a
#     nested unit's parameters unshards it first (it is gathered once, a little earlier
#     than FSDP's own pre-backward would have). That is also what a checkpointed module
#     around a whole FSDP model does: its first replay unshards every unit.
#
# Note [FSDP's own ops are not structure]
#     FSDP2 runs ops of its own inside a nested unit's forward hooks: the all-gather and
#     its copy-in / copy-out, and on a unit's first unshard only, the allocation of the
#     all-gather outputs and the ``as_strided`` views that become the unsharded
#     parameters (``FSDPParam.init_all_gather_outputs`` / ``init_unsharded_param``).
#     They are collectives, ``fsdp::`` copies, allocations and views of FSDP's buffers,
#     never a value the module computes, and which of them run depends on FSDP's state.
#     A memory budget matches its plans on the structure of a module's own computation
#     (budget.py), so it leaves them out: FSDP wraps each phase in a
#     ``torch.profiler.record_function`` scope named ``FSDP::...`` (a dispatched op pair,
#     ``profiler::_record_function_enter_new`` / ``_record_function_exit``, profiler or
#     not), and every op inside such a scope is FSDP's own, except in the scopes where
#     FSDP transforms the module's inputs or outputs (:data:`_FSDP_DATA_SCOPES`: device
#     moves and mixed-precision casts), whose ops are the module's data. (The pre-forward
#     scope also holds the views of the unit's inputs that hook its post-backward: views,
#     which no plan saves either way.)
#
# Note [Replays unshard what they read]
#     Leaves that are a unit's unsharded parameters remember their unit. When a replay
#     takes such a leaf while the unit is resharded, it first calls the unit's
#     ``unshard()`` (a blocking all-gather into the same parameter storage); FSDP's own
#     pre-backward then finds the unit unsharded and does not gather again, and its
#     post-backward reshards as usual. FSDP preserves the parameters' version counters
#     across its all-gathers, so the version check of saved values still holds. A
#     prefetch paced by bytes issues the all-gather earlier, where it starts
#     (``unshard(async_op=True)``); the replay's ``unshard()`` then only waits for it and
#     copies the parameters out (Note [A prefetch holds one unit's values ahead] in
#     _prefetch.py).

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # torch built without distributed
    FSDPModule = None  # type: ignore[assignment,misc]

__all__ = ["is_fsdp_unit", "unsharded_params", "is_unsharded", "is_gathered_or_gathering", "ensure_unsharded",
           "own_ops_scope"]

# See Note [FSDP's own ops are not structure].
#: FSDP profiler scopes whose ops compute the module's data.
_FSDP_DATA_SCOPES = ("FSDP::inputs_to_device", "FSDP::cast_forward_inputs", "FSDP::cast_forward_outputs")


def is_fsdp_unit(module: nn.Module) -> bool:
    """True if ``fully_shard`` was applied to ``module`` (it owns a parameter group)."""
    return FSDPModule is not None and isinstance(module, FSDPModule) and _group(module) is not None


def _group(module: nn.Module) -> Any:
    state = module._get_fsdp_state()
    return getattr(state, "_fsdp_param_group", None)


def unsharded_params(module: nn.Module) -> list[torch.Tensor]:
    """The unit's unsharded parameters (the tensors its forward reads), if created."""
    group = _group(module)
    if group is None:
        return []
    return [fp._unsharded_param for fp in group.fsdp_params if hasattr(fp, "_unsharded_param")]


def collective_buffers(module: nn.Module) -> tuple[Any, int] | None:
    """The unit's shard process group and the bytes of the larger of its two collective
    buffers, the all-gather output (its parameters' padded shards times the group size,
    in the all-gather dtype) and the reduce-scatter input (the same count in the reduce
    dtype), as FSDP2's ``foreach_all_gather`` / ``foreach_reduce`` allocate them. None
    if ``module`` is not an FSDP unit."""
    group = _group(module) if is_fsdp_unit(module) else None
    if group is None:
        return None
    info = group.mesh_info
    world = info.shard_mesh_size
    numel = widest = 0
    for fp in group.fsdp_params:
        numel += fp.padded_sharded_param_size.numel()
        orig = getattr(fp, "orig_dtype", None) or fp.sharded_param.dtype
        param = getattr(fp, "param_dtype", None) or orig  # set at FSDP's lazy init (the first forward)
        dtypes = (param, getattr(fp, "reduce_dtype", None) or param)
        widest = max([widest] + [d.itemsize for d in dtypes if d is not None])
    return info.shard_process_group, numel * world * widest


@contextlib.contextmanager
def pipelined_backward(module: nn.Module) -> Iterator[None]:
    """One microbatch's backward under a pipeline schedule, as torch.distributed.pipelining's
    ``PipelineStage`` runs it around an FSDP2 root ``module``: no gradient sync, no reshard
    after backward, not the last backward. Nothing for another module."""
    # See Note [A pipeline stage's step] in _sim/_pipeline.py.
    if FSDPModule is not None and isinstance(module, FSDPModule):
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False)
        module.set_requires_gradient_sync(False)
    yield


def finish_pipelined_backward(module: nn.Module) -> None:
    """After a pipeline step's last microbatch: what ``PipelineStage`` does for an FSDP2
    root ``module`` -- the flags back, every unit's post-backward (its reduce-scatter and
    reshard), the root's final callback."""
    if FSDPModule is None or not isinstance(module, FSDPModule):
        return
    from torch.distributed.fsdp import fully_shard

    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)  # type: ignore[attr-defined]
    for unit_state in state._state_ctx.all_states:
        groups = getattr(unit_state, "_fsdp_param_groups", None)  # torch >= 2.12; one group before
        if groups is None:
            groups = [g] if (g := getattr(unit_state, "_fsdp_param_group", None)) is not None else []
        for group in groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def is_unsharded(module: nn.Module) -> bool:
    group = _group(module)
    return group is None or group.is_unsharded


def is_gathered_or_gathering(module: nn.Module) -> bool:
    """The unit's parameters are unsharded, or an all-gather of them has been issued and
    not waited for yet (``unshard(async_op=True)``)."""
    group = _group(module)
    return group is not None and (group.is_unsharded or getattr(group, "_all_gather_result", None) is not None)


def ensure_unsharded(unit_ref: weakref.ref) -> bool:
    """Unshard the unit if it is resharded (before a replay reads its parameters).

    Returns True if this call issued (or waited for) the unshard.
    """
    # See Note [Replays unshard what they read].
    module = unit_ref()
    if module is None or is_unsharded(module):
        return False
    module.unshard()  # async_op=False: returns once the parameters hold their data
    return True


def own_ops_scope(name: Any) -> bool | None:
    """For a ``record_function`` scope name: ``None`` if it is not an FSDP scope, else
    whether the ops inside it are FSDP's own rather than the module's computation."""
    # See Note [FSDP's own ops are not structure].
    if type(name) is not str or not name.startswith("FSDP::"):
        return None
    return not name.startswith(_FSDP_DATA_SCOPES)
