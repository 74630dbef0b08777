"""The C recorder (Note [The plain-op path in C] in ac2_dist/_crecord.c): built and in use
where a compiler was there at install time, switchable off, the same graphs as the Python
recorder, no reference leaked, errors propagated."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import sysconfig

import pytest
import torch
from _models import GPT, ConvBN, DropoutMLP
from test_recording_cost import _graph_facts

import ac2_dist as ac
from ac2_dist import _graph, _nodes, _tracer

aten = torch.ops.aten
_PURE = os.environ.get("AC2_DIST_PURE_PYTHON", "0") != "0"
needs_c = pytest.mark.skipif(_tracer.C_DISPATCH is None, reason="the C recorder is off or was not built")


def test_the_recorder_in_use_is_the_one_the_switch_and_the_build_say():
    if _PURE:  # CI's lowest-torch step runs the whole suite on the Python recorder
        assert _tracer.C_DISPATCH is None and _tracer.Tracer.__torch_dispatch__ is _tracer.PY_DISPATCH
        return
    if not sysconfig.get_config_var("CC"):
        pytest.skip("this Python has no C compiler configured: the extension is optional")
    # A compiler was there at install time (CI installs with one): the extension must
    # have been built, and the tracer must use it.
    from ac2_dist import _crecord

    assert isinstance(_tracer.C_DISPATCH, _crecord.Dispatch)
    assert _tracer.Tracer.__torch_dispatch__ is _tracer.C_DISPATCH
    assert _tracer.C_DISPATCH.python is _tracer.PY_DISPATCH
    x = torch.randn(3, requires_grad=True)
    with ac.apply_ac_policy("recompute_all") as region:
        pack, _ = torch._C._autograd._top_saved_tensors_default_hooks(False)
        y = x.tanh().sum()
    assert isinstance(pack, _crecord.Pack) and pack.__self__ is region.graph
    assert region.stats.nodes == 3  # the leaf x, tanh (the C path), sum
    assert torch.equal(torch.autograd.grad(y, x)[0], torch.autograd.grad(x.tanh().sum(), x)[0])


def test_the_switch_turns_the_c_recorder_off_in_a_fresh_process():
    code = (
        "from ac2_dist import _tracer as t; import torch, ac2_dist as ac\n"
        "assert t.C_DISPATCH is None and t.Tracer.__torch_dispatch__ is t.PY_DISPATCH\n"
        "x = torch.randn(4, requires_grad=True)\n"
        "with ac.apply_ac_policy('recompute_all'):\n"
        "    y = (x.tanh() * x).sum()\n"
        "g, = torch.autograd.grad(y, x)\n"
        "assert torch.equal(g, torch.autograd.grad((x.tanh() * x).sum(), x)[0])\n"
        "print('ok')\n"
    )
    env = dict(os.environ, AC2_DIST_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _gpt():
    torch.manual_seed(0)
    return GPT(layers=2, d=32, heads=4), torch.randn(2, 8, 32)


def _conv():
    torch.manual_seed(0)
    return ConvBN(), torch.randn(2, 3, 8, 8)


def _dropout():
    torch.manual_seed(0)
    return DropoutMLP(), torch.randn(4, 32)


def _scalars():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            h = self.lin(x)
            h = torch.clamp(h, -0.5, 0.5) * 3.0  # scalar arguments: recorded, not shared Nones
            h = torch.pow(h, 2) + torch.where(h > 0, h, x)
            h.add_(1.0)  # a write: the general path, then the written value is a new leaf
            return torch.sigmoid(h).sum(dim=-1)

    return M(), torch.randn(4, 8, requires_grad=True)


_PROGRAMS = {"gpt": _gpt, "conv-bn": _conv, "dropout": _dropout, "scalars-and-writes": _scalars}
_POLICIES = {
    "recompute_all": "recompute_all",
    "save-list": [aten.addmm.default, aten.mul.Tensor],
    "must-recompute": {aten.add.Tensor: torch.utils.checkpoint.CheckpointPolicy.MUST_RECOMPUTE},
}


@needs_c
@pytest.mark.parametrize("policy", list(_POLICIES))
@pytest.mark.parametrize("program", list(_PROGRAMS))
def test_c_and_python_record_the_same_graph(program, policy):
    # Both recorders on one model and input: the same nodes (ops, seqs, inputs, use
    # counts, saves, readers, handles, policy marks, recorded args), the same node count,
    # gradients bitwise eager's. Each run builds the model afresh from one seed (batch
    # norm's running statistics are written every step) and draws dropout from one seed.
    def run(region_policy):
        model, x = _PROGRAMS[program]()  # a fresh model each run: buffers' versions alike
        params = [p for p in model.parameters() if p.requires_grad]
        torch.manual_seed(1)
        if region_policy is None:
            y = model(x).square().sum()
            return None, None, torch.autograd.grad(y, params)
        with ac.apply_ac_policy(region_policy) as region:
            y = model(x).square().sum()
        facts = _graph_facts(region.graph)
        return facts, region.stats.nodes, torch.autograd.grad(y, params)

    pol = _POLICIES[policy]
    ref = run(None)[2]
    in_c = run(pol)
    with _tracer.recording_in_python():
        in_py = run(pol)
    assert in_c[0] == in_py[0]
    assert in_c[1] == in_py[1]
    assert len(in_c[0]) > 5
    for a, b, r in zip(in_c[2], in_py[2], ref):
        assert torch.equal(a, r) and torch.equal(b, r)


def _live(cls) -> int:
    return sum(1 for o in gc.get_objects() if type(o) is cls)


@needs_c
def test_c_recorder_leaks_no_reference():
    # Every object the C recorder touches per op keeps the reference count it had: the
    # op, the tensors, the shared empty kwargs and argument tuples; nodes, map entries and
    # handles are all freed once the step's tensors are.
    x = torch.randn(16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    ops = (aten.tanh.default, aten.mul.Tensor)

    def step(n):
        with ac.apply_ac_policy("recompute_all") as region:
            h = x
            for _ in range(n):
                h = torch.tanh(h) * w
            y = (h * 0.5).sum()
        y.backward()
        return region.stats.nodes

    step(10)  # op facts, policy answers: cached once
    gc.collect()
    before = [sys.getrefcount(o) for o in (x, w, *ops, _nodes.NO_KWARGS, *_tracer._NONES)]
    nodes, entries, handles = _live(_nodes.Node), _live(_nodes.MapEntry), _live(_nodes.Handle)
    assert step(500) >= 1000
    gc.collect()
    after = [sys.getrefcount(o) for o in (x, w, *ops, _nodes.NO_KWARGS, *_tracer._NONES)]
    assert after == before
    assert _live(_nodes.Node) == nodes and _live(_nodes.MapEntry) == entries and _live(_nodes.Handle) == handles


@needs_c
def test_dead_plain_outputs_free_their_nodes_during_forward():
    # Note [Map entries are the weak references]: the C path's entries carry the same
    # callback; a plain op's output that dies frees its entry and, with no reader, its node.
    x = torch.randn(16)
    with ac.apply_ac_policy("recompute_all") as region:
        for _ in range(100):
            torch.tanh(x)  # output dropped at once
        graph = region.graph
        assert len(graph.map._d) <= 3
        assert graph.stats.nodes == 101  # the leaf x and 100 tanh


@pytest.mark.parametrize("recorder", ["c", "python"])
def test_an_error_while_recording_propagates_from_either_recorder(recorder, monkeypatch):
    # Graph.ref raising inside the argument walk (after the op ran): the error reaches the
    # caller unchanged, the region exits cleanly, and the next region records normally.
    if recorder == "c" and _tracer.C_DISPATCH is None:
        pytest.skip("the C recorder is off or was not built")

    def broken(self, t, allow_mutation):
        raise RuntimeError("ref failed on purpose")

    x = torch.randn(8, requires_grad=True)
    with _tracer.recording_in_python() if recorder == "python" else contextlib.nullcontext():
        monkeypatch.setattr(_graph.Graph, "ref", broken)
        with pytest.raises(RuntimeError, match="ref failed on purpose"):
            with ac.apply_ac_policy("recompute_all"):
                torch.tanh(x)  # x is a region input: the walk asks Graph.ref for its leaf
        monkeypatch.undo()
        with ac.apply_ac_policy("recompute_all"):
            y = (torch.tanh(x) * x).sum()
        (g,) = torch.autograd.grad(y, x)
        (r,) = torch.autograd.grad((torch.tanh(x) * x).sum(), x)
        assert torch.equal(g, r)
