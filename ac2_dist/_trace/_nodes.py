"""What a region's graph is made of: one recorded op call (:class:`Node`), a value kept
from forward (:class:`Saved`), what autograd holds instead of a saved tensor
(:class:`Handle`), the forward tensor -> node-output map (:class:`TensorMap`) and the
chain of a generator's random ops (:class:`RngChain`). :class:`~ac2_dist._trace._graph.Graph`
connects them (records, arms, replays). A Note named here without a file is in this
module or in ``_graph.py``'s docstring.
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .._compat import MUST_CPU_OFFLOAD, PREFER_CPU_OFFLOAD
from .._policy import SAVE_WITH_HOOKS, Decision

_CP = torch.utils.checkpoint.CheckpointPolicy
# Compared by identity: ``d in CPU_OFFLOAD`` hashes the enum (a Python call) per saved value.
_MUST_OFFLOAD, _PREFER_OFFLOAD = MUST_CPU_OFFLOAD, PREFER_CPU_OFFLOAD
_AD_INPLACE_OR_VIEW = torch._C.DispatchKey.ADInplaceOrView

#: The ``kwargs`` of a node whose op got none (read-only, shared).
NO_KWARGS: Mapping[str, Any] = types.MappingProxyType({})

#: Why a value is held after forward (keys of ``RankReport.saved_bytes_by_reason``).
REASONS = ("policy", "side_effect", "rng", "boundary", "tagged", "offloaded")


def alias(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()`` sharing ``t``'s version counter even inside the tracer.

    Below the ADInplaceOrView key (in a dispatch mode) a plain ``detach()`` gets a
    fresh version counter, which would blind the version check of saved values.
    """
    with torch._C._SetExcludeDispatchKeyGuard(_AD_INPLACE_OR_VIEW, False):
        return t.detach()


def tensor_nbytes(t: torch.Tensor) -> int:
    try:
        return t.numel() * t.element_size()
    except Exception:  # exotic subclasses without a size
        return 0



def version_of(t: torch.Tensor) -> int | None:
    """``t._version``, or ``None`` for an inference tensor (it has no version counter
    and cannot be modified outside ``torch.inference_mode``: nothing to check)."""
    return None if t.is_inference() else t._version


