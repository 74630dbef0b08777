"""One command for a GPU session: measure every GPU claim of ac2_dist, check what must hold.

On the device machine (one GPU; the artefacts come back from ``$OUT``)::

    pip install --no-deps --no-build-isolation -e . && PYTHONUNBUFFERED=1 timeout 480 python launch/gpu_check.py --out "$OUT"

On CPU (CI, tests/test_gpu_check.py)::

    python launch/gpu_check.py --device cpu --smoke --out out/gpu_check   # every default section, tiny sizes

By default it runs the measuring sections and the suite's CUDA tests; ``full_suite``
(the whole test suite on this machine, ``-n 8``) only on request (``--full-suite`` or
``--sections ...,full_suite``). Every artefact goes under ``--out`` (default ``$OUT``
when set, else ``out/gpu_check``), at most 8 files of at most 16 MiB each:
``gpu_check.json`` and ``gpu_check.md`` (device, torch version, date, one table per
section; rewritten after every section, so a run cut short keeps what it measured),
``gpu_check.log`` (everything printed, pytest's output included),
``overlap_trace.json.gz`` (the profiler trace the ``overlap`` section reads),
``cuda_tests.xml`` (JUnit) and, on request, ``full_suite.xml``. The last lines printed
list them with their sizes. It exits 1 if a correctness check failed, a section raised
or ran past its time limit, else 0.

Every section has a time limit (``TIMEOUTS``, scaled by ``--timeout-scale``): past it
the section is interrupted and reported as an error, and the next one runs; one stuck
where it cannot be interrupted (a hung kernel or collective) is reported, the stacks
go to the log, and the run ends there (the JSON and Markdown are written first). A
progress line is printed at least every 20 seconds.

Time on one H100 (an estimate from FLOPs and steps; no GPU has run it yet). At ~400
TFLOP/s of bf16 matmul (40% of the dense peak) and ~20 GB/s each way over PCIe:

- ``replay_scheduling``: 8 Llama blocks (d 4096, FFN 11008: 202 M parameters each,
  1.9 B with the 32000-token embedding and head), 2 x 4096 tokens. Forward
  2 x 1.9e9 x 8192 = 3.1e13 FLOPs + attention 8 x 4 x 2 x 4096^2 x 4096 = 4.4e12,
  so ~3.5e13; a step with full recompute ~4.5 x that = 1.6e14 = 0.4 s. 6 modes x
  (2 warm-up + 5 timed + 1 peak + 1 gradient) steps = 54 steps: 22 s, plus building
  6 models (1.9 B fp32 parameters initialised on the GPU, FSDP2): ~15 s. ~40 s.
- ``overlap``: 1 model, 2 warm-up steps and one profiled backward: ~8 s.
- ``offload``: 8 GPT blocks (d 2048: 50 M parameters each), 4 x 2048 tokens: a step
  ~3 x 2 x 0.4e9 x 8192 = 2e13 FLOPs = 0.05 s of compute; offloading moves ~3 GB each
  way per step (0.3 s). 5 modes x 9 steps = 45 steps: ~15 s, + pinned buffers: ~20 s.
- ``memory_reports``: 4 GPT blocks, 3 steps: ~3 s.
- ``eager_overhead``: HF Llama ~1.1 B (16 layers, d 2048), 4 modes x 2 shapes x 10
  steps: the CPU-bound shape (1 x 128 tokens) ~0.1 s a step, the GPU-bound one (4 x
  2048) 3.5 x 2 x 1.1e9 x 8192 = 6e13 FLOPs = 0.15 s: 80 steps ~10 s, + 4 models: ~30 s.
- ``compile``: 2 GPT blocks, inductor, two models: compiling dominates, ~30-40 s each
  (identical blocks share kernels): ~80 s.
- ``cuda_tests``: pytest starting and collecting (~20 s) + the CUDA tests (~20 s): ~40 s.
- ``environment``: CUDA initialisation, ~2 s.

Total ~230 s, under 4 minutes; the limits (``TIMEOUTS``) add up to 7 minutes, inside
the ``timeout 480`` above. ``full_suite`` (on request) is not in the estimate.

Sections (``sections`` in the JSON, in this order; each has ``status`` -- ok, fail,
error or "not run" with a ``reason`` -- ``seconds`` and ``checks``):

- ``environment``: device, torch / CUDA / transformers versions, date.
- ``cuda_tests``: the test suite's tests marked ``cuda``, run with ``-rs`` and listed
  one by one. On a GPU each must pass (a skip fails the check); on CPU each must skip.
- ``replay_scheduling``: 8 Llama blocks (bf16, FSDP2 on one rank: nccl, world size 1):
  no AC / torch checkpoint / ac2 inline / ac2 side stream with prefetch 0, 1, 2 --
  backward time (median of synchronized steps), ``max_memory_allocated`` peak, and
  gradients against no AC (no worse than torch's checkpoint).
- ``overlap``: a ``torch.profiler`` trace of one backward with side-stream replays and
  prefetch 1: the time replay kernels on the side stream run concurrently with
  backward kernels on the main stream (us and % of replay kernel time), computed from
  the trace's kernel intervals.
- ``offload``: GPT blocks: no AC, torch's ``save_on_cpu(pin_memory=True)``, ac2 CPU
  offload of every saved value / of matmul outputs only (the rest recomputed), ac2
  recompute-all: peak, step time, gradients, the pinned pool reused by step 2.
- ``memory_reports``: ``memory.track``'s peak against ``torch.cuda.max_memory_allocated``
  and against a ``torch.cuda.memory._record_memory_history`` snapshot (within 2%).
- ``eager_overhead``: an HF Llama ~1B config (random init) training step: no AC, HF's
  own checkpointing, ``hf.enable``, and no AC with each layer's forward under a no-op
  Python dispatch mode (what any dispatch-mode recorder pays: the CPU-bound case's
  floor); at a batch where the CPU is the bottleneck and one where the GPU is: step-time
  ratios and CPU time per step.
- ``compile``: ``torch.compile`` of GPT blocks checkpointed by ac2 vs by torch's
  checkpoint: step time, peak, gradients.
- ``full_suite`` (on request): the whole test suite (``-n 8``) on this machine's torch.

A peak is the most bytes allocated above those allocated when the measured step
starts, with the previous step's gradients freed before it starts (on CUDA
``max_memory_allocated``, on CPU the allocator's events: the same definition).

``--smoke`` runs every section with tiny sizes (CPU: inline replays and copies, the
``aot_eager`` backend) in seconds. The harness needs only torch, pytest, pytest-xdist and
transformers (eager overhead); ac2_dist is imported from this checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import faulthandler
import functools
import gc
import gzip
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))
sys.path.insert(0, ROOT)  # ac2_dist from this checkout: the GPU machine has no pip

import bench_common  # noqa: E402
import bench_gpu  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from models import GPTBlock, GPTStack  # noqa: E402

import ac2_dist as ac  # noqa: E402

SCHEMA_VERSION = 1
SECTION_NAMES = ["environment", "cuda_tests", "replay_scheduling", "overlap", "offload", "memory_reports",
                 "eager_overhead", "compile", "full_suite"]
DEFAULT_SECTIONS = SECTION_NAMES[:-1]  # full_suite only on request
# Seconds each section may take: on one H100 at full size (~2x the docstring's estimate;
# 420 in all), and for --smoke on a loaded CPU machine (CI).
TIMEOUTS = {"environment": 20, "cuda_tests": 75, "replay_scheduling": 75, "overlap": 25, "offload": 40,
            "memory_reports": 15, "eager_overhead": 60, "compile": 110, "full_suite": 1200}
SMOKE_TIMEOUTS = {"environment": 60, "cuda_tests": 300, "replay_scheduling": 180, "overlap": 120, "offload": 180,
                  "memory_reports": 120, "eager_overhead": 180, "compile": 300, "full_suite": 1800}
HEARTBEAT_S = 20.0  # a progress line at least this often
GRACE_S = 30.0  # past its limit, a section that cannot be interrupted ends the run after this
MAX_FILES, MAX_FILE_BYTES = 8, 16 << 20  # what --out may hold (the device tool brings back no more)
ARTEFACTS = ("gpu_check.json", "gpu_check.md", "gpu_check.log", "overlap_trace.json.gz", "cuda_tests.xml",
             "full_suite.xml")
MIB = 1 / 2**20
NOT_RUN = "not run"


class SectionTimeout(Exception):
    """A section ran past its time limit (raised in it by the alarm signal)."""


# ---- results ----------------------------------------------------------------------------------


def check(name: str, ok: bool, detail: str = "") -> dict:
    """One correctness check of a section."""
    return {"name": name, "ok": bool(ok), "detail": detail}


def section_status(result: dict) -> str:
    """ok / fail / error / not run: a section fails when one of its checks does."""
    if result.get("status") in ("error", NOT_RUN):
        return result["status"]
    return "ok" if all(c["ok"] for c in result.get("checks", [])) else "fail"


def exit_code(sections: dict[str, dict]) -> int:
    """1 if any section failed a check or raised, else 0 ("not run" is neither)."""
    return 1 if any(r["status"] in ("fail", "error") for r in sections.values()) else 0


def rel_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """Largest |got - ref| relative to the largest |ref| of the same tensor."""
    if len(got) != len(ref):
        return float("inf")
    worst = 0.0
    for a, b in zip(got, ref):
        if a.shape != b.shape:
            return float("inf")
        scale = b.abs().max().item() if b.numel() else 0.0
        diff = (a - b).abs().max().item() if b.numel() else 0.0
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def grads_ok(errors: dict[str, float], reference: str, floor: float) -> list[dict]:
    """Each mode's gradient error against no AC is at most max(4 x the reference mode's,
    ``floor``): recompute may reorder nothing, so it is as close as torch's checkpoint."""
    limit = max(4 * errors.get(reference, 0.0), floor)
    return [check(f"grads {m}", e <= limit, f"rel err {e:.3g} (limit {limit:.3g})")
            for m, e in errors.items() if m != reference]


