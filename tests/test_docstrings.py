"""Docstrings are user documentation (issue 41): what ``help()`` / pydoc shows for the public
API, and the built documentation, cite no design contract ("CONTRACT §n") and no Note of the
code ("Note [...] in _peak.py"). Notes are for contributors: they live in comments and in
private modules, and the design page (docs/dev/, whose subject they are) indexes them.

The docstrings of ac2_dist/memory.py, budget.py, _peak.py, _graph.py, _replayer.py and
_tracer.py still cite them: those files are being split (issue 43) and are fixed after that
lands. Their lines are told apart here (by text), so the check of everything else holds now
and the check of those files is an expected failure that must be removed once they are fixed.
"""

from __future__ import annotations

import ast
import importlib
import os
import pydoc
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PUBLIC_MODULES = [
    "ac2_dist", "ac2_dist.memory", "ac2_dist.budget", "ac2_dist.replay", "ac2_dist.offload",
    "ac2_dist.fsdp", "ac2_dist.compile", "ac2_dist.report", "ac2_dist.side_effects",
    "ac2_dist.distributed", "ac2_dist.integrations", "ac2_dist.integrations.hf",
    "ac2_dist.integrations.torch_checkpoint", "ac2_dist.simulate",
]
# Being split (issue 43): their docstrings are fixed once the split lands.
PROTECTED = ["memory.py", "budget.py", "_peak.py", "_graph.py", "_replayer.py", "_tracer.py"]

_CITATION = re.compile(r"CONTRACT|Note\s+\[")


def _norm(text: str) -> str:
    """Text as both pydoc and Sphinx's text builder may render it: no roles, quotes or
    emphasis marks, whitespace collapsed."""
    text = re.sub(r":[\w:]+:`~?([^`]*)`", r"\1", text)
    text = text.replace("\u2013", "--").replace("\u2014", "---")
    text = re.sub(r"[`\"'*\u2018\u2019\u201c\u201d|]", "", text)
    return " ".join(text.split())


def _protected_docstrings() -> str:
    """Every docstring of the protected files, normalized, one after the other."""
    docs = []
    for name in PROTECTED:
        with open(os.path.join(ROOT, "ac2_dist", name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    docs.append(_norm(doc))
    return "\n".join(docs)


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


def _split(citations: list[str]) -> tuple[list[str], list[str]]:
    """(citations from the protected files' docstrings, the others)."""
    protected = _protected_docstrings()
    ours, theirs = [], []
    for line in citations:
        text = _norm(re.sub(r"^[\w.]+ - ", "", line))  # pydoc's NAME line: "module - summary"
        (theirs if text and text in protected else ours).append(line)
    return theirs, ours


def _rendered(module: str) -> str:
    return pydoc.render_doc(importlib.import_module(module), renderer=pydoc.plaintext)


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
    """The check itself: a wrapped citation is found, and told apart by file."""
    # (the samples are split so that the design page's index of Notes does not read them)
    assert _citations("a (Note\n   [X] in y.py) b\nc") == ["a (No" "te [X] in y.py) b"]
    assert _citations("(CONTRACT §2).") == ["(CONTRACT §2)."]
    theirs, ours = _split(["not in any protected docstring (No" "te [Nothing])"])
    assert theirs == [] and ours


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_help_cites_no_contract_or_note(module):
    """help(module) of every public module: no citation outside the protected files."""
    _, ours = _split(_citations(_rendered(module)))
    assert not ours, f"help({module}) cites the design contract or a Note: {ours}"


def test_the_readme_and_the_built_docs_cite_no_contract_or_note(built_docs):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert not _citations(f.read())
    found = {page: _split(_citations(text))[1] for page, text in built_docs.items()}
    found = {page: lines for page, lines in found.items() if lines}
    assert not found, f"the built docs cite the design contract or a Note: {found}"


@pytest.mark.xfail(strict=True, reason=(
    "the docstrings of ac2_dist/memory.py, budget.py, _peak.py, _graph.py, _replayer.py and "
    "_tracer.py still cite CONTRACT / Notes: they are fixed once issue 43's split of those "
    "files lands; then remove this mark"))
def test_the_files_being_split_cite_no_contract_or_note(built_docs):
    theirs = {module: _split(_citations(_rendered(module)))[0] for module in PUBLIC_MODULES}
    theirs.update({page: _split(_citations(text))[0] for page, text in built_docs.items()})
    theirs = {where: lines for where, lines in theirs.items() if lines}
    assert not theirs, f"help() and the built docs cite the design contract or a Note: {theirs}"
