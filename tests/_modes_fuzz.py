"""A seeded differential fuzzer of autograd and dispatch *modes* inside checkpointed regions.

Each seed makes one small random program ``prog(x, y, w)`` (``x``, ``y``: 4 x 8, ``w``:
8 x 8, leaves that require grad), 2-5 steps drawn from:

- autocast (CPU bfloat16) blocks inside the region (some with an ``enabled=False``
  block inside), and around it (the region called inside ``torch.autocast``; backward
  then inside it too, or not);
- ``torch.no_grad()`` blocks (with an ``enable_grad()`` block nested in some),
  ``torch.inference_mode()`` blocks whose results are read as eager allows (added,
  cloned);
- ``detach()``, and leaves made inside with ``requires_grad_()`` (their ``.grad`` is
  compared);
- custom ``torch.autograd.Function`` kinds: ``save_for_backward`` of an input, of an
  output, of an intermediate; ``mark_dirty`` (an in-place write); a second output
  ``mark_non_differentiable`` (an index); ``once_differentiable``; ``setup_context``
  with ``generate_vmap_rule`` (also under ``torch.vmap``); non-tensor ``ctx`` attributes;
- the user's ``saved_tensors_hooks`` inside the region (pack and unpack counted, the
  pack cloning or not) and around it (what they pack is compared with torch's checkpoint,
  as tests/test_user_hooks.py does); a dispatch mode of the user's inside the region
  (the ops it sees are compared);
- ``register_hook`` (recording the gradient, or scaling it) and ``retain_grad`` on
  intermediates (the gradients the hooks saw and the ``.grad`` of retained tensors are
  compared);
- int, bool and mixed-dtype ops (comparisons, ``where``, ``masked_fill``, ``to(int64)``,
  ``argmax``, ``gather``, indexing, ``index_select``, ``topk``, ``sort``);
- random ops (``dropout``, ``rand_like``, ``randn``, ``bernoulli``, ``randperm``);
- nested regions (an inner function through ``CK``: eager's call, torch's checkpoint or
  ac2's ``checkpoint`` / ``apply_ac_policy_fn`` with its own policy), returning one
  tensor or a tuple; ``torch.vmap``;

and returns one tensor, a tuple, a list or a dict (with a tuple inside). The step ends
with one of three backwards: ``loss.backward()``, twice with ``retain_graph=True``, or a
double backward (``torch.autograd.grad(..., create_graph=True)``, then the penalty's
backward).

Each program runs eagerly (twice: the reference must be deterministic), under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` and torch's selective
checkpoint (the program's save list), and under ac2 with the C recorder and the Python
one (``recording_in_python``): the drop-in ``ac2_dist.checkpoint``,
``apply_ac_policy("recompute_all")``, ``apply_ac_policy(<save list>)``,
``apply_ac_policy("must_save_all")`` and ``ac2_dist.wrap`` (a module), with the program's
``rng`` ("replay" or "save"; "replay" where a double backward meets a random op: under
"save" that is the documented error). ``torch.manual_seed(seed)`` before forward,
``torch.manual_seed(seed + 1)`` before backward.

Against eager, for every ac2 run: no exception; outputs, the leaves' gradients (and a
double backward's first-order gradients), the gradients tensor hooks saw, the ``.grad`` of
retained tensors and of leaves made inside, the saved-tensor hooks' pack and unpack
counts inside the region, the ops the user's dispatch mode saw, and the global RNG state
after backward (a replay must not move it), all bitwise; for the drop-in under hooks around the region, the values packed
(shape, dtype, which input) are torch's checkpoint's. No leak: with the cyclic
collector off, once the step's tensors are dropped, weak references to the inputs,
outputs, observed tensors and the region's graph are dead; and in one extra run per
program (one ac2 variant, drawn by seed) to every tensor an op made in forward
(:class:`_Made`, a dispatch mode outside the region, which must change none of the
above), wherever eager leaves none alive.
Torch's checkpoint is no reference: where it raises or differs from eager it is counted,
not failed (its recompute re-runs the Python: a hook registered or a pack counted twice).

A program that is invalid eagerly (an error, no output that requires grad, two eager
runs that differ) is skipped and counted. An error ac2 documents (``REFUSALS``, where its
condition holds) is counted, not failed; so is a failure of a reported, not yet fixed
issue (``KNOWN``: ``--strict`` fails on those too).

Run: ``python -m tests._modes_fuzz --minutes 3`` (the long mode, exit status 1 on a
failure; failing programs are saved, one file each, under ``--save-dir``), ``python -m
tests._modes_fuzz --seed 17 -v`` (one program, its source and every variant's outcome),
``--minimize`` (drop steps while the program fails the same way).
``tests/test_modes_fuzz.py`` runs a fixed budget of seeds (``AC2_FUZZ_SECONDS`` turns it
into a timed run).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import random
import re
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import ac2_dist as ac
from ac2_dist._trace._tracer import C_DISPATCH, recording_in_python

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # run as python -m tests._modes_fuzz
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _view_fuzz import _indent  # noqa: E402
from _view_fuzz import bitwise_equal as _tensors_bitwise_equal  # noqa: E402

aten = torch.ops.aten
R, C = 4, 8  # x, y are R x C; w is C x C
SAVE_CANDIDATES = (
    aten.mm.default, aten.addmm.default, aten.sin.default, aten.tanh.default, aten.sigmoid.default,
    aten.mul.Tensor, aten.exp.default, aten.gelu.default, aten._softmax.default, aten.native_layer_norm.default,
    aten._to_copy.default, aten.where.self, aten.gather.default, aten.index.Tensor, aten.cumsum.default,
    aten.bernoulli_.float, aten.rand_like.default, aten.randn.default, aten.cat.default, aten.cos.default,
)
BACKWARDS = ("once", "twice", "double")


# ---- custom autograd Functions the programs call ----------------------------------------


class SaveIn(torch.autograd.Function):
    """Saves its input."""

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return a.sin()

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return g * a.cos()


class SaveOut(torch.autograd.Function):
    """Saves its output."""

    @staticmethod
    def forward(ctx, a):
        out = a.sigmoid()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * out * (1 - out)


class SaveMid(torch.autograd.Function):
    """Saves an intermediate it made (no history in eager: a double backward treats it as
    a constant) and its second input."""

    @staticmethod
    def forward(ctx, a, b):
        m = a.tanh()
        ctx.save_for_backward(m, b)
        return m * b

    @staticmethod
    def backward(ctx, g):
        m, b = ctx.saved_tensors
        return g * b * (1 - m * m), g * m


class Dirty(torch.autograd.Function):
    """Writes its input in place (``mark_dirty``)."""

    @staticmethod
    def forward(ctx, a):
        a.mul_(2.0)
        ctx.mark_dirty(a)
        return a

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


class NonDiff(torch.autograd.Function):
    """Row maxima and their indices, the indices ``mark_non_differentiable`` and saved;
    a non-tensor ``ctx`` attribute (the shape)."""

    @staticmethod
    def forward(ctx, a):
        v, i = a.max(1)
        ctx.mark_non_differentiable(i)
        ctx.save_for_backward(i)
        ctx.shape = tuple(a.shape)
        return v, i

    @staticmethod
    def backward(ctx, gv, gi):
        (i,) = ctx.saved_tensors
        return gv.new_zeros(ctx.shape).scatter(1, i.unsqueeze(1), gv.unsqueeze(1))


class Once(torch.autograd.Function):
    """A ``once_differentiable`` backward (a double backward through it raises, in eager
    too: the generator keeps it out of double-backward programs)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, g * a


