"""The simulated steps that verify and correct a peak target's plan (``SimulationReport.plan``),
for one microbatch a step (:class:`OneStep`) or a pipeline rank's schedule
(:class:`~._stage_plan.StageModel`).

Note [A plan file climbs as the job would]
    The peak model errs high (Note [The peak model] in _plan/_peak_model.py): a plan
    solved from the floor step's segment bases measures under its prediction, by 3 % to
    16 % on the tiny models of launch/bench_simulate.py, and a job verifies it and
    corrects it (Note [Verify, correct, stay put] in _plan/_peak_verify.py). A plan file
    followed in the job's first step would leave that headroom unused there, and the
    model's figure in the report would be the first plan's. So ``plan(check=True)``
    runs the job's verification on the simulated rank, step for step as _peak.py does
    it: each simulated step's segment peaks correct the plan (over the target, the
    bases rise to what the step implies, never below what an earlier step over the
    target implied -- the guard -- and the plan is solved again; under by more than
    ``1 - _USE``, the next plan is priced from the step's peaks up with the job's
    ``_solve_from`` and its margin), until a step saves everything, the plan stops
    changing, a step using ``_USE`` of the target corrects to no cheaper plan, or
    ``_TRIES`` plans ran (then the cheapest within the
    target, or the floor). The file holds that plan, the model's bases and the guard:
    the job starts where the simulated steps ended, measures its own steps and goes on
    correcting from there, and a plan the simulation saw overshoot is not chosen again.
    ``plan(check=False)`` (and ``save_plan(path, target)``) writes the plan solved from
    the floor step, unverified. A pipeline rank climbs alike under its schedule, with the
    model of Note [A stage's microbatches in flight] in _plan/_stage_model.py
    (:class:`~._stage_plan.StageModel`); :class:`OneStep` is the model of one microbatch a
    step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .._plan._peak_model import _solve, _solve_from, block_of
from .._plan._peak_verify import _TRIES, _USE
from ._run import _Run

__all__: list[str] = []


class PeakModel(Protocol):
    """What :func:`climb` reads of a peak model: segments' bases above the step's start,
    options per block (each with its ``dk``), a choice of one option per block."""

    def solve(self, options: list[list[Any]], bases: dict[str, int], cap: int) -> tuple[int, ...] | None:
        """The cheapest choice predicted within ``cap``, or None."""
        ...

    def predict(self, bases: dict[str, int], dks: Sequence[int]) -> int:
        """The predicted peak above the step's start of blocks saving ``dks``."""
        ...

    def held(self, segment: str, dks: Sequence[int]) -> int:
        """What blocks saving ``dks`` add to ``segment``."""
        ...

    def correct(self, options: list[list[Any]], problems: list[Any], measured: tuple[int, ...],
                peaks: dict[str, int], cap: int, margin: int) -> tuple[tuple[int, ...], dict[str, int]]:
        """The next plan from a measured plan under ``cap`` and its step's peaks, and its bases."""
        ...

    def adopt(self, run: _Run) -> None:
        """Take the segments of ``run``, a simulated step of a plan."""
        ...


class OneStep:
    """Note [The peak model] (_plan/_peak_model.py): one forward and its backward a step."""

    def solve(self, options: list[list[Any]], bases: dict[str, int], cap: int) -> tuple[int, ...] | None:
        return _solve(options, bases, cap)

    def predict(self, bases: dict[str, int], dks: Sequence[int]) -> int:
        return max(base + self.held(s, dks) for s, base in bases.items())

    def held(self, segment: str, dks: Sequence[int]) -> int:
        return sum(dks[:block_of(segment) + 1])

    def correct(self, options: list[list[Any]], problems: list[Any], measured: tuple[int, ...],
                peaks: dict[str, int], cap: int, margin: int) -> tuple[tuple[int, ...], dict[str, int]]:
        return _solve_from(options, problems, measured, peaks, cap, margin)

    def adopt(self, run: _Run) -> None:
        return None


def climb(model: PeakModel, options: list[list[Any]], problems: list[Any], choice: tuple[int, ...],
          bases: dict[str, int], nbytes: int, origin: int, run_plan: Callable[[tuple[int, ...]], _Run]
          ) -> tuple[tuple[int, ...], dict[str, int], dict[str, int], _Run]:
    """Run the plan ``choice`` in simulated steps (``run_plan``) as the job's planner
    verifies it (Note [A plan file climbs as the job would]), for a target of ``nbytes``
    (the step starting at ``origin`` bytes). Returns the plan, the model's bases and the
    guard (the bases steps over the target implied) it ends with, and the run of the plan
    returned."""
    cap = nbytes - origin
    margin = max((p.records[s].nbytes for p in problems for s in p.candidates), default=0)
    zero = tuple(0 for _ in options)

    def cost(c: tuple[int, ...]) -> float:
        return sum(o[i].seconds for o, i in zip(options, c))

    guard: dict[str, int] = {}
    tried: list[tuple[float, tuple[int, ...], _Run]] = []
    for step in range(1, _TRIES + 1):
        run = run_plan(choice)
        model.adopt(run)
        peaks = {s: v - origin for s, v in run.segments.items()}
        measured = max(peaks.values()) + origin
        dks = [o[i].dk for o, i in zip(options, choice)]
        implied = {s: peaks[s] - model.held(s, dks) for s in peaks}
        over = measured > nbytes
        if over:
            guard = {s: max(guard.get(s, implied[s]), implied[s]) for s in peaks}
        else:
            tried.append((cost(choice), choice, run))
        if not over and all(i == len(o) - 1 for o, i in zip(options, choice)):
            return choice, bases, guard, run
        if step == _TRIES:
            break
        lowest = {s: max(implied[s], guard.get(s, implied[s])) for s in peaks}
        before, kept = choice, bases
        if over:
            bases = {s: max(lowest[s], bases.get(s, lowest[s])) for s in peaks}
            choice = model.solve(options, bases, cap - margin) or zero
        else:
            choice, bases = model.correct(options, problems, choice,
                                          {s: peaks[s] - implied[s] + lowest[s] for s in peaks}, cap, margin)
        if choice == before:
            return choice, bases, guard, run
        if not over and measured >= _USE * nbytes and cost(choice) >= cost(before):
            return before, kept, guard, run  # within _USE: only a cheaper plan is worth a step
    if not tried:
        run = run_plan(zero)
        model.adopt(run)
        return zero, bases, guard, run
    _, best, run = min(tried, key=lambda t: t[0])
    model.adopt(run)
    return best, bases, guard, run
