"""In-place writes inside a region: what the tracer records for a write through any alias,
and what it holds so that every replay reads what forward read.

The tracer (``_tracer.py``) asks this module three questions: before an op writes, which
held values share the written storage (:meth:`HeldStorages.before_write`); for a tensor
the tensor map does not know as it is now, what it is (:func:`stale_view`,
:func:`literal`); and, for a write that is replayed, which of the op's other arguments
alias the written storage (:func:`write_aliases`). ``Graph.ref`` and the tracer's
write path call these; the replay side of the rule is in ``_replayer.py``
(``Replayer._execute``).

Note [Writes inside a region]
    One rule for every in-place write the tracer sees (an op whose schema writes an
    argument: ``copy_``, ``mul_``, ``index_put_`` from ``buf[idx] = v``, ``masked_scatter_``,
    ``out=`` overloads ...), whatever alias it writes through (the tensor, a view, a view
    of a view, an output of ``split``/``unbind``/``chunk``):

    1. **A value the region computed is replayed.** The write is recorded as a
       recomputable op when the written tensor is, directly or through recorded view ops
       (Note [Writes through views of fresh tensors] in _graph.py), the current output of
       a recomputable op of the region that nothing saved and no autograd handle holds.
       Reads of that value (or of its views) before the write are fine: the replay
       writes into the value its producer's replay made, after copying it if anything
       else still needs the bytes from before the write -- a pending use of the value,
       or any other live tensor on the same storage (a cached or prefetched view of it):
       Note [A replayed write owns its storage] in _replayer.py. An argument of the
       write that *is* the written tensor (``h.masked_scatter_(mask, h)``: the same
       tensor, or a view with the same storage, offset, sizes and strides) is not a
       separate input: the replay passes it the written tensor, so it reads what it read
       in forward, the destination as it is being written; another view of the written
       storage (``v.add_(t.view(...))`` where the two overlap in part) is re-made from
       the written base by ``as_strided``, so the op reads memory it writes exactly as
       in forward (:func:`write_aliases`; a write whose aliasing cannot be re-made
       exactly is a side effect).
       Index arguments (``Tensor?[]`` of ``index_put_``) are ordinary inputs.
    2. **Anything else is a side effect**: a write to a region input, a parameter, a
       saved value (a policy save, a side effect's output), an output of an op that
       aliases its input without saying so, or a write whose value autograd holds. The
       op runs once and its outputs are saved. Before it runs, every value ac2 holds by
       reference on the written *storage* -- whichever alias is written: the tensor, its
       view, its base, a sibling view -- and that a recorded recomputable op read, is
       copied (``Saved.snapshot``): the replay of that reader needs the bytes it read
       (:class:`HeldStorages`).
    3. **After a write, aliases of the written storage are stale** (views share their
       base's version counter). A later read of a stale *view* whose base is a current
       value of the region is recorded as ``as_strided`` of that base
       (:func:`stale_view`): replayed from the base's value after the write, not kept.
       Any other stale tensor becomes a saved boundary value, held as a detached alias
       when the region made it (holding the tensor itself would make a cycle through its
       ``grad_fn``: Note [Saved values are version-checked references] in _graph.py).

    Tensors Python makes outside the dispatcher and hands to an op -- a literal
    ``torch.tensor([...])``, the 0-d tensor a scalar becomes in ``buf[i] = 0.5`` --
    reach the tracer through ``aten.lift_fresh``; a small one on the CPU is remembered
    by value, as the program's own code remembers the literal (:func:`literal`). Such a
    literal is a value the region made: a write into it (or through its view) is
    replayed like a write into a computed value (each read of a literal is a new
    tensor).

Note [Writes that overwrite]
    ``b.copy_(src)``, ``b.fill_(v)``, ``b.zero_()`` write every element of ``b`` and read
    none of them: the value they leave depends on their other arguments alone. When the
    written tensor is not a view (a view's base keeps bytes the write did not touch),
    no other argument shares its storage and the op is not saved, the write is recorded
    as a recomputable op whose destination is an argument read for its shape (Note
    [Arguments read for their shape]): the replay writes into a new tensor with the
    written one's sizes and strides, whatever the written tensor is -- a region input,
    a parameter, a buffer, a saved value or a value the region computed. The tensor
    itself is then never held for its value after the write: a later write to it in the
    region (``b.copy_(h); b.clamp_(...)``) is a write into a value the region computed
    (rule 1 of Note [Writes inside a region]), replayed, not copied first; and a write
    to it after the region does not concern the graph. The write still runs once in
    forward, on the tensor itself; held values on its storage that a replay reads are
    copied before it as for any write (rule 2).

Note [Arguments read for their shape]
    ``empty_like(b)``, ``zeros_like``, ``rand_like``, ``b.new_zeros(...)`` ... read only
    their tensor argument's sizes, strides, dtype and device. The tracer records that
    metadata instead of an input (``Node.like``), and the replay passes a new
    uninitialised tensor with it: the op depends on no value, so nothing is kept,
    recomputed or copied for it (a region input read only for its shape and written
    later needs no copy before the write).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from ._nodes import Saved

if TYPE_CHECKING:
    from ._nodes import Node

_Tensor = torch.Tensor
_AS_STRIDED = torch.ops.aten.as_strided.default
_LIFT_FRESH = (torch.ops.aten.lift_fresh.default,)
def storage_key(t: torch.Tensor) -> int | None:
    """An identity of ``t``'s storage (its StorageImpl's address, stable while any tensor
    on it lives), or None for tensors without one (wrapper subclasses, sparse)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


