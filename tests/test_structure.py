"""The house rules the code itself can check (issues 43, 47): no import circle inside
``ac2_dist/`` or ``launch/``, none between the package's wings (``_trace/``, ``_plan/``,
``_measure/``, ``_sim/``) and its top-level modules, no room past ``MAX_LINES``, and every
``Note [...]`` reference names a Note that exists where it says.

What counts as an import circle: a cycle in the graph whose edges are the imports a
module of the package makes, at module level, inside a function (a deferred import
still makes the importer depend on the imported room: neither could be read or changed
alone) or under ``if TYPE_CHECKING:`` (a type-only import never runs, but the importer
still names the imported room's classes: the recorder that names the planner's class
for an annotation knows the planner). Importing a submodule also imports its parent
package; that implicit edge is not one of the module's own and is not counted.
"""

from __future__ import annotations

import ast
import os
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ac2_dist"
LAUNCH = ROOT / "launch"
MAX_LINES = 650  # a room past this is split along its Notes (the C recorder is exempt)


# ---- the import graph ---------------------------------------------------------------------


def _package_modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package at ``root``: its Python
    modules and its C extensions (by their source, ``_crecord.c``; they import nothing
    of the package)."""
    out = {}
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.c")]):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, type_only: bool = True) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with where it stands: ``"module level"``, ``"in a
    function"`` or ``"type only"`` (the body of an ``if TYPE_CHECKING:``, left out
    unless ``type_only``; its ``else`` runs)."""
    found: list[tuple[ast.Import | ast.ImportFrom, str]] = []

    def walk(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                if type_only:
                    for c in child.body:
                        walk_stmt(c, "type only")
                for c in child.orelse:
                    walk_stmt(c, kind)
                continue
            walk_stmt(child, kind)

    def walk_stmt(child: ast.AST, kind: str) -> None:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.append((child, kind))
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            walk(child, "type only" if kind == "type only" else "in a function")
        else:
            walk(child, kind)

    walk(tree, "module level")
    return found


def package_import_graph(root: Path, type_only: bool = True) -> dict[str, dict[str, list[str]]]:
    """``{importer: {imported: ["line N (module level|in a function)", ...]}}`` over the
    modules of the package at ``root``: every import (see the module docstring), or with
    ``type_only=False`` those that run."""
    modules = _package_modules(root)
    graph: dict[str, dict[str, list[str]]] = {name: defaultdict(list) for name in modules}
    for name, path in modules.items():
        if path.suffix != ".py":
            continue
        is_pkg = path.name == "__init__.py"
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        for node, kind in _imports(ast.parse(path.read_text(), str(path)), type_only):
            where = f"line {node.lineno} ({kind})"
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                # ``from pkg import sub`` imports the submodule ``pkg.sub`` if there is one
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
            for t in targets:
                while t and t not in modules and "." in t:  # ``import ac2_dist.x.y`` of a name: its module
                    t = t.rsplit(".", 1)[0]
                if t in modules and t != name and where not in graph[name][t]:
                    graph[name][t].append(where)
    return graph


def script_import_graph(folder: Path) -> dict[str, dict[str, list[str]]]:
    """The same for a folder of scripts that import each other as top-level modules
    (``launch/``: each script puts its own folder on ``sys.path``)."""
    modules = {p.stem: p for p in sorted(folder.glob("*.py"))}
    graph: dict[str, dict[str, list[str]]] = {name: defaultdict(list) for name in modules}
    for name, path in modules.items():
        for node, kind in _imports(ast.parse(path.read_text(), str(path))):
            where = f"line {node.lineno} ({kind})"
            if isinstance(node, ast.Import):
                targets = [a.name.split(".")[0] for a in node.names]
            else:
                targets = [] if node.level or not node.module else [node.module.split(".")[0]]
            for t in targets:
                if t in modules and t != name and where not in graph[name][t]:
                    graph[name][t].append(where)
    return graph


def circles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each
    sorted: every one is at least one import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _describe(graph: dict[str, dict[str, list[str]]], comp: list[str]) -> str:
    members = set(comp)
    lines = [" <-> ".join(comp) + ":"]
    for a in comp:
        for b, where in sorted(graph[a].items()):
            if b in members:
                lines.append(f"    {a} imports {b} at {', '.join(where)}")
    return "\n".join(lines)


def _line_of(name: str, text: str) -> int:
    return next(i for i, line in enumerate((PACKAGE / name).read_text().splitlines(), 1) if line.strip() == text)


WINGS = ("_trace", "_plan", "_measure", "_sim")  # ac2_dist's private subpackages


def wing_graph(graph: dict[str, dict[str, list[str]]], package: str = "ac2_dist",
               wings: tuple[str, ...] = WINGS) -> dict[str, dict[str, list[str]]]:
    """``graph`` with every module of a wing folded into the wing (``ac2_dist._trace``
    for ``ac2_dist._trace._graph``); imports inside one wing drop out, each import
    between rooms keeps the module that makes it (``_graph.py line 12 (type only)``)."""
    def room(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:2]) if len(parts) > 1 and parts[0] == package and parts[1] in wings else name

    out: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for a, targets in graph.items():
        out[room(a)]  # every room, an isolated one too
        for b, where in targets.items():
            if room(a) != room(b):
                out[room(a)][room(b)] += [f"{a.rsplit('.', 1)[-1]}.py {w}" for w in where]
    return out


