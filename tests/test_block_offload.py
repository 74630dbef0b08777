"""The block boundary offloaded (issue 50; Note [Offloaded block inputs] in
ac2_dist/offload.py): ``Offload(block_inputs=True)`` moves each block's input -- what every
policy keeps, and at long context most of what checkpointing leaves on the device -- to
host memory on the offload schedule, and brings it back once per backward; saved-tensor
hooks around the blocks (``save_on_cpu``) move it as under torch's checkpoint.

Device memory is measured by the simulated CUDA (tests/_simcuda.py: live storages that are
not host buffers), independently of ac2's own reports; gradients are eager's bit for bit."""

from __future__ import annotations

import contextlib
import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from _models import assert_bitwise
from models import Llama, LlamaBlock
from torch.multiprocessing.reductions import StorageWeakRef

import ac2_dist as ac

aten = torch.ops.aten
LAYERS = 4
POLICIES = {
    "recompute_all": lambda: "recompute_all",
    "save_mm": lambda: [aten.mm.default],
    "budget": lambda: ac.MemoryBudget(0.5),
}


def _model(dim: int = 32, seq: int = 32) -> Llama:
    torch.manual_seed(0)
    return Llama(vocab=64, dim=dim, layers=LAYERS, heads=4, max_seq=seq)


def _tokens(seq: int = 32) -> torch.Tensor:
    return torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(0))


