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

from torch.utils.checkpoint import CheckpointPolicy

from . import fsdp, memory
from ._graph import GraphStats
from ._modules import apply_ac, unwrap, wrap
from ._policy import SAVE_WITH_HOOKS, PolicyContext
from ._region import apply_ac_policy, apply_ac_policy_fn, is_checkpoint_enabled, tag_with_policy
from .replay import ReplayConfig
from .side_effects import register_side_effect

__all__ = [
    "CheckpointPolicy",
    "GraphStats",
    "PolicyContext",
    "ReplayConfig",
    "SAVE_WITH_HOOKS",
    "apply_ac",
    "apply_ac_policy",
    "apply_ac_policy_fn",
    "fsdp",
    "is_checkpoint_enabled",
    "memory",
    "register_side_effect",
    "tag_with_policy",
    "unwrap",
    "wrap",
]

__version__ = "0.1.0"
