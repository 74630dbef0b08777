"""launch/gpu_check.py: the one command of a GPU session. CI runs its ``--device cpu
--smoke`` form (every section, tiny sizes) so the harness cannot rot; the measuring
code it relies on (interval overlap, snapshot peaks, JUnit parsing, exit status) is
checked here on synthetic inputs."""

from __future__ import annotations

import json
import os
import sys
import time

import _hang
import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))

import gpu_check  # noqa: E402


def test_smoke_run_has_every_section_and_writes_the_table(tmp_path):
    out = tmp_path / "gc"
    # The sections' own limits are for the device's budget; here a slow machine must not trip
    # them (a hang is caught by _hang.run: Note [A timeout catches a hang] in _hang.py).
    cmd = [sys.executable, os.path.join(ROOT, "launch", "gpu_check.py"), "--device", "cpu", "--smoke",
           "--timeout-scale", "20"]
    env = dict(os.environ, OUT=str(out))  # --out defaults to $OUT (the device tool's folder)
    proc = _hang.run(cmd, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    sections = doc["sections"]
    assert list(sections) == gpu_check.DEFAULT_SECTIONS  # full_suite only on request
    assert doc["exit_code"] == 0 and doc["smoke"] is True
    # Every artefact is under --out, listed at the end with its size, within the limits.
    listed = {}
    for line in proc.stdout.splitlines()[-12:]:
        parts = line.split()
        if len(parts) == 4 and parts[0] == "gpu_check:" and parts[3] == "bytes":
            listed[parts[1]] = int(parts[2])
    files = {p.name: p.stat().st_size for p in out.iterdir()}
    assert listed == files and set(files) == {"gpu_check.json", "gpu_check.md", "gpu_check.log",
                                              "overlap_trace.json.gz", "cuda_tests.xml"}, (listed, files)
    assert len(files) <= gpu_check.MAX_FILES and max(files.values()) <= gpu_check.MAX_FILE_BYTES
    log = (out / "gpu_check.log").read_text()
    assert "gpu_check: [" in log and "pytest| " in log and "compile: ok" in log  # the console, kept
    for name, r in sections.items():
        if name == "offload" and not hasattr(CheckpointPolicy, "MUST_CPU_OFFLOAD"):  # torch < 2.11
            assert r["status"] == "not run" and "MUST_CPU_OFFLOAD" in r["reason"]
            continue
        assert r["status"] == "ok", (name, r.get("error"), [c for c in r["checks"] if not c["ok"]])
        if name != "environment":
            assert r["checks"], name  # every measuring section checks something
    env = sections["environment"]["figures"]
    assert env["torch"] == torch.__version__ and env["date"] and env["device"]
    # The CUDA tests are listed one by one: skipped here (no device), run on a GPU.
    tests = {c["test"]: c["outcome"] for c in sections["cuda_tests"]["figures"]["tests"]}
    has_offload = hasattr(CheckpointPolicy, "MUST_CPU_OFFLOAD")  # else test_offload.py skips as a module
    assert ("tests/test_offload.py::test_cuda_schedule_values_memory_and_pool" if has_offload
            else "tests/test_offload.py") in tests
    assert "tests/test_replay.py::test_side_stream_matches_inline_and_bounds_memory" in tests
    expected = "passed" if torch.cuda.device_count() > 0 else "skipped"
    assert set(tests.values()) == {expected}
    replay = sections["replay_scheduling"]["figures"]
    assert set(replay) == {"no-ac", "torch-full", "ac2-inline", "ac2-side-prefetch0", "ac2-side-prefetch1",
                           "ac2-side-prefetch2", "ac2-inline-save-mm", "ac2-side-prefetch1-save-mm",
                           "ac2-inline-save-mm-rerun"}
    assert all(r["peak_bytes"] > 0 and r["backward_seconds_median"] > 0 for r in replay.values())
    assert all("peak_reserved_bytes" in r for r in replay.values())  # None on CPU, the GPU's figure there
    assert replay["ac2-side-prefetch1-save-mm"]["grad_rel_err_vs_inline"] == 0.0  # CPU: bitwise
    assert sections["overlap"]["figures"]["cpu_annotations"] > 0
    assert not has_offload or set(sections["offload"]["figures"]) == {"no-ac", "torch-save_on_cpu", "ac2-offload-all",
                                                   "ac2-offload-mm", "ac2-full"}
    eager = sections["eager_overhead"]
    if eager["status"] != "not run":  # transformers installed (the test extra)
        for v in eager["figures"].values():
            assert set(v["modes"]) == {"no-ac", "hf-torch", "ac2-hf-enable", "no-ac+noop-mode"}
        assert all(c["ok"] for c in eager["checks"])  # the no-op mode's gradients are no AC's
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# ac2_dist GPU check") and torch.__version__ in md
    for name in gpu_check.DEFAULT_SECTIONS:
        assert f"\n## {name}\n" in md and f"| {name} | " in md
    assert not has_offload or "| tests/test_offload.py::test_cuda_schedule_order_matches_cpu | " in md


def test_overlap_of_intervals():
    assert gpu_check.merge([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)]) == [(0, 3), (5, 8)]
    assert gpu_check.total([(0, 2), (1, 3)]) == 3
    assert gpu_check.overlap([(0, 10)], [(2, 3), (5, 7), (9, 12)]) == 1 + 2 + 1
    assert gpu_check.overlap([(0, 1), (4, 5)], [(1, 4)]) == 0
    assert gpu_check.overlap([(0, 4), (2, 6)], [(3, 5), (3, 4)]) == 2


