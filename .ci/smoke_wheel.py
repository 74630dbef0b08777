"""CI step 3: a smoke test of ac2_dist installed from its wheel, with no extras.

    cd /somewhere/outside/the/checkout && python REPO/.ci/smoke_wheel.py REPO

Checks that ac2_dist comes from site-packages (not the checkout), that importing it prints nothing, that its version is
pyproject.toml's and the metadata's, that py.typed and the C recorder are installed, that
every public name and the torch-only integration import, and that a checkpointed model
trains with eager's gradients and a memory report. Raises (exit 1) on the first failure.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import sysconfig

import torch

import ac2_dist as ac
from ac2_dist._trace import _tracer
from ac2_dist.integrations import torch_checkpoint


def main(repo: str) -> None:
    extras = [m for m in ("numpy", "matplotlib", "pytest", "transformers") if importlib.util.find_spec(m) is not None]
    assert not extras, f"the wheel's venv has packages of extras: {extras}"
    # Without numpy, the package's own import prints nothing (Note [A silent import] in _compat.py).
    quiet = subprocess.run([sys.executable, "-c", "import ac2_dist"], capture_output=True, text=True, timeout=600)
    assert quiet.returncode == 0 and not quiet.stdout and not quiet.stderr, (
        f"'import ac2_dist' printed:\n{quiet.stdout}{quiet.stderr}")
    # The venv may live inside the checkout (CI's does), so the test is where the package
    # sits, not what path it is under: in this interpreter's site-packages, and not the
    # checkout's own ac2_dist/ (an editable install or the checkout on sys.path).
    where = os.path.realpath(os.path.dirname(ac.__file__))
    site = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    assert os.path.dirname(where) in site and where != os.path.realpath(os.path.join(repo, "ac2_dist")), (
        f"ac2_dist was imported from {where}, not from the installed wheel in {sorted(site)}")
    with open(os.path.join(repo, "pyproject.toml"), encoding="utf-8") as f:
        version = re.search(r'^version = "([^"]+)"', f.read(), re.MULTILINE).group(1)
    assert ac.__version__ == importlib.metadata.version("ac2-dist") == version, (ac.__version__, version)
    assert os.path.isfile(os.path.join(where, "py.typed")), "py.typed is not installed"
    assert _tracer.C_DISPATCH is not None, "the wheel's C recorder is not in use"
    for name in ac.__all__:
        getattr(ac, name)
    assert not torch_checkpoint.is_enabled()

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(4, 16, requires_grad=True)
    model(x).sum().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ac.apply_ac(model, "recompute_all")
    with ac.memory.track(model) as tracker:
        model(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(eager, model.parameters())), "gradients differ from eager's"
    report = tracker.report()
    assert report.recomputed_ops > 0 and report.saved_bytes > 0, report
    print(f"smoke_wheel: ac2_dist {ac.__version__} from {where}: public names import, C recorder in use, "
          f"{report.recomputed_ops} ops replayed, gradients eager's")


if __name__ == "__main__":
    main(sys.argv[1])
