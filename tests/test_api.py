"""The Python API (`kvports.load`, `Model.generate`): the command line's results, and every bad
input the command line refuses refused with the command line's message."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvports
from kvports import cli, generating, registry
from kvports.formats.weights import save_weights
from kvports.shared.config import ModelConfig
from tests.helpers.commands import api_message, run_cli
from tests.helpers.models import GOLDEN, SEED, SEED_PROMPT, random_weights
from tests.helpers.ports import port_or_skip


@pytest.fixture(scope="module", params=registry.PORTS)
def model(request):
    """Each framework's model of the seed, loaded once."""
    port_or_skip(request.param)
    return kvports.load(request.param)


def cli_message(capsys, *argv: object) -> str:
    """What the command line says after `error: ` (argparse's usage errors: its last line)."""
    try:
        code = cli.main([str(arg) for arg in argv])
    except SystemExit as exit_info:
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2, err
    return err.strip().splitlines()[-1].split("error: ", 1)[1]


# ---------------------------------------------------------------- what it gives


def test_generate_gives_the_golden_tokens_in_every_framework(model):
    out = model.generate(SEED, new_tokens=10)
    assert out.generated == [GOLDEN[:10]] and out.tokens == [SEED + GOLDEN[:10]] and out.finish_reason == ["length"]
    assert out.logits is None and out.speculative is None and out.seconds > 0


def test_generate_gives_what_the_command_line_gives(model, capsys):
    argv = ["generate", "--framework", model.framework, "--mode", "naive", "--json", "--new-tokens", "6"]
    argv += ["--prompt", "1,2,3", "--prompt", "7,8", "--temperature", "0.8", "--top-k", "5", "--seed", "3"]
    expected = json.loads(run_cli(capsys, *argv)[1])
    out = model.generate([[1, 2, 3], [7, 8]], 6, "naive", temperature=0.8, top_k=5, seed=3)
    assert (out.tokens, out.finish_reason) == (expected["tokens"], expected["finish_reason"])


def test_prompts_may_be_one_row_a_batch_text_or_an_array(model):
    expected = model.generate([SEED], new_tokens=3).tokens
    assert model.generate(SEED, new_tokens=3).tokens == expected
    assert model.generate("160,248,104,209,394", new_tokens=3).tokens == expected
    assert model.generate(SEED_PROMPT, new_tokens=3).tokens == expected
    assert model.generate(None, new_tokens=3).tokens == expected  # the seed's prompt, as the command line


def test_logits_and_speculative_counts_when_asked_for(model):
    assert model.generate(SEED, 4, return_logits=True).logits.shape == (1, 4, 500)
    out = model.generate(SEED, 4, "speculative", draft="ngram", draft_tokens=2)
    assert out.generated == [GOLDEN[:4]] and out.speculative["draft_tokens"] == 2


def test_on_token_hears_each_token(model):
    heard = []
    model.generate(SEED, 3, on_token=lambda token: heard.append(int(token[0])))
    assert heard == GOLDEN[:3]


def test_stop_ids_end_a_row_and_an_empty_list_means_none(model):
    out = model.generate(SEED, 10, stop_ids=[GOLDEN[2]])
    assert out.generated == [GOLDEN[:3]] and out.finish_reason == ["stop"]
    assert model.generate(SEED, 3, stop_ids=[]).finish_reason == ["length"]


# ---------------------------------------------------------------- what it refuses


