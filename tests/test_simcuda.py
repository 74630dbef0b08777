"""The simulated CUDA (tests/_simcuda.py) itself: it must fail on the hazards it exists
to catch and pass their synchronised forms, or the stream tests prove nothing."""

from __future__ import annotations

import pytest
import torch
from _simcuda import SimCuda

import ac2_dist as ac
from ac2_dist import _streams


def _read_on_side_then_free(sync: str) -> SimCuda:
    with SimCuda() as sim:
        side = sim.new_stream()
        a = torch.randn(64)  # a kernel on the default stream: allocated there
        side.wait_stream(sim.default)
        with sim.use(side):
            b = a * 2  # read on the side stream
        if sync == "wait":
            sim.default.wait_stream(side)
        elif sync == "record_stream":
            sim.record_stream(a, side)
        elif sync == "host":
            sim.synchronize()
        del a  # freed into the default stream's pool
        c = torch.empty(64)  # the next allocation on the default stream
        del b, c
    return sim


def test_unsynchronised_cross_stream_free_fails():
    sim = _read_on_side_then_free("none")
    assert sim.stats.unsynchronised_frees == 1
    assert sim.stats.reused >= 1  # the model handed the block to the next default-stream allocation
    with pytest.raises(AssertionError, match="unsynchronised cross-stream free") as err:
        sim.check()
    assert "allocated on default" in str(err.value) and "used on stream1 by aten.mul.Tensor" in str(err.value)
    assert "reused that block" in str(err.value)


@pytest.mark.parametrize("sync,counter", [("wait", "guarded_by_wait"), ("record_stream", "guarded_by_record_stream"),
                                          ("host", "guarded_by_wait")])
def test_a_wait_or_record_stream_makes_the_free_safe(sync, counter):
    sim = _read_on_side_then_free(sync)
    sim.check()
    assert sim.stats.cross_stream_frees == 1 and getattr(sim.stats, counter) == 1


def test_record_stream_defers_reuse_until_the_stream_waits():
    with SimCuda() as sim:
        side = sim.new_stream()
        a = torch.randn(64)
        side.wait_stream(sim.default)
        with sim.use(side):
            b = a + 1
        sim.record_stream(a, side)
        del a
        reused = sim.stats.reused
        c = torch.empty(64)
        assert sim.stats.reused == reused  # still pending: the side stream's read may be queued
        sim.default.wait_stream(side)
        d = torch.empty(64)
        assert sim.stats.reused == reused + 1
        del b, c, d
    sim.check()


def test_unordered_read_of_a_side_stream_result_fails():
    with SimCuda() as sim:
        side = sim.new_stream()
        x = torch.randn(8)
        side.wait_stream(sim.default)
        with sim.use(side):
            y = x.exp()  # written on the side stream
        z = y + 1  # read on the default stream with no wait_event: unordered
        del x, y, z
    with pytest.raises(AssertionError, match="unordered access: aten.add.Tensor"):
        sim.check()
    sim2 = SimCuda()
    with sim2:
        side = sim2.new_stream()
        x = torch.randn(8)
        side.wait_stream(sim2.default)
        with sim2.use(side):
            y = x.exp()
        sim2.default.wait_event(side.record_event())
        z = y + 1
        sim2.record_stream(y, sim2.default)
        del x, y, z
    sim2.check()


def test_host_memory_is_the_hosts():
    """Pinned host buffers are host memory (not ``on_device``; their free is not the device
    allocator's); an op on host memory alone runs on the host, in program order."""
    with SimCuda() as sim:
        copy = sim.new_stream()
        buf = sim.host_buffer(32)
        x = torch.randn(8)
        copy.wait_stream(sim.default)
        with sim.use(copy):
            buf.view(torch.float32).copy_(x, non_blocking=True)  # a device->host copy on the copy stream
        sim.default.wait_stream(copy)
        del x  # a device block read on the copy stream: freed after the wait
        copy.synchronize()
        assert buf.view(torch.float32).sum().item() != 0  # the host reads it after synchronising
        del buf  # pinned memory: not checked as a device free
        y = sim.host_buffer(32)
        y.view(torch.float32).fill_(1)  # host work, now
        z = y * 2  # host work again: after the fill in program order
        assert not sim.on_device(y) and not sim.on_device(z) and sim.on_device(torch.ones(1))
        del z
    sim.check()
    assert sim.stats.unsynchronised_frees == 0 and sim.stats.unordered_accesses == 0


