"""The README's side-by-side attention table is generated from the ports' sources."""

from __future__ import annotations

from pathlib import Path

from tools.side_by_side import table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_attention_table_matches_the_ports_sources():
    assert table() in README.read_text(), "regenerate it: python tools/side_by_side.py"
