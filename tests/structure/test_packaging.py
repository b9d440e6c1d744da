"""What `pip install .` ships: every package of the checkout, under the kvports name."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder: name for name, folder in setuptools["package-dir"].items()}
    found = {
        ".".join([folders[init.relative_to(ROOT).parts[0]], *init.relative_to(ROOT).parts[1:-1]])
        for folder in folders
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert sorted(setuptools["packages"]) == sorted(found)