# ---- the blind spots of issue 48: each program races on a GPU, and the checker flags it ----------


@pytest.mark.parametrize("how", ["resize_", "set_"])
@pytest.mark.parametrize("safe", [False, True])
def test_a_free_without_the_storage_dying(how, safe):
    """FSDP2 frees an unsharded parameter with ``untyped_storage().resize_(0)``: the storage
    lives on, its memory is back in the allocator's pool. Freed while another stream still
    reads it, the next allocation may take it (``set_`` dropping the last reference to a
    storage is the same hazard through the storage dying)."""
    with SimCuda() as sim:
        side = sim.new_stream()
        a = torch.randn(1024)
        side.wait_stream(sim.default)
        with sim.use(side):
            b = a * 2  # read on the side stream
        if safe:
            sim.default.wait_stream(side)
        if how == "resize_":
            a.untyped_storage().resize_(0)
        else:
            a.set_(torch.empty(0))
        c = torch.empty(1024)  # the next allocation on the default stream
        del b, c
    if safe:
        sim.check()
    else:
        assert sim.stats.unsynchronised_frees == 1
        with pytest.raises(AssertionError, match="unsynchronised cross-stream free"):
            sim.check()


def test_a_resize_from_zero_allocates_on_the_current_stream():
    with SimCuda() as sim:
        side = sim.new_stream()
        a = torch.randn(256)
        a.untyped_storage().resize_(0)
        with sim.use(side):
            a.untyped_storage().resize_(1024)  # FSDP2's unshard on its all-gather stream
            a.fill_(1.0)
        sim.default.wait_stream(side)
        b = a + 1
        block = sim.blocks[a.untyped_storage()._cdata]
        assert block.stream is side and block.nbytes == 1024
        del b
    sim.check()


@pytest.mark.parametrize("sync", ["none", "event", "blocking copy"])
def test_a_host_read_of_a_copy_in_flight(sync):
    """A device->host copy with ``non_blocking=True`` is still running when the host reads
    the buffer, unless the host synchronised with it (or the copy was blocking)."""
    with SimCuda() as sim:
        copy = sim.new_stream()
        buf = sim.host_buffer(32)
        x = torch.randn(8)
        copy.wait_stream(sim.default)
        with sim.use(copy):
            buf.view(torch.float32).copy_(x, non_blocking=sync != "blocking copy")
        if sync == "event":
            copy.record_event().synchronize()
        buf.view(torch.float32).sum()  # the host reads the pinned buffer
        copy.synchronize()
        del x
    if sync == "none":
        with pytest.raises(AssertionError, match=r"read a block .* \(no synchronize\)"):
            sim.check()
    else:
        sim.check()


@pytest.mark.parametrize("sync", [False, True])
def test_a_host_write_of_a_buffer_a_copy_still_reads(sync):
    """Rewriting a pinned buffer while the host->device copy that reads it is queued."""
    with SimCuda() as sim:
        copy = sim.new_stream()
        buf = sim.host_buffer(32)
        buf.view(torch.float32).fill_(1.0)
        with sim.use(copy):
            dev = torch.empty(8)
            dev.copy_(buf.view(torch.float32), non_blocking=True)
        if sync:
            copy.synchronize()
        buf.view(torch.float32).fill_(2.0)  # the host writes it again
        sim.default.wait_stream(copy)
        del dev
    if sync:
        sim.check()
    else:
        with pytest.raises(AssertionError, match="still reads on copy|stream1"):
            sim.check()


