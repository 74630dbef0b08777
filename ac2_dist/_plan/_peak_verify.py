"""Verifying and correcting a peak target's plan from the measured steps (the planner
is _peak.py's :class:`PeakPlanner`).

Note [Verify, correct, stay put]
    After each planned step the measured segment peaks are compared with the target.
    Within the target and saving everything there is to save: converged. Over the
    target: each segment's base is raised to what the step implies (measured minus the
    plan's ``dk``) and the plan is solved again. Within it: solved again, priced from that
    step's peaks up (Note [A correction adds to what was measured] in _peak_model.py) and,
    in a block's own backward, replay by replay (Note [A block's backward, replay by
    replay] in _peak_model.py), each such correction a climb towards the target; a step
    using at least ``_USE`` of the target is kept (converged) unless the correction is a
    cheaper plan: a few KiB of headroom can be the difference between a matmul replayed
    and none (HF Llama 6 x 512 at compile's 0.8 point: its first plan at 0.9975 of the
    target, the plan without matmul recompute at 0.99997). A corrected plan is solved for the target less the largest candidate output
    unless it replays nothing the measured plan did not (Note [A climb that replays nothing
    new] in _peak_model.py). After ``_TRIES`` planned steps the planner keeps the cheapest
    plan whose measured peak was within the target (the floor if none was) and stops
    measuring: it converges within ``_TRIES + 1`` steps (the floor, then plans) and the
    saved sets do not change afterwards. A step that cannot be measured (on CPU a profiler
    session ac2 did not start is running, Note [A profiler session of the user's] in
    _peak.py; a forward ran without its backward, steps overlapped as under pipeline
    schedules, a block ran twice in one step, the blocks ran another structure or plan
    than the one being verified) changes nothing; the planner stays at its current plan and says why in
    ``describe()``; after ``_UNMEASURED`` step starts in a row without a usable step it
    stops measuring. Bases only rise above what a step over the target implied
    (``guard``): a plan known to overshoot is not chosen again. On a gloo job "the
    target" in all of this is the target less what gloo may hold late (Note
    [Collective buffers gloo frees late] in _late_buffers.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ._peak_model import block_of, fingerprint
from ._peak_offload import offload_block_inputs
from ._peak_step import _all_max, _missing, _Record, _Step

__all__: list[str] = []

_USE = 0.97  # a plan using less of the target than this is corrected (Note [Verify, correct, stay put])
_TRIES = 4  # planned steps measured before the planner stays put
_UNMEASURED = 8  # step starts in a row without a usable step after which the planner stays put
_FOREIGN_PROFILER = "a profiler session ac2 did not start is running"


def use(planner: Any, step: _Step | None) -> None:
    """Use ``step``, the latest step measured (None: none ended since the last step start), on
    every rank at once: Note [Verify, correct, stay put]."""
    device = planner.device
    # what the next step starts from (Note [What a peak target bounds])
    now_abs = torch.cuda.memory_allocated(device) if device is not None and device.type == "cuda" else planner.cpu_origin
    calls = step.calls if step is not None else []
    segments = [f"{kind}:{k}" for k in range(len(calls)) for kind in ("fwd", "bwd")]
    peaks = step.peaks if step is not None else None
    problem = "no step ended since the last one" if step is None else step.problem
    if problem is None and peaks is None:
        problem = "it was not traced"
    if problem is None:
        problem = _missing(segments, peaks) or followed(planner, step)
    # Note [One plan on every rank] (_peak_step.py): one round per step start on every rank.
    n = len(calls)
    unsettled = planner.state != "settled"  # a settled rank measures nothing and vetoes nothing
    if planner.late is None:
        planner.late = planner._late_bytes(device)
    # Note [A block's backward, replay by replay] (_peak_model.py): the sub-segments join the
    # round where every rank marked the same ones and made the same values there
    made = step.made if step is not None and problem is None and step.parts else {}
    parts = sorted(step.parts, key=_order) if made else []
    mark = fingerprint(made)
    head = [int(unsettled), int(unsettled and problem is not None), n, -n, planner.target, -planner.target, now_abs,
            planner.late, mark, -mark]
    synced = _all_max(head + [peaks.get(s, -1) if peaks else -1 for s in segments] + [step.parts[s] for s in parts])
    if not (mark and synced[8] == -synced[9] == mark):
        made, parts = {}, []
    part_peaks = {s: step.parts[s] for s in parts} if step is not None else {}
    planner.all_settled = synced[0] == 0
    if synced[1] and problem is None:
        problem = "another rank could not measure it"
    if synced[2] == -synced[3] == n and synced[4] == -synced[5]:  # same structure and target everywhere
        now_abs = synced[6]
        planner.late = synced[7]  # the largest any rank found: every rank plans for the same target
        if peaks:
            peaks = {s: synced[len(head) + i] for i, s in enumerate(segments)}
            part_peaks = {s: synced[len(head) + len(segments) + i] for i, s in enumerate(parts)}
    planner.base_abs = now_abs
    if planner.state == "settled":
        if step is not None:
            planner._report_only(step)
        return
    if problem is not None:
        if problem != _FOREIGN_PROFILER:  # Note [A profiler session of the user's]: wait for it
            planner.unmeasured += 1
        if step is not None:
            planner._remember(_Record(step.index, planner._describe_choice(), planner.predicted, None, problem))
            if problem != _FOREIGN_PROFILER:  # that one warned when it was found
                planner._warn_once("unmeasured", f"step {step.index + 1} could not be measured ({problem}); the "
                                              f"plan stays as it is ({planner._describe_choice()}) until a step "
                                              "can be")
        if planner.unmeasured >= _UNMEASURED:
            planner._settle(f"{_UNMEASURED} step starts in a row found no measured step (last: {problem})")
        return
    planner.unmeasured = 0
    measured = max(peaks.values()) + step.base_abs
    planner.measured = measured
    target = planner.planned_target
    dks = [c.dk for c in calls]
    implied = {s: peaks[s] - sum(dks[:block_of(s) + 1]) for s in segments}
    choice = step.choice
    planner._remember(_Record(step.index, planner._describe_choice(choice), planner.predicted, measured,
                           "over the target" if measured > planner.target else
                           "over the target less gloo's late buffers" if measured > target else ""))
    if measured > target:
        for s in segments:
            planner.guard[s] = max(planner.guard.get(s, implied[s]), implied[s])
    if planner.state == "floor":
        planner.floor_peak = measured
        planner.structure = list(calls)
        planner.bases = implied
        if measured > target:
            if not offload_block_inputs(planner, measured):  # Note [Below the floor, the block inputs go first]
                planner._infeasible(measured)
            return
        planner.state = "planned"
        planner._plan()
        if planner.choice is None:
            planner._settle("the floor is the only plan within the target")
        return
    planner.planned_steps += 1
    cost = planner._cost(choice)
    if measured <= target:
        planner.tried.append((cost, choice, measured))
    if measured <= target and planner._is_top(choice):
        planner._settle("the measured peak is within the target" + (
            "" if measured >= _USE * target else " (every block saves all it can)"))
        return
    if planner.planned_steps >= _TRIES:
        best = min(planner.tried, key=lambda t: t[0]) if planner.tried else (0.0, None, 0)
        if best[1] != planner.choice:
            planner._install(best[1])
        planner._settle(f"after {_TRIES} planned steps: the cheapest plan measured within the target"
                     if planner.tried else f"after {_TRIES} planned steps no plan was within the target: the floor")
        return
    # Over: the bases rise to what the step implies; under: priced from its peaks up (Note [A correction
    # adds to what was measured] in _peak_model.py); never below what a step over the target implied.
    lowest = {s: max(implied[s], planner.guard.get(s, implied[s])) for s in segments}
    if measured > target:
        planner.bases = {s: max(lowest[s], planner.bases.get(s, lowest[s])) for s in segments}
    planner.structure = list(calls)
    before, bases = planner.choice, planner.bases
    if measured > target:
        planner._plan(None)
    else:
        shift = {s: lowest[s] - implied[s] for s in segments}
        from_peaks = {s: peaks[s] + shift[s] for s in segments}
        from_peaks.update({s: v + shift[f"bwd:{block_of(s)}"] for s, v in part_peaks.items()})
        planner._plan((choice, from_peaks, made))
    if planner.choice == before:
        planner._settle("the measured peak is within the target" if measured >= _USE * target
                        else "a corrected plan equals the measured one")
    elif measured >= _USE * target and planner._cost(planner.choice) >= cost:
        # Note [Verify, correct, stay put]: within _USE of the target only a cheaper plan is worth a step
        planner.bases = bases
        planner._install(before)
        planner._settle("the measured peak is within the target")


def _order(segment: str) -> tuple[int, int]:
    """``bwd:k`` then ``bwd:k/1``, ``bwd:k/2``, ... in block order."""
    return block_of(segment), int(segment.split("/")[1]) if "/" in segment else 0


def followed(planner: Any, step: _Step) -> str | None:
    """Why ``step`` is not a measurement of the plan it began under (None if it is)."""
    calls = step.calls
    if any(c.signature is None for c in calls):
        return "a block's structure is unknown"
    if step.choice is None and planner.state == "floor":
        return None if all(c.dk == 0 for c in calls) else "a block saved more than the floor"
    structure = planner.structure or []
    if [(c.fqn, c.signature) for c in calls] != [(c.fqn, c.signature) for c in structure]:
        return "its blocks' structure changed"
    if [c.dk for c in calls] != planner._dks(step.choice):
        return "its blocks did not follow the plan"
    return None
