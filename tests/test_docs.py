"""Documents that are generated from the code stay in sync with it."""

from __future__ import annotations

from pathlib import Path

from tools.ports_doc import PORTS_MD, section
from tools.side_by_side import table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_ports_md_tables_are_the_contracts():
    assert section() in PORTS_MD.read_text(), "regenerate them: python tools/ports_doc.py"


def test_readme_attention_table_matches_the_ports_sources():
    assert table() in README.read_text(), "regenerate it: python tools/side_by_side.py"
