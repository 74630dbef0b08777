"""Wrapper tensor subclasses made and unwrapped outside dispatch: the graph's conversion
nodes between a subclass and its inner tensors.

Note [Wrapper subclasses made and unwrapped outside dispatch]
    Some tensors enter a region's program without an op the tracer sees. Tensor
    parallelism makes them on every linear layer: ``DTensor.from_local(x)`` (torch's
    ``ColwiseParallel`` input hook) wraps a plain tensor into a DTensor by a Python
    constructor, and ``DTensor.to_local()`` (its ``RowwiseParallel`` output hook, and
    ``use_local_output``) hands out the DTensor's inner ``_local_tensor``. The tracer
    sees the ops on either side but not the conversion, so the tensor the next op reads
    is unknown to the graph: a region input, which must be saved -- an activation kept
    for backward where torch's checkpoint would recompute it (an HF Llama block under
    tensor parallelism kept about eleven hidden states' worth, not its input).

    So, for a tensor the graph does not know (``Graph.ref``), two recipes are tried
    before it becomes a saved region input:

    1. a traceable wrapper subclass (``__tensor_flatten__``) whose inner tensors the
       graph knows, at their current versions: a *rewrap* node whose inputs are those
       inner tensors' producers; its replay rebuilds the subclass with
       ``__tensor_unflatten__`` from the replayed inner tensors and the recorded
       metadata (the flatten context, outer size and stride), detached;
    2. a plain tensor that is an inner tensor of a subclass the region produced (an op
       output, or a rewrap): an *unwrap* node whose input is what the graph maps that
       subclass to now; its replay reads the attribute. The inner tensors of every
       subclass output are registered when the op is recorded (``note_inner``), weakly:
       an entry dies with its tensor and holds neither the subclass nor a node.

    Both share the storage of what they read (a wrapper and its inner tensor are one
    allocation), so they are recorded as views: the producer is marked viewed, the
    planner prices them at no bytes and no FLOPs, and a plan file names them
    ``ac2.rewrap.<Class>`` / ``ac2.unwrap.<attr>``. Inner tensors that are not plain
    tensors, a subclass whose inner tensor was written since it was made, an inner tensor
    whose subclass was written since through a view (a subclass's in-place op bumps the
    subclass's version counter, not the inner tensor's: the subclass's entry in the
    graph's map is then stale), and a subclass that is an autograd leaf fall back to the
    saved region input (correct, as before). The last covers parameters and what FSDP2
    makes without autograd in its first step's unshard inside the region (an unsharded
    DTensor parameter wraps a view of the all-gather output, which FSDP frees after
    forward: rebuilt from that view, a replay would read freed storage; kept as the leaf
    it was, FSDP's unshard restores its storage before the replay). ``from_local`` on a
    tensor with a history returns a non-leaf. A replayed conversion adds nothing to
    ``recomputed_bytes`` (its output is its input's storage); ``cached_bytes`` still counts a
    wrapper and its inner tensor apart while both wait for consumers (the report only).

    An in-place op on a wrapper made by a constructor from a tensor the region knows (a
    ``from_local`` DTensor of a region value or input) writes that tensor's memory below
    the region: the subclass's op unwraps and writes the inner tensor, whose version
    counter does not move, so every reader of it, before or after the write, would be
    replayed from the wrong value. It is refused where it happens (``refuse_hidden_write``)
    with the ways out; a wrapper an op made (an op output the graph maps) is written as
    any op output.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ._nodes import Node, version_of

__all__: list[str] = []


class Conversion:
    """A conversion node's op (Note [Wrapper subclasses made and unwrapped outside
    dispatch]): called with its input tensors like an ATen op; compared by name."""

    __slots__ = ("name",)
    ac2_conversion = True

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Conversion) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


class Rewrap(Conversion):
    """Rebuild a wrapper subclass from its inner tensors."""

    __slots__ = ("cls", "attrs", "consts", "ctx", "size", "stride")

    def __init__(self, t: torch.Tensor, attrs: list[str], consts: dict[str, Any], ctx: Any) -> None:
        super().__init__(f"ac2.rewrap.{type(t).__name__}")
        self.cls = type(t)
        self.attrs = attrs  # the inner tensors' attributes, in input order
        self.consts = consts  # inner entries that are not tensors (a DTensor's mesh)
        self.ctx = ctx
        self.size, self.stride = t.size(), t.stride()

    def __call__(self, *inner: torch.Tensor) -> torch.Tensor:
        parts = dict(self.consts)
        parts.update(zip(self.attrs, inner))
        out = self.cls.__tensor_unflatten__(parts, self.ctx, self.size, self.stride)  # type: ignore[attr-defined]
        return out.detach() if out.requires_grad else out


class Unwrap(Conversion):
    """Read one inner tensor of a wrapper subclass."""

    __slots__ = ("attr",)

    def __init__(self, attr: str) -> None:
        super().__init__(f"ac2.unwrap.{attr}")
        self.attr = attr

    def __call__(self, outer: torch.Tensor) -> torch.Tensor:
        return getattr(outer, self.attr)


def _flatten(t: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any], Any] | None:
    """(its inner tensors by attribute, its other inner entries, the flatten context) of a
    wrapper subclass, or None where it has no inner tensor or cannot say."""
    try:
        attrs, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
        parts = {a: getattr(t, a) for a in attrs}
    except Exception:  # a subclass that cannot say: treated as unknown (saved)
        return None
    tensors = {a: v for a, v in parts.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        return None
    return tensors, {a: v for a, v in parts.items() if a not in tensors}, ctx


class _Entry(weakref.ref):
    __slots__ = ("key", "attr", "outer")


class InnerIndex:
    """Inner tensor -> (its subclass, the attribute it is), weakly both ways: an entry
    dies with its inner tensor and keeps neither the subclass nor any node alive."""

    __slots__ = ("_d", "_cb", "__weakref__")

    def __init__(self) -> None:
        self._d: dict[int, _Entry] = {}
        this = weakref.ref(self)

        def _dead(ref: _Entry) -> None:  # no strong path back to the index (as TensorMap)
            owner = this()
            if owner is not None and owner._d.get(ref.key) is ref:
                del owner._d[ref.key]

        self._cb = _dead

    def add(self, inner: torch.Tensor, attr: str, outer: torch.Tensor) -> None:
        e = _Entry(inner, self._cb)
        e.key, e.attr, e.outer = id(inner), attr, weakref.ref(outer)
        self._d[id(inner)] = e

    def get(self, t: torch.Tensor) -> tuple[torch.Tensor, str] | None:
        """(the live subclass ``t`` is an inner tensor of, the attribute), or None."""
        e = self._d.get(id(t))
        outer = e.outer() if e is not None and e() is t else None
        return (outer, e.attr) if outer is not None else None  # type: ignore[union-attr]


def refuse_hidden_write(graph: Any, written: Any, func: Any, module_fqn: str) -> None:
    """Raise if ``func`` writes in place to a wrapper subclass made outside dispatch from
    a tensor ``graph`` knows (Note [Wrapper subclasses made and unwrapped outside
    dispatch], last paragraph)."""
    for w in written:
        # A parameter (a DTensor one, FSDP2's unsharded ones) is what its module holds, not
        # made from a region tensor; from_local of a tensor without grad is a leaf too.
        if not is_traceable_wrapper_subclass(w) or isinstance(w, torch.nn.Parameter):
            continue
        e = graph.map.get(w)
        if e is not None and not getattr(e.node.op, "ac2_conversion", False):
            continue  # an op's output: the write is recorded on it
        made = _flatten(w)
        if made is None or not any(graph.map.get(t) is not None for t in made[0].values()):
            continue
        where = f" in {module_fqn}" if module_fqn else ""
        raise RuntimeError(
            f"ac2_dist: {func}{where} writes in place to a {type(w).__name__} that was made from a "
            "tensor of this checkpointed region by a Python constructor (e.g. DTensor.from_local), "
            "not by an op: the write changes that tensor's memory where the region cannot see it, "
            "so recomputing what reads it would give wrong gradients. Write to the tensor before "
            "wrapping it, or use the out-of-place op (d = d * 3 instead of d.mul_(3))."
        )


def note_inner(graph: Any, flat: Any) -> None:
    """Register the inner tensors of the wrapper subclasses among an op's outputs
    ``flat`` (Note [Wrapper subclasses made and unwrapped outside dispatch], 2)."""
    for o in flat:
        if isinstance(o, torch.Tensor) and is_traceable_wrapper_subclass(o):
            made = _flatten(o)
            if made is not None:
                index = graph.inners
                if index is None:
                    index = graph.inners = InnerIndex()
                for attr, inner in made[0].items():
                    index.add(inner, attr, o)


def conversion_ref(graph: Any, t: torch.Tensor) -> tuple[Node, int] | None:
    """A conversion node making ``t``, unknown to ``graph``, from what the graph knows,
    or None (Note [Wrapper subclasses made and unwrapped outside dispatch])."""
    if is_traceable_wrapper_subclass(t):
        if t.is_leaf:  # a parameter, or a wrapper made without autograd (FSDP2's unsharded parameters)
            return None
        made = _flatten(t)
        if made is None:
            return None
        tensors, consts, ctx = made
        inputs: tuple = ()
        producers = []
        for k, inner in enumerate(tensors.values()):
            e = graph.map.get(inner)
            if e is None or (e.version is not None and e.version != inner._version):
                return None
            producers.append(e.node)
            inputs += (k, e.node, e.idx)
        op: Conversion = Rewrap(t, list(tensors), consts, ctx)
    else:
        index = graph.inners
        found = index.get(t) if index is not None else None
        if found is None:
            return None
        outer, attr = found
        # What the subclass is in the graph now, unwritten since: a subclass's in-place op
        # through a view bumps its own version counter, not its inner tensor's.
        e = graph.map.get(outer)
        if e is None or (e.version is not None and e.version != outer._version):
            return None
        producers = [e.node]
        inputs = (0, e.node, e.idx)
        op = Unwrap(attr)
    for m in producers:  # a recorded view of each input (they share its storage)
        m.readers += 1
        m.viewed = True
        m.viewers += 1
    fqn = graph.frames[-1].module_fqn if graph.frames else ""
    node = graph.new_node(op, 1, fqn, inputs, (None,) * (len(inputs) // 3))
    graph.map.set(t, node, 0, version_of(t))
    note_inner(graph, (t,))
    if graph.observer is not None:  # a calibrating memory budget records it as a view
        graph.observer(node, op, (), {}, t)
    return node, 0
