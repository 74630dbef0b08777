"""torch.compile: checkpointed blocks compile with no ac2 graph break, in
either order and with ``fullgraph=True``; a policy means the same in the compiled graph as
in eager (checked on the partitioned forward/backward graphs against torch's own
selective checkpoint with the same policy); random and collective ops are never
recomputed; what only eager ac2 does is refused or announced.

Inductor runs on small models (2 blocks, D=64); the graph checks use AOTAutograd with the
same min-cut partitioner Inductor uses and no code generation (fast)."""

from __future__ import annotations

import copy
import functools
import warnings
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _dist import run_ranks
from models import GPTBlock, GPTStack, Llama, LlamaBlock, MLPLayer, StageStack
from torch._dynamo.utils import counters
from torch.utils.checkpoint import CheckpointPolicy as CP
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import ac2_dist as ac

aten = torch.ops.aten
SAVE_MM = [aten.mm.default, aten.addmm.default]


def _reset():
    torch._dynamo.reset()
    counters.clear()


def _graph_breaks() -> dict:
    return dict(counters["graph_break"])


def _capture_backend():
    """An AOTAutograd backend that records the partitioned forward and backward graphs."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs: dict[str, list] = {"fw": [], "bw": []}

    def backend(gm, example_inputs):
        def keep(kind):
            def compiler(g, inputs):
                graphs[kind].append(g)
                return make_boxed_func(g.forward)

            return compiler

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                                     partition_fn=min_cut_rematerialization_partition)

    return graphs, backend


def _ops(graphs: list) -> Counter:
    c: Counter = Counter()
    for g in graphs:
        c.update(str(n.target) for n in g.graph.nodes if n.op == "call_function")
    return c


def _compiled_graphs(model, x) -> tuple[Counter, Counter]:
    _reset()
    graphs, backend = _capture_backend()
    torch.manual_seed(0)
    torch.compile(model, backend=backend, fullgraph=True)(x).float().square().mean().backward()
    assert not _graph_breaks(), _graph_breaks()
    return _ops(graphs["fw"]), _ops(graphs["bw"])


def _torch_checkpointed(model: nn.Module, types: tuple, context_fn=None) -> nn.Module:
    model = copy.deepcopy(model)
    kwargs = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    for m in model.modules():
        if isinstance(m, types):
            m.forward = functools.partial(checkpoint, m.forward, **kwargs)
    return model


def _grads(model, x, seed=0):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    model(x).float().square().mean().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


def _close(a, b, tol=1e-5):
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol, msg=f"grad {i}")


# ---- Inductor, both orders, fullgraph --------------------------------------------------


def _gpt():
    torch.manual_seed(0)
    return GPTStack(2, 64, 4, dropout=0.1).train(), GPTBlock, torch.randn(2, 16, 64)


class _LlamaOnEmbeddings(nn.Module):
    """The Llama test model from its embedding output on (a float input to compile)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        llama = Llama(vocab=64, dim=64, layers=2, heads=4, max_seq=16)
        self.layers, self.norm = llama.layers, llama.norm
        self.register_buffer("cos", llama.rope_cos, persistent=False)
        self.register_buffer("sin", llama.rope_sin, persistent=False)

    def forward(self, h):
        t = h.shape[1]
        for layer in self.layers:
            h = layer(h, self.cos[:t], self.sin[:t])
        return self.norm(h)


def _llama():
    return _LlamaOnEmbeddings(), LlamaBlock, torch.randn(2, 16, 64)


