"""Regression tests for issue 44: in-place writes through views, one section per cause
(A-I) the view-write fuzzer (tests/_view_fuzz.py) found, the two Hugging Face MoE
patterns that crashed (DeepseekV2 ``moe()``, NllbMoe's sparse MLP) and
``allow_cache_entry_mutation=True``.

Each case is a small function, legal eagerly and under torch's non-reentrant checkpoint,
run under ac2 with the C recorder and the Python one. :func:`check` asserts, in this
order: ac2 raises nothing; its outputs and every input gradient are eager's bitwise;
nothing allocated during the step is alive after it, with the cyclic collector off, and
the inputs, the outputs and the region's graph are freed (after backward, and after a
forward whose outputs are dropped without backward); it keeps no more bytes from the end
of forward to the start of backward than torch's checkpoint (from the allocator:
tests/_view_fuzz.py, Note [Kept bytes from the allocator, not from ac2]), where torch's
run reproduces eager's.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _view_fuzz import AllocatorTrace, bitwise_equal, quiet_profiler
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import ac2_dist as ac
from ac2_dist._trace._tracer import recording_in_python

aten = torch.ops.aten
STATE_BYTES = torch.get_rng_state().nbytes  # one CPU generator state (5,056 B)

# A case: ``make()`` returns (leaves, args, fn): the leaves whose gradients are compared,
# the region's arguments, and the region's function (its state captured, fresh per run).
Make = Callable[[], tuple[list[torch.Tensor], tuple, Callable]]


def _leaves(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


# ---- ways to run a region -----------------------------------------------------------


def eager(fn, args, box):
    return fn(*args)


def torch_full(fn, args, box):
    """torch's checkpoint. The cases without random ops keep no generator state there
    (ac2 has none to keep then, and 5 KB of slack would hide a literal kept)."""
    return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def torch_sac(ops):
    def call(fn, args, box):
        ctx = functools.partial(create_selective_checkpoint_contexts, list(ops))
        return torch_checkpoint(fn, *args, use_reentrant=False, context_fn=ctx)

    return call


def ac2_checkpoint(fn, args, box, **options):
    if options:
        return ac.checkpoint_with(**options)(fn, *args, use_reentrant=False)
    return ac.checkpoint(fn, *args, use_reentrant=False)


def ac2_region(policy, **options):
    def call(fn, args, box):
        with ac.apply_ac_policy(policy, **options) as region:
            out = fn(*args)
        if region.graph is not None:
            box["graph"] = weakref.ref(region.graph)
        return out

    return call


@dataclass
class Run:
    error: str | None = None
    outs: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    kept: int = 0
    kept_blocks: list = field(default_factory=list)
    leaked: int = 0
    alive: list = field(default_factory=list)


def _outputs(out: Any) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _to_host(t: torch.Tensor | None) -> Any:
    """A result as Python numbers, so that no tensor of the step outlives the trace."""
    return None if t is None else (t.dtype, t.detach().tolist())


def _from_host(v: Any) -> torch.Tensor | None:
    return None if v is None else torch.tensor(v[1], dtype=v[0])


def _loss(outs: tuple) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs if o.requires_grad)


def run(make: Make, call: Callable, *, backward: bool = True, python: bool = False, seed: int = 0) -> Run:
    """One step of ``make``'s function run by ``call``, inside an allocator trace with the
    cyclic collector off; what it raised, computed, kept and left behind."""
    got = Run()
    refs: list[tuple[str, weakref.ref]] = []
    box: dict = {}
    recorder = recording_in_python() if python else contextlib.nullcontext()
    gc.disable()
    try:
        with recorder, quiet_profiler(), AllocatorTrace() as trace:
            leaves, args, fn = make()
            refs += [(f"input {k}", weakref.ref(t)) for k, t in enumerate(leaves)]
            try:
                trace.mark("forward")
                torch.manual_seed(seed)
                outs = _outputs(call(fn, args, box))
                refs += [(f"output {k}", weakref.ref(o)) for k, o in enumerate(outs)]
                got.outs = [_to_host(o) for o in outs]
                loss = _loss(outs)
                trace.mark("backward")
                if backward:
                    torch.manual_seed(seed + 1)
                    got.grads = [_to_host(g) for g in torch.autograd.grad(loss, leaves, allow_unused=True)]
                del outs, loss
            except Exception as e:  # noqa: BLE001 - an exception is an outcome
                got.error = f"{type(e).__name__}: {e}"
                e.__traceback__ = None
                del e
            leaves = args = fn = None
            trace.mark("end")
        got.kept = trace.live["backward"] - trace.live["forward"] if "backward" in trace.live else 0
        got.kept_blocks = [(n, op) for n, op, born in trace.blocks.get("backward", []) if born == "forward"]
        got.leaked = trace.live["end"]
        got.outs = [_from_host(v) for v in got.outs]
        got.grads = [_from_host(v) for v in got.grads]
        if "graph" in box:
            refs.append(("the region's graph", box["graph"]))
        got.alive = [name for name, r in refs if r() is not None]
    finally:
        gc.enable()
    return got


def check(make: Make, ours: Callable, *, python: bool, reference: Callable = torch_full,
          compare_kept: bool = True) -> Run:
    """Every promise of the module docstring for ``make`` under ``ours`` (an ac2 way to
    run it) against eager and ``reference`` (a torch way); the first broken one fails."""
    want = run(make, eager)
    if want.error is not None:
        pytest.fail(f"the case is not legal eagerly: {want.error}")
    base = run(make, reference)
    if base.error is not None:
        pytest.fail(f"the case is not legal under torch's checkpoint: {base.error}")
    got = run(make, ours, python=python)
    if got.error is not None:
        pytest.fail(f"ac2 raises where torch's checkpoint runs: {got.error}")
    for what, a_list, b_list in (("output", want.outs, got.outs), ("grad", want.grads, got.grads)):
        for k, (a, b) in enumerate(zip(a_list, b_list)):
            if not bitwise_equal(a, b):
                diff = (a - b).abs().max().item() if a is not None and b is not None else "None vs a tensor"
                pytest.fail(f"{what} {k} differs from eager's: max abs {diff}")
    if got.leaked or got.alive:
        pytest.fail(f"after backward: {got.leaked} B allocated in the step still alive; alive: {got.alive}")
    dropped = run(make, ours, backward=False, python=python)
    if dropped.error is not None:
        pytest.fail(f"ac2 raises in a forward whose outputs are dropped: {dropped.error}")
    if dropped.leaked or dropped.alive:
        pytest.fail(f"outputs dropped without backward: {dropped.leaked} B allocated in the step still alive; "
                    f"alive: {dropped.alive}")
    torch_is_eager = all(bitwise_equal(a, b) for a, b in zip(want.outs + want.grads, base.outs + base.grads))
    if compare_kept and torch_is_eager and got.kept > base.kept:
        pytest.fail(f"ac2 keeps {got.kept} B from forward to backward, torch's checkpoint {base.kept} B; "
                    f"blocks made in forward and kept (bytes, allocating ops): ac2 {got.kept_blocks}, "
                    f"torch {base.kept_blocks}")
    return got


RECORDERS = pytest.mark.parametrize("python", [False, True], ids=["C_recorder", "python_recorder"])


# ---- A: a held value written through another alias ------------------------------------


def _a_region_input_written_through_its_view():
    """``b`` (a buffer the region reads, held for recompute: ``b * 2`` is replayed) is
    written through a view of it. README: a held value written in the region is copied
    before the write; the copy looked only at the written tensor object (the view)."""
    (x,) = _leaves((4, 6))
    b = torch.linspace(-1, 1, 24).view(4, 6)

    def fn(x):
        t = b * 2.0  # replayable read of b; t is saved by the mul below
        y = t * x
        b[0].zero_()  # write through a view of b
        return y

    return [x], (x,), fn


def _a_region_input_written_through_its_base():
    """The held value is a view the region is given (``tail``, a view of ``b`` made
    outside it, as a module keeps a view of its weight), written through the base."""
    (x,) = _leaves((3, 6))
    b = torch.linspace(-1, 1, 24).view(4, 6)
    tail = b[1:]

    def fn(x):
        y = (tail * 2.0) * x  # tail * 2.0 is replayed from tail
        b.mul_(0.5)  # write through the base
        return y

    return [x], (x,), fn


def _a_region_input_written_through_a_sibling_view():
    (x,) = _leaves((4, 3))
    b = torch.linspace(-1, 1, 24).view(4, 6)

    def fn(x):
        left = b[:, :3]
        y = (left * 2.0) * x
        b.t()[:3].add_(1.0)  # another view of b, overlapping ``left``
        return y

    return [x], (x,), fn


@RECORDERS
@pytest.mark.parametrize("make", [_a_region_input_written_through_its_view, _a_region_input_written_through_its_base,
                                  _a_region_input_written_through_a_sibling_view],
                         ids=["view", "base", "sibling_view"])
def test_A_held_value_written_through_another_alias(make, python):
    check(make, ac2_checkpoint, python=python)


def _a_policy_output_written_through_its_view():
    """A value the save list keeps (``x @ w``), read by a replayed op, then written
    through a view of it."""
    x, w, z = _leaves((4, 6), (6, 6), (4, 6))

    def fn(x, w, z):
        m = x @ w  # saved: mm is in the save list
        y = (m * 2.0) * z  # m * 2.0 is replayed from m
        m.t()[0].add_(1.0)  # write through a view of m
        return y, m

    return [x, w, z], (x, w, z), fn


@RECORDERS
def test_A_policy_output_written_through_its_view(python):
    # torch's selective checkpoint refuses the write (its cache entry is mutated), so the
    # case is checked against torch's plain checkpoint, where it is legal: no kept
    # comparison (the save list keeps m by request).
    check(_a_policy_output_written_through_its_view, ac2_region([aten.mm.default], rng="replay"), python=python,
          compare_kept=False)


# ---- B: a write through one output of a multi-output view op --------------------------


def _b_split_view_write(op):
    def make():
        (x,) = _leaves((4, 6))

        def fn(x):
            buf = torch.zeros(4, 6)
            part = {"unbind": lambda: buf.unbind(0)[1], "split": lambda: buf.split(2, 0)[0],
                    "chunk": lambda: buf.chunk(2, 1)[1], "split_with_sizes": lambda: buf.split_with_sizes([1, 3])[0]}[op]()
            part.fill_(2.0)  # needs no grad: eager's rule for a multi-output view
            return (buf * x).sin()

        return [x], (x,), fn

    return make


@RECORDERS
@pytest.mark.parametrize("op", ["unbind", "split", "chunk", "split_with_sizes"])
def test_B_write_through_one_output_of_a_multi_output_view(op, python):
    check(_b_split_view_write(op), ac2_checkpoint, python=python)


# ---- C: an in-place op whose other argument is its destination ------------------------


def _c_masked_scatter_from_itself():
    x, w = _leaves((4, 6), (6, 6))

    def fn(x, w):
        h = x @ w
        mask = torch.arange(24).view(4, 6) % 3 == 0
        h.masked_scatter_(mask, h)  # source is the destination
        return h.sin()

    return [x, w], (x, w), fn


@RECORDERS
def test_C_in_place_op_reading_its_own_destination(python):
    check(_c_masked_scatter_from_itself, ac2_checkpoint, python=python)


# ---- D: a buffer written through a view and read again: no cycle ---------------------


def _d_written_view_read_again():
    """The region makes ``m``, writes it through a view and reads it again; the output
    does not depend on it (backward never unpacks what reaches it)."""
    y, w = _leaves((4, 6), (6, 6))
    b = torch.linspace(-1, 1, 24).view(4, 6)

    def fn(y):
        route = F.one_hot(torch.arange(4) % 2, 2).to(y.dtype)
        m = torch.einsum("bm,be->ebm", b, route)
        for e in range(2):
            tok = route[:, e].bool()
            m[e, tok] = m[e, tok] @ w
        return y.sum(1)

    return [y, w], (y,), fn


@RECORDERS
def test_D_written_view_read_again_leaves_no_cycle(python):
    check(_d_written_view_read_again, ac2_checkpoint, python=python)


# ---- E: index_put_ into a buffer the region made -------------------------------------


def _e_index_put(form):
    def make():
        x, y = _leaves((4, 6), (4, 6))

        def fn(x, y):
            buf = torch.zeros(4, 6)
            if form == "index":
                idx = torch.arange(4).flip(0)
                buf[idx] = x.sin()
            elif form == "mask":
                mask = torch.arange(4) % 2 == 0
                buf[mask] = x[mask].sin()
            else:  # the MoE token scatter: buf[tok] += expert(x[tok])
                for e in range(2):
                    tok = torch.arange(4)[e::2]
                    buf[tok] += x[tok].sin() * (e + 1.0)
            return buf * y  # saves buf: torch recomputes it, ac2 kept it

        return [x, y], (x, y), fn

    return make


@RECORDERS
@pytest.mark.parametrize("form", ["index", "mask", "token_accumulate"])
def test_E_index_put_into_a_made_buffer_is_recomputed(form, python):
    check(_e_index_put(form), ac2_checkpoint, python=python)


# ---- F: a view write after an ordinary read ------------------------------------------


def _f_view_write_after_read():
    x, y = _leaves((4, 6), (4, 6))

    def fn(x, y):
        buf = x * 2.0
        z = buf + 1.0  # an ordinary (non-view) read of buf
        buf[1:].add_(y[1:])  # then a write through a view
        return buf * z

    return [x, y], (x, y), fn


@RECORDERS
def test_F_view_write_after_an_ordinary_read_is_recomputed(python):
    check(_f_view_write_after_read, ac2_checkpoint, python=python)


# ---- G: a view write whose derivative needs the old value ----------------------------


def _g_old_value_write(op):
    def make():
        x, y = _leaves((4, 6), (4, 6))

        def fn(x, y):
            buf = x * 2.0
            view = buf[1:]
            if op == "mul_":
                view.mul_(y[1:])  # y requires grad: autograd keeps view's old value
            elif op == "clamp_":
                view.clamp_(-0.5, 0.5)
            elif op == "sin_":
                view.sin_()
            else:
                view.div_(y[1:].abs() + 1.0)
            return buf * y

        return [x, y], (x, y), fn

    return make


@RECORDERS
@pytest.mark.parametrize("op", ["mul_", "clamp_", "sin_", "div_"])
def test_G_view_write_needing_the_old_value_is_recomputed(op, python):
    check(_g_old_value_write(op), ac2_checkpoint, python=python)


# ---- H: tensors the region's Python makes outside the dispatcher ---------------------


def _h_outside(form):
    def make():
        x, y = _leaves((4, 6), (4, 6))

        def fn(x, y):
            if form == "index_literal":
                idx = torch.tensor([2, 0, 3])  # a routing table built in the layer
                return x[idx] * y[:3]  # index's backward keeps idx
            if form == "mask_literal":
                mask = torch.tensor([True, False, True, True])
                return x[mask].sin() * y[:3]
            buf = x * 1.0  # setitem of a scalar, in a loop
            for i in range(4):
                buf[i, 0] = 0.5
            return buf * y

        return [x, y], (x, y), fn

    return make


@RECORDERS
@pytest.mark.parametrize("form", ["index_literal", "mask_literal", "setitem_scalar_loop"])
def test_H_tensors_made_outside_the_dispatcher_are_not_kept(form, python):
    check(_h_outside(form), ac2_checkpoint, python=python)


# ---- I: one generator state per region -----------------------------------------------


def _i_random_ops():
    x, y = _leaves((4, 6), (4, 6))

    def fn(x, y):
        a = x * torch.randn_like(x)  # saved by the save list
        b = F.dropout(a, 0.5, training=True)  # replayed: its generator state
        c = F.dropout(b * y, 0.5, training=True)
        return c

    return [x, y], (x, y), fn


@RECORDERS
def test_I_one_generator_state_per_region_with_a_saved_random_op(python):
    save = [aten.randn_like.default]
    got = check(_i_random_ops, ac2_region(save, rng="replay"), python=python, reference=torch_sac(save))
    states = sum(1 for size, _ in got.kept_blocks if size == STATE_BYTES)
    assert states == 1, f"{states} generator states kept from forward to backward: {got.kept_blocks}"


# ---- what the fixed fuzz budget found after A-I: literals written, shape-only reads, ---
# ---- random ops nobody needs ----------------------------------------------------------


def _literal_written(via_view: bool):
    """A literal Python made in the region, written in place (directly or through its
    view) and read again: a value the region made, replayed; the read after a write
    through its view sees the written bytes (fuzzer seeds 7, 94)."""

    def make():
        x, y = _leaves((4,), (4,))

        def fn(x, y):
            s = torch.tensor([0.5, 1.0, 2.0, 3.0])
            if via_view:
                s[1:3].mul_(y.detach()[:2])
            else:
                s.copy_(y.detach()).sin_()
            return (x * s).sin()

        return [x, y], (x, y), fn

    return make


@RECORDERS
@pytest.mark.parametrize("via_view", [False, True], ids=["direct", "through_a_view"])
def test_literal_written_in_place_is_replayed_and_read_as_written(via_view, python):
    check(_literal_written(via_view), ac2_checkpoint, python=python)


def _shape_only_read_of_a_written_input():
    """``b`` (captured state) read only for its shape, then written through a view: no
    copy of ``b`` is needed, torch keeps none (fuzzer class J, seed 36)."""
    (x,) = _leaves((4, 6))
    b = torch.linspace(-1, 1, 24).view(4, 6)

    def fn(x):
        t = b.new_zeros((4, 6)) + torch.empty_like(b).fill_(0.5)
        y = (t * x).sin()
        b[:, :3].mul_(0.5)
        return y

    return [x], (x,), fn


@RECORDERS
def test_an_argument_read_for_its_shape_is_neither_kept_nor_copied(python):
    check(_shape_only_read_of_a_written_input, ac2_checkpoint, python=python)


def _unused_random_op_reading_a_written_input():
    """A dropout whose output the program drops, reading ``b`` that a later write changes:
    nothing replays it, so neither it nor the copy of ``b`` stays (fuzzer seed 50)."""
    (w,) = _leaves((4, 6))
    b = torch.linspace(-1, 1, 24).view(4, 6)

    def fn(w):
        r = w * torch.randn_like(w)
        F.dropout(b, 0.3, training=True)  # output dropped
        b[..., ::2].fill_(0.75)
        return r

    return [w], (w,), fn


@RECORDERS
def test_random_ops_nobody_needs_leave_their_chain(python):
    check(_unused_random_op_reading_a_written_input, ac2_region("recompute_all", rng="replay"), python=python,
          reference=_torch_with_rng_state)


def _torch_with_rng_state(fn, args, box):
    return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)


def _partial_overlap(kind: str):
    """A write whose other argument is another view of the written storage, overlapping
    the destination in part: forward reads elements the same op already wrote (eager
    allows it; the result depends on that). The replay must read the same memory it
    writes, not an unaliased copy (fuzzer seed 6151: wrong gradients before)."""

    def make():
        (h,) = _leaves((4, 6))

        def fn(h):
            if kind == "split_view":
                t = torch.empty_like(h).fill_(0.5)
                t.split_with_sizes([1, 5], 1)[1].add_(t.reshape(-1)[:20].view(4, 5))
                return (t * h).unbind(0)[3]
            t = h * 2.0
            t[:, 1:].add_(t[:, :-1])  # a running shift: each column adds the one before it
            return t.sin()

        return [h], (h,), fn

    return make


@RECORDERS
@pytest.mark.parametrize("kind", ["split_view", "shift"])
def test_C_write_reading_a_view_that_overlaps_its_destination(kind, python):
    check(_partial_overlap(kind), ac2_checkpoint, python=python)


# ---- the Hugging Face patterns and allow_cache_entry_mutation ---------------------------


def _deepseek_v2_moe():
    """transformers 4.57.1 DeepseekV2MoE.moe (tokens sorted by expert, run per expert,
    scattered back into an empty buffer, weighted through a view of it)."""
    torch.manual_seed(0)
    T, D, E, K = 6, 8, 4, 2
    experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(D, 16), torch.nn.SiLU(), torch.nn.Linear(16, D))
                                  for _ in range(E))
    gate = torch.nn.Linear(D, E, bias=False)
    (x,) = _leaves((T, D), seed=3)
    params = [x, gate.weight] + [p for m in experts for p in m.parameters()]

    def moe(x):
        topk_weight, topk_idx = gate(x).softmax(-1).topk(K, dim=-1)
        cnts = topk_idx.new_zeros((topk_idx.shape[0], E))
        cnts.scatter_(1, topk_idx, 1)
        tokens_per_expert = cnts.sum(dim=0).tolist()
        idxs = topk_idx.view(-1).argsort()
        sorted_tokens = x[idxs // topk_idx.shape[1]]
        outputs, start = [], 0
        for i, n in enumerate(tokens_per_expert):
            if n:
                outputs.append(experts[i](sorted_tokens[start:start + n]))
                start += n
        outs = torch.cat(outputs, dim=0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        return (new_x.view(*topk_idx.shape, -1).type(topk_weight.dtype).mul_(topk_weight.unsqueeze(dim=-1))
                .sum(dim=1).type(new_x.dtype))

    return params, (x,), moe


def _nllb_moe_sparse_mlp():
    """transformers 4.57.1 NllbMoeSparseMLP.forward (top-1 routing): per expert,
    ``masked[idx, tok] = expert(masked[idx, tok])`` into an einsum-made buffer."""
    torch.manual_seed(0)
    T, D, E = 6, 8, 3
    experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(D, 16), torch.nn.ReLU(), torch.nn.Linear(16, D))
                                  for _ in range(E))
    router = torch.nn.Linear(D, E, bias=False)
    (x,) = _leaves((T, D), seed=4)
    params = [x, router.weight] + [p for m in experts for p in m.parameters()]

    def sparse_mlp(hidden):
        probs = router(hidden).softmax(-1)
        router_mask = F.one_hot(probs.argmax(-1), E).to(hidden.dtype)
        masked = torch.einsum("bm,be->ebm", hidden, router_mask)
        for idx, expert in enumerate(experts):
            token_indices = router_mask[:, idx].bool()
            weights = probs[token_indices, idx]
            expert_output = expert(masked[idx, token_indices])
            masked[idx, token_indices] = torch.einsum("b,be->be", weights, expert_output)
        return masked.sum(dim=0)

    return params, (x,), sparse_mlp


HF_PATTERNS = pytest.mark.parametrize("make", [_deepseek_v2_moe, _nllb_moe_sparse_mlp], ids=["deepseek_v2", "nllb_moe"])
ALLOW_CASES = pytest.mark.parametrize(
    "make", [_deepseek_v2_moe, _nllb_moe_sparse_mlp, _a_region_input_written_through_its_view],
    ids=["deepseek_v2", "nllb_moe", "A_view"])


@RECORDERS
@HF_PATTERNS
def test_hf_moe_pattern_matches_eager_and_keeps_no_more_than_torch(make, python):
    check(make, ac2_checkpoint, python=python)


@RECORDERS
@ALLOW_CASES
def test_allow_cache_entry_mutation_never_gives_wrong_gradients(make, python):
    """Either eager's gradients, or a clear error that does not suggest the option."""
    want = run(make, eager)
    got = run(make, functools.partial(ac2_checkpoint, allow_cache_entry_mutation=True), python=python)
    if got.error is not None:
        if "ac2_dist" not in got.error or "allow_cache_entry_mutation=True" in got.error:
            pytest.fail(f"not a clear refusal: {got.error}")
        return
    for k, (a, b) in enumerate(zip(want.grads, got.grads)):
        if not bitwise_equal(a, b):
            pytest.fail(f"allow_cache_entry_mutation=True gives a wrong gradient {k}: "
                        f"max abs {(a - b).abs().max().item()}")


