"""``integrations.torch_checkpoint``: torch's own checkpoint entry points run by ac2 (issue 20).

Every entry point is called the way frameworks call it; each test checks that ac2 ran (the
checkpointed Python runs once per step: torch's checkpoint runs it twice), gradients are
eager's bitwise, and that ``disable()`` leaves torch's objects in place (identity)."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import threading
import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc
from _models import assert_bitwise, step_memory
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import ac2_dist as ac
from ac2_dist.integrations import torch_checkpoint as switch

# The generator torch's non-reentrant checkpoint calls by module lookup: renamed in
# torch 2.14 (the old name is a shim there that calls the new one).
_SEAM = ("_checkpoint_without_reentrant_generator_impl"
         if hasattr(tuc, "_checkpoint_without_reentrant_generator_impl") else "_checkpoint_without_reentrant_generator")
_TORCH = (tuc.checkpoint, tuc.checkpoint_sequential, getattr(tuc, _SEAM), tuc.CheckpointFunction,
          tuc._checkpoint_without_reentrant_generator)
_RESPECT_HOOKS = "respect_saved_tensors_hooks" in inspect.signature(tuc.checkpoint).parameters  # torch >= 2.14


class Block(nn.Module):
    """Linear -> dropout -> ReLU -> Linear with a Python side effect (a call counter)."""

    def __init__(self, d: int = 32, p: float = 0.3) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(d, 4 * d), nn.Dropout(p), nn.Linear(4 * d, d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.b(self.drop(self.a(x)).relu())


class Stack(nn.Module):
    def __init__(self, n: int = 3, d: int = 32, p: float = 0.3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, p) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x

    def calls(self) -> int:
        return sum(b.calls for b in self.blocks)


def _grads(model, x, run, seed=3):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    run(model, x).square().mean().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


def _plain(model, x):
    return model(x)


def _torch_objects_in_place() -> bool:
    from torch.distributed._composable import checkpoint_activation

    return (
        (tuc.checkpoint, tuc.checkpoint_sequential, getattr(tuc, _SEAM), tuc.CheckpointFunction,
         tuc._checkpoint_without_reentrant_generator) == _TORCH
        and getattr(checkpoint_activation, _SEAM) is _TORCH[2]
    )


@pytest.fixture(autouse=True)
def _switch_off_after():
    yield
    switch.disable()
    assert not switch.is_enabled() and _torch_objects_in_place()


def _blockwise(fn):
    """A Stack whose blocks each call ``fn(block, x)`` instead of ``block(x)``."""

    def run(model, x):
        for b in model.blocks:
            x = fn(b, x)
        return x

    return run


ENTRY_POINTS = {
    # torch.utils.checkpoint.checkpoint by attribute, use_reentrant unset / False
    "checkpoint-unset": _blockwise(lambda b, x: tuc.checkpoint(b, x)),
    "checkpoint-false": _blockwise(lambda b, x: tuc.checkpoint(b, x, use_reentrant=False)),
    # preserve_rng_state=False (accelerate's FSDP2 path): eager's gradients all the same
    "checkpoint-no-rng-state": _blockwise(lambda b, x: tuc.checkpoint(b, x, use_reentrant=False,
                                                                       preserve_rng_state=False)),
    "checkpoint-sequential": lambda m, x: tuc.checkpoint_sequential(nn.Sequential(*m.blocks), 3, x,
                                                                    use_reentrant=False),
}


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_entry_points_run_the_forward_once_with_eagers_gradients(name):
    run = ENTRY_POINTS[name]
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(8, 32)
    eager = _grads(model, x, _plain)
    model_calls = model.calls()
    torch_grads = _grads(model, x, run)
    assert model.calls() - model_calls > 3 or name == "checkpoint-sequential"  # torch re-runs the Python
    switch.enable()
    before = model.calls()
    with ac.memory.track() as tracker:
        got = _grads(model, x, run)
    segments = 2 if name == "checkpoint-sequential" else 3  # checkpoint_sequential runs its last chunk plainly
    assert model.calls() - before == 3 and len(tracker.graph_stats) == segments
    assert_bitwise(eager, got)
    if name != "checkpoint-no-rng-state":
        assert_bitwise(torch_grads, got)


def test_captured_function_objects_and_wrappers_are_routed():
    """``from torch.utils.checkpoint import checkpoint`` (transformers), a partial made
    before the switch (CheckpointWrapper), apply_activation_checkpointing, composable."""
    import transformers.modeling_utils as hf_modeling
    from torch.distributed._composable import checkpoint as composable

    torch.manual_seed(0)
    base = Stack()
    x = torch.randn(8, 32)
    eager = _grads(base, x, _plain)
    wrapped = copy.deepcopy(base)
    for i, b in enumerate(wrapped.blocks):
        wrapped.blocks[i] = checkpoint_wrapper(b)  # partial(torch's checkpoint) made now, before the switch
    applied = copy.deepcopy(base)
    apply_activation_checkpointing(applied, check_fn=lambda m: isinstance(m, Block))
    composed = copy.deepcopy(base)
    for b in composed.blocks:
        composable(b)
    captured = hf_modeling.checkpoint
    assert captured is _TORCH[0]
    runs = {
        "captured-name": (base, _blockwise(lambda b, x: hf_modeling.checkpoint(b, x, use_reentrant=False))),
        "captured-object": (base, _blockwise(functools.partial(captured, use_reentrant=False))),
        "checkpoint_wrapper": (wrapped, _plain),
        "apply_activation_checkpointing": (applied, _plain),
        "composable": (composed, _plain),
    }
    with switch.enabled():
        assert hf_modeling.checkpoint is not captured  # the captured name is routed
        for name, (model, run) in runs.items():
            blocks = [m for m in model.modules() if isinstance(m, Block)]
            before = sum(b.calls for b in blocks)
            with ac.memory.track() as tracker:
                got = _grads(model, x, run)
            assert sum(b.calls for b in blocks) - before == 3, name
            assert len(tracker.graph_stats) == 3, name
            assert_bitwise(eager, got)
    assert hf_modeling.checkpoint is captured


def test_checkpoint_without_a_function_behaves_as_torchs():
    """``checkpoint(use_reentrant=False)`` with no function: from torch 2.14 a decorator
    (its calls reach the generator torch looks up, so ac2 runs them, also for a decorator
    made before the switch went on); before 2.14 the error torch gives."""
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(8, 32)
    eager = _grads(model, x, _plain)
    if not _RESPECT_HOOKS:  # torch < 2.14: no decorator form; the routed call fails as torch's does
        with pytest.raises(TypeError) as torchs:
            tuc.checkpoint(use_reentrant=False)
        with switch.enabled(), pytest.raises(TypeError) as routed:
            tuc.checkpoint(use_reentrant=False)
        assert str(routed.value) == str(torchs.value)
        return
    made_before = [tuc.checkpoint(use_reentrant=False, preserve_rng_state=False)(b) for b in model.blocks]
    before = model.calls()
    _grads(model, x, lambda m, x: functools.reduce(lambda h, f: f(h), made_before, x))
    assert model.calls() - before == 6  # torch's: each block's Python runs again in backward
    with switch.enabled():
        made_inside = [tuc.checkpoint(use_reentrant=False)(b) for b in model.blocks]
        for blocks in (made_before, made_inside):
            before = model.calls()
            with ac.memory.track() as tracker:
                got = _grads(model, x, lambda m, x, bs=blocks: functools.reduce(lambda h, f: f(h), bs, x))
            assert model.calls() - before == 3 and len(tracker.graph_stats) == 3
            assert_bitwise(eager, got)


def test_respect_saved_tensors_hooks_runs_ac2_with_or_without_user_hooks():
    """torch >= 2.14's ``respect_saved_tensors_hooks``: True, False or unset, with user
    saved-tensor hooks in scope (``save_on_cpu``) or not, runs ac2 (its region packs what
    torch's would through those hooks: tests/test_user_hooks.py), with eager's gradients
    and no warning. Before 2.14 the name is an ordinary keyword argument of the
    checkpointed function, routed or not, as torch passes it."""
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(8, 32)
    eager = _grads(model, x, _plain)
    if not _RESPECT_HOOKS:
        seen = []

        def fn(h, respect_saved_tensors_hooks):
            seen.append(respect_saved_tensors_hooks)
            return model.blocks[0](h)

        tuc.checkpoint(fn, x, use_reentrant=False, respect_saved_tensors_hooks=True)
        with switch.enabled():
            tuc.checkpoint(fn, x, use_reentrant=False, respect_saved_tensors_hooks=True)
        assert seen == [True, True]
        return

    def run(respect, hooks):
        def step(m, x):
            with hooks():
                return _blockwise(lambda b, h: tuc.checkpoint(b, h, use_reentrant=False,
                                                              respect_saved_tensors_hooks=respect))(m, x)
        return step

    with switch.enabled():
        for respect, hooks in ((True, torch.autograd.graph.save_on_cpu), (False, torch.autograd.graph.save_on_cpu),
                               (None, torch.autograd.graph.save_on_cpu), (True, contextlib.nullcontext)):
            before = model.calls()
            with warnings.catch_warnings(record=True) as caught, ac.memory.track() as tracker:
                warnings.simplefilter("always")
                got = _grads(model, x, run(respect, hooks))
            ours = [w for w in caught if "respect_saved_tensors_hooks" in str(w.message)]
            assert model.calls() - before == 3, (respect, hooks)  # ac2 ran each block once
            assert len(tracker.graph_stats) == 3, (respect, hooks)
            assert not ours, (respect, hooks)
            assert_bitwise(eager, got)
        with pytest.raises(TypeError, match="respect_saved_tensors_hooks must be a bool or None"):
            tuc.checkpoint(model.blocks[0], x, use_reentrant=False, respect_saved_tensors_hooks="yes")


def test_the_switch_checks_that_torch_still_calls_its_seams():
    """Note [The switch checks that torch still calls its seams]: nothing to report on the
    installed torch (enable() warns nothing); a torch whose checkpoint calls a renamed
    generator, or whose composable checkpoint does, is reported."""
    from ac2_dist.integrations.torch_checkpoint import (
        _TORCH_CHECKPOINT,
        _import_composable,
        _unreached_seams,
    )

    assert _unreached_seams(_TORCH_CHECKPOINT, vars(tuc), _import_composable()) == []
    switch._BOARD.checked = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        switch.enable()
    switch.disable()
    assert switch._BOARD.checked
    seam = switch._GENERATOR_SEAM
    ns: dict = {}
    exec("def _renamed(fn): yield\n"
         "def checkpoint(fn, *args):\n    gen = _renamed(fn)\n    next(gen)\n    return fn(*args)\n"
         f"def {seam}(fn): yield\n"
         f"def _impl(fn, args):\n    return {seam}(fn)\n"
         "def checkpoint_via_impl(fn, *args):\n    return _impl(fn, args)\n", ns)
    composable = types.ModuleType("composable_calling_a_renamed_generator")
    composable.__dict__[seam] = switch._TORCH_SEAM_OBJECT
    exec("def checkpoint(module):\n    def hook(*a):\n        return _renamed(module)\n    return hook",
         composable.__dict__)
    problems = _unreached_seams(ns["checkpoint"], ns, composable)
    assert len(problems) == 2 and "checkpoint_wrapper" in problems[0] and "composable" in problems[1], problems
    assert _unreached_seams(ns["checkpoint_via_impl"], ns, None) == []  # one call deeper: reached


def test_selective_checkpoint_context_fn_is_honoured_fresh_per_call():
    made = []

    def context_fn():
        def policy(ctx, op, *args, **kwargs):
            return tuc.CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.addmm.default else \
                tuc.CheckpointPolicy.PREFER_RECOMPUTE

        made.append(policy)
        return create_selective_checkpoint_contexts(policy)

    torch.manual_seed(0)
    model = Stack(p=0.0)
    x = torch.randn(8, 32)
    eager = _grads(model, x, _plain)
    run = _blockwise(lambda b, x: tuc.checkpoint(b, x, use_reentrant=False, context_fn=context_fn))
    with switch.enabled(policy="must_save_all"):  # the framework's context_fn wins over the switch's policy
        with ac.memory.track() as tracker:
            got = _grads(model, x, run)
    assert_bitwise(eager, got)
    assert len(made) == 3 and len(set(map(id, made))) == 3
    # addmm saved, relu / dropout recomputed: some ops replayed (must_save_all would replay none)
    assert all(s.recomputed_ops > 0 for s in tracker.graph_stats)


def test_reentrant_calls_stay_torchs_unless_opted_in():
    torch.manual_seed(0)
    model = Stack(p=0.0)
    x = torch.randn(8, 32)
    eager = _grads(model, x, _plain)
    reentrant = _blockwise(lambda b, x: tuc.checkpoint(b, x, use_reentrant=True))
    kept_object = _blockwise(functools.partial(_TORCH[0], use_reentrant=True))
    x = x.requires_grad_()
    with switch.enabled():
        before = model.calls()
        assert_bitwise(eager, _grads(model, x, reentrant))
        assert model.calls() - before == 6  # torch's reentrant checkpoint re-ran the forward
    with switch.enabled(reentrant=True):
        for run in (reentrant, kept_object):
            before = model.calls()
            assert_bitwise(eager, _grads(model, x, run))
            assert model.calls() - before == 3


def test_dropout_without_rng_state_eagers_gradients_at_torchs_memory():
    """preserve_rng_state=False: torch draws new masks (other gradients); ac2 regenerates
    the forward's masks. It keeps what torch keeps with preserve_rng_state=True (the
    activations it needs, one generator state per region: 5 KB on CPU, 16 B on CUDA);
    torch with False keeps no state, only that."""
    torch.manual_seed(0)
    blocks, d = 4, 256
    model = Stack(n=blocks, d=d, p=0.5)
    x = torch.randn(64, d, requires_grad=True)

    def loss_of(preserve):
        run = _blockwise(lambda b, h: tuc.checkpoint(b, h, use_reentrant=False, preserve_rng_state=preserve))
        return lambda m: run(m, x).square().mean()

    eager = step_memory(model, lambda m: m(x).square().mean(), seed=5, extra=(x,))
    torch_false = step_memory(model, loss_of(False), seed=5, extra=(x,))
    torch_true = step_memory(model, loss_of(True), seed=5, extra=(x,))
    with switch.enabled():
        ac2_false = step_memory(model, loss_of(False), seed=5, extra=(x,))
    plain = step_memory(model, lambda m: _blockwise(lambda b, h: ac.checkpoint(b, h, preserve_rng_state=False))(
        m, x).square().mean(), seed=5, extra=(x,))
    state = torch.get_rng_state().numel()  # one CPU generator state per region
    print(f"\n  kept: eager {eager['kept']} torch(False) {torch_false['kept']} torch(True) {torch_true['kept']} "
          f"ac2 switch {ac2_false['kept']} ac.checkpoint {plain['kept']} "
          f"(ratio to torch(False) {ac2_false['kept'] / torch_false['kept']:.4f}); "
          f"peak: torch(False) {torch_false['peak']} ac2 {ac2_false['peak']}")
    assert_bitwise(eager["grads"], ac2_false["grads"])
    assert_bitwise(eager["grads"], plain["grads"])
    assert any(not torch.equal(a, b) for a, b in zip(eager["grads"], torch_false["grads"]))
    for got in (ac2_false, plain):
        assert got["kept"] <= torch_true["kept"]
        assert got["kept"] <= torch_false["kept"] + blocks * state
        assert got["peak"] <= torch_true["peak"]


def test_scopes_are_per_thread_nested_and_restored_after_an_exception():
    seen = {}
    inside = threading.Event()
    release = threading.Event()

    def other_thread():
        inside.wait(10)
        seen["other"] = switch.is_enabled()
        release.set()

    t = threading.Thread(target=other_thread)
    t.start()
    with switch.enabled(policy="must_save_all"):
        assert switch.is_enabled() and not _torch_objects_in_place()
        inside.set()
        assert release.wait(10)
        with switch.enabled(policy="recompute_all"):
            assert switch._BOARD.current().policy == "recompute_all"
        assert switch._BOARD.current().policy == "must_save_all"
    t.join(10)
    assert seen == {"other": False}
    assert _torch_objects_in_place()
    with pytest.raises(ZeroDivisionError):
        with switch.enabled():
            1 / 0  # noqa: B018
    assert not switch.is_enabled() and _torch_objects_in_place()


def test_enable_twice_and_bad_arguments():
    switch.enable(policy="recompute_all")
    switch.enable(policy="recompute_all")  # the same: nothing happens
    with pytest.raises(RuntimeError, match="already on with other arguments"):
        switch.enable(policy="must_save_all")
    with switch.enabled(policy="must_save_all"):  # a scope may differ
        assert switch._BOARD.current().policy == "must_save_all"
    assert switch.is_enabled()  # enable()'s options are still on
    switch.disable()
    switch.disable()
    assert not switch.is_enabled() and _torch_objects_in_place()
    with pytest.raises(ValueError, match="rng must be 'replay' or 'save'"):
        switch.enable(rng="new")
    with pytest.raises(ValueError, match="unknown policy string"):
        switch.enable(policy="save_some")
    with pytest.raises(TypeError, match="reentrant must be a bool"):
        with switch.enabled(reentrant="yes"):
            pass
    assert not switch.is_enabled() and _torch_objects_in_place()


def test_compiled_blocks_stay_torchs_under_the_switch():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack(p=0.0)
    x = torch.randn(8, 32)
    eager = _grads(model, x, _plain)
    run = torch.compile(_blockwise(lambda b, x: tuc.checkpoint(b, x, use_reentrant=False)), backend="aot_eager")
    with switch.enabled():
        got = _grads(model, x, run)
    for a, b in zip(eager, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_checkpoint_wrapper_reentrant_impl_keeps_torchs_behaviour():
    torch.manual_seed(0)
    model = Stack(p=0.0)
    x = torch.randn(8, 32, requires_grad=True)
    eager = _grads(model, x, _plain)
    wrapped = copy.deepcopy(model)
    apply_activation_checkpointing(
        wrapped, check_fn=lambda m: isinstance(m, Block),
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT))
    with switch.enabled():
        before = sum(m.calls for m in wrapped.modules() if isinstance(m, Block))
        assert_bitwise(eager, _grads(wrapped, x, _plain))
        assert sum(m.calls for m in wrapped.modules() if isinstance(m, Block)) - before == 6
