"""How long a function may be: a reader holds a function in view. None in kvports/ is over 120
lines, none in the bench over 80 (the issue that split the run layer and the bench set both)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMITS = {"kvports": 120, "kvports/bench": 80}  # lines, from `def` to its last line


def longest_functions(folder: str, limit: int, root: Path = ROOT) -> dict[str, int]:
    """Every function under `folder` longer than `limit` lines: "path:name" -> its lines."""
    found = {}
    for path in sorted((root / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    found[f"{path.relative_to(root).as_posix()}:{node.name}"] = lines
    return found


def test_no_application_function_is_longer_than_its_folders_limit():
    assert {folder: longest_functions(folder, limit) for folder, limit in LIMITS.items()} == dict.fromkeys(LIMITS, {})


def test_the_size_check_finds_a_long_function_and_passes_one_at_the_limit(tmp_path):
    (tmp_path / "kvports").mkdir()
    (tmp_path / "kvports" / "long.py").write_text("def long():\n" + "    x = 1\n" * 120)
    (tmp_path / "kvports" / "short.py").write_text("def short():\n" + "    x = 1\n" * 119)
    assert longest_functions("kvports", 120, tmp_path) == {"kvports/long.py:long": 121}
