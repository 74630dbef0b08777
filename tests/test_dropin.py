"""ac2_dist.checkpoint / checkpoint_sequential as drop-ins for torch's, policy_factory,
is_checkpointed."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import itertools
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
from _models import MLP, assert_bitwise
from torch.utils.checkpoint import CheckpointPolicy as CP
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import checkpoint_sequential as torch_checkpoint_sequential
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import ac2_dist as ac
from ac2_dist._region import _thread_state

aten = torch.ops.aten
MM_OPS = {aten.mm.default, aten.addmm.default}


def _block(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 16))


def _grads(block: nn.Module, x: torch.Tensor, run) -> list[torch.Tensor]:
    block.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(5)
    run().square().sum().backward()
    return [x.grad] + [p.grad for p in block.parameters()]


def _sac_list():
    return functools.partial(create_selective_checkpoint_contexts, [aten.addmm.default])


def _sac_fn():
    def policy(ctx, op, *args, **kwargs):
        return CP.MUST_SAVE if op is aten.gelu.default else CP.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


COMBOS = list(itertools.product(
    [None, False, True],  # use_reentrant
    [True, False],  # preserve_rng_state
    ["default", "none"],  # determinism_check
    [False, True],  # debug
    [None, "sac-list", "sac-fn"],  # context_fn
))


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no-dropout", "dropout"])
def test_checkpoint_gradients_match_torch_for_every_argument_combination(dropout):
    block = _block(dropout)
    x = torch.randn(8, 16, requires_grad=True)
    eager = _grads(block, x, lambda: block(x))
    contexts = {None: None, "sac-list": _sac_list(), "sac-fn": _sac_fn()}
    for reentrant, preserve, check, debug, ctx in COMBOS:
        kwargs = {"use_reentrant": reentrant, "preserve_rng_state": preserve, "determinism_check": check,
                  "debug": debug}
        if ctx is not None:
            kwargs["context_fn"] = contexts[ctx]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # use_reentrant=True / None warnings, tested below
            got = _grads(block, x, lambda kw=kwargs: ac.checkpoint(block, x, **kw))
            # torch accepts context_fn / debug only non-reentrant, and not both together
            # (ac2 accepts every combination). torch's debug=True only adds an op trace to
            # its error messages, through a logger that pytest's log capture cannot
            # format: the reference runs without it (gradients do not depend on it).
            torch_kwargs = dict(kwargs, debug=False)
            if ctx is not None or debug or reentrant is None:
                torch_kwargs["use_reentrant"] = False
            want = _grads(block, x, lambda kw=torch_kwargs: torch_checkpoint(block, x, **kw))
        label = (reentrant, preserve, check, debug, ctx)
        if dropout and not preserve:
            # torch draws new masks in its recompute (its gradients are not eager's);
            # ac2 keeps the forward's masks: eager's gradients.
            assert_bitwise(eager, got), label
        else:
            assert_bitwise(want, got), label
        assert not ac.is_checkpoint_enabled()


def test_checkpoint_use_reentrant_true_warns_once_per_call_site():
    block = _block(0.0)
    x = torch.randn(4, 16, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            ac.checkpoint(block, x, use_reentrant=True).sum().backward()
        for reentrant in (None, False):
            ac.checkpoint(block, x, use_reentrant=reentrant).sum().backward()
    ours = [w for w in caught if "ac2_dist.checkpoint(use_reentrant=True)" in str(w.message)]
    assert len(ours) == 1 and "ignored" in str(ours[0].message)


def test_checkpoint_kwargs_inputs_without_grad_and_autograd_grad():
    """What torch's reentrant checkpoint cannot do, ac2's can (like non-reentrant)."""

    def fn(a, *, scale, bias=None):
        return (a.sin() * scale + bias).tanh()

    a = torch.randn(4, 4)  # does not require grad
    scale = torch.randn(4, requires_grad=True)
    bias = torch.randn(4, requires_grad=True)
    y = ac.checkpoint(fn, a, scale=scale, bias=bias, use_reentrant=True)
    got = torch.autograd.grad(y.sum(), [scale, bias])
    want = torch.autograd.grad(fn(a, scale=scale, bias=bias).sum(), [scale, bias])
    assert_bitwise(list(want), list(got))


def test_checkpoint_rejects_bad_arguments():
    block = _block(0.0)
    x = torch.randn(4, 16, requires_grad=True)
    with pytest.raises(ValueError, match="determinism_check should be one of"):
        ac.checkpoint(block, x, determinism_check="strict")
    with pytest.raises(TypeError, match="context_fn.*policy / policy_factory, not both"):
        ac.checkpoint(block, x, context_fn=_sac_list(), policy="must_save_all")
    with pytest.raises(TypeError, match="policy or policy_factory, not both"):
        ac.checkpoint(block, x, policy="must_save_all", policy_factory=lambda: "recompute_all")
    with pytest.raises(TypeError, match="policy_factory .* returned 42, which is not a policy"):
        ac.checkpoint(block, x, policy_factory=lambda: 42)
    with pytest.raises(TypeError, match="policy_factory must be a zero-argument callable"):
        ac.checkpoint(block, x, policy_factory="recompute_all")
    with pytest.raises(TypeError, match="tuple of two context managers"):
        ac.checkpoint(block, x, context_fn=lambda: contextlib.nullcontext())
    with pytest.raises(TypeError, match="debug must be a bool"):
        ac.checkpoint(block, x, debug="yes")
    with pytest.raises(TypeError, match="use_reentrant must be a bool or None"):
        ac.checkpoint(block, x, use_reentrant="no")
    assert not ac.is_checkpoint_enabled() and _thread_state().graph is None


def test_context_fn_other_than_sac_enters_the_forward_context_only():
    entered = []

    @contextlib.contextmanager
    def tag(name):
        entered.append(name)
        yield

    block = _block(0.0)
    x = torch.randn(4, 16, requires_grad=True)
    y = ac.checkpoint(block, x, use_reentrant=False, context_fn=lambda: (tag("forward"), tag("recompute")))
    y.sum().backward()
    assert entered == ["forward"]  # ac2 never re-runs the function: no recompute context
    assert_bitwise(_grads(block, x, lambda: block(x)),
                   _grads(block, x, lambda: ac.checkpoint(block, x, context_fn=lambda: (tag("f"), tag("r")))))


# ---- stateful policies: fresh per region ------------------------------------------------


class _EverySecondMatmul:
    """torchtitan's "save every second matmul" (a counter per policy object; like
    torchtitan's, separate counts for forward and for torch < 2.12's recompute calls)."""

    def __init__(self) -> None:
        self.mm_seen = {False: 0, True: 0}
        self.saved = 0

    def __call__(self, ctx, op, *args, **kwargs):
        if op in MM_OPS:
            recompute = bool(getattr(ctx, "is_recompute", False))
            self.mm_seen[recompute] += 1
            if self.mm_seen[recompute] % 2 == 1:
                self.saved += not recompute
                return CP.MUST_SAVE
        return CP.PREFER_RECOMPUTE


class _Stack(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(MLP() for _ in range(n))  # 3 linears per block

    def forward(self, x, run=None):
        for b in self.blocks:
            x = run(b, x) if run is not None else b(x)
        return x


def _per_block_saves(run_block) -> list[int]:
    made: list[_EverySecondMatmul] = []

    def make():
        made.append(_EverySecondMatmul())
        return made[-1]

    model = _Stack()
    x = torch.randn(4, 32, requires_grad=True)
    model(x, run=lambda b, h: run_block(b, h, make)).sum().backward()
    return [p.saved for p in made]


def test_stateful_context_fn_policy_saves_per_block_like_torch_sac():
    def context_fn(make):
        return create_selective_checkpoint_contexts(make())

    torch_counts = _per_block_saves(
        lambda b, h, make: torch_checkpoint(b, h, use_reentrant=False, context_fn=lambda: context_fn(make)))
    ours = _per_block_saves(
        lambda b, h, make: ac.checkpoint(b, h, use_reentrant=False, context_fn=lambda: context_fn(make)))
    factory = _per_block_saves(lambda b, h, make: ac.checkpoint(b, h, policy_factory=make))
    assert torch_counts == ours == factory == [2, 2, 2, 2]  # 3 matmuls per block: 1st and 3rd saved
    # One shared policy object drifts across blocks (what policy_factory exists for).
    shared = _EverySecondMatmul()
    model = _Stack()
    model(torch.randn(4, 32), run=lambda b, h: ac.checkpoint(b, h, policy=shared))
    assert shared.saved == 6 and shared.mm_seen[False] == 12  # saves 2, 1, 2, 1 per block


def test_policy_factory_is_fresh_per_region_for_every_entry_point():
    calls = []

    def factory():
        policy = _EverySecondMatmul()
        calls.append(policy)
        return policy

    model = _Stack(3)
    ref = copy.deepcopy(model)
    ac.apply_ac(model, modules=[MLP], policy_factory=factory)
    x = torch.randn(4, 32, requires_grad=True)
    for step in range(2):
        got = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
        want = torch.autograd.grad(ref(x).sum(), [x, *ref.parameters()])
        assert_bitwise(list(want), list(got))
        assert len(calls) == 3 * (step + 1) and all(p.saved == 2 for p in calls)
    calls.clear()
    block = MLP()
    ac.wrap(block, policy_factory=factory)
    block(x).sum().backward()
    ac.apply_ac_policy_fn(MLP(), x, policy_factory=factory).sum().backward()
    assert len(calls) == 2 and all(p.saved == 2 for p in calls)
    with pytest.raises(TypeError, match="apply_ac: pass either policy or policy_factory"):
        ac.apply_ac(MLP(), "recompute_all", policy_factory=factory)
    with pytest.raises(TypeError, match="wrap: pass either policy or policy_factory"):
        ac.wrap(MLP(), [aten.mm.default], policy_factory=factory)
    with pytest.raises(TypeError, match="apply_ac_policy_fn: pass either"):
        ac.apply_ac_policy_fn(MLP(), x, policy_fn="must_save_all", policy_factory=factory)
    bad = ac.wrap(MLP(), policy_factory=lambda: "save_everything")
    with pytest.raises(TypeError, match="policy_factory .* returned 'save_everything', which is not a policy"):
        bad(x)
    assert not ac.is_checkpoint_enabled()


def _module_level_factory():
    return [aten.addmm.default]


def test_policy_factory_modules_pickle_and_name_unpicklable_factories():
    model = ac.apply_ac(_Stack(2), modules=[MLP], policy_factory=_module_level_factory)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(2, 32)
    assert torch.equal(loaded(x), model(x)) and ac.is_checkpointed(loaded.blocks[0])
    local = ac.wrap(MLP(), policy_factory=lambda: "recompute_all", module_fqn="blk")
    with pytest.raises(pickle.PicklingError, match="policy_factory of the checkpointed module 'blk'"):
        pickle.dumps(local)


# ---- checkpoint_sequential ----------------------------------------------------------------


@pytest.mark.parametrize("segments", [1, 2, 3, 5])
@pytest.mark.parametrize("as_list", [False, True], ids=["sequential", "list"])
def test_checkpoint_sequential_matches_torch(segments, as_list):
    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.2)) for _ in range(5)])
    functions = list(seq) if as_list else seq
    x = torch.randn(4, 8, requires_grad=True)
    params = [x, *seq.parameters()]
    torch.manual_seed(1)
    want = torch.autograd.grad(torch_checkpoint_sequential(functions, segments, x, use_reentrant=False).sum(), params)
    torch.manual_seed(1)
    got = torch.autograd.grad(ac.checkpoint_sequential(functions, segments, x, use_reentrant=False).sum(), params)
    assert_bitwise(list(want), list(got))
    with pytest.raises(ValueError, match="Unexpected keyword arguments: bogus"):
        ac.checkpoint_sequential(functions, segments, x, bogus=1)


def test_checkpoint_sequential_passes_policy_on():
    seq = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    x = torch.randn(2, 8, requires_grad=True)
    made = []
    ac.checkpoint_sequential(seq, 2, x, policy_factory=lambda: made.append(1) or "must_save_all").sum().backward()
    assert len(made) == 1  # two segments: the first is checkpointed, the last runs plainly


# ---- the function's keywords (issue 19 item 12) -------------------------------------------------


def _keyword_fn(x, policy=False, policy_factory=None, allow_cache_entry_mutation=0):
    """A function whose own keywords share ac2's names."""
    scale = 2.0 if policy is True else 1.0
    scale += 3.0 if policy_factory == "f" else 0.0
    return (x * scale + allow_cache_entry_mutation).tanh()