def _on_storage(s: Any) -> torch.Tensor | None:
    """The tensor on the original's storage that a saved value holds: the value itself
    when held by reference; an offloaded value's device tensor until its copy to the
    host is done (Note [Offloaded values that are written] in offload.py); None for
    copies and packed values."""
    if type(s) is not Saved or s.hooks is not None or s.device is not None:
        return None
    if s.offloaded:
        return s.value.device
    return s.value


class HeldStorages:
    """The values a graph holds by reference, found by storage when something writes.

    Note [Held values are found by storage]
        A write through any alias changes the bytes of every tensor on the written
        storage. A value ac2 holds for a replay (a region input, a parameter, a policy
        save, a side effect's output, a boundary value) may be any of those tensors; the
        written tensor need not be the one the graph holds. So the tracer lists each
        held value when it is made (a weak reference to its node: a value nobody needs
        any more is still freed in forward), and the first write after that files it
        under its storage (``storage_key``); a write then copies the held values on the
        written storage that a recorded recomputable op read (their replays need the old
        bytes). Regions that write nothing pay one list append per held value.
        The list lives for forward only (``Graph.close_map`` drops it).
    """

    __slots__ = ("pending", "_by_storage")

    def __init__(self) -> None:
        # Weak references to nodes that hold values, listed since the last write (one
        # per node, not per output: one object per saved node for the collector); the
        # tracer's save path appends to it directly (one call less per saved node).
        self.pending: list[weakref.ref] = []
        self._by_storage: dict[int, list[tuple[weakref.ref, int]]] = {}

    def add(self, node: Node) -> None:
        self.pending.append(weakref.ref(node))

    def _file(self) -> None:
        by_storage = self._by_storage
        for ref in self.pending:
            node = ref()
            if node is None or node.saved is None:
                continue
            for idx, s in enumerate(node.saved):
                t = _on_storage(s)
                if t is not None:
                    key = storage_key(t)
                    if key is not None:
                        by_storage.setdefault(key, []).append((ref, idx))
        self.pending = []

    def before_write(self, written: Any) -> None:
        """Copy the held values on the storages of ``written`` (tensors about to be
        written) that a replay reads."""
        # See Note [Held values are found by storage] (above).
        if self.pending:
            self._file()
        if not self._by_storage:
            return
        for t in written:
            key = storage_key(t)
            entries = self._by_storage.get(key) if key is not None else None
            if not entries:
                continue
            keep = []
            for entry in entries:
                node = entry[0]()
                if node is None or node.saved is None:
                    continue
                s = node.saved[entry[1]]
                held = _on_storage(s)
                if held is None or storage_key(held) != key:
                    continue  # copied already (or replaced): no longer on this storage
                if node.readers:
                    s.snapshot()
                else:
                    keep.append(entry)
            self._by_storage[key] = keep


def _dense(t: torch.Tensor) -> bool:
    """``t`` covers its elements' memory without gaps or overlaps (a clone keeps its
    strides: ``torch.preserve_format``)."""
    expected = 1
    for stride, size in sorted(zip(t.stride(), t.size())):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _plain_strided(t: torch.Tensor) -> bool:
    return (
        t.layout is torch.strided and type(t) in (_Tensor, torch.nn.Parameter)
        and not t.is_conj() and not t.is_neg() and not t.is_quantized
    )


def stale_view(graph: Any, t: torch.Tensor, fqn: str) -> tuple[Node, int] | None:
    """``t`` is a view whose map entry is stale (its storage was written since): record
    it as ``as_strided`` of its base's current value and return that node output, or
    None when that is not exact."""
    # See Note [Writes inside a region], 3.
    base = t._base
    if base is None or not _plain_strided(t) or not _plain_strided(base) or t.dtype != base.dtype:
        return None
    e = graph.map.get(base)
    if e is None or (e.version is not None and e.version != base._version):
        return None
    # The replayed base must have the forward base's layout in its storage: a fresh
    # output or a copy of one (Note [A replayed write owns its storage] in _replayer.py).
    if base.storage_offset() != 0 or not _dense(base) or storage_key(t) != storage_key(base):
        return None
    m, j = e.node, e.idx
    m.readers += 1
    m.viewed = True
    m.viewers += 1
    node = graph.new_node(
        _AS_STRIDED, 1, fqn, (0, m, j), (None, tuple(t.size()), tuple(t.stride()), t.storage_offset()),
    )
    graph.map.set(t, node, 0, t._version)
    return node, 0