def test_no_import_circle_in_the_package():
    graph = package_import_graph(PACKAGE)
    # The walk sees the package's imports (a module-level one, a deferred one, a type-only
    # one), so an empty answer below is not a walk that found nothing.
    assert "ac2_dist._trace._nodes" in graph["ac2_dist._trace._graph"]
    assert graph["ac2_dist._trace._tracer"]["ac2_dist._trace._crecord"] == [f"line {_line_of('_trace/_tracer.py', 'from . import _crecord')} (in a function)"]
    assert any("(type only)" in w for w in graph["ac2_dist._trace._replayer"]["ac2_dist._trace._nodes"])
    found = circles(graph)
    assert not found, "import circles in ac2_dist/ (TYPE_CHECKING imports included):\n" + "\n".join(
        _describe(graph, c) for c in found)


def test_the_wings_import_one_way():
    """Folding each wing into one room, the package is still a graph without a circle
    (type-only imports counted): the recorder never names the planner, the measuring
    code or the simulation; the planner never the simulation; and no wing imports a
    module that imports it back."""
    assert all((PACKAGE / w / "__init__.py").is_file() for w in WINGS)
    folded = wing_graph(package_import_graph(PACKAGE))
    assert "ac2_dist._trace" in folded["ac2_dist._plan"]  # the planner reads the recorder's nodes
    found = circles(folded)
    assert not found, "import circles between ac2_dist's wings and top-level modules:\n" + "\n".join(
        _describe(folded, c) for c in found)


def test_no_import_circle_in_launch():
    graph = script_import_graph(LAUNCH)
    assert "models" in graph["bench_core"]
    found = circles(graph)
    assert not found, "import circles in launch/:\n" + "\n".join(_describe(graph, c) for c in found)


