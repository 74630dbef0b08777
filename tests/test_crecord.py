"""The C recorder (Note [The plain-op path in C] in ac2_dist/_trace/_crecord.c): built and in use
where a compiler was there at install time, switchable off, the same graphs as the Python
recorder, no reference leaked, errors propagated."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import sysconfig
import weakref

import _hang
import pytest
import torch
from _models import GPT, ConvBN, DropoutMLP, live_instances
from test_recording_cost import _graph_facts

import ac2_dist as ac
from ac2_dist._trace import _graph, _nodes, _tracer

aten = torch.ops.aten
_PURE = os.environ.get("AC2_DIST_PURE_PYTHON", "0") != "0"
needs_c = pytest.mark.skipif(_tracer.C_DISPATCH is None, reason="the C recorder is off or was not built")


def test_the_recorder_in_use_is_the_one_the_switch_and_the_build_say():
    if _PURE:  # CI step 6 (the GPU machine's stack) runs the suite on the Python recorder
        assert _tracer.C_DISPATCH is None and _tracer.Tracer.__torch_dispatch__ is _tracer.PY_DISPATCH
        return
    if not sysconfig.get_config_var("CC"):
        pytest.skip("this Python has no C compiler configured: the extension is optional")
    # A compiler was there at install time (CI installs with one): the extension must
    # have been built, and the tracer must use it.
    from ac2_dist._trace import _crecord

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
        "from ac2_dist._trace import _tracer as t; import torch, ac2_dist as ac\n"
        "assert t.C_DISPATCH is None and t.Tracer.__torch_dispatch__ is t.PY_DISPATCH\n"
        "x = torch.randn(4, requires_grad=True)\n"
        "with ac.apply_ac_policy('recompute_all'):\n"
        "    y = (x.tanh() * x).sum()\n"
        "g, = torch.autograd.grad(y, x)\n"
        "assert torch.equal(g, torch.autograd.grad((x.tanh() * x).sum(), x)[0])\n"
        "print('ok')\n"
    )
    env = dict(os.environ, AC2_DIST_PURE_PYTHON="1")
    out = _hang.run([sys.executable, "-c", code], env=env)
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
    return live_instances(cls)  # tracked or not (Note [Plain records are not tracked by the collector])


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


# ---- Note [Plain records are not tracked by the collector] (_crecord.c) -------------------


@needs_c
def test_plain_records_are_off_the_collectors_lists():
    # The C recorder's nodes, their inputs tuples and the handles' weak references are not
    # tracked by the cyclic collector; the Python recorder's are. Both graphs are freed by
    # reference counting alone once the output is dropped.
    x = torch.randn(16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)

    def region():
        with ac.apply_ac_policy("recompute_all") as r:
            h = x
            for _ in range(50):
                h = torch.tanh(h) * w
        return r.graph, h

    region()  # op facts cached: the next region records its ops in C
    for recorder, tracked in (("c", False), ("python", True)):
        with _tracer.recording_in_python() if recorder == "python" else contextlib.nullcontext():
            graph, out = region()
        plain = [h.node for h in graph.handles if h.node.op is not None]
        assert len(plain) >= 50
        assert all(gc.is_tracked(n) is tracked and gc.is_tracked(n.inputs) is tracked for n in plain), recorder
        refs = [r for r in graph._handle_refs if r().node.op is not None]  # (a leaf's may be Python's)
        assert all(gc.is_tracked(r) is tracked for r in refs), recorder
        nodes = weakref.ref(plain[0])
        ref = weakref.ref(graph)
        gc.disable()
        try:
            del graph, out, plain, refs
            assert ref() is None and nodes() is None  # freed by refcount, with no collection
        finally:
            gc.enable()


class _Owner(torch.nn.Module):
    """A module that keeps its last region (for its stats, say) and whose parameter refers
    back to it: a saved tensor (the parameter) reaches an object that holds the graph."""

    def __init__(self, rng: str):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8))
        self.w.owner = self
        self.rng = rng

    def forward(self, x):
        with ac.apply_ac_policy("recompute_all", rng=self.rng) as region:
            h = torch.tanh(x * self.w) * self.w
            y = torch.nn.functional.dropout(torch.tanh(h) + 1.0, 0.5)  # a random op after plain ops
        self.region = region
        return y.sum()


@pytest.mark.parametrize("recorder", ["c", "python"])
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("rng", ["save", "replay"])
def test_a_cycle_through_user_objects_is_still_collected(rng, backward, recorder):
    # Note [A graph holds only tracked nodes] (_tracer.py): with rng="replay" the graph
    # keeps its random ops' chains, whose nodes reach the plain ops recorded before them.
    # Were those untracked, the cycle model -> region -> graph -> chain -> nodes -> leaf ->
    # parameter -> model could not be collected (it leaked with the C recorder before the
    # region exit tracked them again).
    if recorder == "c" and _tracer.C_DISPATCH is None:
        pytest.skip("the C recorder is off or was not built")
    with _tracer.recording_in_python() if recorder == "python" else contextlib.nullcontext():
        _Owner(rng)(torch.randn(4, 8)).backward()  # ops seen once: recorded in C from here on
        model = _Owner(rng)
        out = model(torch.randn(4, 8, requires_grad=True))
        if backward:
            out.backward()
        graph, owner = weakref.ref(model.region.graph), weakref.ref(model)
        assert graph() is not None
        del model, out
        gc.collect()
        assert graph() is None and owner() is None


def _untracked_reached(*roots) -> list:
    """Untracked nodes (or tuples of nodes) reached from ``roots`` through references the
    cyclic collector follows: through tracked ac2 objects, modules and plain containers
    (tensors and functions are not entered; an untracked object's references are not
    followed, the collector does not see them)."""
    seen, found, todo = set(), [], list(roots)
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if not (isinstance(o, (list, tuple, dict, set, torch.nn.Module)) or type(o).__module__.startswith("ac2_dist")):
            continue
        if not gc.is_tracked(o):
            if type(o) is _nodes.Node or (type(o) is tuple and any(type(i) is _nodes.Node for i in o)):
                found.append(o)
            continue
        todo.extend(gc.get_referents(o))
    return found


def _referrers_of_untracked_nodes() -> set:
    """Types of the tracked objects that refer to an untracked node (or to an untracked
    tuple of nodes); a node's own fields (its inputs tuple, its rare-field dict and the
    tuples in it) count as the node."""
    objects = gc.get_objects()
    nodes = [o for o in objects if type(o) is _nodes.Node]
    fields = gc.get_referents(*nodes)
    owned = {id(f) for f in fields + gc.get_referents(*[f for f in fields if type(f) is dict])}
    kinds = set()
    for o in objects:
        if id(o) in owned:
            continue
        for r in gc.get_referents(o):
            if gc.is_tracked(r):
                continue
            if type(r) is _nodes.Node or (type(r) is tuple and any(type(i) is _nodes.Node for i in r)):
                kinds.add(type(o).__name__)
    return kinds


@needs_c
@pytest.mark.parametrize("case", ["recompute_all", "rng-replay", "save-list", "budget-module", "tracker"])
def test_nothing_a_user_holds_reaches_an_untracked_node(case):
    # Note [A graph holds only tracked nodes]: after forward (and after backward), the
    # region, its graph, the budget and the tracker reach no untracked node, and the only
    # tracked objects that refer to one are nodes (recorded in Python) and handles, which
    # autograd holds (its references are not the collector's to follow).
    from models import GPTBlock

    torch.manual_seed(0)
    model = GPT(layers=2, d=32, heads=4, dropout=0.1)
    x = torch.randn(2, 8, 32)
    roots: list = [model]
    if case in ("budget-module", "tracker"):
        budget = ac.MemoryBudget(0.5) if case == "budget-module" else "recompute_all"
        ac.apply_ac(model, budget, modules=[GPTBlock])
        roots.append(budget)
        if case == "tracker":
            tracker = ac.memory.track(model)
            tracker.__enter__()
            roots.append(tracker)

        def forward():
            return model(x).sum(), None
    else:
        policy = [aten.addmm.default] if case == "save-list" else "recompute_all"
        rng = "replay" if case == "rng-replay" else "save"

        def forward():
            with ac.apply_ac_policy(policy, rng=rng) as region:
                y = model(x).sum()
            return y, region

    for _ in range(3):  # op facts cached, a budget calibrated
        y, region = forward()
        y.backward()
    y, region = forward()
    if region is not None:
        roots += [region, region.graph]
    untracked = live_instances(_nodes.Node) - sum(1 for o in gc.get_objects() if type(o) is _nodes.Node)
    # (a calibrating budget's regions record in Python: its observer sees every op)
    assert untracked > 0 or case == "budget-module", "nothing recorded in C: the test would test nothing"
    for phase in ("forward", "backward"):
        assert _untracked_reached(*roots) == [], phase
        assert _referrers_of_untracked_nodes() <= {"Node", "Handle"}, phase
        if phase == "forward":
            y.backward(retain_graph=True)
    if case == "tracker":
        tracker.__exit__(None, None, None)
