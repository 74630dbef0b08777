"""Region inputs rebuilt from a recipe (``apply_ac(..., rebuild=)``).

Note [A region rebuilds an input from its recipe]
    A module that runs outside every region and hands its result to several regions (a
    causal LM's rotary embedding: cos and sin from the positions, read by every layer)
    makes region inputs, and a region keeps its inputs through backward, as torch's
    checkpoint does. A whole-model partitioner (``torch.compile``) instead keeps the
    positions and recomputes the tables in backward. ``rebuild`` names such modules.

    Recording: the module's forward runs under :class:`_Recorder`, a dispatch mode that
    notes every ATen op (op, arguments with each tensor either an earlier op's output or
    an outside tensor, its inputs) until the forward returns. The recipe is refused -- the
    outputs stay plain tensors, kept by the regions that read them as before -- at the
    first op that is not a pure function of its arguments: a random draw, a collective or
    other side effect, an in-place write, an output that shares an argument's memory
    undeclared (except its first argument's, which it records as the tracer does), a
    tensor subclass, a non-tensor result, an argument read for its shape only. An output
    made by a recorded op, not requiring grad (a tensor with a history is autograd's to
    keep), gets the recipe, per thread, while it lives and is unchanged (its version).

    Using it: a region that meets such a tensor as an input it has not seen
    (``Graph.ref``, the seam) records the recipe's ops that lead to it into its own graph
    as recomputable nodes reading the recipe's inputs (the positions; the module's
    buffers, which live anyway) and maps the tensor to the last of them; a second output
    of the same recipe reuses the nodes already recorded there. The region then holds the
    recipe's inputs instead of the tensor, and backward replays the recipe where a saved
    value needs it and frees it by use count, as any replayed value. The policy is never
    asked about these ops: they are not saved, since each region would keep its own
    copy of what the module made once. A recipe whose outside inputs (not counting the
    module's parameters and buffers) are as large as its outputs is not used: holding
    them would cost more than the outputs. The ops replay as recorded, on the same
    inputs: the value is the forward's bit for bit.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from ._trace._nodes import version_of
from ._trace._tracer import Tracer
from .compile import announce_eager_only, is_compiling
from .side_effects import SideEffect, op_info

__all__: list[str] = []

_ATTR = "_ac2_rebuild"  # a rebuild module's _Rebuild
_Tensor = torch.Tensor


class _Step:
    """One recorded op: its arguments with tensors replaced by None, and where each
    tensor came from: ``refs`` flat ``(pos, step, idx)``, ``step`` -1 for an outside
    tensor (``idx`` into :attr:`_Recipe.leaves`); ``pos`` is ``i``, ``name`` or
    ``(i or name, k)`` for a list element (as the tracer records them)."""

    __slots__ = ("op", "args", "kwargs", "refs", "nout", "lists", "view_src", "alias")

    def __init__(self, op: Any, args: tuple, kwargs: dict, refs: tuple, nout: int, lists: bool,
                 view_src: int | None, alias: bool) -> None:
        self.op, self.args, self.kwargs, self.refs, self.nout = op, args, kwargs, refs, nout
        self.lists, self.view_src, self.alias = lists, view_src, alias


class _Recipe:
    """What a rebuild module's forward ran: its steps and the outside tensors they read."""

    __slots__ = ("steps", "leaves", "__weakref__")

    def __init__(self) -> None:
        self.steps: list[_Step] = []
        self.leaves: list[torch.Tensor] = []

    def cone(self, step: int) -> list[int]:
        """The steps ``step`` depends on, itself included, in recorded order."""
        need = {step}
        for s in range(step, -1, -1):
            if s in need:
                refs = self.steps[s].refs
                need.update(refs[i + 1] for i in range(0, len(refs), 3) if refs[i + 1] >= 0)
        return sorted(need)


