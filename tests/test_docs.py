"""Documents that are generated from the code stay in sync with it, the tools that generate them work,
and the README tells a new user how to install right after the make commands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools import pasted_outputs, side_by_side
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


# ---------------------------------------------------------------- pasted outputs (tools/pasted_outputs.py)


@pytest.mark.parametrize("pasted", pasted_outputs.every_pasted(), ids=lambda pasted: pasted.name[:80])
def test_a_pasted_output_is_what_its_command_prints_now(pasted):
    reason = pasted_outputs.missing(pasted)
    if reason is not None:
        pytest.skip(reason)
    assert pasted_outputs.stale(pasted) is None, "regenerate it: python tools/pasted_outputs.py"


def test_every_document_with_a_pasted_command_output_has_its_marker():
    # The README's real model answer and each doc's example run are regenerated, not typed.
    marked = {pasted.document.name for pasted in pasted_outputs.every_pasted()}
    assert {"README.md", "API.md", "CHECK.md", "COMMANDS.md", "GENERATION.md"} <= marked


def test_a_pasted_output_that_no_longer_matches_is_named_with_its_line(tmp_path, monkeypatch):
    document = tmp_path / "DOC.md"
    document.write_text("<!-- output of: echo one; echo two -->\n```text\none\nthree\n```\n")
    [pasted] = pasted_outputs.find(document)
    assert pasted_outputs.stale(pasted) == "DOC.md: echo one; echo two: line 2 is now 'two' (pasted: 'three')"
    monkeypatch.setattr(pasted_outputs, "DOCUMENTS", [document])
    pasted_outputs.main([])
    assert document.read_text() == "<!-- output of: echo one; echo two -->\n```text\none\ntwo\n```\n"
    assert pasted_outputs.stale(pasted_outputs.find(document)[0]) is None


def test_a_pasted_output_differing_only_in_timings_and_widths_still_matches():
    printed = "done in 0.410 s, 698.2 tokens/s, 2.9x faster\n a    b   1e-06\n────────"
    pasted = "done in 6.543 s, 12.0 tokens/s, 14.5x faster\n a  b 1e-06\n──"
    assert pasted_outputs.normalize(printed) == pasted_outputs.normalize(pasted)
    assert pasted_outputs.normalize("max 1.4e-06") != pasted_outputs.normalize("max 9.5e-07")
    assert pasted_outputs.normalize("max 1.4e-06", numbers_vary=True) == pasted_outputs.normalize("max 9.5e-07", True)


def test_the_block_above_runs_as_python(tmp_path):
    document = tmp_path / "DOC.md"
    example = "```python\nprint(6 * 7)\n```\n\n"
    document.write_text(example + "<!-- output of: python (the block above) -->\n```text\n42\n```\n")
    [pasted] = pasted_outputs.find(document)
    assert pasted_outputs.stale(pasted) is None


def test_the_readme_opens_with_the_lesson_then_the_real_model_then_how_to_install():
    sections = re.findall(r"^## (.+)$", README.read_text(), re.M)
    lesson = ["Reading order", "Attention, three ways", "The cache, in one paragraph"]
    assert sections[:3] == lesson  # the first thing after the two make commands
    assert sections.index("A real model: SmolLM2-135M-Instruct from a GGUF file") < sections.index("Install")


def test_the_readme_says_how_to_install_from_the_clone_with_the_cpu_torch():
    readme = README.read_text()
    install = readme.index("## Install")
    section = readme[install : readme.index("\n## ", install + 1)]
    for needed in ("pip install -e '.[all]'", "--index-url https://download.pytorch.org/whl/cpu", "torch==2.13.0"):
        assert needed in section
    for extra in ("torch", "jax", "hf", "plot", "test"):
        assert f"`{extra}`" in section
