"""What gpu_check.py's sections conclude from what they measured: one check and a
section's status and the run's exit code; gradient errors; busy intervals of a
profiler trace and the overlap of a replay with other work; a memory snapshot's peak.
Moved verbatim from gpu_check.py (which re-exports every name)."""

from __future__ import annotations

from typing import Any

import torch

NOT_RUN = "not run"


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

