"""The index of ``Note [...]``s, generated from the code at every docs build.

A Note is a block comment or docstring paragraph that explains one design decision,
headed by its title on a line of its own::

    Note [Shutdown order]
        A gloo worker thread can ...

    # Note [The tracker keeps no graph alive]: a graph holds ...

Elsewhere the code refers to it by title (``Note [Shutdown order] in distributed.py``,
or a title shortened with ``...``). :func:`scan` finds the definitions and references;
the ``notes-index`` directive renders the table on the design page and warns (an error
in the strict build) about a reference whose Note is defined nowhere, so the index
cannot drift from the code.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = ("ac2_dist", "launch", "tests")
SUFFIXES = (".py", ".c")
# Files about Notes themselves (their examples are not Notes): the checker of references.
NOT_SCANNED = ("tests/test_structure.py",)

# A title on a line of its own (a docstring paragraph, a comment block's first line).
_HEADING = re.compile(r'^\s*(?:#+|\*|/\*|""")?\s*Note \[([^\]]+)\]\s*$')
# "Note [title]: text" opening a line (of a comment or a docstring): a definition where no
# heading defines the title (the first such line), a reference elsewhere.
_COMMENT = re.compile(r"^\s*(?:#\s*)?Note \[([^\]]+)\]:")
_ANY = re.compile(r"Note \[([^\]]+)\]")


@dataclass
class Note:
    title: str
    defined: list[str] = field(default_factory=list)  # "path:line"
    references: list[str] = field(default_factory=list)


def _files(root: str):
    for top in SOURCES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
            for name in sorted(filenames):
                if name.endswith(SUFFIXES):
                    path = os.path.join(dirpath, name)
                    rel = os.path.relpath(path, root).replace(os.sep, "/")
                    if rel not in NOT_SCANNED:
                        yield rel, path


def resolve(title: str, titles: set[str]) -> list[str]:
    """The defined titles a reference means (none: it dangles): the same title, the
    titles it shortens with ``...``, or a title that continues it after a colon
    (``Epochs`` for ``Epochs: retain_graph=True``)."""
    if title in titles:
        return [title]
    if title.endswith("..."):
        stem = title[:-3].rstrip()
        return sorted(t for t in titles if t.startswith(stem))
    return sorted(t for t in titles if t.startswith(title + ":"))


def scan(root: str = ROOT) -> tuple[list[Note], list[tuple[str, str]]]:
    """(the Notes sorted by title, dangling references as (title, "path:line"))."""
    headings: dict[str, list[str]] = {}
    comments: dict[str, list[str]] = {}
    mentions: list[tuple[str, str]] = []
    for rel, path in _files(root):
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                where = f"{rel}:{n}"
                m = _HEADING.match(line)
                if m:
                    headings.setdefault(m.group(1), []).append(where)
                    continue
                m = _COMMENT.match(line)
                if m:
                    comments.setdefault(m.group(1), []).append(where)
                mentions += [(t, where) for t in _ANY.findall(line)]
    defined = dict(headings)
    for title, places in comments.items():
        if title not in defined:
            defined[title] = places[:1]
            mentions += [(title, p) for p in places[1:]]
    notes = {t: Note(t, places) for t, places in defined.items()}
    dangling = []
    for title, where in mentions:
        targets = resolve(title, set(notes))
        if not targets:
            dangling.append((title, where))
        for target in targets:
            if where not in notes[target].defined:
                notes[target].references.append(where)
    return sorted(notes.values(), key=lambda n: n.title.lower()), dangling


def modules(root: str = ROOT) -> list[tuple[str, str, int]]:
    """(path, first sentence of its docstring or header comment, line count) of every
    module of the package, the C extension included, sorted by path."""
    import ast

    out = []
    for rel, path in _files(root):
        if not rel.startswith("ac2_dist/"):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if rel.endswith(".py"):
            doc = ast.get_docstring(ast.parse(text)) or ""
        else:  # the C extension: its first block comment
            m = re.search(r"/\*(.*?)\*/", text, re.DOTALL)
            doc = re.sub(r"^\s*\*", "", m.group(1), flags=re.MULTILINE) if m else ""
        lines = []
        for line in doc.strip().splitlines():
            if not line.strip() or line.strip().startswith(("Note [", "::")):
                break
            lines.append(line.strip())
        first = " ".join(lines).split(". ")[0].rstrip(".")
        first = re.sub(r":\w+:`~?([^`]+)`", r"\1", first)  # roles: their target's text
        first = re.sub(r"``([^`]+)``", r"\1", first)
        first = re.sub(r"\s*\(Note \[[^\]]+\](?: in [\w./]+)?\)", "", first)  # the Notes table lists them
        out.append((rel, first + "." if first else "", len(text.splitlines())))
    return out


def setup(app):  # the Sphinx extension
    from docutils import nodes
    from sphinx.util import logging
    from sphinx.util.docutils import SphinxDirective

    logger = logging.getLogger(__name__)

    def _table(widths, header, rows, literal):
        """A docutils table: ``header`` then ``rows`` (tuples of strings); ``literal`` says
        which columns are set as code."""
        table = nodes.table()
        group = nodes.tgroup(cols=len(widths))
        table += group
        for width in widths:
            group += nodes.colspec(colwidth=width)
        head, body = nodes.thead(), nodes.tbody()
        group += head
        group += body

        def row(cells, lit):
            r = nodes.row()
            for text, code in zip(cells, lit):
                entry = nodes.entry()
                entry += nodes.paragraph("", "", nodes.literal(text, text) if code else nodes.Text(text))
                r += entry
            return r

        head += row(header, [False] * len(header))
        for cells in rows:
            body += row(cells, literal)
        return table

    class NotesIndex(SphinxDirective):
        """``notes-index``: a table of every Note (title, where defined, references)."""

        def run(self):
            notes, dangling = scan()
            for title, where in dangling:
                logger.warning(f"Note [{title}] referred to at {where} is defined nowhere "
                               "(define it, or fix the reference's title)", location=self.get_location())
            rows = []
            for note in notes:
                files = sorted({w.split(":")[0] for w in note.references})
                refs = f"{len(note.references)} place(s)" + (f" in {len(files)} file(s)" if files else "")
                rows.append((note.title, ", ".join(note.defined), refs))
            table = _table((40, 35, 25), ("Note", "defined in", "referred to"), rows, (False, True, False))
            summary = nodes.paragraph("", f"{len(notes)} Notes, generated from the sources when these docs were built.")
            return [summary, table]

    class ModulesIndex(SphinxDirective):
        """``modules-index``: a table of every module of the package: its path, its line
        count and its docstring's first sentence (the one concept it holds)."""

        def run(self):
            found = modules()
            table = _table((30, 8, 62), ("module", "lines", "what it holds"),
                           [(path, str(lines), first) for path, first, lines in found], (True, False, False))
            total = sum(lines for _, _, lines in found)
            summary = nodes.paragraph("", f"{len(found)} modules, {total} lines, counted from the sources "
                                      "when these docs were built.")
            return [summary, table]

    app.add_directive("notes-index", NotesIndex)
    app.add_directive("modules-index", ModulesIndex)
    return {"version": "1", "parallel_read_safe": True}
