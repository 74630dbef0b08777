"""The recorder and the replayer: the tracer records every ATen op of a region as a node
of its graph (``_tracer.py``, the plain-op path in C: ``_crecord.c``; the general path:
``_tracer_general.py``; in-place writes: ``_writes.py``); the graph holds the nodes and
counts the uses backward will make of each output (``_nodes.py``, ``_graph.py``,
``_graph_stats.py``); in backward it arms the saved values and replays, from the nearest
saved ones, only the node outputs autograd asks for (``_graph_backward.py``,
``_replayer.py``). ``_held.py`` reads what the graphs hold after forward.

This wing depends only on the policy (``ac2_dist._policy``) and the shared leaves below
it (side effects, FSDP, compile, the torch compatibility layer); the planner, the
measuring code and the simulation read it, never the other way round.
"""
