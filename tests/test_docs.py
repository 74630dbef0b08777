"""The README and the docs: every runnable code block runs, the set-up commands match CI.

Code blocks in ``README.md`` and ``docs/**/*.md`` carry a marker on the line before their
fence (an HTML comment: invisible on GitHub and in the built site):

- ``<!-- snippet: run -->``: a complete program, run here with ``python`` in an empty
  directory (CPU); ``needs=module[,module]`` skips it, naming the module, where that module
  is not installed (an extra);
- ``<!-- snippet: torchrun -->``: a complete torchrun script, run with 2 gloo ranks;
- ``<!-- snippet: fragment -->``: lines of a larger program; only compiled here (syntax).

Every ``python`` block must carry one: a block added without a decision fails
:func:`test_every_python_block_is_marked`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import _hang
import pytest
from _dist import run_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
ABORT_MARKERS = ("terminate called", "Fatal Python error", "Segmentation fault", "Traceback (most recent call last)")
_MARKER = re.compile(r"^<!--\s*snippet:\s*(run|torchrun|fragment)((?:\s+\w+=[\w.,-]+)*)\s*-->\s*$")
_FENCE = re.compile(r"^(```+|~~~+)\s*(\w*)")


@dataclass
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence
    lang: str
    kind: str | None  # run / torchrun / fragment; None: no marker
    options: dict[str, str]
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def markdown_files() -> list[str]:
    files = [README]
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "docs")):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(("_", ".")))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".md")]
    return files


def code_blocks(path: str) -> list[Block]:
    """The fenced code blocks of a Markdown file, each with the marker before it (if any)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2), i
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        marker = _MARKER.match(lines[prev]) if prev >= 0 else None
        options = dict(o.split("=", 1) for o in marker.group(2).split()) if marker else {}
        blocks.append(Block(os.path.relpath(path, ROOT), start + 1, lang, marker.group(1) if marker else None,
                            options, "\n".join(lines[start + 1 : j]) + "\n"))
        i = j + 1
    return blocks


ALL_BLOCKS = [b for path in markdown_files() for b in code_blocks(path)]
RUN = [b for b in ALL_BLOCKS if b.kind == "run"]
TORCHRUN = [b for b in ALL_BLOCKS if b.kind == "torchrun"]


def test_every_python_block_is_marked():
    unmarked = [b.id for b in ALL_BLOCKS if b.lang == "python" and b.kind is None]
    assert not unmarked, ("python code blocks without a '<!-- snippet: run|torchrun|fragment -->' line before "
                          f"them: {unmarked}")
    assert len(RUN) >= 8 and len(TORCHRUN) >= 2, "the README's quick starts and the guide's examples are marked"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.kind == "fragment"], ids=lambda b: b.id)
def test_fragment_is_python(block):
    compile(block.code, block.id, "exec")


def _skip_without_needs(block: Block) -> None:
    for module in filter(None, block.options.get("needs", "").split(",")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{block.id} needs {module} (an extra: pip install -e '.[hf]' for transformers)")


def _check(block: Block, proc: subprocess.CompletedProcess) -> None:
    output = proc.stdout + proc.stderr
    marker = next((m for m in ABORT_MARKERS if m in output), None)
    assert proc.returncode == 0 and marker is None, (
        f"{block.id} failed (exit status {proc.returncode}{f', {marker!r}' if marker else ''}):\n{block.code}\n"
        f"--- output ---\n{output[-4000:]}")


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.id)
def test_snippet_runs(block, tmp_path):
    _skip_without_needs(block)
    script = tmp_path / "snippet.py"
    script.write_text(block.code)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = _hang.run([sys.executable, str(script)],
                          cwd=tmp_path, env=env)
    _check(block, proc)


@pytest.mark.slow
@pytest.mark.parametrize("block", TORCHRUN, ids=lambda b: b.id)
def test_torchrun_snippet_runs_on_two_ranks(block, tmp_path):
    _skip_without_needs(block)
    script = tmp_path / "job.py"
    script.write_text(block.code)
    proc = run_torchrun(str(script), cwd=str(tmp_path))
    _check(block, proc)


def _bash_commands(path: str) -> list[str]:
    return [line.strip() for b in code_blocks(path) if b.lang == "bash" for line in b.code.splitlines() if line.strip()]


def _ci_lines() -> list[str]:
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


def test_readme_setup_commands_are_what_ci_runs():
    """The README's two set-up commands stay in sync with .ci/run: the test command is
    exactly the one step 1 runs; the main job is the one step 3 runs (CI adds --steps 2)."""
    readme = _bash_commands(README)
    ci = _ci_lines()
    test_cmd = "python -m pytest -n 2 -q"
    main_job = "torchrun --standalone --nproc-per-node 2 launch/train.py"
    assert test_cmd in readme and test_cmd in ci
    assert main_job in readme
    assert any(line.startswith(main_job) for line in ci), "CI runs the README's main job"