class Saved:
    """A value kept from forward: a version-checked reference, offloaded, or packed."""

    __slots__ = (
        "value", "version", "counter", "hooks", "meta", "device", "allow_mutation", "reason", "nbytes",
        "owner", "detached", "offloaded",
    )

    def __init__(
        self,
        t: torch.Tensor,
        decision: Decision,
        *,
        reason: str,
        allow_mutation: bool,
        keep_identity: bool,
        owner: str,
        version: int | None = None,
        counter: torch.Tensor | None = None,
        offload: Any = None,
        user_hooks: SAVE_WITH_HOOKS | None = None,
        history: bool = True,
    ) -> None:
        if user_hooks is not None and type(decision) is not SAVE_WITH_HOOKS and decision is not _MUST_OFFLOAD \
                and decision is not _PREFER_OFFLOAD:
            decision = user_hooks  # Note [The user's saved-tensor hooks] in _region.py
        self.reason = reason
        self.allow_mutation = allow_mutation
        self.owner = owner
        self.nbytes = tensor_nbytes(t)
        self.hooks: SAVE_WITH_HOOKS | None = None
        self.meta: tuple | None = None
        self.device: torch.device | None = None
        self.version: int | None = None
        # The tensor whose version counter guards the value (Note [Versions of view
        # outputs] in _tracer.py: a view's own counter is replaced after the tracer).
        self.counter: torch.Tensor | None = counter
        # ``value`` is an offload.OffloadedTensor: the block's offload schedule holds it
        # (Note [The offload schedule] in offload.py; ``offload`` is the region's block).
        self.offloaded = False
        # The stored value has no autograd history although the original had one: it
        # cannot serve a create_graph=True backward. One that never had any (``history``
        # False: made with grad mode off, or from inputs none of which requires grad)
        # serves it as eager's constant does.
        self.detached = (not keep_identity or isinstance(decision, SAVE_WITH_HOOKS)) and history and (
            t.is_floating_point() or t.is_complex()
        )
        if isinstance(decision, SAVE_WITH_HOOKS):
            self.hooks = decision
            self.meta = (t.shape, t.dtype, t.device)
            self.value = decision.pack(t if keep_identity else alias(t))
            self.reason = "offloaded"
            return
        if decision is _MUST_OFFLOAD or decision is _PREFER_OFFLOAD:
            self.reason = "offloaded"
            # A copy comes back: a region input offloaded as itself loses its history too.
            self.detached = history and (t.is_floating_point() or t.is_complex())
            if offload is not None and offload.takes(t):
                self.offloaded = True
                version = version_of(counter if counter is not None else t) if version is None else version
                self.value = offload.save(alias(t), version=version, counter=counter, allow_mutation=allow_mutation,
                                          owner=owner)
                self.counter = None
                return
            if t.device.type != "cpu":  # no schedule: a synchronous copy
                self.device = t.device
                self.value = alias(t).to("cpu", non_blocking=True)
                return
        self.value = t if keep_identity else alias(t)
        self.version = version_of(counter if counter is not None else t) if version is None else version

    def snapshot(self) -> None:
        """Keep a private copy: the referenced tensor is about to be written in place
        while replays still need its current value."""
        # See Note [Versions of written tensors] in _tracer.py.
        if self.offloaded:  # Note [Offloaded values that are written] (offload.py)
            self.value.before_write()
            return
        if self.hooks is None and self.device is None:
            with torch.no_grad():
                self.value = alias(self.value).clone()
            self.version = None
            self.counter = None

    def with_history(self, v: torch.Tensor) -> None:
        """Hold ``v`` -- this value recomputed with its autograd history -- from now on
        (Note [A saved value keeps its recipe] in _history.py)."""
        self.value = v
        self.hooks = self.meta = self.device = self.counter = None
        self.offloaded = False
        self.detached = False
        self.version = v._version

    def get(self) -> torch.Tensor:
        if self.offloaded:
            return self.value.fetch()
        if self.hooks is not None:
            return self._unpacked()
        if self.device is not None:
            return self.value.to(self.device, non_blocking=True)
        if self.version is not None:
            now = (self.counter if self.counter is not None else self.value)._version
            if now != self.version:
                raise RuntimeError(modified_error(self.owner, self.version, now))
        return self.value

    def _unpacked(self) -> torch.Tensor:
        unpack = self.hooks.unpack
        t = unpack(self.value)
        shape, dtype, device = self.meta
        if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype or t.device != device:
            got = (
                f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}" if isinstance(t, torch.Tensor)
                else f"a {type(t).__name__}"
            )
            name = getattr(unpack, "__qualname__", None) or repr(unpack)
            raise RuntimeError(
                f"ac2_dist: the SAVE_WITH_HOOKS unpack hook {name} returned {got} for the saved "
                f"{self.owner}, which was packed with shape {tuple(shape)}, dtype {dtype}, device "
                f"{device}. unpack must restore a tensor like the one pack received."
            )
        return t


def modified_error(owner: str, then: int, now: int) -> str:
    """The error for a held value modified where the tracer did not see the write.

    Note [A held value modified out of sight]
        ac2 copies what a replay still needs before every in-place write it records
        (Note [Writes inside a region] in _writes.py), so a version change found at
        backward is a write it did not see: after the region's forward (an optimizer
        step, a user's ``add_`` between forward and backward), under inference mode, or
        by code that ran with dispatch disabled. The bytes forward read are gone, and
        gradients computed from the modified value would not be the forward's (eager
        autograd raises in the same place when it saved the tensor itself). So it is an
        error whatever ``allow_cache_entry_mutation`` says: that flag, which torch's
        selective checkpoint uses to skip its check of in-region writes to cached
        values, is accepted and not needed (in-region writes are exact here).
    """
    return (
        f"ac2_dist: a tensor held for recompute ({owner}) was modified in place after the region "
        f"recorded it (version {then} -> {now}), by a write ac2_dist did not record (after the region's "
        "forward, under inference mode, or with dispatch disabled). The values forward read are gone, "
        "and gradients computed from the modified tensor would not be the forward's, so backward stops "
        "here (allow_cache_entry_mutation=True does not change this: writes inside a region are always "
        "replayed exactly). Modify the tensor after backward, or modify a clone of it instead."
    )


