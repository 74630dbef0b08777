"""CI step 3: the sdist and the wheel in DIST hold every file users need.

    python .ci/check_dist.py DIST

The wheel is built from the sdist (``python -m build``), so a file the sdist lacks is
missing from the wheel too; an optional C extension whose source is missing would only be
skipped, so its compiled module is checked in the wheel. Exits 1 naming what is missing.
"""

from __future__ import annotations

import glob
import os
import sys
import tarfile
import zipfile

SDIST = ["pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE", "ac2_dist/__init__.py", "ac2_dist/_trace/_crecord.c", "ac2_dist/py.typed",
         "ac2_dist/integrations/hf.py"]
WHEEL = ["ac2_dist/__init__.py", "ac2_dist/py.typed", "ac2_dist/distributed.py", "ac2_dist/report.py",
         "ac2_dist/integrations/hf.py", "ac2_dist/integrations/torch_checkpoint.py",
         # one module of each wing (a subpackage the build did not find would be missing whole)
         "ac2_dist/_trace/_graph.py", "ac2_dist/_plan/_peak.py", "ac2_dist/_measure/_alloc.py", "ac2_dist/_sim/_cli.py"]


def main(dist: str) -> int:
    sdists, wheels = glob.glob(os.path.join(dist, "*.tar.gz")), glob.glob(os.path.join(dist, "*.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        print(f"check_dist: expected one sdist and one wheel in {dist}, found {sdists + wheels}", file=sys.stderr)
        return 1
    with tarfile.open(sdists[0]) as t:
        in_sdist = {name.split("/", 1)[1] for name in t.getnames() if "/" in name}
    with zipfile.ZipFile(wheels[0]) as z:
        in_wheel = set(z.namelist())
    missing = [f"sdist: {name}" for name in SDIST if name not in in_sdist]
    missing += [f"wheel: {name}" for name in WHEEL if name not in in_wheel]
    if not any(n.startswith("ac2_dist/_trace/_crecord") and n.endswith((".so", ".pyd")) for n in in_wheel):
        missing.append("wheel: the compiled C recorder (ac2_dist/_trace/_crecord*.so)")
    if not any(n.endswith(("/licenses/LICENSE", ".dist-info/LICENSE")) for n in in_wheel):
        missing.append("wheel: LICENSE in its .dist-info")
    if missing:
        print("check_dist: the package is missing files:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    print(f"check_dist: {os.path.basename(sdists[0])} ({len(in_sdist)} files) and {os.path.basename(wheels[0])} "
          f"({len(in_wheel)} files) hold every file checked")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