class Attrs(torch.autograd.Function):
    """Non-tensor arguments kept as ``ctx`` attributes."""

    @staticmethod
    def forward(ctx, a, scale, flag):
        ctx.scale, ctx.flag = scale, flag
        return a * scale if flag else a + scale

    @staticmethod
    def backward(ctx, g):
        return (g * ctx.scale if ctx.flag else g), None, None


class Ctx(torch.autograd.Function):
    """``forward`` without ``ctx`` and a ``setup_context``; ``generate_vmap_rule``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b):
        return a * b.cos()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b.cos(), -g * a * b.sin()


FUNCTIONS = {f.__name__: f for f in (SaveIn, SaveOut, SaveMid, Dirty, NonDiff, Once, Attrs, Ctx)}


# ---- what a run observes besides outputs and gradients ----------------------------------


class Observer:
    """The program's view of its backward: gradients its tensor hooks saw (``hook``; a
    hook may also scale the gradient it passes on), tensors whose ``.grad`` is compared
    (``retain``: ``retain_grad()``; ``leaf``: a leaf made inside) and how many values its
    saved-tensor hooks inside the region packed and unpacked (``hooks``) and which ops a
    dispatch mode of its own saw (``mode``). A key is
    registered once: torch's recompute re-runs the Python, and its second registration
    must not replace the first (its hooks on recomputed tensors never fire)."""

    def __init__(self) -> None:
        self.seen: dict[str, list[torch.Tensor]] = {}
        self.kept: dict[str, torch.Tensor] = {}
        self.packs = 0
        self.unpacks = 0
        self.ops: list[str] = []

    def hook(self, t: torch.Tensor, key: str, scale: float | None = None) -> None:
        def fn(g: torch.Tensor) -> torch.Tensor | None:
            self.seen.setdefault(key, []).append(g.detach().clone())
            return None if scale is None else g * scale

        t.register_hook(fn)

    def retain(self, t: torch.Tensor, key: str) -> None:
        t.retain_grad()
        self.kept.setdefault(key, t)

    def leaf(self, t: torch.Tensor, key: str) -> None:
        self.kept.setdefault(key, t)

    def hooks(self, clone: bool = True) -> Any:
        def pack(t: torch.Tensor) -> Any:
            self.packs += 1
            return t.clone() if clone else t

        def unpack(t: Any) -> torch.Tensor:
            self.unpacks += 1
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def mode(self) -> TorchDispatchMode:
        """A dispatch mode of the user's: it records the ops it sees and runs them."""
        return _OpNames(self.ops)

    def clear(self) -> None:
        self.seen, self.kept = {}, {}


_PACKING = [0]  # > 0 while the hooks around the region pack (Around.pack)


