"""gpu_check.py's sections: the run's :class:`Context` and one function per section
(``environment``, ``cuda_tests``, ``replay_scheduling``, ``overlap``, ``offload``,
``memory_reports``, ``eager_overhead``, ``compile``, ``full_suite``), each returning its
figures and checks. Moved verbatim from gpu_check.py, which registers them in its
``SECTIONS`` and runs them."""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
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
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

# gpu_check.py put launch/ and this checkout (ac2_dist: the GPU machine has no pip) on
# sys.path before importing this module.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import bench_common  # noqa: E402
import bench_gpu  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from gpu_check_report import ARTEFACTS, MIB  # noqa: E402
from gpu_check_verdicts import NOT_RUN, check, grads_ok, rel_err, replay_overlap, snapshot_peak  # noqa: E402
from models import GPTBlock, GPTStack  # noqa: E402

import ac2_dist as ac  # noqa: E402

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
        from ac2_dist._measure._alloc import AllocationTrace

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
        out.update(_fresh_stream_cost())
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        out["transformers"] = None
    return {"figures": out}


def _fresh_stream_cost() -> dict:
    """What a new stream's first matmul costs the allocator (its cuBLAS workspace: Note
    [What side streams cost] in ac2_dist/_streams.py): allocated and reserved bytes beyond
    the matmul's own output."""
    torch.cuda.synchronize()
    x = torch.randn(256, 256, device="cuda")
    y = x @ x  # the current stream's workspace, if it had none yet
    torch.cuda.synchronize()
    a0, r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        z = x @ x
    torch.cuda.synchronize()
    out = {"fresh_stream_allocated_bytes": torch.cuda.memory_allocated() - a0 - z.numel() * z.element_size(),
           "fresh_stream_reserved_bytes": torch.cuda.memory_reserved() - r0}
    del x, y, z, stream
    return out


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
        if r.get("peak_reserved_bytes") is not None and t.get("peak_reserved_bytes"):
            r["reserved_vs_torch_full"] = r["peak_reserved_bytes"] / t["peak_reserved_bytes"]
    checks = grads_ok(errors, "torch-full", 2e-2 if ctx.cuda else 1e-6)
    # Save the matmuls: the side stream against inline, judged by inline's own run-to-run noise.
    saved = {}
    for mode in bench_gpu.SAVE_MM_MODES:
        r = bench_gpu.measure(args, mode, mesh, ctx.device, grads=True)
        ctx.free()
        saved[mode] = r.pop("grads")
        results[mode] = r
    inline, side, rerun = (saved[m] for m in bench_gpu.SAVE_MM_MODES)
    floor, side_err = rel_err(rerun, inline), rel_err(side, inline)
    results[bench_gpu.SAVE_MM_MODES[1]]["grad_rel_err_vs_inline"] = side_err
    results[bench_gpu.SAVE_MM_MODES[2]]["grad_rel_err_vs_inline"] = floor
    checks.append(check("save-matmuls gradients: side stream vs inline within inline's rerun noise",
                        side_err <= max(2 * floor, 1e-6), f"side {side_err:.2e}, rerun {floor:.2e}"))
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


