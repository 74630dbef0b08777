"""A ``MemoryBudget(peak=...)`` on a ``torch.distributed.pipelining`` stage (the planner
is _peak.py's :class:`~._peak.PeakPlanner`).

Note [A pipeline rank's plan is followed as simulated]
    Under a ``torch.distributed.pipelining`` schedule a rank's forwards and backwards of
    several microbatches interleave, so no step of one plan can be measured apart (and
    stages reach a step's first region at different times: no sync round either). The
    planner then measures nothing. A plan file the simulation made for the pipeline rank
    (Note [A stage's microbatches in flight] in _plan/_stage_model.py; the file's
    ``pipeline``) is followed as it is, from the first step: the simulation verified it
    under the schedule, in the steps Note [A plan file climbs as the job would] in
    _sim/_climb.py runs. Without one the blocks stay at the floor, also when a plan file
    made for one microbatch a step was loaded (its plan would be held once per
    microbatch in flight). A pipeline rank's plan in a step outside any pipeline stage
    (no function of torch's pipelining stage module on the stack: neither its schedule's
    forward nor its first step's shape or metadata inference) is an error: it would be
    followed unmeasured where the planner can measure.
"""

from __future__ import annotations

from typing import Any

__all__: list[str] = []


def at_the_floor(planner: Any) -> None:
    """A pipeline stage without a pipeline rank's plan file: the blocks stay at the floor
    (also a plan file's plan for one microbatch a step), said once."""
    planner.state = "pipelined"
    planner.all_settled = True
    if planner.choice is not None:
        planner._install(None)
    planner.reason = ("at the floor: a torch.distributed.pipelining stage's steps cannot be measured; plan the "
                      "stage with ac2_dist.simulate(..., pipeline=..., target=...) and pass its plan file")
    planner._warn_once("pipelined", "a pipeline schedule runs this model: microbatches are in flight, so a step "
                                    "cannot be measured; the plan stays at the floor (\"recompute_all\"). Plan the "
                                    "stage with ac2_dist.simulate(..., pipeline=Pipeline(...), target=...) and pass "
                                    "MemoryBudget(peak=..., plan=...) the plan file it writes")


def follow(planner: Any, stage: dict[str, Any], predicted: int) -> None:
    """Follow the installed plan of a pipeline rank's plan file as it is; ``stage``: the
    file's ``pipeline``, ``predicted``: its predicted peak."""
    planner.stage_plan = dict(stage)
    planner.state = "pipelined"
    planner.all_settled = True
    planner.bases = None
    planner.predicted = predicted or None
    planner.reason = (f"following the simulated plan of pipeline rank {stage.get('stage')} of "
                      f"{stage.get('stages')} ({stage.get('schedule')}, {stage.get('microbatches')} microbatches a "
                      "step): steps interleave, so none is measured or corrected")


def outside(planner: Any, fqn: str) -> str:
    """The error of a pipeline rank's plan in a step outside any pipeline stage."""
    stage = planner.stage_plan or {}
    return (f"ac2_dist.MemoryBudget: module {fqn or '(region)'!r} runs outside a torch.distributed.pipelining "
            f"schedule, but the plan file holds the plan of pipeline rank {stage.get('stage')} "
            f"({stage.get('schedule')}, {stage.get('microbatches')} microbatches a step), made for the "
            "microbatches that schedule keeps in flight. Run the stage under its schedule, or simulate the job as "
            "it runs (without pipeline=) and pass that plan file")
