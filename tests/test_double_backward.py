"""Double backward through every policy (issue 50): a saved value that has an autograd
history in forward is recomputed with it when a backward runs with ``create_graph=True``
(Note [A saved value keeps its recipe] in ac2_dist/_trace/_history.py), so gradient
penalties, Hessian-vector products and MAML-style updates get eager's gradients under a
save list, ``must_save_all`` and a MemoryBudget as under ``recompute_all``. Both
recorders; bitwise against eager; the recipes hold no value the first-order backward
would have freed (Note [A recipe holds no saved value]); what cannot be recomputed is a
clear error."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from _models import assert_bitwise

import ac2_dist as ac
from ac2_dist._trace._history import has_recipe
from ac2_dist._trace._tracer import C_DISPATCH, recording_in_python

aten = torch.ops.aten

POLICIES = {
    "recompute_all": lambda: "recompute_all",
    "save list": lambda: [aten.mm.default, aten.addmm.default, aten.tanh.default, aten.sigmoid.default],
    "must_save_all": lambda: "must_save_all",
    "budget": lambda: ac.MemoryBudget(fraction=0.5),
}
RECORDERS = ["python"] + (["C"] if C_DISPATCH is not None else [])


def _recorder(name: str):
    return recording_in_python() if name == "python" else contextlib.nullcontext()


class _Net(nn.Module):
    def __init__(self, width: int = 16, layers: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width), nn.Sigmoid())
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x) * x.sin()
        return x


def _penalty(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """A gradient penalty: the input gradient's norm, differentiated again."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    y = model(x)
    (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    (y.sum() + g.square().sum()).backward()
    return [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("recorder", RECORDERS)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_gradient_penalty_matches_eager_under_every_policy(policy, recorder):
    """Before: every policy but recompute_all raised ("ac2_dist keeps saved activations
    detached") at the first saved value with a history."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    eager = _penalty(_Net(), x)
    model = ac.apply_ac(_Net(), POLICIES[policy](), [nn.Sequential])
    with _recorder(recorder):
        for _ in range(2):  # a MemoryBudget calibrates on its first step and follows its plan after
            assert_bitwise(eager, _penalty(model, x))


@pytest.mark.parametrize("policy", ["recompute_all", "save list", "budget"])
def test_hessian_vector_product_through_a_checkpointed_mlp(policy):
    """``torch.autograd.functional.hvp`` (double backward with create_graph) through a
    checkpointed MLP: eager's product."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 12), nn.Sigmoid(), nn.Linear(12, 1))
    ckpt = ac.checkpoint_with(POLICIES[policy]())
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(2))
    v = torch.randn(5, 12, generator=torch.Generator().manual_seed(3))
    _, want = torch.autograd.functional.hvp(lambda x: mlp(x).sum(), x, v)
    for _ in range(2):
        _, got = torch.autograd.functional.hvp(
            lambda x: ckpt(mlp, x, use_reentrant=False).sum(), x, v)
        assert torch.equal(want, got), (want - got).abs().max()


T = None


def _llama():
    global T
    T = pytest.importorskip("transformers", reason="the 'test' extra installs transformers")
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    config._attn_implementation = "eager"  # torch's fused CPU attention has no double backward, in eager either
    return T.LlamaForCausalLM(config)


def _hf_penalty(model, embeds: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    embeds.grad = None
    logits = model(inputs_embeds=embeds).logits
    (g,) = torch.autograd.grad(logits.logsumexp(-1).sum(), embeds, create_graph=True)
    (logits.mean() + g.square().sum()).backward()
    return [embeds.grad.clone()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("policy", ["recompute_all", "save list", "budget"])
def test_gradient_penalty_on_a_small_hf_llama(policy):
    """A gradient penalty on a Hugging Face Llama (from its config), its layers
    checkpointed by ``hf.enable``: eager's gradients bit for bit."""
    from ac2_dist.integrations import hf

    embeds = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(4)).requires_grad_()
    eager = _hf_penalty(_llama().train(), embeds)
    policies = {**POLICIES, "save list": lambda: [aten.mm.default, aten.bmm.default, aten._softmax.default]}
    model = hf.enable(_llama().train(), policy=policies[policy]())
    for _ in range(2):
        assert_bitwise(eager, _hf_penalty(model, embeds))


def _reachable(graph, through_recipes: bool) -> set[int]:
    """Storages of the op outputs saved and reachable from the graph's live handles: the
    way the first-order backward walks (not through a saved node's recipe), or every
    edge. Region inputs are left out: recipes hold them as themselves, as torch's
    checkpoint holds every region input."""
    seen, storages = set(), set()
    stack = [h.node for h in graph.handles]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if through_recipes or n.saved is None or n.rng is not None or any(s is None for s in n.saved):
            stack.extend(n.inputs[1::3])
        for s in n.saved or () if n.op is not None else ():
            v = getattr(s, "value", None)
            if isinstance(v, torch.Tensor):
                storages.add(v.untyped_storage().data_ptr())
    return storages


@pytest.mark.parametrize("policy", ["must_save_all", "save list"])
def test_recipes_hold_no_value_the_first_backward_would_free(policy):
    """Recipes keep nodes, not saved values: every saved value reachable from the handles
    is one the first-order backward reaches anyway, region inputs aside. Before shadows,
    recipes held (Llama, 4 layers, must_save_all) 1.3 MB more between forward and
    backward, the partner of an undeclared alias among them."""
    from ac2_dist._trace import _graph

    graphs = []
    close = _graph.Graph.close_map

    def keep(self):
        graphs.append(self)
        return close(self)

    model = _llama().train()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
    from ac2_dist.integrations import hf

    hf.enable(model, policy=POLICIES[policy]())
    _graph.Graph.close_map = keep
    try:
        loss = model(input_ids=ids, labels=ids).loss
    finally:
        _graph.Graph.close_map = close
    assert graphs and any(n.saved and has_recipe(n) for g in graphs for n in _nodes(g))
    for g in graphs:
        assert _reachable(g, True) == _reachable(g, False)
    loss.backward()


def _nodes(graph):
    seen, stack = {}, [h.node for h in graph.handles]
    while stack:
        n = stack.pop()
        if id(n) not in seen:
            seen[id(n)] = n
            stack.extend(n.inputs[1::3])
    return list(seen.values())


def _dropout_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out, _ = aten.native_dropout(torch.tanh(x @ w), 0.25, True)
    return out * x


def test_a_random_op_replayed_from_its_generator_state_serves_double_backward():
    torch.manual_seed(0)
    x = torch.randn(6, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)

    def penalty(run):
        x.grad = w.grad = None
        torch.manual_seed(9)
        y = run()
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        g.square().sum().backward()
        return [x.grad.clone(), w.grad.clone()]

    eager = penalty(lambda: _dropout_block(x, w))
    ckpt = ac.checkpoint_with([aten.native_dropout.default, aten.mm.default], rng="replay")
    assert_bitwise(eager, penalty(lambda: ckpt(_dropout_block, x, w, use_reentrant=False)))


def test_a_random_op_kept_from_forward_is_the_one_clear_error():
    """Under rng="save" the dropout's output is kept from forward and never replayed: its
    history cannot be given back; the error names the op and the way out."""
    torch.manual_seed(0)
    x = torch.randn(6, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)
    y = ac.checkpoint_with("recompute_all", rng="save")(_dropout_block, x, w, use_reentrant=False)
    with pytest.raises(RuntimeError, match=r"create_graph=True.*native_dropout.*never replayed.*rng='replay'"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def _penalty_of(run, x: torch.Tensor, *rest: torch.Tensor) -> list[torch.Tensor]:
    x.grad = None
    y = run(x * 1, *rest)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    g.square().sum().backward()
    return [x.grad.clone()]


def test_an_input_written_after_a_saved_op_read_it_is_a_clear_error():
    """A recipe keeps no copy of a region input the region then writes in place (a
    snapshot would cost every step, for a backward that may never come): the error says
    which op, which input and what to do; the same region under a policy that does not
    save the op keeps what its replay needs, and matches eager."""
    torch.manual_seed(0)
    x = torch.randn(5, 5, requires_grad=True)
    c = torch.randn(5, 5)

    def block(h, c):
        a = h + c
        c.mul_(2)
        return a.sin() * c

    eager = _penalty_of(block, x, c.clone())
    recompute = ac.checkpoint_with("recompute_all")
    assert_bitwise(eager, _penalty_of(lambda h, c: recompute(block, h, c, use_reentrant=False), x, c.clone()))
    ckpt = ac.checkpoint_with([aten.add.Tensor])
    with pytest.raises(RuntimeError, match=r"aten.add.Tensor.*written in place after that op read it.*does not save"):
        _penalty_of(lambda h, c: ckpt(block, h, c, use_reentrant=False), x, c.clone())


def test_a_region_input_written_in_place_is_the_documented_exception():
    """The written tensor's new value comes from an op that is never replayed (a write
    to a region input is kept from forward): no recipe gives it its history back."""
    x = torch.randn(5, 5, requires_grad=True)

    def block(h):
        h.mul_(2)
        return h.sin()

    ckpt = ac.checkpoint_with("recompute_all")
    with pytest.raises(RuntimeError, match=r"create_graph=True.*mul_.*never replayed"):
        _penalty_of(lambda h: ckpt(block, h, use_reentrant=False), x)


def test_a_region_input_without_history_is_read_as_itself():
    """A recipe holds a region input as itself, as torch's checkpoint holds it (an
    eager-attention model's mask): the program may drop it after forward."""
    x = torch.randn(5, 5, requires_grad=True)

    def block(h, c):
        return (h + c).sin()

    ckpt = ac.checkpoint_with([aten.add.Tensor])
    c = torch.randn(5, 5, generator=torch.Generator().manual_seed(6))
    eager = _penalty_of(block, x, c)
    assert_bitwise(eager, _penalty_of(
        lambda h: ckpt(block, h, torch.randn(5, 5, generator=torch.Generator().manual_seed(6)),
                       use_reentrant=False), x))


@torch.library.custom_op("ac2test_db::stamp", mutates_args=())
def _stamp(x: torch.Tensor) -> torch.Tensor:
    return x * 3


_stamp.register_autograd(lambda ctx, g: g * 3)
ac.register_side_effect("ac2test_db::stamp")


def test_a_never_replayed_output_without_history_is_read_weakly():
    """The output of an op never replayed, made without a history (a registered side
    effect on a tensor that does not require grad, as a collective's), is read weakly by
    recipes: kept by the program, the recompute reads it and matches eager; freed after
    forward, the error names it and the ways out."""
    x = torch.randn(5, 5, requires_grad=True)
    c = torch.randn(5, 5, generator=torch.Generator().manual_seed(6))

    def block(h, c):
        return (h + torch.ops.ac2test_db.stamp(c)).sin()

    def kept(h, c):
        s = torch.ops.ac2test_db.stamp(c)
        return (h + s).sin() + 0 * s.sum(), s

    ckpt = ac.checkpoint_with([aten.add.Tensor])
    eager = _penalty_of(block, x, c)
    with pytest.raises(RuntimeError, match=r"aten.add.Tensor.*ac2test_db.stamp.*freed after it.*does not save"):
        _penalty_of(lambda h, c: ckpt(block, h, c, use_reentrant=False), x, c)
    held = []

    def run(h, c):
        out, s = ckpt(kept, h, c, use_reentrant=False)
        held.append(s)  # the program keeps the stamp's output until backward
        return out

    assert_bitwise(eager, _penalty_of(run, x, c))


def test_a_never_replayed_custom_op_with_autograd_serves_double_backward():
    """A registered side effect with its own autograd formula (torch.library) is kept
    from forward, as a constant below its autograd node: a create_graph backward
    differentiates through that node as eager does."""
    x = torch.randn(5, 5, requires_grad=True)

    def block(h):
        return torch.ops.ac2test_db.stamp(h.sin()).tanh()

    eager = _penalty_of(block, x)
    for policy in ("recompute_all", [aten.sin.default]):
        ckpt = ac.checkpoint_with(policy)
        assert_bitwise(eager, _penalty_of(lambda h, ckpt=ckpt: ckpt(block, h, use_reentrant=False), x))


def _two_leaf_penalty(block, run_block) -> list:
    """A gradient penalty through ``block(x, y)`` (x, y leaves), gradients of both."""
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(4, 8, generator=g).requires_grad_() for _ in range(2))
    torch.manual_seed(1)
    out = run_block(block, x, y)
    loss = (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2))).sum()
    gs = torch.autograd.grad(loss, (x, y), create_graph=True, allow_unused=True)
    (loss + sum(gr.square().sum() for gr in gs if gr is not None and gr.requires_grad)).backward()
    return [t.grad for t in (x, y)]


