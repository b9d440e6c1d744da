"""`kvports convert` keeps a GGUF file's tokenizer (tokenizer.json) and chat template
(tokenizer_config.json) beside what it writes, so --text and --chat give the same tokens on the
converted weights as on the GGUF file."""

from __future__ import annotations

import json

import pytest

from tests.helpers.commands import run_cli

GENERATE = ["generate", "--framework", "numpy", "--mode", "cached", "--new-tokens", "4", "--json"]


def tokens(capsys, weights, *flags: str) -> list[list[int]]:
    code, out, err = run_cli(capsys, *GENERATE, "--weights", weights, *flags)
    assert code == 0, err
    return json.loads(out)["tokens"]


@pytest.mark.parametrize("to", ["safetensors", "hf"])
@pytest.mark.parametrize("flags", [("--text", "hello"), ("--chat", "hi there")], ids=["text", "chat"])
def test_converted_weights_take_text_and_chats_as_the_gguf_file_does(capsys, chat_model, tmp_path, to, flags):
    if to == "safetensors":
        out = tmp_path / "model.safetensors"
        code, _, err = run_cli(capsys, "convert", "--from-gguf", chat_model, "--out", out)
        weights = out
    else:  # a Hugging Face directory, and back
        code, _, err = run_cli(capsys, "convert", "--to-hf", chat_model, "--out", tmp_path / "hf")
        assert code == 0, err
        assert {"tokenizer.json", "tokenizer_config.json"} <= {path.name for path in (tmp_path / "hf").iterdir()}
        weights = tmp_path / "back" / "model.safetensors"
        weights.parent.mkdir()
        code, _, err = run_cli(capsys, "convert", "--from-hf", tmp_path / "hf", "--out", weights)
    assert code == 0, err
    assert {"tokenizer.json", "tokenizer_config.json"} <= {path.name for path in weights.parent.iterdir()}
    assert tokens(capsys, weights, *flags) == tokens(capsys, chat_model, *flags)