class _Recorder(TorchDispatchMode):
    """Records a rebuild module's ops (Note [A region rebuilds an input from its recipe])."""

    def __init__(self) -> None:
        super().__init__()
        self.recipe = _Recipe()
        self.made: dict[int, tuple[weakref.ref, int, int, int]] = {}  # id -> (ref, step, idx, version)
        self.leaf_index: dict[int, int] = {}
        self.why: str | None = None  # why the recipe was refused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.why is None:
            try:
                self.why = self._record(func, types, args, kwargs, out)
            except Exception as e:  # noqa: BLE001 - an op the recorder cannot describe: no recipe, the op ran
                self.why = f"{func}: {type(e).__name__}: {e}"
        return out

    def _source(self, t: torch.Tensor) -> tuple[int, int]:
        e = self.made.get(id(t))
        if e is not None and e[0]() is t and e[3] == version_of(t):
            return e[1], e[2]
        k = self.leaf_index.get(id(t))
        leaves = self.recipe.leaves
        if k is None or leaves[k] is not t:
            k = self.leaf_index[id(t)] = len(leaves)
            leaves.append(t)
        return -1, k

    def _record(self, func: Any, types: Any, args: tuple, kwargs: dict, out: Any) -> str | None:
        info = op_info(func)
        if types:
            return f"{func} ran on a tensor subclass"
        if info.higher_order or info.side_effect is not SideEffect.NONE:
            return f"{func} has a side effect"
        if info.written and info.writes(args):
            return f"{func} writes in place"
        if info.is_rng and info.is_random(args, kwargs):
            return f"{func} draws random numbers"
        if info.shape_only or info.accumulators:
            return f"{func} reads an argument for its shape"
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        if not all(isinstance(o, _Tensor) for o in flat):
            return f"{func} returned something other than tensors"
        alias = False
        if info.view_src is None and not info.fresh_output:  # Note [Aliases a schema does not declare] (_tracer.py)
            ptrs = {a.data_ptr() for a in _tensors(args, kwargs) if a.numel()}
            if any(o.numel() and o.data_ptr() in ptrs for o in flat):
                a0 = args[0] if args and isinstance(args[0], _Tensor) else None
                if len(flat) != 1 or a0 is None or flat[0].data_ptr() != a0.data_ptr():
                    return f"{func} returned a tensor sharing an argument's memory"
                alias = True  # of its first argument (``_unsafe_view`` after a matmul), as the tracer records it
        refs: tuple = ()
        targs = list(args)
        lists = False
        for i, a in enumerate(args):
            if isinstance(a, _Tensor):
                refs += (i, *self._source(a))
                targs[i] = None
            elif type(a) in (list, tuple) and any(isinstance(e, _Tensor) for e in a):
                lst = list(a)
                for k, e in enumerate(a):
                    if isinstance(e, _Tensor):
                        refs += ((i, k), *self._source(e))
                        lst[k] = None
                targs[i] = lst
                lists = True
        tkw = dict(kwargs)
        for name, v in kwargs.items():
            if isinstance(v, _Tensor):
                refs += (name, *self._source(v))
                tkw[name] = None
            elif type(v) in (list, tuple) and any(isinstance(e, _Tensor) for e in v):
                return f"{func} takes a tensor list by keyword"
        steps = self.recipe.steps
        n = len(steps)
        steps.append(_Step(func, tuple(targs), tkw, refs, len(flat), lists, info.view_src, alias))
        for j, o in enumerate(flat):
            self.made[id(o)] = (weakref.ref(o), n, j, version_of(o))
        return None


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, _Tensor):
            found.append(a)
        elif type(a) in (list, tuple):
            found.extend(e for e in a if isinstance(e, _Tensor))
    return found


class _Entry:
    """A live output with a recipe: its step and output index, and its version then."""

    __slots__ = ("ref", "recipe", "step", "idx", "version")

    def __init__(self, ref: weakref.ref, recipe: _Recipe, step: int, idx: int, version: int | None) -> None:
        self.ref, self.recipe, self.step, self.idx, self.version = ref, recipe, step, idx, version


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.recipes: dict[int, _Entry] = {}  # id(output) -> its entry, while the output lives
        self.recording: list[_Recorder] = []


_state = _PerThread()


class Rebuilder:
    """One graph's use of the thread's recipes (the seam ``Graph.rebuild``)."""

    __slots__ = ("recipes", "made")

    def __init__(self, recipes: dict[int, _Entry]) -> None:
        self.recipes = recipes
        self.made: dict[tuple[_Recipe, int], Any] = {}  # (recipe, step) -> the node recorded here

    def ref(self, graph: Any, t: torch.Tensor, allow: bool) -> tuple[Any, int] | None:
        """The node output standing for the region input ``t``, recorded from its
        recipe; None if ``t`` has none (Note [A region rebuilds an input from its recipe])."""
        e = self.recipes.get(id(t))
        if e is None or e.ref() is not t or e.version != version_of(t):
            return None
        key = recipe = e.recipe
        made = self.made
        fqn = graph.frames[-1].module_fqn if graph.frames else ""
        for s in recipe.cone(e.step):
            if (key, s) in made:
                continue
            step = recipe.steps[s]
            refs = step.refs
            inputs: tuple = ()
            for i in range(0, len(refs), 3):
                pos, src, j = refs[i], refs[i + 1], refs[i + 2]
                if src < 0:
                    m, j = graph.ref(recipe.leaves[j], allow)
                else:
                    m = made[(key, src)]
                m.readers += 1
                if pos == step.view_src:
                    m.viewed = True
                    m.viewers += 1
                inputs += (pos, m, j)
            node = graph.new_node(step.op, step.nout, fqn, inputs, step.args)
            if step.kwargs:
                node.kwargs = dict(step.kwargs)
            if step.lists:
                node.lists = True
            if step.alias:  # its output shares its first argument's storage, undeclared
                src, j0 = inputs[1], inputs[2]
                node.alias_of = (src, j0)
                src.aliased = True
            made[(key, s)] = node
        node = made[(key, e.step)]
        graph.map.set(t, node, e.idx, version_of(t))
        return node, e.idx


