"""Documents that are generated from the code stay in sync with it, and the tools that generate them work."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools import side_by_side
from tools.ports_doc import PORTS_MD, section
from tools.side_by_side import table

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_ports_md_tables_are_the_contracts():
    assert section() in PORTS_MD.read_text(), "regenerate them: python tools/ports_doc.py"


def test_readme_attention_table_matches_the_ports_sources():
    assert table() in README.read_text(), "regenerate it: python tools/side_by_side.py"


@pytest.mark.parametrize("name", ["KVCache", "KVCache.update", "KVCache.mask", "token_positions", "TinyModel"])
def test_side_by_side_renders_any_function_class_or_method_the_ports_share(name):
    rendered = table(name).splitlines()
    lines = side_by_side.source_lines("torch_impl", name)
    assert len(rendered) >= 2 + len(lines)  # header, separator, at least one row per reference line
    assert all(len(re.findall(r"(?<!\\)\|", row)) == 4 for row in rendered)  # three cells a row
    leaf = name.split(".")[-1]
    assert any(f"class {leaf}" in row or f"def {leaf}(" in row for row in rendered[2:5])  # after any decorators


def test_side_by_side_lists_names_that_every_port_defines():
    names = side_by_side.shared_names()
    assert {"Block.attention", "KVCache.update", "KVCache.mask", "generate_cached"} <= set(names)
    assert "KVCache.write" not in names  # JAX's alone: its immutable cache needs a helper the others do not


def test_side_by_side_gives_a_line_one_port_has_alone_a_row_of_its_own():
    rows = side_by_side.rows([["a", "same", "b"], ["a", "extra", "same", "b"], ["a", "same", "b"]])
    assert rows == [["a", "a", "a"], ["", "extra", ""], ["same", "same", "same"], ["b", "b", "b"]]


def test_side_by_side_has_help_and_refuses_a_name_not_in_every_port(capsys):
    with pytest.raises(SystemExit) as exit_info:
        side_by_side.main(["--help"])
    assert exit_info.value.code == 0 and "KVCache.update" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        side_by_side.main(["KVCache.write"])
    assert exit_info.value.code == 2
    assert "KVCache.write is not defined in torch_impl/model.py" in capsys.readouterr().err


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("document", markdown_files(), ids=lambda path: path.name)
def test_documents_point_only_inside_the_repository(document):
    text = document.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)[^)]*\)", text)  # Markdown links and images
    local = [target for target in targets if "://" not in target]
    missing = [target for target in local if not (document.parent / target).resolve().is_relative_to(ROOT)]
    missing += [target for target in local if not (document.parent / target).exists()]
    assert missing == [] and "../shared/" not in text


def test_bench_md_peers_table_is_the_committed_runs():
    from tools import peers_report

    table = peers_report.markdown(peers_report.read_runs(peers_report.RUNS))
    assert table in (ROOT / "docs" / "BENCH.md").read_text(), "regenerate it: python tools/peers_report.py"
