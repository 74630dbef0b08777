"""The torch versions ac2_dist runs on, and the few names that differ between them.

Note [Supported torch versions]
    ac2_dist needs torch >= :data:`TORCH_FLOOR` (checked when ``ac2_dist`` is
    imported, with an error that names the version). Inside the supported range the
    differences are:

    - ``CheckpointPolicy.MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD`` exist from torch
      2.11. On older torch a policy cannot name them: the two names here are private
      placeholders no decision is identical to, :data:`CPU_OFFLOAD` is empty and the
      offload branches are never taken.
    - ``SelectiveCheckpointContext(op_output=...)`` exists from torch 2.12; ac2's
      context sets ``op_output`` itself (``_policy.PolicyContext``).

    CI runs the whole test suite on the floor as well as on the pinned torch.
"""

from __future__ import annotations

import warnings
from typing import Any

# Note [A silent import]
#     Without NumPy (torch does not need it, and neither does ac2: Note [Gather without
#     numpy] in _measure/_run_file.py) torch warns "Failed to initialize NumPy" from
#     inside its own import, and the warning is shown when torch is first imported by a
#     package rather than by the user's script: ``import ac2_dist`` printed it where
#     ``import torch`` prints nothing. ac2's import hides that one message, only while it
#     imports torch; nothing else is filtered, and nothing after.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch
    import torch.utils.checkpoint

__all__ = ["TORCH_FLOOR", "CPU_OFFLOAD", "MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD", "check_torch"]

TORCH_FLOOR = (2, 10)


def _release(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def check_torch(version: str = torch.__version__) -> None:
    """Raise ImportError naming the needed torch version if ``version`` is too old."""
    if _release(version) < TORCH_FLOOR:
        need = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(
            f"ac2_dist needs torch >= {need}, but torch {version} is installed; "
            f"upgrade it (pip install 'torch>={need}')"
        )


class _Absent:
    """A CheckpointPolicy member this torch does not have (never a policy's answer)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<CheckpointPolicy.{self.name}: not in torch {torch.__version__}>"


# Module level code must import on any torch: check_torch() runs after it.
_CP: Any = getattr(torch.utils.checkpoint, "CheckpointPolicy", None)
MUST_CPU_OFFLOAD: Any = getattr(_CP, "MUST_CPU_OFFLOAD", None) or _Absent("MUST_CPU_OFFLOAD")
PREFER_CPU_OFFLOAD: Any = getattr(_CP, "PREFER_CPU_OFFLOAD", None) or _Absent("PREFER_CPU_OFFLOAD")
CPU_OFFLOAD: frozenset[Any] = frozenset(
    p for p in (MUST_CPU_OFFLOAD, PREFER_CPU_OFFLOAD) if not isinstance(p, _Absent)
)
