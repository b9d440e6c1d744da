"""Request files (`kvports batch --requests`) refused line by line: a line nested too deep, a line
without an id taking another's number, an id used twice, a chat ("messages") that is not a list
of messages or has no GGUF file to render it. Each bad line is one `error: line N:` line, and the
rest run. Lines are split where JSONL splits them, at newlines alone."""

from __future__ import annotations

import json

from kvports.batching.request_file import parse_requests, split_lines
from kvports.shared.config import ModelConfig
from tests.helpers.commands import batch, requests_file, run_batch, run_cli


def test_a_request_line_nested_too_deep_is_one_bad_line(tmp_path, capsys, port):
    path = requests_file(tmp_path, "[" * 200_000 + "]" * 200_000, '{"prompt": [1, 2, 3]}')
    code, out, err = batch(capsys, port, "--requests", path, "--new-tokens", "2")
    assert code == 2 and err == "error: line 1: not valid JSON (nested too deeply)\n", err
    assert [json.loads(line).get("id") for line in out.splitlines()][:1] == ["2"]


def test_a_raw_line_separator_inside_a_json_string_does_not_end_the_line(tmp_path, capsys, port):
    """U+2028 may stand raw in a JSON string; str.splitlines would cut the line there."""
    line = json.dumps({"id": "a\u2028b\u0085c", "prompt": [1, 2, 3]}, ensure_ascii=False)
    code, out, err = batch(capsys, port, "--requests", requests_file(tmp_path, line), "--new-tokens", "2")
    assert (code, err) == (0, "")
    assert json.loads(out.splitlines()[0])["id"] == "a\u2028b\u0085c"


def test_request_lines_are_split_at_newlines_alone():
    assert split_lines('{"id": "a\u2028b"}\n\n{"id": "\x1c"}\r\n') == ['{"id": "a\u2028b"}', "", '{"id": "\x1c"}\r', ""]


def test_a_line_without_an_id_keeps_its_number_and_the_line_that_takes_it_is_refused():
    lines = ['{"id": 3, "prompt": [1]}', '{"prompt": [2]}', '{"prompt": [3]}', '{"id": "2", "prompt": [4]}']
    requests, bad = parse_requests(lines, ModelConfig(), default_new_tokens=2)
    assert [(request.id, request.prompt) for request in requests] == [("2", (2,)), ("3", (3,))]
    assert [str(line) for line in bad] == [
        "line 1: id '3' is line 3's (a line without an id is named by its number)",
        "line 4: id '2' is line 2's (a line without an id is named by its number)",
    ]


def test_an_id_a_bad_line_would_have_had_is_free_and_a_repeated_id_names_its_first_line():
    lines = ['{"id": 2, "prompt": [1]}', '{"prompt": []}', '{"id": "x", "prompt": [1]}', '{"id": "x", "prompt": [1]}']
    requests, bad = parse_requests(lines, ModelConfig(), default_new_tokens=2)
    assert [request.id for request in requests] == ["2", "x"]
    assert [str(line) for line in bad][1] == "line 4: id 'x' is already used by line 3"


# --- chats ----------------------------------------------------------------------------------------


BAD_MESSAGES = [
    ({"messages": "hello"}, "'messages' must hold a non-empty JSON list"),
    ({"messages": []}, "'messages' must hold a non-empty JSON list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "message 0 has role 'robot'"),
    ({"messages": [{"role": "user"}]}, "message 0 is"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt": [1]}, "give exactly one of 'prompt'"),
    ({"messages": [{"role": "user", "content": "x" * (2**20 + 1)}]}, "above 1048576"),
]


def test_bad_messages_lines_are_one_error_each_and_the_rest_run(capsys, chat_model, tmp_path):
    good = {"id": "good", "messages": [{"role": "user", "content": "hi"}]}
    code, lines, err = run_batch(capsys, chat_model, tmp_path, [line for line, _ in BAD_MESSAGES] + [good])
    assert code == 2
    assert [line["id"] for line in lines[:-1]] == ["good"]
    errors = err.splitlines()
    assert len(errors) == len(BAD_MESSAGES)
    for number, (error, (_, words)) in enumerate(zip(errors, BAD_MESSAGES, strict=True), start=1):
        assert error.startswith(f"error: line {number}: ") and words in error, error


def test_messages_without_a_gguf_file_say_what_they_need(capsys, tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" + '{"prompt": [1]}\n')
    code, out, err = run_cli(capsys, "batch", "--framework", "numpy", "--requests", requests, "--new-tokens", "2")
    assert code == 2
    assert err.splitlines()[0] == (
        "error: line 1: 'messages' renders a GGUF file's chat template: give --model NAME or --weights FILE.gguf"
    )
