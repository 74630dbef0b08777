"""What ac2 sees in a CPU job on a GPU machine once CUDA is initialised.

torch.compile initialises CUDA on any machine with a GPU: dynamo saves and restores
the CUDA RNG state around every frame it converts (``torch.cuda.get_rng_state()``
when ``torch.cuda.is_available()``). From then on ``torch.cuda.is_available()`` and
``torch.cuda.is_initialized()`` are True in a job whose tensors are all on the CPU.

:func:`simulate` gives ac2_dist's own code that answer on a machine without a GPU:
the two functions answer True when called from a module of ``ac2_dist``, and the
truth to everyone else -- torch's own code (dynamo, inductor, the allocator's
Python functions), the tests and the launch scripts would otherwise take paths that
need a device there is none of, which says nothing about ac2. A decision of ac2's
that still read the process state would take its CUDA path for CPU tensors: a CUDA
stream for replays (which fails here), CUDA memory statistics (0 here), prefetch.

``pytest --simulate-cuda-initialised`` applies it in every worker (conftest.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

HAS_CUDA_DEVICE = torch.cuda.is_available()  # read before any simulation


def _for_ac2(real: Callable[[], bool]) -> Callable[[], bool]:
    def answer() -> bool:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return True if caller == "ac2_dist" or caller.startswith("ac2_dist.") else real()

    return answer


def simulate(mp: Any) -> None:
    """Apply it with ``mp`` (a ``pytest.MonkeyPatch``); undone by ``mp.undo()``."""
    mp.setattr(torch.cuda, "is_available", _for_ac2(torch.cuda.is_available))
    mp.setattr(torch.cuda, "is_initialized", _for_ac2(torch.cuda.is_initialized))
