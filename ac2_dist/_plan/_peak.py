"""Fit the step in N bytes: ``MemoryBudget(peak=N)`` plans the saved sets of every block
together so that the rank's measured peak stays at or below N.

    budget = ac.MemoryBudget(peak="70GiB")
    ac.apply_ac(model, budget, modules=[Block])   # one instance: one budget for the model
    print(budget.format_plan())

Note [What a peak target bounds]
    A *step* is one forward and the backward that consumes it. After ``apply_ac(model,
    budget)`` it begins where ``memory.track(model)``'s does: when ``model``'s forward
    begins, before its other forward pre-hooks (FSDP's root all-gather; _watch_model in
    _peak_step.py), so the embedding and the unsharded root parameters count in both.
    Without a model (``checkpoint``, ``apply_ac_policy``) it begins when the budget's
    first region of the forward enters. It ends when that backward pass completes.
    ``peak=N`` bounds the rank's peak allocated bytes during the step. On CUDA, N is
    absolute (``memory_allocated()`` when the step began plus the peak above it: the scale
    of ``torch.cuda.max_memory_allocated``); on CPU, where torch exposes no
    allocated-bytes counter, N bounds the peak above what was allocated when the step
    began (``memory.track``'s peak forward and peak backward) plus ``cpu_origin``: 0, or a
    plan file's simulated start (Note [A plan file is the planner's state] in
    _plan/_plan_file.py), making N absolute as on CUDA. Everything counts: the blocks' saved and
    recomputed values, gradients, FSDP's unsharded parameters and prefetches, the replay
    working set, the loss and its backward.

How a plan's peak is predicted and solved for is Note [The peak model] in
_peak_model.py; a measured step is a :class:`_Step` (_peak_step.py).

How a plan is verified and corrected from the measured steps is Note [Verify, correct,
stay put] in _peak_verify.py.

Note [A profiler session of the user's]
    On CPU a step is measured from a profiler session's memory events (torch exposes no
    allocated-bytes counter there) and two sessions cannot run at once. A session ac2 did
    not start that is running when a step begins (the user's ``torch.profiler``) cannot be
    read, so the planner waits for it: the step is not measured, the plan stays as it is,
    the wait does not count towards ``_UNMEASURED`` (the planner measures at the first
    step that begins after the session ended), and it warns once saying so and what to do.
    ``memory.track``'s session is read instead (Note [One trace, two readers]). On CUDA no
    profiler session is used (Note [Measuring a CUDA step without a profiler]), so a
    user's profiler changes nothing there.

Note [The step's device]
    The planner measures on the device its blocks compute on (Note [The device comes from
    the tensors] in _device.py): the device the first region of a step decided when it
    entered (a checkpointed module's or a function region's); a step begun at the model's
    forward, the one earlier steps' regions decided (step 1: the one of the model's
    arguments and tensors, ``device_of``). A ``with apply_ac_policy(...)`` block decides
    only when it exits; a step that begins with one is measured on the device an earlier
    step's regions decided, and the first such step is not measured.

The sync round of every step start is Note [One plan on every rank] in _peak_step.py.

A pipeline stage's planner: Note [A pipeline rank's plan is followed as simulated] in
_peak_pipeline.py.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from functools import partial
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .._device import device_of
from .._measure._alloc import AllocationTrace, active_trace
from .._measure._alloc_history import AllocatorHistory
from .._pipelining import in_pipeline_stage
from .._pipelining import pipeline_microbatch as _pipeline_microbatch
from .._sizes import human_bytes as _human
from ._block_problem import BlockBudget, Plan, _Option, _Problem
from ._late_buffers import late_collective_bytes
from ._peak_model import _solve, _solve_from, block_of
from ._peak_offload import remember_schedule
from ._peak_pipeline import at_the_floor, follow, outside
from ._peak_report import describe
from ._peak_step import _Call, _Record, _Step, _watch_model
from ._peak_verify import _FOREIGN_PROFILER, use

__all__ = ["PeakPlanner"]

_HISTORY = 64  # measured steps describe() lists
_MAX_CALLS = 4096  # regions per step the planner follows
_MAX_SUBS = 512  # sub-segment marks per block's backward (Note [A block's backward, replay by replay])
_OVERLAP = ("forwards and backwards of several steps interleaved (microbatches in flight, as under a "
            "pipeline schedule, or a forward without its backward)")


class PlannerOwner(BlockBudget, Protocol):
    """What a :class:`PeakPlanner` reads of the budget that owns it (a
    ``MemoryBudget(peak=...)``), beside what a block problem reads of it."""

    _strict: bool  # a target below the measured floor raises instead of warning
    _offload_block_inputs: bool  # below the floor, the blocks' inputs may go to host memory

    def _set_plans(self, plans: dict[str, Plan]) -> None:
        """The plans the modules' next calls follow (fqn -> plan)."""
        ...


