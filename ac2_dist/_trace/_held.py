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
        stack: list[Node] = [h.node for h in list(graph.handles)]
        while stack:
            node = stack.pop()
            if id(node) in visited:
                continue
            visited.add(id(node))
            stack.extend(node.inputs[1::3])  # Note [Node inputs are one flat tuple] (_nodes.py)
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


def _storage_key(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # DTensor (FSDP2's sharded params)
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(t)