# (the command line's flags for `generate`, the same input as the API's generate() keywords)
GENERATE_CASES = {
    "id_too_large": (["--prompt", "1,500,3"], dict(prompts=[1, 500, 3])),
    "negative_id": (["--prompt", "1,-1,3"], dict(prompts=[1, -1, 3])),
    "non_integer_id": (["--prompt", "1,2.5,3"], dict(prompts=[1, 2.5, 3])),
    "word": (["--prompt", "hello"], dict(prompts="hello")),
    "empty_prompt": (["--prompt", ""], dict(prompts=[])),
    "empty_row": (["--prompt", "1,2", "--prompt", ""], dict(prompts=[[1, 2], []])),
    "stray_comma": (["--prompt", "1,,2"], dict(prompts="1,,2")),
    "too_long": (["--prompt", "1,2,3", "--new-tokens", "510"], dict(prompts=[1, 2, 3], new_tokens=510)),
    "zero_new_tokens": (["--new-tokens", "0"], dict(new_tokens=0)),
    "negative_new_tokens": (["--new-tokens", "-3"], dict(new_tokens=-3)),
    "word_new_tokens": (["--new-tokens", "ten"], dict(new_tokens="ten")),
    "fractional_new_tokens": (["--new-tokens", "2.5"], dict(new_tokens=2.5)),
    "mode": (["--mode", "fast"], dict(mode="fast")),
    "negative_temperature": (["--temperature", "-1"], dict(temperature=-1)),
    "nan_temperature": (["--temperature", "nan"], dict(temperature=float("nan"))),
    "negative_top_k": (["--top-k", "-1"], dict(top_k=-1)),
    "zero_top_p": (["--top-p", "0"], dict(top_p=0)),
    "negative_seed": (["--seed", "-1"], dict(seed=-1)),
    "stop_id_outside_vocab": (["--stop-id", "600"], dict(stop_ids=[600])),
    "speculative_without_draft": (["--mode", "speculative"], dict(mode="speculative")),
    "zero_draft_tokens": (
        ["--mode", "speculative", "--draft", "ngram", "--draft-tokens", "0"],
        dict(mode="speculative", draft="ngram", draft_tokens=0),
    ),
    "too_many_draft_tokens": (
        ["--mode", "speculative", "--draft", "ngram", "--draft-tokens", "17"],
        dict(mode="speculative", draft="ngram", draft_tokens=17),
    ),
    "missing_draft_file": (
        ["--mode", "speculative", "--draft", "/no/such/draft.safetensors"],
        dict(mode="speculative", draft="/no/such/draft.safetensors"),
    ),
}


TEMPERATURE_RULE = (
    " must be a finite number >= 0 (0 means greedy; else in [1e-12, 1e+18]: logits divided by less lose their "
    "exactness in float64, and the ports their agreement)"
)

# Where the command line's message names a flag (or is argparse's), the API's names its own argument.
API_MESSAGES = {
    "non_integer_id": "token id 2.5 in prompt 0 is not an integer",
    "empty_row": "prompt 1 is empty: give at least one token id",
    "zero_new_tokens": "new_tokens=0 is below 1",
    "negative_new_tokens": "new_tokens=-3 is below 1",
    "word_new_tokens": "new_tokens='ten' is not an integer",
    "fractional_new_tokens": "new_tokens=2.5 is not an integer",
    "too_long": "prompt length 3 + new_tokens=510 = 513 exceeds max_seq_len 512",
    "mode": "mode='fast' is not one of naive, cached, speculative",
    "negative_temperature": "temperature=-1" + TEMPERATURE_RULE,
    "nan_temperature": "temperature=nan" + TEMPERATURE_RULE,
    "negative_top_k": "top_k=-1 must be >= 0",
    "zero_top_p": "top_p=0 must be in (0, 1] (1 means no nucleus filter)",
    "negative_seed": "seed=-1 must be in [0, 18446744073709551615]",
    "stop_id_outside_vocab": "stop_ids=600 must be in [0, 499]",
    "speculative_without_draft": "mode='speculative' needs draft= a smaller model's weights file, or draft='ngram'",
    "zero_draft_tokens": "draft_tokens=0 is below 1",
    "too_many_draft_tokens": "draft_tokens=17 is above 16",
}


def mode_of(flags: list[str]) -> list[str]:
    return [] if "--mode" in flags else ["--mode", "cached"]


