"""Print the requirements of the project and of the extras named on the command line, one
per line (pyproject.toml; an extra naming the project's own extras is expanded), so that a
venv can install them before the project itself: .ci/run installs steps 4-5's in the
background while earlier steps run; the project, whose C recorder builds in place in the
checkout, installs in its step."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib


def requirements(extras: list[str], project: dict) -> list[str]:
    name = project["name"]
    optional = project.get("optional-dependencies", {})
    out: list[str] = list(project.get("dependencies", []))
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f".ci/deps.py: pyproject.toml has no extra {extra!r}")
        seen.add(extra)
        for req in optional[extra]:
            own = re.fullmatch(rf"{re.escape(name)}\[([^\]]+)\]", req.replace(" ", ""))
            if own:
                todo += own.group(1).split(",")
            else:
                out.append(req)
    return sorted(set(out))


if __name__ == "__main__":
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    print("\n".join(requirements(sys.argv[1:], pyproject["project"])))