def _eager(block, x, y):
    return block(x, y)


@pytest.mark.parametrize("case", ["layer_norm", "rand_like", "no_grad", "leaf_made_inside"])
@pytest.mark.parametrize("policy", ["must_save_all", "list"])
def test_outputs_without_history_and_leaves_made_inside(case, policy):
    """Found by the modes fuzzer (tests/_modes_fuzz.py): a saved output that has no
    history in eager either (``native_layer_norm``'s mean and rstd, ``rand_like``'s), a
    value made under ``no_grad`` read by a saved op (a constant, read as saved), and a
    leaf made inside the region with ``requires_grad_()`` (no ATen op: the recipe reads
    the leaf itself). Before, an internal error or a freed-value error; now eager's."""
    leaves = {}

    def layer_norm(x, y):
        return torch.nn.functional.layer_norm(x, (8,)) * y

    def rand_like(x, y):
        return (torch.rand_like(x) * x).sin() * y

    def no_grad(x, y):
        with torch.no_grad():
            t = y * x.exp()
        return (t * x).tanh()

    def leaf_made_inside(x, y):
        d = x.detach().requires_grad_()
        leaves["d"] = d
        return d.softmax(-1) * x * y

    block = {"layer_norm": layer_norm, "rand_like": rand_like, "no_grad": no_grad,
             "leaf_made_inside": leaf_made_inside}[case]
    saved = {"layer_norm": [aten.native_layer_norm.default], "rand_like": [aten.rand_like.default],
             "no_grad": [aten.tanh.default], "leaf_made_inside": [aten._softmax.default]}[case]
    ckpt = ac.checkpoint_with("must_save_all" if policy == "must_save_all" else saved)
    eager = _two_leaf_penalty(block, _eager)
    got = _two_leaf_penalty(block, lambda b, x, y: ckpt(b, x, y, use_reentrant=False))
    assert [g is None for g in got] == [g is None for g in eager]  # no_grad: y gets no gradient
    assert_bitwise([g for g in eager if g is not None], [g for g in got if g is not None])


def test_a_custom_functions_output_freed_is_a_clear_error():
    """A custom autograd.Function's output gets its history from the Function, which a
    replay of ATen ops cannot make again: read by a saved op's recipe, it is read by weak
    reference; freed by the program, the error says so; kept, eager's gradients."""

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return a * a

        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            return 2 * g * a

    kept = []

    def block(x, y):
        q = Square.apply(x)
        kept.append(q)
        return (q * y).sin()

    def dropped(x, y):
        return (Square.apply(x) * y).sin()

    ckpt = ac.checkpoint_with("must_save_all")
    assert_bitwise(_two_leaf_penalty(block, _eager), _two_leaf_penalty(block, lambda b, x, y: ckpt(b, x, y,
                                                                                                    use_reentrant=False)))
    with pytest.raises(RuntimeError, match=r"custom autograd.Function.*freed it after forward.*keep a reference"):
        _two_leaf_penalty(dropped, lambda b, x, y: ckpt(b, x, y, use_reentrant=False))