@pytest.mark.parametrize("case", sorted(GENERATE_CASES))
def test_generate_refuses_what_the_command_line_refuses_naming_its_own_arguments(model, capsys, case):
    flags, keywords = GENERATE_CASES[case]
    expected = cli_message(capsys, "generate", "--framework", model.framework, *mode_of(flags), *flags)
    message = api_message(lambda: model.generate(**keywords))
    assert message == API_MESSAGES.get(case, expected) and "--" not in message


def test_a_draft_with_another_vocabulary_is_refused_with_the_command_lines_message(model, capsys, tmp_path):
    config = ModelConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=1, max_seq_len=128)
    draft = tmp_path / "draft.safetensors"
    save_weights(draft, random_weights(config), config)
    flags = ["--mode", "speculative", "--draft", draft]
    expected = cli_message(capsys, "generate", "--framework", model.framework, *flags)
    assert api_message(lambda: model.generate(mode="speculative", draft=draft)) == expected
    assert "vocab_size 64 differs" in expected


# (the command line's flags, the same input as load()'s arguments, and the API's message where it names one)
LOAD_CASES = {
    "framework": (
        ["--framework", "tensorflow"],
        dict(framework="tensorflow"),
        "framework='tensorflow' is not one of torch, jax, numpy",
    ),
    "dtype": (
        ["--dtype", "float16"],
        dict(dtype="float16"),
        "dtype='float16' is not one of float32, float64, bfloat16",
    ),
    "device": (["--device", "tpu"], dict(device="tpu"), "device='tpu' is not one of cpu, gpu"),
    "missing_weights": (
        ["--weights", "/no/such/model.safetensors"],
        dict(weights="/no/such/model.safetensors"),
        None,
    ),
    "numpy_on_a_gpu": (
        ["--framework", "numpy", "--device", "gpu"],
        dict(framework="numpy", device="gpu"),
        "device='gpu': numpy runs on the CPU only",
    ),
}


@pytest.mark.parametrize("case", sorted(LOAD_CASES))
def test_load_refuses_what_the_command_line_refuses_naming_its_own_arguments(capsys, case):
    flags, keywords, api_wording = LOAD_CASES[case]
    arguments = {"framework": "numpy", **keywords}
    argv = ["generate", "--mode", "cached"] + ([] if "--framework" in flags else ["--framework", "numpy"]) + flags
    expected = cli_message(capsys, *argv)
    assert api_message(lambda: kvports.load(**arguments)) == (expected if api_wording is None else api_wording)


def test_load_refuses_a_broken_weights_file_with_the_command_lines_message(capsys, tmp_path):
    broken = tmp_path / "broken.safetensors"
    broken.write_text("not a weights file at all\n")
    expected = cli_message(capsys, "generate", "--framework", "numpy", "--mode", "cached", "--weights", broken)
    assert api_message(lambda: kvports.load("numpy", broken)) == expected


@pytest.mark.parametrize("framework", [name for name in registry.PORTS if name not in registry.CPU_ONLY])
def test_load_on_a_gpu_that_is_not_there_is_the_command_lines_error(capsys, monkeypatch, framework):
    port = port_or_skip(framework)
    monkeypatch.setattr(port, "resolve_device", lambda device: (_ for _ in ()).throw(RuntimeError("no GPU here")))
    expected = cli_message(capsys, "generate", "--framework", framework, "--mode", "cached", "--device", "gpu")
    assert expected == "--device gpu: no GPU here"
    assert api_message(lambda: kvports.load(framework, device="gpu")) == "device='gpu': no GPU here"


def test_the_package_root_offers_the_api_and_nothing_it_does_not_have():
    assert kvports.load is kvports.api.load and issubclass(kvports.UserError, ValueError)
    with pytest.raises(AttributeError):
        kvports.generate  # noqa: B018