def test_the_circle_check_catches_a_circle(tmp_path):
    """A package with a circle through a deferred import, one through a module-level
    import, one through a TYPE_CHECKING import (a circle when type-only imports count,
    none when they do not), and one between two wings that no two modules close."""
    pkg = tmp_path / "pkg"
    for sub in ("sub", "w1", "w2"):
        (pkg / sub).mkdir(parents=True)
    files = {
        "__init__.py": "from . import a\n",
        "a.py": "from .b import f\n",
        "b.py": "def f():\n    from . import a\n    return a\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import X\nelse:\n    X = None\n",
        "d.py": "from .c import X\n",
        "sub/__init__.py": "",
        "sub/e.py": "from ..sub import f as _f\nimport pkg.sub.g\n",
        "sub/f.py": "",
        "sub/g.py": "from .e import _f\n",
        "w1/__init__.py": "",
        "w1/p.py": "from ..w2.q import Q\n",
        "w1/r.py": "",
        "w2/__init__.py": "",
        "w2/q.py": "class Q: ...\n",
        "w2/s.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..w1.r import R\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    running = package_import_graph(pkg, type_only=False)
    assert running["pkg.c"] == {}  # TYPE_CHECKING only
    assert circles(running) == [["pkg.a", "pkg.b"], ["pkg.sub.e", "pkg.sub.g"]]
    graph = package_import_graph(pkg)
    assert graph["pkg.c"] == {"pkg.d": ["line 3 (type only)"]}
    assert graph["pkg.sub.e"].keys() == {"pkg.sub.f", "pkg.sub.g"}  # ``from ..sub import f``: the submodule
    assert circles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"], ["pkg.sub.e", "pkg.sub.g"]]
    assert "pkg.b imports pkg.a at line 2 (in a function)" in _describe(graph, ["pkg.a", "pkg.b"])
    folded = wing_graph(graph, "pkg", ("w1", "w2"))
    assert ["pkg.w1", "pkg.w2"] in circles(folded)
    assert "pkg.w2 imports pkg.w1 at s.py line 3 (type only)" in _describe(folded, ["pkg.w1", "pkg.w2"])


# ---- room sizes ---------------------------------------------------------------------------


def test_no_room_past_max_lines():
    """Every module of ``ac2_dist/`` and every script of ``launch/`` stays within
    ``MAX_LINES`` (the C recorder, whose plain-op path and pack hook are one hot loop,
    is exempt)."""
    files = [*sorted(PACKAGE.rglob("*.py")), *sorted(LAUNCH.glob("*.py"))]
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in files}
    assert len(sizes) > 40 and max(sizes.values()) > MAX_LINES // 2  # the scan reads both folders
    long = {str(p): n for p, n in sizes.items() if n > MAX_LINES}
    assert not long, f"modules past {MAX_LINES} lines (split them along their Notes): {long}"


# ---- Note references ----------------------------------------------------------------------

# A Note is defined by a line that starts with it (after a comment marker or a docstring's
# quotes) and ends there or goes on after a colon: ``Note [Name]`` / ``# Note [Name]: ...``.
_DEFINITION = re.compile(r'^\s*(?:#+:?|\*|/\*+|[rRbBuU]?"""|\'\'\')?\s*Note \[([^\]]+)\](?::|\s*$)')
# A reference, possibly wrapped over comment or docstring lines, optionally naming its file:
# ``Note [Name] in file.py``, ``Note [Name] in ``ac2_dist/file.c````, ``Note [Name] (file.py)``.
_REFERENCE = re.compile(r"Note \[([^\]]+)\](?:\s*(?:in|\()\s*`{0,2}([\w/.]+\.(?:py|c))\b)?")
_COMMENT_MARK = re.compile(r"^(?:#+:?|\*+/?|//+|/\*+)\s?")


def _sources() -> list[Path]:
    return [p for root in (PACKAGE, LAUNCH) for p in sorted(root.rglob("*")) if p.suffix in (".py", ".c")]


def _test_tools() -> list[Path]:
    """The test suite's tools (``tests/_*.py``: the simulated CUDA, its timeline), whose
    Notes launch/'s benchmarks refer to; the test files are not scanned (their section
    headings name the Notes they test)."""
    return sorted((ROOT / "tests").glob("_*.py"))


def _flat(text: str) -> str:
    """The file's lines joined, comment markers and indentation dropped: a reference
    wrapped over two comment lines reads as one."""
    return " ".join(_COMMENT_MARK.sub("", line.strip()) for line in text.splitlines())


def _norm(name: str) -> str:
    return " ".join(name.split())


def _notes() -> dict[Path, set[str]]:
    notes = {}
    for p in _sources() + _test_tools():
        notes[p] = {_norm(m.group(1)) for line in p.read_text().splitlines() if (m := _DEFINITION.match(line))}
    return notes


def _references() -> list[tuple[Path, str, str | None]]:
    refs = []
    for p in _sources():
        for m in _REFERENCE.finditer(_flat(p.read_text())):
            refs.append((p, _norm(m.group(1)), m.group(2)))
    return refs


