"""Measuring and reports: the allocator's own events (``_alloc.py``; on CUDA the caching
allocator's history, ``_alloc_history.py``; kept quiet by ``_quiet.py``), one rank's
figures (``_rank_report.py``), a run's file (``_run_file.py``) and its table
(``_report_table.py``). The public face is ``ac2_dist/memory.py``.

It reads the recorder's reasons for holding a value and nothing else of the package;
the planner reads its traces.
"""
