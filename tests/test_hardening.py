"""Regression tests for defects found by outside probes (one section per defect)."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import threading
import weakref

import _hang
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _dist import run_ranks
from _models import MLP, OpCounter, assert_bitwise, grads_of
from models import Llama, LlamaBlock
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import ac2_dist as ac

aten = torch.ops.aten
CP = ac.CheckpointPolicy


def _nothing_installed(process_wide: bool = True) -> bool:
    """Nothing of ac2 is left on this thread (and, by default, in the process)."""
    return (
        not ac.is_checkpoint_enabled()
        and not _get_current_dispatch_mode_stack()
        and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        and not (process_wide and torch.nn.modules.module._global_forward_hooks)
    )


def _llama(layers=3):
    torch.manual_seed(0)
    return Llama(vocab=64, dim=32, layers=layers, heads=4)


def _loss(model, tokens):
    return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


def _tokens(seed=0, shape=(2, 16)):
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))


# ---- 2: inference_mode / no_grad -------------------------------------------------------


def test_inference_mode_around_a_checkpointed_model():
    model = _llama()
    ref = copy.deepcopy(model)
    ac.apply_ac(model, "recompute_all", modules=[LlamaBlock])
    tokens = _tokens()
    with torch.inference_mode():
        got, want = model(tokens), ref(tokens)
    assert torch.equal(got, want)
    assert _nothing_installed()


def test_inference_mode_inside_a_region_and_inference_inputs():
    x = torch.randn(4, 8, requires_grad=True)
    with torch.inference_mode():
        frozen = torch.randn(4, 8)  # an inference tensor
    with ac.apply_ac_policy("recompute_all"):
        with torch.inference_mode():
            stats = frozen.mean()  # inference-mode code inside a region
        y = (x.sin() * (frozen + 1) + stats).tanh().sum()
    y.backward()
    xr = x.detach().requires_grad_()
    (xr.sin() * (frozen + 1) + frozen.mean()).tanh().sum().backward()
    assert torch.equal(x.grad, xr.grad)
    # An inference tensor passed into a region under no_grad.
    with torch.no_grad(), ac.apply_ac_policy("recompute_all"):
        out = (frozen * 2).tanh()
    assert torch.equal(out, (frozen * 2).tanh())
    assert _nothing_installed()


def test_region_records_nothing_without_grad():
    model = _llama()
    ac.apply_ac(model, "recompute_all", modules=[LlamaBlock])
    tokens = _tokens()
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx(), ac.apply_ac_policy("recompute_all") as region:
            with OpCounter():  # a mode below ours would see every op either way
                model(tokens)
            assert not _get_current_dispatch_mode_stack()  # no tracer installed
        assert isinstance(region.stats, ac.GraphStats) and region.stats.nodes == 0  # never None
    # Frozen parameters and inputs that do not require grad: nothing to checkpoint.
    for p in model.parameters():
        p.requires_grad_(False)
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append(op)
        return CP.PREFER_RECOMPUTE

    ac.apply_ac(model, policy, modules=[LlamaBlock])
    out = model(tokens)
    assert not out.requires_grad and seen == []


# ---- 3: prefetch links units by data flow ------------------------------------------------


def _prefetch_model(prefetch):
    model = _llama()
    ac.apply_ac(model, "recompute_all", modules=[LlamaBlock],
                replay=ac.ReplayConfig(stream="inline", prefetch=prefetch))
    return model


@pytest.mark.parametrize("prefetch", [1, 2])
def test_prefetch_does_not_replay_an_older_forward(prefetch):
    recomputed = {}
    for depth in (0, prefetch):
        model = _prefetch_model(depth)
        with ac.memory.track() as tracker:
            kept = _loss(model, _tokens(1))  # an eval output kept with grad enabled
            _loss(model, _tokens(2)).backward()
        recomputed[depth] = tracker.report().recomputed_ops  # over both forwards' graphs
        del kept
    assert recomputed[prefetch] == recomputed[0]


@pytest.mark.parametrize("prefetch", [1, 2])
def test_prefetch_after_optimizer_step_with_an_older_graph_alive(prefetch):
    model = _prefetch_model(prefetch)
    ref = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _loss(model, _tokens(0)).backward()
    _loss(ref, _tokens(0)).backward()
    kept = _loss(model, _tokens(1))  # this graph stays alive ...
    opt.step()  # ... and the parameters it saved are modified in place
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    _loss(model, _tokens(2)).backward()  # must not touch the old graph
    _loss(ref, _tokens(2)).backward()
    assert_bitwise([p.grad for p in ref.parameters()], [p.grad for p in model.parameters()])
    del kept


def test_retained_loss_is_not_prefetched_by_another_backward():
    model = _prefetch_model(1)
    with ac.memory.track() as tracker:
        first = _loss(model, _tokens(1))
        first.backward(retain_graph=True)
        second = _loss(model, _tokens(2))
        second.backward()
    graphs = tracker.graphs
    old = graphs[:3]
    # The first forward's graphs hold nothing parked for a backward that never comes.
    assert all(not g._parked and g.stats.cached_bytes == 0 for g in old)
    del first


# ---- 5: pickling -----------------------------------------------------------------------


def _policy_fn(ctx, op, *args, **kwargs):  # module level: picklable
    return CP.MUST_SAVE if op is aten.mm.default else CP.PREFER_RECOMPUTE


@pytest.mark.parametrize(
    "policy",
    [
        "recompute_all",
        "must_save_all",
        True,
        CP.MUST_SAVE,
        [aten.mm.default, aten.addmm.default, aten._scaled_dot_product_flash_attention_for_cpu.default],
        [aten.mm],  # a packet
        {aten.mm.default: CP.MUST_SAVE, aten.silu.default: CP.PREFER_RECOMPUTE},
        _policy_fn,
    ],
    ids=lambda p: type(p).__name__,
)
def test_checkpointed_model_pickles_with_every_builtin_policy_form(policy):
    model = _llama(layers=2)
    ac.apply_ac(model, policy, modules=[LlamaBlock])
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    tokens = _tokens()
    ref = _llama(layers=2)
    assert_bitwise(grads_of(ref, lambda m: _loss(m, tokens)), grads_of(loaded, lambda m: _loss(m, tokens)))
    assert ac.is_checkpoint_enabled() is False
    assert "_ac2_wrap" in loaded.layers[0].__dict__


def test_unpicklable_user_policy_names_the_module():
    model = _llama(layers=2)
    ac.apply_ac(model, lambda ctx, op, *a, **k: CP.PREFER_RECOMPUTE, modules=[LlamaBlock])
    with pytest.raises(pickle.PicklingError, match=r"ac2_dist.*layers\.0.*policy"):
        torch.save(model, io.BytesIO())


# ---- 6: one region object, two threads -------------------------------------------------


def test_one_region_object_used_from_two_threads():
    region = ac.apply_ac_policy("recompute_all")
    models = [MLP() for _ in range(2)]
    xs = [torch.randn(4, 32) for _ in range(2)]
    refs = [grads_of(copy.deepcopy(m), lambda m, x=x: m(x).sum()) for m, x in zip(models, xs)]
    barrier = threading.Barrier(2)
    results, errors = [None, None], []

    def work(i):
        try:
            with region:
                barrier.wait(timeout=30)  # both threads inside the same object at once
                y = models[i](xs[i]).sum()
                barrier.wait(timeout=30)
            y.backward()
            results[i] = [p.grad for p in models[i].parameters()]
            assert _nothing_installed(process_wide=False)  # the other thread may still be inside
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for ref, got in zip(refs, results):
        assert_bitwise(ref, got)
    assert not torch.nn.modules.module._global_forward_hooks


# ---- 7: create_graph inside a region leaks nothing --------------------------------------


@pytest.mark.parametrize("rng", ["save", "replay"])
def test_gradient_penalty_inside_a_region_frees_the_graph(rng):
    torch.manual_seed(0)
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)

    def step():
        y = (x @ w).tanh().sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        return y + g.pow(2).sum()

    step().backward()
    ref = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    gc.collect()
    gc.disable()
    try:
        refs = []
        for _ in range(3):
            x.grad = w.grad = None
            with ac.apply_ac_policy("recompute_all", rng=rng) as region:
                z = step()
            refs.append(weakref.ref(region.graph))
            z.backward()
            assert torch.equal(x.grad, ref[0]) and torch.equal(w.grad, ref[1])
            del z, region
        assert all(r() is None for r in refs)  # freed by refcount: no cycle
    finally:
        gc.enable()


# ---- 10: input checks ------------------------------------------------------------------


def test_dict_policy_is_a_real_policy_form():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(8, 32)
    ref = grads_of(copy.deepcopy(model), lambda m: m(x).sum())
    policy = {aten.addmm.default: CP.MUST_SAVE, aten.relu: CP.PREFER_SAVE}
    with ac.apply_ac_policy(policy) as region:
        y = model(x).sum()
    with OpCounter() as counter:
        y.backward()
    assert_bitwise(ref, [p.grad for p in model.parameters()])
    assert counter["aten.addmm"] == 0  # saved: none replayed
    assert counter["aten.relu"] == 0  # saved
    assert counter["aten.gelu"] == 1  # unlisted: recomputed
    assert region.stats.recomputed_ops >= 1
    with pytest.raises(TypeError, match="CheckpointPolicy"):
        ac.apply_ac_policy({aten.mm.default: "save"})
    with pytest.raises(TypeError, match="OpOverload"):
        ac.apply_ac_policy({"mm": CP.MUST_SAVE})


def test_bad_arguments_are_clear_type_errors():
    model = MLP()
    with pytest.raises(TypeError, match="replay.*ReplayConfig"):
        ac.apply_ac(model, "recompute_all", replay="inline")
    with pytest.raises(TypeError, match="replay.*ReplayConfig"):
        ac.apply_ac_policy("recompute_all", replay="inline")
    with pytest.raises(TypeError, match="model.*nn.Module"):
        ac.apply_ac(lambda x: x)
    with pytest.raises(TypeError, match="modules.*instance"):
        ac.apply_ac(model, modules=nn.Linear(2, 2))
    with pytest.raises(TypeError, match="nn.Module"):
        ac.wrap(lambda x: x)
    with pytest.raises(TypeError, match="accepted"):
        ac.apply_ac_policy(42)
    with pytest.raises(ValueError, match="rng"):
        ac.apply_ac_policy("recompute_all", rng="yes")
    assert _nothing_installed()


def test_save_with_hooks_unpack_of_wrong_shape_is_named():
    bad = ac.SAVE_WITH_HOOKS(lambda t: t.clone(), lambda t: t.flatten())

    def bad_unpack(t):
        return t.flatten()

    bad = ac.SAVE_WITH_HOOKS(lambda t: t.clone(), bad_unpack)
    x = torch.randn(4, 4, requires_grad=True)
    with ac.apply_ac_policy(lambda ctx, op, *a, **k: bad if op is aten.tanh.default else CP.PREFER_RECOMPUTE):
        y = x.sin().tanh().sum()
    with pytest.raises(RuntimeError, match=r"bad_unpack.*aten\.tanh.*shape"):
        y.backward()
    to_half = ac.SAVE_WITH_HOOKS(lambda t: t.clone(), lambda t: t.half())
    with ac.apply_ac_policy(lambda ctx, op, *a, **k: to_half if op is aten.tanh.default else CP.PREFER_RECOMPUTE):
        y = x.sin().tanh().sum()
    with pytest.raises(RuntimeError, match="dtype"):
        y.backward()


# ---- 12: prefetch + nested FSDP units: the same collective order on every rank ----------


def _nested_prefetch(rank, world, depth):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    losses = {}
    grads = {}
    for name in ("no-ac", "ac2"):
        model = _llama(layers=4)
        for blk in model.layers:
            fully_shard(blk.attention, mesh=mesh)
            fully_shard(blk.feed_forward, mesh=mesh)
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if name == "ac2":
            ac.apply_ac(model, "recompute_all", modules=[LlamaBlock],
                        replay=ac.ReplayConfig(stream="inline", prefetch=depth))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses[name] = []
        for step in range(3):
            loss = _loss(model, _tokens(10 * step + rank))
            loss.backward()
            losses[name].append(loss.item())
            opt.step()
            opt.zero_grad()
        grads[name] = [p.to_local().clone() for p in model.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(grads["no-ac"], grads["ac2"]))
    return losses, same


@pytest.mark.parametrize("depth", [1, 2])
def test_prefetch_with_nested_fsdp_units_matches_no_ac(depth):
    for losses, same in run_ranks(_nested_prefetch, depth):
        assert losses["ac2"] == losses["no-ac"]
        assert same


# ---- 13: views of in-place-modified tensors ---------------------------------------------


def test_view_of_an_inplace_modified_tensor_is_not_stale():
    x = torch.randn(4, 6, requires_grad=True)

    def fn(x):
        h = x * 2
        h.add_(1)
        v = h[:, ::2]
        w = torch.tanh(v)
        h.mul_(3)
        return (w.sum() + h.sum())

    with ac.apply_ac_policy("recompute_all") as region:
        y = fn(x)
    y.backward()
    xr = x.detach().requires_grad_()
    fn(xr).backward()
    assert torch.equal(x.grad, xr.grad)
    assert region.stats.nodes > 0


def test_linear_weight_transpose_is_recomputed_not_a_leaf():
    model = _llama(layers=2)
    ac.apply_ac(model, "recompute_all", modules=[LlamaBlock])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):  # after a step every weight has a non-zero version
        with ac.memory.track(model) as tracker:
            loss = _loss(model, _tokens())
            view_leaves = 0
            for g in tracker.graphs:
                seen, stack = set(), [h.node for h in g.handles]
                while stack:
                    n = stack.pop()
                    if id(n) in seen:
                        continue
                    seen.add(id(n))
                    stack.extend(n.inputs[1::3])
                    if n.op is None and n.saved[0].value._is_view():
                        view_leaves += 1
            # weight.t(), slices of the rotary tables...: recomputable view nodes over
            # the region inputs, not region inputs themselves.
            assert view_leaves == 0, (step, view_leaves)
            loss.backward()
        opt.step()
        opt.zero_grad()


def test_saved_view_detects_a_later_mutation_of_its_base():
    x = torch.randn(4, 4, requires_grad=True)
    with ac.apply_ac_policy("must_save_all"):
        h = x * 1
        v = h.t()
        y = (v.exp()).sum()
    with torch.no_grad():
        h.add_(1)  # modifies what v (saved for exp's backward? no: exp saves its output) aliases
    y.backward()  # exp saves its output, not v: still fine
    with ac.apply_ac_policy("must_save_all"):
        h = x * 1
        v = h.t()
        y = (v * x).sum()  # mul saves v
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified"):
        y.backward()


# ---- 14: save-lists with HigherOrderOperators -------------------------------------------


def test_save_list_accepts_higher_order_operators():
    from torch._higher_order_ops.flex_attention import flex_attention as flex_hop

    save = {aten.mm.default, flex_hop, torch.ops.higher_order.wrap_with_autocast}
    model = MLP()
    x = torch.randn(4, 32)
    ref = grads_of(copy.deepcopy(model), lambda m: m(x).sum())
    got = grads_of(model, lambda m: ac.apply_ac_policy_fn(m, x, policy_fn=save).sum())
    assert_bitwise(ref, got)
    buf = io.BytesIO()
    ac.apply_ac(model, save)
    torch.save(model, buf)  # HOPs pickle by name too


# ---- 15: wrapped modules are freed by refcount ------------------------------------------


def test_wrapped_module_is_freed_without_gc():
    gc.collect()
    gc.disable()
    try:
        model = _llama(layers=2)
        ac.apply_ac(model, "recompute_all", modules=[LlamaBlock])
        model(_tokens()).sum().backward()
        ref = weakref.ref(model.layers[0])
        del model
        assert ref() is None
    finally:
        gc.enable()


def test_wrapped_module_deepcopy_runs_the_copy():
    model = _llama(layers=2)
    ac.apply_ac(model, "recompute_all", modules=[LlamaBlock])
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(1)
    tokens = _tokens()
    assert not torch.equal(clone(tokens), model(tokens))
    fresh = _llama(layers=2)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1)
    assert torch.equal(clone(tokens), fresh(tokens))


def test_higher_order_operator_inside_a_region_is_recorded_and_saved():
    """Eager flex_attention runs a compiled wrapper that dispatches the flex_attention
    HOP to the active mode: recorded as one saved call, gradients equal eager."""
    from torch.nn.attention.flex_attention import flex_attention

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx)

    x = torch.randn(1, 2, 16, 8, requires_grad=True)
    q = torch.randn(1, 2, 16, 8)  # CPU flex_attention has no backward: constant q/k/v
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append(op)
        return CP.PREFER_RECOMPUTE

    with ac.apply_ac_policy(policy) as region:
        y = (flex_attention(q, q, q, score_mod=score_mod) * x).tanh().sum()
    y.backward()
    xr = x.detach().requires_grad_()
    (flex_attention(q, q, q, score_mod=score_mod) * xr).tanh().sum().backward()
    assert torch.equal(x.grad, xr.grad)
    assert torch.ops.higher_order.flex_attention in seen
    assert region.stats.saved_nodes >= 1


def test_compiled_submodule_inside_an_eager_region():
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    outer_w = nn.Linear(16, 16)
    compiled = torch.compile(inner, backend="aot_eager")
    x = torch.randn(4, 16, requires_grad=True)
    with ac.apply_ac_policy("recompute_all"):
        y = outer_w(compiled(x)).tanh().sum()
    y.backward()
    got = [x.grad] + [p.grad for p in inner.parameters()] + [p.grad for p in outer_w.parameters()]
    for t in [x, *inner.parameters(), *outer_w.parameters()]:
        t.grad = None
    outer_w(inner(x)).tanh().sum().backward()
    want = [x.grad] + [p.grad for p in inner.parameters()] + [p.grad for p in outer_w.parameters()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---- 11: torch.compile -----------------------------------------------------------------


def _compile_counters():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return counters


def test_compiled_checkpointed_modules_have_no_graph_break():
    counters = _compile_counters()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(5)])
    ref = copy.deepcopy(model)
    ac.apply_ac(model, "recompute_all", modules=lambda fqn, m: fqn.isdigit())
    x = torch.randn(4, 16)
    got = grads_of(model, lambda m: torch.compile(m, backend="aot_eager", fullgraph=True)(x).sum())
    want = grads_of(ref, lambda m: m(x).sum())
    assert not counters["graph_break"], dict(counters["graph_break"])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_compiled_function_region_has_no_graph_break():
    counters = _compile_counters()
    torch.manual_seed(0)
    block = MLP()
    x = torch.randn(4, 32, requires_grad=True)

    def f(x):
        return ac.apply_ac_policy_fn(block, x.sin(), policy_fn=[aten.mm.default]).cos().sum()

    got = grads_of(block, lambda m: torch.compile(f, backend="aot_eager", fullgraph=True)(x), x)
    want = grads_of(block, lambda m: m(x.sin()).cos().sum(), x)
    assert not counters["graph_break"], dict(counters["graph_break"])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_context_manager_region_in_compiled_code_warns_once_and_is_correct():
    counters = _compile_counters()
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)

    def f(x):
        x = x.sin()
        with ac.apply_ac_policy("recompute_all"):
            y = lin(x).tanh()
        return y.cos().sum()

    def g(x):
        with ac.apply_ac_policy("must_save_all"):
            y = lin(x).relu()
        return y.sum()

    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # the filter a user has: a location warns once
        for fn in (f, g, f):
            got = grads_of(lin, lambda m, fn=fn: torch.compile(fn, backend="aot_eager")(x), x)
            want = grads_of(lin, lambda m, fn=fn: fn(x), x)
            assert_bitwise(got, want)
    ours = [w for w in caught if "ac2_dist" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "graph break" in str(ours[0].message) and "apply_ac_policy_fn" in str(ours[0].message)
    # dynamo never tried to compile ac2's own frames while the block ran eagerly
    assert not any("_thread" in k or "ac2_dist" in k for k in counters["graph_break"]), dict(counters["graph_break"])
    assert _nothing_installed()

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"(?s)ac2_dist.*apply_ac_policy_fn"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    assert _nothing_installed()


# ---- the torch version range -------------------------------------------------------------


def test_import_on_a_torch_below_the_floor_names_the_version():
    import sys

    code = "import torch; torch.__version__ = '2.9.1+cu128'; import ac2_dist"
    proc = _hang.run([sys.executable, "-c", code])
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "ImportError: ac2_dist needs torch >= 2.10, but torch 2.9.1+cu128 is installed; "
        "upgrade it (pip install 'torch>=2.10')"
    ), proc.stderr[-2000:]


def test_declared_floor_is_the_checked_floor():
    import os
    import re

    from ac2_dist._compat import TORCH_FLOOR, check_torch

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml")) as f:
        declared = re.search(r'"torch>=([0-9.]+)"', f.read()).group(1)
    assert tuple(int(p) for p in declared.split(".")) == TORCH_FLOOR
    for ok in ("2.10.0", "2.10.0+cu128", "2.13.0+cpu", "2.15.0", "3.0.0a0+git1234"):
        check_torch(ok)
    for old in ("2.9.1", "1.13.1+cu117", "garbage"):
        with pytest.raises(ImportError, match="needs torch >= 2.10"):
            check_torch(old)


def test_region_stats_is_an_empty_graphstats_when_nothing_was_recorded():
    """README: ``region.stats`` is a GraphStats. After a use under no_grad it is an empty
    one (not the figures of an earlier recording use, and never None)."""
    lin = nn.Linear(8, 8)
    region = ac.apply_ac_policy("recompute_all")
    assert isinstance(region.stats, ac.GraphStats) and region.stats.nodes == 0  # before any use
    with region:
        lin(torch.randn(2, 8)).sum().backward()
    assert region.stats.nodes > 0
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx(), region:
            lin(torch.randn(2, 8))
        assert isinstance(region.stats, ac.GraphStats) and region.stats.nodes == 0
