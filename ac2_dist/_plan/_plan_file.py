"""A peak target's plan as a file: written by ``SimulationReport.save_plan``, loaded by
``MemoryBudget(peak=..., plan=path)`` so that the job's first step runs it.

Note [A plan file is the planner's state]
    The file holds what a ``PeakPlanner`` would have after measuring its floor step:
    each block structure's problem (per op: its name, output shape, bytes, FLOPs,
    estimated seconds, inputs; the outputs backward needs, the forced and the written
    ones: enough to rebuild :class:`_Problem` and its options without a graph), the
    blocks in forward order (module fqn -> structure), the segment bases of the peak
    model (Note [The peak model] in _peak_model.py: measured in the simulated floor step,
    or implied by the simulated planned steps when ``plan()`` verified and corrected the
    plan, with ``guard``, the bases its steps over the target implied: Note [A plan file
    climbs as the job would] in _sim/_climb.py) and the option chosen per block. Loading it
    rebuilds the problems and installs the choice as the
    planner's plan in state ``planned``: the first step follows it (no calibration at
    the floor) and is measured like any planned step, so Note [Verify, correct, stay
    put] in _peak_verify.py goes on from there. The file's ``step_start`` (the simulated bytes
    alive when block 0's forward began, the origin of its bases) becomes the planner's
    origin: its first prediction is absolute, and on CPU, where a step's peak is
    measured above the step's start, the planner adds it (``cpu_origin``, Note [What a
    peak target bounds] in _peak.py), so the target the user gave the simulation means
    the same bytes in the job on CPU as on CUDA. Ops are stored by name (``aten.mm.default``)
    and resolved with ``torch.ops``; a structure is the op sequence and first output
    shapes the job's blocks must run. A block whose ops differ from its structure, or
    a checkpointed module the file does not name, is refused at its first op /
    region with the first difference named (:func:`mismatch`): a plan for another
    model, shapes, dtype or world size must not be followed silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from .._trace._subclass_wraps import Conversion
from ._block_problem import _Problem, _Record
from ._peak_step import _Call

__all__: list[str] = []

FORMAT = "ac2_dist.plan"
VERSION = 1


def _op_name(op: Any) -> str:
    return str(op)


def _resolve(name: str, path: str) -> Any:
    if name.startswith(("ac2.rewrap.", "ac2.unwrap.")):  # Note [Wrapper subclasses made and unwrapped outside dispatch]
        return Conversion(name)
    parts = name.split(".")
    if len(parts) != 3:
        raise ValueError(f"ac2_dist.MemoryBudget(plan={path!r}): op {name!r} is not namespace.op.overload")
    try:
        return getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError) as e:
        raise ValueError(f"ac2_dist.MemoryBudget(plan={path!r}): op {name!r} does not exist in this torch "
                         f"({torch.__version__}); make the plan with the torch the job runs") from e


def _sig_json(signature: tuple) -> list:
    return [[_op_name(op), list(shape) if shape is not None else None] for op, shape in signature]


def dump(fqns: list[str], structure: dict[str, tuple], problems: dict[tuple, _Problem],
         choice: tuple[int, ...] | None, bases: dict[str, int], meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON document of a plan (Note [A plan file is the planner's state])."""
    sigs: list[tuple] = []
    for f in fqns:
        if structure[f] not in sigs:
            sigs.append(structure[f])
    structures = []
    for sig in sigs:
        p = problems[sig]
        structures.append({
            "signature": _sig_json(sig),
            "records": [[r.seq, r.call, _op_name(r.op), r.nbytes, r.flops, r.seconds, list(r.inputs), r.view]
                        for r in (p.records[s] for s in p.order)],
            "targets": sorted(p.targets), "forced": sorted(p.forced),
            "written": sorted(getattr(p, "written", set())),
        })
    blocks = []
    for k, f in enumerate(fqns):
        sig = structure[f]
        opts = problems[sig].frontier()
        i = choice[k] if choice is not None else 0
        blocks.append({"fqn": f, "structure": sigs.index(sig), "option": i,
                       "saved": sorted(opts[i].saved), "dk": opts[i].dk})
    return {"format": FORMAT, "version": VERSION, **meta, "bases": bases, "blocks": blocks,
            "structures": structures}


@dataclass
class _Loaded:
    """A plan file read back: problems, the blocks' calls, bases and choice."""

    path: str
    target: int
    problems: dict[tuple, _Problem]
    calls: list[_Call]
    saved: list[frozenset]
    bases: dict[str, int]
    meta: dict[str, Any]
    start: int = 0  # the simulated bytes alive when block 0's forward began (the bases' origin)

    @property
    def fqns(self) -> dict[str, tuple]:
        return {c.fqn: c.signature for c in self.calls}


