"""ac2_dist: graph-traced activation checkpointing for (distributed) PyTorch.

Instead of re-running your Python forward in backward (``torch.utils.checkpoint``),
ac2_dist records the ATen ops a region runs and, in backward, replays only the ops whose
outputs autograd needs, starting from the nearest saved values. Side effects
(collectives, FSDP ops, in-place writes into inputs or buffers, random ops unless
``rng="replay"``) are never replayed. It never keeps more than torch's checkpoint keeps,
and gradients are eager's.

Quick start::

    import ac2_dist as ac

    ac.apply_ac(model, "recompute_all", modules=[Block])   # every Block checkpointed
    loss = model(x).sum()
    loss.backward()                                        # replays only what it needs

Entry points (``help(ac2_dist.<name>)`` for each):

Checkpointing
    apply_ac, wrap, unwrap, is_checkpointed -- checkpoint modules in place (FSDP2-aware)
    apply_ac_policy, apply_ac_policy_fn, is_checkpoint_enabled -- a region as a
    ``with`` block or a function call
    checkpoint, checkpoint_sequential, checkpoint_with -- drop-ins for torch's
Policies
    CheckpointPolicy (torch's), PolicyContext, SAVE_WITH_HOOKS, tag_with_policy
    MemoryBudget -- ac2 chooses what to save: a memory fraction / bytes per block, or a
    peak target for the whole step (``MemoryBudget(peak="70GiB")``)
Scheduling
    ReplayConfig -- replay stream and prefetch depth; Offload -- asynchronous CPU offload
    register_side_effect -- an op of yours that must never be replayed
Reports
    memory.track, memory.gather, memory.format_table, memory.save_run, memory.load_run,
    memory.plot, memory.RankReport, memory.Tracker -- per-rank memory reports
    (``python -m ac2_dist.report run.json`` renders a saved run); GraphStats
torchrun
    distributed.shutdown -- end a torchrun script without gloo's abort at exit
Modules
    memory, offload, fsdp, distributed; ac2_dist.integrations.hf (Hugging Face),
    ac2_dist.integrations.torch_checkpoint (the switch for frameworks that call torch's
    checkpoint) are imported on demand.

``__version__`` is the installed distribution's version (``ac2-dist``).
"""

from ._compat import check_torch

check_torch()  # Note [Supported torch versions] (_compat.py)

from torch.utils.checkpoint import CheckpointPolicy  # noqa: E402

from . import distributed, fsdp, memory, offload  # noqa: E402
from ._dropin import checkpoint, checkpoint_sequential, checkpoint_with  # noqa: E402
from ._modules import apply_ac, is_checkpointed, unwrap, wrap  # noqa: E402
from ._policy import SAVE_WITH_HOOKS, PolicyContext  # noqa: E402
from ._region import apply_ac_policy, apply_ac_policy_fn, is_checkpoint_enabled, tag_with_policy  # noqa: E402
from ._trace._graph import GraphStats  # noqa: E402
from .budget import MemoryBudget  # noqa: E402
from .offload import Offload  # noqa: E402
from .replay import ReplayConfig  # noqa: E402
from .side_effects import register_side_effect  # noqa: E402

__all__ = [  # in the order of the docstring's groups (the API reference follows it)
    "apply_ac",
    "wrap",
    "unwrap",
    "is_checkpointed",
    "apply_ac_policy",
    "apply_ac_policy_fn",
    "is_checkpoint_enabled",
    "checkpoint",
    "checkpoint_sequential",
    "checkpoint_with",
    "CheckpointPolicy",
    "PolicyContext",
    "SAVE_WITH_HOOKS",
    "tag_with_policy",
    "MemoryBudget",
    "ReplayConfig",
    "Offload",
    "register_side_effect",
    "GraphStats",
    "memory",
    "distributed",
    "offload",
    "fsdp",
]


def _version() -> str:
    """The installed distribution's version; in a source checkout that was never
    installed (no metadata), the version its pyproject.toml declares."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ac2-dist")
    except PackageNotFoundError:
        pass
    import os
    import re

    pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    try:
        with open(pyproject, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return "0+unknown"
    found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return found.group(1) if found and 'name = "ac2-dist"' in text else "0+unknown"


__version__: str = _version()
