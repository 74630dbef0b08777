"""What ac2 holds for backward after forward, read from the regions' graphs: bytes of
unique storages on the device by reason and module, and offloaded values resident in
host memory apart (``memory.track``'s ``saved_bytes`` figures). Moved verbatim from
memory.py."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from ._graph import Graph
from ._nodes import REASONS, Node

__all__: list[str] = []


def _host_resident(s: Any, t: torch.Tensor) -> bool:
    """Whether saved value ``s``, held as ``t``, is kept in host memory for a value
    computed elsewhere (an offloaded value's host copy), not in the device's memory."""
    if s.offloaded:  # the offload schedule: the device tensor until committed, then the host copy
        return s.value.device is None
    if s.device is not None:  # a synchronous copy to the CPU (no schedule)
        return True
    home = s.meta[2] if s.hooks is not None and s.meta is not None else None  # SAVE_WITH_HOOKS
    return home is not None and home.type != "cpu" and t.device.type == "cpu"


def _held_bytes(graphs: Iterable[Graph], params: set[int]) -> tuple[dict[str, int], dict[str, int], int,
                                                                     dict[str, int]]:
    """Bytes of unique storages ac2 holds for backward in the device's memory, by reason
    and by module, and in host memory (offloaded values), in all and by module."""
    seen: set[int] = set()
    by_reason = dict.fromkeys(REASONS, 0)
    by_module: dict[str, int] = {}
    host = 0
    host_by_module: dict[str, int] = {}
    visited: set[int] = set()
    for graph in graphs:
        for node in _held_nodes(graph, visited):
            for s in node.saved or ():
                # An offloaded value occupies its device tensor or its host copy (offload.py).
                t = s.value.held() if s is not None and s.offloaded else getattr(s, "value", None)
                if not isinstance(t, torch.Tensor):
                    continue
                if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or node.fsdp_unit is not None:
                    continue  # parameters (and views of them) are not activations
                try:
                    storage = t.untyped_storage()
                    key, nbytes = storage.data_ptr(), storage.nbytes()
                except (RuntimeError, NotImplementedError):  # subclasses without storage
                    key, nbytes = id(t), s.nbytes
                if key in params or key in seen or nbytes == 0:
                    continue
                seen.add(key)
                if _host_resident(s, t):
                    host += nbytes
                    host_by_module[node.fqn] = host_by_module.get(node.fqn, 0) + nbytes
                    continue
                by_reason[s.reason] += nbytes
                by_module[node.fqn] = by_module.get(node.fqn, 0) + nbytes
    return by_reason, by_module, host, host_by_module


def _held_nodes(graph: Graph, visited: set[int]) -> list[Node]:
    """The nodes ``graph`` keeps alive from its live handles, not in ``visited`` (which
    grows): first those the first-order backward reaches, then those only saved nodes'
    recipes reach (Note [A recipe holds no saved value] in _history.py: leaves that
    require grad), so that a storage both hold is counted under the first one's reason
    whatever the recipes are."""
    order: list[Node] = []
    later: list[Node] = []
    stack: list[Node] = [h.node for h in list(graph.handles)]
    for phase in (0, 1):
        while stack:
            node = stack.pop()
            if id(node) in visited:
                continue
            visited.add(id(node))
            order.append(node)
            saved = node.saved
            # Note [Node inputs are one flat tuple] (_nodes.py)
            if phase or saved is None or node.rng is not None or any(x is None for x in saved):
                stack.extend(node.inputs[1::3])
            else:  # a saved node's recipe
                later.extend(node.inputs[1::3])
        stack = later
    return order


def _storage_key(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # DTensor (FSDP2's sharded params)
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(t)
