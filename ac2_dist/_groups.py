"""Module groups: one region over several modules' forwards (``apply_ac(..., groups=)``).

Note [A group region spans its members' forwards]
    Some values sit between modules that are never called as one: a causal LM's final
    norm runs at the end of its decoder (``model.norm``) and the LM head in the outer
    model (``lm_head``). Checkpointed apart, each region keeps its input (the norm's
    region the last layer's output, the head's the norm's output), and left outside any
    region eager autograd keeps the last layer's output, the norm's normalized value and
    its output -- three hidden-state-sized tensors, a large share of what a long-context
    step keeps. One region over both keeps only the norm's input and replays the norm
    (memory-bound) in backward.

    A group opens its region in the forward pre-hook of whichever member runs first and
    closes it in the forward post-hook of the call that completes the group (every
    member has run), as FSDP2 does for a list of modules given to ``fully_shard``. The
    ops between the members (the outer model slicing the hidden states) are recorded in
    it. A group whose members do not all run (the decoder called alone, without its LM
    head) closes when the outermost of the members' ancestors that was running when the
    group opened returns; with none running (a member called directly) it closes when
    that member returns. Post-hooks are ``always_call`` ones: a forward that raises
    closes the region too, as a ``with`` block would. State is per thread.

    Hooks: the pre-hooks run after FSDP2's pre-forward (FSDP registers its own with
    ``prepend=True``), so a member's all-gather runs before the region opens; the post-
    hooks are prepended, so the region closes before FSDP2's post-forward reshards. A
    member that is an FSDP unit is then one the region saw called (Note [FSDP units are
    region boundaries] in fsdp.py). Under ``torch.compile`` a group does not open (a
    warning says so): its members run as plain modules inside the compiled graph.
"""

from __future__ import annotations

import copy
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from ._device import device_of
from ._policy import PolicySource
from ._region import apply_ac_policy
from ._units import after_region, needs_region
from .compile import announce_eager_only, is_compiling
from .replay import ReplayConfig

__all__: list[str] = []

_ATTR = "_ac2_group"  # a member's _Group


class _Open:
    """A group's region while it is open on one thread."""

    __slots__ = ("region", "left", "closer", "depth", "args", "kwargs", "device")

    def __init__(self, region: apply_ac_policy, left: set[int], closer: int, depth: int,
                 args: tuple, kwargs: dict, device: torch.device) -> None:
        self.region = region
        self.left = left  # ids of the members that have not run yet
        self.closer = closer  # id of the ancestor whose return closes it (-id: the opening member's)
        self.depth = depth  # that ancestor's depth of calls when the group opened
        self.args, self.kwargs, self.device = args, kwargs, device


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.open: _Open | None = None
        self.running: dict[int, int] = {}  # id(ancestor) -> calls in progress


class _Group:
    """One region over ``fqns`` of ``root`` (Note [A group region spans its members' forwards])."""

    def __init__(self, root: nn.Module, fqns: Sequence[str], source: PolicySource, config: ReplayConfig) -> None:
        self.root = weakref.ref(root)
        self.fqns = tuple(fqns)
        self.name = group_name(self.fqns)
        self.source = source
        self.config = config
        self.state = _PerThread()

    # ---- the modules, looked up from the root (a deepcopy re-points the root) --------------
    def _module(self, fqn: str) -> nn.Module:
        root = self.root()
        if root is None:
            raise RuntimeError(f"ac2_dist: the model of the module group {self.name!r} was freed")
        return root.get_submodule(fqn)

    def members(self) -> list[nn.Module]:
        return [self._module(f) for f in self.fqns]

    def ancestors(self) -> list[nn.Module]:
        """The members' proper ancestors, outermost first (the root included)."""
        names: list[str] = []
        for f in self.fqns:
            parts = f.split(".")
            for k in range(len(parts)):
                name = ".".join(parts[:k])
                if name not in names and name not in self.fqns:
                    names.append(name)
        names.sort(key=lambda n: (n.count(".") + (n != ""), n))
        return [self._module(n) for n in names]

    # ---- hooks ---------------------------------------------------------------------------
    def install(self) -> None:
        for m in self.members():
            m.register_forward_pre_hook(_Hook(self, "pre"), with_kwargs=True)
            m.register_forward_hook(_Hook(self, "post"), prepend=True, always_call=True)
            m.__dict__[_ATTR] = self
        for a in self.ancestors():
            a.register_forward_pre_hook(_Hook(self, "enter"))
            a.register_forward_hook(_Hook(self, "leave"), always_call=True)

    def remove(self) -> None:
        root = self.root()
        if root is None:
            return
        for m in root.modules():
            for hooks in (m._forward_pre_hooks, m._forward_hooks):
                for key in [k for k, h in hooks.items() if isinstance(h, _Hook) and h.group is self]:
                    del hooks[key]
                    m._forward_hooks_always_called.pop(key, None)
                    m._forward_pre_hooks_with_kwargs.pop(key, None)
            if m.__dict__.get(_ATTR) is self:
                del m.__dict__[_ATTR]

    def on_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        st = self.state
        if st.open is not None:
            return
        if not needs_region(module, args, kwargs):  # Note [No grad, no region] (_region.py)
            return
        closer, depth = -id(module), 0  # no ancestor running: closes when this member returns
        for a in self.ancestors():
            n = st.running.get(id(a), 0)
            if n:
                closer, depth = id(a), n
                break
        device = device_of(args, kwargs, module=module)  # Note [The device comes from the tensors]
        region = apply_ac_policy._from_frame(self.source.new_frame(), self.config, device=device, inputs=args)
        region.__enter__()
        st.open = _Open(region, {id(m) for m in self.members()}, closer, depth, args, kwargs, device)

    def on_post(self, module: nn.Module, output: Any) -> None:
        op = self.state.open
        if op is None:
            return
        op.left.discard(id(module))
        if not op.left or op.closer == -id(module):
            self._close(output)

    def on_enter(self, module: nn.Module) -> None:
        running = self.state.running
        running[id(module)] = running.get(id(module), 0) + 1

    def on_leave(self, module: nn.Module, output: Any) -> None:
        st = self.state
        running = st.running
        n = running.get(id(module), 0)
        if n <= 1:
            running.pop(id(module), None)
        else:
            running[id(module)] = n - 1
        op = st.open
        if op is not None and op.closer == id(module) and n == op.depth:
            self._close(output)  # Note [A group region spans its members' forwards]: not every member ran

    def _close(self, output: Any) -> None:
        st = self.state
        op = st.open
        st.open = None
        assert op is not None
        exc_type, exc, tb = sys.exc_info()  # an always_call hook runs inside the forward's except clause
        op.region.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            return
        after_region(op.region, self.config, self.name, op.args, op.kwargs, output, op.device.type == "cuda", self)

    # ---- copies --------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict) -> _Group:
        root = self.root()
        new = _Group.__new__(_Group)
        memo[id(self)] = new
        new.root = weakref.ref(memo.get(id(root), root))
        new.fqns, new.name, new.config = self.fqns, self.name, self.config
        new.source = copy.deepcopy(self.source, memo)
        new.state = _PerThread()
        return new

    def __reduce__(self) -> tuple:
        return (_Group, (self.root(), self.fqns, self.source, self.config))


