"""The process state of a CPU job on a GPU machine once CUDA is initialised.

torch.compile initialises CUDA on any machine with a GPU: dynamo saves and restores
the CUDA RNG state around every frame it converts (``torch.cuda.get_rng_state()``
when ``torch.cuda.is_available()``). From then on ``torch.cuda.is_available()`` and
``torch.cuda.is_initialized()`` are True in a job whose tensors are all on the CPU.
:func:`simulate` makes this process look so on a machine without a GPU: both answer
True, and the RNG-state calls dynamo makes answer with a fixed state (there is no
device to hold one). Nothing else of ``torch.cuda`` works: a CPU job that takes a
CUDA path for CPU tensors (a CUDA stream, CUDA memory statistics) fails.

``pytest --simulate-cuda-initialised`` applies it in every worker (conftest.py).
"""

from __future__ import annotations

from typing import Any

import torch

HAS_CUDA_DEVICE = torch.cuda.is_available()  # read before any simulation


def simulate(mp: Any) -> None:
    """Apply it with ``mp`` (a ``pytest.MonkeyPatch``); undone by ``mp.undo()``."""
    mp.setattr(torch.cuda, "is_available", lambda: True)
    mp.setattr(torch.cuda, "is_initialized", lambda: True)
    if not HAS_CUDA_DEVICE:
        mp.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.zeros(16, dtype=torch.uint8))
        mp.setattr(torch.cuda, "set_rng_state", lambda new_state, device="cuda": None)
