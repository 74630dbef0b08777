"""Render a saved per-rank memory report.

    python -m ac2_dist.report run.json [--png out.png]

``run.json`` is what :func:`ac2_dist.memory.save_run` writes (``launch/train.py
--report-json`` and ``launch/bench.py`` do).
"""

from __future__ import annotations

import argparse
import sys

from .memory import format_table, load_run, plot


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ac2_dist.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run file written by ac2_dist.memory.save_run")
    p.add_argument("--png", help="also draw the per-rank / per-module chart here (needs matplotlib)")
    args = p.parse_args(argv)
    try:
        reports = load_run(args.run)
    except (OSError, ValueError, KeyError) as e:
        print(f"ac2_dist.report: cannot read {args.run}: {e}", file=sys.stderr)
        return 2
    print(format_table(reports))
    if args.png:
        plot(reports, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