@pytest.mark.slow
@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt-dropout", "llama"])
@pytest.mark.parametrize("order", ["ac-then-compile", "compile-then-ac"])
def test_inductor_fullgraph_no_graph_break_and_grads_of_compiled_no_ac(make, order):
    model, block, x = make()
    plain = torch.compile(copy.deepcopy(model), fullgraph=True)
    ours = copy.deepcopy(model)
    if order == "ac-then-compile":
        ac.apply_ac(ours, [aten.mm.default], modules=[block], rng="replay")
        ours = torch.compile(ours, fullgraph=True)
    else:  # torchtitan's per-block compile, AC applied to the compiled blocks' modules
        for m in ours.modules():
            if isinstance(m, block):
                m.compile(fullgraph=True)
        ac.apply_ac(ours, [aten.mm.default], modules=[block], rng="replay")
    _reset()
    want = _grads(plain, x)
    got = _grads(ours, x)
    assert not _graph_breaks(), _graph_breaks()
    assert counters["stats"]["unique_graphs"] >= 1
    assert all(ac.is_checkpointed(m) for m in ours.modules() if isinstance(m, block))
    # Same seed, same random ops: dropout masks equal (they are saved, never recomputed).
    _close(want, got, 1e-4)


# ---- the policy in the compiled graphs --------------------------------------------------


def _every_second_matmul():
    seen = [0]

    def policy(ctx, op, *args, **kwargs):
        if op in (aten.mm.default, aten.addmm.default):
            seen[0] += 1
            return CP.MUST_SAVE if seen[0] % 2 else CP.PREFER_RECOMPUTE
        return CP.PREFER_RECOMPUTE

    return policy


def _save_mm_fn(ctx, op, *args, **kwargs):
    return CP.MUST_SAVE if op in SAVE_MM else CP.PREFER_RECOMPUTE