def _kernel(name, stream, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream,
            "args": {"stream": stream}}


def test_replay_overlap_from_a_trace():
    trace = {"traceEvents": [
        _kernel("at::cuda::spin_kernel(long)", 7, 0, 10),  # main-stream marker
        _kernel("at::cuda::spin_kernel(long)", 21, 10, 10),  # replay-stream marker, after it
        _kernel("gemm", 7, 30, 40),  # backward: 30..70
        _kernel("gemm", 7, 80, 20),  # 80..100
        _kernel("replay_gemm", 21, 60, 30),  # replay: 60..90, overlaps 60..70 and 80..90
        _kernel("replay_add", 21, 100, 10),  # 100..110: alone
        _kernel("nccl", 13, 0, 500),  # another stream (FSDP): ignored
        {"ph": "X", "cat": "user_annotation", "name": "ac2::replay", "ts": 55, "dur": 40, "tid": 1},
    ]}
    got = gpu_check.replay_overlap(trace)
    assert (got["main_stream"], got["replay_stream"], got["streams_from"]) == (7, 21, "marker kernels")
    assert got["replay_us"] == 40 and got["overlap_us"] == 20 and got["overlap_pct_of_replay"] == 50
    assert (got["replay_kernels"], got["backward_kernels"], got["cpu_annotations"]) == (2, 2, 1)
    # No markers: the busiest stream is main, the replay stream is the annotated one.
    trace["traceEvents"] = [e for e in trace["traceEvents"] if "spin" not in e["name"] and e["tid"] != 13]
    trace["traceEvents"].append({"ph": "X", "cat": "gpu_user_annotation", "name": "ac2::replay", "ts": 60,
                                 "dur": 50, "tid": 21, "args": {"stream": 21}})
    got = gpu_check.replay_overlap(trace)
    assert (got["main_stream"], got["replay_stream"]) == (7, 21) and got["overlap_us"] == 20


def test_snapshot_peak():
    trace = [{"action": "alloc", "size": 100}, {"action": "alloc", "size": 50},
             {"action": "free_requested", "size": 100}, {"action": "free_completed", "size": 100},
             {"action": "alloc", "size": 80}, {"action": "segment_alloc", "size": 2 << 20}]
    assert gpu_check.snapshot_peak(trace) == 150
    no_requested = [e for e in trace if e["action"] != "free_requested"]
    assert gpu_check.snapshot_peak(no_requested) == 150


