"""ac2_dist.distributed.shutdown(): the end of a torchrun script (Note [Shutdown order]).

The main job ends with it, and tests/test_stress_main_job.py runs that job 50 times under
load (CI step 2). Here: the README's FSDP2 quick start, as a user pastes it, leaves no gloo
thread alive when the interpreter starts finalizing; a model still alive at shutdown() is
reported; after an error nothing waits for the other ranks.
"""

from __future__ import annotations

import os
import warnings

import pytest
from _dist import run_torchrun
from test_docs import README, TORCHRUN, code_blocks

import ac2_dist as ac

linux_only = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the threads from /proc (Linux)")

_THREADS_AT_EXIT = """
import os
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
with open(f"threads-{os.environ['RANK']}.txt", "w") as f:  # the ranks' stdout interleave
    f.write(repr(sorted(n for n in names if "gloo" in n)))
"""


def test_shutdown_without_a_process_group_does_nothing():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ac.distributed.shutdown()
        ac.distributed.shutdown(after_error=True)
    assert "distributed" in ac.__all__


@pytest.mark.slow
@linux_only
def test_readme_fsdp2_quick_start_joins_gloo_threads(tmp_path):
    """The README's torchrun quick start (the block itself, read from the README) ends with
    shutdown(): when it returns no gloo thread is left that could free a tensor while the
    interpreter finalizes, and it warns about nothing."""
    (block,) = [b for b in TORCHRUN if b.path == "README.md"]
    assert "ac.distributed.shutdown()" in block.code
    script = tmp_path / "job.py"
    script.write_text(block.code + _THREADS_AT_EXIT)
    proc = run_torchrun(str(script), cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RuntimeWarning" not in proc.stderr, proc.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"threads-{rank}.txt").read_text() == "[]", f"rank {rank}: gloo threads alive at exit"
    assert len(code_blocks(README)) > 4


_MODEL_ALIVE = """
import warnings
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import ac2_dist as ac

dist.init_process_group("gloo")
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))  # module scope: alive at shutdown
for m in [*model, model]:
    fully_shard(m)
model(torch.randn(4, 8)).sum().backward()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ac.distributed.shutdown()
print("warned:", [str(w.message)[:60] for w in caught if w.category is RuntimeWarning])
"""

_AFTER_ERROR = """
import os, time
import torch.distributed as dist
import ac2_dist as ac

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    try:
        raise ValueError("rank 1 fails")
    except ValueError:
        ac.distributed.shutdown(after_error=True)  # must not wait for rank 0 (a barrier would)
        open("rank1-done", "w").close()
        print("rank 1 ended after its error:", not dist.is_initialized())
else:
    deadline = time.monotonic() + 60  # rank 0 enters no collective before rank 1 is done
    while not os.path.exists("rank1-done") and time.monotonic() < deadline:
        time.sleep(0.05)
    ac.distributed.shutdown(after_error=True)
    print("rank 0 saw rank 1 done:", os.path.exists("rank1-done"))
"""


@pytest.mark.slow
def test_shutdown_warns_when_the_model_is_still_alive(tmp_path):
    """A model alive where shutdown() runs keeps the group (and gloo's threads) alive: that
    is the mistake that aborts at exit, and shutdown() says what to do."""
    script = tmp_path / "job.py"
    script.write_text(_MODEL_ALIVE)
    proc = run_torchrun(str(script), cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("warned: ['ac2_dist.distributed.shutdown(): process group(s)") == 2, proc.stdout


@pytest.mark.slow
def test_shutdown_after_an_error_does_not_wait_for_other_ranks(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(_AFTER_ERROR)
    proc = run_torchrun(str(script), cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 1 ended after its error: True" in proc.stdout and "rank 0 saw rank 1 done: True" in proc.stdout
