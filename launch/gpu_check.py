"""One command for a GPU session: measure every GPU claim of ac2_dist, check what must hold.

On the device machine (one GPU; the artefacts come back from ``$OUT``), through
launch/gpu_run.sh (it installs the checkout and goes on from the checkout if that
fails, sets the Hugging Face hub offline, and stops the run with SIGINT at its outer
time limit, so the sections' ``finally`` blocks and this file's reports still run)::

    bash launch/gpu_run.sh

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
  so ~3.5e13; a step with full recompute ~4.5 x that = 1.6e14 = 0.4 s. 9 modes (the
  6 replay modes, and the save-matmuls policy inline, on the side stream, and inline
  again) x (2 warm-up + 5 timed + 1 peak + 1 gradient) steps = 81 steps: 33 s, plus
  building 9 models (1.9 B fp32 parameters initialised on the GPU, FSDP2): ~22 s. ~55 s.
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

Total ~245 s, under 4.5 minutes; the limits (``TIMEOUTS``) add up to 7 minutes, inside
launch/gpu_run.sh's outer limit of 480 s. ``full_suite`` (on request) is not in the estimate.

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
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))
sys.path.insert(0, ROOT)  # ac2_dist from this checkout: the GPU machine has no pip

import torch  # noqa: E402
from gpu_check_report import ARTEFACTS, MIB, artefacts, markdown, write  # noqa: E402, F401
from gpu_check_sections import (  # noqa: E402, F401
    Context,
    compile_section,
    cuda_tests,
    eager_overhead,
    environment,
    full_suite,
    junit_cases,
    memory_reports,
    offload,
    overlap_section,
    replay_scheduling,
)
from gpu_check_verdicts import (  # noqa: E402, F401  (re-exported: tests/test_gpu_check.py reads them here)
    NOT_RUN,
    check,
    exit_code,
    grads_ok,
    merge,
    overlap,
    rel_err,
    replay_overlap,
    section_status,
    snapshot_peak,
    stream_of,
    total,
)

SCHEMA_VERSION = 1
SECTION_NAMES = ["environment", "cuda_tests", "replay_scheduling", "overlap", "offload", "memory_reports",
                 "eager_overhead", "compile", "full_suite"]
DEFAULT_SECTIONS = SECTION_NAMES[:-1]  # full_suite only on request
# Seconds each section may take: on one H100 at full size (~2x the docstring's estimate;
# 420 in all), and for --smoke on a loaded CPU machine (CI).
TIMEOUTS = {"environment": 20, "cuda_tests": 75, "replay_scheduling": 90, "overlap": 25, "offload": 40,
            "memory_reports": 15, "eager_overhead": 60, "compile": 100, "full_suite": 1200}
SMOKE_TIMEOUTS = {"environment": 60, "cuda_tests": 300, "replay_scheduling": 180, "overlap": 120, "offload": 180,
                  "memory_reports": 120, "eager_overhead": 180, "compile": 300, "full_suite": 1800}
HEARTBEAT_S = 20.0  # a progress line at least this often
GRACE_S = 30.0  # past its limit, a section that cannot be interrupted ends the run after this
MAX_FILES, MAX_FILE_BYTES = 8, 16 << 20  # what --out may hold (the device tool brings back no more)


class SectionTimeout(Exception):
    """A section ran past its time limit (raised in it by the alarm signal)."""


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
            except KeyboardInterrupt:  # SIGINT: the device command's outer time limit (launch/gpu_run.sh)
                finish(name, {"status": "error", "error": "interrupted (SIGINT: the run's outer time limit)"}, t0)
                for later in names[i + 1:]:
                    finish(later, {"status": NOT_RUN, "reason": f"the run was interrupted in {name}"}, t0)
                ctx.progress(f"{name}: interrupted; the run ends here (exit 1), what it measured is written")
                break
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