class _Freed:
    """What a saved slot holds once its value was dropped after its last use (Note
    [Saved values die at their last use]): counted as saved, so nothing tries to
    recompute through it, and an error if anything still asks for it."""

    __slots__ = ()
    value = hooks = device = version = counter = meta = None
    detached = allow_mutation = offloaded = False
    reason, nbytes, owner = "policy", 0, "freed saved value"

    def snapshot(self) -> None:
        return None

    def get(self) -> torch.Tensor:
        raise RuntimeError(
            "ac2_dist: a value saved for recompute was read after its last use in this backward "
            "had freed it (a saved tensor unpacked again after the tensors read the first time "
            "were released?). Backward with retain_graph=True keeps saved values for another use."
        )


FREED = _Freed()


class Node:
    """One recorded op call. Leaves (``op is None``) are region inputs. Made by
    :meth:`Graph.new_node` only (it sets every slot).

    Note [Rare node fields live in a lazy dict]
        The tracer makes one node per op, so the node is kept small: the fields every
        node sets are slots; the ones few nodes set (written positions, RNG chains,
        undeclared aliases, cut marks, ...) are class attributes holding the default,
        and an assignment creates the instance ``__dict__`` only for the node that
        needs it (reads fall back to the class default). ``kwargs`` defaults to a
        shared read-only empty mapping: a node is never given a dict it does not use.
    """

    __slots__ = (
        "op",
        "seq",
        "args",
        "kwargs",
        "inputs",
        "saved",
        "values",
        "nout",
        "scheduled",
        "fqn",
        "readers",
        "held",
        "viewed",
        "viewers",
        "__dict__",
        "__weakref__",
    )
    op: Any
    seq: int
    args: tuple
    kwargs: Mapping[str, Any]
    inputs: tuple
    saved: list[Saved | None] | None
    values: list[Any] | None
    nout: int
    scheduled: bool
    fqn: str
    readers: int
    held: int
    viewed: bool
    viewers: int

    # ---- rare fields: class defaults (Note [Rare node fields live in a lazy dict]) ----
    lists = False  # args/kwargs hold lists with tensor slots
    # (index of its chain in Graph.rng_chains, position in the chain): ints, not the
    # chain itself, which holds its nodes (no reference cycle: Note [One generator
    # state per region]).
    rng: tuple[int, int] | None = None
    must_recompute = False  # the policy said MUST_RECOMPUTE: never made a boundary
    fsdp_unit: weakref.ref | None = None  # leaf = unsharded param of this FSDP unit
    # Note [Aliases a schema does not declare] (_tracer.py): the (node, idx) whose
    # storage its output shares, and whether another node's output shares its storage.
    alias_of: tuple[Node, int] | None = None
    aliased = False
    # Input positions this (recomputable) op writes in place (Note [Replaying writes
    # to fresh tensors]); () for ops that write nothing.
    writes: tuple = ()
    cut = False  # output of a nested checkpointed module (Note [Nested modules cut the replay])
    # A write through a view of a fresh value (Note [Writes through views of fresh
    # tensors]): the view ops that rebuild the written view from the base, as
    # (op, args, kwargs, source position); its last output is the written base.
    via: tuple | None = None
    # Accumulator arguments a replay fills with scratch zeros, as (position, shape,
    # dtype, device) (Note [Statistics an op accumulates] in side_effects.py).
    scratch: tuple = ()
    # Arguments read for their metadata only, as (position, sizes, strides, dtype,
    # device): the replay passes a new empty tensor (Note [Arguments read for their
    # shape] in _writes.py).
    like: tuple = ()
    # Positions of a replayable write's arguments that are the written tensor itself: the
    # replay passes them the written tensor (Note [Writes inside a region] in _writes.py).
    same: tuple = ()
    # Other views of the written storage among a replayable write's arguments, as
    # (position, sizes, strides, storage offset): re-made from the written base.
    rebuilt: tuple = ()
    # A saved node with a recipe: the recomputable node standing for it in other recipes;
    # that shadow: a weak reference to the saved node (Note [A recipe holds no saved
    # value] in _history.py).
    shadow: Node | None = None
    original: weakref.ref | None = None
    # A saved op recorded with grad mode off (its recipe runs so: Note [A saved value
    # keeps its recipe] in _history.py).
    no_grad = False

    def __repr__(self) -> str:
        return f"Node({self.op or 'input'}, seq={self.seq})"

    def has_value(self, idx: int) -> bool:
        if self.saved is not None and self.saved[idx] is not None:
            return True
        return self.values is not None and self.values[idx] is not None

    def set_saved(self, idx: int, saved: Saved) -> None:
        if self.saved is None:
            self.saved = [None] * self.nout
        self.saved[idx] = saved

    @property
    def name(self) -> str:
        return "region input" if self.op is None else f"output of {self.op}"


