"""The cost of recording: per-op forward and backward cost of each checkpointing mode.

One region holding a chain of tiny ops (``tanh`` then ``mul`` by a weight, 16-element
tensors by default: the per-op Python cost dominates), at 1k, 4k, 16k and 64k ops, one thread.
Modes, interleaved in one process (every mode at every size once per round, so machine
drift hits all alike, the growth with size included; medians over the rounds):

- ``eager``: no checkpointing;
- ``torch-full``: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``;
- ``torch-sac``: the same with ``create_selective_checkpoint_contexts([aten.mul.Tensor])``;
- ``ac2-full``: ``ac2_dist.apply_ac_policy("recompute_all")``;
- ``ac2-save``: ``ac2_dist.apply_ac_policy([aten.mul.Tensor])`` (the same save list);
- ``noop-mode``: a Python ``TorchDispatchMode`` whose ``__torch_dispatch__`` only calls
  ``func`` -- the floor any Python dispatch mode pays (forward; its backward is eager's);
- ``noop-mode-noshim``: the same mode without torch's per-call dynamo-disable shim
  (``_should_skip_dynamo() -> False``, what ac2's tracer does);
- ``noop-mode+hooks``: the no-op mode plus identity saved-tensor hooks
  (``saved_tensors_hooks(lambda t: t, lambda t: t)``): the floor of any checkpointing that
  records with a dispatch mode and hands autograd its own saved objects, as ac2 does
  (torch's checkpoint installs such hooks too; the no-op mode alone has none).
- ``ac2-full-py``: ``ac2-full`` recorded by the Python recorder (what an install without a
  C compiler records with; Note [The plain-op path in C] in ``ac2_dist/_trace/_crecord.c``);
- ``record-floor``: the least any tracer that records ops for a later replay does per op,
  in Python, on top of the no-op mode (no shim): one tuple per op holding the op and its
  tensor arguments' producers (found in an ``id``-keyed map of weak references), one map
  entry per output, and saved-tensor hooks whose pack looks the tensor's producer up.
  No use counts, policy, version or side-effect checks; its pack also keeps the tensor,
  so its backward is eager's (a reference for the *forward* only). The ratio of
  ``ac2-full``'s forward to it is what ac2 adds to that minimum.

Printed: microseconds per op (forward, backward; medians over rounds), the ratios of ac2's
forward to the no-op mode's (both floors), to the record floor and to torch's, of ac2's
backward to torch's, the growth of the forward cost per op from 1k ops to the largest size
(every ratio is the median over rounds of the two figures' ratio in the same round), and the Python heap kept per recorded
op (``tracemalloc``, the graph of one ``ac2-full`` / ``ac2-save`` forward still alive), and,
as a diagnostic, ``ac2-full``'s forward with the cyclic garbage collector paused during the
timed forward (what the growth with region length is made of). Each timed step starts after
a collection; a second diagnostic (``--loop-ops``, 0 to skip) runs steps back to back as a
training loop does and reports the time the collector takes per op during forwards and the
full collections (objects a step keeps until its backward age into the oldest generation).

With ``--baseline DIR`` (a checkout of another ac2_dist revision, e.g. made by ``git
worktree add /tmp/base <rev>``), that revision's package is imported beside this one (as
``ac2_baseline``) and measured in the same rounds as ``base-full`` and ``base-save``: the
printed ``this / baseline`` ratios are paired per round, so machine drift cancels.

    python launch/bench_tracer.py                      # 1k 4k 16k 64k ops, 5 rounds
    python launch/bench_tracer.py --sizes 1000 4000 --rounds 3
    python launch/bench_tracer.py --baseline /tmp/base # and the revision checked out there

With ``--instructions`` the same modes are measured in CPU instructions instead of time,
under ``valgrind --tool=callgrind`` (needs valgrind): one process per (mode, size,
phase), the measured forward (or backward) run through ``operator.call`` and only that
call counted (``--toggle-collect=_operator_call``), after two warm-up steps. Counts are
deterministic (the same code gives the same figure to within a few hundred instructions
per op, whatever else the machine runs), so ratios of a few percent are visible where
timings on a shared machine move by 20 %. They are a proxy, not a time: a cache miss or a
syscall counts as one instruction. The garbage collector's work inside the measured call
is included.

    python launch/bench_tracer.py --instructions --sizes 1000 4000 --jobs 2

``--numel N --scale S`` changes the chain to ``tanh(h) * S`` (a Python number, ``mul`` saves
nothing: one saved tensor per two ops) on ``N``-element tensors; ``--numel 64 --scale 1.0001``
is the chain issue 44 measured ac2's backward per op on (every op replayed, half as many unpacks
as the weight chain's).

    python launch/bench_tracer.py --instructions --sizes 4000 --phases bwd --modes ac2-full torch-full \
        --numel 64 --scale 1.0001 --jobs 2
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib
import json
import operator
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import ac2_dist as ac
from ac2_dist._trace._tracer import recording_in_python

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_tracer_report import _ratio, _size, paired, report_instructions, report_loop  # noqa: E402

aten = torch.ops.aten
SAVE = [aten.mul.Tensor]
MODES = [
    "eager", "torch-full", "torch-sac", "ac2-full", "ac2-save", "noop-mode", "noop-mode-noshim", "noop-mode+hooks",
    "record-floor", "ac2-full-py",
]


class NoopMode(TorchDispatchMode):
    """A dispatch mode that does nothing: the floor of any Python dispatch mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class BareNoopMode(NoopMode):
    """The no-op mode without torch's per-call dynamo-disable shim."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class _Entry(weakref.ref):
    __slots__ = ("producer",)


class RecordFloor(BareNoopMode):
    """``record-floor``: what a recording tracer cannot avoid per op (see the module
    docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.map: dict[int, _Entry] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        get = self.map.get
        inputs: tuple = ()
        for a in args:
            if isinstance(a, torch.Tensor):
                e = get(id(a))
                inputs += (e.producer if e is not None and e() is a else None,)
        e = _Entry(out)
        e.producer = (func, inputs)
        self.map[id(out)] = e
        return out

    def pack(self, t: torch.Tensor) -> tuple:
        e = self.map.get(id(t))
        return (e.producer if e is not None and e() is t else None, t)


def _unpack_floor(packed: tuple) -> torch.Tensor:
    return packed[1]


@dataclasses.dataclass(frozen=True)
class Chain:
    """The chain's shape: ``numel``-element tensors; ``tanh`` then ``mul`` by the weight
    ``w`` (``scale`` None: ``mul`` saves both operands) or by the Python number ``scale``
    (``tanh(x) * 1.0001``: ``mul`` saves nothing, one saved tensor per two ops)."""

    numel: int = 16
    scale: float | None = None

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(self.numel, requires_grad=True), torch.randn(self.numel, requires_grad=True)


def chain(x: torch.Tensor, w: torch.Tensor, n_ops: int, scale: float | None = None) -> torch.Tensor:
    h = x
    if scale is not None:
        for _ in range(n_ops // 2):
            h = torch.tanh(h) * scale
        return h
    for _ in range(n_ops // 2):
        h = torch.tanh(h) * w
    return h


def forward_fn(mode: str, n_ops: int, spec: Chain = Chain()) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``fn(x, w) -> out``: ``n_ops`` ATen ops recorded the way ``mode`` records them."""
    run = functools.partial(chain, n_ops=n_ops, scale=spec.scale)
    if mode == "eager":
        return run
    if mode == "torch-full":
        return lambda x, w: checkpoint(run, x, w, use_reentrant=False)
    if mode == "torch-sac":
        ctx = functools.partial(create_selective_checkpoint_contexts, SAVE)
        return lambda x, w: checkpoint(run, x, w, use_reentrant=False, context_fn=ctx)
    if mode in ("ac2-full", "ac2-save", "base-full", "base-save"):
        policy: Any = "recompute_all" if mode.endswith("-full") else SAVE
        pkg = ac if mode.startswith("ac2") else importlib.import_module("ac2_baseline")

        def region(x, w):
            with pkg.apply_ac_policy(policy):
                return run(x, w)
        return region
    if mode == "ac2-full-py":
        def region_in_python(x, w):
            with recording_in_python(), ac.apply_ac_policy("recompute_all"):
                return run(x, w)
        return region_in_python
    if mode in ("noop-mode", "noop-mode-noshim"):
        cls = NoopMode if mode == "noop-mode" else BareNoopMode

        def in_mode(x, w):
            with cls():
                return run(x, w)
        return in_mode
    if mode == "noop-mode+hooks":
        def in_mode_with_hooks(x, w):
            with NoopMode(), torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
                return run(x, w)
        return in_mode_with_hooks
    if mode == "record-floor":
        def recorded(x, w):
            rec = RecordFloor()
            with rec, torch.autograd.graph.saved_tensors_hooks(rec.pack, _unpack_floor):
                return run(x, w)
        return recorded
    raise ValueError(mode)


def one_step(fn: Callable, x: torch.Tensor, w: torch.Tensor) -> tuple[float, float]:
    """Seconds of forward and of backward of one step (after a collection, untimed: no
    mode pays for garbage another one left)."""
    x.grad = w.grad = None
    gc.collect()
    t0 = time.perf_counter()
    out = fn(x, w)
    t1 = time.perf_counter()
    out.sum().backward()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def measure(
    sizes: list[int], rounds: int, warmup: int, modes: list[str], spec: Chain = Chain(),
) -> dict[int, dict[str, dict]]:
    """Every (size, mode) once per round, interleaved: machine drift during the run hits
    every size alike, so the growth from 1k to 64k ops is not a drift between sizes."""
    x, w = spec.inputs()
    fns = {(n, m): forward_fn(m, n, spec) for n in sizes for m in modes}
    for _ in range(warmup):
        for fn in fns.values():
            one_step(fn, x, w)
    times: dict[tuple[int, str], tuple[list[float], list[float]]] = {k: ([], []) for k in fns}
    grads: dict[tuple[int, str], torch.Tensor] = {}
    for _ in range(rounds):
        for k, fn in fns.items():
            f, b = one_step(fn, x, w)
            times[k][0].append(f)
            times[k][1].append(b)
            grads[k] = x.grad.clone()
    for (n, m), g in grads.items():  # every mode computes the same gradient
        if not torch.equal(g, grads[n, "eager"]):
            raise AssertionError(f"{m}: gradient differs from eager's at {n} ops")
    return {
        n: {
            m: {"fwd_us": statistics.median(times[n, m][0]) / n * 1e6,
                "bwd_us": statistics.median(times[n, m][1]) / n * 1e6,
                "fwd_s": times[n, m][0], "bwd_s": times[n, m][1]}
            for m in modes
        }
        for n in sizes
    }


def heap_per_op(n_ops: int, policy: Any, pkg: Any = ac, spec: Chain = Chain()) -> float:
    """Python heap (tracemalloc) kept per recorded op by one region's forward."""
    x, w = spec.inputs()
    run = functools.partial(chain, n_ops=n_ops, scale=spec.scale)

    def region():
        with pkg.apply_ac_policy(policy):
            return run(x, w)
    region().sum().backward()  # warm caches (op facts, policy answers)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        out = region()
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del out
    return kept / n_ops


def forward_gc_paused(sizes: list[int], rounds: int, spec: Chain = Chain()) -> dict[int, float]:
    """Diagnostic: ``ac2-full`` forward us/op with the cyclic garbage collector paused
    for the timed forward only (re-enabled and run before the next one). The difference
    to the plain figure is what full collections cost; never what ac2 does by itself.
    Sizes are interleaved per round after one warm-up round, as in :func:`measure`: a
    transient slowdown (the heap measurement runs right before) moves one sample."""
    x, w = spec.inputs()
    fns = {n: forward_fn("ac2-full", n, spec) for n in sizes}
    fwd: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(rounds + 1):
        for n in sizes:
            x.grad = w.grad = None
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                y = fns[n](x, w)
                t1 = time.perf_counter()
            finally:
                gc.enable()
            y.sum().backward()
            del y
            if r:
                fwd[n].append(t1 - t0)
    return {n: statistics.median(fwd[n]) / n * 1e6 for n in sizes}


def collector_in_a_loop(
    sizes: list[int], total_ops: int, modes: tuple[str, ...], spec: Chain = Chain(),
) -> dict[str, dict[int, dict]]:
    """Diagnostic: the cyclic collector's share of a forward in a training loop. For each
    size, steps of that many ops (forward and backward) back to back until ``total_ops``
    ops ran, with no collection forced between steps (one before the first): what a
    training loop sees, where objects a step keeps into its backward age into the oldest
    generation and trigger full collections. Measured with ``gc.callbacks`` during the
    forwards: microseconds per op spent in the collector, the forward's microseconds per
    op, and the number of full (generation 2) collections."""
    x, w = spec.inputs()
    out: dict[str, dict[int, dict]] = {}
    for mode in modes:
        out[mode] = {}
        for n in sizes:
            fn = forward_fn(mode, n, spec)
            one_step(fn, x, w)  # warm caches
            spent, full, started, timing = [0.0], [0], [0.0], [False]

            def on_gc(phase: str, info: dict, spent=spent, full=full, started=started, timing=timing) -> None:
                if not timing[0]:
                    return
                if phase == "start":
                    started[0] = time.perf_counter()
                else:
                    spent[0] += time.perf_counter() - started[0]
                    full[0] += info["generation"] == 2

            steps, fwd = max(1, total_ops // n), 0.0
            gc.collect()
            gc.callbacks.append(on_gc)
            try:
                for _ in range(steps):
                    x.grad = w.grad = None
                    timing[0] = True
                    t0 = time.perf_counter()
                    y = fn(x, w)
                    fwd += time.perf_counter() - t0
                    timing[0] = False
                    y.sum().backward()
                    del y
            finally:
                gc.callbacks.remove(on_gc)
            ops = steps * n
            out[mode][n] = {"gc_us": spent[0] / ops * 1e6, "fwd_us": fwd / ops * 1e6, "full": full[0], "steps": steps}
    return out


def report(results: dict[int, dict[str, dict]], heap: dict[str, float], paused: dict[int, float]) -> str:
    lines = [
        "| ops | eager | torch full AC | torch SAC | ac2 full | ac2 save-list | no-op mode | no-op mode, no shim |"
        " no-op mode + hooks | record floor | ac2 full fwd / no-op | ac2 full fwd / no-op + hooks |"
        " record floor / no-op | ac2 full fwd / record floor | ac2 full fwd / torch full |"
        " ac2 full bwd / torch full | ac2 save-list fwd, bwd / torch SAC | ac2 full, Python recorder |"
        " ac2 full fwd, Python recorder / no-op |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, r in results.items():
        cells = [f"{r[m]['fwd_us']:.1f} / {r[m]['bwd_us']:.1f}" for m in MODES[:5]]
        cells += [f"{r[m]['fwd_us']:.1f}" for m in MODES[5:7]]
        cells += [f"{r['noop-mode+hooks']['fwd_us']:.1f} / {r['noop-mode+hooks']['bwd_us']:.1f}"]
        cells += [f"{r['record-floor']['fwd_us']:.1f}"]
        cells += [
            _ratio(r, "ac2-full", "noop-mode"),
            _ratio(r, "ac2-full", "noop-mode+hooks"),
            _ratio(r, "record-floor", "noop-mode"),
            _ratio(r, "ac2-full", "record-floor"),
            _ratio(r, "ac2-full", "torch-full"),
            _ratio(r, "ac2-full", "torch-full", "bwd"),
            f"{_ratio(r, 'ac2-save', 'torch-sac')}, {_ratio(r, 'ac2-save', 'torch-sac', 'bwd')}",
            f"{r['ac2-full-py']['fwd_us']:.1f} / {r['ac2-full-py']['bwd_us']:.1f}",
            _ratio(r, "ac2-full-py", "noop-mode"),
        ]
        lines.append(f"| {_size(n)} | " + " | ".join(cells) + " |")
    sizes = list(results)
    first, last = sizes[0], sizes[-1]
    lines.append("")
    for m in ("ac2-full", "ac2-save", "torch-full", "torch-sac", "noop-mode", "record-floor", "ac2-full-py"):
        growth = statistics.median(
            (a / last) / (b / first) for a, b in zip(results[last][m]["fwd_s"], results[first][m]["fwd_s"])
        )
        lines.append(f"{m}: forward per op at {_size(last)} ops / at {_size(first)}: {growth:.2f}")
    lines.append("ac2-full forward per op, cyclic GC paused during the forward (diagnostic): "
                 + ", ".join(f"{_size(n)} {v:.1f} us" for n, v in paused.items())
                 + f"; {_size(last)} / {_size(first)}: {paused[last] / paused[first]:.2f}")
    for m, b in heap.items():
        lines.append(f"Python heap kept per recorded op ({m}, tracemalloc): {b:.0f} B")
    return "\n".join(lines)


def import_baseline(checkout: str) -> None:
    """Make another revision's ``ac2_dist`` (``checkout``/ac2_dist) importable as
    ``ac2_baseline`` (the package imports itself relatively, so a renamed copy works)."""
    src = os.path.join(checkout, "ac2_dist")
    if not os.path.isfile(os.path.join(src, "__init__.py")):
        raise SystemExit(f"--baseline: {checkout!r} holds no ac2_dist package")
    root = tempfile.mkdtemp(prefix="ac2_baseline_")
    shutil.copytree(src, os.path.join(root, "ac2_baseline"))
    sys.path.insert(0, root)
    importlib.import_module("ac2_baseline")


#: Modes whose backward is their own (the no-op modes' and the record floor's is eager's).
_OWN_BACKWARD = ("eager", "torch-full", "torch-sac", "ac2-full", "ac2-save", "base-full", "base-save", "ac2-full-py")


def instructions_child(mode: str, n_ops: int, phase: str, go: str, spec: Chain = Chain()) -> None:
    """Run inside callgrind: two warm-up steps, then one forward (or backward) through
    ``operator.call``, the only call the parent's ``--toggle-collect`` counts. The
    process starts uninstrumented (imports at full speed); it says it is ready and waits
    for the file ``go``, which the parent makes once it switched instrumentation on."""
    torch.set_num_threads(1)
    x, w = spec.inputs()
    warm = forward_fn(mode, min(n_ops, 1000), spec)  # op facts, policy answers, specialized bytecode
    for _ in range(2):
        one_step(warm, x, w)
    fn = forward_fn(mode, n_ops, spec)
    x.grad = w.grad = None
    gc.collect()
    print(f"ready {os.getpid()}", flush=True)
    deadline = time.monotonic() + 600
    while not os.path.exists(go):  # polling: callgrind takes commands while the process runs
        if time.monotonic() > deadline:
            raise SystemExit("the parent never switched instrumentation on")
        time.sleep(0.005)
    if phase == "fwd":
        operator.call(fn, x, w)
    else:
        loss = fn(x, w).sum()
        gc.collect()
        operator.call(loss.backward)


def count_instructions(
    modes: list[str], sizes: list[int], jobs: int, baseline: str | None, phases: tuple[str, ...] = ("fwd", "bwd"),
    spec: Chain = Chain(),
) -> dict[int, dict[str, dict[str, float]]]:
    """Instructions per op of each mode's forward (and backward, where it is the mode's
    own) at each size, one callgrind process each, ``jobs`` at a time."""
    valgrind, control = shutil.which("valgrind"), shutil.which("callgrind_control")
    if valgrind is None or control is None:
        raise SystemExit("--instructions needs valgrind and callgrind_control on PATH (apt-get install valgrind)")
    tmp = tempfile.mkdtemp(prefix="ac2_callgrind_")
    runs = [(m, n, ph) for n in sizes for m in modes for ph in phases if ph == "fwd" or m in _OWN_BACKWARD]

    def one(run: tuple[str, int, str]) -> tuple[tuple[str, int, str], float]:
        m, n, ph = run
        stem = os.path.join(tmp, f"{m}.{n}.{ph}")
        cmd = [valgrind, "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               "--toggle-collect=_operator_call", f"--callgrind-out-file={stem}.out", sys.executable,
               os.path.abspath(__file__), "--instructions-child", m, str(n), ph, f"{stem}.go"]
        if baseline:
            cmd += ["--baseline", baseline]
        cmd += ["--numel", str(spec.numel)] + (["--scale", repr(spec.scale)] if spec.scale is not None else [])
        with open(f"{stem}.err", "w+") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
            try:
                line = proc.stdout.readline()
                if line.startswith("ready "):
                    subprocess.run([control, "-i", "on", line.split()[1]], capture_output=True, timeout=120,
                                   check=True)
                    open(f"{stem}.go", "w").close()
                proc.wait(timeout=3600)
            finally:
                if proc.poll() is None:
                    proc.kill()
            err.seek(0)
            log = err.read()
        found = re.search(r"Collected : (\d+)", log)
        if proc.returncode != 0 or found is None or int(found.group(1)) == 0:
            raise RuntimeError(f"callgrind run {m} {n} {ph} failed (exit {proc.returncode}):\n{log[-2000:]}")
        return run, int(found.group(1)) / n

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        counted = dict(pool.map(one, runs))
    shutil.rmtree(tmp, ignore_errors=True)
    return {n: {m: {ph: counted[m, n, ph] for ph in ("fwd", "bwd") if (m, n, ph) in counted} for m in modes}
            for n in sizes}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 4000, 16000, 64000])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--heap-ops", type=int, default=4000)
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--json", default=None)
    p.add_argument("--loop-ops", type=int, default=256000,
                   help="ops per size for the collector-in-a-loop diagnostic (0: skip it)")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="a checkout of another ac2_dist revision, measured in the same rounds")
    p.add_argument("--instructions", action="store_true",
                   help="count CPU instructions per op under callgrind instead of timing (needs valgrind)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="callgrind processes at a time")
    p.add_argument("--phases", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"],
                   help="with --instructions: what to count")
    p.add_argument("--numel", type=int, default=16, help="elements per tensor of the chain")
    p.add_argument("--scale", type=float, default=None,
                   help="multiply by this Python number instead of the weight (tanh(x) * 1.0001)")
    p.add_argument("--instructions-child", nargs=4, metavar=("MODE", "OPS", "PHASE", "GO"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    spec = Chain(args.numel, args.scale)
    if args.baseline:
        import_baseline(args.baseline)
    if args.instructions_child:
        mode, n_ops, phase, go = args.instructions_child
        instructions_child(mode, int(n_ops), phase, go, spec)
        return {}
    modes = args.modes if "eager" in args.modes else ["eager", *args.modes]
    if args.baseline:
        modes += [m for m in ("base-full", "base-save") if m not in modes]
    if args.instructions:
        counts = count_instructions(modes, args.sizes, args.jobs, args.baseline, tuple(args.phases), spec)
        print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, 1 thread; thousands of CPU instructions"
              " per op (callgrind), forward / backward")
        if args.json:  # first: a report that fails loses no measurement
            with open(args.json, "w") as f:
                json.dump({"instructions_per_op": counts}, f, indent=2)
        print(report_instructions(counts))
        return {"instructions_per_op": counts}
    results = measure(args.sizes, args.rounds, args.warmup, modes, spec)
    heap = {"ac2-full": heap_per_op(args.heap_ops, "recompute_all", spec=spec),
            "ac2-save": heap_per_op(args.heap_ops, SAVE, spec=spec)}
    paused = forward_gc_paused([args.sizes[0], args.sizes[-1]], args.rounds, spec)
    if set(MODES) <= set(modes):
        print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, 1 thread, {args.rounds} rounds;"
              " us per op, forward / backward (median over rounds)")
        print(report(results, heap, paused))
    else:
        for n, r in results.items():
            print(n, {m: (round(v["fwd_us"], 2), round(v["bwd_us"], 2)) for m, v in r.items()})
            for mode in ("ac2-full", "base-full"):
                if mode in r and "torch-full" in r:
                    print(f"  {mode} / torch-full backward (paired per round): {_ratio(r, mode, 'torch-full', 'bwd')}")
        print(heap, paused)
    if args.baseline:
        print(f"baseline ({args.baseline}): " + ", ".join(
            f"{_size(n)} full {r['base-full']['fwd_us']:.1f} / {r['base-full']['bwd_us']:.1f},"
            f" save-list {r['base-save']['fwd_us']:.1f} / {r['base-save']['bwd_us']:.1f}"
            for n, r in results.items()) + " us per op")
        for mode, base_mode in (("ac2-full", "base-full"), ("ac2-save", "base-save")):
            if mode in modes:
                print(paired(results, mode, base_mode))
        if "noop-mode" in modes:
            print("base-full forward / no-op mode: " + ", ".join(
                f"{_size(n)} {r['base-full']['fwd_us'] / r['noop-mode']['fwd_us']:.2f}" for n, r in results.items()))
        base = importlib.import_module("ac2_baseline")
        for name, policy in (("base-full", "recompute_all"), ("base-save", SAVE)):
            heap[name] = heap_per_op(args.heap_ops, policy, base, spec)
            print(f"Python heap kept per recorded op ({name}, tracemalloc): {heap[name]:.0f} B")
    out = {"results": results, "heap_per_op": heap, "ac2_full_fwd_us_gc_paused": paused}
    if args.loop_ops:
        loop_modes = tuple(m for m in ("ac2-full", "ac2-full-py", "noop-mode") if m in modes)
        out["collector_in_a_loop"] = collector_in_a_loop(args.sizes, args.loop_ops, loop_modes, spec)
        print(report_loop(out["collector_in_a_loop"], args.loop_ops))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