# ---- interval arithmetic (overlap) ------------------------------------------------------------


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of intervals as disjoint sorted intervals."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def total(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in merge(intervals))


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of (union of a) intersected with (union of b)."""
    a, b = merge(a), merge(b)
    i = j = 0
    got = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            got += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return got


_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_MARKER = "spin_kernel"  # torch.cuda._sleep's kernel


def stream_of(ev: dict) -> Any:
    return (ev.get("args") or {}).get("stream", ev.get("tid"))


def replay_overlap(trace: dict) -> dict:
    """Overlap of replay kernels (side stream) with backward kernels (main stream) in a
    Chrome trace from ``torch.profiler``. The streams are told apart by two marker
    kernels (``torch.cuda._sleep``): the first on the main stream, then, ordered after
    it, one on the replay stream. Without markers the busiest stream is the main one and
    the replay stream is the one holding the ``ac2::replay`` GPU annotations."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in _GPU_CATS]
    markers = sorted((e for e in gpu if _MARKER in e.get("name", "")), key=lambda e: e["ts"])
    if len(markers) >= 2:
        main, side = stream_of(markers[0]), stream_of(markers[1])
        how = "marker kernels"
    else:
        busy: dict[Any, float] = {}
        for e in gpu:
            busy[stream_of(e)] = busy.get(stream_of(e), 0.0) + e["dur"]
        main = max(busy, key=busy.get) if busy else None
        annotated = {stream_of(e) for e in events
                     if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith("ac2::")}
        annotated.discard(main)
        side = max(annotated, key=lambda s: busy.get(s, 0.0)) if annotated else None
        how = "busiest stream and ac2::replay annotations"
    real = [e for e in gpu if _MARKER not in e.get("name", "")]
    on_main = [(e["ts"], e["ts"] + e["dur"]) for e in real if stream_of(e) == main]
    on_side = [(e["ts"], e["ts"] + e["dur"]) for e in real if side is not None and stream_of(e) == side]
    replay_us = total(on_side)
    both_us = overlap(on_side, on_main)
    return {
        "main_stream": main, "replay_stream": side, "streams_from": how,
        "replay_kernels": len(on_side), "backward_kernels": len(on_main),
        "replay_us": round(replay_us, 1), "main_busy_us": round(total(on_main), 1),
        "overlap_us": round(both_us, 1), "overlap_pct_of_replay": round(100 * both_us / replay_us, 1) if replay_us else 0.0,
        "cpu_annotations": sum(1 for e in events if e.get("name") in ("ac2::replay", "ac2::prefetch")),
    }


