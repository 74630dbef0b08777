"""Device streams: the few stream operations ac2's CUDA paths make, behind one object.

Note [Stream backends]
    Everything the replay executor (replay.py) and the offload copy engine (offload.py)
    do with streams goes through a :class:`StreamBackend`: make a stream, read and
    switch the current one, order one stream after another (``wait_stream``,
    ``record_event``, ``wait_event`` on the stream objects it returns), tell the
    caching allocator that a tensor is used on another stream (``record_stream``),
    allocate pinned host memory, and say whether a tensor lives on the device.
    :class:`CudaStreams` is ``torch.cuda``. The test suite plugs a simulated CUDA into
    the same seam (``tests/_simcuda.py``: CPU tensors, streams and events as vector
    clocks, a caching-allocator model that fails a test on a cross-stream use the
    real allocator would not order) with :func:`simulate`, for the calling thread, so
    the CPU suite runs the side-stream replays, the prefetch and the asynchronous
    offload a GPU runs.

    A region picks its backend once, when it is installed (:func:`region_streams`);
    its executor and its offload block keep it, so backward -- on whatever thread
    autograd runs it -- uses what forward chose.

Note [One side stream per device]
    Replays run on a side stream (``ReplayConfig(stream="auto")``). Every CUDA stream
    costs memory that is not given back while the process lives: torch caches a cuBLAS
    workspace per (handle, stream) -- 32 MiB on an H100 -- and the caching allocator
    keeps a pool of blocks per stream. So the side stream is made once per device and
    per thread that runs backward (:meth:`StreamBackend.side_stream`) and reused by
    every graph of every step. Autograd runs a CUDA backward on one worker thread per
    device, so a training loop has one replay side stream per GPU, made by its first
    backward; it lives as long as that thread (the cache is the backend's thread-local
    state), which for autograd's device threads is the process. A ``torch.cuda.Stream``
    passed as ``ReplayConfig(stream=...)`` is used as given. An ``Offload`` makes its
    own copy stream when it first copies and keeps it for the Offload's lifetime.

Note [What side streams cost]
    Memory, beside what inline replays hold, with the side stream and prefetch 1 (the CUDA
    defaults), as the simulated timeline prices it (tests/_simtime.py, with the caching
    allocator's model in _sim/_allocator.py; launch/bench_overlap.py prints it):

    - the side stream's cuBLAS workspace (32 MiB on Hopper), once per device;
    - its own allocator pool: a block the side stream freed serves only the side stream,
      so the two pools' peaks add up, each rounded to its segments (20 MiB for blocks over
      1 MiB, 2 MiB below);
    - the prefetched unit's values and its replay's temporaries, alive while the current
      unit's backward runs: what prefetching costs on any stream. On the side stream
      the prefetch is paced so that the current and the prefetched units' values
      together stay within one unit's (Note [A prefetch holds one unit's values ahead]
      in _prefetch.py): the side pool holds one unit's replay, not two;
    - the unsharded parameters a prefetch gathers, allocated on the side stream: the
      unit being consumed and the one prefetched;
    - so the side pool holds one unit's replay beside a compute pool that keeps torch's
      checkpoint's size (the backward's gradient temporaries find there the blocks torch's
      recompute would have freed): 8 Llama blocks of 1024, prefetch 1, compute pool 886
      MiB as torch's, side pool 386 (one unit's values 168 MiB allocated, two units'
      parameters 2 x 48, the workspace 32, the rest its segments' rounding). Gathering the
      parameters into the compute pool instead grew that pool by more than it saved
      (1752 MiB reserved against 1676: launch/results/bench_overlap_2026-11-29.md);
    - nothing held by ``record_stream`` for the values handed to the compute stream (Note
      [Tensors that cross streams] in replay.py): a hold lasts until the device reaches
      the free, and in a GPU-bound backward the host queues far ahead. Simulated, 4
      Llama blocks of 1024 under FSDP2: 1590 MiB reserved with the holds, 1366 without,
      856 inline (launch/bench_overlap.py's model; 921 and 713 MiB allocated).
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["StreamBackend", "CudaStreams", "CUDA", "region_streams", "simulate", "record_stream"]


class StreamBackend(abc.ABC):
    """The stream operations of a device. Subclasses give the device's operations;
    the side-stream cache is the same for all of them."""

    # See Note [Stream backends].

    def __init__(self) -> None:
        self._local = threading.local()  # per thread: {device index: side stream}

    def side_stream(self) -> Any:
        """This thread's replay side stream on the current device, made at its first
        use and reused after that: one side stream per device and thread."""
        # See Note [One side stream per device].
        cache = getattr(self._local, "side", None)
        if cache is None:
            cache = self._local.side = {}
        index = self.device_index()
        stream = cache.get(index)
        if stream is None:
            stream = cache[index] = self.new_stream()
        return stream

    @abc.abstractmethod
    def on_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in this backend's device memory."""

    @abc.abstractmethod
    def device_index(self) -> int:
        """The calling thread's current device."""

    @abc.abstractmethod
    def new_stream(self) -> Any:
        """A new stream on the current device."""

    @abc.abstractmethod
    def current_stream(self) -> Any:
        """The calling thread's current stream."""

    @abc.abstractmethod
    def use(self, stream: Any) -> Any:
        """A context manager making ``stream`` current."""

    @abc.abstractmethod
    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        """``t``'s memory is in use on ``stream``: the allocator reuses it, once freed,
        only after the work queued on ``stream`` by then is done."""

    @abc.abstractmethod
    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of pinned host memory (uint8)."""


class CudaStreams(StreamBackend):
    """``torch.cuda``'s streams, events and caching allocator."""

    def on_device(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def device_index(self) -> int:
        return torch.cuda.current_device()

    def new_stream(self) -> Any:
        return torch.cuda.Stream()

    def current_stream(self) -> Any:
        return torch.cuda.current_stream()

    def use(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        record_stream(t, stream)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def record_stream(t: torch.Tensor, stream: Any) -> None:
    """``t.record_stream(stream)``, into the inner tensors of a wrapper subclass (a
    DTensor's local shard) whose own ``record_stream`` would not reach the memory."""
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            record_stream(getattr(t, name), stream)
    else:
        t.record_stream(stream)


# See Note [One side stream per device].
#: The backend of CUDA tensors. Its only state is the per-thread side-stream cache.
CUDA = CudaStreams()


class _Override(threading.local):
    backend: StreamBackend | None = None


_OVERRIDE = _Override()  # per thread: a simulated backend a test installed (simulate)


def region_streams(on_cuda: bool) -> StreamBackend | None:
    """The stream backend a region installed now uses: a backend :func:`simulate`
    installed on this thread, else ``torch.cuda``'s when the region runs on CUDA, else
    None (CPU: no streams, replays inline)."""
    backend = _OVERRIDE.backend
    if backend is not None:
        return backend
    return CUDA if on_cuda else None


@contextlib.contextmanager
def simulate(backend: StreamBackend) -> Iterator[StreamBackend]:
    """Regions installed on this thread inside the block use ``backend`` as if they
    ran on CUDA (side-stream replays, prefetch by default, the offload schedule): the
    seam the CPU test suite's simulated CUDA plugs into."""
    # See Note [Stream backends].
    previous = _OVERRIDE.backend
    _OVERRIDE.backend = backend
    try:
        yield backend
    finally:
        _OVERRIDE.backend = previous
