"""A seeded differential fuzzer of in-place writes through views (issue 44).

Each seed makes one random program: ``make(w, h, b)`` returns the region's function
``prog(x, y)``. ``x``, ``y`` (4 x 6) are the region's arguments; ``w`` (6 x 6), ``h``
(4 x 6, requires grad, not a leaf: ``x * 0.5 + y``) and ``b`` (4 x 6, a buffer) are its
state, captured as a module's parameters and buffers are; ``x``, ``y``, ``w`` are leaves
that require grad. The program mixes buffers made inside it (``zeros``, ``empty_like`` +
fill, ``new_empty`` / ``new_zeros``, ``clone``, matmul / einsum results, ``torch.tensor``
literals), every kind of view of them (slices, ``view`` / ``reshape``, ``t`` /
``transpose``, ``unsqueeze``, ``expand``, ``select``, ``narrow``, ``diagonal``,
``as_strided``, ``permute``, one output of ``unbind`` / ``split`` / ``chunk`` /
``split_with_sizes``, advanced-indexing reads), in-place writes through those views, the
bases and sibling views (``copy_``, ``add_``, ``mul_`` by a tensor that requires grad,
``clamp_``, ``sin_``, ``div_``, ``masked_fill_``, ``masked_scatter_`` also with the
destination as source, ``buf[idx] = v``, ``buf[mask] = v``, ``buf[tok] += f(x[tok])``,
``buf[i] = 0.5``, ``index_add_``, ``scatter_``, in-place dropout), writes to the state
(``h``, ``b`` and their views), loops (setitem per row; the MoE token scatter of NllbMoe,
``masked[e, tok] = expert(masked[e, tok])``; the token accumulation ``buf[tok] +=
expert(x[tok])``; DeepseekV2's ``new_x[perm] = outs; new_x.view(...).mul_(w).sum(1)``),
reads between writes, and random ops (``dropout``, ``rand_like``, ``randn_like``).

Each program runs eagerly (twice: the reference must be deterministic), under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` and under ac2:
``ac2_dist.checkpoint`` and ``apply_ac_policy("recompute_all")`` and
``apply_ac_policy(<random save list of aten ops>)``, each with the C recorder and the
Python one (``recording_in_python``), ``rng="replay"``. The loss weighs the outputs and the
state ``h``, ``b`` as the region left it. A program that is invalid eagerly (an error, a
loss that needs no grad, a result that differs between two eager runs) is skipped; one
whose torch checkpoint raises is discarded (not counted). For the others, against eager:
no exception, outputs, every input gradient and the state after backward bitwise. Against
torch: the bytes kept from the end of forward to the start of backward, from the
allocator, no more than torch's (its plain checkpoint for ``recompute_all`` and
``ac2_dist.checkpoint``; its selective checkpoint with the same save list for a save
list), where torch's run reproduced eager's outputs, gradients and state (its recompute
re-runs the Python: after a write to the state it computes another program, whose figures
are no reference). And no leak: after backward, and after a forward whose outputs are
dropped without backward, with the cyclic collector off, every byte allocated during the
step is freed and weak references to the inputs, the outputs and the region's graph are
dead.

Note [Kept bytes from the allocator, not from ac2]
    On CPU there is no ``memory_allocated()``; the allocator reports every allocation and
    free (address, size, time) to ``torch.profiler`` when ``profile_memory=True``.
    :class:`AllocatorTrace` replays those events in time order, counting a free only if
    the trace saw the block's allocation (pairing by address), and reads the live bytes at
    named instants (``record_function`` ranges with no duration). It uses only torch: no
    figure ac2 reports (``region.stats``, ``memory.track``) and none of ac2's own
    accounting code (``ac2_dist._measure._alloc``) enters it, so a saved value, a snapshot, a
    generator state or a literal that ac2 keeps counts whoever holds it. The same trace
    measures torch's checkpoint. Kept = live bytes when backward starts minus live bytes
    when forward starts (outputs and the loss count in both: the code around the region
    is the same). Programs without random ops run torch's checkpoint with
    ``preserve_rng_state=False``: it would otherwise keep one CPU generator state
    (5,056 B) that ac2, with nothing random to replay, rightly does not, and that slack
    would hide small excesses (a 4-byte literal).

Run: ``python -m tests._view_fuzz --seconds 300`` (the long mode, exit status 1 on a
failure), ``python -m tests._view_fuzz --seed 17 -v`` (one program, its source and every
variant's figures), ``--minimize`` (shrink each failing program, statement by statement,
while it fails the same way) and ``--classify`` (name the issue-44 cause of each failure
after minimizing). ``tests/test_view_write_fuzz.py`` runs a fixed budget of seeds
(``AC2_FUZZ_SECONDS`` turns it into a timed run).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import gc
import os
import random
import re
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch._C._profiler import _ExtraFields_Allocation
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import ac2_dist as ac
from ac2_dist._trace._tracer import C_DISPATCH, recording_in_python

aten = torch.ops.aten
R, C = 4, 6  # x, y, h, b are R x C; w is C x C
E = 2  # experts in the MoE templates
SCALARS = ("0.5", "1.5", "-0.25", "2.0", "0.75")
SAVE_CANDIDATES = (
    aten.mm.default, aten.index_put_.default, aten.sin.default, aten.mul.Tensor, aten.add.Tensor,
    aten.randn_like.default, aten.rand_like.default, aten.bernoulli_.float, aten.bmm.default,
    aten.tanh.default, aten.index.Tensor, aten.clone.default, aten.cat.default, aten.copy_.default,
    aten.masked_scatter_.default, aten.index_add_.default,
)
RANDOM_OPS = (aten.randn_like.default, aten.rand_like.default, aten.bernoulli_.float)


# ---- allocator trace (Note [Kept bytes from the allocator, not from ac2]) -------------------


def _op_path(e: Any) -> str:
    """``outermost op > innermost op`` around an allocation event (marks excluded)."""
    names = []
    p = e.parent
    while p is not None:
        if not p.name.startswith(AllocatorTrace._PREFIX):
            names.append(p.name)
        p = p.parent
    if not names:
        return "(no op)"
    return names[-1] if len(names) == 1 else f"{names[-1]} > {names[0]}"


class AllocatorTrace:
    """Live bytes of the CPU allocator at named instants, from torch.profiler's memory
    events; blocks allocated before the trace are not counted (nor their frees).
    ``live[mark]``: bytes; ``blocks[mark]``: ``(bytes, ops that allocated it, the mark
    before its allocation)`` of each block alive then (ops: the outermost and innermost
    profiler events around the allocation)."""

    _PREFIX = "view_fuzz::"

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.blocks: dict[str, list[tuple[int, str, str]]] = {}
        self.peak = 0
        self._prof: Any = None

    def __enter__(self) -> AllocatorTrace:
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
        self._prof.__enter__()
        return self

    def mark(self, name: str) -> None:
        with record_function(self._PREFIX + name):
            pass

    def __exit__(self, *exc: Any) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(*exc)
        allocs: list[tuple[int, int, int, str]] = []
        marks: list[tuple[int, str]] = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if isinstance(e.extra_fields, _ExtraFields_Allocation):
                if e.extra_fields.device.type == "cpu":
                    op = _op_path(e)
                    allocs.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size, op))
            elif e.name.startswith(self._PREFIX):
                marks.append((e.start_time_ns, e.name[len(self._PREFIX):]))
        allocs.sort(key=lambda a: a[0])
        stream: list[tuple[int, int, Any, int]] = [(t, 0, name, 0) for t, name in marks]
        born: dict[int, tuple[int, str]] = {}
        for t, ptr, nbytes, op in allocs:
            if nbytes > 0:
                born[ptr] = (nbytes, op)
                stream.append((t, 1, (ptr, nbytes, op), nbytes))
            elif ptr in born:
                stream.append((t, 1, (ptr, 0, ""), -born.pop(ptr)[0]))
        stream.sort(key=lambda s: (s[0], s[1]))
        live = 0
        alive: dict[int, tuple[int, str, str]] = {}
        last = ""
        for _, kind, value, delta in stream:
            if kind == 0:
                self.live[value] = live
                self.blocks[value] = sorted(alive.values())
                last = value
                continue
            ptr, nbytes, op = value
            if delta > 0:
                alive[ptr] = (nbytes, op, last)
            else:
                alive.pop(ptr, None)
            live += delta
            self.peak = max(self.peak, live)


# ---- programs ---------------------------------------------------------------------------


@dataclass
class Root:
    """A storage: an input, or a tensor the program made."""

    kind: str  # "leaf" (x, y, w), "input" (h, b: writable region inputs), "fresh"
    rg: bool  # requires grad now
    saved: bool = False  # autograd saved it (or a view) for backward: eager forbids writes


@dataclass
class Val:
    name: str
    shape: tuple[int, ...]
    root: Root
    view: bool = False
    expanded: bool = False  # overlapping memory: no writes
    multi: bool = False  # one output of a multi-output view op
    contig: bool = True
    strided: bool = False  # contiguous, storage offset 0, the whole storage (as_strided)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Index:
    """A 1-d int64 tensor of distinct values < ``bound`` (``len``), or a bool mask."""

    name: str
    len: int
    bound: int
    literal: bool


@dataclass
class Program:
    seed: int
    stmts: list[str]  # each a statement or a block, without the function's indent
    outputs: list[str]
    save_list: tuple = ()

    def source(self) -> str:
        body = []
        for s in self.stmts:
            body += ["        " + line for line in s.split("\n")]
        outs = ", ".join(self.outputs)
        return ("def make(w, h, b):  # the region's state: a parameter, a tensor and a buffer\n"
                "    def prog(x, y):  # the region's arguments\n"
                + "\n".join(body) + f"\n        return ({outs},)\n    return prog\n")

    def compile(self) -> Callable:
        """``make(w, h, b)``, which returns the region's function ``prog(x, y)``."""
        ns: dict[str, Any] = {"torch": torch, "F": F, "aten_tensor": aten_tensor}
        exec(compile(self.source(), f"<view_fuzz seed {self.seed}>", "exec"), ns)  # noqa: S102
        return ns["make"]

    @property
    def random_ops(self) -> int:
        """Calls of random ops in the source (a loop body counts once)."""
        return sum(len(_RANDOM_CALL.findall(st)) for st in self.stmts)

    @property
    def has_rng(self) -> bool:
        return self.random_ops > 0