def test_record_stream_of_host_memory_is_an_error():
    with SimCuda() as sim:
        side = sim.new_stream()
        buf = sim.host_buffer(64)
        sim.record_stream(buf, side)
        del buf
    with pytest.raises(AssertionError, match="record_stream of host memory"):
        sim.check()


@pytest.mark.parametrize("wait", [False, True])
def test_another_threads_kernels_are_seen(wait):
    """A kernel another thread queues (autograd's device thread, a prefetch thread) is
    checked like any other: here it writes on the side stream what the main thread then
    reads on the default stream."""
    import threading

    with SimCuda() as sim:
        side = sim.new_stream()
        a = torch.randn(8)
        side.wait_stream(sim.default)

        def work() -> None:
            with sim.use(side):
                a.mul_(2)

        th = threading.Thread(target=work)
        th.start()
        th.join()
        if wait:
            sim.default.wait_stream(side)
        b = a + 1
        del b
    if wait:
        sim.check()
    else:
        with pytest.raises(AssertionError, match=r"aten.add.Tensor .* read a block .* aten.mul_.Tensor wrote on stream1"):
            sim.check()


def test_regions_take_the_simulation_for_cuda(simcuda):
    """Inside the simulation a region gets the side-stream executor; a ``with`` region is
    never prefetched, so its backward replays inline on the consuming stream and makes no
    side stream (Note [Nothing waits behind another unit] in replay.py). Outside, the same
    region gets the inline executor."""
    x = torch.randn(4, 4, requires_grad=True)
    assert _streams.region_streams(False) is simcuda
    with ac.apply_ac_policy("recompute_all") as region:
        y = x.sin().tanh().sum()
    assert type(region.graph.executor).__name__ == "SideStreamExecutor"
    y.backward()
    assert simcuda.stats.streams_created == 0 and simcuda.stats.cross_stream_uses == 0


def test_outside_the_simulation_cpu_regions_replay_inline():
    assert _streams.region_streams(False) is None
    x = torch.randn(4, 4, requires_grad=True)
    with ac.apply_ac_policy("recompute_all") as region:
        x.sin().sum()
    assert type(region.graph.executor).__name__ == "InlineExecutor"


@pytest.mark.parametrize("broken,kind", [
    ("guard_read", "unsynchronised cross-stream free"),  # issue 39 item 2: the code before the fix
    ("side waits for the consumer", "unsynchronised cross-stream free|unordered access"),
    ("wait_event", "unordered access"),
])
def test_the_checker_catches_a_side_stream_executor_missing_a_guard(monkeypatch, broken, kind):
    """Each guard of Note [Tensors that cross streams] taken out of the executor in turn:
    the simulation fails the run (save the matmuls of 4 Llama blocks, CUDA defaults)."""
    import torch.nn.functional as F
    from models import Llama, LlamaBlock

    from ac2_dist.replay import SideStreamExecutor

    if broken == "guard_read":
        monkeypatch.setattr(SideStreamExecutor, "_read_on_side", lambda self, value: None)
    elif broken == "wait_event":
        monkeypatch.setattr(SideStreamExecutor, "hand_over", lambda self, value, ready: value)
    else:  # a replay that does not first wait for the consumer: what its reads left in the side pool
        def prefetch(self, graph, node, idx):  # SideStreamExecutor.prefetch without side.wait_stream
            from ac2_dist.replay import _MISSING_VALUE

            value = graph._existing(node, idx)
            if value is not _MISSING_VALUE:
                return value, graph.side_ready
            side = self._side()
            self._waits_for = self._streams.current_stream()
            with self._streams.use(side):
                value = self._realize(graph, node, idx)
            graph.side_ready = ready = side.record_event()
            return value, ready

        monkeypatch.setattr(SideStreamExecutor, "prefetch", prefetch)
    torch.manual_seed(0)
    model = ac.apply_ac(Llama(vocab=64, dim=32, layers=4, heads=4), [torch.ops.aten.mm.default], modules=[LlamaBlock])
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    with SimCuda() as sim:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    with pytest.raises(AssertionError, match=kind):
        sim.check()