def input_refs(node: Node) -> Iterator[tuple[Any, Node, int]]:
    """``(position, producer, output index)`` of each tensor argument of ``node``.

    Note [Node inputs are one flat tuple]
        A recorded op's tensor arguments are kept as one flat tuple of triples
        ``(pos, producer, idx, ...)`` rather than a list of 3-tuples: one object per
        node instead of one plus one per input. Every node lives until backward, and
        objects the garbage collector tracks are what makes recording slow down with
        region length (full collections scan them all); the C recorder's nodes and
        tuples are not tracked at all (Note [Plain records are not tracked by the
        collector] in _crecord.c).
    """
    it = iter(node.inputs)
    return zip(it, it, it)


def producers(node: Node) -> Iterator[tuple[Node, int]]:
    """``(producer, output index)`` of each tensor argument of ``node``."""
    # See Note [Node inputs are one flat tuple] (input_refs).
    inp = node.inputs
    return zip(inp[1::3], inp[2::3])


class RngChain:
    """The random ops of a region on one generator, replayed in forward order."""

    # See Note [One generator state per region] in _graph.py.

    __slots__ = ("generator", "index", "start", "state", "cursor", "nodes")

    def __init__(self, generator: torch.Generator, index: int) -> None:
        self.generator = generator
        self.index = index  # in Graph.rng_chains
        self.start = generator.get_state()  # before the chain's first op, in forward
        self.state = self.start  # before nodes[cursor], during backward
        self.cursor = 0
        self.nodes: list[Node] = []

    def rewind(self) -> None:
        self.state, self.cursor = self.start, 0