def test_the_quick_tier_is_what_the_readme_says():
    """The README's quick tier selects every test conftest.QUICK names (none of them stale);
    the suite CI runs includes them."""
    from conftest import QUICK

    readme = _bash_commands(README)
    assert "python -m pytest -m quick -q" in readme
    proc = _hang.run([sys.executable, "-m", "pytest", "-m", "quick", "-q", "--collect-only", "-p", "no:cacheprovider"],
                     cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    stale = [q for q in QUICK if not any(c == q or c.startswith(q + "[") for c in collected)]
    assert not stale, f"tests/conftest.py QUICK names tests that do not exist: {stale}"
    assert len(collected) >= len(QUICK)


def test_readme_is_short():
    with open(README, encoding="utf-8") as f:
        n = sum(1 for _ in f)
    assert n <= 250, f"README.md has {n} lines; move the details into docs/ (the README stays under 250)"


def test_readme_links_resolve():
    """Relative links of the README point at files that exist (the docs build checks the
    docs' own links in strict mode; GitHub renders the README outside it)."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target and not os.path.exists(os.path.join(ROOT, target)):
            missing.append(target)
    assert not missing, f"README.md links to missing files: {missing}"


def test_files_the_docs_name_exist():
    """A repository path in a code span of the README or the docs (`ac2_dist/_trace/_graph.py`,
    `launch/results/*.json`) names a file that exists: the design page's map of the modules
    cannot point at a module that moved."""
    import glob

    missing = []
    for path in markdown_files():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for name in re.findall(r"`((?:ac2_dist|launch|tests|docs|\.ci)/[\w./*-]*[\w*])`", text):
            if not glob.glob(os.path.join(ROOT, name)):
                missing.append(f"{os.path.relpath(path, ROOT)}: {name}")
    assert not missing, f"the docs name files that do not exist: {missing}"


def test_report_glossary_covers_every_field_and_row():
    """docs/guide/reports.md's glossary names every RankReport field and every row
    format_table prints, so a field added to the report cannot go unexplained."""
    from dataclasses import fields

    from ac2_dist import memory

    with open(os.path.join(ROOT, "docs", "guide", "reports.md"), encoding="utf-8") as f:
        text = f.read()
    glossary = text[text.index("## Glossary"):]
    missing = [f"field {f.name}" for f in fields(memory.RankReport) if not re.search(rf"`{f.name}[`\[]", glossary)]
    table = memory.format_table([memory.RankReport()]).splitlines()
    labels = [line.split("  ")[0].strip() if not line.startswith("  saved:") else line.split("  ")[1].strip()
              for line in table[2:] if line.strip()]
    assert "peak backward" in labels and "saved: boundary" in labels, table
    missing += [f"row {label!r}" for label in labels if f"| {label} |" not in glossary]
    assert not missing, f"the report glossary (docs/guide/reports.md) does not explain: {missing}"


def test_every_note_reference_is_defined():
    """The design page's index of Notes is generated from the code (docs/_ext/notes_index.py);
    a reference to a Note defined nowhere fails here and in the strict docs build."""
    sys.path.insert(0, os.path.join(ROOT, "docs", "_ext"))
    try:
        import notes_index
    finally:
        sys.path.pop(0)
    notes, dangling = notes_index.scan(ROOT)
    assert len(notes) > 50
    assert not dangling, f"Notes referred to but defined nowhere: {dangling}"


def _notes_index():
    sys.path.insert(0, os.path.join(ROOT, "docs", "_ext"))
    try:
        import notes_index
    finally:
        sys.path.pop(0)
    return notes_index


def test_the_design_page_lists_every_module():
    """The design page's module table (``modules-index``, generated at build time) has a row
    for every module of the package, each with its concept (a module docstring's first
    sentence) and its true line count; the page's diagram and seams name only modules that
    exist."""
    import glob

    listed = {path: (first, lines) for path, first, lines in _notes_index().modules(ROOT)}
    files = sorted(os.path.relpath(p, ROOT).replace(os.sep, "/") for ext in ("py", "c")
                   for p in glob.glob(os.path.join(ROOT, "ac2_dist", "**", f"*.{ext}"), recursive=True))
    assert sorted(listed) == files
    no_concept = [path for path, (first, _) in listed.items() if not first]
    assert not no_concept, f"modules without a docstring (or header comment) naming their concept: {no_concept}"
    for path, (_, lines) in listed.items():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            assert lines == len(f.read().splitlines()), path
    with open(os.path.join(ROOT, "docs", "dev", "design.md"), encoding="utf-8") as f:
        page = f.read()
    assert "```{modules-index}" in page
    # Every file the page names, bare (``_graph_stats.py``) or by a path (``_trace/_graph.py``,
    # ``ac2_dist/_plan/_peak.py``), and every folder (``ac2_dist/_sim/``), is in the tree.
    named = set(re.findall(r"(?<![\w/])((?:[\w]+/)*_?\w+\.(?:py|c))\b", page))
    assert {"_trace/_tracer.py", "ac2_dist/_trace/_graph.py", "_trace/_replayer.py", "_policy.py"} <= named
    not_modules = {"design.md", "test_docs.py", "test_structure.py", "test_docstrings.py", "notes_index.py"}
    unknown = sorted(n for n in named - not_modules
                     if not any(f == n or f.endswith("/" + n) for f in files)
                     and not os.path.exists(os.path.join(ROOT, n)))
    assert not unknown, f"docs/dev/design.md names modules that ac2_dist/ does not have: {unknown}"
    folders = set(re.findall(r"\bac2_dist/(?:\w+/)+", page))
    assert "ac2_dist/_sim/" in folders
    missing = sorted(p for p in folders if not os.path.isdir(os.path.join(ROOT, p)))
    assert not missing, f"docs/dev/design.md names folders that do not exist: {missing}"