class _OpNames(TorchDispatchMode):
    """Records the ops it sees, but for two kinds that differ by design under any
    saved-tensor hooks (ac2's, torch's checkpoint's): the ``detach`` autograd itself runs to
    save an output when no hook is set, and what the hooks around the region run to pack
    a value the region saves (under a region, such values bypass them)."""

    def __init__(self, ops: list[str]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not aten.detach.default and not _PACKING[0]:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class Around:
    """Saved-tensor hooks around the region (and the loss): each pack is recorded as
    ``(shape, dtype, index of the input it is or None)`` and keeps a clone."""

    def __init__(self, watched: list[torch.Tensor]) -> None:
        self.packed: list[tuple] = []
        self.watched = watched

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.packed.append((tuple(t.shape), str(t.dtype), next((i for i, w in enumerate(self.watched) if w is t), None)))
        _PACKING[0] += 1
        try:
            return t.clone()
        finally:
            _PACKING[0] -= 1

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


class _Made(TorchDispatchMode):
    """Weak references to every tensor an op makes while it is active (forward only)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[str, weakref.ref]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for k, o in enumerate(torch.utils._pytree.tree_leaves(out)):
            if isinstance(o, torch.Tensor):
                self.refs.append((f"{func}[{k}]", weakref.ref(o)))
        return out


# ---- programs -----------------------------------------------------------------------


@dataclass
class Val:
    name: str
    kind: str  # "float", "int", "bool"
    shape: tuple[int, ...]
    rg: bool  # requires grad
    inference: bool = False  # made under inference_mode: only added or cloned later
    low: bool = False  # bfloat16 (autocast made it)


@dataclass
class Program:
    """One program: its steps (each a statement or a block, without the function's
    indent), what it returns (a Python expression) and how it is run."""

    seed: int
    stmts: list[str]
    ret: str
    backward: str = "once"  # "once", "twice" (retain_graph=True), "double" (create_graph)
    rng: str = "replay"  # ac2's rng for apply_ac_policy / wrap / apply_ac_policy_fn
    save_list: tuple = ()
    inner: tuple = ("checkpoint", "recompute_all")  # how ac2 runs CK: ("checkpoint"|"fn", policy)
    wrap_policy: Any = "recompute_all"
    around_autocast: bool = False
    backward_in_autocast: bool = False
    around_hooks: bool = False

    def source(self) -> str:
        body = []
        for s in self.stmts:
            body += ["        " + line for line in s.split("\n")]
        return ("def make(CK, obs):  # CK: the nested region's call; obs: the Observer\n"
                "    def prog(x, y, w):\n" + "\n".join(body) + f"\n        return {self.ret}\n    return prog\n")

    @functools.cached_property
    def make(self) -> Callable:
        """``make(CK, obs)``, which returns the region's function ``prog(x, y, w)``."""
        ns: dict[str, Any] = {"torch": torch, "F": F, **FUNCTIONS}
        exec(compile(self.source(), f"<modes_fuzz seed {self.seed}>", "exec"), ns)  # noqa: S102
        return ns["make"]

    @property
    def has_rng(self) -> bool:
        return bool(_RANDOM_CALL.search(self.source()))

    def settings(self) -> str:
        return (f"backward={self.backward} rng={self.rng} save_list={[str(o) for o in self.save_list]} "
                f"inner={self.inner[0]}:{_policy_str(self.inner[1])} wrap={_policy_str(self.wrap_policy)} "
                f"around_autocast={self.around_autocast} backward_in_autocast={self.backward_in_autocast} "
                f"around_hooks={self.around_hooks}")

    def replace(self, **kw: Any) -> Program:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(kw)
        return Program(**d)


def _policy_str(p: Any) -> str:
    return p if isinstance(p, str) else str([str(o) for o in p])


_RANDOM_CALL = re.compile(r"\b(?:rand_like|randn_like|dropout|randn|bernoulli|randperm)\(")

# Features a program may show (by its source or settings), counted per run program.
FEATURES = {
    "autocast inside": lambda p: "torch.autocast" in p.source(),
    "autocast around": lambda p: p.around_autocast,
    "no_grad": lambda p: "torch.no_grad()" in p.source(),
    "enable_grad in no_grad": lambda p: "torch.enable_grad()" in p.source(),
    "inference_mode": lambda p: "torch.inference_mode()" in p.source(),
    "detach": lambda p: ".detach()" in p.source(),
    "leaf made inside": lambda p: "requires_grad_()" in p.source(),
    **{f"Function {n}": (lambda p, n=n: f"{n}.apply" in p.source()) for n in FUNCTIONS},
    "vmap": lambda p: "torch.vmap" in p.source(),
    "autocast off inside autocast": lambda p: "enabled=False" in p.source(),
    "dispatch mode inside": lambda p: "obs.mode()" in p.source(),
    "saved_tensors_hooks inside": lambda p: "obs.hooks(" in p.source(),
    "saved_tensors_hooks around": lambda p: p.around_hooks,
    "register_hook": lambda p: "obs.hook(" in p.source(),
    "retain_grad": lambda p: "obs.retain(" in p.source(),
    "int/bool ops": lambda p: bool(re.search(r"torch\.where|masked_fill|torch\.int64|argmax|\.gather\(| > ", p.source())),
    "random ops": lambda p: p.has_rng,
    "nested region": lambda p: "CK(" in p.source(),
    "dict output": lambda p: p.ret.startswith("{"),
    "tuple/list output": lambda p: p.ret.startswith(("(", "[")),
    "backward twice": lambda p: p.backward == "twice",
    "double backward": lambda p: p.backward == "double",
}


class Generator:
    """Builds one program (or, with ``parent``, a nested region's body) from a seed. It
    keeps the eager rules it knows (an inference tensor is only added or cloned, a hook
    only on a tensor that requires grad, no ``once_differentiable`` in a double
    backward); what it does not model eager finds: such a program is skipped."""

    def __init__(self, seed: int, parent: Generator | None = None, args: list[Val] | None = None) -> None:
        self.seed = seed
        self.parent = parent
        self.rng: random.Random = parent.rng if parent else random.Random(seed)
        self.depth = parent.depth + 1 if parent else 0
        self.stmts: list[str] = []
        self.mode = "grad"  # while generating a block: "grad", "no_grad", "inference"
        self.autocast = False
        if parent is None:
            self.counter = [0]
            self.backward = self.rng.choices(BACKWARDS, [0.5, 0.2, 0.3])[0]
            self.vals = [Val("x", "float", (R, C), True), Val("y", "float", (R, C), True)]  # w: read by name
        else:
            self.counter = parent.counter
            self.backward = parent.backward
            self.vals = list(args or [])

    # helpers
    def fresh(self, prefix: str = "t") -> str:
        self.counter[0] += 1
        return f"{prefix}{self.counter[0]}"

    def pick(self, pred: Callable[[Val], bool] = lambda v: True) -> Val | None:
        cands = [v for v in self.vals if pred(v)]
        return self.rng.choice(cands) if cands else None

    def pick_float(self, *, inference: bool = False, rg: bool | None = None) -> Val:
        v = self.pick(lambda u: u.kind == "float" and u.shape == (R, C) and (inference or not u.inference)
                      and (rg is None or u.rg == rg))
        return v if v is not None else self.vals[0]

    def result_rg(self, *ins: Val, weight: bool = False) -> bool:
        if self.mode != "grad":
            return False
        return weight or any(v.rg for v in ins)

    def add(self, name: str, kind: str, shape: tuple[int, ...], rg: bool, low: bool = False) -> Val:
        v = Val(name, kind, shape, rg, inference=self.mode == "inference", low=low)
        self.vals.append(v)
        return v

    def f32(self, v: Val) -> str:
        """``v``'s name, cast to float32 where it is bfloat16 and autocast is off (a
        matmul with the float32 ``w`` needs it)."""
        return f"{v.name}.float()" if v.low and not self.autocast else v.name

    # steps: each returns its lines (a block's body indented) -------------------------
    def compute(self) -> list[str]:
        """A float op on one or two float values (or a value made under inference_mode,
        added)."""
        rng = self.rng
        t = self.fresh()
        a, b = self.pick_float(), self.pick_float()
        kind = rng.randrange(12)
        low = self.autocast or a.low or b.low
        if kind == 0:
            line, rg, low = f"{t} = {self.f32(a)} @ w", self.result_rg(a, weight=True), self.autocast
        elif kind == 1:
            line, rg, low = f"{t} = F.linear({self.f32(a)}, w, w[0])", self.result_rg(a, weight=True), self.autocast
        elif kind == 2:
            line, rg = f"{t} = {a.name}.sin() * {b.name}", self.result_rg(a, b)
        elif kind == 3:
            line, rg = f"{t} = ({a.name} * {b.name}).tanh()", self.result_rg(a, b)
        elif kind == 4:
            line, rg = f"{t} = {a.name}.sigmoid() + {b.name}.cos()", self.result_rg(a, b)
        elif kind == 5:
            line, rg = f"{t} = F.gelu({a.name}) - {b.name} * 0.5", self.result_rg(a, b)
        elif kind == 6:
            line, rg = f"{t} = {a.name}.softmax(-1) * {b.name}", self.result_rg(a, b)
        elif kind == 7:
            line, rg, low = f"{t} = F.layer_norm({a.name}, ({C},))", self.result_rg(a), a.low
        elif kind == 8:
            line, rg, low = f"{t} = {a.name}.cumsum(1) * 0.25", self.result_rg(a), a.low
        elif kind == 9:
            line, rg = f"{t} = torch.cat([{a.name}[:, :{C // 2}], {b.name}[:, {C // 2}:]], 1)", self.result_rg(a, b)
        elif kind == 10:
            line, rg = f"{t} = {a.name}.relu() * {b.name}.tanh().exp()", self.result_rg(a, b)
        else:  # a value made under inference_mode: added (add saves neither operand)
            c = self.pick_float(inference=True)
            line, rg, low = f"{t} = {a.name} + {c.name}", self.result_rg(a), a.low or c.low
        self.add(t, "float", (R, C), rg, low=low)
        return [line]

    def ops(self, n: int) -> list[str]:
        lines: list[str] = []
        for _ in range(n):
            lines += self.compute()
        return lines

    def autocast_block(self) -> list[str]:
        outer, self.autocast = self.autocast, True
        body = self.ops(self.rng.randint(1, 2))
        if self.rng.random() < 0.25:  # a block with autocast off again inside it
            self.autocast = False
            body += ["with torch.autocast('cpu', enabled=False):"] + ["    " + s for s in self.ops(1)]
        self.autocast = outer
        lines = ["with torch.autocast('cpu', dtype=torch.bfloat16):"] + ["    " + s for s in body]
        if self.rng.random() < 0.4:
            v = self.vals[-1]
            t = self.fresh()
            lines.append(f"{t} = {v.name}.float()")
            self.add(t, "float", (R, C), v.rg)
        return lines

    def no_grad_block(self) -> list[str]:
        outer, self.mode = self.mode, "no_grad"
        lines = ["with torch.no_grad():"] + ["    " + s for s in self.ops(self.rng.randint(1, 2))]
        self.mode = outer
        if self.rng.random() < 0.4 and outer == "grad":
            body = self.ops(1)
            lines += ["    with torch.enable_grad():"] + ["        " + s for s in body]
        return lines

    def inference_block(self) -> list[str]:
        outer, self.mode = self.mode, "inference"
        lines = ["with torch.inference_mode():"] + ["    " + s for s in self.ops(self.rng.randint(1, 2))]
        self.mode = outer
        if self.rng.random() < 0.4:  # a clone outside inference_mode is a normal tensor
            v = self.vals[-1]
            t = self.fresh()
            lines.append(f"{t} = {v.name}.clone()")
            self.add(t, "float", (R, C), False, low=v.low)
        return lines

    def detach(self) -> list[str]:
        """A detached value, or a leaf made inside (its ``.grad`` is compared)."""
        a = self.pick_float()
        t = self.fresh("d")
        r = self.rng.randrange(4)
        if r == 0:
            self.add(t, "float", (R, C), False, low=a.low)
            return [f"{t} = {a.name}.detach()"]
        expr = [f"{a.name}.detach().requires_grad_()", f"{a.name}.detach().clone().requires_grad_()",
                f"torch.ones({R}, {C}).requires_grad_()"][r - 1]
        self.add(t, "float", (R, C), True, low=a.low and r < 3)
        return [f"{t} = {expr}", f"obs.leaf({t}, {t!r})"]

    def function(self) -> list[str]:
        """A custom autograd Function."""
        rng = self.rng
        names = [n for n in FUNCTIONS if not (n == "Once" and self.backward == "double")]
        name = rng.choice(names)
        a, b = self.pick_float(), self.pick_float()
        t = self.fresh()
        if name == "NonDiff":
            v, i = self.fresh("v"), self.fresh("i")
            self.add(i, "int", (R,), False)
            self.add(t, "float", (R, C), self.result_rg(a, b), low=a.low or b.low)
            return [f"{v}, {i} = NonDiff.apply({a.name})", f"{t} = {b.name} * {v}.unsqueeze(1)"]
        if name == "Dirty":
            expr = f"Dirty.apply({a.name} * 1.5)"
        elif name == "Attrs":
            expr = f"Attrs.apply({a.name}, {rng.choice(['0.5', '1.5'])}, {rng.choice(['True', 'False'])})"
        elif name in ("SaveIn", "SaveOut"):
            expr = f"{name}.apply({a.name})"
        elif name == "Ctx" and rng.random() < 0.4:
            expr = f"torch.vmap(Ctx.apply)({a.name}, {b.name})"
        else:
            expr = f"{name}.apply({a.name}, {b.name})"
        two = name in ("SaveMid", "Once", "Ctx")
        self.add(t, "float", (R, C), self.result_rg(a, b) if two else self.result_rg(a),
                 low=(a.low or b.low) if two else a.low)
        return [f"{t} = {expr}"]

    def vmap(self) -> list[str]:
        a, b = self.pick_float(), self.pick_float()
        t = self.fresh()
        self.add(t, "float", (R, C), True)
        return [f"{t} = torch.vmap(lambda r, s: ({self.f32(a).replace(a.name, 'r')} @ w).sin() * s)({a.name}, {b.name})"]

    def mode_block(self) -> list[str]:
        return ["with obs.mode():"] + ["    " + s for s in self.ops(self.rng.randint(1, 2))]

    def hooks_block(self) -> list[str]:
        clone = self.rng.random() < 0.6
        return [f"with obs.hooks(clone={clone}):"] + ["    " + s for s in self.ops(self.rng.randint(1, 2))]

    def observe(self) -> list[str]:
        """A tensor hook (recording, or scaling the gradient) or retain_grad on a value
        that requires grad."""
        ok = lambda u: u.kind == "float" and u.rg and not u.inference  # noqa: E731
        v = self.pick(lambda u: ok(u) and u.name not in ("x", "y", "a", "b")) if self.rng.random() < 0.8 else None
        v = v or self.pick(ok)
        if v is None:
            return self.compute()
        key = self.fresh("k")
        r = self.rng.randrange(3)
        if r == 0:
            return [f"obs.hook({v.name}, {key!r})"]
        if r == 1:
            return [f"obs.hook({v.name}, {key!r}, {self.rng.choice(['0.5', '2.0', '-1.0'])})"]
        return [f"obs.retain({v.name}, {key!r})"]

    def intlike(self) -> list[str]:  # noqa: C901 - one case per template
        """Int, bool and mixed-dtype ops: a comparison, where, masked_fill, a cast to
        int64, argmax, gather, indexing, index_select, topk, sort, a count."""
        rng = self.rng
        a, b = self.pick_float(), self.pick_float()
        t = self.fresh()
        kind = rng.randrange(10)
        mask = self.pick(lambda u: u.kind == "bool")
        ints = self.pick(lambda u: u.kind == "int" and u.shape == (R,))
        lines: list[str] = []
        if kind in (0, 1, 2, 3) and mask is None:
            m = self.fresh("m")
            lines.append(f"{m} = {a.name} > {b.name}" if rng.random() < 0.5 else f"{m} = {a.name}.abs() > 0.5")
            mask = self.add(m, "bool", (R, C), False)
        if kind in (4, 5, 6) and ints is None:
            i = self.fresh("i")
            lines.append(f"{i} = {a.name}.argmax(1)")
            ints = self.add(i, "int", (R,), False)
        if kind == 0:
            lines.append(f"{t} = torch.where({mask.name}, {a.name}, {b.name})")
            rg = self.result_rg(a, b)
        elif kind == 1:
            lines.append(f"{t} = {a.name}.masked_fill({mask.name}, 0.25)")
            rg = self.result_rg(a)
        elif kind == 2:
            lines.append(f"{t} = {a.name} * {mask.name}")
            rg = self.result_rg(a)
        elif kind == 3:
            k = self.fresh("n")
            lines.append(f"{k} = {mask.name}.sum()")
            self.add(k, "int", (), False)
            lines.append(f"{t} = {a.name} / ({k} + 1) + {mask.name}.sum(1, keepdim=True)")
            rg = self.result_rg(a)
        elif kind == 4:
            lines.append(f"{t} = {a.name}.gather(1, {ints.name}.unsqueeze(1) % {C}) * {b.name}")
            rg = self.result_rg(a, b)
        elif kind == 5:
            lines.append(f"{t} = {a.name}[{ints.name} % {R}]")
            rg = self.result_rg(a)
        elif kind == 6:
            lines.append(f"{t} = {a.name}.index_select(0, {ints.name} % {R}) + {b.name}")
            rg = self.result_rg(a, b)
        elif kind == 7:
            i = self.fresh("i")
            lines.append(f"{i} = ({a.name} * 3).to(torch.int64)")
            self.add(i, "int", (R, C), False)
            lines.append(f"{t} = {b.name} * {i} + {i}")
            rg = self.result_rg(b)
        elif kind == 8:
            lines.append(f"{t} = {a.name}.topk(3, 1).values.sum(1, keepdim=True) * {b.name}")
            rg = self.result_rg(a, b)
        else:
            lines.append(f"{t} = {a.name}.sort(1).values - {b.name}")
            rg = self.result_rg(a, b)
        self.add(t, "float", (R, C), rg, low=a.low or b.low)
        return lines

    def random_op(self) -> list[str]:
        a = self.pick_float()
        t = self.fresh()
        line = self.rng.choice([
            f"{t} = F.dropout({a.name}, 0.3, training=True)",
            f"{t} = {a.name} * torch.rand_like({a.name})",
            f"{t} = {a.name} + torch.randn({R}, {C})",
            f"{t} = {a.name} * torch.bernoulli(torch.full_like({a.name}, 0.5))",
            f"{t} = {a.name}[:, torch.randperm({C})]",
        ])
        self.add(t, "float", (R, C), self.result_rg(a), low=a.low)
        return [line]

    def nested(self) -> list[str]:
        """An inner function called through ``CK`` (the nested region)."""
        if self.depth >= 2:
            return self.compute()
        a, b = self.pick_float(), self.pick_float()
        fname = self.fresh("f")
        child = Generator(self.seed, parent=self, args=[Val("a", "float", (R, C), a.rg, low=a.low),
                                                         Val("b", "float", (R, C), b.rg, low=b.low)])
        body: list[str] = []
        for _ in range(self.rng.randint(1, 3)):
            body += child.step()
        made = [v for v in child.vals[2:] if v.kind == "float" and not v.inference]
        if not made:
            body += child.compute()
            made = [child.vals[-1]]
        outs = [made[-1]] + ([made[0]] if len(made) > 1 and self.rng.random() < 0.4 else [])
        lines = [f"def {fname}(a, b):"] + ["    " + s for s in body]
        names = [self.fresh() for _ in outs]
        if len(outs) == 1:
            lines += [f"    return {outs[0].name}", f"{names[0]} = CK({fname}, {a.name}, {b.name})"]
        else:
            lines += [f"    return {outs[0].name}, {outs[1].name}",
                      f"{names[0]}, {names[1]} = CK({fname}, {a.name}, {b.name})"]
        for n, v in zip(names, outs):
            self.add(n, "float", (R, C), v.rg, low=v.low)
        return lines

    STEPS = {  # name -> weight
        "compute": 2.0, "autocast_block": 1.0, "no_grad_block": 0.7, "inference_block": 0.6, "detach": 0.7,
        "function": 1.5, "hooks_block": 0.7, "mode_block": 0.5, "observe": 1.2, "intlike": 1.2, "random_op": 0.8, "nested": 0.8,
        "vmap": 0.2,
    }

    def step(self) -> list[str]:
        names = list(self.STEPS)
        return getattr(self, self.rng.choices(names, [self.STEPS[n] for n in names])[0])()

    def program(self) -> Program:
        rng = self.rng
        stmts = ["\n".join(self.step()) for _ in range(rng.randint(2, 5))]
        cands = [v for v in self.vals[2:] if not v.inference or rng.random() < 0.2]
        grad = [v for v in cands if v.rg and v.kind == "float"]
        first = grad[-1] if grad else cands[-1] if cands else self.vals[0]  # the latest that needs grad
        rest = [v for v in cands if v is not first]
        rng.shuffle(rest)
        outs = [v.name for v in [first] + rest[:rng.randint(0, 2)]]
        form = rng.random()
        if len(outs) == 1 and form < 0.5:
            ret = outs[0]
        elif form < 0.65:
            ret = "(" + ", ".join(outs) + ",)"
        elif form < 0.8:
            ret = "[" + ", ".join(outs) + "]"
        else:
            ret = "{" + f"'a': {outs[0]}, 'b': ({', '.join(outs[1:])}{',' if len(outs) == 2 else ''})" + "}"
        save_list = tuple(rng.sample(SAVE_CANDIDATES, rng.randint(1, 4)))
        policies: list[Any] = ["recompute_all", "must_save_all", save_list]
        prog = Program(
            self.seed, stmts, ret, backward=self.backward, rng=rng.choice(["replay", "save"]), save_list=save_list,
            inner=(rng.choice(["checkpoint", "fn"]), rng.choice(policies)), wrap_policy=rng.choice(policies),
            around_autocast=rng.random() < 0.15, around_hooks=rng.random() < 0.2,
        )
        prog.backward_in_autocast = prog.around_autocast and rng.random() < 0.5
        if prog.backward == "double" and prog.has_rng:
            prog.rng = "replay"  # under "save", a kept random op's output has no history: the documented error
        return prog


def generate(seed: int) -> Program:
    return Generator(seed).program()


# ---- running ---------------------------------------------------------------------------


def _leaves(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + seed)
    return [torch.randn(R, C, generator=g).requires_grad_(), torch.randn(R, C, generator=g).requires_grad_(),
            (torch.randn(C, C, generator=g) * 0.5).requires_grad_()]


def _loss(seed: int, flat: list) -> torch.Tensor | None:
    """A weighted sum of the float outputs that require grad (as float32), or None."""
    g = torch.Generator().manual_seed(20_000 + seed)
    total = None
    for o in flat:
        if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad:
            term = (o.float() * torch.randn(o.shape, generator=g)).sum()
            total = term if total is None else total + term
    return total


def bitwise_equal(a: Any, b: Any) -> bool:
    """Tensors: same shape, dtype and bits (NaN where the other has NaN); others by ``==``."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _tensors_bitwise_equal(a, b)
    return type(a) is type(b) and a == b


def _diff(a: Any, b: Any) -> str:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.is_floating_point():
        return f"max abs {(a.double() - b.double()).abs().max().item():.3g}"
    short = lambda v: f"{v.dtype}{tuple(v.shape)}" if isinstance(v, torch.Tensor) else repr(v)[:60]  # noqa: E731
    return f"{short(a)} vs {short(b)}"


def _grad(t: torch.Tensor) -> torch.Tensor | None:
    return None if t.grad is None else t.grad.detach().clone()


@dataclass
class Observed:
    """What one run computed."""

    spec: str = ""  # the output's structure
    outs: list = field(default_factory=list)
    grads: list = field(default_factory=list)  # of x, y, w
    first: list = field(default_factory=list)  # a double backward's first-order gradients
    seen: dict = field(default_factory=dict)  # tensor hooks: key -> gradients
    kept: dict = field(default_factory=dict)  # retained / made leaves: key -> .grad
    packs: tuple = (0, 0)  # saved-tensor hooks inside: packs, unpacks
    ops: list = field(default_factory=list)  # what the program's own dispatch mode saw
    around: list = field(default_factory=list)  # saved-tensor hooks around: what they packed
    rng: torch.Tensor | None = None  # the global generator's state after backward


@dataclass
class Outcome:
    error: str | None = None
    obs: Observed = field(default_factory=Observed)
    alive: list[str] = field(default_factory=list)  # weak references still alive after the step


def compare(got: Observed, ref: Observed) -> list[tuple[str, str]]:
    """``(kind, detail)`` for each way ``got`` differs from ``ref``: wrong_output,
    wrong_grad, wrong_observed (hooks, retained / made leaves' .grad, pack counts),
    wrong_rng."""
    out: list[tuple[str, str]] = []

    def each(kind: str, what: str, a: list, b: list, names: str | list[str] = "") -> None:
        if len(a) != len(b):
            out.append((kind, f"{what}: {len(a)} values vs eager's {len(b)}"))
            return
        bad = [f"{what} {names[k] if names else k} differs ({_diff(p, q)})"
               for k, (p, q) in enumerate(zip(a, b)) if not bitwise_equal(p, q)]
        if bad:
            out.append((kind, "; ".join(bad[:4])))

    if got.spec != ref.spec:
        out.append(("wrong_output", f"output structure {got.spec} vs eager's {ref.spec}"))
    else:
        each("wrong_output", "output", got.outs, ref.outs)
    each("wrong_grad", "grad of", got.grads, ref.grads, "xyw")
    each("wrong_grad", "first-order grad of", got.first, ref.first, "xyw")
    if sorted(got.seen) != sorted(ref.seen):
        out.append(("wrong_observed", f"tensor hooks fired for {sorted(got.seen)}, in eager {sorted(ref.seen)}"))
    else:
        for k in ref.seen:
            each("wrong_observed", f"hook {k} call", got.seen[k], ref.seen[k])
    if sorted(got.kept) != sorted(ref.kept):
        out.append(("wrong_observed", f"observed tensors {sorted(got.kept)}, in eager {sorted(ref.kept)}"))
    else:
        for k in ref.kept:
            each("wrong_observed", ".grad of", [got.kept[k]], [ref.kept[k]], [k])
    if got.packs != ref.packs:
        out.append(("wrong_observed", f"saved-tensor hooks inside the region: (packs, unpacks) {got.packs}, "
                                      f"in eager {ref.packs}"))
    if got.ops != ref.ops:
        k = next((i for i, (a, b) in enumerate(zip(got.ops, ref.ops)) if a != b), min(len(got.ops), len(ref.ops)))
        out.append(("wrong_observed", f"a dispatch mode inside the region saw {len(got.ops)} ops, in eager "
                                      f"{len(ref.ops)}; from op {k}: {got.ops[k:k + 3]} vs {ref.ops[k:k + 3]}"))
    if not bitwise_equal(got.rng, ref.rng):
        out.append(("wrong_rng", "the global generator's state after backward is not eager's"))
    return out


def _ck(variant: str, program: Program) -> Callable:
    """The nested region's call ``CK(f, *args)`` for ``variant``."""
    if variant == "eager":
        return lambda f, *a: f(*a)
    if variant.startswith("torch"):
        return lambda f, *a: torch_checkpoint(f, *a, use_reentrant=False)
    how, policy = program.inner
    if how == "checkpoint":
        return lambda f, *a: ac.checkpoint(f, *a, use_reentrant=False, policy=policy)
    return lambda f, *a: ac.apply_ac_policy_fn(f, *a, policy_fn=policy, rng=program.rng)


class _Wrapped(torch.nn.Module):
    """The program as a module's forward (``w`` its attribute), for ``ac2_dist.wrap``."""

    def __init__(self, fn: Callable, w: torch.Tensor) -> None:
        super().__init__()
        self.fn = fn
        self.w = w

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        return self.fn(x, y, self.w)


AC2_POLICIES = {"ac2_recompute_all": "recompute_all", "ac2_must_save_all": "must_save_all"}


def _entry(variant: str, program: Program, fn: Callable, leaves: list[torch.Tensor], box: dict) -> Any:
    """Call the region the way ``variant`` says; ``box['graph']``: a weak reference to an
    ac2 region's graph, where there is one."""
    x, y, w = leaves
    if variant == "eager":
        return fn(x, y, w)
    if variant == "torch":
        return torch_checkpoint(fn, x, y, w, use_reentrant=False)
    if variant == "torch_sac":
        ctx = functools.partial(create_selective_checkpoint_contexts, list(program.save_list))
        return torch_checkpoint(fn, x, y, w, use_reentrant=False, context_fn=ctx)
    if variant == "ac2_checkpoint":
        return ac.checkpoint(fn, x, y, w, use_reentrant=False)
    if variant == "ac2_wrap":
        module = ac.wrap(_Wrapped(fn, w), program.wrap_policy, rng=program.rng)
        return module(x, y)
    policy = program.save_list if variant == "ac2_save_list" else AC2_POLICIES[variant]
    with ac.apply_ac_policy(policy, rng=program.rng) as region:
        out = fn(x, y, w)
    if region.graph is not None:
        box["graph"] = weakref.ref(region.graph)
    return out


def _backward(program: Program, loss: torch.Tensor, leaves: list[torch.Tensor], obs: Observed) -> None:
    if program.backward == "once":
        loss.backward()
    elif program.backward == "twice":
        loss.backward(retain_graph=True)
        loss.backward()
    else:
        gs = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
        obs.first = [None if g is None else g.detach().clone() for g in gs]
        pen = [g.float().square().sum() for g in gs if g is not None and g.requires_grad]
        total = loss + sum(pen) if pen else loss
        del gs, pen
        total.backward()


def run_variant(program: Program, variant: str, python_recorder: bool = False, track: bool = False) -> Outcome:
    """Run ``program`` once as ``variant`` with the cyclic collector off; then drop
    everything and list the weak references still alive. ``track``: also weak references
    to every tensor an op made in forward (:class:`_Made`, outside the region)."""
    got = Outcome()
    box: dict[str, Any] = {}
    refs: list[tuple[str, weakref.ref]] = []
    made = _Made() if track else None
    gc.disable()
    recorder = recording_in_python() if python_recorder else contextlib.nullcontext()
    try:
        with recorder:
            leaves = _leaves(program.seed)
            obs = Observer()
            around = Around(leaves)
            fn = program.make(_ck(variant, program), obs)
            refs += [(f"input {n}", weakref.ref(t)) for n, t in zip("xyw", leaves)]
            try:
                torch.manual_seed(program.seed)
                with contextlib.ExitStack() as stack:
                    if program.around_hooks:
                        stack.enter_context(around.hooks())
                    if made is not None:
                        stack.enter_context(made)
                    if program.around_autocast:
                        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
                    outs = _entry(variant, program, fn, leaves, box)
                    stack.close()  # the loss outside autocast, still inside the hooks
                    with around.hooks() if program.around_hooks else contextlib.nullcontext():
                        flat, spec = tree_flatten(outs)
                        got.obs.spec = str(spec)
                        got.obs.outs = [o.detach().clone() if isinstance(o, torch.Tensor) else o for o in flat]
                        refs += [(f"output {k}", weakref.ref(o)) for k, o in enumerate(flat)
                                 if isinstance(o, torch.Tensor)]
                        refs += [(f"observed {k}", weakref.ref(t)) for k, t in obs.kept.items()]
                        loss = _loss(program.seed, flat)
                    del flat, outs
                if loss is None:
                    raise RuntimeError("no output requires grad")
                torch.manual_seed(program.seed + 1)  # backward must not depend on the global RNG
                with torch.autocast("cpu", dtype=torch.bfloat16) if program.backward_in_autocast \
                        else contextlib.nullcontext():
                    _backward(program, loss, leaves, got.obs)
                got.obs.rng = torch.get_rng_state()
                got.obs.grads = [_grad(t) for t in leaves]
                got.obs.seen = obs.seen
                got.obs.kept = {k: _grad(t) for k, t in obs.kept.items()}
                got.obs.packs = (obs.packs, obs.unpacks)
                got.obs.ops = obs.ops
                got.obs.around = around.packed
                del loss
            except Exception as e:  # noqa: BLE001 - any exception is an outcome
                got.error = f"{type(e).__name__}: {_first_line(e)}"
                e.__traceback__ = None  # the traceback holds the frames that hold the tensors
                del e
            obs.clear()
            leaves = fn = obs = around = None
            stack = None
        if "graph" in box:
            refs.append(("the region's graph", box["graph"]))
        if made is not None:
            refs += made.refs
        got.alive = [name for name, r in refs if r() is not None]
    finally:
        gc.enable()
    if got.alive:
        gc.collect()  # a leak must not spill into the next run
    return got


def _first_line(e: BaseException) -> str:
    return str(e).strip().split("\n")[0][:600]


# variant name, python recorder?
AC2_VARIANTS = [(v, p) for v in ("ac2_checkpoint", "ac2_recompute_all", "ac2_save_list", "ac2_must_save_all",
                                 "ac2_wrap") for p in (False, True)]


def variant_name(variant: str, python: bool) -> str:
    if variant.startswith("ac2"):
        return variant + (" (python recorder)" if python else " (C recorder)" if C_DISPATCH is not None
                          else " (python recorder: no C one)")
    return variant


@dataclass
class Failure:
    seed: int
    variant: str
    kind: str  # crash, wrong_output, wrong_grad, wrong_observed, wrong_rng, wrong_packs, leak, leak_made
    detail: str
    program: Program

    def format(self) -> str:
        return (f"seed {self.seed}: {self.variant}: {self.kind}: {self.detail}\n"
                f"  {self.program.settings()}\n"
                f"  replay alone: python -m tests._modes_fuzz --seed {self.seed} -v\n"
                + _indent(self.program.source(), "  | "))


@dataclass
class Result:
    """What one program gave."""

    status: str  # "invalid", "ok", "failed"
    why: str = ""
    failures: list[Failure] = field(default_factory=list)
    torch: dict[str, str] = field(default_factory=dict)  # "torch"/"torch_sac" -> "raises", "differs", "matches"
    leak_checked: bool = True  # eager left nothing alive (else leaks are not failures)
    recorders_differ: bool = False
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)  # variants that raised a documented refusal
    known: list[tuple[str, Failure]] = field(default_factory=list)  # (KNOWN name, failure), not failing


@dataclass(frozen=True)
class Refusal:
    """An error ac2 documents for what it does not support: where ``applies(program,
    variant)`` holds, a crash whose message matches ``pattern`` is counted, not failed."""

    name: str
    applies: Callable[[Program, str], bool]
    pattern: str


REFUSALS = (
    # _history.py's error (Note [The user's saved-tensor hooks] in _region.py): the drop-in
    # and a wrapped module pack their positional inputs through the hooks around them;
    # what the unpack gives back has no autograd history for a create_graph backward.
    Refusal("double backward through a drop-in or wrapped module whose inputs the saved-tensor hooks "
            "around it packed",
            lambda p, v: p.around_hooks and p.backward == "double" and v in ("ac2_checkpoint", "ac2_wrap"),
            r"needs the region input, packed by the saved-tensor hooks around the region"),
    # Note [A saved value keeps its recipe] (_history.py): a value the region made and
    # then wrote in place before reading it again has no recipe (Dirty: mark_dirty's mul_).
    Refusal("double backward through a value the region wrote in place (a mark_dirty Function) before "
            "reading it",
            lambda p, v: p.backward == "double" and "Dirty.apply" in p.source(),
            r"needs the saved value made in the region by aten\.mul_\.Tensor, read after an in-place write"),
    # _history.py's _gone: a custom Function's output has the Function's history, which no
    # replay makes again; a recipe reads it by weak reference, and the program freed it.
    Refusal("double backward through a saved op reading a custom Function's output the program freed",
            lambda p, v: p.backward == "double" and ".apply" in p.source(),
            r"whose history ac2_dist cannot make again \(the output of a custom autograd\.Function"),
    # _history.py's _check_no_history: under torch.vmap the recorder sees a custom
    # Function's inner ops on unwrapped tensors, so the recompute of a saved op reading the
    # Function's output finds no history where eager had the Function's.
    Refusal("double backward through a saved op whose recompute reads a custom Function's inner values",
            lambda p, v: p.backward == "double" and ".apply" in p.source(),
            r"its recompute read values that have none although that op's inputs had one in forward: values "
            r"computed inside a custom autograd\.Function's forward"),
)


@dataclass(frozen=True)
class Known:
    """A discrepancy this fuzzer found and reported, not fixed yet: a failure whose
    ``kind: detail`` matches ``pattern`` is counted apart (``--strict`` fails on it).
    ``program`` is its minimal program and ``variant`` an ac2 variant where it fails
    (tests/test_modes_fuzz.py checks that it still does: a fixed issue must leave this
    list)."""

    name: str
    pattern: str
    program: Program
    variant: str
    applies: Callable[[Program], bool] = lambda p: True


def _minimal(stmts: list[str], ret: str, **kw: Any) -> Program:
    return Program(0, stmts, ret, backward="double", **kw)


KNOWN = (
    Known("double backward: torch.vmap's in-place squeeze_ of an intermediate is never replayed",
          r"crash: RuntimeError: ac2_dist: backward with create_graph=True needs the saved output of "
          r"aten\.squeeze_\.dims( \(needed to recompute [^)]*\))? with its autograd history, and ac2_dist "
          r"cannot recompute it",
          _minimal(["t1 = torch.vmap(lambda r: (r @ w).sin())(x)"], "t1"), "ac2_must_save_all",
          applies=lambda p: "torch.vmap" in p.source()),
)


def _program_packs(packs: list) -> list:
    """What torch's checkpoint packed of the program's tensors: torch 2.10 and 2.11 also save
    an empty placeholder tensor in front of each call's inputs (0 elements, none of the
    program's; later releases do not), which is left out."""
    return [p for p in packs if not (tuple(p[0]) == (0,) and p[-1] is None)]


def refusal(program: Program, variant: str, error: str) -> Refusal | None:
    return next((r for r in REFUSALS if r.applies(program, variant) and re.search(r.pattern, error)), None)


def known_issue(failure: Failure) -> Known | None:
    return next((k for k in KNOWN if k.applies(failure.program)
                 and re.search(k.pattern, f"{failure.kind}: {failure.detail}")), None)


def _track_variant(program: Program) -> tuple[str, bool]:
    """The ac2 variant of the program's extra run under :class:`_Made`."""
    return AC2_VARIANTS[random.Random(program.seed * 7 + 3).randrange(len(AC2_VARIANTS))]


def check_program(program: Program, variants: list[tuple[str, bool]] | None = None, strict: bool = False) -> Result:
    """Every comparison of the module docstring for one program. A documented refusal
    (:data:`REFUSALS`) is counted in ``refused``; a failure of a known issue
    (:data:`KNOWN`) goes to ``known``, unless ``strict``."""
    ref = run_variant(program, "eager")
    if ref.error is not None:
        return Result("invalid", f"eager raises {ref.error}")
    again = run_variant(program, "eager")
    if again.error is not None or compare(again.obs, ref.obs) or again.obs.around != ref.obs.around:
        return Result("invalid", "eager is not deterministic")
    res = Result("ok", outcomes={"eager": ref})
    res.leak_checked = not ref.alive
    for t in ("torch", "torch_sac"):
        got = run_variant(program, t)
        res.outcomes[t] = got
        res.torch[t] = "raises" if got.error else "differs" if compare(got.obs, ref.obs) else "matches"
    torch_run = res.outcomes["torch"]
    for variant, python in variants if variants is not None else AC2_VARIANTS:
        name = variant_name(variant, python)
        got = run_variant(program, variant, python_recorder=python)
        res.outcomes[name] = got
        fail = functools.partial(Failure, program.seed, name, program=program)
        if got.error is not None:
            refused = refusal(program, variant, got.error)
            if refused is not None:
                res.refused.append(f"{name}: {refused.name}")
            else:
                res.failures.append(fail("crash", got.error))
        else:
            res.failures += [fail(kind, detail) for kind, detail in compare(got.obs, ref.obs)]
            if (variant == "ac2_checkpoint" and program.around_hooks and torch_run.error is None
                    and got.obs.around != _program_packs(torch_run.obs.around)):
                res.failures.append(fail("wrong_packs", f"saved-tensor hooks around the region packed "
                                                        f"{got.obs.around}, under torch's checkpoint "
                                                        f"{_program_packs(torch_run.obs.around)}"))
        if res.leak_checked and got.error is None and got.alive:
            res.failures.append(fail("leak", f"alive after the step: {got.alive}"))
    if variants is None:  # the extra run: every tensor made in forward
        control = run_variant(program, "eager", track=True)
        if control.error is None and not control.alive:
            variant, python = _track_variant(program)
            name = variant_name(variant, python) + ", every forward tensor tracked"
            got = run_variant(program, variant, python_recorder=python, track=True)
            res.outcomes[name] = got
            if got.error is None:  # the tracking mode around the region changes nothing
                res.failures += [Failure(program.seed, name, kind, detail, program)
                                 for kind, detail in compare(got.obs, ref.obs)]
            if got.error is None and got.alive:
                res.failures.append(Failure(program.seed, name, "leak_made",
                                            f"made in forward, alive after the step: {got.alive[:8]}"
                                            f"{' ...' if len(got.alive) > 8 else ''}", program))
    if not strict:
        res.known = [(k.name, f) for f in res.failures if (k := known_issue(f)) is not None]
        res.failures = [f for f in res.failures if known_issue(f) is None]
    if res.failures:
        res.status = "failed"
    seen: dict[bool, set] = {False: set(), True: set()}
    for f in res.failures + [f for _, f in res.known]:
        if "every forward tensor" not in f.variant:
            seen["python recorder" in f.variant].add((f.variant.split(" (")[0], f.kind))
    res.recorders_differ = C_DISPATCH is not None and seen[False] != seen[True]
    return res


# ---- minimizing ------------------------------------------------------------------------


def _still_fails(program: Program, failure: Failure) -> bool:
    variant = failure.variant.split(" (")[0]
    python = "python recorder" in failure.variant
    res = check_program(program, variants=[(variant, python)], strict=True) if failure.kind != "leak_made" \
        else check_program(program, strict=True)
    return any(f.kind == failure.kind and f.variant == failure.variant for f in res.failures)


def minimize(failure: Failure, budget_s: float = 30.0) -> Program:
    """Drop steps one at a time, then simplify the settings, while the program fails the
    same way (the same variant, the same kind)."""
    prog = failure.program
    deadline = time.monotonic() + budget_s
    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        for k in reversed(range(len(prog.stmts))):
            if k < len(prog.stmts) and time.monotonic() < deadline:
                cand = prog.replace(stmts=prog.stmts[:k] + prog.stmts[k + 1:])
                if _still_fails(cand, failure):
                    prog, changed = cand, True
        for kw in ({"backward": "once"}, {"around_autocast": False, "backward_in_autocast": False},
                   {"around_hooks": False}, {"backward_in_autocast": False}):
            cand = prog.replace(**kw)
            if cand.settings() != prog.settings() and _still_fails(cand, failure):
                prog, changed = cand, True
    return prog


# ---- the loop ------------------------------------------------------------------------


@dataclass
class Summary:
    seeds: int = 0
    invalid: int = 0
    run: int = 0
    failed: int = 0
    torch: dict[str, dict[str, int]] = field(default_factory=dict)
    leak_unchecked: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # documented refusals: name -> programs
    known: dict[str, list[int]] = field(default_factory=dict)  # KNOWN name -> seeds
    recorders_differ: list[int] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)
    features: dict[str, int] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def format(self, show: int = 3) -> str:
        rate = self.run / self.seconds * 60 if self.seconds else 0.0
        t = {k: ", ".join(f"{n} {s}" for s, n in sorted(v.items())) for k, v in self.torch.items()}
        lines = [f"modes fuzzer: {self.seeds} seeds in {self.seconds:.1f} s: {self.invalid} invalid eagerly, "
                 f"{self.run} run ({rate:.0f} programs/minute), {self.failed} failing; "
                 f"torch's checkpoint: {t.get('torch', '-')}; its selective checkpoint: {t.get('torch_sac', '-')}; "
                 f"{self.leak_unchecked} without a leak check (eager leaves tensors alive); "
                 f"the C and the Python recorder failed differently in {len(self.recorders_differ)} "
                 f"{self.recorders_differ[:10]}"]
        if self.features:
            lines.append("  programs run with: " + ", ".join(f"{k} {v}" for k, v in self.features.items()))
        for name, n in self.refused.items():
            lines.append(f"  documented refusal in {n} programs: {name}")
        for name, seeds in self.known.items():
            lines.append(f"  known issue (not failing; --strict fails) in {len(seeds)} programs {seeds[:8]}: {name}")
        if self.kinds:
            lines.append("  failures by kind (a program counts once per kind): "
                         + ", ".join(f"{k} {v}" for k, v in sorted(self.kinds.items())))
        for f in self.failures[:show]:
            lines.append(f.format())
        if len(self.failures) > show:
            lines.append(f"  ... and {len(self.failures) - show} more failing programs")
        if self.saved:
            lines.append(f"  failing programs saved: {self.saved[:5]}{' ...' if len(self.saved) > 5 else ''}")
        return "\n".join(lines)


