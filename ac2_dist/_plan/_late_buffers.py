"""What a gloo job may hold beside its step: collective buffers gloo frees late.

Note [Collective buffers gloo frees late]
    gloo's all-gather gathers into a flat buffer of the output's size and its
    reduce-scatter reduces in a clone of its input; both are made on the calling thread
    when the collective is issued and belong to the collective's work object. The caller
    drops its handle once it has waited, but one of the process group's worker threads
    (``ProcessGroupGloo`` runs ``threads`` of them, 2 by default) holds the work until it
    takes the group's lock again after running it; on a loaded host that can be after
    the calling thread has run many more ops, so a buffer one step frees right after its
    wait another step frees late. Each worker holds at most one finished work, so at any
    moment at most ``threads`` such buffers of a group are alive past their wait.
    Measured on 2 and 4 gloo ranks on 2 cores (launch/bench_simulate.py, five HF models,
    FSDP2 per block): the same step's peak varied by zero, one or two blocks' buffers
    from run to run, never more.

    So a peak target on a gloo job is planned for the target less that bound: per gloo
    process group the FSDP units shard over, ``threads`` times its largest unit's
    buffer (:func:`late_collective_bytes`). The steps where no buffer is late use that
    much less than the target; none goes over it. The planner measures and corrects
    against the same reduced target (Note [Verify, correct, stay put] in _peak_verify.py), and
    a simulated gloo job (``ac2_dist.simulate`` on ``device="cpu"``) plans with the same
    bound, so a plan file's job keeps the plan.

    Tensor parallelism's collectives are not among them. A colwise/rowwise block (torch's
    ``parallelize_module``) all-reduces its rowwise outputs through functional
    collectives; measured on 4 gloo ranks (dp 2 x tp 2, the tests' tiny Llama, full AC,
    the allocator's frees made off the training thread over 3 steps a rank): only FSDP's
    buffers (427,008 and 524,800 B, a block's and the root's) and blocks of 4-8 B were
    freed there, never an all-reduce output (131,072 B, one activation), on any rank or
    step. tests/test_simulate_tp.py checks it on every run. Sequence parallelism is not
    simulated and was not measured. NCCL makes no such buffers (its
    collectives run in the tensors FSDP allocates, in stream order) and a CUDA step's
    allocated bytes are counted in the host's program order: the bound is 0 there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from ..fsdp import collective_buffers

__all__ = ["GLOO_THREADS", "late_collective_bytes"]

#: ProcessGroupGloo's default worker threads (a simulated gloo job; a group whose options cannot be read)
GLOO_THREADS = 2


def late_collective_bytes(modules: Iterable[nn.Module], threads: int | None = None) -> int:
    """Bytes of collective buffers gloo may hold past their wait at any moment of a step
    that runs ``modules``' FSDP units (Note [Collective buffers gloo frees late]): per
    gloo process group, its worker threads times its largest unit's buffer. ``threads``
    given: every group counts as gloo with that many workers (a simulated gloo job,
    whose process groups are fake); else groups of other backends count 0."""
    largest: dict[int, tuple[Any, int]] = {}
    seen: set[int] = set()
    for module in modules:
        if id(module) in seen:
            continue
        seen.add(id(module))
        found = collective_buffers(module)
        if found is None:
            continue
        pg, nbytes = found
        key = id(pg)
        if nbytes > largest.get(key, (pg, 0))[1]:
            largest[key] = (pg, nbytes)
    total = 0
    for pg, nbytes in largest.values():
        n = threads if threads is not None else _gloo_threads(pg)
        total += n * nbytes
    return total


def _gloo_threads(pg: Any) -> int:
    """The worker threads of ``pg``'s gloo backend; 0 if ``pg`` does not run gloo."""
    import torch.distributed as dist

    try:
        if dist.get_backend(pg) != "gloo":
            return 0
        backend = pg._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError, AttributeError):
        return 0
    threads = getattr(getattr(backend, "options", None), "_threads", None)
    return int(threads) if isinstance(threads, int) and threads > 0 else GLOO_THREADS
