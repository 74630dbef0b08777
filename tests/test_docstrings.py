"""Docstrings are user documentation (issue 41): what ``help()`` / pydoc shows for the public
API, and the built documentation, cite no section of a design document ("§n") and no Note of the
code ("Note [...] in _peak.py"): a fact the user needs is stated in words where they read it.
Notes are for contributors: they live in comments and in private modules' own docstrings, and
the design page (docs/dev/, whose subject they are) indexes them.

Checked here: ``help()`` of every public module of the package (found by walking it, not
listed), the docstring of every public name those modules export and of every public member
of the classes among them (wherever the class is defined: a public class of a private module
is documented under the public module that exports it), the ``#:`` attribute comments Sphinx
renders for them, the README, and the docs as Sphinx builds them.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import pydoc
import re

import pytest

import ac2_dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CITATION = re.compile(r"§\s*\d|CONTRAC[T]|Note\s+\[")  # [T]: this line does not match itself


def _public_modules() -> list[str]:
    """``ac2_dist`` and every submodule no part of whose name starts with an underscore."""
    found = [m.name for m in pkgutil.walk_packages(ac2_dist.__path__, "ac2_dist.")
             if not any(part.startswith("_") for part in m.name.split(".")[1:])]
    return ["ac2_dist", *sorted(found)]


PUBLIC_MODULES = _public_modules()


def _citations(text: str) -> list[str]:
    """The lines that cite a contract or a Note (a citation wrapped over two lines: both)."""
    lines = text.splitlines()
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line) + 1)
    found = []
    for m in _CITATION.finditer(text):
        first = next(i for i in range(len(lines)) if starts[i + 1] > m.start())
        last = next(i for i in range(len(lines)) if starts[i + 1] > m.end() - 1)
        found.append(" ".join(line.strip() for line in lines[first:last + 1]))
    return found


def _rendered(module: str) -> str:
    return pydoc.render_doc(importlib.import_module(module), renderer=pydoc.plaintext)


def _is_public(name: str) -> bool:
    return not name.startswith("_") or name == "__init__"


def _exported(module: str) -> dict[str, object]:
    """What ``help(module)`` documents: its ``__all__``, else its public names defined there."""
    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n, v in vars(mod).items() if _is_public(n) and getattr(v, "__module__", None) == module]
    return {f"{module}.{n}": getattr(mod, n) for n in names}


def _members(qualname: str, cls: type) -> dict[str, object]:
    """The public members a class defines itself (methods, properties, class methods)."""
    out: dict[str, object] = {}
    for name, value in vars(cls).items():
        if _is_public(name):
            value = getattr(value, "__func__", value)  # classmethod / staticmethod
            value = getattr(value, "fget", value)  # property
            if callable(value) or inspect.isdatadescriptor(value):
                out[f"{qualname}.{name}"] = value
    return out


def public_names() -> dict[str, object]:
    """Every public name of the package's public modules, and the public members of its
    classes, by dotted name."""
    out: dict[str, object] = {}
    for module in PUBLIC_MODULES:
        for qualname, obj in _exported(module).items():
            if not getattr(obj, "__module__", "").startswith("ac2_dist"):
                continue  # torch's names a module re-exports (CheckpointPolicy)
            out[qualname] = obj
            if inspect.isclass(obj):
                out.update(_members(qualname, obj))
    return out


def _doc_comments(obj: object) -> str:
    """The ``#:`` attribute comments in the source of a module or class (what autodoc renders
    as the attributes' documentation)."""
    try:
        lines = inspect.getsource(obj).splitlines()  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""
    return "\n".join(line.strip()[2:] for line in lines if line.strip().startswith("#:"))


@pytest.fixture(scope="module")
def built_docs(tmp_path_factory):
    """The docs built as plain text (Sphinx's text builder: the same autodoc as the HTML)."""
    build = pytest.importorskip("sphinx.cmd.build")
    out = tmp_path_factory.mktemp("docs-text")
    assert build.build_main(["-q", "-b", "text", os.path.join(ROOT, "docs"), str(out)]) == 0
    pages = {}
    for folder, _, files in os.walk(out):
        for name in files:
            page = os.path.relpath(os.path.join(folder, name), out)
            # docs/dev/: the contributors' pages, whose subject the Notes are.
            if name.endswith(".txt") and not page.startswith(("dev" + os.sep, ".")):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    pages[page] = f.read()
    assert "api" + os.sep + "ac2_dist.txt" in pages
    return pages


def test_the_check_finds_citations():
    """The check itself: a wrapped citation is found, and so is a design document's section."""
    # (the samples are split so that the design page's index of Notes does not read them)
    assert _citations("a (Note\n   [X] in y.py) b\nc") == ["a (No" "te [X] in y.py) b"]
    assert _citations("(the design, §" "2).") == ["(the design, §" "2)."]
    assert _citations("nothing to see") == []


