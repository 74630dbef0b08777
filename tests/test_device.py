"""Note [The device comes from the tensors] (ac2_dist/_device.py): whether a region,
a checkpointed module, memory.track or a peak target takes a CUDA path is decided by
the devices of the tensors it sees, never by ``torch.cuda.is_initialized()``. Here a
CPU job runs as on a GPU machine after torch.compile initialised CUDA
(tests/_cuda_initialised.py): CPU regions replay inline, prefetch nothing, track CPU
memory (non-zero figures), plan a peak target from CPU allocations; gradients are
eager's bitwise. The whole suite runs so too with ``--simulate-cuda-initialised``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _cuda_initialised import HAS_CUDA_DEVICE, simulate
from _models import assert_bitwise
from models import GPTBlock, GPTStack

import ac2_dist as ac
from ac2_dist._device import CPU, cuda_device_of, device_of, module_cuda_device, recorded_device
from ac2_dist.replay import InlineExecutor


class _OnCuda(torch.Tensor):
    """A tensor that says it is on CUDA (no storage; nothing runs on it)."""

    @staticmethod
    def __new__(cls, *shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, device="cuda", dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def _as_ac2_sees_it() -> bool:
    probe = "torch.cuda.is_available() and torch.cuda.is_initialized()"
    return eval(probe, {"__name__": "ac2_dist._probe", "torch": torch})


@pytest.fixture
def cuda_initialised(monkeypatch):
    simulate(monkeypatch)
    assert _as_ac2_sees_it()  # what ac2's code is told; torch and the tests are told the truth
    assert HAS_CUDA_DEVICE or not torch.cuda.is_initialized()


def _model():
    torch.manual_seed(0)
    return GPTStack(3, 32, 4), torch.randn(2, 16, 32)


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_the_decision_reads_tensors():
    cpu = torch.zeros(2)
    assert cuda_device_of((cpu, [cpu]), {"k": cpu}) is None and device_of(cpu) == CPU
    gpu = _OnCuda(2)
    assert cuda_device_of((cpu, [gpu]), {}) == torch.device("cuda")  # any CUDA tensor decides
    assert cuda_device_of({"k": (cpu, gpu)}) == torch.device("cuda")
    m = nn.Linear(2, 2)
    assert module_cuda_device(m) is None and cuda_device_of(cpu, module=m) is None
    m.register_buffer("on_gpu", gpu)
    assert module_cuda_device(m) == torch.device("cuda") and device_of(module=m).type == "cuda"
    # a `with` block: its most recent live recorded tensors
    from ac2_dist._trace._nodes import TensorMap

    class _Graph:
        map = TensorMap()

    graph = _Graph()
    assert recorded_device(graph) == CPU
    graph.map.set(cpu, None, 0, None)
    assert recorded_device(graph) == CPU
    graph.map.set(gpu, None, 0, None)
    assert recorded_device(graph).type == "cuda"
    graph.map = None  # gone: nothing recorded is alive to say
    assert recorded_device(graph) == CPU


def test_cpu_modules_replay_inline_and_prefetch_nothing_with_cuda_initialised(cuda_initialised):
    base, x = _model()
    eager = _grads(copy.deepcopy(base), x)
    events = []
    model = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=[GPTBlock],
                        replay=ac.ReplayConfig(log=lambda event, fqn: events.append(event)))
    model.zero_grad(set_to_none=True)
    with ac.memory.track(model) as tracker:
        loss = model(x).square().mean()
        graphs = list(tracker.graphs)  # alive until backward
        loss.backward()
    got = [p.grad for p in model.parameters()]
    assert_bitwise(got, eager)
    assert "prefetch_start" not in events and "backward_start" in events  # prefetch depth 0: CPU
    assert graphs and all(isinstance(g.executor, InlineExecutor) and type(g.executor) is InlineExecutor
                          and g.device == CPU and g.offload is None for g in graphs)
    report = tracker.report()
    assert report.device == "cpu"
    assert report.peak_bytes_forward > 0 and report.peak_bytes_backward > 0 and report.saved_bytes > 0


def test_with_blocks_and_function_regions_decide_cpu_with_cuda_initialised(cuda_initialised):
    base, x = _model()
    eager = _grads(copy.deepcopy(base), x)
    model = copy.deepcopy(base)
    region = ac.apply_ac_policy("recompute_all")
    model.zero_grad(set_to_none=True)
    with ac.memory.track() as tracker:  # no model: the device of the regions it sees
        with region:
            loss = model(x).square().mean()
        loss.backward()
    assert region.graph.device == CPU and type(region.graph.executor) is InlineExecutor
    assert_bitwise([p.grad for p in model.parameters()], eager)
    report = tracker.report()
    assert report.device == "cpu" and report.peak_bytes_backward > 0
    model.zero_grad(set_to_none=True)
    ac.apply_ac_policy_fn(lambda m, t: m(t).square().mean(), model, x).backward()
    assert_bitwise([p.grad for p in model.parameters()], eager)


def test_a_peak_target_measures_cpu_steps_with_cuda_initialised(cuda_initialised):
    base, x = _model()
    budget = ac.MemoryBudget(peak="64MiB")
    model = ac.apply_ac(copy.deepcopy(base), budget, modules=[GPTBlock])
    for _ in range(3):
        _grads(model, x)
    planner = budget.peak_planner
    assert planner.device == CPU
    assert planner.floor_peak is not None and planner.floor_peak > 0, planner.describe()
    budget.close()
