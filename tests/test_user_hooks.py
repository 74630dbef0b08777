"""Saved-tensor hooks around a region (issue 50 item 1; Note [The user's saved-tensor hooks] in
ac2_dist/_region.py): they see the tensors torch's checkpoint passes them -- the call's
positional tensor arguments, and with ``respect_saved_tensors_hooks=True`` every value the
region saves -- for the drop-in, modules checkpointed in place and the framework switch;
gradients are eager's bit for bit, and what the hooks move away leaves the region."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _models import assert_bitwise
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ac2_dist as ac
from ac2_dist.integrations import torch_checkpoint as switch

D = 64


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x))) * scale


class _Recorder:
    """Pack/unpack hooks that remember what they packed (by identity against ``watched``)
    and keep a copy of each packed value (``compress``: as bf16, what it holds is then
    measurable, and gradients are no longer eager's)."""

    def __init__(self, compress: bool = False) -> None:
        self.packed: list[tuple] = []
        self.unpacked = 0
        self.watched: list[torch.Tensor] = []
        self.compress = compress

    def pack(self, t: torch.Tensor):
        self.packed.append((tuple(t.shape), next((i for i, w in enumerate(self.watched) if w is t), None)))
        return (t.dtype, t.to(torch.bfloat16) if self.compress and t.is_floating_point() else t.clone())

    def unpack(self, packed) -> torch.Tensor:
        self.unpacked += 1
        dtype, t = packed
        return t.to(dtype)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _programs(packed: list[tuple]) -> list[tuple]:
    """What was packed of the program's tensors: torch 2.10's checkpoint also saves an
    empty placeholder tensor in front of each call's inputs (0 elements, none of the
    program's; later releases do not), which is left out."""
    return [p for p in packed if p != ((0,), None)]


def _blocks(n: int = 3) -> list[_Block]:
    torch.manual_seed(0)
    return [_Block() for _ in range(n)]


def _run(blocks, call, rec: _Recorder | None):
    """Forward through ``blocks`` (each through ``call(block, h, scale)``) inside ``rec``'s
    hooks; returns the gradients of the parameters and the input."""
    for b in blocks:
        b.zero_grad(set_to_none=True)
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(1)).requires_grad_()
    scale = torch.full((D,), 0.5)
    if rec is not None:
        rec.watched = [x, scale]
    with rec.hooks() if rec is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        h = x
        for b in blocks:
            h = call(b, h, scale)
    h.square().sum().backward()
    return [p.grad for b in blocks for p in b.parameters()] + [x.grad]


def _torch(block, h, scale):
    return torch_checkpoint(block, h, scale, use_reentrant=False)


def _ac2(block, h, scale):
    return ac.checkpoint(block, h, scale, use_reentrant=False)


def test_the_hooks_see_the_region_inputs_as_under_torch():
    """Legacy behaviour (``respect_saved_tensors_hooks`` unset): each call's positional
    tensor arguments go through the pack hook when the region opens, as torch's
    checkpoint saves them; nothing the region keeps itself does."""
    blocks = _blocks()
    eager = _run(blocks, lambda b, h, s: b(h, s), None)
    under = {}
    for name, call in (("torch", _torch), ("ac2", _ac2)):
        rec = _Recorder()
        got = _run(blocks, call, rec)
        assert_bitwise(eager, got)
        under[name] = (_programs(rec.packed), rec.unpacked > 0)
    assert under["ac2"] == under["torch"]
    assert len(under["torch"][0]) == 6 and under["torch"][0][0] == ((8, D), 0)  # x first, then scale, per block


