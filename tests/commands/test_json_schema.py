"""`kvports generate --json-schema FILE`: each answer is JSON that follows the schema, the same tokens
in every port (through the batching engine, whose steps mask each row's logits to its grammar), and
a bad file, a schema llguidance cannot follow or a mode other than cached is one error line."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from kvports.cli import main
from kvports.registry import PORTS
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.ports import port_or_skip

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def schema_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("schema") / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    return path


def generate(capsys, chat_model, framework, schema, *more):
    return run_cli(
        capsys,
        "generate",
        "--framework",
        framework,
        "--mode",
        "cached",
        "--weights",
        chat_model,
        "--text",
        "hi",
        "--new-tokens",
        "30",
        "--json-schema",
        schema,
        *more,
    )


@pytest.fixture(scope="module")
def answers(chat_model, schema_file):
    """Each port's --json output, greedy and sampled (two rows, seeded): module-scoped, so capsys is not
    at hand and the command's output is captured here."""
    found = {}
    for framework in PORTS:
        port_or_skip(framework)
        for how in (("--temperature", "0"), ("--temperature", "1", "--seed", "4", "--num-samples", "2")):
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                argv = ["generate", "--framework", framework, "--mode", "cached", "--weights", chat_model]
                argv += ["--text", "hi", "--new-tokens", "30", "--json-schema", schema_file, "--json", *how]
                assert main([str(arg) for arg in argv]) == 0
            found[framework, how[1]] = json.loads(out.getvalue())
    return found


def test_every_answer_is_json_that_follows_the_schema(answers):
    for output in answers.values():
        assert output["finish_reason"] == ["stop"] * len(output["answer"])
        for answer in output["answer"]:
            parsed = json.loads(answer)
            assert set(parsed) == {"ok", "n"} and isinstance(parsed["ok"], bool) and 0 <= parsed["n"] <= 9


def test_every_port_gives_the_same_tokens(answers):
    for (framework, temperature), output in answers.items():
        assert output["tokens"] == answers[PORTS[0], temperature]["tokens"], framework


@pytest.mark.parametrize(
    "content, expected",
    [
        ('{"type":', "is not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"type": "objekt"}', "--json-schema is not one structured output can follow"),
        ('{"type": "object", "minimum": NaN}', "is not valid JSON"),
    ],
)
def test_a_bad_schema_file_is_one_error_line(capsys, chat_model, tmp_path, content, expected):
    path = tmp_path / "bad.json"
    path.write_text(content)
    line = assert_one_error_line(*generate(capsys, chat_model, "numpy", path))
    assert expected in line


def test_a_folder_or_a_missing_file_is_one_error_line(capsys, chat_model, tmp_path):
    for path in (tmp_path, tmp_path / "missing.json"):
        assert "is not a regular file" in assert_one_error_line(*generate(capsys, chat_model, "numpy", path))


def test_a_mode_other_than_cached_is_one_error_line(capsys, chat_model, schema_file):
    code, out, err = run_cli(
        capsys, "generate", "--framework", "numpy", "--mode", "naive", "--weights", chat_model, "--text", "hi",
        "--new-tokens", "8", "--json-schema", schema_file,
    )  # fmt: skip
    assert "runs in --mode cached only" in assert_one_error_line(code, out, err)
