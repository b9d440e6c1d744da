"""Chat templates are code from the weights file: a template that loops, allocates, recurses or
runs without bound, divides by zero, does not parse, is not UTF-8 or renders nothing is one
`error:` line naming the file's template and the problem, in bounded time and memory; the same in
`kvports batch`'s "messages" lines. Chat text that is not Unicode (a byte that is not UTF-8 in
--chat, a lone surrogate in --chat-file) is one line too."""

from __future__ import annotations

import json

import pytest

from kvports.formats import chat
from tests.helpers.commands import assert_one_error_line, run_batch, run_cli
from tests.helpers.gguf_files import CHATML, write_gguf

TEMPLATES = {
    "range of 10**9": ("{% for i in range(10**9) %}x{% endfor %}", "uses the number 1000000000"),
    "two loops of 10**5": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "loop steps",
    ),
    "messages repeated 10**9 times": (
        "{% for m in messages * 10**9 %}{{ m.content }}{% endfor %}",
        "list of 1000000000 items",
    ),
    "a gigabyte string": ("{{ 'x' * 10**9 }}", "list of 1000000000 items"),
    "a string doubled 64 times": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "items, above",
    ),
    "a gigabyte format width": ("{{ '{:>1000000000}'.format('x') }}", "uses the number 1000000000"),
    "division by zero": ("{{ 1 // 0 }}", "ZeroDivisionError"),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recurses without end"),
    "syntax error": ("{% for %}", "(line 1): TemplateSyntaxError"),
    "not UTF-8": (b"{{ '\xff' }}", "is not UTF-8 text"),
    "renders nothing": ("{% if false %}x{% endif %}", "renders these messages as nothing"),
}


def chat_model(tmp_path, template):
    return write_gguf(tmp_path / "chat.gguf", chat_template=template)


@pytest.mark.parametrize("case", TEMPLATES)
def test_a_template_past_its_limits_is_one_error_line_naming_it(capsys, tmp_path, case):
    template, words = TEMPLATES[case]
    path = chat_model(tmp_path, template)
    argv = ("generate", "--framework", "numpy", "--mode", "cached", "--weights", path, "--chat", "hi")
    err = assert_one_error_line(*run_cli(capsys, *argv, "--new-tokens", 2))
    assert f"the chat template of GGUF file {str(path)!r}" in err and words in err


def test_a_template_past_its_time_is_one_error_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(chat, "TIME_LIMIT", 0.0)  # every deadline already passed: no clock in the test
    path = chat_model(tmp_path, TEMPLATES["two loops of 10**5"][0])
    argv = ("generate", "--framework", "numpy", "--mode", "cached", "--weights", path, "--chat", "hi")
    err = assert_one_error_line(*run_cli(capsys, *argv, "--new-tokens", 2))
    assert "runs longer than 0 seconds" in err


def test_a_batch_messages_line_meets_the_same_limits(capsys, tmp_path):
    path = chat_model(tmp_path, TEMPLATES["a gigabyte string"][0])
    code, out, err = run_batch(capsys, path, tmp_path, [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}])
    lines = err.splitlines()
    assert code == 2 and all(line.startswith("error: ") for line in lines), err  # the line's, then the batch's
    assert "line 1: the chat template" in lines[0] and "list of 1000000000 items" in lines[0]


CHAT_TEXT = {
    "a byte that is not UTF-8 in --chat": (("--chat", "caf\udce9"), "--chat 1 holds the byte 0xe9"),
    "a lone surrogate in --chat-file": (("--chat-file", None), "message 0's content holds a lone surrogate U+D800"),
}


@pytest.mark.parametrize("case", CHAT_TEXT)
def test_chat_text_that_is_not_unicode_is_one_error_line(capsys, tmp_path, case):
    (flag, value), words = CHAT_TEXT[case]
    if value is None:
        value = tmp_path / "chat.json"
        value.write_text(json.dumps([{"role": "user", "content": "\ud800"}]))  # JSON's "\ud800" escape
    path = chat_model(tmp_path, CHATML)
    argv = ("generate", "--framework", "numpy", "--mode", "cached", "--weights", path, flag, value)
    err = assert_one_error_line(*run_cli(capsys, *argv, "--new-tokens", 2))
    assert words in err
