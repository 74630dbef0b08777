"""One region under a :class:`~ac2_dist.MemoryBudget`: its policy, and while it
calibrates the observer that records the block's problem (``_block_problem.py``).

Note [Calibrate, plan, replay the plan]
    A region (one call of a checkpointed module) whose structure has no plan yet is a
    *calibration*: every op is recomputable (the memory of ``"recompute_all"``) and an
    observer on the graph records, per op, its output bytes, its inputs and its
    estimated recompute cost. When the region exits, the ops' dependency graph and the
    outputs autograd saved (the graph's handles) define the problem; :meth:`_Problem.solve`
    picks the saved set; the plan is cached by structure (the sequence of ops and output
    shapes), so identical blocks share it and later steps pay no planning cost. A
    planned region answers each op from the plan after checking the op and its output
    shape against it; at a mismatch it switches to another cached plan that agrees so
    far (a structure seen before: other shapes, another dispatch path), and otherwise
    recomputes the rest and its next call calibrates again. The structure is the
    module's own computation: ops FSDP runs for a nested unit (its all-gathers and their
    one-time buffers) are not part of it (Note [FSDP's own ops are not structure] in
    fsdp.py): they are answered PREFER_RECOMPUTE, which a plan answers for them anyway.

Note [A calibration keeps what its plan saves]
    A calibrating region holds the outputs a plan could save (of the recomputable ops
    its own frame decides: not views, not in-place writes, not random ops replayed
    under ``rng="replay"``) until it exits; then, with the plan made, the outputs the
    plan saves become saved values of the graph (``Graph._save_in_place``, as
    ``tag_with_policy`` does) -- provided the tensor is still that op's value (same
    version, still mapped to it; a plan never saves an output written later) -- and
    the rest are let go. So the calibrating call
    keeps what later calls keep and backward recomputes what it will recompute on
    every later step, at the cost of holding one block's op outputs transiently (until
    the block's forward returns) instead of recomputing them.

Note [Identical blocks share the first step]
    A module without a plan of its own whose first op matches a cached plan (preferably
    the plan of its siblings: ``blocks.3`` looks at ``blocks.#``) follows that plan from
    its first op instead of calibrating, as later steps do; identical blocks therefore
    follow the first block's plan in the first step. Until the plan first says
    PREFER_SAVE the region keeps recording as a calibration would (everything was
    recomputable so far): if it diverges from every cached plan before that point, or
    ends early, it *is* a calibration and plans on its own. Diverging after a save, it
    recomputes the rest and its next call calibrates (no following then).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy

from .._trace._nodes import flatten_outputs, input_refs
from ..fsdp import own_ops_scope
from ..side_effects import op_info
from ._block_problem import Plan, _CostModel, _Problem, _Record, _tensor_bytes

if TYPE_CHECKING:
    from ._peak import PeakPlanner

_CP = CheckpointPolicy
_PS, _PR = _CP.PREFER_SAVE, _CP.PREFER_RECOMPUTE
# A torch.profiler.record_function scope opens and closes (Note [FSDP's own ops are not
# structure] in fsdp.py).
_SCOPE_ENTER = torch.ops.profiler._record_function_enter_new.default
_SCOPE_EXIT = torch.ops.profiler._record_function_exit._RecordFunction


class RegionOwner(Protocol):
    """What a :class:`_BudgetRegion` asks of the budget that made it (a
    :class:`~ac2_dist.MemoryBudget`): its plans by module and by structure, the cost
    model, and the peak planner of a peak target. The planner names this, never the
    public class above it."""

    _planner: PeakPlanner | None  # a peak target's planner (None: fraction or bytes)

    def _plan_for(self, fqn: str) -> tuple[Plan | None, bool]: ...
    def _first_match(self, fqn: str, key: tuple) -> Plan | None: ...
    def _switch(self, plan: Plan, k: int, key: tuple, fqn: str = "") -> Plan | None: ...
    def _mismatch(self, fqn: str, k: int, key: tuple | None) -> None: ...
    def _follow(self, fqn: str, plan: Plan) -> None: ...
    def _forget(self, fqn: str) -> None: ...
    def _adopt(self, fqn: str, problem: _Problem) -> Plan: ...
    def _cost_model(self, device: torch.device) -> _CostModel: ...


class _BudgetRegion:
    """The policy of one region under a :class:`~ac2_dist.MemoryBudget` (Note [Calibrate, plan,
    replay the plan]); also the region's observer while it calibrates."""

    def __init__(self, budget: RegionOwner, fqn: str) -> None:
        self.budget = budget
        self.fqn = fqn
        self.plan, self.may_follow = budget._plan_for(fqn)
        self.calls = 0
        self.current: int | None = None  # call index of the op being decided (None: not structure)
        self.diverged = False
        # Observing the ops as a calibration (also while following a cached plan that has
        # answered only PREFER_RECOMPUTE so far: Note [Identical blocks share the first step]).
        self.recording = False
        self.signature: list[tuple] = []
        self.records: list[_Record] = []
        self.graph: Any = None
        self.observing = False  # self._observe is installed on the graph
        self.previous_observer: Any = None
        self.first_handle = 0
        # node seq -> call index of a planned call's ops, while a peak target's planner wants
        # them (Note [A block's backward, replay by replay] in _peak_model.py); None: not noted
        self.seq_calls: dict[int, int] | None = None
        self.allow_mutation = False
        self.cost: _CostModel | None = None
        self.scopes: list[tuple[int, bool]] = []  # open FSDP profiler scopes: (handle key, FSDP's own ops)
        self.fsdp_own = False  # inside a scope of FSDP's own ops (Note [FSDP's own ops are not structure] in fsdp.py)
        self.peak_call: Any = None  # (step, call index) of a peak target (_peak.py)
        self.problem_signature: tuple | None = None  # the structure this region calibrated

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if (op is _SCOPE_ENTER or op is _SCOPE_EXIT) and self._fsdp_scope(op, args, ctx.op_output):
            self.current = None
            return _PR
        if self.fsdp_own:  # FSDP's own op: not structure, never saved by a plan
            self.current = None
            return _PR
        k = self.calls
        self.calls = k + 1
        self.current = k
        key = (op, _first_shape(ctx.op_output))
        plan = self.plan
        if plan is None:  # calibrating
            if k == 0 and self.may_follow:  # Note [Identical blocks share the first step]
                plan = self.budget._first_match(self.fqn, key)
                if plan is not None:
                    self.plan = plan
                    return self._recorded(plan.decisions[0], key)
            self.signature.append(key)
            return _PR
        if self.diverged:
            return _PR
        if k < len(plan.signature) and plan.signature[k] == key:
            decision = plan.decisions[k]
            return self._recorded(decision, key) if self.recording else decision
        other = self.budget._switch(plan, k, key, self.fqn)
        if other is not None:  # another cached structure that agrees so far: follow it
            self.plan = other
            decision = other.decisions[k]
            return self._recorded(decision, key) if self.recording else decision
        self.budget._mismatch(self.fqn, k, key)  # a plan from a file is refused here
        if self.recording:  # nothing saved so far: this region is a calibration after all
            self.plan = None
            self.signature.append(key)
            return _PR
        self.diverged = True  # an unknown structure: recompute the rest, calibrate next time
        return _PR

    def _recorded(self, decision: CheckpointPolicy, key: tuple) -> CheckpointPolicy:
        """A plan's decision in a region still recording as a possible calibration: it
        stops at the plan's first save (it can no longer be one)."""
        if decision is _PS:
            self.recording = False
            self.signature = []
            self.records = []
        else:
            self.signature.append(key)
        return decision

    def _fsdp_scope(self, op: Any, args: tuple, out: Any) -> bool:
        """Track FSDP's profiler scopes; True for the op that opens or closes one (Note
        [FSDP's own ops are not structure] in fsdp.py)."""
        scopes = self.scopes
        if op is _SCOPE_ENTER:
            own = own_ops_scope(args[0] if args else None)
            if own is None:
                return False
            scopes.append((_handle_key(out), own))
            self.fsdp_own = own
            return True
        if scopes and args and _handle_key(args[0]) == scopes[-1][0]:
            scopes.pop()
            self.fsdp_own = scopes[-1][1] if scopes else False
            return True
        return False

    # ---- region hooks (Note [Region-scoped policies] in _policy.py) ------------------------
    def region_enter(self, graph: Any) -> None:
        if graph is None:  # no grad: nothing is recorded
            return
        self.graph = graph
        self.seq_calls = None
        planner = self.budget._planner
        if planner is not None:
            planner.enter(self, graph)
        if self.plan is not None:
            if graph.tracker is not None:
                graph.tracker._note_plan(self.fqn, self.plan)
            if self.seq_calls is not None:  # the planner asked (PeakPlanner.enter)
                self.previous_observer = graph.observer
                graph.observer = self._note_call
            return
        frames = graph.frames
        self.allow_mutation = bool(frames) and frames[-1].fn is self and frames[-1].allow_mutation
        self.recording = True
        self.observing = True
        self.previous_observer = graph.observer
        graph.observer = self._observe
        self.first_handle = graph.packed

    def _note_call(self, node: Any, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """The observer of a planned call whose planner wants its nodes' call indices."""
        previous = self.previous_observer
        if previous is not None:
            previous(node, func, args, kwargs, out)
        if self.current is not None and self.seq_calls is not None and not getattr(func, "ac2_conversion", False) \
                and not op_info(func).ignored:
            self.seq_calls[node.seq] = self.current

    def _observe(self, node: Any, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        previous = self.previous_observer
        if previous is not None:
            previous(node, func, args, kwargs, out)
        if not self.recording:
            return
        if getattr(func, "ac2_conversion", False):  # Note [Wrapper subclasses made and unwrapped outside dispatch]
            call, view = None, True
        else:
            info = op_info(func)
            call = None if info.ignored else self.current
            view = info.aliases
        nbytes = 0 if view else _tensor_bytes(out)
        if self.cost is None:
            device = next((t.device for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)),
                          torch.device("cpu"))
            self.cost = self.budget._cost_model(device)
        flops, seconds = (0, 0.0) if view else self.cost.estimate(func, args, kwargs, out)
        # Note [A calibration keeps what its plan saves]: hold what a plan could save.
        frames = self.graph.frames
        held = out if (
            self.budget._planner is None  # a peak target's calibration is the floor (Note [The peak model] in _peak_model.py)
            and call is not None and nbytes > 0 and node.saved is None and node.rng is None and not node.must_recompute
            and not node.writes and node.via is None and frames and frames[-1].fn is self
        ) else None
        self.records.append(_Record(node.seq, call, func, node, nbytes, flops, seconds,
                                    tuple(m.seq for m in node.inputs[1::3]), view, held))

    def region_exit(self, graph: Any, failed: bool) -> None:
        if self.graph is None:
            return
        try:
            self._region_exit(graph, failed)
        finally:
            planner = self.budget._planner
            if planner is not None:
                planner.exit(self)

    def _region_exit(self, graph: Any, failed: bool) -> None:
        if self.observing or (self.seq_calls is not None and graph.observer == self._note_call):
            graph.observer = self.previous_observer
        plan = self.plan
        if plan is not None:
            if failed:
                self.records = []
                return
            if not self.diverged and self.calls == len(plan.signature):
                self.records = []
                self.budget._follow(self.fqn, plan)  # it may have switched plans
                if self.observing and graph.tracker is not None:  # followed a cached plan from the start
                    graph.tracker._note_plan(self.fqn, plan)
                return
            if not self.diverged:  # it ended before its plan did
                self.budget._mismatch(self.fqn, self.calls, None)
            if not self.recording:
                self.budget._forget(self.fqn)  # calibrate next time
                return
            # A shorter structure, and the plan saved nothing so far: a calibration after all.
        if failed:
            self.records = []
            return
        targets = {h.node.seq for h in graph.handles_since(self.first_handle)}
        forced = {r.seq for r in self.records if r.node.saved is not None and all(s is not None for s in r.node.saved)}
        written = set()  # outputs written in place later: saving one would make the write a side effect
        for r in self.records:
            writes = r.node.writes
            if writes:
                for pos, m, _ in input_refs(r.node):
                    if pos in writes:
                        written.add(m.seq)
                        if m.alias_of is not None:  # its storage's owner (Note [Aliases a schema does not declare] in _tracer.py)
                            written.add(m.alias_of[0].seq)
        problem = _Problem(self.records, targets, forced, written, tuple(self.signature))
        plan = self.budget._adopt(self.fqn, problem)
        self._keep_planned(graph, plan)
        problem.release()
        self.problem_signature = problem.signature
        self.records = []  # let the nodes and the held outputs go
        if graph.tracker is not None:
            graph.tracker._note_plan(self.fqn, plan)

    def _keep_planned(self, graph: Any, plan: Plan) -> None:
        """Save the held outputs the plan saves (Note [A calibration keeps what its plan saves])."""
        gmap = graph.map
        decisions = plan.decisions
        if gmap is None or _PS not in decisions:
            return
        # The region's frame is gone but the tracer may still be installed: what saving
        # runs (an alias of the value) is not an op of any region.
        with _disable_current_modes():
            self._save_held(graph, gmap, decisions)

    def _save_held(self, graph: Any, gmap: Any, decisions: tuple) -> None:
        for r in self.records:
            if r.held is None or r.call >= len(decisions) or decisions[r.call] is not _PS:
                continue
            node = r.node
            if node.cut or node.must_recompute:
                continue
            kept = False
            for t in flatten_outputs(r.held):
                if not isinstance(t, torch.Tensor):
                    continue
                e = gmap.get(t)
                if e is None or e[1] is not node or (e[3] is not None and e[3] != t._version):
                    continue  # no longer this op's value (written since, or remapped)
                if node.saved is not None and node.saved[e[2]] is not None:
                    continue
                graph._save_in_place(node, e[2], t, _PS, "policy", self.allow_mutation)
                kept = True
            if kept:
                graph.stats.saved_nodes += 1


def _handle_key(handle: Any) -> int:
    """Identifies a record_function handle: the ``ScriptObject`` that reaches the exit op
    is a new Python wrapper of the one the enter op returned; its hash is the object's
    address (alive while the scope is open)."""
    try:
        return hash(handle)
    except TypeError:
        return id(handle)


def _first_shape(out: Any) -> tuple | None:
    if isinstance(out, torch.Tensor):
        return tuple(out.shape)
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return tuple(o.shape)
    return None
