"""The order `make test` runs its files in: tests/conftest.py's SLOWEST_FILES, the files handed to
the workers first, names files that exist, so that a renamed file cannot silently drop to the end
of the run."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def slowest_files() -> list[str]:
    """SLOWEST_FILES as tests/conftest.py spells it, read from its source (nothing imports conftest.py)."""
    for node in ast.parse((TESTS / "conftest.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SLOWEST_FILES" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("tests/conftest.py has no SLOWEST_FILES")


def test_every_file_the_suite_starts_first_exists():
    names = slowest_files()
    assert names, "SLOWEST_FILES is empty"
    assert [name for name in names if not (TESTS / name).is_file() or not Path(name).name.startswith("test_")] == []