def flatten_outputs(out: Any) -> list[Any]:
    """Flatten an op's return value (tensor, or tuple/list nesting one list level)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        flat: list[Any] = []
        for o in out:
            if isinstance(o, (tuple, list)):
                flat.extend(o)
            else:
                flat.append(o)
        return flat
    return [out]


class MapEntry(weakref.ref):
    """What the tensor map holds for one tensor: a weak reference to it that also
    carries the node output it currently is and the version recorded then.

    Note [Map entries are the weak references]
        One object per mapped tensor instead of a weak reference plus a tuple: fewer
        objects for the garbage collector to track per recorded op. An entry is never
        changed after it is made (remapping a tensor makes a new entry), so one a
        caller holds stays what it was. Indexing (``e[1]`` node, ``e[2]`` index,
        ``e[3]`` version, ``e[0]`` the reference) reads like the tuple it replaced.
    """

    __slots__ = ("key", "node", "idx", "version", "handle")

    key: int
    node: Node
    idx: int
    version: int | None
    # The handle autograd got for this tensor while it was this node output, if any
    # (Note [One handle per saved value]); the only field set after the entry is made.
    handle: Handle | None

    def __getitem__(self, i: int) -> Any:
        return (self, self.node, self.idx, self.version)[i]


class TensorMap:
    """tensor -> :class:`MapEntry` (node, output index, version), keyed by object identity.

    A plain dict keyed by ``id(t)``; each entry is a weak reference whose callback
    removes the entry when the tensor dies (so the map never keeps a node, and hence
    no saved value, alive). Lookups compare the referent with ``is``, so a recycled
    ``id`` never matches. About 10x cheaper per lookup than ``WeakTensorKeyDictionary``
    on the tracer's hot path.
    """

    __slots__ = ("_d", "_cb", "__weakref__")

    def __init__(self) -> None:
        self._d: dict[int, MapEntry] = {}
        # The callback must not reference the map strongly: entries hold weakrefs
        # whose callback is this function, and a strong path back would make a cycle
        # that keeps every entry (and its node's saved values) alive until gc runs.
        this = weakref.ref(self)

        def _dead(ref: MapEntry) -> None:
            owner = this()
            if owner is not None:
                e = owner._d.get(ref.key)
                if e is ref:
                    del owner._d[ref.key]

        self._cb = _dead

    def recent(self, n: int) -> list[MapEntry]:
        """The ``n`` most recent entries (weak references to the mapped tensors), newest
        first: a copy, so that a tensor dying while they are read changes nothing."""
        return list(itertools.islice(reversed(self._d.values()), n))

    def get(self, t: torch.Tensor) -> MapEntry | None:
        e = self._d.get(id(t))
        if e is not None and e() is t:
            return e
        return None

    def set(self, t: torch.Tensor, node: Node, idx: int, version: int | None) -> None:
        # Graph.new_node makes the same entry inline for a plain op's output (Note [The
        # plain-op path] in _tracer.py), and so does the C recorder (_crecord.c): a change
        # to the entry's fields changes all three.
        key = id(t)
        e = MapEntry(t, self._cb)
        e.key = key
        e.node = node
        e.idx = idx
        e.version = version
        e.handle = None
        self._d[key] = e


class Handle:
    """What autograd keeps instead of a saved tensor: a pointer to a node output.
    Made by :meth:`Graph.pack` only (it sets every slot).

    A handle has no reference to its graph: autograd keeps the graph's bound
    ``unpack`` beside every handle (the region's saved-tensor hooks), which is how an
    unpack finds it. Its pack order is its position in the graph's list (Note [Handles
    are weakly listed]).

    Note [One handle per saved value]
        Autograd often saves one tensor several times: an activation is saved by the op
        that made it (``tanh``'s result) and by the op that reads it (``mul``'s self);
        a weight by every op that multiplies with it. Every save of a tensor that is
        still the same node output gets the same handle, as long as no backward has
        read it yet: ``count`` says how many saved variables share it and each save
        arms one pending use, as separate handles did. A backward's unpacks take one
        use each until ``taken`` reaches ``count``; a read past that is a second read
        of one saved variable (Note [Epochs: retain_graph=True]). A new backward over
        a retained graph gives back the ``taken`` uses. One handle (and one weak
        reference to it) per saved value instead of per save: less Python heap and
        fewer objects for the garbage collector per recorded op.
    """

    __slots__ = ("node", "idx", "count", "consumed_task", "taken", "prefetched", "ready", "last", "__weakref__")

    node: Node
    idx: int
    count: int  # saved variables sharing it (Note [One handle per saved value])
    # The autograd GraphTask (one backward call) that consumed this handle's pending
    # uses, if any, and how many it took (Note [Epochs: retain_graph=True]).
    consumed_task: int | None
    taken: int
    prefetched: Any  # value realized ahead of its unpack (Note [Prefetching the next unit's replay] in replay.py)
    ready: Any  # the event that value is ready on (side-stream executor)
    last: weakref.ref | None  # what consumed_task's unpack returned (a second read)

