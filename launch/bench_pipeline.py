"""ac2_dist.simulate's pipeline ranks against torch.distributed.pipelining's schedules run on
real gloo ranks: the predicted-vs-measured table per schedule.

    python launch/bench_pipeline.py                                   # every schedule
    python launch/bench_pipeline.py --schedules 1F1B,InterleavedZeroBubble --json out.json

The tiny Llama of tests/_sim_case.py (built with ``from_config``: nothing is downloaded) on
2 pipeline ranks, 4 microbatches of 2 x 128 a step, FSDP2 per block and per stage (a 1-rank
data-parallel group), AdamW: 1F1B and GPipe with one stage a rank (3 layers), the
multi-stage schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
DualPipeV) with two (4 layers, one a stage). Each rank's step simulated by
``ac2_dist.simulate(..., pipeline=Pipeline(...))`` and the same rank run by torch's
``PipelineStage`` and schedule, no AC and full AC (tests/_pipeline_case.py says how), and a
peak target per rank halfway between its floor (full AC plus the collective buffers gloo may
hold late) and no AC: the simulation's plan, and the job following its plan file.

Measured independently of ac2's reports: the peak is the bytes of every storage alive when
the step began (parameter shards, optimizer states, the batch, the stages' receive buffers)
plus the CPU allocator's peak above them during the step (allocator events), the lowest of
four steps; for a plan also the highest of the four against its target. Also reported:
whether every gradient of the first step under full AC and under the plan equals the same
schedule's without AC, bitwise (under the multi-stage schedules a run without FSDP: under
FSDP2 with ``reshard_after_forward=True`` torch's split backward computes no gradient for a
middle stage's weights).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from _pipeline_case import MULTI, SINGLE, compare  # noqa: E402
from bench_common import write_json  # noqa: E402

_NAMES = {"none": "no AC", "full": "full AC", "plan": "target"}


def table(results: list[dict]) -> str:
    lines = ["| schedule | rank | mode | simulated, B | measured, B | simulated / measured - 1 |",
             "|---|---:|---|---:|---:|---:|"]
    for res in results:
        for row in res["rows"]:
            mode = _NAMES[row["mode"]] + (f" {row['target']:,}" if row["mode"] == "plan" else "")
            lines.append(f"| {res['schedule']} | {row['rank']} | {mode} | {row['simulated']:,} | {row['measured']:,} "
                         f"| {row['error']:+.2%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedules", default=",".join(SINGLE + MULTI))
    ap.add_argument("--json", default=None, help="write the results here (and a .md beside it)")
    args = ap.parse_args(argv)
    wanted = [s for s in args.schedules.split(",") if s]
    unknown = [s for s in wanted if s not in SINGLE + MULTI]
    if unknown:
        ap.error(f"--schedules: {unknown[0]!r} is not one of {', '.join(SINGLE + MULTI)}")
    results = []
    for schedule in wanted:
        res = compare(schedule, plans=True)
        for row in res["rows"]:
            row.pop("text", None)
        results.append(res)
        worst = max(abs(r["error"]) for r in res["rows"])
        same = "yes" if all(g["count"] and not g["full"] and not g["plan"] for g in res["grads"]) else "NO"
        within = all(r["highest"] <= r["target"] for r in res["rows"] if r["mode"] == "plan")
        print(f"{schedule}: worst |error| {worst:.2%}, full-AC and plan gradients bitwise no AC's: {same}, every "
              f"planned step within its target: {'yes' if within else 'NO'} (simulate {res['simulate_s']:.0f} s, "
              f"real {res['real_s']:.0f} s)", flush=True)
    md = table(results)
    print(md)
    worst = max(abs(r["error"]) for res in results for r in res["rows"])
    fits = all(r["highest"] <= r["target"] for res in results for r in res["rows"] if r["mode"] == "plan")
    summary = (f"every rank and mode within {worst:.2%}; every planned step within its target: "
               f"{'yes' if fits else 'NO'}")
    print(summary)
    out = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "python": platform.python_version(),
           "machine": platform.machine(), "results": results, "worst_error": worst}
    write_json(args.json, out)
    if args.json:
        with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
            f.write(f"# bench_pipeline {out['date']} (torch {out['torch']})\n\n`python launch/bench_pipeline.py "
                    f"--schedules {','.join(wanted)}`\n\n{md}\n\n{summary}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
