"""Quiet by default (issue 41): the profiler session ac2 starts to measure a step prints
nothing. Without care each tracked step printed kineto's ``USDT ... profiler_start`` /
``profiler_stop`` lines and the CPU allocator's "Memory block of unknown size was allocated
before the profiling started" once per process, two ranks' lines interleaved. A user's own
``torch.profiler`` session is left as torch makes it.
"""

from __future__ import annotations

import os
import sys

import _hang
import torch

import ac2_dist as ac
from ac2_dist import memory
from ac2_dist._measure import _quiet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# torchrun's own banner, printed when OMP_NUM_THREADS is not set (as a user runs it).
_BANNER = "*" * 41
_NOISE = ("USDT", "profiler_start", "profiler_stop", "Memory block of unknown size", "STAGE:", "CPUAllocator")


def _beyond_the_banner(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    if _BANNER in lines:  # the block between its two rows of asterisks
        first = lines.index(_BANNER)
        last = lines.index(_BANNER, first + 1)
        lines = lines[:first] + lines[last + 1:]
    return [line for line in lines if line.strip()]


def test_main_job_prints_nothing_from_the_profiler_or_the_allocator(tmp_path):
    """The README's main job on 2 gloo ranks, run as a user runs it (no OMP_NUM_THREADS):
    both ranks' stderr holds torchrun's banner and nothing else; stdout has no profiler or
    allocator line either."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "KINETO_LOG_LEVEL", "TORCH_CPP_LOG_LEVEL")}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(ROOT, "launch", "train.py"), "--steps", "2", "--baseline-steps", "3",
           "--baseline-measured", "1"]
    proc = _hang.run(cmd, cwd=str(tmp_path), env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "per-rank memory report" in proc.stdout and "baseline" in proc.stdout, proc.stdout
    assert _beyond_the_banner(proc.stderr) == [], proc.stderr
    assert not [line for line in proc.stdout.splitlines() if any(n in line for n in _NOISE)], proc.stdout


_TRACKED_STEP = """
import torch, ac2_dist as ac
from ac2_dist import memory
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(3)])
ac.apply_ac(model, "recompute_all", modules=[torch.nn.Sequential])
garbage = [torch.randn(4096) for _ in range(8)]  # blocks from before the session, freed inside it
for step in range(2):
    with memory.track(model) as t:
        del garbage[:4]
        model(torch.randn(32, 64)).sum().backward()
    assert t.report().peak_bytes_backward > 0
print("done")
"""


def test_a_tracked_step_prints_nothing():
    env = {k: v for k, v in os.environ.items() if k not in ("KINETO_LOG_LEVEL", "TORCH_CPP_LOG_LEVEL")}
    proc = _hang.run([sys.executable, "-c", _TRACKED_STEP], env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done\n" and proc.stderr == "", proc.stderr


def test_the_levels_are_restored_after_the_session():
    """What a user's own profiler session prints afterwards is what torch prints: the native
    log levels ac2 raised for its own session are back."""
    before = _quiet.levels()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    ac.apply_ac(model, "recompute_all", modules=[torch.nn.Sequential])
    with memory.track(model):
        model(torch.randn(4, 8)).sum().backward()
    after = _quiet.levels()
    # Kineto sets its own level when its first session starts: compare once it is set.
    if before["kineto"] == 0:
        before["kineto"] = after["kineto"]
    assert after == before
    with torch.profiler.profile():
        pass
    assert _quiet.levels() == after


def test_an_explicit_log_level_is_left_alone(monkeypatch):
    """KINETO_LOG_LEVEL / TORCH_CPP_LOG_LEVEL set by the user: ac2 changes neither level."""
    monkeypatch.setenv("KINETO_LOG_LEVEL", "3")
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    seen = []
    real = _quiet._set

    def spy(name, value):
        seen.append(name)
        real(name, value)

    monkeypatch.setattr(_quiet, "_set", spy)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    ac.apply_ac(model, "recompute_all", modules=[torch.nn.Sequential])
    with memory.track(model):
        model(torch.randn(4, 8)).sum().backward()
    assert seen == []