def _loss(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


def _grads(model: Llama, tokens: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _loss(model, tokens).backward()
    return [p.grad.clone() for p in model.parameters()]


class _Inputs:
    """A forward pre-hook on the blocks: a weak reference to each block's input storage."""

    def __init__(self, model: Llama) -> None:
        self.refs: list[StorageWeakRef] = []
        self.nbytes = 0
        for block in model.layers:
            block.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        x = args[0]
        self.refs.append(StorageWeakRef(x.untyped_storage()))
        self.nbytes = x.untyped_storage().nbytes()

    def alive(self) -> list[bool]:
        return [not r.expired() for r in self.refs]


@pytest.mark.parametrize("depth", [0, 1])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_block_inputs_leave_and_come_back_once(policy, depth):
    """CPU, the inline copy engine: the schedule a GPU runs. After forward only the last
    block's input is alive (the others were copied when the next block opened and
    dropped at the wait); backward copies each back once (Note [One copy back per
    backward]), with or without the prefetch; two steps, gradients bitwise eager's."""
    tokens = _tokens()
    eager = _grads(_model(), tokens)
    offload = ac.Offload(stream="inline", block_inputs=True)
    model = ac.apply_ac(_model(), POLICIES[policy](), modules=[LlamaBlock],
                        replay=ac.ReplayConfig(prefetch=depth, offload=offload))
    for step in range(2):
        inputs = _Inputs(model) if step == 0 else None
        model.zero_grad(set_to_none=True)
        loss = _loss(model, tokens)
        if inputs is not None:
            gc.collect()
            assert inputs.alive() == [False] * (LAYERS - 1) + [True]
        before = offload.stats.h2d_copies
        loss.backward()
        assert_bitwise(eager, [p.grad for p in model.parameters()])
        if policy == "recompute_all":  # the inputs are all it offloads
            assert offload.stats.h2d_copies - before == LAYERS - 1
    stats = offload.stats
    assert stats.units_committed == 2 * (LAYERS - 1) and stats.units_kept == 2
    if policy == "recompute_all":
        assert stats.d2h_copies == 2 * (LAYERS - 1) and stats.buffers_allocated == LAYERS - 1


def test_masks_parameters_and_inputs_without_grad_stay():
    """Only positional inputs that require grad are block inputs: the rotary tables the
    blocks are passed (buffers), a block called on an input without grad, and
    ``block_inputs=False`` offload nothing."""
    tokens = _tokens()
    off = ac.Offload(stream="inline", block_inputs=True)
    model = ac.apply_ac(_model(), "recompute_all", modules=[LlamaBlock], replay=ac.ReplayConfig(offload=off))
    _grads(model, tokens)
    assert off.stats.d2h_bytes == (LAYERS - 1) * 32 * 32 * 4  # one (1, 32, 32) fp32 input per block
    plain = ac.Offload(stream="inline")
    model = ac.apply_ac(_model(), "recompute_all", modules=[LlamaBlock], replay=ac.ReplayConfig(offload=plain))
    _grads(model, tokens)
    assert plain.stats.d2h_copies == 0
    assert ac.Offload.is_block_input(torch.ones(2, requires_grad=True))
    assert not ac.Offload.is_block_input(torch.nn.Parameter(torch.ones(2)))
    assert not ac.Offload.is_block_input(torch.ones(2))
    with pytest.raises(ValueError, match="block_inputs must be a bool"):
        ac.Offload(block_inputs=1)
    assert "block_inputs=True" in repr(off)


def test_pickle_keeps_block_inputs():
    import pickle

    assert pickle.loads(pickle.dumps(ac.Offload(2, block_inputs=True))).block_inputs


def test_create_graph_through_an_offloaded_input_is_refused_by_name():
    """The copy that comes back has no autograd history: a second-order backward through
    the block says so (eager's would differentiate through the input), and a first-order
    backward of the same program is eager's."""
    class Blk(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.lin(x)) * x

    torch.manual_seed(0)
    model = torch.nn.Sequential(Blk(), Blk())
    eager_model = copy.deepcopy(model)
    off = ac.Offload(stream="inline", block_inputs=True)
    ac.apply_ac(model, "recompute_all", modules=[Blk], replay=ac.ReplayConfig(offload=off))
    x0 = torch.randn(4, 8, requires_grad=True)
    (ge,) = torch.autograd.grad(eager_model(x0 * 2).sum(), x0)
    (g1,) = torch.autograd.grad(model(x0 * 2).sum(), x0)
    assert_bitwise([ge], [g1])
    h = model(x0 * 2)
    with pytest.raises(RuntimeError, match=r"block input \(offloaded to the CPU\) with its autograd history.*"
                                           r"Offload\(block_inputs=True\)"):
        torch.autograd.grad(h.sum(), x0, create_graph=True)


def _save_on_cpu_like(sim):
    """``torch.autograd.graph.save_on_cpu(pin_memory=True)``'s pack and unpack, into the
    simulated CUDA's host memory (torch's own would pin through the real CUDA)."""

    def pack(t):
        host = sim.host_buffer(t.untyped_storage().nbytes()).view(t.dtype)[: t.numel()].view(t.shape)
        host.copy_(t)
        return t.device, host

    def unpack(packed):
        device, host = packed
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype)
        out.copy_(host)
        return out

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


@pytest.mark.parametrize("how", ["offload", "hooks"])
def test_long_context_device_memory(how, simcuda):
    """A Llama-style 4-block model at a long sequence on the simulated CUDA, ``recompute_all``:
    the device bytes kept between forward and backward are at most one block's boundary
    and the working set -- with ``Offload(block_inputs=True)`` exactly that (the last
    block's input is read on the device), with save_on_cpu-style hooks around the forward
    less (they move everything autograd saves, as under torch); gradients are eager's,
    and the streams checker finds no unordered access."""
    seq, dim = 1024, 64
    tokens = _tokens(seq)
    eager = _grads(_model(dim, seq), tokens)

    def kept(offload: ac.Offload | None, hooks: bool) -> tuple[int, int, list[torch.Tensor]]:
        model = ac.apply_ac(_model(dim, seq), "recompute_all", modules=[LlamaBlock],
                            replay=ac.ReplayConfig(stream="auto", prefetch=1, offload=offload))
        _grads(model, tokens)  # every parameter seen by the simulation; the pool filled
        model.zero_grad(set_to_none=True)
        inputs = _Inputs(model)
        gc.collect()
        base = simcuda.device_bytes()
        with _save_on_cpu_like(simcuda) if hooks else contextlib.nullcontext():
            loss = _loss(model, tokens)
        gc.collect()
        held = simcuda.device_bytes() - base
        loss.backward()
        return held, inputs.nbytes, [p.grad for p in model.parameters()]

    plain, boundary, grads = kept(ac.Offload(), False)
    assert_bitwise(eager, grads)
    assert boundary == seq * dim * 4
    working_set = plain - LAYERS * boundary  # what recompute_all keeps beyond the boundaries
    if how == "offload":
        moved, _, grads = kept(ac.Offload(block_inputs=True), False)
        assert_bitwise(eager, grads)
        # The last block's input stays (read on the device) and the working set outside
        # the blocks (final norm, head and loss): exactly 3 boundaries left.
        assert moved == boundary + working_set, (plain, moved, boundary)
    else:
        moved, _, grads = kept(ac.Offload(), True)
        assert_bitwise(eager, grads)
        # The hooks around the forward move every block's input, and what autograd saves
        # outside the blocks as well (the working set): a few bytes stay (the loss).
        assert moved <= working_set and moved < boundary, (plain, moved, boundary)


@pytest.mark.parametrize("allowed", [True, False])
def test_a_peak_target_below_the_floor_offloads_the_block_inputs_first(allowed):
    """``MemoryBudget(peak=...)`` whose floor step is over the target, blocks on an offload
    schedule that keeps their inputs: the planner turns ``block_inputs`` on, warns saying
    so and measures the floor again (Note [Below the floor, the block inputs go first]);
    with ``offload_block_inputs=False`` the target is infeasible at once, as before."""
    import warnings

    tokens = _tokens()
    eager = _grads(_model(), tokens)
    offload = ac.Offload(stream="inline")
    budget = ac.MemoryBudget(peak=1, offload_block_inputs=allowed)
    model = ac.apply_ac(_model(), budget, modules=[LlamaBlock], replay=ac.ReplayConfig(offload=offload))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert_bitwise(eager, _grads(model, tokens))
    said = [str(w.message) for w in caught if "MemoryBudget" in str(w.message)]
    assert offload.block_inputs is allowed
    if allowed:
        assert any("Offload(block_inputs=True)" in m and "offload_block_inputs=False" in m for m in said), said
        assert offload.stats.d2h_copies > 0
    else:
        assert not any("block_inputs" in m for m in said) and offload.stats.d2h_copies == 0
    assert any("below" in m or "above the target" in m for m in said), said
    assert "offload_block_inputs=False" in repr(ac.MemoryBudget(peak=1, offload_block_inputs=False))
    with pytest.raises(TypeError, match="offload_block_inputs must be a bool"):
        ac.MemoryBudget(peak=1, offload_block_inputs="yes")
    import pickle

    assert not pickle.loads(pickle.dumps(ac.MemoryBudget(peak=1, offload_block_inputs=False)))._offload_block_inputs
