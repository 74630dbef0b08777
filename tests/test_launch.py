"""The main job runs under torchrun on 2 CPU ranks and writes a valid report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize("ac_mode", ["ac2-full", "ac2-sac"])
def test_train_py_under_torchrun_writes_report(tmp_path, ac_mode):
    out = os.path.join(tmp_path, "run.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "launch", "train.py"), "--steps", "3", "--layers", "2", "--dim", "64",
           "--seq", "64", "--batch", "4", "--ac", ac_mode, "--report-json", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step   3/3" in proc.stdout and "per-rank memory report" in proc.stdout
    data = json.load(open(out))
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for r in data["ranks"]:
        assert r["world_size"] == 2 and r["device"] == "cpu"
        assert r["recomputed_ops"] > 0 and r["saved_bytes"] > 0
        assert r["allgathers_backward"] == 2  # one per resharded block
        assert set(r["per_module"]) == {"layers.0", "layers.1"}
    report = subprocess.run([sys.executable, "-m", "ac2_dist.report", out], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert report.returncode == 0 and "all-gathers in backward" in report.stdout