def test_the_walk_finds_the_public_api():
    """The modules and names below are found, not listed: the walk reaches them."""
    assert {"ac2_dist.memory", "ac2_dist.budget", "ac2_dist.integrations.hf"} <= set(PUBLIC_MODULES)
    assert not any("._" in m for m in PUBLIC_MODULES)
    names = public_names()
    # a class exported from a private module, its method, a property and a function
    for name in ("ac2_dist.MemoryBudget.close", "ac2_dist.memory.RankReport", "ac2_dist.budget.MemoryBudget.budget_bytes",
                 "ac2_dist.apply_ac", "ac2_dist.replay.InlineExecutor.realize"):
        assert name in names, name
    assert "the plain replay path" in _doc_comments(names["ac2_dist.replay.InlineExecutor"])


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_help_cites_no_contract_or_note(module):
    """help(module) of every public module, and the ``#:`` comments of the module."""
    found = _citations(_rendered(module)) + _citations(_doc_comments(importlib.import_module(module)))
    assert not found, f"help({module}) cites the design contract or a Note: {found}"


def test_public_names_cite_no_contract_or_note():
    """The docstring of every public name (and public member of a public class), and the
    ``#:`` comments of every public class, wherever it is defined."""
    found = {}
    for name, obj in public_names().items():
        text = (inspect.getdoc(obj) or "") + "\n" + (_doc_comments(obj) if inspect.isclass(obj) else "")
        if lines := _citations(text):
            found[name] = lines
    assert not found, f"public docstrings cite the design contract or a Note: {found}"


def test_the_readme_and_the_built_docs_cite_no_contract_or_note(built_docs):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert not _citations(f.read())
    found = {page: _citations(text) for page, text in built_docs.items()}
    found = {page: lines for page, lines in found.items() if lines}
    assert not found, f"the built docs cite the design contract or a Note: {found}"


# ---- examples -----------------------------------------------------------------------------

_EXAMPLE = re.compile(r"^( *)Example::\s*$")
# The entry points a newcomer reads first: each docstring shows a call that runs.
WITH_EXAMPLES = ("ac2_dist.apply_ac", "ac2_dist.MemoryBudget", "ac2_dist.checkpoint", "ac2_dist.memory.track",
                 "ac2_dist.simulate.simulate", "ac2_dist.integrations.hf.enable")


def _example(doc: str) -> str | None:
    """The code block under a docstring's ``Example::`` line, dedented."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        m = _EXAMPLE.match(line)
        if m:
            indent = len(m.group(1))
            block = []
            for body in lines[i + 1:]:
                if body.strip() and len(body) - len(body.lstrip()) <= indent:
                    break
                block.append(body)
            import textwrap

            return textwrap.dedent("\n".join(block)).strip() + "\n"
    return None


def _examples() -> dict[str, str]:
    """Every public docstring's example, once per object (by its first public name)."""
    seen, out = set(), {}
    for name, obj in public_names().items():
        code = _example(inspect.getdoc(obj) or "")
        if code is not None and id(obj) not in seen:
            seen.add(id(obj))
            out[name] = code
    return out


EXAMPLES = _examples()


def test_the_entry_points_show_an_example():
    names = set(EXAMPLES)
    found = {n for n in WITH_EXAMPLES if n in names or any(public_names().get(n) is public_names().get(m) for m in names)}
    assert found == set(WITH_EXAMPLES), f"no Example:: in the docstrings of {sorted(set(WITH_EXAMPLES) - found)}"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_example_runs(name, tmp_path):
    """Each docstring's example runs as written (a fresh process, an empty directory)."""
    import sys

    import _hang

    code = EXAMPLES[name]
    if "transformers" in code:
        pytest.importorskip("transformers", reason="the example needs the 'hf' extra")
    script = tmp_path / "example.py"
    script.write_text(code)
    proc = _hang.run([sys.executable, str(script)], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, f"{name}'s example failed:\n{code}\n{proc.stderr[-3000:]}"


def test_every_exported_name_is_in_the_api_reference(built_docs):
    """Every name a module with an API page exports (its ``__all__``), data included
    (``simulate.DEVICES``), has an entry in the built reference, under that name or another
    public name of the same object (``ac2_dist.MemoryBudget`` for ``budget.MemoryBudget``)."""
    import glob

    pages = "".join(open(f, encoding="utf-8").read() for f in glob.glob(os.path.join(ROOT, "docs", "api", "*.md")))
    documented = sorted(set(re.findall(r"automodule:: ([\w.]+)", pages)))
    assert {"ac2_dist", "ac2_dist.memory", "ac2_dist.simulate"} <= set(documented)
    api = "\n".join(text for page, text in built_docs.items() if page.startswith("api" + os.sep))
    names_of: dict[int, list[str]] = {}
    for module in PUBLIC_MODULES:
        mod = importlib.import_module(module)
        for name in getattr(mod, "__all__", ()):
            names_of.setdefault(id(getattr(mod, name)), []).append(f"{module}.{name}")
    missing = []
    for module in documented:
        mod = importlib.import_module(module)
        for name in getattr(mod, "__all__", ()):
            obj = getattr(mod, name)
            if inspect.ismodule(obj) or not getattr(obj, "__module__", "ac2_dist").startswith("ac2_dist"):
                continue  # a submodule (its own page) or torch's name re-exported (CheckpointPolicy)
            if not any(re.search(rf"(^|\s){re.escape(n)}\b", api, re.MULTILINE) for n in names_of[id(obj)]):
                missing.append(f"{module}.{name}")
    assert not missing, f"exported but not in the API reference: {missing}"
