"""The plain replay path (Note [The plain replay path] in ac2_dist/_trace/_replayer.py) against
the general one (``Replayer._run``: ``_execute`` + ``_keep``): the same gradients, the
same values freed at the same unpack, the same statistics, on programs that mix plain
nodes with every kind the general path handles (writes, scratch accumulators, random
ops, multi-output ops, keyword arguments, saved inputs, cut nodes of nested regions,
retained and create_graph backwards)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from _models import GPT, ConvBN, DropoutMLP
from models import MLPLayer, Stage

import ac2_dist as ac
from ac2_dist import memory, replay
from ac2_dist._trace import _graph, _replayer

aten = torch.ops.aten


def _chain(scale):
    torch.manual_seed(0)
    x = torch.randn(64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)

    def fn():
        h = x
        for _ in range(50):
            h = torch.tanh(h) * (scale if scale is not None else w)
        return h.sum()
    return fn, [x] if scale is not None else [x, w]


def _model(make, shape):
    def build():
        torch.manual_seed(0)
        model = make()
        x = torch.randn(*shape)
        return (lambda: model(x).square().sum()), [p for p in model.parameters() if p.requires_grad]
    return build


def _mixed():
    # Multi-output ops (max.dim, split), keyword-only arguments (gelu's approximate,
    # add's alpha), a scalar argument, a write into a fresh value and a view of it.
    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)

    def fn():
        h = torch.tanh(x @ w)
        h = F.gelu(h, approximate="tanh")
        m, _ = torch.max(h, dim=-1, keepdim=True)
        a, b = torch.split(h - m, 4, dim=-1)
        h = torch.cat([a.sigmoid(), torch.add(b, a, alpha=0.5)], dim=-1)
        h = h * 1.5
        h.relu_()
        h = torch.clamp(h, -2.0, 2.0) @ w
        return h.square().sum()
    return fn, [x, w]


def _cut():
    # Checkpointed layers inside the region: their outputs are cut nodes (Note [Nested
    # modules cut the replay]), filled by private replays; tanh between them is plain.
    torch.manual_seed(0)
    model = ac.apply_ac(Stage(16, 3), "recompute_all", modules=[MLPLayer])
    x = torch.randn(4, 16, requires_grad=True)
    return (lambda: model(x).tanh().square().sum()), [x, *model.parameters()]


_PROGRAMS = {
    "scalar-chain": lambda: _chain(1.0001),
    "weight-chain": lambda: _chain(None),
    "gpt": _model(lambda: GPT(layers=2, d=32, heads=4), (2, 8, 32)),
    "conv-bn": _model(ConvBN, (2, 3, 8, 8)),
    "dropout": _model(DropoutMLP, (4, 32)),
    "mixed": _mixed,
    "cut": _cut,
}
_POLICIES = {
    "recompute_all": dict(policy="recompute_all"),
    "save-list": dict(policy=[aten.mm.default, aten.addmm.default, aten.mul.Tensor]),
    "rng-replay": dict(policy="recompute_all", rng="replay"),
    "nested": None,  # cut nodes: a recompute_all region inside a save-list one
}


def _run(program: str, policy: str, general: bool, monkeypatch, backward: str = "plain"):
    """One forward in a region and its backward, with the plain path on or off. Returns
    the gradients, the region's statistics, the statistics after each unpack, the final
    use counts, which nodes still hold values, and how many nodes ``_run`` replayed."""
    fn, params = _PROGRAMS[program]()
    ran: list[int] = []
    trace: list[tuple] = []
    unpack, run = _graph.Graph.unpack, _replayer.Replayer._run

    def traced_unpack(self, h):
        v = unpack(self, h)
        s = self.stats
        trace.append((h.node.seq, h.idx, s.recomputed_ops, s.recomputed_bytes, s.cached_bytes,
                      s.peak_cached_bytes))
        return v

    def counted_run(self, node):
        ran.append(node.seq)
        return run(self, node)

    monkeypatch.setattr(_graph.Graph, "unpack", traced_unpack)
    monkeypatch.setattr(_replayer.Replayer, "_run", counted_run)
    if general:  # every node through _run (Note [The plain replay path])
        monkeypatch.setattr(_replayer, "_INFO", {})
    torch.manual_seed(1)
    with memory.track() as tracker:
        if policy == "nested":
            with ac.apply_ac_policy([aten.mm.default, aten.addmm.default]) as region:
                with ac.apply_ac_policy("recompute_all"):
                    y = fn()
        else:
            with ac.apply_ac_policy(**_POLICIES[policy]) as region:
                y = fn()
        graph = region.graph
        if backward == "retain":
            first = torch.autograd.grad(y, params, retain_graph=True)
            grads = torch.autograd.grad(y, params)
            assert all(torch.equal(a, b) for a, b in zip(first, grads))
        elif backward == "create_graph":
            grads = torch.autograd.grad(y, params, create_graph=True)
            sum(g.square().sum() for g in grads).backward()
            grads = [*grads, *(p.grad for p in params)]
        else:
            grads = torch.autograd.grad(y, params)
    assert graph.has_cuts == (program == "cut")
    stats = dataclasses.replace(region.stats, replay_seconds=0.0)
    nodes = {n.seq: n for n in _nodes_of(graph)}
    held = sorted(s for s, n in nodes.items() if n.values is not None and any(v is not None for v in n.values))
    monkeypatch.undo()
    return [g.detach() for g in grads], stats, trace, list(graph.uses), held, ran, tracker


def _nodes_of(graph):
    seen: dict[int, object] = {}
    todo = [h.node for h in graph.live_handles()]
    while todo:
        n = todo.pop()
        if n.seq not in seen:
            seen[n.seq] = n
            todo.extend(n.inputs[1::3])
    return seen.values()


def _eager(program: str):
    fn, params = _PROGRAMS[program]()
    torch.manual_seed(1)
    return torch.autograd.grad(fn(), params)


@pytest.mark.parametrize("policy", list(_POLICIES))
@pytest.mark.parametrize("program", list(_PROGRAMS))
def test_plain_replay_path_matches_the_general_path(program, policy, monkeypatch):
    plain = _run(program, policy, False, monkeypatch)
    general = _run(program, policy, True, monkeypatch)
    for a, b, r in zip(plain[0], general[0], _eager(program)):
        assert torch.equal(a, b) and torch.equal(a, r)
    assert plain[1] == general[1]  # every counter, peak and per-module bytes included
    assert plain[1].recomputed_ops > 0
    assert plain[2] == general[2]  # the same values alive after every unpack
    assert plain[3] == general[3] and plain[4] == general[4]
    assert plain[1].cached_bytes == 0 and not plain[4]  # nothing recomputed outlives backward
    assert plain[6].report().recomputed_bytes == general[6].report().recomputed_bytes
    # The general run replayed every node through _run (private replays of cut nodes
    # and RNG chains run _execute only); the plain one fewer: none on the chains.
    assert 0 < len(general[5]) <= general[1].recomputed_ops
    assert len(plain[5]) < len(general[5])
    if program.endswith("chain"):
        assert plain[5] == []


@pytest.mark.parametrize("backward", ["retain", "create_graph"])
@pytest.mark.parametrize("program", ["scalar-chain", "weight-chain", "mixed"])
def test_plain_replay_path_in_retained_and_create_graph_backwards(program, backward, monkeypatch):
    plain = _run(program, "recompute_all", False, monkeypatch, backward)
    general = _run(program, "recompute_all", True, monkeypatch, backward)
    for a, b in zip(plain[0], general[0]):
        assert torch.equal(a, b)
    assert plain[1] == general[1]
    assert plain[2] == general[2]
    assert plain[3] == general[3] and plain[4] == general[4]


def test_an_executor_whose_run_does_more_is_called_for_plain_nodes(monkeypatch):
    # InlineExecutor.calls_ops_directly: an executor that sets it False gets every
    # replayed op through its run, plain nodes included.
    calls: list[object] = []

    class Counting(replay.InlineExecutor):
        calls_ops_directly = False

        def run(self, node, args, kwargs, chain=None):
            calls.append(node.op)
            return super().run(node, args, kwargs, chain)

    fn, params = _chain(1.0001)
    ref = torch.autograd.grad(fn(), params)
    with ac.apply_ac_policy("recompute_all") as region:
        y = fn()
    region.graph.executor = Counting(region.graph.executor._state_of_thread)
    grads = torch.autograd.grad(y, params)
    assert torch.equal(grads[0], ref[0])
    assert len(calls) == region.stats.recomputed_ops == 99  # the last mul: nothing needs it
    assert set(calls) == {aten.tanh.default, aten.mul.Tensor}
