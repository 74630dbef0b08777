"""A peak target on a simulated pipeline rank: ``simulate(..., pipeline=..., target=...)``
solves the model of Note [A stage's microbatches in flight] (_plan/_stage_model.py) on
the floor step run under the schedule; the simulated steps that verify and correct it are
Note [A plan file climbs as the job would] (_sim/_climb.py), with :class:`StageModel`'s
correction: priced from the step's peaks up (:func:`~.._plan._peak_model._above`: each
option costs what it holds beyond the measured plan's saved set, in every microbatch in
flight), and a plan that replays an op the measured one did not keeps the largest
candidate output free (Note [A climb that replays nothing new] in _plan/_peak_model.py).

Note [A pipeline rank's plan file names its stages]
    With several stages a rank the simulation's model is a container whose ``stages``
    are the rank's stage modules (``RankStages`` in _pipeline.py), so its blocks are
    ``stages.0.<fqn>``, ``stages.1.<fqn>``, ... The job's stages are separate modules (one
    ``PipelineStage`` each); one ``MemoryBudget`` plans them together when ``apply_ac`` is
    given an ``nn.ModuleList`` of them in ``Pipeline.indices``' order, whose blocks are
    ``0.<fqn>``, ``1.<fqn>``, ...: the plan file names them so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .._plan._peak_model import corrected
from .._plan._stage_model import counts, predict, solve
from ._run import _Run

__all__: list[str] = []


class StageModel:
    """The peak model of one simulated pipeline rank: its blocks' stages and each
    segment's microbatch counts (``n``), from the floor step's segments in time order."""

    def __init__(self, floor: _Run, several: bool) -> None:
        # with several stages a rank the blocks are ``stages.<k>.<fqn>`` (RankStages)
        self.stage_of = [int(f.split(".")[1]) if several else 0 for f in floor.fqns]
        self.n = counts(list(floor.segments), self.stage_of)

    def adopt(self, run: _Run) -> None:
        """Count the segments of ``run`` (a planned step: its marks are the floor's, unless
        a block's backward began elsewhere)."""
        self.n = counts(list(run.segments), self.stage_of)

    def solve(self, options: list[list[Any]], bases: dict[str, int], cap: int) -> tuple[int, ...] | None:
        return solve(options, bases, self.n, self.stage_of, cap)

    def predict(self, bases: dict[str, int], dks: Sequence[int]) -> int:
        return predict(bases, self.n, dks)

    def held(self, segment: str, dks: Sequence[int]) -> int:
        return sum(c * d for c, d in zip(self.n[segment], dks))

    def correct(self, options: list[list[Any]], problems: list[Any], measured: tuple[int, ...],
                peaks: dict[str, int], cap: int, margin: int) -> tuple[tuple[int, ...], dict[str, int]]:
        """The cheapest plan predicted to fit from a measured plan's step: each option priced
        above the measured saved set (Note [A correction adds to what was measured] in
        _plan/_peak_model.py); a plan that replays an op the measured one did not fits
        ``cap - margin`` only. Returns it (``measured`` if none fits) and its bases."""
        choice, mine = corrected(options, problems, measured, peaks, cap, margin, self.solve)
        # the bases that make the model's prediction of ``choice`` this one's
        dks = [o[i].dk for o, i in zip(options, choice)]
        extra = [o.dk - d for o, d in zip(mine, dks)]
        return choice, {s: base + self.held(s, extra) for s, base in peaks.items()}


def file_fqns(fqns: list[str], several: bool) -> list[str]:
    """The blocks' names in a pipeline rank's plan file (Note [A pipeline rank's plan file
    names its stages]): a rank of one stage keeps its module's own names."""
    return [f.removeprefix("stages.") for f in fqns] if several else list(fqns)


def plan_meta(pipeline: Any) -> dict[str, Any]:
    """What a plan file says of the pipeline rank it was planned for."""
    return dataclasses.asdict(pipeline)
