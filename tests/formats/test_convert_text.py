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


def test_tokenizer_out_is_a_folder_transformers_loads_and_encodes_as_the_gguf_tokenizer(capsys, chat_model, tmp_path):
    transformers = pytest.importorskip("transformers")
    from kvports.formats.chat import chat_ids
    from kvports.formats.gguf.tokenizer import gguf_text, gguf_tokenizer

    code, _, err = run_cli(capsys, "convert", "--from-gguf", chat_model, "--tokenizer-out", tmp_path / "tok")
    assert code == 0, err
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    ours = gguf_tokenizer(chat_model)
    for text in ["hello world", "hi there, this is hell", "or"]:
        assert loaded(text)["input_ids"] == ours.encode(text).ids
    special = gguf_text(chat_model).special
    assert loaded.eos_token == special["eos_token"]
    messages = [{"role": "user", "content": "hello"}]
    rendered = loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert loaded(rendered, add_special_tokens=False)["input_ids"] == chat_ids(chat_model, messages, ours)


def test_tokenizer_out_needs_from_gguf_and_no_out(capsys, chat_model, tmp_path):
    code, _, err = run_cli(
        capsys, "convert", "--from-gguf", chat_model, "--out", tmp_path / "m.safetensors", "--tokenizer-out", tmp_path
    )
    assert code == 2 and "--tokenizer-out goes with --from-gguf FILE, without --out" in err
