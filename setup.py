"""Builds the optional C recorder (Note [The plain-op path in C] in ac2_dist/_crecord.c).

Everything else is in pyproject.toml. ``optional=True``: where no C compiler is found the
install goes on without it and the tracer records in Python (same graphs, slower).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ac2_dist._crecord", ["ac2_dist/_crecord.c"], optional=True)])