def _written_after_the_region(x, allow: bool | None):
    """(``allow=None``: eager.) A buffer the region fills with ``index_put_`` and reads (``buf * 3.0`` is replayed
    from it), written in place after the region: eager's gradient does not depend on
    the write (sin keeps its own input)."""
    eager_run = allow is None
    region = contextlib.nullcontext() if eager_run else ac.apply_ac_policy("recompute_all", allow_cache_entry_mutation=allow)
    with region:
        buf = torch.zeros(4, 6)
        buf[torch.arange(4).flip(0)] = x * 1.0
        y = (buf * 3.0).sin()
    buf.add_(1.0)
    return torch.autograd.grad(y.sum(), x)[0]


@pytest.mark.parametrize("allow", [False, True], ids=["default", "allow_cache_entry_mutation"])
def test_write_after_the_region_gives_eager_gradients_or_an_error_suggesting_nothing_wrong(allow):
    """Either eager's gradient, or an error; no error suggests an option that would give
    a wrong gradient, and the option never gives one."""
    x0 = torch.randn(4, 6, generator=torch.Generator().manual_seed(5))
    want = _written_after_the_region(x0.clone().requires_grad_(), None)
    try:
        got = _written_after_the_region(x0.clone().requires_grad_(), allow)
    except RuntimeError as e:
        wrong = _written_after_the_region(x0.clone().requires_grad_(), True) if not allow else None
        if "allow_cache_entry_mutation=True" in str(e) and wrong is not None and not bitwise_equal(wrong, want):
            pytest.fail(f"the error suggests allow_cache_entry_mutation=True, which gives a wrong gradient "
                        f"(max abs {(wrong - want).abs().max().item():.3g}): {e}")
        return
    if not bitwise_equal(got, want):
        pytest.fail(f"gradient differs from eager's: max abs {(got - want).abs().max().item():.3g}")


