"""docs/GENERATION.md's text demo: a tiny Llama and a word-level tokenizer built locally, converted,
then a sampled, streamed, stopped generation that every framework writes the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.commands import run_cli

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

GENERATION_MD = Path(__file__).resolve().parent.parent / "docs" / "GENERATION.md"
FLAGS = ["--text", "the cat sat on the", "--new-tokens", "24", "--temperature", "0.8", "--top-k", "20", "--seed", "6"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from tools.demo_model import build

    directory = build(tmp_path_factory.mktemp("demo") / "demo-llama")
    weights = directory.parent / "demo.safetensors"
    return directory, weights


def test_the_readme_demo_streams_the_same_stopped_text_in_every_port(port, demo, capsys):
    directory, weights = demo
    if not weights.exists():
        assert run_cli(capsys, "convert", "--from-hf", directory, "--out", weights)[0] == 0
    command = ["generate", "--framework", port.NAME, "--mode", "cached", "--weights", weights, "--tokenizer", directory]
    code, out, _ = run_cli(capsys, *command, *FLAGS, "--stream")
    assert code == 0
    streamed = out.splitlines()[0]
    assert streamed.endswith("<eos>")  # stopped at the converted checkpoint's eos_token_id
    assert f"```text\n{streamed}\n" in GENERATION_MD.read_text()  # docs/GENERATION.md's pasted output starts with it
    code, out, _ = run_cli(capsys, *command, *FLAGS, "--json")
    result = json.loads(out)
    assert result["finish_reason"] == ["stop"] and result["text"] == ["the cat sat on the " + streamed]
