"""The counters of one region's graph (:class:`GraphStats`): what the graph's forward
side (``_graph.py``) and its replays (``_replayer.py``) add to, and what reports read
(``ac2_dist.memory``, ``Graph.stats``). Public as ``ac2_dist.GraphStats``."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GraphStats"]


@dataclass
class GraphStats:
    """Counters of one region's graph; readable after the region exits.

    ``recomputed_bytes`` counts what replays allocated (view outputs allocate nothing).
    ``cached_bytes`` is the size of recomputed values alive right now (waiting for a
    pending consumer); ``peak_cached_bytes`` its maximum.
    """

    nodes: int = 0
    saved_nodes: int = 0
    recomputed_ops: int = 0
    recomputed_bytes: int = 0
    cached_bytes: int = 0
    peak_cached_bytes: int = 0
    replay_seconds: float = 0.0
    backward_epochs: int = 0
    collectives: int = 0  # collective / FSDP / registered ops recorded (never replayed)
    recomputed_by_module: dict[str, int] = field(default_factory=dict)  # only while tracked