class PeakPlanner:
    """The global plan of one ``MemoryBudget(peak=...)`` (Notes above); owned by the budget."""

    def __init__(self, budget: PlannerOwner, target: int) -> None:
        self.budget = budget
        self.target = target  # bytes on this rank (Note [What a peak target bounds])
        self.lock = threading.RLock()
        self.step: _Step | None = None
        self.steps = 0
        self.problems: dict[tuple, _Problem] = {}  # structure -> its calibration's problem
        self._options: dict[tuple, list[_Option]] = {}
        self.structure: list[_Call] | None = None  # the calls of the step the plan is for
        self.choice: tuple[int, ...] | None = None  # option index per call (None: the floor)
        self.bases: dict[str, int] | None = None
        self.base_abs = 0
        self.cpu_origin = 0  # on CPU, taken as allocated when a step begins (Note [What a peak target bounds])
        self.floor_peak: int | None = None  # measured peak of the first measured (floor) step
        self.predicted: int | None = None
        self.measured: int | None = None  # of the latest measured step the planner used
        self.last_seen: int | None = None  # of the latest step traced on this rank (reports)
        self.tried: list[tuple[float, tuple[int, ...] | None, int]] = []  # (cost, choice, measured)
        self.planned_steps = 0  # planned steps measured
        self.state = "floor"  # floor -> planned -> settled
        self.reason = ""  # why it settled (or stays at the floor)
        self.history: list[_Record] = []
        self._ready: list[_Step] = []
        self.guard: dict[str, int] = {}  # per segment, the highest base a step over the target implied
        self.all_settled = False  # every rank settled (the last sync said so): no more collectives
        self.unmeasured = 0  # synced rounds in a row without a usable step
        self.device: torch.device | None = None  # the blocks' device (Note [The step's device])
        self._warned: set[str] = set()
        self._models: list[weakref.ref[torch.nn.Module]] = []  # watched models (:meth:`watch`)
        self.offload: weakref.ref | None = None  # the blocks' Offload (Note [Below the floor, the block inputs go first])
        self._error: str | None = None
        # bytes gloo may hold late, kept clear of the target (Note [Collective buffers gloo frees late]);
        # None until the first step is used
        self.late: int | None = None
        # a plan file's pipeline rank, whose plan is followed as it is (Note [A pipeline
        # rank's plan is followed as simulated] in _peak_pipeline.py); None otherwise
        self.stage_plan: dict[str, Any] | None = None

    # ---- steps ------------------------------------------------------------------------
    def before_region(self, fqn: str) -> str:
        """A region of the budget is about to start (before its policy picks a plan).
        Returns the key its plan is kept under: ``fqn``, or for an anonymous region (a
        drop-in ``checkpoint(fn)`` call, fqn ``""``) its position among the step's
        anonymous calls (``""``, ``"[1]"``, ``"[2]"``, ...)."""
        with self.lock:
            step = self.step
            if step is not None and step.ended:
                self._close(step)  # also before a no-grad forward: an eval loop is not traced
                step = None
            if not torch.is_grad_enabled():  # records nothing: not part of a step
                return fqn
            if self._error is not None:
                raise RuntimeError(self._error)
            if self.state == "pipelined":
                if self.stage_plan is not None and not in_pipeline_stage():
                    raise RuntimeError(outside(self, fqn))
                return fqn
            if step is not None:
                if not step.backward and fqn and any(c.fqn == fqn for c in step.calls):
                    step.problem = step.problem or _OVERLAP
                    self._close(step)
                elif step.backward:  # a forward while the step's backward is still running
                    step.problem = step.problem or _OVERLAP
                    return self._key(step, fqn)
                else:
                    return self._key(step, fqn)  # the step's next block
            if _pipeline_microbatch() is not None:  # checked before any collective, at every step start
                self._pipelined()
                return fqn
            self._update()
            if self._error is not None:
                raise RuntimeError(self._error)
            self._begin()
            return self._key(self.step, fqn)

    def watch(self, model: torch.nn.Module) -> None:
        """Begin steps at ``model``'s forward (``apply_ac(model, budget)`` calls this):
        Note [What a peak target bounds]."""
        with self.lock:
            if any(ref() is model for ref in self._models):
                return
            self._models.append(weakref.ref(model))
        _watch_model(self.model_forward, model)

    def model_forward(self, model: torch.nn.Module, args: Any) -> None:
        """A watched model's forward begins: under grad and with no step open, a step
        begins here, measured from now (Note [What a peak target bounds]); else the
        step's first region decides, as without a watched model."""
        if not torch.is_grad_enabled():
            return
        with self.lock:
            step = self.step
            if step is not None and step.ended:
                self._close(step)
                step = None
            if step is not None or self.state == "pipelined" or self._error is not None:
                return  # the regions see to it (an open step, a refused target)
            device = self.device or device_of(args, module=model)  # Note [The step's device]
            if _pipeline_microbatch() is not None:
                return
            self._update()
            if self._error is not None:
                raise RuntimeError(self._error)
            self._begin()
            step = self.step
            step.at_model = True
            self._measure(step, device, active_trace() is not None)
            step.mark("start")

    def _pipelined(self) -> None:
        """A pipeline stage's steps interleave (Note [Verify, correct, stay put] in
        _peak_verify.py): the planner measures nothing and issues no collective (stages
        reach a step's first region at different times)."""
        self.close()  # a step begun outside the schedule (e.g. the stage's shape inference)
        at_the_floor(self)

    def follow_stage_plan(self, stage: dict[str, Any], predicted: int) -> None:
        """Follow the installed plan file's plan of a pipeline rank as it is (Note [A
        pipeline rank's plan is followed as simulated] in _peak_pipeline.py); ``stage``:
        the file's pipeline."""
        follow(self, stage, predicted)

    @staticmethod
    def _key(step: _Step | None, fqn: str) -> str:
        if fqn or step is None or step.anonymous >= _MAX_CALLS:
            return fqn
        n = step.anonymous
        step.anonymous = n + 1
        return f"[{n}]" if n else ""

    def _begin(self) -> None:
        """A step begins; it is measured from its first region's entry (``_measure``),
        when that region's device is known (Note [The step's device])."""
        index = self.steps
        self.steps += 1
        step = _Step(index, f"{id(self):x}:{index}:")
        step.choice = self.choice
        self.step = step

    def _measure(self, step: _Step, device: torch.device | None, tracked: bool) -> None:
        """Start measuring ``step`` on ``device`` (its first region's; ``None``: not known
        yet). ``tracked``: a ``memory.track`` runs (its report shows the measured peak)."""
        if device is not None:
            self.device = device
        device = self.device
        if device is None:
            step.problem = step.problem or ("its device was not known when it began (a `with apply_ac_policy(...)` "
                                            "block decides it when it exits); the next step is measured")
            return
        if device.type == "cuda":  # Note [Measuring a CUDA step without a profiler]
            step.base_abs = torch.cuda.memory_allocated(device)
            if self.state == "settled" and not tracked:
                return
            meter = AllocatorHistory(device)
            try:
                with _disable_current_modes():
                    meter.__enter__()
            except Exception as e:  # a step that cannot be measured changes nothing (Note [Verify, correct, stay put])
                step.problem = step.problem or f"the allocator's memory history could not be read ({e})"
                return
            meter.on_exit.append(partial(self._collect, step))
            step.trace, step.own_trace = meter, True
            return
        step.base_abs = self.cpu_origin  # Note [What a peak target bounds]
        trace = active_trace()
        if trace is not None:  # Note [One trace, two readers]
            step.trace = trace
            trace.on_exit.append(partial(self._collect, step))
        elif self.state != "settled":
            if torch._C._autograd._profiler_enabled():  # Note [A profiler session of the user's]
                step.problem = _FOREIGN_PROFILER
                self._warn_once("profiler", (
                    f"ac2_dist.MemoryBudget(peak={_human(self.target)}): a torch.profiler session that ac2 did not "
                    f"start is running; on CPU the planner measures a step from a profiler session of its own and "
                    f"two cannot run at once, so it keeps its current plan ({self._describe_choice()}) and measures "
                    f"at the first step that begins after your session ends. To plan first, start profiling once "
                    f"budget.describe() says 'settled' (within 5 steps), or read memory with "
                    f"ac2_dist.memory.track(...), whose session the planner shares"))
            else:
                trace = AllocationTrace("cpu")
                trace.preempt = partial(self._preempt, step)
                with _disable_current_modes():
                    trace.__enter__()
                trace.on_exit.append(partial(self._collect, step))
                step.trace, step.own_trace = trace, True

    def enter(self, region: Any, graph: Any) -> None:
        """``region`` (a _BudgetRegion) entered with ``graph`` (its outermost region's)."""
        if graph.frames and graph.frames[0].fn is not region:
            self.close()
            raise ValueError(
                f"ac2_dist.MemoryBudget(peak=...): the module {region.fqn or '(region)'} runs inside another "
                f"ac2 region; a peak target plans per outermost checkpointed module. Apply the budget to the "
                f"outermost modules, or use MemoryBudget(fraction) / MemoryBudget(bytes=...) for nested ones")
        with self.lock:
            step = self.step
            if step is None:
                return
            plan = region.plan
            k = len(step.calls)
            if k == 0 and not step.at_model:  # its first region: the device is known now (Note [The step's device])
                self._measure(step, getattr(graph, "device", None), graph.tracker is not None)
            if k >= _MAX_CALLS:
                step.problem = step.problem or f"more than {_MAX_CALLS} checkpointed regions in one step"
                return
            step.calls.append(_Call(region.fqn, plan.saved_bytes - plan.floor_bytes if plan is not None else 0,
                                    plan.signature if plan is not None else None))
            if any(c.fqn == region.fqn for c in step.calls[:-1]):
                step.problem = step.problem or f"the module {region.fqn} ran twice in one step"
            step.mark(f"fwd:{k}")
            remember_schedule(self, graph)
        graph.on_backward = partial(self._backward, step, k)
        if self.state == "planned" and plan is not None and not self.late:  # Note [A block's backward, replay by replay]
            region.seq_calls = step.calls[k].seq_calls = {}
            graph.on_replay = partial(self._replayed, step, k)
        region.peak_call = (step, k)

    def exit(self, region: Any) -> None:
        """``region`` exited: its structure is known now."""
        where = getattr(region, "peak_call", None)
        if where is None:
            return
        step, k = where
        plan = region.plan
        graph = getattr(region, "graph", None)
        device = getattr(graph, "device", None)
        with self.lock:
            if device is not None:  # decided by now, a `with` block's too (Note [The step's device])
                self.device = device
            call = step.calls[k]
            if region.problem_signature is not None:  # it calibrated: the floor, nothing kept
                call.signature, call.dk = region.problem_signature, 0
            elif plan is not None and not region.diverged:  # it followed ``plan`` (maybe switched to it)
                call.signature, call.dk = plan.signature, plan.saved_bytes - plan.floor_bytes
            else:
                step.problem = step.problem or f"the module {region.fqn} did not follow a plan to its end"

    def _backward(self, step: _Step, k: int, graph: Any) -> None:
        with self.lock:
            current = self.step
            if current is not None and current is not step:  # an earlier step's backward runs in this one
                current.problem = current.problem or _OVERLAP
            step.mark(f"bwd:{k}")
            if step.backward:
                return
            step.backward = True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(partial(self._end, step))
        except RuntimeError:  # unpacked outside a backward pass
            with self.lock:
                step.problem = step.problem or "its saved values were read outside a backward pass"

    def _replayed(self, step: _Step, k: int, graph: Any, nodes: list) -> None:
        """Block ``k``'s graph replayed ``nodes``: remember what it made and, once its backward
        has begun, mark a sub-segment (Note [A block's backward, replay by replay] in _peak_model.py)."""
        with self.lock:
            if k >= len(step.calls) or step.ended:
                return
            calls = step.calls[k].seq_calls
            if calls is None:
                return
            now = step.made_now.setdefault(k, set())
            now.update(calls[n.seq] for n in nodes if n.seq in calls)
            marks = step.made.setdefault(k, [])
            if graph.on_backward is None and len(marks) < _MAX_SUBS:  # its backward began (the mark fired)
                marks.append(frozenset(now))
                step.mark(f"bwd:{k}/{len(marks)}")

    def _collect(self, step: _Step, trace: AllocationTrace) -> None:
        step.collect(trace)
        if step.peaks and step.problem is None:
            self.last_seen = max(step.peaks.values()) + step.base_abs

    def _end(self, step: _Step) -> None:
        with self.lock:
            step.mark("end")
            step.ended = True

    def _close(self, step: _Step) -> None:
        """Stop the step's own trace (its figures arrive through ``on_exit``; Note [One
        trace, two readers] in _alloc.py) and queue the step for :meth:`_update`."""
        self._stop(step)
        if self.step is step:
            self.step = None
        self._ready.append(step)

    def _stop(self, step: _Step) -> None:
        if step.own_trace and step.trace is not None:
            trace, step.trace = step.trace, None
            trace.preempt = None
            with _disable_current_modes():
                trace.__exit__(None, None, None)

    def close(self) -> None:
        """Stop measuring the open step (its trace stops; the step is not used)."""
        with self.lock:
            step = self.step
            if step is not None:
                step.problem = step.problem or "measuring was stopped (MemoryBudget.close)"
                self._stop(step)
                self.step = None

    def _preempt(self, step: _Step) -> None:
        """Another trace starts while the step's own one runs: stop ours now."""
        with self.lock:
            self._stop(step)

    # ---- measured steps -----------------------------------------------------------------
    def _update(self) -> None:
        """Use the latest step measured since the last call (Note [Verify, correct, stay
        put]). Until every rank has settled, every rank syncs exactly once here per step
        start, whatever it has to offer (Note [One plan on every rank] in _peak_step.py)."""
        ready, self._ready = self._ready, []
        waiting = [s for s in ready if s.trace is not None and not s.own_trace and s.peaks is None
                   and s.problem is None]  # someone else's trace still runs: read it later
        self._ready = waiting
        done = [s for s in ready if s not in waiting]
        step = done[-1] if done else None
        if self.steps == 0 or self.all_settled:  # nothing measured anywhere yet, or no more syncing
            if step is not None:
                self._report_only(step)
            return
        use(self, step)

    def _report_only(self, step: _Step) -> None:
        """A settled planner records what a traced step measured (reports), nothing else."""
        if step.peaks is not None and step.problem is None:
            self.measured = max(step.peaks.values()) + step.base_abs
            self._remember(_Record(step.index, self._describe_choice(), self.predicted, self.measured,
                                   "over the target" if self.measured > self.target else ""))

    @property
    def planned_target(self) -> int:
        """The target plans are made and measured against: the target less the collective
        buffers gloo may hold late (Note [Collective buffers gloo frees late])."""
        return self.target - (self.late or 0)

    def _late_bytes(self, device: torch.device | None) -> int:
        if device is not None and device.type != "cpu":
            return 0
        return late_collective_bytes(m for ref in self._models if (model := ref()) is not None
                                     for m in model.modules())

    def _remember(self, record: _Record) -> None:
        self.history.append(record)
        if len(self.history) > _HISTORY:
            del self.history[1:2]  # keep the floor step and the latest ones

    def _settle(self, reason: str) -> None:
        self.state = "settled"
        self.reason = reason

    def _infeasible(self, floor: int) -> None:
        self.state = "settled"
        self.reason = "the target is below the measured floor"
        late = self.late or 0
        above = (f"above the target of {self.target} bytes" if not late else
                 f"above the target of {self.target} bytes less the {late} bytes of collective buffers gloo may "
                 f"hold past their wait")
        msg = (f"ac2_dist.MemoryBudget(peak={_human(self.target)}): the measured peak of a step at the floor "
               f"(\"recompute_all\" in every block) is {_human(floor)} ({floor} bytes) on this rank, {above}. "
               f"To fit: raise the target to at least {floor + late} bytes, shard more (FSDP), "
               f"lower the batch size or sequence length, or offload saved values to CPU (ac2_dist.Offload)")
        if self.budget._strict:
            self._error = msg + ". (strict=True: stopping here.)"
            return
        self._warn_once("infeasible", msg + "; running at the floor (pass strict=True to make this an error)")

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, RuntimeWarning, stacklevel=4)

    # ---- planning -----------------------------------------------------------------------
    def options(self, signature: tuple) -> list[_Option]:
        """The Pareto frontier of a block structure's saved sets: the choices where no other
        saves less memory at no more recompute cost."""
        # See Note [The peak model] in _peak_model.py.
        opts = self._options.get(signature)
        if opts is None:
            opts = self._options[signature] = self.problems[signature].frontier()
        return opts

    def _plan(self, measured: tuple[tuple[int, ...] | None, dict[str, int], dict[int, list[frozenset[int]]]] | None
              = None) -> None:
        """The next plan: from the bases, or from a measured plan under the target, its step's
        peaks and what its blocks' replays had made at their sub-segments."""
        calls = self.structure or []
        if not calls or any(c.signature not in self.problems for c in calls):
            self.choice = None
            self._install(None)
            return
        options = [self.options(c.signature) for c in calls]
        # a corrected plan keeps the largest candidate output free (Note [Verify, correct, stay put]),
        # unless it replays nothing the measured plan did not (Note [A climb that replays nothing new])
        margin = 0 if self.planned_steps == 0 else max(
            (p.records[s].nbytes for p in (self.problems[c.signature] for c in calls) for s in p.candidates), default=0)
        cap = self.planned_target - self.base_abs
        if measured is None:
            choice = _solve(options, self.bases or {}, cap - margin)
        else:
            choice, self.bases = _solve_from(options, [self.problems[c.signature] for c in calls], *measured[:2], cap,
                                             margin, made=measured[2])
        if choice is not None and all(i == 0 for i in choice):
            choice = None
        self._install(choice)

    def _install(self, choice: tuple[int, ...] | None) -> None:
        """Make ``choice`` the plan every block's next call follows."""
        self.choice = choice
        calls = self.structure or []
        plans = {}
        for k, c in enumerate(calls):
            if c.signature is None or c.signature not in self.problems:
                continue
            opt = self.options(c.signature)[choice[k] if choice is not None else 0]
            plans[c.fqn] = self.problems[c.signature].make_plan(self.budget, opt.saved)
        self.budget._set_plans(plans)
        self.predicted = self._predict(choice)

    def _dks(self, choice: tuple[int, ...] | None) -> list[int]:
        calls = self.structure or []
        if choice is None:
            return [0] * len(calls)
        return [self.options(c.signature)[i].dk for c, i in zip(calls, choice)]

    def _predict(self, choice: tuple[int, ...] | None) -> int | None:
        if self.bases is None:
            return None
        dks = self._dks(choice)
        return self.base_abs + max(
            base + sum(dks[:block_of(s) + 1]) for s, base in self.bases.items())

    def _cost(self, choice: tuple[int, ...] | None) -> float:
        if choice is None:
            return sum(self.options(c.signature)[0].seconds for c in self.structure or [])
        return sum(self.options(c.signature)[i].seconds for c, i in zip(self.structure or [], choice))

    def _is_top(self, choice: tuple[int, ...] | None) -> bool:
        calls = self.structure or []
        if choice is None:
            return all(len(self.options(c.signature)) == 1 for c in calls)
        return all(i == len(self.options(c.signature)) - 1 for c, i in zip(calls, choice))

    def recompute(self) -> tuple[float, int]:
        """(estimated seconds, FLOPs) the current plan recomputes per step."""
        calls = self.structure or []
        if not calls:
            return 0.0, 0
        idx = self.choice or (0,) * len(calls)
        opts = [self.options(c.signature)[i] for c, i in zip(calls, idx)]
        return sum(o.seconds for o in opts), sum(o.flops for o in opts)

    # ---- what the user sees -------------------------------------------------------------
    def _describe_choice(self, choice: Any = "current") -> str:
        choice = self.choice if choice == "current" else choice
        if choice is None:
            return "floor"
        return f"saves {_human(sum(self._dks(choice)))} above the floor"

    def describe(self) -> str:
        """Target, floor, predicted and measured peak, and the history of measured steps."""
        return describe(self)