# ---- memory snapshot --------------------------------------------------------------------------


def snapshot_peak(trace: list[dict]) -> int:
    """Peak of (bytes allocated - bytes allocated when recording began) from a
    ``torch.cuda.memory._snapshot()`` device trace: +size at ``alloc``, -size when a
    block is freed (``free_requested``, when the allocator's statistics drop it; traces
    without it: ``free_completed``)."""
    frees = "free_requested" if any(e.get("action") == "free_requested" for e in trace) else "free_completed"
    now = peak = 0
    for e in trace:
        action = e.get("action")
        if action == "alloc":
            now += e["size"]
            peak = max(peak, now)
        elif action == frees:
            now -= e["size"]
    return peak


# ---- the run's context ------------------------------------------------------------------------


class Context:
    """What every section shares: arguments, device, sizes, the one-rank process group."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.smoke = args.smoke
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.start = time.monotonic()
        self._mesh: Any = None
        self.out = args.out
        self.deadline = float("inf")  # of the running section (time.monotonic())
        self.tee: Any = None  # the log (main)

    def remaining(self) -> float:
        """Seconds left of the running section's limit."""
        return self.deadline - time.monotonic()

    def progress(self, msg: str) -> None:
        """A progress line (also in the log)."""
        print(f"gpu_check: [{time.monotonic() - self.start:6.0f} s] {msg}", flush=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def mesh(self) -> Any:
        """A 1-rank device mesh (nccl on CUDA, gloo on CPU) for FSDP2."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            bench_gpu.one_rank_group(self.device)
            self._mesh = init_device_mesh(self.device.type, (1,))
        return self._mesh

    def close(self) -> None:
        self._mesh = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def free(self) -> None:
        """Collect what the last measurement left (FSDP modules hold reference cycles)."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def path(self, name: str) -> str:
        """An artefact under --out (one of ``ARTEFACTS``)."""
        assert name in ARTEFACTS, name
        return os.path.join(self.out, name)

    def reset_peak(self) -> int:
        """Bytes allocated now, the peak statistic reset (CUDA)."""
        self.sync()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak_of(self, fn: Callable[[], Any], prepare: Callable[[], Any] | None = None) -> int:
        """Peak bytes above those allocated when ``fn`` starts (CUDA: allocator
        statistics; CPU: allocator events). ``prepare`` runs first, outside the window
        (e.g. the previous step's gradients freed): on CUDA a free inside the window
        would lower the figure, on CPU it would not (the events count only blocks
        allocated in the window), so the two definitions agree only without one."""
        if prepare is not None:
            prepare()
        if self.cuda:
            base = self.reset_peak()
            fn()
            self.sync()
            return torch.cuda.max_memory_allocated() - base
        from ac2_dist._alloc import AllocationTrace

        with AllocationTrace() as trace:
            fn()
        return trace.whole.peak_bytes


def replay_args(ctx: Context) -> argparse.Namespace:
    """bench_gpu's arguments for the replay sections."""
    if ctx.smoke:
        sizes = dict(layers=2, dim=32, heads=4, seq=32, batch=2, vocab=64, iters=1, warmup=1)
    else:
        sizes = dict(layers=8, dim=4096, heads=32, hidden=11008, seq=4096, batch=2, vocab=32000, iters=5, warmup=2)
    return argparse.Namespace(model="llama", dtype="bf16" if ctx.cuda else "fp32", **sizes)


# ---- sections -----------------------------------------------------------------------------------


def environment(ctx: Context) -> dict:
    out = {
        "device": torch.cuda.get_device_name() if ctx.cuda else f"CPU ({platform.machine()})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "smoke": ctx.smoke,
        "cpu_threads": torch.get_num_threads(),
    }
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        out["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        out["multiprocessors"] = props.multi_processor_count
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        out["transformers"] = None
    return {"figures": out}


def _pytest(ctx: Context, args: list[str], junit: str, timeout: float) -> tuple[int | None, str]:
    """Run pytest on the suite (JUnit XML to ``junit``), its output streamed into this
    run's output (and log) as it comes; ``None`` as exit status if it ran past
    ``timeout`` seconds (it is killed). Returns (status, the output's last 6000 chars)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)
    tail: list[str] = []
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        for line in proc.stdout:
            print(f"  pytest| {line}", end="", flush=True)
            tail.append(line)
            if len(tail) > 400:
                del tail[:200]
        rc = proc.wait()
    except BaseException:  # the section's own limit: the pytest process goes too
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        timer.cancel()
    if timed_out.is_set():
        rc = None
    return rc, "".join(tail)[-6000:]


def junit_cases(path: str) -> list[dict]:
    """Test cases of a JUnit XML file: name, outcome (passed/failed/error/skipped), message."""
    if not os.path.exists(path):
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or "")[:300]
                break
        classname = case.get("classname") or ""
        if classname:
            name = f"{classname.replace('.', '/')}.py::{case.get('name')}"
        else:  # a module skipped or failing as a whole: pytest names the module only
            name = f"{(case.get('name') or '').replace('.', '/')}.py"
        cases.append({"test": name, "outcome": outcome, "message": message})
    return cases


def cuda_tests(ctx: Context) -> dict:
    junit = ctx.path("cuda_tests.xml")
    rc, tail = _pytest(ctx, ["-m", "cuda", "-q", "tests"], junit, timeout=max(10.0, ctx.remaining() - 5))
    cases = junit_cases(junit)
    # What the machine has decides, not --device: on a GPU machine they must run.
    want = "passed" if torch.cuda.device_count() > 0 else "skipped"
    checks = [check("cuda tests collected", len(cases) > 0, f"{len(cases)} tests")]
    for c in cases:
        checks.append(check(c["test"], c["outcome"] == want, f"{c['outcome']}: {c['message']}".rstrip(": ")))
    checks.append(check("pytest finished", rc == 0, f"exit code {rc}"))
    return {"figures": {"tests": cases, "expected": want}, "checks": checks, "pytest_tail": tail}


def replay_scheduling(ctx: Context) -> dict:
    args = replay_args(ctx)
    mesh = ctx.mesh()
    results, grads = {}, {}
    for mode in bench_gpu.ALL_MODES:
        r = bench_gpu.measure(args, mode, mesh, ctx.device, grads=True)
        ctx.free()  # the mode's model before the next one's
        grads[mode] = r.pop("grads")
        results[mode] = r
    errors = {m: rel_err(g, grads["no-ac"]) for m, g in grads.items() if m != "no-ac"}
    t = results["torch-full"]
    for m, r in results.items():
        r["grad_rel_err_vs_no_ac"] = errors.get(m, 0.0)
        r["backward_vs_torch_full"] = r["backward_seconds_median"] / t["backward_seconds_median"]
        r["peak_vs_torch_full"] = r["peak_bytes"] / t["peak_bytes"]
    checks = grads_ok(errors, "torch-full", 2e-2 if ctx.cuda else 1e-6)
    return {"config": vars(args), "figures": results, "checks": checks}


def overlap_section(ctx: Context) -> dict:
    from torch.profiler import ProfilerActivity, profile

    args = replay_args(ctx)
    side = torch.cuda.Stream() if ctx.cuda else None
    # On CPU "auto" is the inline executor: the same prefetch schedule, no stream.
    model = bench_gpu.build(args, "ac2-side-prefetch1", ctx.mesh(), ctx.device, stream=side)
    x = bench_gpu.make_input(args, ctx.device)
    loss_fn = bench_gpu.loss_of(args)
    for _ in range(args.warmup):
        model.zero_grad(set_to_none=True)
        loss_fn(model, x).backward()
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, x)
    ctx.sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=activities) as prof:
        if ctx.cuda:  # marker kernels: main stream first, then (ordered after it) the replay stream
            torch.cuda._sleep(200_000)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000)
        loss.backward()
        ctx.sync()
    path = ctx.path("overlap_trace.json.gz")  # torch writes it gzipped (.gz)
    prof.export_chrome_trace(path)
    with gzip.open(path, "rt") as f:
        figures = replay_overlap(json.load(f))
    del model, loss
    checks = [check("trace has ac2 replay ranges", figures["cpu_annotations"] > 0,
                    f"{figures['cpu_annotations']} ac2::replay / ac2::prefetch ranges")]
    if ctx.cuda:
        checks.append(check("replay kernels found on the side stream", figures["replay_kernels"] > 0,
                            f"streams from {figures['streams_from']}: main {figures['main_stream']}, "
                            f"replay {figures['replay_stream']}"))
    else:
        figures["note"] = "CPU: no kernels; the inline executor replays in stream order (nothing overlaps)"
    return {"config": {**vars(args), "mode": "ac2-side-prefetch1"}, "figures": figures, "checks": checks}


def _gpt_args(ctx: Context, layers: int) -> argparse.Namespace:
    if ctx.smoke:
        return argparse.Namespace(layers=2, dim=32, heads=4, seq=16, batch=2, rounds=2, warmup=1)
    return argparse.Namespace(layers=layers, dim=2048, heads=16, seq=2048, batch=4, rounds=5, warmup=2)


def _grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().float().cpu() for p in model.parameters() if p.grad is not None]


def _timed_steps(ctx: Context, steps: dict[str, Callable[[], Any]], rounds: int, warmup: int) -> dict[str, list]:
    """Interleaved rounds (bench_common.timed_rounds), synchronized on CUDA."""
    return bench_common.timed_rounds(steps, rounds, warmup, sync=ctx.sync if ctx.cuda else None)


def offload(ctx: Context) -> dict:
    from torch.autograd.graph import save_on_cpu
    from torch.utils.checkpoint import CheckpointPolicy as CP

    if not hasattr(CP, "MUST_CPU_OFFLOAD"):
        return {"status": NOT_RUN, "reason": f"torch {torch.__version__} has no CheckpointPolicy.MUST_CPU_OFFLOAD"}
    args = _gpt_args(ctx, layers=8)
    aten = torch.ops.aten
    with torch.device(ctx.device):
        torch.manual_seed(0)
        base = GPTStack(args.layers, args.dim, args.heads).to(ctx.dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.dim, generator=g).to(ctx.device, ctx.dtype).requires_grad_()
    pin = ctx.cuda  # pinned memory needs a device
    offloads = {}

    def ac2(policy: Any, name: str) -> nn.Module:
        offloads[name] = ac.Offload(stream="auto" if ctx.cuda else "inline")
        config = ac.ReplayConfig(stream="auto" if ctx.cuda else "inline", prefetch=1, offload=offloads[name])
        return ac.apply_ac(copy.deepcopy(base), policy, modules=[GPTBlock], replay=config)

    models = {
        "no-ac": copy.deepcopy(base),
        "torch-save_on_cpu": copy.deepcopy(base),
        "ac2-offload-all": ac2(CP.MUST_CPU_OFFLOAD, "ac2-offload-all"),
        "ac2-offload-mm": ac2({aten.mm.default: CP.MUST_CPU_OFFLOAD, aten.addmm.default: CP.MUST_CPU_OFFLOAD},
                              "ac2-offload-mm"),
        "ac2-full": ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=[GPTBlock]),
    }

    def zero(mode: str) -> None:
        models[mode].zero_grad(set_to_none=True)

    def run(mode: str) -> None:
        ctxm = save_on_cpu(pin_memory=pin) if mode == "torch-save_on_cpu" else contextlib.nullcontext()
        with ctxm:
            loss = bench_common.forward(models[mode], x)
        loss.backward()

    def step(mode: str) -> None:
        zero(mode)
        run(mode)

    results, grads = {}, {}
    for mode in models:
        step(mode)  # warm: the pool fills, kernels are chosen
        before = dataclasses.replace(offloads[mode].stats) if mode in offloads else None
        # the previous step's gradients are freed before the measured window (Context.peak_of)
        results[mode] = {"peak_bytes": ctx.peak_of(functools.partial(run, mode), functools.partial(zero, mode))}
        grads[mode] = _grads_of(models[mode])
        if mode in offloads:  # the second step's schedule
            after = offloads[mode].stats
            results[mode].update({
                "host_buffers_allocated_step2": after.buffers_allocated - before.buffers_allocated,
                "d2h_bytes_step": after.d2h_bytes - before.d2h_bytes,
                "h2d_bytes_step": after.h2d_bytes - before.h2d_bytes,
                "blocks_committed_step": after.units_committed - before.units_committed,
                "blocks_kept_step": after.units_kept - before.units_kept,
                "pool_bytes": offloads[mode].pool_held()[1]})
    times = _timed_steps(ctx, {m: functools.partial(step, m) for m in models}, args.rounds, args.warmup)
    for mode, r in results.items():
        r["step_seconds_median"] = statistics.median(times[mode])
        r["step_vs_save_on_cpu"] = bench_common.ratio_stats(times[mode], times["torch-save_on_cpu"])
        r["peak_vs_save_on_cpu"] = r["peak_bytes"] / max(results["torch-save_on_cpu"]["peak_bytes"], 1)
        r["peak_vs_no_ac"] = r["peak_bytes"] / max(results["no-ac"]["peak_bytes"], 1)
    errors = {m: rel_err(g, grads["no-ac"]) for m, g in grads.items() if m != "no-ac"}
    for m, e in errors.items():
        results[m]["grad_rel_err_vs_no_ac"] = e
    checks = grads_ok(errors, "torch-save_on_cpu", 2e-2 if ctx.cuda else 1e-6)
    for name in offloads:
        r = results[name]
        checks.append(check(f"{name}: pool reused (no host buffer allocated in step 2)",
                            r["host_buffers_allocated_step2"] == 0, f"{r['host_buffers_allocated_step2']} allocated"))
        checks.append(check(f"{name}: the last block kept on the device, the others offloaded",
                            (r["blocks_kept_step"], r["blocks_committed_step"]) == (1, args.layers - 1),
                            f"kept {r['blocks_kept_step']}, committed {r['blocks_committed_step']} "
                            f"of {args.layers} blocks"))
    if ctx.cuda:
        checks.append(check("ac2-offload-all peaks below no AC", results["ac2-offload-all"]["peak_vs_no_ac"] < 1.0,
                            f"{results['ac2-offload-all']['peak_vs_no_ac']:.3f}x"))
    models.clear()
    return {"config": {**vars(args), "dtype": str(ctx.dtype), "pin_memory": pin}, "figures": results,
            "checks": checks}


def memory_reports(ctx: Context) -> dict:
    args = _gpt_args(ctx, layers=4)
    with torch.device(ctx.device):
        torch.manual_seed(0)
        model = ac.apply_ac(GPTStack(args.layers, args.dim, args.heads).to(ctx.dtype), "recompute_all",
                            modules=[GPTBlock])
    x = torch.randn(args.batch, args.seq, args.dim).to(ctx.device, ctx.dtype).requires_grad_()

    def step() -> None:
        bench_common.forward(model, x).backward()

    model.zero_grad(set_to_none=True)
    step()  # warm
    model.zero_grad(set_to_none=True)
    independent = ctx.peak_of(step)  # untracked: max_memory_allocated (CPU: allocator events)
    model.zero_grad(set_to_none=True)
    snap_peak = None
    if ctx.cuda:
        ctx.sync()
        record = torch.cuda.memory._record_memory_history
        try:
            record(enabled="all", context=None, stacks="python", max_entries=2_000_000, clear_history=True)
        except TypeError:  # older signature
            record(enabled="all", context=None, stacks="python", max_entries=2_000_000)
    try:
        with ac.memory.track(model) as tracker:
            step()
        ctx.sync()
        if ctx.cuda:
            snap = torch.cuda.memory._snapshot()
            traces = snap.get("device_traces") or [[]]
            snap_peak = snapshot_peak(traces[torch.cuda.current_device()])
    finally:
        if ctx.cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
    report = tracker.report()
    tracked = max(report.peak_bytes_forward, report.peak_bytes_backward)
    figures = {"tracker_peak_bytes": tracked, "tracker_peak_forward": report.peak_bytes_forward,
               "tracker_peak_backward": report.peak_bytes_backward,
               ("max_memory_allocated_peak_bytes" if ctx.cuda else "allocator_events_peak_bytes"): independent,
               "snapshot_peak_bytes": snap_peak}

    def within(a: int, b: int) -> tuple[bool, str]:
        return abs(a - b) <= 0.02 * max(b, 1), f"{a * MIB:.2f} vs {b * MIB:.2f} MiB ({a / max(b, 1):.4f}x)"

    ok, detail = within(tracked, independent)
    checks = [check("memory.track peak within 2% of " + ("max_memory_allocated" if ctx.cuda else "allocator events"),
                    ok, detail)]
    if snap_peak is not None:
        ok, detail = within(snap_peak, independent)
        checks.append(check("_record_memory_history snapshot peak within 2% of max_memory_allocated", ok, detail))
        ok, detail = within(tracked, snap_peak)
        checks.append(check("memory.track peak within 2% of the snapshot", ok, detail))
    return {"config": vars(args), "figures": figures, "checks": checks}


def eager_overhead(ctx: Context) -> dict:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"status": NOT_RUN, "reason": "transformers is not installed"}
    import bench_hf

    if ctx.smoke:
        cfg = dict(layers=2, dim=32, heads=4, kv_heads=2, intermediate=64, vocab=64)
        shapes, rounds, warmup = {"cpu-bound": (1, 16), "larger": (4, 32)}, 2, 1
    else:  # Llama-3.2-1B's shape (vocab 32000): ~1.1 B parameters
        cfg = dict(layers=16, dim=2048, heads=32, kv_heads=8, intermediate=8192, vocab=32000)
        shapes, rounds, warmup = {"cpu-bound": (1, 128), "gpu-bound": (4, 2048)}, 8, 2
    modes = ["no-ac", "hf-torch", "ac2-hf-enable", "no-ac+noop-mode"]
    seq = max(s for _, s in shapes.values())
    margs = argparse.Namespace(**cfg, seq=seq, device=ctx.device, dtype=ctx.dtype)
    models = {m: bench_hf.build(margs, m) for m in modes}
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(1)
    for label, (batch, length) in shapes.items():
        ids = torch.randint(0, cfg["vocab"], (batch, length), generator=g).to(ctx.device)
        wall: dict[str, list[float]] = {m: [] for m in modes}
        cpu: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(warmup + rounds):
            for m in modes:
                ctx.sync()
                t0, c0 = time.perf_counter(), time.process_time()
                bench_common.step(models[m], ids, bench_hf.lm_loss)
                ctx.sync()
                if r >= warmup:
                    wall[m].append(time.perf_counter() - t0)
                    cpu[m].append(time.process_time() - c0)
        rows = {}
        for m in modes:
            rows[m] = {"step_seconds_median": statistics.median(wall[m]),
                       "cpu_seconds_per_step_median": statistics.median(cpu[m]),
                       "step_vs_hf_torch": bench_common.ratio_stats(wall[m], wall["hf-torch"]),
                       "step_vs_no_ac": bench_common.ratio_stats(wall[m], wall["no-ac"]),
                       "cpu_vs_hf_torch": bench_common.ratio_stats(cpu[m], cpu["hf-torch"])}
        out[label] = {"batch": batch, "seq": length, "modes": rows}
    grads = {}  # one more step of the last shape, gradients sampled
    for m in modes:
        bench_common.step(models[m], ids, bench_hf.lm_loss)
        grads[m] = bench_gpu.grad_sample(models[m])
    errors = {m: rel_err(grads[m], grads["no-ac"]) for m in modes if m != "no-ac"}
    for m, e in errors.items():
        out[label]["modes"][m]["grad_rel_err_vs_no_ac"] = e
    del models
    return {"config": {**cfg, "dtype": str(ctx.dtype)}, "figures": out,
            "checks": grads_ok(errors, "hf-torch", 2e-2 if ctx.cuda else 1e-6)}


def compile_section(ctx: Context) -> dict:
    args = _gpt_args(ctx, layers=2)  # compiling dominates (module docstring): 2 blocks show it
    backend = "aot_eager" if ctx.smoke else "inductor"
    with torch.device(ctx.device):
        torch.manual_seed(0)
        base = GPTStack(args.layers, args.dim, args.heads).to(ctx.dtype)
    x = torch.randn(args.batch, args.seq, args.dim).to(ctx.device, ctx.dtype).requires_grad_()
    torch._dynamo.reset()
    modes = {"torch-full@compiled": "torch-full", "ac2-full@compiled": "ac2-full"}
    models, results, grads, compile_s = {}, {}, {}, {}
    for name, mode in modes.items():
        models[name] = torch.compile(bench_common.checkpointed(base, mode, (GPTBlock,)), backend=backend,
                                     fullgraph=True)
        t0 = time.perf_counter()
        bench_common.step(models[name], x)  # compiles
        ctx.sync()
        compile_s[name] = time.perf_counter() - t0
        model = models[name]
        results[name] = {"compile_seconds": compile_s[name],
                         "peak_bytes": ctx.peak_of(lambda model=model: bench_common.forward(model, x).backward(),
                                                   functools.partial(model.zero_grad, set_to_none=True))}
        grads[name] = _grads_of(models[name])
    times = _timed_steps(ctx, {m: functools.partial(bench_common.step, models[m], x) for m in models}, args.rounds,
                         args.warmup)
    for name, r in results.items():
        r["step_seconds_median"] = statistics.median(times[name])
    a, t = results["ac2-full@compiled"], results["torch-full@compiled"]
    ratios = {"peak": a["peak_bytes"] / max(t["peak_bytes"], 1),
              "step_time": bench_common.ratio_stats(times["ac2-full@compiled"], times["torch-full@compiled"])}
    err = rel_err(grads["ac2-full@compiled"], grads["torch-full@compiled"])
    del models
    torch._dynamo.reset()
    limit = 2e-2 if ctx.cuda else 1e-6
    return {"config": {**vars(args), "backend": backend, "dtype": str(ctx.dtype)},
            "figures": {"modes": results, "ac2_vs_torch": ratios, "grad_rel_err_ac2_vs_torch": err},
            "checks": [check("compiled ac2 grads match compiled torch checkpoint", err <= limit,
                             f"rel err {err:.3g} (limit {limit:.3g})")]}


def full_suite(ctx: Context) -> dict:
    if ctx.smoke:
        return {"status": NOT_RUN, "reason": "--smoke: CI runs the whole suite itself (python -m pytest -n 2 -q)"}
    junit = ctx.path("full_suite.xml")
    workers = str(min(8, os.cpu_count() or 2))
    left = ctx.remaining() - 10
    rc, tail = _pytest(ctx, ["-n", workers, "-q", "tests"], junit, timeout=left)
    cases = junit_cases(junit)
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    failed = [c for c in cases if c["outcome"] in ("failed", "error")]
    figures = {"counts": counts, "failed": failed[:50], "exit_code": rc,
               "skipped": [c for c in cases if c["outcome"] == "skipped"]}
    if rc is None:
        return {"status": "error", "error": f"the suite did not finish in its {left:.0f} s",
                "figures": figures, "pytest_tail": tail}
    return {"figures": figures, "pytest_tail": tail,
            "checks": [check("whole suite passes", rc == 0 and not failed, f"exit code {rc}, {counts}")]}


SECTIONS: dict[str, Callable[[Context], dict]] = {
    "environment": environment,
    "cuda_tests": cuda_tests,
    "replay_scheduling": replay_scheduling,
    "overlap": overlap_section,
    "offload": offload,
    "memory_reports": memory_reports,
    "eager_overhead": eager_overhead,
    "compile": compile_section,
    "full_suite": full_suite,
}


# ---- output -------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict) and "median" in v:
        return f"{v['median']:.3f} ({v['min']:.3f}–{v['max']:.3f})"
    return str(v)


def _cell(v: Any) -> bool:
    """Shown in a table: scalars and ratio statistics (median, min, max)."""
    return not isinstance(v, (list, dict)) or isinstance(v, dict) and "median" in v


def _table(rows: dict[str, dict]) -> list[str]:
    """A Markdown table: one row per key, the union of the rows' scalar fields."""
    cols: list[str] = []
    for r in rows.values():
        cols += [k for k, v in r.items() if _cell(v) and k not in cols]
    out = ["| | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, r in rows.items():
        cells = []
        for c in cols:
            v = r.get(c, "")
            if c.endswith("bytes") and isinstance(v, int):
                v = f"{v * MIB:.1f} MiB"
            cells.append(_fmt(v))
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def markdown(doc: dict) -> str:
    env = doc["sections"].get("environment", {}).get("figures", {})
    lines = [f"# ac2_dist GPU check — {env.get('device', '?')}", "",
             f"torch {env.get('torch', '?')}, CUDA {env.get('cuda')}, {env.get('date', '?')}"
             f"{' (smoke run)' if doc.get('smoke') else ''}; exit code {doc.get('exit_code')}", "",
             "| section | status | seconds | checks failed |", "|---|---|---:|---|"]
    for name, r in doc["sections"].items():
        bad = [c["name"] for c in r.get("checks", []) if not c["ok"]]
        status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
        lines.append(f"| {name} | {status} | {r.get('seconds', 0):.1f} | {', '.join(bad)} |")
    for name, r in doc["sections"].items():
        lines += ["", f"## {name}", ""]
        if r.get("error"):
            lines += ["```", r["error"], "```"]
        figs = r.get("figures")
        if name == "cuda_tests" and figs:
            lines += ["| test | outcome | message |", "|---|---|---|"]
            lines += [f"| {c['test']} | {c['outcome']} | {c['message']} |" for c in figs["tests"]]
        elif name == "eager_overhead" and figs:
            for label, v in figs.items():
                lines += [f"batch {v['batch']} x seq {v['seq']} ({label}):", ""] + _table(v["modes"]) + [""]
        elif name == "compile" and figs:
            ratio = figs["ac2_vs_torch"]
            lines += _table(figs["modes"]) + ["", f"ac2 / torch compiled: peak {_fmt(ratio['peak'])}, step time "
                                              f"{_fmt(ratio['step_time'])}; gradient rel err "
                                              f"{_fmt(figs['grad_rel_err_ac2_vs_torch'])}"]
        elif name == "full_suite" and figs:
            lines += [f"counts: {figs['counts']}, exit code {figs['exit_code']}"]
            lines += [f"- {c['test']}: {c['outcome']} {c['message']}" for c in figs.get("failed", [])]
        elif isinstance(figs, dict) and figs and all(isinstance(v, dict) for v in figs.values()):
            lines += _table(figs)
        elif isinstance(figs, dict):
            lines += [f"- {k}: {_fmt(v)}" for k, v in figs.items()]
        checks = r.get("checks", [])
        if checks:
            lines += ["", "| check | ok | detail |", "|---|---|---|"]
            lines += [f"| {c['name']} | {'yes' if c['ok'] else '**NO**'} | {c['detail']} |" for c in checks]
    return "\n".join(lines) + "\n"


def write(out_dir: str, doc: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(markdown(doc))


def artefacts(out_dir: str) -> list[tuple[str, int]]:
    """(name, bytes) of every file under ``out_dir``, sorted."""
    found = []
    for root, _, files in os.walk(out_dir):
        for name in files:
            path = os.path.join(root, name)
            found.append((os.path.relpath(path, out_dir), os.path.getsize(path)))
    return sorted(found)


class _Tee:
    """Everything this process and its children write to stdout and stderr (Python, C++
    and subprocesses alike: file descriptors 1 and 2 go through a pipe) is copied to
    the console and to the log file, the log up to ``MAX_FILE_BYTES`` (then one line
    says it was cut)."""

    def __init__(self, path: str) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.log = open(path, "wb")
        self.read_end, write_end = os.pipe()
        self.console = os.dup(1)
        self.saved = (os.dup(1), os.dup(2))
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        # Python's own writes go to the descriptors too (sys.stdout may be something else,
        # e.g. a test runner's capture).
        self.streams = sys.stdout, sys.stderr
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        self.thread = threading.Thread(target=self._copy, daemon=True, name="gpu_check-tee")
        self.thread.start()

    def _copy(self) -> None:
        room = MAX_FILE_BYTES - 200
        try:
            while True:
                data = os.read(self.read_end, 1 << 16)
                if not data:
                    break
                os.write(self.console, data)
                if room > 0:
                    self.log.write(data[:room])
                    if len(data) > room:
                        self.log.write(b"\n[gpu_check: the log reached its size limit; the console has the rest]\n")
                    room -= len(data)
                    self.log.flush()
        except (OSError, ValueError):  # closed: a child process still held the pipe when the run ended
            return

    def close(self) -> None:
        """Put stdout and stderr back; the log has everything written until now."""
        if self.log.closed:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = self.streams
        os.dup2(self.saved[0], 1)
        os.dup2(self.saved[1], 2)
        self.thread.join(timeout=10)  # the pipe's last writer is gone: it ends
        for fd in (*self.saved, self.console, self.read_end):
            os.close(fd)
        self.log.close()


class _Watch:
    """While a section runs: a progress line every ``HEARTBEAT_S``; past its limit an
    interrupt (SIGALRM in the main thread, raising :class:`SectionTimeout`); ``GRACE_S``
    later, if it still runs (stuck where Python cannot interrupt it), ``on_stuck``
    (write the results, dump the stacks, end the process)."""

    def __init__(self, ctx: Context, name: str, limit: float, on_stuck: Callable[[], None]) -> None:
        self.ctx, self.name, self.limit, self.on_stuck = ctx, name, limit, on_stuck
        self.done = threading.Event()
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self._watch, daemon=True, name=f"gpu_check-watch-{name}")

    def __enter__(self) -> _Watch:
        self.ctx.deadline = self.t0 + self.limit
        self.previous = signal.signal(signal.SIGALRM, self._alarm)
        signal.setitimer(signal.ITIMER_REAL, self.limit)
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)
        self.done.set()
        self.thread.join()
        self.ctx.deadline = float("inf")

    def _alarm(self, signum: int, frame: Any) -> None:
        raise SectionTimeout(f"{self.name} ran past its limit of {self.limit:.0f} s")

    def _watch(self) -> None:
        stuck_at = self.t0 + self.limit + GRACE_S
        while not self.done.wait(HEARTBEAT_S):
            now = time.monotonic()
            self.ctx.progress(f"{self.name} running: {now - self.t0:.0f} s of its {self.limit:.0f} s")
            if now >= stuck_at:
                self.on_stuck()
                return


def run(args: argparse.Namespace, tee: Any = None) -> dict:
    ctx = Context(args)
    ctx.tee = tee
    names = args.sections.split(",") if args.sections else list(DEFAULT_SECTIONS)
    if args.full_suite and "full_suite" not in names:
        names.append("full_suite")
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"gpu_check: unknown section(s) {unknown}; sections: {SECTION_NAMES}")
    limits = SMOKE_TIMEOUTS if ctx.smoke else TIMEOUTS
    doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "smoke": ctx.smoke, "device": args.device,
                           "argv": sys.argv[1:], "sections": {},
                           "time_limits_s": {n: limits[n] * args.timeout_scale for n in names}}

    def finish(name: str, result: dict, t0: float) -> None:
        result.setdefault("checks", [])
        result["status"] = section_status(result)
        result["seconds"] = round(time.perf_counter() - t0, 2)
        doc["sections"][name] = result
        doc["exit_code"] = exit_code(doc["sections"])
        doc["seconds"] = round(time.monotonic() - ctx.start, 1)
        write(args.out, doc)  # after every section: a run cut short keeps what it measured

    try:
        for i, name in enumerate(names):
            limit = limits[name] * args.timeout_scale
            t0 = time.perf_counter()
            ctx.progress(f"{name} ... (limit {limit:.0f} s)")

            def stuck(name: str = name, t0: float = t0, limit: float = limit, rest: list[str] = names[i + 1:]) -> None:
                finish(name, {"status": "error", "error": f"stuck past its limit of {limit:.0f} s (+{GRACE_S:.0f} s) "
                                                          "where it cannot be interrupted; the stacks are in the log"},
                       t0)
                for later in rest:
                    finish(later, {"status": NOT_RUN, "reason": f"{name} was stuck: the run ended there"}, t0)
                ctx.progress(f"{name} is stuck: every thread's stack follows; the run ends here (exit 1)")
                sys.stderr.flush()
                faulthandler.dump_traceback(all_threads=True)  # to stderr: the console and the log
                list_artefacts(args.out)
                if ctx.tee is not None:
                    ctx.tee.close()
                os._exit(1)

            try:
                with _Watch(ctx, name, limit, stuck):
                    result = SECTIONS[name](ctx)
            except Exception as e:  # a section that raises (or ran past its limit) is reported, the others run
                result = {"status": "error", "error": f"{type(e).__name__}: {e}",
                          "traceback": traceback.format_exc()[-6000:]}
            finish(name, result, t0)
            bad = [c["name"] for c in result["checks"] if not c["ok"]]
            ctx.progress(f"{name}: {result['status']} ({result['seconds']:.1f} s)"
                         + (f" failed: {bad}" if bad else "") + (f" {result.get('error', '')}" if result.get("error") else "")
                         + (f" ({result['reason']})" if result.get("reason") else ""))
            ctx.free()
    finally:
        ctx.close()
    return doc