def test_checkpoint_passes_the_functions_own_keywords_like_torch():
    x = torch.randn(4, 8, requires_grad=True)
    kw = {"policy": True, "policy_factory": "f", "allow_cache_entry_mutation": 5}
    want = torch_checkpoint(_keyword_fn, x, use_reentrant=False, **kw)
    (gw,) = torch.autograd.grad(want.sum(), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a named parameter: passed on silently, as torch does
        got = ac.checkpoint(_keyword_fn, x, use_reentrant=False, **kw)
    (gg,) = torch.autograd.grad(got.sum(), x)
    assert_bitwise(want, got)
    assert_bitwise(gw, gg)


def test_checkpoint_passes_policy_to_a_function_with_var_kwargs_and_warns():
    seen = {}

    def fn(x, **kwargs):
        seen.update(kwargs)
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    with pytest.warns(UserWarning, match=r"accepts \*\*kwargs, so the keyword 'policy' was passed to it"):
        ac.checkpoint(fn, x, policy="must_save_all").sum().backward()
    assert seen == {"policy": "must_save_all"}


def test_checkpoint_takes_policy_from_a_function_that_cannot_receive_it():
    block = MLP(8)
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(ValueError, match="unknown policy string"):  # ac2's, validated as before
        ac.checkpoint(block, x, policy="save_some")
    with ac.memory.track() as tracker:
        ac.checkpoint(block, x, policy="must_save_all").sum().backward()
    assert tracker.graph_stats and all(s.recomputed_ops == 0 for s in tracker.graph_stats)


def test_checkpoint_with_binds_ac2_options_and_gives_every_keyword_to_the_function():
    x = torch.randn(4, 8, requires_grad=True)
    ckpt = ac.checkpoint_with(policy="must_save_all", rng="save")
    assert pickle.loads(pickle.dumps(ckpt)).policy == "must_save_all"
    assert "must_save_all" in repr(ckpt)
    kw = {"policy": True, "policy_factory": "f", "allow_cache_entry_mutation": 5}
    want = torch_checkpoint(_keyword_fn, x, use_reentrant=False, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ckpt(_keyword_fn, x, use_reentrant=False, **kw)
    assert_bitwise(want, got)
    assert ac._dropin.is_ac2_checkpoint(ckpt) and ac._dropin.is_ac2_checkpoint(functools.partial(ckpt, debug=False))
    with pytest.raises(ValueError, match="rng must be 'replay', 'save' or None"):
        ac.checkpoint_with(rng="sometimes")
    with pytest.raises(TypeError, match="pass either policy or policy_factory"):
        ac.checkpoint_with("recompute_all", policy_factory=lambda: "recompute_all")


def test_checkpoint_without_a_function_is_a_decorator():
    """torch >= 2.14's ``checkpoint(use_reentrant=False)(fn)``, on every torch: calls run
    once in an ac2 region with the bound options, every call keyword goes to ``fn``, and
    it decorates methods (bound on access)."""
    block = _block(0.3)
    x = torch.randn(8, 16, requires_grad=True)
    eager = _grads(block, x, lambda: block(x))
    calls = []

    def fn(h, *, debug):  # a keyword named like a checkpoint option: the function's
        calls.append(debug)
        return block(h)

    wrapped = ac.checkpoint(use_reentrant=False, preserve_rng_state=False)(fn)
    assert wrapped.__wrapped__ is fn and wrapped.__name__ == "fn"
    with ac.memory.track() as tracker:
        got = _grads(block, x, lambda: wrapped(x, debug="mine"))
    assert calls == ["mine"] and len(tracker.graph_stats) == 1
    assert tracker.graph_stats[0].recomputed_ops > 0
    assert_bitwise(eager, got)

    saving = ac.checkpoint(policy="must_save_all")(block)  # an ac2 option bound too
    with ac.memory.track() as tracker:
        assert_bitwise(eager, _grads(block, x, lambda: saving(x)))
    assert tracker.graph_stats[0].recomputed_ops == 0
    assert_bitwise(eager, _grads(block, x, lambda: ac.checkpoint_with(rng="save")()(block)(x)))

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = block
            self.runs = 0

        @ac.checkpoint(use_reentrant=False)
        def forward(self, h):
            self.runs += 1
            return self.block(h)

    holder = Holder()
    with ac.memory.track() as tracker:
        assert_bitwise(eager, _grads(block, x, lambda: holder(x)))
    assert holder.runs == 1 and len(tracker.graph_stats) == 1
    with pytest.raises(ValueError, match="Unexpected keyword arguments: scale"):
        ac.checkpoint(use_reentrant=False, scale=2)
    with pytest.raises(TypeError, match="debug must be a bool"):
        ac.checkpoint(debug="yes")(block)(x)


def test_respect_saved_tensors_hooks():
    """Every setting inside ``save_on_cpu`` runs with eager's gradients (what the hooks see:
    tests/test_user_hooks.py); ``True`` with no user hooks in scope (none, or only an
    enclosing ac2 region's) runs too; a value that is not a bool is refused."""
    block = _block(0.3)
    x = torch.randn(8, 16, requires_grad=True)
    eager = _grads(block, x, lambda: block(x))

    def inside_hooks(respect):
        with torch.autograd.graph.save_on_cpu():
            return ac.checkpoint(block, x, use_reentrant=False, respect_saved_tensors_hooks=respect)

    for respect in (None, False, True):
        assert_bitwise(eager, _grads(block, x, lambda r=respect: inside_hooks(r)))
    assert not ac.is_checkpoint_enabled()
    assert_bitwise(eager, _grads(block, x, lambda: ac.checkpoint(block, x, respect_saved_tensors_hooks=True)))

    def nested():
        with ac.apply_ac_policy("recompute_all"):
            return ac.checkpoint(block, x, respect_saved_tensors_hooks=True)
    assert_bitwise(eager, _grads(block, x, nested))
    with pytest.raises(TypeError, match="respect_saved_tensors_hooks must be a bool or None"):
        ac.checkpoint(block, x, respect_saved_tensors_hooks=1)


# ---- is_checkpointed ------------------------------------------------------------------------


def test_is_checkpointed():
    model = _Stack(2)
    assert not any(ac.is_checkpointed(m) for m in model.modules())
    ac.apply_ac(model, modules=[MLP])
    assert [ac.is_checkpointed(m) for m in model.blocks] == [True, True]
    assert not ac.is_checkpointed(model) and not ac.is_checkpointed(model.blocks[0].fc1)
    ac.unwrap(model.blocks[0])
    assert [ac.is_checkpointed(m) for m in model.blocks] == [False, True]
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        ac.is_checkpointed(lambda x: x)


# ---- torch.compile ----------------------------------------------------------------------


@pytest.mark.parametrize("how", ["policy", "context_fn", "policy_factory"])
def test_checkpoint_inside_torch_compile_has_no_graph_break(how):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    block = _block(0.0)
    x = torch.randn(4, 16, requires_grad=True)
    kwargs = {"policy": [aten.addmm.default], "context_fn": _sac_list(),
              "policy_factory": _module_level_factory}[how]
    kwargs = {how: kwargs}

    def f(x):
        return ac.checkpoint(block, x.sin(), use_reentrant=False, **kwargs).cos()

    got = _grads(block, x, lambda: torch.compile(f, backend="aot_eager", fullgraph=True)(x))
    want = _grads(block, x, lambda: block(x.sin()).cos())
    assert not counters["graph_break"], dict(counters["graph_break"])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
