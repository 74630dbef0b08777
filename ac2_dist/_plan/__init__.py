"""The planner: what a region saves under a :class:`~ac2_dist.MemoryBudget`.

One region's calibration and plan (``_budget_region.py``) over the problem it records
and its solver (``_block_problem.py``, the cost model's FLOPs: ``_flops.py``); a whole
step's peak target planned over every block together (``_peak.py``, with the model in
``_peak_model.py`` and the measured step in ``_peak_step.py``); a target's plan as a
file (``_plan_file.py``). The public face is ``ac2_dist/budget.py``.

It reads the recorder's nodes and the measuring wing's allocator traces; neither of
those names anything here.
"""