_RANDOM_CALL = re.compile(r"\b(?:rand_like|randn_like|dropout|rand|randn|bernoulli_)\(")


def _shape_str(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


class Generator:
    """Builds one program from a seed, keeping the eager rules it knows (no write into a
    leaf, an expanded view, a value autograd saved, a multi-output view when grad is
    involved). What it does not model eager finds: such a program is skipped."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.vals: list[Val] = []
        self.index: list[Index] = []
        self.masks: list[Index] = []
        self.stmts: list[str] = []
        self.random_kinds: set = set()
        self.n = 0
        leaf = lambda: Root("leaf", True)  # noqa: E731
        self.vals += [Val("x", (R, C), leaf()), Val("y", (R, C), leaf()), Val("w", (C, C), leaf()),
                      Val("h", (R, C), Root("input", True)), Val("b", (R, C), Root("input", False))]

    # helpers
    def fresh_name(self, prefix: str = "t") -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def pick(self, pred: Callable[[Val], bool] = lambda v: True) -> Val | None:
        cands = [v for v in self.vals if pred(v)]
        return self.rng.choice(cands) if cands else None

    def scalar(self) -> str:
        return self.rng.choice(SCALARS)

    def writable(self, v: Val) -> bool:
        r = v.root
        return r.kind != "leaf" and not v.expanded and not r.saved and not (v.multi and r.rg)

    def dst(self, pred: Callable[[Val], bool]) -> Val | None:
        """A tensor to write: mostly one the program made. A write into a region input
        (``h``, ``b``) is legal eagerly and under torch's checkpoint, whose recompute
        writes it again (its gradients then differ from eager's): 1 write in 5."""
        inputs = self.rng.random() < 0.2
        d = self.pick(lambda v: self.writable(v) and pred(v) and (inputs or v.root.kind == "fresh"))
        return d if d is not None else self.pick(lambda v: self.writable(v) and pred(v))

    def read(self, vals: list[Val], saves: bool) -> None:
        """``vals`` are read by an op that saves its inputs for backward (if any needs grad)."""
        if saves and any(v.root.rg for v in vals):
            for v in vals:
                v.root.saved = True

    def new_root(self, name: str, shape: tuple[int, ...], rg: bool, contig: bool = True) -> Val:
        v = Val(name, shape, Root("fresh", rg), contig=contig, strided=contig)
        self.vals.append(v)
        return v

    def src(self, shape: tuple[int, ...], grad: bool | None = None) -> tuple[str, bool]:
        """An expression of ``shape`` read from some value, and whether it requires grad.
        ``grad=False``: one that does not (detached if need be). ``self.last_src``: the
        value it reads."""
        n = 1
        for s in shape:
            n *= s
        v = self.pick(lambda u: u.numel >= n and u.numel > 0)
        if v is None:
            v = self.vals[0]
        self.last_src = v
        if v.shape == shape and self.rng.random() < 0.6:
            expr = v.name
        elif shape == ():
            expr = f"{v.name}.reshape(-1)[{self.rng.randrange(n if n else 1)}]"
        else:
            expr = f"{v.name}.reshape(-1)[:{n}].view{_shape_str(shape)}"
        rg = v.root.rg
        if grad is False and rg:
            expr, rg = f"{expr}.detach()", False
        wrap = self.rng.random()
        if wrap < 0.2:
            self.read([v], saves=True)
            expr = f"{expr}.sin()"
        elif wrap < 0.35:
            expr = f"({expr} * {self.scalar()})"
        elif wrap < 0.45:
            expr = f"{expr}.tanh()"
        return expr, rg

    def mask_expr(self, shape: tuple[int, ...]) -> str:
        n = 1
        for s in shape:
            n *= s
        r = self.rng.random()
        if r < 0.35:
            bits = [self.rng.random() < 0.5 for _ in range(n)]
            return f"torch.tensor({bits}).view{_shape_str(shape)}"
        if r < 0.6:
            return f"(torch.arange({n}) % {self.rng.choice([2, 3])} == {self.rng.randrange(2)}).view{_shape_str(shape)}"
        expr, _ = self.src(shape, grad=False)
        return f"({expr} > 0)"

    def index_for(self, bound: int) -> Index | None:
        """An index of distinct values < ``bound``: an existing one or a new statement."""
        old = [i for i in self.index if i.bound <= bound]
        if old and self.rng.random() < 0.5:
            return self.rng.choice(old)
        return self.make_index(bound)

    def make_index(self, bound: int) -> Index:
        k = self.rng.randint(1, bound)
        name = self.fresh_name("i")
        r = self.rng.random()
        literal = r < 0.4
        if literal:
            perm = list(range(bound))
            self.rng.shuffle(perm)
            expr = f"torch.tensor({perm[:k]})"
        elif r < 0.7:
            roll = self.rng.randrange(bound)
            flip = ".flip(0)" if self.rng.random() < 0.5 else ""
            expr = f"torch.arange({bound}).roll({roll}){flip}[:{k}]"
        else:
            src, _ = self.src((bound,), grad=False)
            expr = f"{src}.argsort(stable=True)[:{k}]"
        self.stmts.append(f"{name} = {expr}")
        idx = Index(name, k, bound, literal)
        self.index.append(idx)
        return idx

    # statements
    def create(self) -> None:
        rng = self.rng
        name = self.fresh_name("t")
        r = rng.random()
        if r < 0.1:
            self.parts(name)
        elif r < 0.2:
            shape = rng.choice([(R, C), (C,), (2, C), (R, 2, 3)])
            self.stmts.append(f"{name} = torch.zeros{_shape_str(shape)}")
            self.new_root(name, shape, False)
        elif r < 0.3:
            u = self.pick()
            how = rng.choice([f".fill_({self.scalar()})", ".zero_()"])
            self.stmts.append(f"{name} = torch.empty_like({u.name}){how}")
            self.new_root(name, u.shape, False, contig=u.contig)
        elif r < 0.4:
            u = self.pick()
            shape = rng.choice([(R, C), (C,), (3, C)])
            how = rng.choice([f"new_empty({_shape_str(shape)}).fill_({self.scalar()})",
                              f"new_zeros({_shape_str(shape)})", f"new_ones({_shape_str(shape)})"])
            self.stmts.append(f"{name} = {u.name}.{how}")
            self.new_root(name, shape, False)
        elif r < 0.55:
            u = self.pick()
            self.stmts.append(f"{name} = {u.name}.clone()")
            self.new_root(name, u.shape, u.root.rg, contig=u.contig)
        elif r < 0.75:
            u = self.pick(lambda v: len(v.shape) >= 1 and v.shape[-1] == C)
            if u is None:
                return
            if len(u.shape) == 2 and rng.random() < 0.5:
                expr = f"torch.einsum('ij,jk->ik', {u.name}, w)"
            else:
                expr = f"{u.name} @ w"
            self.read([u, self.vals[2]], saves=True)
            self.stmts.append(f"{name} = {expr}")
            self.new_root(name, u.shape, True)
        elif r < 0.85:
            expr, rg = self.src((R, C))
            self.stmts.append(f"{name} = {expr} * {self.scalar()}")
            self.new_root(name, (R, C), rg)
        else:
            vals = [round(rng.uniform(-1, 1), 2) for _ in range(C)]
            self.stmts.append(f"{name} = torch.tensor({vals})")
            self.new_root(name, (C,), False)

    def parts(self, name: str) -> None:
        """A buffer that needs no grad, filled through one output of a multi-output view
        op, then read with a value that needs grad (cause B)."""
        rng = self.rng
        self.stmts.append(f"{name} = " + rng.choice([f"torch.zeros({R}, {C})", f"b.new_zeros(({R}, {C}))",
                                                     f"torch.empty_like(b).fill_({self.scalar()})"]))
        buf = self.new_root(name, (R, C), False)
        part = self.fresh_name("v")
        d = rng.randrange(2)
        k = rng.randrange(2)
        expr, shape = rng.choice([
            (f"{name}.unbind({d})[{k}]", ((C,), (R,))[d]),
            (f"{name}.split(2, {d})[{k}]", ((2, C), (R, 2))[d]),
            (f"{name}.chunk(2, {d})[{k}]", ((2, C), (R, 3))[d]),
            (f"{name}.split_with_sizes([1, {(R, C)[d] - 1}], {d})[{k}]", ((1, C), (R, 1))[d] if k == 0
             else ((R - 1, C), (R, C - 1))[d]),
        ])
        self.stmts.append(f"{part} = {expr}")
        self.vals.append(Val(part, shape, buf.root, view=True, multi=True, contig=d == 0))
        src, _ = self.src(shape, grad=False)
        self.stmts.append(rng.choice([f"{part}.copy_({src})", f"{part}.add_({src})", f"{part}.fill_({self.scalar()})"]))
        if rng.random() < 0.6:
            r = self.fresh_name("r")
            g = self.pick(lambda v: v.shape == (R, C) and v.root.rg)
            self.stmts.append(f"{r} = {name} * {g.name}")
            self.read([buf, g], saves=True)
            self.new_root(r, (R, C), True)

    def view(self) -> None:  # noqa: C901 - one case per view kind
        rng = self.rng
        u = self.pick(lambda v: v.shape != () and v.numel > 0)
        if u is None:
            return
        name = self.fresh_name("v")
        s = u.shape
        nd = len(s)
        contig = False
        multi = expanded = False
        kind = rng.choice(["slice0", "slice1", "step", "t", "unsqueeze", "expand", "select", "narrow",
                           "diagonal", "view", "reshape", "as_strided", "unbind", "split", "chunk",
                           "split_with_sizes", "permute"])
        if kind == "slice0":
            a = rng.randrange(s[0])
            e = rng.randint(a + 1, s[0])
            expr, shape, contig = f"{u.name}[{a}:{e}]", (e - a,) + s[1:], u.contig
        elif kind == "slice1" and nd >= 2:
            a = rng.randrange(s[1])
            e = rng.randint(a + 1, s[1])
            expr, shape = f"{u.name}[:, {a}:{e}]", (s[0], e - a) + s[2:]
        elif kind == "step":
            expr, shape = f"{u.name}[..., ::2]", s[:-1] + ((s[-1] + 1) // 2,)
        elif kind == "t" and nd == 2:
            expr, shape = rng.choice([f"{u.name}.t()", f"{u.name}.transpose(0, 1)"]), (s[1], s[0])
        elif kind == "unsqueeze":
            d = rng.randrange(nd + 1)
            expr, shape, contig = f"{u.name}.unsqueeze({d})", s[:d] + (1,) + s[d:], u.contig
        elif kind == "expand":
            expr, shape, expanded = f"{u.name}.unsqueeze(0).expand(2, *{u.name}.shape)", (2,) + s, True
        elif kind == "select":
            d = rng.randrange(nd)
            i = rng.randrange(s[d])
            expr = f"{u.name}[{i}]" if d == 0 and rng.random() < 0.5 else f"{u.name}.select({d}, {i})"
            shape, contig = s[:d] + s[d + 1:], u.contig and d == 0
        elif kind == "narrow":
            d = rng.randrange(nd)
            a = rng.randrange(s[d])
            ln = rng.randint(1, s[d] - a)
            expr, shape, contig = f"{u.name}.narrow({d}, {a}, {ln})", s[:d] + (ln,) + s[d + 1:], u.contig and d == 0
        elif kind == "diagonal" and nd == 2:
            expr, shape = f"{u.name}.diagonal()", (min(s),)
        elif kind == "view" and u.contig:
            if nd == 2 and rng.random() < 0.5:
                expr, shape = f"{u.name}.view({s[1]}, {s[0]})", (s[1], s[0])
            elif u.numel % 2 == 0 and rng.random() < 0.5:
                expr, shape = f"{u.name}.view(2, -1)", (2, u.numel // 2)
            else:
                expr, shape = f"{u.name}.view(-1)", (u.numel,)
            contig = True
        elif kind == "reshape":
            expr, shape, contig = f"{u.name}.reshape(-1)", (u.numel,), u.contig
        elif kind == "as_strided" and u.strided and nd == 2 and s[0] >= 2 and s[1] >= 3:
            expr, shape = f"{u.name}.as_strided(({s[0] - 1}, 2), ({s[1]}, 1), 1)", (s[0] - 1, 2)
        elif kind == "unbind":
            k = rng.randrange(s[0])
            expr, shape, contig, multi = f"{u.name}.unbind(0)[{k}]", s[1:], u.contig, True
        elif kind in ("split", "chunk", "split_with_sizes"):
            d = rng.randrange(nd)
            if s[d] < 2:
                return
            first = rng.randint(1, s[d] - 1)
            k = rng.randrange(2)
            if kind == "split":
                expr = f"{u.name}.split({first}, {d})[{k}]"
                parts = [first] * (s[d] // first) + ([s[d] % first] if s[d] % first else [])
                k = rng.randrange(len(parts))
                expr = f"{u.name}.split({first}, {d})[{k}]"
                size = parts[k]
            elif kind == "chunk":
                per = (s[d] + 1) // 2
                parts = [per, s[d] - per] if s[d] - per else [per]
                k = rng.randrange(len(parts))
                expr, size = f"{u.name}.chunk(2, {d})[{k}]", parts[k]
            else:
                expr, size = f"{u.name}.split_with_sizes([{first}, {s[d] - first}], {d})[{k}]", [first, s[d] - first][k]
            shape, contig, multi = s[:d] + (size,) + s[d + 1:], u.contig and d == 0, True
        elif kind == "permute" and nd == 3:
            expr, shape = f"{u.name}.permute(2, 0, 1)", (s[2], s[0], s[1])
        else:
            return
        self.stmts.append(f"{name} = {expr}")
        self.vals.append(Val(name, shape, u.root, view=True, expanded=expanded or u.expanded,
                             multi=multi or u.multi, contig=contig))

    def write(self) -> None:  # noqa: C901 - one case per write kind
        rng = self.rng
        d = self.dst(lambda v: v.numel > 0)
        if d is None:
            return
        s = d.shape
        nograd = d.multi  # a multi-output view: only values that need no grad (eager's rule)
        grad = False if nograd else None
        kind = rng.choice(["copy", "add", "mul_t", "mul_s", "clamp", "sin", "div", "masked_fill",
                           "masked_scatter_self", "masked_scatter", "setitem_idx", "setitem_mask",
                           "iadd_idx", "setitem_scalar", "setitem_row", "index_add", "scatter", "fill",
                           "dropout"])
        rg_in = False
        if kind == "copy":
            e, rg_in = self.src(s, grad)
            line = f"{d.name}.copy_({e})"
        elif kind == "add":
            e, rg_in = self.src(s, grad)
            line = f"{d.name}.add_({e})" if rng.random() < 0.6 else f"{d.name}.add_({e}, alpha={self.scalar()})"
        elif kind == "mul_t":
            e, rg_in = self.src(s, grad)
            line = f"{d.name}.mul_({e})"
            if d.root.rg or rg_in:
                self.last_src.root.saved = True
        elif kind == "mul_s":
            line = f"{d.name}.mul_({self.scalar()})"
        elif kind == "clamp":
            line = f"{d.name}.clamp_(-0.5, 0.5)"
        elif kind == "sin":
            line = f"{d.name}.sin_()"
        elif kind == "div":
            e, rg_in = self.src(s, grad)
            line = f"{d.name}.div_({e}.abs() + 1.0)"
        elif kind == "masked_fill":
            line = f"{d.name}.masked_fill_({self.mask_expr(s)}, {self.scalar()})"
        elif kind == "masked_scatter_self":
            line = f"{d.name}.masked_scatter_({self.mask_expr(s)}, {d.name})"
        elif kind == "masked_scatter":
            e, rg_in = self.src(s, grad)
            line = f"{d.name}.masked_scatter_({self.mask_expr(s)}, {e})"
        elif kind in ("setitem_idx", "iadd_idx", "index_add") and len(s) >= 1:
            idx = self.index_for(s[0])
            if idx is None:
                return
            e, rg_in = self.src((idx.len,) + s[1:], grad)
            if kind == "setitem_idx":
                line = f"{d.name}[{idx.name}] = {e}"
            elif kind == "iadd_idx":
                line = f"{d.name}[{idx.name}] += {e}"
            else:
                line = f"{d.name}.index_add_(0, {idx.name}, {e})"
        elif kind == "setitem_mask":
            m = self.mask_expr(s[:1] if s and rng.random() < 0.5 else s)
            if rng.random() < 0.5 or not s:
                line = f"{d.name}[{m}] = {self.scalar()}"
            else:
                e, rg_in = self.src(s, grad)
                mname = self.fresh_name("m")
                self.stmts.append(f"{mname} = {m}")
                line = f"{d.name}[{mname}] = {e}[{mname}]"
        elif kind == "setitem_scalar" and len(s) >= 1:
            line = f"{d.name}[{rng.randrange(s[0])}] = {self.scalar()}"
        elif kind == "setitem_row" and len(s) >= 1:
            e, rg_in = self.src(s[1:], grad)
            line = f"{d.name}[{rng.randrange(s[0])}] = {e}"
        elif kind == "scatter" and len(s) == 2:
            k = rng.randint(1, s[1])
            if rng.random() < 0.4:
                rows = []
                for _ in range(s[0]):
                    perm = list(range(s[1]))
                    rng.shuffle(perm)
                    rows.append(perm[:k])
                iexpr = f"torch.tensor({rows})"
            else:
                iexpr = f"torch.arange({s[1]}).roll({rng.randrange(s[1])})[:{k}].expand({s[0]}, {k})"
            e, rg_in = self.src((s[0], k), grad)
            line = f"{d.name}.scatter_(1, {iexpr}, {e})"
        elif kind == "fill":
            line = rng.choice([f"{d.name}.fill_({self.scalar()})", f"{d.name}.zero_()"])
        elif kind == "dropout":
            if d.multi:
                return
            self.random_kinds.add(aten.bernoulli_.float)
            line = f"F.dropout({d.name}, 0.25, training=True, inplace=True)"
        else:
            return
        self.stmts.append(line)
        if rg_in and not nograd:
            d.root.rg = True
        if kind == "dropout" and d.root.rg:
            d.root.saved = False  # the mask is saved, not the value

    def compute(self) -> None:
        """A read between writes: a new value from existing ones."""
        rng = self.rng
        name = self.fresh_name("r")
        u = self.pick(lambda v: v.numel > 0)
        r = rng.random()
        if r < 0.25:
            fn, saves = rng.choice([("sin()", True), ("cos()", True), ("tanh()", False), ("relu()", False)])
            self.stmts.append(f"{name} = {u.name}.{fn}")
            self.read([u], saves=saves)
            self.new_root(name, u.shape, u.root.rg)
            if not saves and u.root.rg:
                self.vals[-1].root.saved = True  # tanh / relu save their output
        elif r < 0.45:
            self.stmts.append(f"{name} = {u.name} * {self.scalar()} + {self.scalar()}")
            self.new_root(name, u.shape, u.root.rg)
        elif r < 0.6:
            e, rg = self.src(u.shape)
            op = rng.choice(["+", "*"])
            self.stmts.append(f"{name} = {u.name} {op} {e}")
            if op == "*":
                self.read([u, self.last_src], saves=True)
            self.new_root(name, u.shape, u.root.rg or rg)
        elif r < 0.72 and u.shape != ():
            idx = self.index_for(u.shape[0])
            self.stmts.append(f"{name} = {u.name}[{idx.name}]")
            self.new_root(name, (idx.len,) + u.shape[1:], u.root.rg)
        elif r < 0.82 and len(u.shape) >= 1:
            d = rng.randrange(len(u.shape))
            self.stmts.append(f"{name} = {u.name}.sum({d})")
            self.new_root(name, u.shape[:d] + u.shape[d + 1:], u.root.rg)
        elif r < 0.9:
            fn = rng.choice(["torch.rand_like", "torch.randn_like"])
            self.random_kinds.add(aten.rand_like.default if fn == "torch.rand_like" else aten.randn_like.default)
            self.stmts.append(f"{name} = {u.name} * {fn}({u.name})")
            self.read([u], saves=True)
            self.new_root(name, u.shape, u.root.rg)
        else:
            self.random_kinds.add(aten.bernoulli_.float)
            self.stmts.append(f"{name} = F.dropout({u.name}, 0.3, training=True)")
            self.new_root(name, u.shape, u.root.rg)

    def loop(self) -> None:
        """A loop of writes: per-row setitem, or an MoE token scatter / accumulate."""
        rng = self.rng
        kind = rng.choice(["scalar_rows", "rows", "moe_scatter", "moe_accumulate", "moe_combine"])
        if kind in ("scalar_rows", "rows"):
            d = self.dst(lambda v: len(v.shape) >= 1 and v.numel > 0)
            if d is None:
                return
            n = d.shape[0]
            if kind == "scalar_rows":
                self.stmts.append(f"for i in range({n}):\n    {d.name}[i] = {self.scalar()} * i")
                return
            u = self.pick(lambda v: v.shape == d.shape)
            if d.multi and u.root.rg:
                return
            op = rng.choice([f"{d.name}[i] = {u.name}[i] * {self.scalar()}", f"{d.name}[i].add_({u.name}[i])",
                             f"{d.name}[i].copy_({u.name}[i].sin())"])
            if "sin" in op:
                self.read([u], saves=True)
            self.stmts.append(f"for i in range({n}):\n    {op}")
            if u.root.rg and not d.multi:
                d.root.rg = True
            return
        u = self.pick(lambda v: v.shape == (R, C))
        tokens = self._tokens()
        if kind == "moe_scatter":  # NllbMoe: masked[e, tok] = expert(masked[e, tok])
            route, m = self.fresh_name("route"), self.fresh_name("m")
            self.stmts.append(f"{route} = F.one_hot({tokens[0]}, {E}).to({u.name}.dtype)")
            self.stmts.append(f"{m} = torch.einsum('bm,be->ebm', {u.name}, {route})")
            self.read([u], saves=False)
            fn = rng.choice(["(_ @ w).tanh()", "_ * 0.5 + w[0]", "(_ @ w)"])
            body = fn.replace("_", f"{m}[e, tok]")
            self.stmts.append(f"for e in range({E}):\n    tok = {route}[:, e].bool()\n    {m}[e, tok] = {body}")
            self.read([self.vals[2]], saves=True)
            self.new_root(m, (E, R, C), True)
            return
        if kind == "moe_accumulate":  # buf[tok] += expert(x[tok])
            d = self.dst(lambda v: v.shape == (R, C) and not v.multi)
            if d is None:
                return
            self.stmts.append(f"for e in range({E}):\n    tok = {tokens[1]}[e]\n"
                              f"    {d.name}[tok] += ({u.name}[tok] @ w) * {self.scalar()}")
            self.read([self.vals[2]], saves=True)
            d.root.rg = True
            return
        # moe_combine (DeepseekV2): new_x = empty_like(outs); new_x[perm] = outs; view, mul_, sum
        o, p, nx, wt, r = (self.fresh_name(k) for k in ("outs", "perm", "new_x", "wt", "r"))
        v2 = self.pick(lambda v: v.shape == (R, C))
        self.stmts.append(f"{o} = torch.cat([{u.name} @ w, {v2.name}.sin()], 0)")
        self.read([u, v2, self.vals[2]], saves=True)
        if rng.random() < 0.5:
            perm = list(range(2 * R))
            rng.shuffle(perm)
            self.stmts.append(f"{p} = torch.tensor({perm})")
        else:
            src, _ = self.src((2 * R,), grad=False)
            self.stmts.append(f"{p} = {src}.argsort(stable=True)")
        # one statement: the minimizer must not leave the buffer unwritten (empty memory)
        self.stmts.append(f"{nx} = torch.empty_like({o})\n{nx}[{p}] = {o}")
        e, _ = self.src((R, 2))
        self.stmts.append(f"{wt} = {e}.softmax(-1)")
        self.stmts.append(f"{r} = {nx}.view({R}, 2, -1).type({wt}.dtype).mul_({wt}.unsqueeze(-1)).sum(1)")
        self.new_root(r, (R, C), True)

    def _tokens(self) -> tuple[str, str]:
        """Routing made in the region: a (R,) expert id per token, and per-expert token lists."""
        ids, toks = self.fresh_name("ids"), self.fresh_name("toks")
        if self.rng.random() < 0.5:
            assign = [self.rng.randrange(E) for _ in range(R)]
            self.stmts.append(f"{ids} = torch.tensor({assign})")
            lists = [[t for t in range(R) if assign[t] == e] for e in range(E)]
            self.stmts.append(f"{toks} = [torch.tensor(lst, dtype=torch.long) for lst in {lists}]")
        else:
            self.stmts.append(f"{ids} = torch.arange({R}) % {E}")
            self.stmts.append(f"{toks} = [torch.arange({R})[e::{E}] for e in range({E})]")
        return ids, toks

    def program(self) -> Program:
        rng = self.rng
        steps = rng.randint(3, 12)
        kinds = ["create", "view", "write", "compute", "loop"]
        weights = [0.2, 0.3, 0.3, 0.15, 0.05]
        self.create()
        for _ in range(steps):
            getattr(self, rng.choices(kinds, weights)[0])()
        for _ in range(rng.randint(1, 3)):
            self.view()
            self.write()
        cands = [v for v in self.vals[5:] if v.numel > 0]
        rng.shuffle(cands)
        cands.sort(key=lambda v: not v.root.rg)  # stable: the first output needs grad if one can
        outs = [cands[0].name] if cands else []
        rest = cands[1:]
        rng.shuffle(rest)
        outs += [v.name for v in rest[:rng.randint(0, 2)]]
        if not outs or rng.random() < 0.3:
            outs.append("h")
        save = ()
        if rng.random() < 0.7:
            save = tuple(rng.sample(SAVE_CANDIDATES, rng.randint(1, 3)))
            if self.random_kinds and rng.random() < 0.5:  # a saved random op (cause I)
                save = tuple(dict.fromkeys(save + (rng.choice(sorted(self.random_kinds, key=str)),)))
        return Program(self.seed, self.stmts, outs, save)


def generate(seed: int) -> Program:
    return Generator(seed).program()


# ---- running -------------------------------------------------------------------------


def _inputs(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + seed)
    return [torch.randn(R, C, generator=g), torch.randn(R, C, generator=g), torch.randn(C, C, generator=g) * 0.5,
            torch.randn(R, C, generator=g)]


def _make_args(base: list[torch.Tensor]) -> tuple[list[torch.Tensor], tuple, tuple]:
    """The leaves ``x, y, w``, the region's arguments ``x, y`` and its state ``w, h, b``.

    The state is captured, not passed (as a module's parameters and buffers are): torch's
    non-reentrant checkpoint saves its tensor arguments and refuses any write to them in
    the region, while a write to captured state is legal there (its recompute writes
    again: its gradients then differ from eager's, and its kept bytes are not compared)."""
    x, y, w = (t.clone().requires_grad_() for t in base[:3])
    h = x * 0.5 + y  # requires grad, not a leaf: may be written
    b = base[3].clone()  # a buffer: no grad, may be written
    return [x, y, w], (x, y), (w, h, b)


def _loss(seed: int, outs: tuple, state: tuple) -> torch.Tensor | None:
    """A weighted sum of the outputs and of the state ``h, b`` as the region left it (a
    write to the state is part of what the region computes), or None if none needs grad."""
    g = torch.Generator().manual_seed(20_000 + seed)
    total = None
    for o in tuple(outs) + tuple(state[1:]):
        if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad:
            term = (o * torch.randn(o.shape, generator=g)).sum()
            total = term if total is None else total + term
    return total


def bitwise_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Same shape, dtype and bits (NaN where the other has NaN)."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if a.is_floating_point():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    return False


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> str:
    if a is None or b is None or a.shape != b.shape:
        return f"{None if a is None else tuple(a.shape)} vs {None if b is None else tuple(b.shape)}"
    return f"{(a.double() - b.double()).abs().max().item():.3g}"


@dataclass
class Reference:
    outs: list[torch.Tensor | None]
    grads: list[torch.Tensor | None]
    state: list[torch.Tensor]  # h and b after backward


@dataclass
class Outcome:
    """One run of a program: what it raised, computed, kept and leaked."""

    error: str | None = None
    outs_equal: bool = True
    grads_equal: bool = True
    state_equal: bool = True  # h and b after backward are eager's
    detail: str = ""
    kept: int = 0
    leaked: int = 0
    alive: list[str] = field(default_factory=list)  # weak references still alive
    kept_blocks: list[tuple[int, str]] = field(default_factory=list)  # (bytes, op) made in forward, alive at backward


def _compare(got: Outcome, what: str, values: Any, refs: list) -> None:
    """Record in ``got`` which of ``values`` differ from ``refs`` (a function of its own:
    a loop variable left in the caller's frame would keep a tensor alive)."""
    for k, (v, r) in enumerate(zip(values, refs)):
        v = v.detach() if isinstance(v, torch.Tensor) else v
        if not bitwise_equal(v, r):
            if what == "output":
                name, got.outs_equal = f"output {k}", False
            elif what == "grad":
                name, got.grads_equal = f"grad of {'xyw'[k]}", False
            else:
                name, got.state_equal = f"state {'hb'[k]} after backward", False
            got.detail += f"{name} differs (max abs {_max_diff(v, r)}); "


def _entry(variant: str, program: Program, fn: Callable, args: tuple, box: dict) -> Any:
    """Call ``fn(*args)`` the way ``variant`` says; ``box['graph']``: a weak reference to
    an ac2 region's graph, where there is one."""
    policy = program.save_list if variant.endswith("save_list") else "recompute_all"
    if variant == "eager":
        return fn(*args)
    if variant == "torch":
        return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=program.has_rng)
    if variant == "torch_sac":
        ctx = functools.partial(create_selective_checkpoint_contexts, list(program.save_list))
        return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=program.has_rng, context_fn=ctx)
    if variant == "ac2_checkpoint":
        return ac.checkpoint(fn, *args, use_reentrant=False)
    with ac.apply_ac_policy(policy, rng="replay") as region:
        out = fn(*args)
    if region.graph is not None:
        box["graph"] = weakref.ref(region.graph)
    return out


def run_variant(program: Program, variant: str, ref: Reference | None, backward: bool = True,
                python_recorder: bool = False) -> Outcome:
    """Run ``program`` once as ``variant`` inside an allocator trace with the cyclic
    collector off; compare with ``ref``; then drop everything and check it is freed."""
    make = program.compile()
    base = _inputs(program.seed)
    got = Outcome()
    box: dict[str, Any] = {}
    refs: list[tuple[str, weakref.ref]] = []
    gc.disable()
    recorder = recording_in_python() if python_recorder else contextlib.nullcontext()
    try:
        with recorder, AllocatorTrace() as trace:
            leaves, args, state = _make_args(base)
            fn = make(*state)
            refs += [(f"input {n}", weakref.ref(t)) for n, t in zip("xywhb", args + state)]
            try:
                trace.mark("forward")
                torch.manual_seed(program.seed)
                outs = _entry(variant, program, fn, args, box)
                refs += [(f"output {k}", weakref.ref(o)) for k, o in enumerate(outs) if isinstance(o, torch.Tensor)]
                if ref is not None:
                    _compare(got, "output", outs, ref.outs)
                loss = _loss(program.seed, outs, state)
                trace.mark("backward")
                if backward and loss is not None:
                    torch.manual_seed(program.seed + 1)  # backward must not depend on the global RNG
                    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
                    if ref is not None:
                        _compare(got, "grad", grads, ref.grads)
                        _compare(got, "state", state[1:], ref.state)
                    del grads
                del outs, loss
            except Exception as e:  # noqa: BLE001 - any exception is an outcome
                got.error = f"{type(e).__name__}: {_first_line(e)}"
                # the traceback holds the frames that hold the tensors
                e.__traceback__ = None
                del e
            leaves = args = state = fn = None
            trace.mark("end")
        got.kept = trace.live.get("backward", 0) - trace.live.get("forward", 0)
        got.leaked = trace.live.get("end", 0)
        got.kept_blocks = [(n, op) for n, op, born in trace.blocks.get("backward", []) if born == "forward"]
        if "graph" in box:
            refs.append(("the region's graph", box["graph"]))
        got.alive = [name for name, r in refs if r() is not None]
    finally:
        gc.enable()
    return got


def _first_line(e: BaseException) -> str:
    text = str(e).strip().split("\n")[0]
    return text[:300]


def reference(program: Program) -> tuple[Reference | None, str]:
    """Eager's outputs and gradients, or why the program is not a valid one."""
    make = program.compile()
    results = []
    for _ in range(2):
        leaves, args, state = _make_args(_inputs(program.seed))
        fn = make(*state)
        try:
            torch.manual_seed(program.seed)
            outs = fn(*args)
            outs_c = [o.detach().clone() if isinstance(o, torch.Tensor) else o for o in outs]
            loss = _loss(program.seed, outs, state)
            if loss is None:
                return None, "no output requires grad"
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        except Exception as e:  # noqa: BLE001
            return None, f"eager raises {type(e).__name__}: {_first_line(e)}"
        results.append(Reference(outs_c, list(grads), [t.detach().clone() for t in state[1:]]))
    a, b = results
    if not all(bitwise_equal(p, q) for p, q in zip(a.outs + a.grads + a.state, b.outs + b.grads + b.state)):
        return None, "eager is not deterministic"
    return a, ""


# variant name, python recorder?
AC2_VARIANTS = [
    ("ac2_checkpoint", False), ("ac2_checkpoint", True),
    ("ac2_recompute_all", False), ("ac2_recompute_all", True),
    ("ac2_save_list", False), ("ac2_save_list", True),
]


@dataclass
class Failure:
    seed: int
    variant: str
    kind: str  # crash, wrong_output, wrong_grad, kept, leak, leak_no_backward
    detail: str
    program: Program

    def signature(self) -> tuple[str, str, str]:
        detail = self.detail.split(":")[0] if self.kind == "crash" else ""
        return (self.variant, self.kind, detail)

    def format(self) -> str:
        return (f"seed {self.seed}: {self.variant}: {self.kind}: {self.detail}\n"
                f"  save list: {[str(o) for o in self.program.save_list]}; random ops: {self.program.random_ops}\n"
                f"  replay alone: python -m tests._view_fuzz --seed {self.seed} -v\n"
                + _indent(self.program.source(), "  | "))


def _indent(text: str, prefix: str) -> str:
    return "".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n"))


@dataclass
class Result:
    """What one program gave: its status and the failures of its ac2 variants."""

    status: str  # "invalid", "discarded" (torch's checkpoint raises), "ok", "failed"
    why: str = ""
    failures: list[Failure] = field(default_factory=list)
    torch_wrong: bool = False  # torch's gradients are not eager's (no kept comparison)
    recorders_differ: bool = False  # the C and the Python recorder failed differently
    figures: dict[str, Outcome] = field(default_factory=dict)


class _OpValues(TorchDispatchMode):
    """Records the outputs of the ops a function runs, per call of that function: the
    forward call of a torch checkpoint and its recompute (Note [A reference must recompute
    what forward computed])."""

    def __init__(self, state: tuple = ()) -> None:
        super().__init__()
        self.calls: list[list[tuple[str, list]]] = []
        self.depth = 0
        self.state = state  # the captured state the region may write (w, h, b)
        self.starts: list[dict[int, int]] = []  # per call: state storage -> version at its start
        self.read_at_start: list[set[int]] = []  # per call: state storages read before any write

    def wrap(self, fn: Callable) -> Callable:
        def counted(*args: Any) -> Any:
            self.calls.append([])
            self.starts.append({t.untyped_storage()._cdata: t._version for t in self.state})
            self.read_at_start.append(set())
            self.depth += 1
            try:
                return fn(*args)
            finally:
                self.depth -= 1
        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth:
            start = self.starts[-1]
            skip = args[0] if func in _OVERWRITES and args else None  # written, not read
            for a in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(a, torch.Tensor) and a is not skip:
                    key = a.untyped_storage()._cdata
                    if start.get(key) == a._version:
                        self.read_at_start[-1].add(key)
        out = func(*args, **(kwargs or {}))
        if self.depth:
            flat = [o.detach().clone() for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
            self.calls[-1].append((str(func), flat))
        return out


_OVERWRITES = (torch.ops.aten.copy_.default, torch.ops.aten.fill_.Scalar, torch.ops.aten.fill_.Tensor,
               torch.ops.aten.zero_.default)


def torch_recompute_is_faithful(program: Program) -> bool:
    """Note [A reference must recompute what forward computed]
        Torch's checkpoint re-runs the region's Python in backward. After the region
        wrote the state it read (``h``, ``b``) its recompute computes from the written
        values: another program. Its gradients can still be eager's by coincidence (a
        mask whose positions the write did not move, a value multiplied by zero), and
        then its kept bytes look like a reference while they are not one (it keeps
        nothing because it recomputes the wrong thing). So torch's figures count only
        where every op its recompute ran produced forward's values bitwise (untraced
        run: the recording's copies would count as kept bytes), and where no op of
        forward read state as it was before the region while the region then wrote it:
        the recompute reads the written state, even where the write left the same
        values (``h[m] = h.clone()[m]``). The destination of a write that overwrites
        all of it (``copy_``, ``fill_``, ``zero_``) is not read."""
    make = program.compile()
    leaves, args, state = _make_args(_inputs(program.seed))
    fn = make(*state)
    rec = _OpValues(state)
    try:
        with rec:
            torch.manual_seed(program.seed)
            outs = torch_checkpoint(rec.wrap(fn), *args, use_reentrant=False, preserve_rng_state=program.has_rng)
            loss = _loss(program.seed, outs, state)
            if loss is not None:
                torch.autograd.grad(loss, leaves, allow_unused=True)
    except Exception:  # noqa: BLE001 - no reference then
        return False
    if len(rec.calls) < 2:
        return True  # nothing recomputed
    # A recompute that read state the region wrote since forward read it computes from
    # the written value, whatever values it happened to produce.
    if any(rec.starts[1][key] != rec.starts[0][key] for key in rec.read_at_start[0]):
        return False
    # torch's recompute detaches what it saves: those ops are its own, not the program's
    forward, again = ([c for c in call if c[0] != "aten.detach.default"] for call in rec.calls[:2])
    if len(again) > len(forward):
        return False
    for (op_a, vals_a), (op_b, vals_b) in zip(forward, again):
        if op_a != op_b or len(vals_a) != len(vals_b):
            return False
        if "empty" in op_a:  # uninitialised memory: only its metadata is the op's
            continue
        if not all(bitwise_equal(a, b) for a, b in zip(vals_a, vals_b)):
            return False
    return True


def usable_reference(torch_run: Outcome) -> bool:
    """Torch's kept bytes are a reference only where its run reproduced eager's: its
    recompute re-runs the region's Python, so after a write to the state (``h``, ``b``)
    it computes from the written value, and its figures are those of another program."""
    return torch_run.error is None and torch_run.outs_equal and torch_run.grads_equal and torch_run.state_equal


def extra_blocks(got: Outcome, against: Outcome) -> list[tuple[int, str]]:
    """The blocks alive when backward starts in ``got`` with no block of the same size
    alive in ``against`` (size, allocating op): which tensors ac2 keeps that torch does not."""
    rest = list(against.kept_blocks)
    unmatched = []
    for blk in got.kept_blocks:  # the same size and ops first, then the same size
        if blk in rest:
            rest.remove(blk)
        else:
            unmatched.append(blk)
    sizes = [size for size, _ in rest]
    extra = []
    for size, op in unmatched:
        if size in sizes:
            sizes.remove(size)
        else:
            extra.append((size, op))
    return extra


def check_program(program: Program, variants: list[tuple[str, bool]] | None = None) -> Result:
    """Every comparison of the module docstring for one program."""
    ref, why = reference(program)
    if ref is None:
        return Result("invalid", why)
    base = run_variant(program, "torch", ref)
    if base.error is not None:
        return Result("discarded", f"torch's checkpoint raises {base.error}")
    res = Result("ok", figures={"eager": run_variant(program, "eager", ref), "torch": base})
    faithful = usable_reference(base) and torch_recompute_is_faithful(program)
    if not faithful:  # Note [A reference must recompute what forward computed]
        base.outs_equal = False
        base.detail += "torch's recompute computed other values than its forward; "
    res.torch_wrong = not usable_reference(base)
    sac: Outcome | None = None
    for variant, python in variants or AC2_VARIANTS:
        if variant == "ac2_save_list" and not program.save_list:
            continue
        got = run_variant(program, variant, ref, python_recorder=python)
        name = variant + (" (python recorder)" if python else " (C recorder)" if C_DISPATCH is not None else "")
        res.figures[name] = got
        fail = functools.partial(Failure, program.seed, name, program=program)
        if got.error is not None:
            res.failures.append(fail("crash", got.error))
            continue
        if not got.outs_equal:
            res.failures.append(fail("wrong_output", got.detail))
        elif not got.grads_equal:
            res.failures.append(fail("wrong_grad", got.detail))
        elif not got.state_equal:
            res.failures.append(fail("wrong_state", got.detail))
        if got.leaked or got.alive:
            res.failures.append(fail("leak", f"{got.leaked} B still allocated after the step; alive: {got.alive}"))
        if variant == "ac2_save_list":
            if sac is None:
                sac = run_variant(program, "torch_sac", ref)
                res.figures["torch_sac"] = sac
            against, against_name = sac, "torch's selective checkpoint (same save list)"
        else:
            against, against_name = base, "torch's checkpoint"
        if faithful and usable_reference(against) and got.kept > against.kept:
            res.failures.append(fail("kept", f"kept {got.kept} B after forward, {against_name} {against.kept} B "
                                             f"(+{got.kept - against.kept}; blocks only ac2 keeps: "
                                             f"{extra_blocks(got, against)})"))
    # a forward whose outputs are dropped without backward (validation, an exception)
    for python in (False, True):
        got = run_variant(program, "ac2_recompute_all", ref, backward=False, python_recorder=python)
        name = "ac2_recompute_all, no backward" + (" (python recorder)" if python else "")
        res.figures[name] = got
        if got.error is None and (got.leaked or got.alive):
            res.failures.append(Failure(program.seed, name, "leak_no_backward",
                                        f"{got.leaked} B still allocated after the outputs were dropped; "
                                        f"alive: {got.alive}", program))
    if res.failures:
        res.status = "failed"
    seen: dict[bool, set] = {False: set(), True: set()}
    for f in res.failures:
        seen["python recorder" in f.variant].add((f.variant.split(" (")[0], f.kind))
    res.recorders_differ = seen[False] != seen[True]
    return res


# ---- minimizing and classifying ------------------------------------------------------


def _still_fails(program: Program, failure: Failure) -> bool:
    variant = failure.variant.split(" (")[0].split(",")[0]
    python = "python recorder" in failure.variant
    backward = "no backward" not in failure.variant
    ref, _ = reference(program)
    if ref is None:
        return False
    base = run_variant(program, "torch", ref)
    if base.error is not None:
        return False
    got = run_variant(program, variant, ref, backward=backward, python_recorder=python)
    kind = failure.kind
    if kind == "crash":
        return got.error is not None and got.error.split(":")[0] == failure.detail.split(":")[0]
    if got.error is not None:
        return False
    if kind == "wrong_output":
        return not got.outs_equal
    if kind == "wrong_grad":
        return got.outs_equal and not got.grads_equal
    if kind == "wrong_state":
        return got.outs_equal and got.grads_equal and not got.state_equal
    if kind in ("leak", "leak_no_backward"):
        return bool(got.leaked or got.alive)
    if kind == "kept":
        against = run_variant(program, "torch_sac", ref) if variant == "ac2_save_list" else base
        return usable_reference(against) and got.kept > against.kept
    return False


def minimize(failure: Failure, budget_s: float = 30.0) -> Program:
    """Drop statements (then outputs, then save-list ops) one at a time while the program
    fails the same way."""
    prog = failure.program
    deadline = time.monotonic() + budget_s
    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        for k in reversed(range(len(prog.stmts))):
            if k >= len(prog.stmts) or time.monotonic() > deadline:
                continue
            cand = Program(prog.seed, prog.stmts[:k] + prog.stmts[k + 1:], prog.outputs, prog.save_list)
            if _still_fails(cand, failure):
                prog, changed = cand, True
        for k in reversed(range(len(prog.outputs))):
            if len(prog.outputs) > 1:
                cand = Program(prog.seed, prog.stmts, prog.outputs[:k] + prog.outputs[k + 1:], prog.save_list)
                if _still_fails(cand, failure):
                    prog, changed = cand, True
        for k in reversed(range(len(prog.save_list))):
            if len(prog.save_list) > 1:
                cand = Program(prog.seed, prog.stmts, prog.outputs, prog.save_list[:k] + prog.save_list[k + 1:])
                if _still_fails(cand, failure):
                    prog, changed = cand, True
    return prog


CAUSES = {
    "A": "a held value written through another alias (crash)",
    "B": "a write through a multi-output view (crash)",
    "C": "an in-place op whose other argument is its destination (wrong gradient)",
    "D": "a cycle through a written buffer's leaf (leak)",
    "E": "index_put_ into a region-made buffer is saved (kept > torch)",
    "F": "a view write after an ordinary read keeps the buffer (kept > torch)",
    "G": "a view write whose derivative needs the old value keeps the buffer (kept > torch)",
    "H": "tensors made outside the dispatcher (literals, setitem scalars) kept (kept > torch)",
    "I": "one generator state per saved random op (kept > torch)",
    "J": "(not in the issue) a shape-only read of a region input (empty_like(b), rand_like(b), "
         "b.new_zeros, in-place dropout's empty_like) counts as a value read: ac2 copies the input before "
         "a later write and keeps the copy as long as the reader's node lives (kept > torch)",
}
_SCALAR_SETITEM = re.compile(r"^(\s*\w+\[[^\n]*\]) = ([-0-9.]+(?: \* i)?)$", re.M)


def aten_tensor(values: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """What ``torch.tensor(values, dtype)`` makes, built by ATen ops (``full``, ``stack``)
    that a dispatch mode sees made, instead of outside the dispatcher (cause H)."""
    ref = torch.tensor(values, dtype=dtype, device="meta")
    flat: list = []
    stack = [values]
    while stack:
        v = stack.pop()
        if isinstance(v, (list, tuple)):
            stack.extend(reversed(v))
        else:
            flat.append(v)
    if not flat:
        return torch.empty(ref.shape, dtype=ref.dtype)
    return torch.stack([torch.full((), v, dtype=ref.dtype) for v in flat]).view(ref.shape)


def without_outside_tensors(program: Program) -> Program:
    """``program`` with its literals and setitem scalars made by ATen ops: the H test."""
    stmts = [_SCALAR_SETITEM.sub(r"\1 = torch.full((), \2)", st.replace("torch.tensor(", "aten_tensor("))
             for st in program.stmts]
    return Program(program.seed, stmts, program.outputs, program.save_list)


def _index_put_into_fresh(program: Program) -> bool:
    """A setitem (``buf[idx] = v``, ``buf[mask] = v``, ``buf[tok] += v``) with a tensor
    index into a tensor the program made (not ``h`` or ``b``)."""
    tree = ast.parse(program.source())
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        for t in targets:
            if not isinstance(t, ast.Subscript):
                continue
            base = t.value
            while isinstance(base, ast.Subscript):
                base = base.value
            if isinstance(base, ast.Name) and base.id in ("h", "b"):
                continue
            parts = t.slice.elts if isinstance(t.slice, ast.Tuple) else [t.slice]
            if any(not isinstance(q, (ast.Constant, ast.Slice)) and not (isinstance(q, ast.Name) and q.id == "i")
                   for q in parts):
                return True
    return False


_SHAPE_READS = (  # (pattern, replacement): a read of h or b for its shape only -> none
    (re.compile(r"F\.dropout\(([hb]), ([0-9.]+), training=True, inplace=True\)"),
     r"\1.mul_(F.dropout(torch.ones(tuple(\1.shape)), \2, training=True))"),
    (re.compile(r"torch\.(rand|randn|empty|zeros|ones)_like\(([hb])\)"), r"torch.\1(tuple(\2.shape))"),
    (re.compile(r"\b[hb]\.new_(zeros|ones|empty)\("), r"torch.\1("),
)


def without_shape_reads(program: Program) -> Program:
    """``program`` with nothing reading the state ``h``, ``b`` for its shape only (the J
    test): ``torch.rand_like(b)`` -> ``torch.rand(tuple(b.shape))``, ``b.new_zeros(s)`` ->
    ``torch.zeros(s)``, in-place dropout of ``b`` (whose ``empty_like(b)`` reads it) ->
    ``b.mul_(F.dropout(torch.ones(tuple(b.shape)), p, training=True))``: the same draws,
    the same values."""
    stmts = []
    for st in program.stmts:
        for pattern, repl in _SHAPE_READS:
            st = pattern.sub(repl, st)
        stmts.append(st)
    return Program(program.seed, stmts, program.outputs, program.save_list)


_OLD_VALUE_WRITES = re.compile(r"\.(mul_\((?![-0-9.]+\))|clamp_\(|sin_\(|div_\()")


def classify(failure: Failure, minimal: Program) -> str:
    """The issue-44 cause of a minimized failure. By test first: if making the program's
    literals and setitem scalars with ATen ops ends the failure, H. Then by how it fails
    and what is left of the program (the report's minimal programs were checked by
    hand): a crash naming a list argument is B, another crash A; a wrong gradient through
    ``d.masked_scatter_(m, d)`` C; a leak D; kept bytes: one generator state more with a
    random op in the save list I, a setitem with a tensor index into a made buffer E, a
    write whose derivative needs the old value G, any other write F; but first J if
    reading no state tensor for its shape only ends the failure."""
    kind, detail = failure.kind, failure.detail
    if kind == "crash" and ("found type 'list'" in detail or "Expected a value of type 'Tensor'" in detail):
        return "B"
    plain = without_outside_tensors(minimal)
    if plain.source() != minimal.source() and not _still_fails(plain, failure):
        return "H"
    src = plain.source()
    if kind == "crash":
        return "A"
    if kind in ("wrong_output", "wrong_grad"):
        return "C" if re.search(r"(\w+)\.masked_scatter_\([^\n]*, \1\)", src) else "?"
    if kind in ("leak", "leak_no_backward"):
        return "D"
    if kind == "kept":
        m = re.search(r"\(\+(\d+)", detail)
        excess = int(m.group(1)) if m else 0
        state = torch.get_rng_state().nbytes
        if any(op in RANDOM_OPS for op in minimal.save_list) and minimal.random_ops >= 2 and excess % state == 0:
            return "I"
        unshaped = without_shape_reads(plain)
        if unshaped.source() != plain.source() and not _still_fails(unshaped, failure):
            return "J"
        if _index_put_into_fresh(plain):
            return "E"
        if _OLD_VALUE_WRITES.search(src):
            return "G"
        return "F"
    return "?"


# ---- the loop ------------------------------------------------------------------------


@dataclass
class Summary:
    seeds: int = 0
    invalid: int = 0
    discarded: int = 0
    run: int = 0
    failed: int = 0
    torch_wrong: int = 0
    recorders_differ: list[int] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)
    causes: dict[str, int] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    minimal: dict[str, tuple[Failure, Program]] = field(default_factory=dict)
    seconds: float = 0.0

    def format(self, show: int = 3) -> str:
        lines = [f"view-write fuzzer: {self.seeds} seeds in {self.seconds:.1f} s: {self.invalid} invalid "
                 f"eagerly, {self.discarded} discarded (torch's checkpoint raises), {self.run} run "
                 f"({self.torch_wrong} where torch's checkpoint does not reproduce eager's outputs, gradients and "
                 f"state: no kept comparison), "
                 f"{self.failed} failing; the C and the Python recorder failed differently in "
                 f"{len(self.recorders_differ)} {self.recorders_differ[:10]}"]
        if self.kinds:
            lines.append("  failures by kind (a program counts once per kind): "
                         + ", ".join(f"{k} {v}" for k, v in sorted(self.kinds.items())))
        if self.causes:
            lines.append("  failing programs by cause (first failure of each, minimized): "
                         + ", ".join(f"{k} {v}" for k, v in sorted(self.causes.items())))
        for f in self.failures[:show]:
            lines.append(f.format())
        if len(self.failures) > show:
            lines.append(f"  ... and {len(self.failures) - show} more failing programs")
        return "\n".join(lines)


@contextlib.contextmanager
def quiet_profiler() -> Iterator[None]:
    """File descriptor 2 to /dev/null: the profiler's C++ side prints two lines to it per
    session (``profiler_start`` / ``profiler_stop``), a dozen sessions per program. Python
    errors raised inside print after it is restored."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def fuzz(seeds: Iterator[int], *, programs: int | None = None, seconds: float | None = None,
         do_classify: bool = False, verbose: bool = False, log: Callable[[str], None] = print) -> Summary:
    """Check programs from ``seeds`` until ``programs`` were run (not invalid, not
    discarded) or ``seconds`` passed."""
    summary = Summary()
    t0 = time.monotonic()
    for seed in seeds:
        if programs is not None and summary.run >= programs:
            break
        if seconds is not None and time.monotonic() - t0 > seconds:
            break
        summary.seeds += 1
        program = generate(seed)
        with quiet_profiler():
            res = check_program(program)
        if verbose:
            log(f"seed {seed}: {res.status} {res.why}")
            log(_indent(program.source(), "  | ").rstrip())
            log(f"  save list: {[str(o) for o in program.save_list]}")
            for name, o in res.figures.items():
                log(f"  {name}: kept {o.kept} B, leaked {o.leaked} B, alive {o.alive}, error {o.error}, "
                    f"outputs equal {o.outs_equal}, grads equal {o.grads_equal} {o.detail}")
            for f in res.failures:
                log("  FAIL " + f.format().split("\n")[0])
        if res.status == "invalid":
            summary.invalid += 1
            continue
        if res.status == "discarded":
            summary.discarded += 1
            continue
        summary.run += 1
        summary.torch_wrong += res.torch_wrong
        if res.recorders_differ:
            summary.recorders_differ.append(seed)
        if res.failures:
            summary.failed += 1
            summary.failures.append(res.failures[0])
            for kind in {f.kind for f in res.failures}:
                summary.kinds[kind] = summary.kinds.get(kind, 0) + 1
            if do_classify:
                first = res.failures[0]
                with quiet_profiler():
                    minimal = minimize(first)
                    cause = classify(first, minimal)
                summary.causes[cause] = summary.causes.get(cause, 0) + 1
                best = summary.minimal.get(cause)
                if best is None or len(minimal.source()) < len(best[1].source()):
                    summary.minimal[cause] = (first, minimal)
                log(f"seed {seed}: {first.variant}: {first.kind}: cause {cause}: {first.detail[:160]}")
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
    p.add_argument("--classify", action="store_true", help="minimize and name each failure's cause")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    seconds = a.seconds if a.minutes is None else a.minutes * 60
    if a.seed is not None:
        seeds: Iterator[int] = iter([a.seed])
    else:
        seeds = iter(range(a.start, sys.maxsize))
        if seconds is None and a.programs is None:
            a.programs = 150
    summary = fuzz(seeds, programs=a.programs, seconds=seconds, do_classify=a.classify, verbose=a.verbose,
                   log=lambda s: print(s, flush=True))
    print(summary.format(show=0 if a.classify else 5))
    if a.minimize and not a.classify:
        for f in summary.failures:
            with quiet_profiler():
                minimal = minimize(f)
                cause = classify(f, minimal)
            print(f"\nminimal program for seed {f.seed} ({f.variant}: {f.kind}), cause {cause}:")
            print(_indent(minimal.source(), "  | ") + f"  save list: {[str(o) for o in minimal.save_list]}")
    if a.classify:
        for cause, (f, minimal) in sorted(summary.minimal.items()):
            print(f"\ncause {cause} ({CAUSES.get(cause, 'unclassified')}): seed {f.seed}, {f.variant}: "
                  f"{f.kind}: {f.detail[:200]}")
            print(_indent(minimal.source(), "  | ") + f"  save list: {[str(o) for o in minimal.save_list]}")
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