def test_an_array_prompt_is_refused_like_the_same_list():
    numpy_model = kvports.load("numpy")
    assert api_message(lambda: numpy_model.generate(np.array([[1, 500]]))) == api_message(
        lambda: numpy_model.generate([[1, 500]])
    )


def test_a_generation_config_as_the_second_argument_is_the_keywords(model):
    config = kvports.GenerationConfig(6, temperature=0.8, top_k=5, seed=3)
    assert (
        model.generate(SEED, config).tokens
        == model.generate(SEED, new_tokens=6, temperature=0.8, top_k=5, seed=3, stop_ids=[]).tokens
    )


def test_a_speculative_call_with_a_draft_file_reads_the_draft_once(tmp_path, monkeypatch):
    numpy_model = kvports.load("numpy")
    draft = tmp_path / "draft.safetensors"
    save_weights(draft, random_weights(numpy_model.config), numpy_model.config)
    reads = []
    real = generating.open_model
    monkeypatch.setattr(generating, "open_model", lambda *args: reads.append(args) or real(*args))
    first = numpy_model.generate(SEED, 4, "speculative", draft=draft, draft_tokens=2)
    second = numpy_model.generate(SEED, 4, "speculative", draft=draft, draft_tokens=2)
    assert len(reads) == 1 and first.tokens == second.tokens and first.speculative["draft"] == str(draft)


def test_one_generate_call_checks_its_inputs_once(monkeypatch):

    numpy_model = kvports.load("numpy")
    calls = {name: 0 for name in ("check_prompts", "check_seeds", "check_draft", "check_needed", "check_run")}
    for name in calls:
        real = getattr(generating, name)
        monkeypatch.setattr(
            generating,
            name,
            lambda *args, real=real, name=name: calls.__setitem__(name, calls[name] + 1) or real(*args),
        )
    numpy_model.generate(SEED, 3, "speculative", draft="ngram")
    assert calls == dict.fromkeys(calls, 1)


def test_time_to_first_token_is_measured_when_tokens_stream(model):
    assert model.generate(SEED, 3).first_token_seconds is None
    assert model.generate(SEED, 3, on_token=lambda token: None).first_token_seconds is not None


# ---------------------------------------------------------------- words in, words out

QUESTION = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module", params=registry.PORTS)
def text_model(request, chat_model):
    """Each framework's model of a tiny GGUF file with a byte-level tokenizer and a ChatML template."""
    port_or_skip(request.param)
    return kvports.load(request.param, chat_model)


def cli_json(capsys, model, *flags: str) -> dict:
    code, out, err = run_cli(
        capsys,
        "generate",
        "--framework",
        model.framework,
        "--mode",
        "cached",
        "--weights",
        model.weights,
        "--json",
        *flags,
    )
    assert code == 0, err
    return json.loads(out)


def test_a_text_prompt_is_encoded_as_the_command_lines_text(text_model, capsys):
    out = text_model.generate("hello world", new_tokens=4)
    given = cli_json(capsys, text_model, "--text", "hello world", "--new-tokens", "4")
    assert (out.tokens, out.text, out.answer) == (given["tokens"], given["text"], given["answer"])


def test_chat_renders_the_files_template_as_the_command_lines_chat(text_model, capsys):
    out = text_model.chat(QUESTION, new_tokens=4)
    given = cli_json(capsys, text_model, "--chat", "hi there", "--new-tokens", "4")
    assert (out.tokens, out.answer) == (given["tokens"], given["answer"])


def test_stream_yields_the_chats_answer_in_pieces(text_model):
    pieces = list(text_model.stream(messages=QUESTION, new_tokens=6, stop_ids=[]))
    answer = text_model.chat(QUESTION, new_tokens=6, stop_ids=[]).answer[0]
    assert "".join(pieces) == answer.rstrip("\ufffd")  # a character cut off by new_tokens is never yielded


