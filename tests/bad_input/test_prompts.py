"""Prompts and text kvports refuses: token ids outside the vocabulary or not integers, empty
prompts, prompts too long for the model, the seed's default prompt outside another model's
vocabulary, prompt files with bad lines or that cannot be read, a tokenizer smaller than the
vocabulary or too large to read, text that is not UTF-8. One `error:` line naming the value, the
same in every framework, mode and command, before any port loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvports.registry import PORTS
from tests.helpers.commands import assert_one_error_line, generate, refusals_in_every_framework, run_cli
from tests.helpers.weights_files import MiB, sparse

PROMPT_CASES = {
    "id_too_large": (["--prompt", "1,500,3"], "token id 500 in prompt 0 is outside [0, 500)"),
    "negative_id": (["--prompt", "1,-1,3"], "token id -1 in prompt 0 is outside [0, 500)"),
    "non_integer": (["--prompt", "1,2.5,3"], "prompt token '2.5' is not an integer"),
    "word": (["--prompt", "hello"], "prompt token 'hello' is not an integer"),
    "underscore": (["--prompt", "1_0"], "prompt token '1_0' is not an integer"),
    "arabic_indic_digits": (["--prompt", "\u0661\u0662"], "is not an integer"),
    "fullwidth_digits": (["--prompt", "\uff11\uff12"], "is not an integer"),
    "thousands_of_digits": (["--prompt", "9" * 5000], "has 5000 digits: no token id is that long"),
    "empty": (["--prompt", ""], "empty prompt"),
    "stray_comma": (["--prompt", "1,,2"], "empty token id"),
    "zero_new_tokens": (["--new-tokens", "0"], "error: --new-tokens 0 is below 1"),
    "negative_new_tokens": (["--new-tokens", "-3"], "error: --new-tokens -3 is below 1"),
    "new_tokens_with_underscore": (["--new-tokens", "1_0"], "invalid int value: '1_0'"),
    "fullwidth_temperature": (["--temperature", "\uff11"], "invalid number"),
    "infinite_temperature": (["--temperature", "inf"], "temperature inf must be a finite number >= 0"),
    "too_long": (
        ["--prompt", "1,2,3", "--new-tokens", "510"],
        "prompt length 3 + new tokens 510 = 513 exceeds max_seq_len 512",
    ),
}


@pytest.mark.parametrize("case", sorted(PROMPT_CASES))
def test_bad_prompt_is_the_same_error_for_every_framework(capsys, no_port_may_load, case):
    extra, expected = PROMPT_CASES[case]
    messages = set()
    for framework in PORTS:
        for mode in ("naive", "cached"):
            err = assert_one_error_line(*run_cli(capsys, "generate", "--framework", framework, "--mode", mode, *extra))
            assert expected in err, err
            messages.add(err)
    assert len(messages) == 1


@pytest.mark.parametrize("case", sorted(PROMPT_CASES))
def test_bad_prompt_is_refused_by_compare_too(capsys, no_port_may_load, case):
    extra, expected = PROMPT_CASES[case]
    assert expected in assert_one_error_line(*run_cli(capsys, "compare", *extra))


def test_a_refused_value_is_echoed_short(capsys, no_port_may_load):
    err = refusals_in_every_framework(capsys, "--prompt", "1," + "9" * 5000)
    assert len(err) < 200


@pytest.mark.parametrize("command", ["generate", "compare"])
def test_the_seeds_default_prompt_outside_another_vocabulary_says_to_give_a_prompt(
    capsys, no_port_may_load, tmp_path, command
):
    from kvports.formats.weights import gpt2_init_weights, save_weights
    from tests.helpers.models import TINY_FAMILIES

    config = TINY_FAMILIES["gpt2"]  # a vocabulary of 64
    weights = tmp_path / "tiny.safetensors"
    save_weights(weights, gpt2_init_weights(config), config)
    argv = [command, "--weights", weights] + (["--framework", "numpy", "--mode", "cached"] * (command == "generate"))
    err = assert_one_error_line(*run_cli(capsys, *argv))
    assert err.endswith(f"outside this model's vocabulary [0, {config.vocab_size}): give --prompt IDS or --text TEXT\n")


# --- prompt files ---------------------------------------------------------------------------------


def test_each_bad_line_of_a_prompt_file_is_its_own_error_line(capsys, no_port_may_load, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1,2,3\nx 1\n4\n1,-\n")
    code, out, err = run_cli(capsys, "generate", "--framework", "numpy", "--mode", "cached", "--prompt-file", prompts)
    assert (code, out) == (2, "")
    assert err == (
        "error: --prompt-file line 2: prompt token 'x' is not an integer\n"
        "error: --prompt-file line 4: prompt token '-' is not an integer\n"
    )


@pytest.mark.parametrize(
    "content, words",
    [
        (b"\n\n", "has no line to run"),
        (b"\xff\xfe", "is not UTF-8 text"),
        (b"1," * (2**23 + 1), "holds more than 16.0 MiB, the most --prompt-file reads"),
    ],
)
def test_a_prompt_file_that_cannot_be_read_is_one_error_line(capsys, no_port_may_load, tmp_path, content, words):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(content)
    argv = ["generate", "--framework", "numpy", "--mode", "cached", "--prompt-file", prompts]
    assert words in assert_one_error_line(*run_cli(capsys, *argv))


# --- text and its tokenizer -----------------------------------------------------------------------


@pytest.fixture
def seed_tokenizer(tmp_path):
    """A word-level tokenizer.json: word w{i} is id i, for the first `size` ids."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    def make(size: int) -> Path:
        tokenizer = tokenizers.Tokenizer(WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
        tokenizer.pre_tokenizer = Whitespace()
        folder = tmp_path / f"tokenizer{size}"
        folder.mkdir()
        tokenizer.save(str(folder / "tokenizer.json"))
        return folder

    return make


def test_a_tokenizer_smaller_than_the_vocabulary_is_refused(capsys, no_port_may_load, seed_tokenizer):
    err = refusals_in_every_framework(capsys, "--tokenizer", seed_tokenizer(10), "--text", "w1 w2")
    assert "the tokenizer has no token for id 10 (it knows 10 of the model's vocab_size 500)" in err


def test_text_that_is_not_utf8_is_refused(capsys, no_port_may_load, seed_tokenizer):
    not_utf8 = b"w1 \xff".decode("utf-8", "surrogateescape")  # what Python makes of such bytes in argv
    err = refusals_in_every_framework(capsys, "--tokenizer", seed_tokenizer(500), "--text", not_utf8)
    assert "is not valid UTF-8" in err


def test_a_tokenizer_json_past_the_memory_limit_is_refused_unread(tmp_path, capsys, monkeypatch, port):
    pytest.importorskip("tokenizers")
    monkeypatch.setenv("KVPORTS_MAX_BYTES", "1M")
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    sparse(folder / "tokenizer.json", 2 * MiB)
    err = generate(capsys, port, "--tokenizer", folder, "--text", "w1")
    assert "tokenizer file 2.0 MiB, parsed tokenizer file 20.0 MiB" in err and "above the limit of 1.0 MiB" in err, err


# ---------------------------------------------------------------- one rule, every front door

BAD_PROMPT = [1, 999, 3]  # 999: outside the seed model's vocabulary of 500
FRONT_DOORS = {
    "command line": "token id 999 in prompt 0 is outside [0, 500) (vocab_size 500)",
    "api": "token id 999 in prompt 0 is outside [0, 500) (vocab_size 500)",
    "batch line": "line 1: prompt token 999 is outside [0, 500) (vocab_size 500)",
    "server": "'prompt' token 999 is outside [0, 500) (vocab_size 500)",
}


def refusal_at(door: str, capsys: pytest.CaptureFixture, tmp_path: Path) -> str:
    """What `door` answers the bad prompt with: its one message."""
    import kvports
    from kvports.formats.weights import DEFAULT_WEIGHTS, open_weights
    from kvports.server.schemas import ApiError, Limits, check_body

    if door == "command line":
        argv = ["generate", "--framework", "numpy", "--mode", "cached", "--prompt", ",".join(map(str, BAD_PROMPT))]
        return assert_one_error_line(*run_cli(capsys, *argv))[7:-1]
    if door == "api":
        with pytest.raises(kvports.UserError) as refused:
            kvports.load("numpy").generate(BAD_PROMPT, new_tokens=2)
        return str(refused.value)
    if door == "batch line":
        requests = tmp_path / "requests.jsonl"
        requests.write_text(f'{{"prompt": {BAD_PROMPT}, "max_new_tokens": 2}}\n')
        code, _, err = run_cli(capsys, "batch", "--requests", requests, "--framework", "numpy")
        assert code == 2
        return err.splitlines()[0].removeprefix("error: ")  # the bad line's; then that no line is left to run
    with open_weights(DEFAULT_WEIGHTS) as file:
        limits = Limits("seed", file.config.vocab_size, file.config.max_seq_len, (), file.config)
    with pytest.raises(ApiError) as refused:
        check_body({"model": "seed", "prompt": BAD_PROMPT, "max_tokens": 2}, limits, False, None, None)
    assert (refused.value.status, refused.value.param) == (400, "prompt")
    return refused.value.message


@pytest.mark.parametrize("door", FRONT_DOORS)
def test_one_prompt_rule_refuses_the_same_prompt_at_every_front_door_in_its_own_words(capsys, tmp_path, door):
    assert refusal_at(door, capsys, tmp_path) == FRONT_DOORS[door]
