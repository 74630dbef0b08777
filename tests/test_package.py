"""What the package ships and says about itself: version, license, typing marker."""

from __future__ import annotations

import importlib.metadata
import os
import re

import pytest

import ac2_dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject_version() -> str:
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        return re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.MULTILINE).group(1)


def test_version_is_the_distributions():
    assert ac2_dist.__version__ == importlib.metadata.version("ac2-dist") == _pyproject_version()


def test_version_of_a_checkout_never_installed(monkeypatch):
    """Without metadata (the sources on sys.path, never pip-installed) the version is the
    one pyproject.toml declares, not an error at import."""

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert ac2_dist._version() == _pyproject_version()


def test_license_changelog_and_typing_marker_are_there():
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
        assert f.readline().strip() == "BSD 3-Clause License"
    assert os.path.isfile(os.path.join(os.path.dirname(ac2_dist.__file__), "py.typed"))
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        assert f"## {ac2_dist.__version__}" in f.read(), "CHANGELOG.md has a section for this version"


@pytest.mark.parametrize("name", ac2_dist.__all__)
def test_help_of_the_package_lists_every_public_name(name):
    if name == "CheckpointPolicy":  # torch's, re-exported
        return
    assert name in ac2_dist.__doc__, f"help(ac2_dist) does not mention ac2_dist.{name}"


@pytest.mark.parametrize("numpy", ["blocked", "installed"])
def test_importing_the_package_prints_nothing(numpy, tmp_path):
    """Issue 47: without NumPy, ``import ac2_dist`` printed torch's "Failed to initialize
    NumPy" warning (torch shows it when a package, not the script, first imports it). The
    package's import is silent either way; the control, a package that imports torch
    plainly, shows that the check sees the warning where it is printed."""
    import sys

    import _hang

    block = "import sys; sys.modules['numpy'] = None; " if numpy == "blocked" else ""
    ours = _hang.run([sys.executable, "-c", block + "import ac2_dist"])
    assert ours.returncode == 0 and ours.stdout == "" and ours.stderr == "", ours.stderr
    if numpy == "blocked":
        (tmp_path / "plain").mkdir()
        (tmp_path / "plain" / "__init__.py").write_text("import torch\n")
        env = {**os.environ, "PYTHONPATH": str(tmp_path)}
        control = _hang.run([sys.executable, "-c", block + "import plain"], env=env)
        assert control.returncode == 0 and "Failed to initialize NumPy" in control.stderr, control.stderr