class Literal:
    """A saved value remembered by its bytes: a small CPU tensor Python made outside the
    dispatcher. Each read makes a new tensor with the same dtype, shape and bytes.
    Duck-types :class:`~ac2_dist._trace._nodes.Saved`."""

    # See Note [Writes inside a region].

    __slots__ = ("data", "dtype", "shape")
    value = hooks = device = version = counter = meta = None
    detached = allow_mutation = offloaded = False
    reason, nbytes, owner = "boundary", 0, "literal tensor made by Python in the region"

    def __init__(self, t: torch.Tensor) -> None:
        self.data = bytes(t.untyped_storage())[t.storage_offset() * t.element_size():][: t.nbytes]
        self.dtype = t.dtype
        self.shape = tuple(t.shape)

    def snapshot(self) -> None:
        return None  # already a copy

    def get(self) -> torch.Tensor:
        if not self.data:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(bytearray(self.data), dtype=self.dtype).reshape(self.shape)


def is_literal(node: Node, idx: int) -> bool:
    """``node[idx]`` is a literal remembered by value: a value the region made, which a
    write may replay into (each read of it is a new tensor)."""
    return node.op is None and node.saved is not None and type(node.saved[idx]) is Literal


def literal(func: Any, args: tuple) -> torch.Tensor | None:
    """The tensor ``func`` lifts if it is a literal Python made (``aten.lift_fresh`` of a
    tensor the map does not know), to remember by value (any size: torch's recompute
    makes it again from what the program's code keeps, and so does a replay from its
    bytes, outside the device allocator), else None."""
    if func not in _LIFT_FRESH or not args:
        return None
    t = args[0]
    if (
        not isinstance(t, _Tensor) or t.device.type != "cpu" or not _plain_strided(t) or t.requires_grad
        or t._base is not None or not t.is_contiguous()
    ):
        return None
    return t


def write_aliases(written: dict[int, torch.Tensor], base: torch.Tensor | None, args: tuple, kwargs: dict,
                  positions: tuple) -> tuple[tuple, tuple] | None:
    """How a replayed write's other arguments that share the written storage are made in
    the replay: ``(same, rebuilt)`` -- positions that
    are the written tensor itself (the same tensor, or a view with its storage, offset,
    sizes, strides and dtype: passed the written tensor) and ``(position, sizes, strides,
    offset)`` of other views of the written storage (re-made by ``as_strided`` of the
    written base, so the op reads memory it writes exactly as in forward); None if one
    cannot be re-made exactly (then the write is a side effect). ``base``: the tensor
    whose storage the replay holds (the written tensor, or the base a view is written
    through)."""
    # See Note [Writes inside a region], 1.
    same: tuple = ()
    rebuilt: tuple = ()
    keys = {storage_key(w) for w in written.values()}
    keys.discard(None)
    items = [(i, a) for i, a in enumerate(args)] + list(kwargs.items())
    for pos, a in items:
        if pos in positions:
            continue
        if type(a) in (list, tuple):  # index lists: none may alias the written storage
            if any(isinstance(e, _Tensor) and storage_key(e) in keys for e in a):
                return None
            continue
        if not isinstance(a, _Tensor) or storage_key(a) not in keys:
            continue
        if any(a is w or (
            a.dtype == w.dtype and a.size() == w.size() and a.stride() == w.stride()
            and a.storage_offset() == w.storage_offset()
        ) for w in written.values()):
            same += (pos,)
            continue
        if (len(written) != 1 or base is None or not _plain_strided(a) or not _plain_strided(base)
                or a.dtype != base.dtype or base.storage_offset() != 0 or not _dense(base)):
            return None
        rebuilt += ((pos, tuple(a.size()), tuple(a.stride()), a.storage_offset()),)
    return same, rebuilt


def overwritten(info: Any, written: dict[int, torch.Tensor], args: tuple, kwargs: dict) -> bool:
    """The op writes all of one tensor that is not a view, from arguments that do not
    share its storage."""
    # See Note [Writes that overwrite].
    if not info.overwrites or len(written) != 1:
        return False
    (w,) = written.values()
    if w._base is not None or not _plain_strided(w) or w is not args[0]:
        return False
    key = storage_key(w)
    if key is None:
        return False
    for a in list(args[1:]) + list(kwargs.values()):
        if isinstance(a, _Tensor) and storage_key(a) == key:
            return False
    return True