def test_exit_status_and_checks():
    ok, bad = gpu_check.check("a", True), gpu_check.check("b", False, "why")
    assert gpu_check.section_status({"checks": [ok]}) == "ok"
    assert gpu_check.section_status({"checks": [ok, bad]}) == "fail"
    assert gpu_check.section_status({"status": "not run", "reason": "smoke"}) == "not run"
    assert gpu_check.exit_code({"x": {"status": "ok"}, "y": {"status": "not run"}}) == 0
    assert gpu_check.exit_code({"x": {"status": "ok"}, "y": {"status": "fail"}}) == 1
    assert gpu_check.exit_code({"x": {"status": "error"}}) == 1
    # Gradient errors: no worse than 4x the reference mode's, or under the floor.
    checks = gpu_check.grads_ok({"torch": 1e-3, "ac2": 3e-3, "bad": 5e-3}, "torch", 1e-6)
    assert [(c["name"], c["ok"]) for c in checks] == [("grads ac2", True), ("grads bad", False)]
    assert gpu_check.rel_err([torch.ones(3)], [torch.ones(3)]) == 0
    assert gpu_check.rel_err([torch.tensor([1.0, 2.5])], [torch.tensor([1.0, 2.0])]) == 0.25
    assert gpu_check.rel_err([torch.ones(2)], [torch.ones(3)]) == float("inf")


def test_junit_cases(tmp_path):
    path = tmp_path / "j.xml"
    path.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_ok" time="0.1"/>'
        '<testcase classname="tests.test_a" name="test_skip[1]"><skipped message="needs a CUDA device"/></testcase>'
        '<testcase classname="tests.test_b" name="test_fail"><failure message="assert 1 == 2">tb</failure></testcase>'
        '<testcase classname="" name="tests.test_c"><skipped message="no such policy"/></testcase>'
        "</testsuite></testsuites>")
    assert gpu_check.junit_cases(str(path)) == [
        {"test": "tests/test_a.py::test_ok", "outcome": "passed", "message": ""},
        {"test": "tests/test_a.py::test_skip[1]", "outcome": "skipped", "message": "needs a CUDA device"},
        {"test": "tests/test_b.py::test_fail", "outcome": "failed", "message": "assert 1 == 2"},
        {"test": "tests/test_c.py", "outcome": "skipped", "message": "no such policy"},  # a module-level skip
    ]
    assert gpu_check.junit_cases(str(tmp_path / "missing.xml")) == []


@pytest.mark.parametrize("outcome", ["fail", "raise"])
def test_a_failed_check_or_a_raising_section_exits_1(tmp_path, monkeypatch, outcome):
    def section(ctx):
        if outcome == "raise":
            raise RuntimeError("boom")
        return {"figures": {"x": 1}, "checks": [gpu_check.check("values", False, "differ")]}

    monkeypatch.setitem(gpu_check.SECTIONS, "environment", section)
    rc = gpu_check.main(["--device", "cpu", "--smoke", "--sections", "environment", "--out", str(tmp_path)])
    assert rc == 1
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    r = doc["sections"]["environment"]
    assert r["status"] == ("fail" if outcome == "fail" else "error")
    if outcome == "raise":
        assert "RuntimeError: boom" in r["error"] and "boom" in (tmp_path / "gpu_check.md").read_text()
    else:
        assert "| values | **NO** | differ |" in (tmp_path / "gpu_check.md").read_text()