def test_stream_never_splits_a_character_of_several_bytes(monkeypatch, chat_model):
    """Each UTF-8 byte of "é東" as its own token: the pieces are whole characters, never half of one."""
    from kvports.formats.gguf.tokenizer import byte_alphabet

    model = kvports.load("numpy", chat_model)
    spelling = byte_alphabet()
    ids = [model.tokenizer.token_to_id(spelling[byte]) for byte in "é東".encode()]

    def bytewise(loaded, prompts, inputs, return_logits=False, on_token=None, tokenizer=None):
        for token in ids:
            on_token(np.array([token]))

    monkeypatch.setattr(generating, "generate", bytewise)
    assert list(model.stream("hi", new_tokens=len(ids))) == ["é", "東"]


def test_leaving_a_stream_early_stops_its_generation(chat_model):
    import threading

    model = kvports.load("numpy", chat_model)
    stream = model.stream(messages=QUESTION, new_tokens=30, stop_ids=[])
    next(piece for piece in stream if piece)
    stream.close()
    assert not any(thread.name == "kvports-stream" for thread in threading.enumerate())


@pytest.mark.parametrize(
    "call",
    [
        lambda model: model.chat(QUESTION),
        lambda model: next(model.stream("hello")),
        lambda model: model.generate("hello"),
    ],
    ids=["chat", "stream", "text"],
)
def test_words_need_a_model_with_a_tokenizer(call):
    message = api_message(lambda: call(kvports.load("numpy")))
    assert "tokenizer" in message or "prompt token 'hello' is not an integer" in message


def test_bad_messages_are_refused_naming_the_argument(chat_model):
    model = kvports.load("numpy", chat_model)
    assert "messages: message 0" in api_message(lambda: model.chat([{"role": "robot", "content": "x"}]))


# JAX passes it too, but at ~40 s (30 layers compiled twice under the suite's -O0 flags, its loop and
# its streamed step): its answer on this file is tests/test_smollm2.py's, token for token.
@pytest.mark.slow
@pytest.mark.parametrize("framework", [name for name in registry.PORTS if name != "jax"])
def test_the_real_model_answers_in_words_and_streams_the_same_words(framework):
    """SmolLM2 (skipped until `make model`): the chat's answer, and its stream in pieces."""
    from kvports.hub import model_path

    port_or_skip(framework)
    try:
        model_path("smollm2")
    except kvports.UserError:
        pytest.skip("SmolLM2 is not fetched: run make model")
    smol = kvports.load(framework, model="smollm2", threads=1)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    assert smol.chat(question, new_tokens=12).answer == ["The capital of France is Paris."]
    pieces = list(smol.stream(messages=question, new_tokens=12))
    assert len(pieces) > 1 and "".join(pieces) == "The capital of France is Paris."


# ---------------------------------------------------------------- structured output

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def test_a_response_format_gives_the_command_lines_json_answer(text_model, capsys, tmp_path):
    pytest.importorskip("llguidance")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    given = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    result = text_model.generate("hi", 30, response_format=given)
    answer = json.loads(result.answer[0])
    assert set(answer) == {"ok", "n"} and isinstance(answer["ok"], bool) and 0 <= answer["n"] <= 9
    command_line = cli_json(capsys, text_model, "--text", "hi", "--new-tokens", "30", "--json-schema", str(schema))
    assert result.tokens == command_line["tokens"]


@pytest.mark.parametrize(
    "given, options, words",
    [
        ({"type": "xml"}, {}, "response_format type 'xml' is not one of"),
        ("json", {}, "response_format must be an object"),
        ({"type": "json_object"}, {"mode": "naive"}, "response_format runs in mode=cached only, not naive"),
    ],
    ids=["unknown-type", "not-an-object", "naive-mode"],
)
def test_a_bad_response_format_is_refused_naming_the_argument(chat_model, given, options, words):
    model = kvports.load("numpy", chat_model)
    assert words in api_message(lambda: model.generate("hi", 5, response_format=given, **options))
