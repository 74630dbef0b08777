"""gpu_check.py's output files: ``gpu_check.md`` (one table per section) and
``gpu_check.json``, and the artefacts under ``--out``. Moved verbatim from gpu_check.py
(which re-exports every name)."""

from __future__ import annotations

import json
import os
from typing import Any

ARTEFACTS = ("gpu_check.json", "gpu_check.md", "gpu_check.log", "overlap_trace.json.gz", "cuda_tests.xml",
             "full_suite.xml")
MIB = 1 / 2**20


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict) and "median" in v:
        return f"{v['median']:.3f} ({v['min']:.3f}–{v['max']:.3f})"
    return str(v)


def _cell(v: Any) -> bool:
    """Shown in a table: scalars and ratio statistics (median, min, max)."""
    return not isinstance(v, (list, dict)) or isinstance(v, dict) and "median" in v


def _table(rows: dict[str, dict]) -> list[str]:
    """A Markdown table: one row per key, the union of the rows' scalar fields."""
    cols: list[str] = []
    for r in rows.values():
        cols += [k for k, v in r.items() if _cell(v) and k not in cols]
    out = ["| | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, r in rows.items():
        cells = []
        for c in cols:
            v = r.get(c, "")
            if c.endswith("bytes") and isinstance(v, int):
                v = f"{v * MIB:.1f} MiB"
            cells.append(_fmt(v))
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def markdown(doc: dict) -> str:
    env = doc["sections"].get("environment", {}).get("figures", {})
    lines = [f"# ac2_dist GPU check — {env.get('device', '?')}", "",
             f"torch {env.get('torch', '?')}, CUDA {env.get('cuda')}, {env.get('date', '?')}"
             f"{' (smoke run)' if doc.get('smoke') else ''}; exit code {doc.get('exit_code')}", "",
             "| section | status | seconds | checks failed |", "|---|---|---:|---|"]
    for name, r in doc["sections"].items():
        bad = [c["name"] for c in r.get("checks", []) if not c["ok"]]
        status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
        lines.append(f"| {name} | {status} | {r.get('seconds', 0):.1f} | {', '.join(bad)} |")
    for name, r in doc["sections"].items():
        lines += ["", f"## {name}", ""]
        if r.get("error"):
            lines += ["```", r["error"], "```"]
        figs = r.get("figures")
        if name == "cuda_tests" and figs:
            lines += ["| test | outcome | message |", "|---|---|---|"]
            lines += [f"| {c['test']} | {c['outcome']} | {c['message']} |" for c in figs["tests"]]
        elif name == "eager_overhead" and figs:
            for label, v in figs.items():
                lines += [f"batch {v['batch']} x seq {v['seq']} ({label}):", ""] + _table(v["modes"]) + [""]
        elif name == "compile" and figs:
            ratio = figs["ac2_vs_torch"]
            lines += _table(figs["modes"]) + ["", f"ac2 / torch compiled: peak {_fmt(ratio['peak'])}, step time "
                                              f"{_fmt(ratio['step_time'])}; gradient rel err "
                                              f"{_fmt(figs['grad_rel_err_ac2_vs_torch'])}"]
        elif name == "full_suite" and figs:
            lines += [f"counts: {figs['counts']}, exit code {figs['exit_code']}"]
            lines += [f"- {c['test']}: {c['outcome']} {c['message']}" for c in figs.get("failed", [])]
        elif isinstance(figs, dict) and figs and all(isinstance(v, dict) for v in figs.values()):
            lines += _table(figs)
        elif isinstance(figs, dict):
            lines += [f"- {k}: {_fmt(v)}" for k, v in figs.items()]
        checks = r.get("checks", [])
        if checks:
            lines += ["", "| check | ok | detail |", "|---|---|---|"]
            lines += [f"| {c['name']} | {'yes' if c['ok'] else '**NO**'} | {c['detail']} |" for c in checks]
    return "\n".join(lines) + "\n"


def write(out_dir: str, doc: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(markdown(doc))


def artefacts(out_dir: str) -> list[tuple[str, int]]:
    """(name, bytes) of every file under ``out_dir``, sorted."""
    found = []
    for root, _, files in os.walk(out_dir):
        for name in files:
            path = os.path.join(root, name)
            found.append((os.path.relpath(path, out_dir), os.path.getsize(path)))
    return sorted(found)

