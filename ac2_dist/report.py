"""Render a saved per-rank memory report.

    python -m ac2_dist.report run.json [--png out.png]

``run.json`` is what :func:`ac2_dist.memory.save_run` writes (``launch/train.py
--report-json`` and ``launch/bench.py`` do). Exit status: 0 when the table (and the
chart) were written, 2 when the run file cannot be read or is not valid, or the chart
cannot be written (one line on stderr says why). Files that are valid but look
inconsistent (duplicate or out-of-range ranks, mixed world sizes) still render, with a
warning line on stderr.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from .memory import RankReport, format_table, load_run, plot

_PROG = "python -m ac2_dist.report"


def _say(kind: str, message: object) -> None:
    """One line on stderr (multi-line messages are folded)."""
    text = " ".join(str(message).split())
    print(f"{_PROG}: {kind}: {text}", file=sys.stderr)


def _read(path: str) -> list[RankReport] | None:
    """The run file's reports, printing its warnings; ``None`` (after one error line)
    if it cannot be read or is not a valid run file."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reports = load_run(path)
    except OSError as e:
        _say("error", f"cannot read {path}: {e.strerror or e}")
        return None
    except ValueError as e:
        _say("error", e)
        return None
    for w in caught:
        _say("warning", w.message)
    return reports


def _draw(reports: list[RankReport], path: str) -> bool:
    """Write the chart; ``False`` (after one error line) if it cannot be written."""
    try:
        plot(reports, path)
    except ImportError as e:
        _say("error", f"--png {path}: {e}")
        return False
    except ValueError as e:
        _say("error", f"--png: {e}")
        return False
    except OSError as e:
        _say("error", f"--png: cannot write {path}: {e.strerror or e}")
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """Print the rank x metric table of a run file (and draw the chart); the exit status."""
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run file written by ac2_dist.memory.save_run")
    p.add_argument("--png", help="also draw the per-rank / per-module chart here (needs matplotlib)")
    args = p.parse_args(argv)
    reports = _read(args.run)
    if reports is None:
        return 2
    print(format_table(reports), flush=True)
    if args.png:
        if not _draw(reports, args.png):
            return 2
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