def _resolve(name: str) -> list[Path]:
    """The source files a reference's file name can mean (by path suffix)."""
    parts = Path(name).parts
    return [p for p in _sources() + _test_tools() if p.parts[-len(parts):] == parts]


def test_note_references_name_notes_in_their_files():
    notes = _notes()
    refs = _references()
    assert sum(1 for r in refs if r[2]) > 100  # the scan reads the references (wrapped ones included)
    bad = []
    for path, name, where in refs:
        if where is None:
            continue
        files = _resolve(where)
        if len(files) != 1:
            bad.append(f"{path.relative_to(ROOT)}: Note [{name}] in {where}: {len(files)} files have that name")
        elif name not in notes[files[0]]:
            holders = [str(p.relative_to(ROOT)) for p, n in notes.items() if name in n]
            bad.append(f"{path.relative_to(ROOT)}: Note [{name}] in {where}: not there"
                       + (f" (it is in {', '.join(holders)})" if holders else " (no file defines it)"))
    assert not bad, "stale Note references:\n" + "\n".join(bad)


def test_note_references_without_a_file_name_a_note():
    """A reference that names no file is to a Note of its own file or, where the text
    says which elsewhere, of another one: it must at least exist, exactly once."""
    notes = _notes()
    defined: dict[str, list[Path]] = defaultdict(list)
    for p, names in notes.items():
        for n in names:
            defined[n].append(p)
    twice = {n: [str(p.relative_to(ROOT)) for p in ps] for n, ps in defined.items() if len(ps) > 1}
    assert not twice, f"Notes defined in more than one file: {twice}"
    bad = sorted({f"{p.relative_to(ROOT)}: Note [{name}]" for p, name, where in _references()
                  if where is None and name not in defined})
    assert not bad, "references to Notes that no file defines:\n" + "\n".join(bad)


@pytest.mark.parametrize("text,expected", [
    ("# see Note [A\n# b] in x.py.", [("A b", "x.py")]),
    ('"""Note [Def]\n    body\n"""', [("Def", None)]),
    ("(Note [C] (_y.py))", [("C", "_y.py")]),
    ("Note [D] in ``ac2_dist/_z.c``", [("D", "ac2_dist/_z.c")]),
])
def test_reference_scan(text, expected):
    assert [(_norm(m.group(1)), m.group(2)) for m in _REFERENCE.finditer(_flat(text))] == expected


# ---- documents not in the repository ------------------------------------------------------

# The team's internal design document is not in the repository: nothing here may cite it
# by name, path or section number ("[T]": this file does not match itself).
_INTERNAL_DOCUMENT = re.compile(r"\bCONTRAC[T]\b|shared/doc[s]|§\s*\d")
_TEXT_SUFFIXES = {".py", ".c", ".md", ".toml", ".txt", ".json", ".cfg", ".yaml", ".yml", ".sh", ""}
# The BSD license's disclaimer names liability "whether in contract, strict liability, ..."
# (in capitals): legal text, not a citation, and not ours to reword.
_NOT_SCANNED = {"LICENSE"}


def _repository_text_files() -> list[Path]:
    skip_dirs = {".git", "__pycache__", "build", "dist", "_build", "node_modules"}
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith((".ci-venv", ".venv"))
                       and not d.endswith(".egg-info") and not d.startswith((".pytest", ".ruff", ".mypy", ".hypothesis"))]
        for name in filenames:
            path = Path(dirpath) / name
            if path.suffix in _TEXT_SUFFIXES and str(path.relative_to(ROOT)) not in _NOT_SCANNED:
                out.append(path)
    return out


def test_no_text_cites_a_document_not_in_the_repository():
    files = _repository_text_files()
    names = {str(p.relative_to(ROOT)) for p in files}
    assert {"README.md", ".ci/run", "docs/dev/design.md", "ac2_dist/_policy.py", "tests/test_structure.py"} <= names
    found = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if _INTERNAL_DOCUMENT.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, ("text citing a document that is not in the repository (say the rule where it "
                       "applies instead):\n" + "\n".join(found))
