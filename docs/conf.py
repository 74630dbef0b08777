"""Sphinx configuration of ac2_dist's documentation.

    python -m sphinx -W --keep-going -n -b html docs docs/_build/html

``-W`` turns every warning into an error and ``-n`` (nitpicky) warns on every reference
that does not resolve: a broken link, a missing page, an API name that does not exist or a
docstring that does not render fails the build (CI builds it so, .ci/run). Pages are
Markdown (MyST); the API reference is generated from the docstrings (autodoc, with
napoleon for their ``Args:`` sections).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))

import ac2_dist  # noqa: E402

project = "ac2_dist"
author = "the ac2_dist authors"
copyright = "2026, the ac2_dist authors"
release = ac2_dist.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "notes_index",  # docs/_ext/notes_index.py: the design page's index of Notes, from the code
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_ext"]
root_doc = "index"

myst_heading_anchors = 3  # links to sections: page.md#a-heading
myst_enable_extensions = ["colon_fence"]

# A broken cross-page link or heading anchor is a warning (and so an error under -W).
suppress_warnings: list[str] = []

autodoc_default_options = {"members": True, "undoc-members": True}  # dataclass fields have no docstrings
autodoc_member_order = "bysource"
autodoc_typehints = "description"  # types beside each documented argument
autodoc_typehints_description_target = "documented_params"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields of the class, not a second description of each

# Nitpicky: every reference must resolve. Names from other projects (torch, transformers,
# the standard library's typing) are not documented here and the build reads no other
# site's inventory (CI has no network but PyPI), so those are exempt; any ac2_dist name
# that does not resolve still fails the build.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|nn|transformers|peft|typing|collections|contextlib|types|os|weakref|enum|dataclasses)(\..*)?"),
    (r"py:.*", r"(nn|Tensor|Module|T|Any|Callable|Iterable|Iterator|Sequence|Mapping|PathLike|ProcessGroup)"),
    (r"py:class", r"(int|float|str|bool|bytes|dict|list|tuple|set|frozenset|object|type|None|NoneType|callable)"),
    (r"py:exc", r".*"),
    (r"py:.*", r"SelectiveCheckpointContext"),  # torch's, named without its module
    # Type aliases of signatures, described in prose on the API index page.
    (r"py:class", r"(PolicyLike|PolicyFn|OpLike|ModuleSelector|Log)"),
    # Private names: implementation, not documented here. A docstring may name them for
    # contributors; a public name that does not resolve still fails the build.
    (r"py:.*", r"(.*\.)?_\w+(\..*)?"),
]

# Public-named members that only ac2 itself calls: not API users program against, so the
# reference leaves them out. When one is renamed private or removed, its entry here is
# stale and the build fails (warning below) until the entry goes too.
INTERNAL_MEMBERS = frozenset({
    "MemoryBudget.new_region_policy",
    "MemoryBudget.peak_planner",
    "MemoryBudget.budget_bytes",
    "ReplayConfig.explicit_scheduling",
    "ReplayConfig.prefetch_depth",
    "ReplayConfig.executor",
    "Offload.applies",
    "Offload.open_unit",
})


def _qualname(obj) -> str:
    obj = getattr(obj, "fget", obj)  # a property: its getter
    return getattr(obj, "__qualname__", "")


def _skip_internal(app, what, name, obj, skip, options):
    qualname = _qualname(obj)
    if qualname in INTERNAL_MEMBERS:
        app.env.ac2_internal_seen = getattr(app.env, "ac2_internal_seen", set()) | {qualname}
        return True
    return None


def _check_internal(app, exception):
    if exception is None:
        from sphinx.util import logging

        stale = sorted(INTERNAL_MEMBERS - getattr(app.env, "ac2_internal_seen", set()))
        for name in stale:
            logging.getLogger(__name__).warning(
                f"docs/conf.py INTERNAL_MEMBERS: {name} was not found in the documented API "
                "(renamed or made private?): remove its entry")


def _resolve_from_package(app, env, node, contnode):
    """A docstring of a submodule may name what the package exports without its module
    (``MemoryBudget.format_plan`` in ``ac2_dist.budget``): resolve it as ``ac2_dist.<name>``."""
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or not target or target.startswith(("ac2_dist.", "_")):
        return None
    py = env.get_domain("py")
    return py.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], "ac2_dist." + target, node, contnode)


def setup(app):
    app.connect("missing-reference", _resolve_from_package)
    app.connect("autodoc-skip-member", _skip_internal)
    app.connect("build-finished", _check_internal)

html_theme = "furo"
html_title = f"ac2_dist {release}"
html_static_path: list[str] = []