def test_a_section_past_its_limit_is_interrupted_and_the_next_runs(tmp_path, monkeypatch, capfd):
    def slow(ctx):
        time.sleep(30)
        return {"figures": {}, "checks": [gpu_check.check("finished", True)]}

    monkeypatch.setitem(gpu_check.SECTIONS, "environment", slow)
    monkeypatch.setitem(gpu_check.SECTIONS, "overlap", lambda ctx: {"checks": [gpu_check.check("ran", True)]})
    monkeypatch.setattr(gpu_check, "HEARTBEAT_S", 0.5)
    limit = 2.5
    rc = gpu_check.main(["--device", "cpu", "--smoke", "--sections", "environment,overlap", "--out", str(tmp_path),
                         "--timeout-scale", str(limit / gpu_check.SMOKE_TIMEOUTS["environment"])])
    assert rc == 1
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    slow_r, next_r = doc["sections"]["environment"], doc["sections"]["overlap"]
    assert slow_r["status"] == "error" and "SectionTimeout" in slow_r["error"] and slow_r["seconds"] < 10
    assert next_r["status"] == "ok"
    printed = capfd.readouterr().out
    assert printed.count("environment running:") >= 3  # a progress line every HEARTBEAT_S
    assert "environment running:" in (tmp_path / "gpu_check.log").read_text()


_STUCK = """
import sys, time
sys.path.insert(0, {launch!r})
import gpu_check

def stuck(ctx):  # ignores the interrupt: as a kernel or a collective that never returns
    while True:
        try:
            time.sleep(60)
        except gpu_check.SectionTimeout:
            pass

gpu_check.SECTIONS["environment"] = lambda ctx: {{"checks": [gpu_check.check("ran", True)]}}
gpu_check.SECTIONS["overlap"] = stuck
gpu_check.SMOKE_TIMEOUTS["overlap"] = 1.0
gpu_check.HEARTBEAT_S, gpu_check.GRACE_S = 0.5, 1.0
sys.exit(gpu_check.main(["--device", "cpu", "--smoke", "--sections", "environment,overlap,compile",
                         "--out", {out!r}]))
"""


def test_a_section_stuck_past_its_limit_ends_the_run_with_its_stacks(tmp_path):
    out = tmp_path / "gc"
    code = _STUCK.format(launch=os.path.join(ROOT, "launch"), out=str(out))
    proc = _hang.run([sys.executable, "-c", code], cwd=ROOT)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["sections"]["environment"]["status"] == "ok"
    assert doc["sections"]["overlap"]["status"] == "error" and "stuck" in doc["sections"]["overlap"]["error"]
    assert doc["sections"]["compile"]["status"] == "not run"
    log = (out / "gpu_check.log").read_text()
    assert "overlap is stuck" in log and "in stuck" in log  # every thread's stack, the stuck one's too
    assert "gpu_check:   gpu_check.json" in proc.stdout


def test_the_device_command_goes_on_when_the_install_fails(tmp_path):
    """launch/gpu_run.sh, the GPU session's command: a failed install is reported and the
    run goes on from the checkout, with the hub offline and every artefact under $OUT."""
    env = dict(os.environ, OUT=str(tmp_path), GPU_RUN_INSTALL="false",
               GPU_RUN_ARGS="--device cpu --smoke --sections environment --timeout-scale 20")
    env.pop("HF_HUB_OFFLINE", None)
    proc = _hang.run(["bash", os.path.join(ROOT, "launch", "gpu_run.sh")], cwd=str(tmp_path), env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_run: the install failed (exit 1); running from the checkout" in proc.stdout
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["sections"]["environment"]["status"] == "ok" and doc["exit_code"] == 0


def test_an_interrupted_run_reports_where_it_stopped(tmp_path, monkeypatch):
    """SIGINT (the device command's outer time limit) in a section: that section is an error,
    the later ones are "not run", the JSON is written and the run exits 1."""
    def interrupted(ctx):
        raise KeyboardInterrupt

    monkeypatch.setitem(gpu_check.SECTIONS, "cuda_tests", interrupted)
    rc = gpu_check.main(["--device", "cpu", "--smoke", "--sections", "environment,cuda_tests,overlap",
                         "--out", str(tmp_path)])
    assert rc == 1
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert sections["environment"]["status"] == "ok"
    assert sections["cuda_tests"]["status"] == "error" and "SIGINT" in sections["cuda_tests"]["error"]
    assert sections["overlap"]["status"] == gpu_check.NOT_RUN