def list_artefacts(out_dir: str) -> list[tuple[str, int]]:
    """Print every file under ``out_dir`` with its size (and what breaks the limits)."""
    found = artefacts(out_dir)
    print(f"gpu_check: artefacts under {out_dir} ({len(found)} files):", flush=True)
    for name, size in found:
        over = f"  ** over {MAX_FILE_BYTES >> 20} MiB **" if size > MAX_FILE_BYTES else ""
        print(f"gpu_check:   {name}  {size} bytes{over}", flush=True)
    if len(found) > MAX_FILES:
        print(f"gpu_check: ** {len(found)} files, more than {MAX_FILES} **", flush=True)
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.device_count() > 0 else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--smoke", action="store_true", help="tiny sizes: every section in seconds (CI)")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "out", "gpu_check"),
                   help="folder for every artefact (default: $OUT when set, else out/gpu_check)")
    p.add_argument("--sections", default="", help=f"comma-separated subset of {SECTION_NAMES} "
                                                  f"(default: all but full_suite)")
    p.add_argument("--full-suite", action="store_true", help="also run the whole test suite (full_suite)")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every section's time limit")
    args = p.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() == 0:
        p.error("--device cuda: no CUDA device is available (use --device cpu --smoke on a CPU machine)")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    os.makedirs(args.out, exist_ok=True)
    tee = _Tee(os.path.join(args.out, "gpu_check.log"))
    try:
        doc = run(args, tee)
        print(f"gpu_check: exit code {doc['exit_code']} ({doc['seconds']:.0f} s)", flush=True)
    finally:
        tee.close()
    found = list_artefacts(args.out)  # after the log is complete: its final size
    too_big = [n for n, size in found if size > MAX_FILE_BYTES]
    if too_big or len(found) > MAX_FILES:
        print(f"gpu_check: --out breaks its limits ({MAX_FILES} files of {MAX_FILE_BYTES >> 20} MiB): {too_big}")
        return 1
    return doc["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
