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


def test_host_buffers_are_ordered_but_not_device_blocks():
    with SimCuda() as sim:
        copy = sim.new_stream()
        buf = sim.host_buffer(32)
        x = torch.randn(8)
        copy.wait_stream(sim.default)
        with sim.use(copy):
            buf.view(torch.float32).copy_(x)  # written on the copy stream
        del buf  # a host buffer is not the device allocator's: its free is not checked
        sim.default.wait_stream(copy)
        del x  # a device block read on the copy stream: freed after the wait
        y = sim.host_buffer(32)
        y.view(torch.float32).add_(1)  # written on the default stream
        with sim.use(copy):
            z = y * 2  # read on the copy stream, which did not wait: unordered
        del z
    assert sim.stats.kernels > 0 and sim.stats.unsynchronised_frees == 0
    with pytest.raises(AssertionError, match="unordered access: aten.mul.Tensor"):
        sim.check()


def test_regions_take_the_simulation_for_cuda(simcuda):
    """Inside the simulation a region's executor runs replays on a simulated side stream
    (and hands the values over); outside, the same region replays inline."""
    x = torch.randn(4, 4, requires_grad=True)
    assert _streams.region_streams(False) is simcuda
    with ac.apply_ac_policy("recompute_all") as region:
        y = x.sin().tanh().sum()
    assert type(region.graph.executor).__name__ == "SideStreamExecutor"
    y.backward()
    assert simcuda.stats.streams_created == 1 and simcuda.stats.cross_stream_uses > 0


def test_outside_the_simulation_cpu_regions_replay_inline():
    assert _streams.region_streams(False) is None
    x = torch.randn(4, 4, requires_grad=True)
    with ac.apply_ac_policy("recompute_all") as region:
        x.sin().sum()
    assert type(region.graph.executor).__name__ == "InlineExecutor"


@pytest.mark.parametrize("broken,kind", [
    ("guard_read", "unsynchronised cross-stream free"),  # issue 39 item 2: the code before the fix
    ("record_stream", "unsynchronised cross-stream free"),
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
    else:
        def hand_over(self, value, ready):
            consumer = self._streams.current_stream()
            if broken != "wait_event":
                consumer.wait_event(ready)
            if broken != "record_stream" and isinstance(value, torch.Tensor):
                self._streams.record_stream(value, consumer)
            return value

        monkeypatch.setattr(SideStreamExecutor, "hand_over", hand_over)
    torch.manual_seed(0)
    model = ac.apply_ac(Llama(vocab=64, dim=32, layers=4, heads=4), [torch.ops.aten.mm.default], modules=[LlamaBlock])
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    with SimCuda() as sim:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    with pytest.raises(AssertionError, match=kind):
        sim.check()