POLICIES = {
    "recompute_all": ("recompute_all", None),
    "must_save_all": ("must_save_all", lambda ctx, op, *a, **k: CP.MUST_SAVE),
    "save-list": (SAVE_MM, SAVE_MM),
    "callable": (_save_mm_fn, _save_mm_fn),
    "dict": ({aten.mm: CP.MUST_SAVE, aten.addmm: CP.MUST_SAVE, aten.gelu: CP.PREFER_RECOMPUTE}, SAVE_MM),
    "bool": (False, None),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_compiled_graph_saves_and_recomputes_what_the_policy_says(name):
    ours_policy, torch_policy = POLICIES[name]
    torch.manual_seed(0)
    base = GPTStack(2, 32, 4)
    x = torch.randn(2, 8, 32)
    ctx = None if torch_policy is None else functools.partial(create_selective_checkpoint_contexts, torch_policy)
    theirs = _torch_checkpointed(base, (GPTBlock,), ctx)
    fw_t, bw_t = _compiled_graphs(theirs, x)
    fw_a, bw_a = _compiled_graphs(ac.apply_ac(copy.deepcopy(base), ours_policy, modules=[GPTBlock]), x)
    assert (fw_a, bw_a) == (fw_t, bw_t)  # the same partitioned graphs as torch's SAC
    _, bw_none = _compiled_graphs(copy.deepcopy(base), x)
    recomputed_mm = bw_a["aten.addmm.default"] - bw_none["aten.addmm.default"]
    if name in ("recompute_all", "bool"):
        assert recomputed_mm > 0 and bw_a["aten.gelu.default"] > 0  # forward ops in backward
    else:
        assert recomputed_mm == 0  # matmul outputs saved, not recomputed


def test_stateful_policy_factory_and_nested_modules_compiled_like_torch():
    torch.manual_seed(0)
    base = GPTStack(2, 32, 4)
    x = torch.randn(2, 8, 32)
    theirs = _torch_checkpointed(
        base, (GPTBlock,), lambda: create_selective_checkpoint_contexts(_every_second_matmul()))
    ours = ac.apply_ac(copy.deepcopy(base), modules=[GPTBlock], policy_factory=_every_second_matmul)
    assert _compiled_graphs(ours, x) == _compiled_graphs(theirs, x)
    nested = StageStack(1, 32, 2)
    from models import Stage

    x = torch.randn(2, 8, 32)
    assert _compiled_graphs(ac.apply_ac(copy.deepcopy(nested), modules=[Stage, MLPLayer]), x) == \
        _compiled_graphs(_torch_checkpointed(nested, (Stage, MLPLayer)), x)


class _Tagged(nn.Module):
    def __init__(self, tag: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.tag = nn.Linear(16, 16), nn.Linear(16, 16), tag

    def forward(self, x):
        h = self.a(x).sin()
        if self.tag:
            h = ac.tag_with_policy(h)  # Note [Tags inside compiled code]: use the result
        return self.b(h).cos()


def test_tag_with_policy_compiled_saves_the_tensor():
    x = torch.randn(4, 16)
    fw_plain, bw_plain = _compiled_graphs(ac.wrap(_Tagged(False)), x)
    fw_tag, bw_tag = _compiled_graphs(ac.wrap(_Tagged(True)), x)
    # Untagged, sin is recomputed in backward (one sin for that, one in cos's backward).
    assert bw_plain["aten.sin.default"] == bw_tag["aten.sin.default"] + 1
    assert fw_tag["ac2_dist.tagged.default"] == 1
    eager = _grads(ac.wrap(_Tagged(True)), x)
    compiled = _grads(torch.compile(ac.wrap(_Tagged(True)), backend="aot_eager", fullgraph=True), x)
    _close(eager, compiled)


def test_random_ops_are_saved_not_recomputed_in_the_compiled_backward():
    torch.manual_seed(0)
    base = GPTStack(1, 32, 4, dropout=0.5).train()
    x = torch.randn(2, 8, 32)
    fw, bw = _compiled_graphs(ac.apply_ac(copy.deepcopy(base), modules=[GPTBlock], rng="replay"), x)
    random = [op for op in fw if any(k in op for k in ("bernoulli", "rand", "native_dropout"))]
    assert random and not [op for op in bw if op in random]
    eager = _grads(ac.apply_ac(copy.deepcopy(base), modules=[GPTBlock], rng="replay"), x, seed=3)
    compiled = _grads(torch.compile(ac.apply_ac(copy.deepcopy(base), modules=[GPTBlock]), backend="aot_eager"),
                      x, seed=3)
    _close(eager, compiled)  # aot_eager draws from the eager generator: the same masks


class _BrokenDropoutBlock(nn.Module):
    """Linear -> CPU dropout -> graph break -> Linear: dynamo runs the block's checkpoint
    eagerly (Note [Random writes in the dynamo fallback])."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 16)

    def forward(self, x):
        h = self.drop(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h).relu()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("rng", ["replay", "save"])
def test_graph_break_inside_a_block_with_cpu_dropout_matches_eager(rng, backend):
    _reset()
    torch.manual_seed(0)
    eager = nn.Sequential(_BrokenDropoutBlock(), _BrokenDropoutBlock()).train()
    model = torch.compile(ac.apply_ac(copy.deepcopy(eager), modules=[_BrokenDropoutBlock], rng=rng),
                          backend=backend)
    x = torch.randn(4, 16)
    for seed in (1, 2):  # the second step runs the compiled code again
        want, got = _grads(eager, x, seed=seed), _grads(model, x, seed=seed)
        for i, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), f"grad {i} differs at seed {seed}"
    assert _graph_breaks()  # the case under test: dynamo did break inside the block


# ---- eager-only features: refused or announced --------------------------------------------


def _drop_leaked_sac_modes() -> int:
    """torch < 2.13 leaves its selective-checkpoint dispatch mode on the stack when a policy
    raises while AOTAutograd traces; later ops of the process would all go through it."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode
    from torch.utils.checkpoint import _CachingTorchDispatchMode

    leaked = 0
    while _get_current_dispatch_mode_stack() and isinstance(_get_current_dispatch_mode_stack()[-1],
                                                            _CachingTorchDispatchMode):
        _pop_mode()
        leaked += 1
    return leaked


def _torch_at_least(major: int, minor: int) -> bool:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (major, minor)


def test_eager_only_features_are_refused_or_announced():
    hooks = ac.SAVE_WITH_HOOKS(lambda t: t, lambda t: t)
    x = torch.randn(4, 16, requires_grad=True)

    def offload_policy(ctx, op, *args, **kwargs):
        return hooks if op is aten.sin.default else CP.PREFER_RECOMPUTE

    _reset()
    with pytest.raises(Exception, match="SAVE_WITH_HOOKS and CPU offload run only in eager mode"):
        torch.compile(ac.wrap(_Tagged(False), offload_policy), backend="aot_eager")(x).sum().backward()
    leaked = _drop_leaked_sac_modes()
    assert leaked == 0 or not _torch_at_least(2, 13)

    class HookTag(_Tagged):
        def forward(self, x):
            return self.b(ac.tag_with_policy(self.a(x).sin(), hooks)).cos()

    _reset()
    with pytest.raises(Exception, match="tag_with_policy with SAVE_WITH_HOOKS or a CPU-offload policy is eager-only"):
        torch.compile(ac.wrap(HookTag(False)), backend="aot_eager", fullgraph=True)(x)
    _reset()
    with pytest.raises(RuntimeError, match="tag_with_policy with SAVE_WITH_HOOKS"):
        torch.compile(ac.wrap(HookTag(False)), backend="aot_eager")(x)

    _reset()
    scheduled = ac.wrap(_Tagged(False), replay=ac.ReplayConfig(stream="inline", prefetch=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        compiled = torch.compile(scheduled, backend="aot_eager", fullgraph=True)
        for _ in range(2):
            compiled(x).sum().backward()
    ours = [w for w in caught if "ReplayConfig" in str(w.message)]
    assert len(ours) == 1 and "eager ac2 regions only" in str(ours[0].message)
    assert not _graph_breaks()


# ---- distributed: FSDP2 per-block compile, collectives ------------------------------------

_COLLECTIVE_NAMES = ("c10d::", "_c10d_functional::")


def _collectives_in_backward(loss) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    return sorted(e.name for e in prof.events()
                  if e.name.startswith(_COLLECTIVE_NAMES) and "wait" not in e.name)


def _fsdp_compiled(rank, world, use_ac):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Llama(vocab=64, dim=64, layers=2, heads=4, max_seq=16)
    mesh = init_device_mesh("cpu", (world,))
    if use_ac:  # torchtitan's order: AC, compile each block, fully_shard
        ac.apply_ac(model, "recompute_all", modules=[LlamaBlock])
    for blk in model.layers:
        blk.compile(fullgraph=True)
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, collectives = [], []
    for step in range(3):
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        collectives.append(_collectives_in_backward(loss))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "collectives": collectives, "breaks": len(counters["graph_break"])}


def _fsdp_both(rank, world):
    return {"ac2": _fsdp_compiled(rank, world, True), "none": _fsdp_compiled(rank, world, False)}


@pytest.mark.slow
def test_fsdp2_per_block_compile_with_ac2_matches_no_ac():
    for rank, r in enumerate(run_ranks(_fsdp_both)):
        ours, plain = r["ac2"], r["none"]
        print(f"\n  rank {rank}: losses ac2 {ours['losses']} no AC {plain['losses']}")
        assert ours["breaks"] == 0
        for a, b in zip(ours["losses"], plain["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b)
        assert ours["collectives"] == plain["collectives"]  # nothing re-issued in backward
        gathers = [sum("all_gather" in n or "allgather" in n for n in step) for step in ours["collectives"]]
        assert all(0 < g <= 2 for g in gathers)  # at most one all-gather per resharded block


class _AllReduceBlock(nn.Module):
    """A block with a functional all-reduce inside (a tensor-parallel-style reduction)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        h = self.a(x).sin()
        s = funcol.all_reduce(h.detach().sum(0), "sum", torch.distributed.group.WORLD)
        return self.b(h * s).tanh()


def _funcol_compiled(rank, world):
    out = {}
    for name in ("none", "ac2"):
        _reset()
        block = _AllReduceBlock()
        if name == "ac2":
            ac.wrap(block, "recompute_all")
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        loss = compiled(x).square().sum()
        out[name] = {"collectives": _collectives_in_backward(loss), "grad": x.grad.tolist(),
                     "breaks": len(counters["graph_break"])}
    return out


def test_collectives_in_a_compiled_block_are_not_reissued_in_backward():
    for r in run_ranks(_funcol_compiled):
        assert r["ac2"]["breaks"] == 0
        assert r["ac2"]["collectives"] == r["none"]["collectives"]
        assert r["ac2"]["grad"] == r["none"]["grad"]
