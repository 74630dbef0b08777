"""Backward semantics: retain_graph, second backward, create_graph, threads, exceptions."""

from __future__ import annotations

import threading

import pytest
import torch
from _models import GPT, MLP, OpCounter, assert_bitwise, grads_of
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import ac2_dist as ac


def _nothing_installed() -> bool:
    return (
        not ac.is_checkpoint_enabled()
        and not _get_current_dispatch_mode_stack()
        and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    )


@pytest.mark.parametrize("policy", ["recompute_all", [torch.ops.aten.addmm.default]])
def test_retain_graph_twice_same_grads_and_no_extra_recompute(policy):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 32, requires_grad=True)
    params = list(model.parameters())
    ref = torch.autograd.grad(model(x).sum(), params)
    with ac.apply_ac_policy(policy) as region:
        y = model(x).sum()
    g1 = torch.autograd.grad(y, params, retain_graph=True)
    once = region.stats.recomputed_ops
    g2 = torch.autograd.grad(y, params, retain_graph=True)
    g3 = torch.autograd.grad(y, params)
    assert_bitwise(list(ref), list(g1))
    assert_bitwise(list(g1), list(g2))
    assert_bitwise(list(g1), list(g3))
    # Each backward replays every needed op exactly once (Note [Epochs]).
    assert region.stats.recomputed_ops == 3 * once
    assert region.stats.backward_epochs == 2


def test_partial_backward_then_full_backward():
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    with ac.apply_ac_policy("recompute_all"):
        h = (x @ w).tanh()
        y = (h.sigmoid() * x).sum()
    (gx_only,) = torch.autograd.grad(y, x, retain_graph=True)
    gx, gw = torch.autograd.grad(y, (x, w))
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    rx, rw = torch.autograd.grad(((xr @ wr).tanh().sigmoid() * xr).sum(), (xr, wr))
    assert torch.equal(gx_only, rx) and torch.equal(gx, rx) and torch.equal(gw, rw)


def test_second_backward_without_retain_graph_errors():
    x = torch.randn(4, requires_grad=True)
    with ac.apply_ac_policy("recompute_all"):
        y = x.sin().tanh().sum()
    y.backward()
    with pytest.raises(RuntimeError, match="retain_graph"):
        y.backward()


@pytest.mark.parametrize("rng", ["save", "replay"])
def test_create_graph_recompute_all_matches_eager(rng):
    torch.manual_seed(0)
    x = torch.randn(6, 5, requires_grad=True)
    w = torch.randn(5, 5, requires_grad=True)

    def fn(x, w):
        return ((x @ w).tanh() * x.sin()).sigmoid().sum()

    g, = torch.autograd.grad(fn(x, w), x, create_graph=True)
    ref = torch.autograd.grad(g.pow(2).sum(), (x, w))
    with ac.apply_ac_policy("recompute_all", rng=rng):
        y = fn(x, w)
    g2, = torch.autograd.grad(y, x, create_graph=True)
    got = torch.autograd.grad(g2.pow(2).sum(), (x, w))
    assert torch.equal(g, g2)
    for a, b in zip(ref, got):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_create_graph_through_saved_activations_matches_eager():
    # Before issue 50 a refusal ("ac2_dist keeps saved activations detached"): a saved
    # value is recomputed with its history (Note [A saved value keeps its recipe] in
    # ac2_dist/_trace/_history.py; tests/test_double_backward.py covers every policy).
    x = torch.randn(4, requires_grad=True)
    (g,) = torch.autograd.grad(x.sin().tanh().sum(), x, create_graph=True)
    (want,) = torch.autograd.grad(g.square().sum(), x)
    with ac.apply_ac_policy("must_save_all"):
        y = x.sin().tanh().sum()
    (g2,) = torch.autograd.grad(y, x, create_graph=True)
    (got,) = torch.autograd.grad(g2.square().sum(), x)
    assert torch.equal(g, g2) and torch.equal(want, got)


def test_threads_have_independent_regions():
    torch.manual_seed(0)
    models = [GPT(layers=1) for _ in range(4)]
    xs = [torch.randn(2, 8, 32) for _ in range(4)]
    refs = [grads_of(m, lambda m, x=x: m(x).sum()) for m, x in zip(models, xs)]
    policies = ["recompute_all", "must_save_all", [torch.ops.aten.addmm.default], "recompute_all"]
    results, errors = [None] * 4, []
    barrier = threading.Barrier(4)

    def work(i):
        try:
            barrier.wait(timeout=30)
            for _ in range(3):
                with ac.apply_ac_policy(policies[i]):
                    assert ac.is_checkpoint_enabled()
                    y = models[i](xs[i]).sum()
                models[i].zero_grad(set_to_none=True)
                y.backward()
            results[i] = [p.grad.clone() for p in models[i].parameters()]
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert not ac.is_checkpoint_enabled()  # nothing leaked into this thread
    for ref, got in zip(refs, results):
        assert_bitwise(ref, got)


def test_backward_on_another_thread():
    x = torch.randn(4, 4, requires_grad=True)
    with ac.apply_ac_policy("recompute_all"):
        y = x.exp().tanh().sum()
    out = {}
    t = threading.Thread(target=lambda: out.update(g=torch.autograd.grad(y, x)[0]))
    t.start()
    t.join(timeout=60)
    (ref,) = torch.autograd.grad(x.exp().tanh().sum(), x)
    assert torch.equal(out["g"], ref)


def test_backward_inside_an_active_region_is_not_recorded():
    x = torch.randn(4, requires_grad=True)
    with ac.apply_ac_policy("recompute_all") as outer:
        y = x.sin().tanh().sum()
        with OpCounter() as counter:
            (g,) = torch.autograd.grad(y, x)
        nodes_after = outer.stats.nodes
        z = g.sum()
    assert counter["aten.sin"] == 1  # the replay ran (and was not traced as forward)
    (ref,) = torch.autograd.grad(x.sin().tanh().sum(), x)
    assert torch.equal(g, ref)
    assert outer.stats.nodes == nodes_after + 1  # only z's sum was recorded after it
    del z


def test_exception_inside_region_leaves_nothing_behind():
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError, match="boom"):
        with ac.apply_ac_policy("recompute_all"):
            with ac.apply_ac_policy([torch.ops.aten.sin.default]):
                x.sin()
                raise ValueError("boom")
    assert _nothing_installed()
    with pytest.raises(RuntimeError):
        with ac.apply_ac_policy("recompute_all"):
            torch.mm(torch.randn(2, 3), torch.randn(2, 3))  # shape error inside an op
    assert _nothing_installed()
    # A later region works normally.
    with ac.apply_ac_policy("recompute_all"):
        y = x.sin().tanh().sum()
    y.backward()
    (ref,) = torch.autograd.grad(x.sin().tanh().sum(), x)
    assert torch.equal(x.grad, ref)


def test_out_of_order_exit_and_reentry_are_errors():
    a = ac.apply_ac_policy("recompute_all")
    b = ac.apply_ac_policy("recompute_all")
    a.__enter__()
    b.__enter__()
    with pytest.raises(RuntimeError, match="out of order"):
        a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="already active"):
        a.__enter__()
    a.__exit__(None, None, None)
    assert _nothing_installed()
    with a:  # the object can be reused once exited
        pass
    assert _nothing_installed()
