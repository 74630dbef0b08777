"""The simulation: one rank of a W-rank FSDP2 step on fake tensors under torch's fake
process group (``_world.py``), one mode's step (``_run.py``; a pipeline stage's,
``_pipeline.py``), counted by torch's own
memory tracker (``_meter.py``), reported (``_report.py``) and run from the shell
(``_cli.py``); a model of torch's CUDA caching allocator (``_allocator.py``: what a
sequence of allocations reserves), which the test suite's simulated CUDA timeline
drives. The public face is ``ac2_dist/simulate.py``.

It stands above everything else: it applies checkpointing as a user would and reads
the planner; nothing else imports it.
"""
