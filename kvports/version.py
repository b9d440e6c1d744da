"""The package's version, in one place: the package root, `kvports --version` and pyproject
(`[tool.setuptools.dynamic]`) read it from here."""

__version__ = "0.1.0"