# ---- writes that overwrite all of a tensor (fuzzer seed 103617) ----------------------


def _state_overwritten_then_written_again():
    """A buffer filled from a captured value, then clamped in place and read: the fill is
    replayed into a new tensor, so neither the buffer nor a copy of it is kept (torch's
    checkpoint keeps nothing: its recompute writes the buffer again)."""
    (x,) = _leaves((4, 6))
    h = torch.linspace(-1, 1, 24).view(4, 6)
    b = torch.zeros(4, 6)

    def fn(x):
        b.copy_(h * x)
        b.clamp_(-0.5, 0.5)  # autograd keeps b's value before this write (a clone)
        return b.tanh() * x

    return [x], (x,), fn


def _accumulator_zeroed_then_filled():
    """An accumulator buffer reset with ``zero_`` and filled by ``index_add_`` each step."""
    (x,) = _leaves((4, 6))
    acc = torch.full((4, 6), 3.0)

    def fn(x):
        acc.zero_()
        acc.index_add_(0, torch.tensor([3, 1, 2, 0]), x.sin())
        return (acc * x).cos()

    return [x], (x,), fn


def _filled_with_a_scalar_tensor():
    (x,) = _leaves((4, 6))
    b = torch.randn(4, 6)
    v = torch.tensor(0.25)

    def fn(x):
        b.fill_(v)
        b[1:].mul_(x[1:].detach())
        return (b * x).sum(0)

    return [x], (x,), fn


