"""ac2_dist: graph-traced activation checkpointing for (distributed) PyTorch.

Instead of re-running Python forward code in backward (``torch.utils.checkpoint``),
ac2_dist records the post-dispatch ATen ops of a region with a TorchDispatchMode and,
in backward, replays only the ops whose outputs autograd needs, starting from the
nearest saved values. Side effects (collectives, FSDP ops, in-place writes, random
ops unless ``rng="replay"``) are never replayed.

Quick start::

    import ac2_dist as ac

    with ac.apply_ac_policy("recompute_all"):
        y = block(x)
    y.sum().backward()

See ``help(ac2_dist.apply_ac_policy)`` and the README for policies and nesting.
"""

from ._compat import check_torch

check_torch()  # Note [Supported torch versions] (_compat.py)

from torch.utils.checkpoint import CheckpointPolicy  # noqa: E402

from . import fsdp, memory, offload  # noqa: E402
from ._dropin import checkpoint, checkpoint_sequential, checkpoint_with  # noqa: E402
from ._graph import GraphStats  # noqa: E402
from ._modules import apply_ac, is_checkpointed, unwrap, wrap  # noqa: E402
from ._policy import SAVE_WITH_HOOKS, PolicyContext  # noqa: E402
from ._region import apply_ac_policy, apply_ac_policy_fn, is_checkpoint_enabled, tag_with_policy  # noqa: E402
from .budget import MemoryBudget  # noqa: E402
from .offload import Offload  # noqa: E402
from .replay import ReplayConfig  # noqa: E402
from .side_effects import register_side_effect  # noqa: E402

__all__ = [
    "CheckpointPolicy",
    "GraphStats",
    "MemoryBudget",
    "Offload",
    "PolicyContext",
    "ReplayConfig",
    "SAVE_WITH_HOOKS",
    "apply_ac",
    "apply_ac_policy",
    "apply_ac_policy_fn",
    "checkpoint",
    "checkpoint_sequential",
    "checkpoint_with",
    "fsdp",
    "is_checkpoint_enabled",
    "is_checkpointed",
    "memory",
    "offload",
    "register_side_effect",
    "tag_with_policy",
    "unwrap",
    "wrap",
]

__version__ = "0.1.0"