def test_modules_checkpointed_in_place_pass_their_positional_inputs():
    """``apply_ac(model, modules=[Block])`` against torch's ``checkpoint_wrapper``
    (``checkpoint(module, *args)``): the hooks see the same tensors."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    eager_blocks = _blocks()
    eager = _run(eager_blocks, lambda b, h, s: b(h, s), None)
    wrapped = [checkpoint_wrapper(b) for b in _blocks()]
    rec_torch = _Recorder()
    assert_bitwise(eager, _run(wrapped, lambda b, h, s: b(h, s), rec_torch))
    mine = _blocks()
    for b in mine:
        ac.wrap(b, "recompute_all")
    rec = _Recorder()
    assert_bitwise(eager, _run(mine, lambda b, h, s: b(h, s), rec))
    assert rec.packed == _programs(rec_torch.packed) and len(rec.packed) == 6


def test_the_switch_passes_them_too():
    blocks = _blocks()
    eager = _run(blocks, lambda b, h, s: b(h, s), None)
    rec_torch = _Recorder()
    _run(blocks, _torch, rec_torch)
    rec = _Recorder()
    with switch.enabled(policy="recompute_all"):
        got = _run(blocks, _torch, rec)  # torch's entry point, ac2's region
    assert_bitwise(eager, got)
    assert rec.packed == _programs(rec_torch.packed)


def test_what_the_hooks_move_away_is_not_kept():
    """A pack that keeps a bf16 copy: the fp32 block inputs are not held by the region
    after forward (kept bytes from the allocator within 1 % of torch's checkpoint)."""
    from _models import step_memory

    class Chain(torch.nn.Module):
        def __init__(self, call):
            super().__init__()
            self.blocks = torch.nn.ModuleList(_blocks(4))
            self.call = call

        def forward(self, x):
            scale = torch.full((D,), 0.5)
            h = x
            for b in self.blocks:
                h = self.call(b, h, scale)
            return h

    x = torch.randn(256, D, generator=torch.Generator().manual_seed(1)).requires_grad_()
    kept = {}
    for name, call in (("torch", _torch), ("ac2", _ac2)):
        rec = _Recorder(compress=True)

        def loss(m, rec=rec):
            with rec.hooks():
                return m(x).square().sum()

        kept[name] = step_memory(Chain(call), loss, extra=(x,))
    assert_bitwise(kept["torch"]["grads"], kept["ac2"]["grads"])
    assert kept["ac2"]["kept"] <= kept["torch"]["kept"] * 1.01, kept


def test_respect_saved_tensors_hooks_true_routes_every_saved_value():
    """``respect_saved_tensors_hooks=True``: the values the region saves (here the matmul
    outputs a save-list keeps) go through the hooks too, beside the inputs; ``False``:
    the inputs only. Gradients are eager's."""
    blocks = _blocks()
    eager = _run(blocks, lambda b, h, s: b(h, s), None)
    save = [torch.ops.aten.addmm.default]
    packs = {}
    for respect in (False, True):
        rec = _Recorder()

        def call(b, h, s, respect=respect):
            return ac.checkpoint(b, h, s, use_reentrant=False, policy=save, respect_saved_tensors_hooks=respect)

        assert_bitwise(eager, _run(blocks, call, rec))
        packs[respect] = rec.packed
    assert len(packs[False]) == 6  # the inputs
    assert len(packs[True]) == 6 + 2 * 3  # and both addmm outputs of each block
    assert packs[True][:2] == packs[False][:2]


def test_no_hooks_no_change_and_nested_regions_pack_once():
    """Without user hooks nothing is packed; inside an enclosing ac2 region (whose hooks
    are ac2's own) the inner call packs nothing either."""
    blocks = _blocks()
    eager = _run(blocks, lambda b, h, s: b(h, s), None)
    assert_bitwise(eager, _run(blocks, _ac2, None))
    rec = _Recorder()

    def nested(b, h, s):
        with ac.apply_ac_policy("recompute_all"):
            return ac.checkpoint(b, h, s, use_reentrant=False)

    with rec.hooks():
        got = _run(blocks, nested, None)
    assert_bitwise(eager, got)
    # The outer ac2 region's hooks are on top: the user's see none of the inner calls' inputs,
    # only the loss's square, outside every region.
    assert rec.packed == [((8, D), None)]


@pytest.mark.parametrize("respect", [None, False, True])
def test_save_on_cpu_around_the_drop_in(respect):
    """torch's own ``save_on_cpu`` around ac2's checkpoint, every setting of the option."""
    blocks = _blocks()
    eager = _run(blocks, lambda b, h, s: b(h, s), None)
    for b in blocks:
        b.zero_grad(set_to_none=True)
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(1)).requires_grad_()
    scale = torch.full((D,), 0.5)
    with torch.autograd.graph.save_on_cpu():
        h = x
        for b in blocks:
            h = ac.checkpoint(b, h, scale, use_reentrant=False, respect_saved_tensors_hooks=respect)
    h.square().sum().backward()
    assert_bitwise(eager, [p.grad for b in blocks for p in b.parameters()] + [x.grad])


@pytest.mark.skipif("respect_saved_tensors_hooks" not in __import__("inspect").signature(torch_checkpoint).parameters,
                    reason=f"torch {torch.__version__}'s checkpoint has no respect_saved_tensors_hooks (torch >= 2.14)")
def test_respect_true_packs_what_torchs_selective_checkpoint_packs():
    """Against torch's own opt-in (torch >= 2.14; CI step 5): with a save list, the same
    tensors reach the pack hook, in the same order, under ac2 and under torch's selective
    checkpoint."""
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    save = [torch.ops.aten.addmm.default]
    blocks = _blocks()
    eager = _run(blocks, lambda b, h, s: b(h, s), None)
    torch_rec, rec = _Recorder(), _Recorder()
    contexts = functools.partial(create_selective_checkpoint_contexts, save)
    assert_bitwise(eager, _run(blocks, lambda b, h, s: torch_checkpoint(
        b, h, s, use_reentrant=False, context_fn=contexts, respect_saved_tensors_hooks=True), torch_rec))
    assert_bitwise(eager, _run(blocks, lambda b, h, s: ac.checkpoint(
        b, h, s, use_reentrant=False, policy=save, respect_saved_tensors_hooks=True), rec))
    assert rec.packed == torch_rec.packed and len(rec.packed) == 12
