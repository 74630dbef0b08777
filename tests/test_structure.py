"""The house rules the code itself can check (issue 43): no import circle inside
``ac2_dist/`` or ``launch/``, no room past ``MAX_LINES``, and every ``Note [...]``
reference names a Note that exists where it says.

What counts as an import circle: a cycle in the graph whose edges are the imports a
module of the package runs, at module level *or* inside a function (a deferred import
still makes the importer depend on the imported room: neither could be read or changed
alone). Imports under ``if TYPE_CHECKING:`` do not count: they never run (every module
has ``from __future__ import annotations``), they only name types for annotations.
Importing a submodule also imports its parent package; that implicit edge is not one
of the module's own and is not counted either.
"""

from __future__ import annotations

import ast
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


def _runtime_imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement that can run, with whether it runs at module level; the
    bodies of ``if TYPE_CHECKING:`` are skipped (their ``else`` is not)."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def walk(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for c in child.orelse:
                    walk_stmt(c, top)
                continue
            walk_stmt(child, top)

    def walk_stmt(child: ast.AST, top: bool) -> None:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.append((child, top))
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            walk(child, False)
        else:
            walk(child, top)

    walk(tree, True)
    return found


def package_import_graph(root: Path) -> dict[str, dict[str, list[str]]]:
    """``{importer: {imported: ["line N (module level|in a function)", ...]}}`` over the
    modules of the package at ``root`` (runtime imports only, see the module docstring)."""
    modules = _package_modules(root)
    graph: dict[str, dict[str, list[str]]] = {name: defaultdict(list) for name in modules}
    for name, path in modules.items():
        if path.suffix != ".py":
            continue
        is_pkg = path.name == "__init__.py"
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        for node, top in _runtime_imports(ast.parse(path.read_text(), str(path))):
            where = f"line {node.lineno} ({'module level' if top else 'in a function'})"
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
        for node, top in _runtime_imports(ast.parse(path.read_text(), str(path))):
            where = f"line {node.lineno} ({'module level' if top else 'in a function'})"
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


def test_no_import_circle_in_the_package():
    graph = package_import_graph(PACKAGE)
    # The walk sees the package's imports (a module-level one, a deferred one), so an
    # empty answer below is not a walk that found nothing.
    assert "ac2_dist._nodes" in graph["ac2_dist._graph"]
    assert graph["ac2_dist._tracer"]["ac2_dist._crecord"] == [f"line {_line_of('_tracer.py', 'from . import _crecord')} (in a function)"]
    found = circles(graph)
    assert not found, "import circles in ac2_dist/ (TYPE_CHECKING imports excluded):\n" + "\n".join(
        _describe(graph, c) for c in found)


def test_no_import_circle_in_launch():
    graph = script_import_graph(LAUNCH)
    assert "models" in graph["bench_core"]
    found = circles(graph)
    assert not found, "import circles in launch/:\n" + "\n".join(_describe(graph, c) for c in found)


def test_the_circle_check_catches_a_circle(tmp_path):
    """A package with a circle through a deferred import, one through a module-level
    import, and a TYPE_CHECKING-only back edge that is no circle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
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
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = package_import_graph(pkg)
    assert graph["pkg.c"] == {}  # TYPE_CHECKING only
    assert graph["pkg.sub.e"].keys() == {"pkg.sub.f", "pkg.sub.g"}  # ``from ..sub import f``: the submodule
    assert circles(graph) == [["pkg.a", "pkg.b"], ["pkg.sub.e", "pkg.sub.g"]]
    assert "pkg.b imports pkg.a at line 2 (in a function)" in _describe(graph, ["pkg.a", "pkg.b"])


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


def _flat(text: str) -> str:
    """The file's lines joined, comment markers and indentation dropped: a reference
    wrapped over two comment lines reads as one."""
    return " ".join(_COMMENT_MARK.sub("", line.strip()) for line in text.splitlines())


def _norm(name: str) -> str:
    return " ".join(name.split())


def _notes() -> dict[Path, set[str]]:
    notes = {}
    for p in _sources():
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
    return [p for p in _sources() if p.parts[-len(parts):] == parts]


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