def load(path: str) -> _Loaded:
    """Read and check a plan file (format, version, internal consistency)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ValueError(f"ac2_dist.MemoryBudget(plan={path!r}): cannot read the plan file ({e}); write one "
                         f"with `python -m ac2_dist.simulate ... --plan-out {path}`") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"ac2_dist.MemoryBudget(plan={path!r}): not a JSON plan file ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"ac2_dist.MemoryBudget(plan={path!r}): not an ac2_dist plan file (no "
                         f"\"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise ValueError(f"ac2_dist.MemoryBudget(plan={path!r}): plan format version {doc.get('version')!r}; "
                         f"this ac2_dist reads version {VERSION}: simulate again with this version")
    try:
        problems_by_index = []
        for s in doc["structures"]:
            sig = tuple((_resolve(op, path), tuple(shape) if shape is not None else None)
                        for op, shape in s["signature"])
            records = [_Record(seq, call, _resolve(op, path), None, nbytes, flops, seconds, tuple(inputs), view)
                       for seq, call, op, nbytes, flops, seconds, inputs, view in s["records"]]
            problem = _Problem(records, set(s["targets"]), set(s["forced"]), set(s["written"]), sig)
            problems_by_index.append(problem)
        calls, saved = [], []
        for b in doc["blocks"]:
            problem = problems_by_index[b["structure"]]
            chosen = frozenset(b["saved"])
            held = problem.evaluate(chosen)[0] - problem.evaluate(frozenset())[0]
            calls.append(_Call(b["fqn"], held, problem.signature))
            saved.append(chosen)
        bases = {str(k): int(v) for k, v in doc["bases"].items()}
        target = int(doc["target"])
        start = int(doc["step_start"])
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(f"ac2_dist.MemoryBudget(plan={path!r}): the plan file is incomplete or damaged "
                         f"({type(e).__name__}: {e}); write it again") from e
    problems = {p.signature: p for p in problems_by_index}
    meta = {k: v for k, v in doc.items() if k not in ("bases", "blocks", "structures")}
    return _Loaded(path, target, problems, calls, saved, bases, meta, start)


def install(planner: Any, loaded: _Loaded) -> None:
    """Make ``loaded`` the plan of ``planner`` (a PeakPlanner still at its start):
    Note [A plan file is the planner's state]."""
    planner.problems.update(loaded.problems)
    planner.structure = list(loaded.calls)
    planner.bases = dict(loaded.bases)
    planner.base_abs = planner.cpu_origin = loaded.start  # Note [A plan file is the planner's state]
    choice = []
    for call, saved in zip(loaded.calls, loaded.saved):
        options = planner.options(call.signature)
        match = [i for i, o in enumerate(options) if o.saved == saved]
        if not match:  # a saved set off this frontier: the closest one with no more bytes
            match = [max((i for i, o in enumerate(options) if o.dk <= call.dk), default=0)]
        choice.append(match[0])
    # the bases the simulated steps over the target implied (Note [A plan file climbs as
    # the job would] in _sim/_climb.py): a plan the simulation saw overshoot is not chosen again
    planner.guard = {str(k): int(v) for k, v in (loaded.meta.get("guard") or {}).items()}
    planner.state = "planned"
    stage = loaded.meta.get("pipeline")
    if stage:  # its bases are a pipeline rank's model's: Note [A pipeline rank's plan is followed as simulated] in _peak_pipeline.py
        planner.bases = None
    planner._install(tuple(choice) if any(choice) else None)
    if stage:
        planner.follow_stage_plan(stage, int(loaded.meta.get("predicted_peak") or 0))


def mismatch(loaded: _Loaded, fqn: str, k: int | None, key: tuple | None) -> str:
    """The error for a job whose block ``fqn`` does not match the plan (at op ``k``
    running ``key``; ``k`` None: a module the plan does not name)."""
    head = f"ac2_dist.MemoryBudget(plan={loaded.path!r}): the plan does not match this model: "
    tail = (". Simulate the model, batch, sequence length, dtype and world size the job runs and write the "
            "plan again, or drop plan= to calibrate at the first step")
    if k is None:
        named = ", ".join(list(loaded.fqns)[:4]) + (", ..." if len(loaded.fqns) > 4 else "")
        return head + f"the checkpointed module {fqn or '(region)'!r} is not in it (it names {named})" + tail
    sig = loaded.fqns.get(fqn, ())
    want = f"{_op_name(sig[k][0])} with output shape {list(sig[k][1]) if sig[k][1] is not None else None}" \
        if k < len(sig) else "the end of the block"
    got = f"{_op_name(key[0])} with output shape {list(key[1]) if key[1] is not None else None}" \
        if key is not None else "the end of the block"
    return head + f"module {fqn!r}, op {k}: the plan expects {want}, the job ran {got}" + tail
