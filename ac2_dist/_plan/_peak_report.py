"""What ``MemoryBudget(peak=...).format_plan()`` shows of its planner (_peak.py)."""

from __future__ import annotations

from typing import Any

from .._sizes import human_bytes as _human
from .._sizes import human_or_dash as _opt_human

__all__: list[str] = []


def describe(planner: Any) -> str:
    """Target, floor, predicted and measured peak, and the history of measured steps, of
    the :class:`~ac2_dist._plan._peak.PeakPlanner` ``planner``."""
    with planner.lock:
        state = {"floor": "measuring the floor" if not planner.history else "at the floor",
                 "planned": "verifying its plan", "settled": f"settled: {planner.reason}",
                 "pipelined": planner.reason}[planner.state]
        seconds, flops = planner.recompute()
        lines = [
            f"peak target {_human(planner.target)} ({planner.target} bytes) on this rank; {state}",
            f"  floor (measured) {_opt_human(planner.floor_peak)}; predicted {_opt_human(planner.predicted)}; "
            f"measured {_opt_human(planner.measured)}; plan {planner._describe_choice()}, estimated recompute "
            f"{seconds * 1e3:.3f} ms ({flops / 1e6:.1f} MFLOP) per step",
        ]
        if planner.late:  # Note [Collective buffers gloo frees late] in _late_buffers.py
            lines.insert(1, f"  planned for {_human(planner.planned_target)}: gloo may hold {_human(planner.late)} "
                            f"of collective buffers past their wait (its worker threads free them late)")
        if planner.history:
            lines.append(f"  {'step':>5}  {'plan':<36} {'predicted':>12} {'measured':>12}  note")
            for r in planner.history:
                lines.append(f"  {r.step + 1:>5}  {r.what:<36} {_opt_human(r.predicted):>12} "
                             f"{_opt_human(r.measured):>12}  {r.note}")
        return "\n".join(lines)