class _Hook:
    """A group's forward hook on a member (``pre``/``post``) or an ancestor (``enter``/``leave``)."""

    __slots__ = ("group", "role")

    def __init__(self, group: _Group, role: str) -> None:
        self.group, self.role = group, role

    def __call__(self, module: nn.Module, *rest: Any) -> None:
        role, group = self.role, self.group
        if is_compiling():  # traced by dynamo: nothing to record (constant-folded away)
            if role == "pre":
                announce_eager_only(f"the module group {group.name!r} (apply_ac groups=)")
            return
        if role == "pre":
            group.on_pre(module, rest[0], rest[1])
        elif role == "post":
            group.on_post(module, rest[1])
        elif role == "enter":
            group.on_enter(module)
        else:
            group.on_leave(module, rest[1])

    def __reduce__(self) -> tuple:
        return (_Hook, (self.group, self.role))


def group_name(fqns: Sequence[str]) -> str:
    """A group's name: what its policies see as ``ctx.module_fqn`` and the planner's
    block name."""
    return "+".join(fqns)


def check_groups(model: nn.Module, groups: Any, taken: set[str]) -> None:
    """Raise for ``groups`` that are not lists of distinct submodule fqns of ``model``, or
    that overlap each other or ``taken`` (the modules checkpointed on their own)."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, (list, tuple)):
        raise TypeError(f"ac2_dist.apply_ac: groups must be a list of lists of module names, e.g. "
                        f"[['model.norm', 'lm_head']], got {groups!r}")
    names = dict(model.named_modules())
    seen: set[str] = set()
    for g in groups:
        if isinstance(g, (str, bytes)) or not isinstance(g, (list, tuple)) or not g \
                or not all(isinstance(f, str) for f in g) or len(set(g)) != len(g):
            raise TypeError(f"ac2_dist.apply_ac: each group is a non-empty list of distinct module names "
                            f"(fqns), got {g!r}")
        for f in g:
            if f == "":
                raise ValueError(f"ac2_dist.apply_ac: group {list(g)}: the model itself cannot be a group member; "
                                 f"checkpoint it with modules=None")
            if f not in names:
                raise ValueError(f"ac2_dist.apply_ac: group {list(g)}: {type(model).__name__} has no submodule "
                                 f"{f!r}")
            clash = [t for t in sorted(taken | seen) if t == f or f.startswith(t + ".") or t.startswith(f + ".")]
            if clash:
                raise ValueError(f"ac2_dist.apply_ac: group {list(g)}: {f!r} is, contains or is inside {clash[0]!r}, "
                                 f"which is already checkpointed; a module belongs to one region")
            if group_of(names[f]) is not None:
                raise ValueError(f"ac2_dist.apply_ac: {f!r} is already in a module group; unwrap it first")
        seen.update(g)


def group_of(module: nn.Module) -> _Group | None:
    return module.__dict__.get(_ATTR)
