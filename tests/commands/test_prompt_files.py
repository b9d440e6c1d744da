"""`--prompt-file` and `--text-file`: a prompt a line, the same tokens as the same prompts given as
flags; `-` reads standard input. (Bad lines and unreadable files: tests/bad_input/test_prompts.py.)"""

from __future__ import annotations

import json
import sys

from tests.helpers.commands import run_cli


def test_a_prompt_file_gives_the_tokens_of_the_same_prompts_as_flags(capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1,2,3\n\n4 5 6 7\r\n")  # a blank line skipped, ids by commas or spaces, CRLF
    common = ["generate", "--framework", "numpy", "--mode", "cached", "--new-tokens", "3", "--json"]
    outputs = [
        run_cli(capsys, *common, *extra)[1]
        for extra in (["--prompt-file", prompts], ["--prompt", "1,2,3", "--prompt", "4,5,6,7"])
    ]
    assert json.loads(outputs[0])["tokens"] == json.loads(outputs[1])["tokens"]


def test_a_text_file_from_stdin_is_one_prompt_a_line(capsys, chat_model, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello world\nhi\n")))
    common = ["generate", "--framework", "numpy", "--mode", "cached", "--weights", chat_model, "--json"]
    code, out, err = run_cli(capsys, *common, "--text-file", "-", "--new-tokens", "2")
    assert code == 0, err
    code, expected, err = run_cli(capsys, *common, "--text", "hello world", "--text", "hi", "--new-tokens", "2")
    assert json.loads(out)["tokens"] == json.loads(expected)["tokens"]