def rebuilder() -> Rebuilder | None:
    """What a new region's graph uses for inputs with a recipe (None: there are none)."""
    recipes = _state.recipes
    return Rebuilder(recipes) if recipes else None


# ---- the modules ------------------------------------------------------------------------------


class _Rebuild:
    """Records one module's forward (Note [A region rebuilds an input from its recipe])."""

    def __init__(self) -> None:
        self.state_ids: set[int] = set()  # the module's parameters and buffers, at its last forward

    def pre(self, module: nn.Module, args: tuple) -> None:
        if is_compiling():
            announce_eager_only("the rebuilt module (apply_ac rebuild=)")
            return
        st = _state
        if torch.is_inference_mode_enabled() or any(
                isinstance(m, (Tracer, _Recorder)) for m in _get_current_dispatch_mode_stack()):
            st.recording.append(None)  # inside a region (it records these ops itself) or another recording
            return
        self.state_ids = {id(t) for t in (*module.parameters(), *module.buffers())}
        rec = _Recorder()
        rec.__enter__()
        st.recording.append(rec)

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        st = _state
        if not st.recording:  # compiling: pre recorded nothing
            return
        rec = st.recording.pop()
        if rec is None:
            return
        rec.__exit__(None, None, None)
        if rec.why is not None:
            return
        outs = [o for o in torch.utils._pytree.tree_leaves(output) if isinstance(o, _Tensor)]
        found = []
        for o in outs:
            e = rec.made.get(id(o))
            if e is not None and e[0]() is o and e[3] == version_of(o) and not o.requires_grad:
                found.append((o, e))
        inputs = sum(_nbytes(t) for t in rec.recipe.leaves if id(t) not in self.state_ids)
        if not found or inputs >= sum(_nbytes(o) for o, _ in found):
            return
        recipes = st.recipes
        for o, e in found:
            key = id(o)
            recipes[key] = _Entry(weakref.ref(o, _forget(recipes, key)), rec.recipe, e[1], e[2], e[3])


def _forget(recipes: dict[int, _Entry], key: int) -> Any:
    def dead(ref: weakref.ref) -> None:
        e = recipes.get(key)
        if e is not None and e.ref is ref:
            del recipes[key]
    return dead


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Hook:
    __slots__ = ("rebuild", "role")

    def __init__(self, rebuild: _Rebuild, role: str) -> None:
        self.rebuild, self.role = rebuild, role

    def __call__(self, module: nn.Module, *rest: Any) -> None:
        if self.role == "pre":
            self.rebuild.pre(module, rest[0])
        else:
            self.rebuild.post(module, rest[0], rest[1])


def install(model: nn.Module, fqns: Sequence[str], taken: set[str]) -> None:
    """Record the forwards of ``model``'s submodules ``fqns`` (validated first: a bad
    name changes nothing)."""
    if isinstance(fqns, (str, bytes)) or not isinstance(fqns, (list, tuple)) \
            or not all(isinstance(f, str) for f in fqns):
        raise TypeError(f"ac2_dist.apply_ac: rebuild must be a list of module names (fqns), e.g. "
                        f"['model.rotary_emb'], got {fqns!r}")
    names = dict(model.named_modules())
    for f in fqns:
        if f not in names or f == "":
            raise ValueError(f"ac2_dist.apply_ac: rebuild: {type(model).__name__} has no submodule {f!r}")
        clash = [t for t in sorted(taken) if t == f or f.startswith(t + ".") or t.startswith(f + ".")]
        if clash:
            raise ValueError(f"ac2_dist.apply_ac: rebuild: {f!r} is, contains or is inside {clash[0]!r}, which is "
                             f"checkpointed; a rebuilt module runs outside every region")
        if names[f].__dict__.get(_ATTR) is not None:
            raise ValueError(f"ac2_dist.apply_ac: rebuild: {f!r} is already rebuilt")
    for f in fqns:
        m = names[f]
        r = _Rebuild()
        m.register_forward_pre_hook(_Hook(r, "pre"))
        m.register_forward_hook(_Hook(r, "post"), always_call=True)
        m.__dict__[_ATTR] = r


def remove(module: nn.Module) -> None:
    """Stop recording ``module``'s forward (no-op for a module that is not rebuilt)."""
    if module.__dict__.pop(_ATTR, None) is None:
        return
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [k for k, h in hooks.items() if isinstance(h, _Hook)]:
            del hooks[key]
            module._forward_hooks_always_called.pop(key, None)
