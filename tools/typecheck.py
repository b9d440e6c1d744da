"""mypy over kvports as it installs (kvports/shared/..., kvports/torch_impl/...), from the checkout.

pyproject maps kvports.shared to the top-level folder shared/ (and so on); mypy cannot follow
that mapping, so this lays the installed tree out as symlinks under build/typecheck, runs mypy
there with pyproject's [tool.mypy] settings, and prints the repository's own paths."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"
FOLDERS = ("shared", "torch_impl", "jax_impl", "numpy_impl")


def lay_out() -> None:
    package = TREE / "kvports"
    package.mkdir(parents=True, exist_ok=True)
    # The application's own files and folders, then the top-level folders installed under it
    own = [(path.name, path) for path in (ROOT / "kvports").iterdir() if path.name != "__pycache__"]
    for name, target in own + [(f, ROOT / f) for f in FOLDERS]:
        link = package / name
        if not link.is_symlink():
            os.symlink(os.path.relpath(target, package), link)


def main() -> int:
    lay_out()
    os.chdir(ROOT)
    stdout, stderr, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), *sys.argv[1:]])
    prefix = str(Path("build", "typecheck", "kvports")) + os.sep
    for folder in FOLDERS:  # build/typecheck/kvports/shared/x.py -> shared/x.py
        stdout = stdout.replace(prefix + folder + os.sep, folder + os.sep)
    stdout = stdout.replace(prefix, "kvports" + os.sep)  # the package root's own files
    sys.stdout.write(stdout)
    sys.stderr.write(stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