@RECORDERS
@pytest.mark.parametrize("make", [_state_overwritten_then_written_again, _accumulator_zeroed_then_filled,
                                  _filled_with_a_scalar_tensor])
def test_a_write_that_overwrites_is_replayed_into_a_new_tensor(make, python):
    check(make, ac2_checkpoint, python=python)


@RECORDERS
def test_an_overwritten_buffer_may_be_written_again_before_backward(python):
    """The next step (or micro-batch) writes the buffer before this one's backward: the
    graph holds nothing on it, so backward gives eager's gradients."""
    def step(region: bool) -> torch.Tensor:
        x = torch.linspace(-2, 2, 24).view(4, 6).requires_grad_()
        b = torch.zeros(4, 6)

        def fn(x):
            b.copy_(x.detach() * 0.5)
            return (b + x).sin()  # eager saves the sum, not b

        y = ac2_checkpoint(fn, (x,), {}) if region else fn(x)
        b.fill_(7.0)  # the next micro-batch's write
        return torch.autograd.grad(y.sum(), x)[0]

    with recording_in_python() if python else contextlib.nullcontext():
        got = step(True)
    assert bitwise_equal(got, step(False))


def test_the_fuzzer_does_not_take_a_recompute_from_written_state_as_a_reference():
    """Fuzzer seed 102380: the region reads ``h``, then writes it with the values it
    already has. Torch's recompute reads the written ``h`` (the same values by chance):
    its kept bytes are no reference. A write that overwrites all of the state before
    the region reads it (seed 103617) leaves the reference usable."""
    from _view_fuzz import generate, torch_recompute_is_faithful

    assert not torch_recompute_is_faithful(generate(102380))
    assert torch_recompute_is_faithful(generate(103617))