def save_failure(directory: str, res: Result, program: Program) -> str:
    """Write the failing program, its settings and every failure to ``directory``."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"seed_{program.seed}.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# modes fuzzer: seed {program.seed}; replay: python -m tests._modes_fuzz --seed {program.seed} -v\n")
        f.write(f"# {program.settings()}\n")
        for fl in res.failures:
            f.write(f"# FAIL {fl.variant}: {fl.kind}: {fl.detail[:400]}\n")
        f.write(program.source())
    return path


def fuzz(seeds: Iterator[int], *, programs: int | None = None, seconds: float | None = None,
         save_dir: str | None = None, strict: bool = False, verbose: bool = False,
         log: Callable[[str], None] = print) -> Summary:
    """Check programs from ``seeds`` until ``programs`` were run (not invalid) or
    ``seconds`` passed."""
    summary = Summary(features={k: 0 for k in FEATURES})
    t0 = time.monotonic()
    for seed in seeds:
        if programs is not None and summary.run >= programs:
            break
        if seconds is not None and time.monotonic() - t0 > seconds:
            break
        summary.seeds += 1
        program = generate(seed)
        res = check_program(program, strict=strict)
        if verbose:
            log(f"seed {seed}: {res.status} {res.why}\n  {program.settings()}")
            log(_indent(program.source(), "  | ").rstrip())
            for name, o in res.outcomes.items():
                log(f"  {name}: error {o.error}, alive {o.alive[:4]}, packs {o.obs.packs}, hooks {sorted(o.obs.seen)}")
            for f in res.failures:
                log(f"  FAIL {f.variant}: {f.kind}: {f.detail[:300]}")
            for name, f in res.known:
                log(f"  known issue: {f.variant}: {name}")
            for r in res.refused:
                log(f"  refused as documented: {r}")
        if res.status == "invalid":
            summary.invalid += 1
            continue
        summary.run += 1
        for k, check in FEATURES.items():
            summary.features[k] += bool(check(program))
        for t, status in res.torch.items():
            summary.torch.setdefault(t, {})
            summary.torch[t][status] = summary.torch[t].get(status, 0) + 1
        summary.leak_unchecked += not res.leak_checked
        for name in {r.split(": ", 1)[1] for r in res.refused}:
            summary.refused[name] = summary.refused.get(name, 0) + 1
        for name in {n for n, _ in res.known}:
            summary.known.setdefault(name, []).append(seed)
        if res.recorders_differ:
            summary.recorders_differ.append(seed)
        if res.failures:
            summary.failed += 1
            summary.failures.append(res.failures[0])
            for kind in {f.kind for f in res.failures}:
                summary.kinds[kind] = summary.kinds.get(kind, 0) + 1
            if save_dir is not None:
                summary.saved.append(save_failure(save_dir, res, program))
            log(f"seed {seed}: FAIL {res.failures[0].variant}: {res.failures[0].kind}: {res.failures[0].detail[:200]}")
    summary.seconds = time.monotonic() - t0
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=None, help="run for this long (the long mode)")
    p.add_argument("--minutes", type=float, default=None)
    p.add_argument("--programs", type=int, default=None, help="stop after this many programs run")
    p.add_argument("--start", type=int, default=0, help="first seed")
    p.add_argument("--seed", type=int, default=None, help="one program only")
    p.add_argument("--minimize", action="store_true", help="shrink and print each failing program")
    p.add_argument("--save-dir", default=os.path.join(tempfile.gettempdir(), "ac2_modes_fuzz"),
                   help="where failing programs are saved, one file per seed")
    p.add_argument("--strict", action="store_true", help="known issues (KNOWN) fail too")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    seconds = a.seconds if a.minutes is None else a.minutes * 60
    if a.seed is not None:
        seeds: Iterator[int] = iter([a.seed])
    else:
        seeds = iter(range(a.start, sys.maxsize))
        if seconds is None and a.programs is None:
            a.programs = 100
    summary = fuzz(seeds, programs=a.programs, seconds=seconds, save_dir=a.save_dir, strict=a.strict, verbose=a.verbose,
                   log=lambda s: print(s, flush=True))
    print(summary.format(show=5))
    if a.minimize:
        for f in summary.failures:
            minimal = minimize(f)
            print(f"\nminimal program for seed {f.seed} ({f.variant}: {f.kind}):\n  {minimal.settings()}")
            print(_indent(minimal.source(), "  | "), end="")
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
