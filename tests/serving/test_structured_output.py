"""Structured output: a chat's `response_format` (OpenAI's json_object and json_schema) masks each
step's logits to the tokens llguidance's grammar allows, computed on the host and applied by every
port's `sample_rows` before the one sampling rule. A tiny random model, which alone writes no JSON,
answers JSON that parses and follows its schema, ends when the grammar is complete ("stop"), and
gives the same tokens in every port, greedy and sampled; a bad response_format is a 400 naming it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvports.batching.constraint import Grammars, json_object, json_schema
from kvports.batching.engine import BatchSettings, Engine
from kvports.batching.request import Request
from kvports.formats.gguf.tokenizer import gguf_tokenizer
from kvports.loading import header, load_model, open_model, read_tensors
from kvports.registry import PORTS
from kvports.shared.generation import GenerationConfig
from tests.helpers.ports import port_or_skip
from tests.helpers.servers import WAIT_S, start_server

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

# Small bounded values: a random model finishes the object well within MAX_TOKENS.
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "c": {"enum": ["r", "g"]},
    },
    "required": ["ok", "n", "c"],
    "additionalProperties": False,
}
MAX_TOKENS = 40  # the tiny model's context is 64 tokens: a prompt of 20 and the longest answer's 27 characters
MESSAGES = [{"role": "user", "content": "J"}]


def follows_schema(answer: object) -> bool:
    """SCHEMA checked by hand (no jsonschema here): exactly its three keys, each of its type and range."""
    return (
        isinstance(answer, dict)
        and set(answer) == {"ok", "n", "c"}
        and isinstance(answer["ok"], bool)
        and isinstance(answer["n"], int)
        and not isinstance(answer["n"], bool)
        and 0 <= answer["n"] <= 9
        and answer["c"] in ("r", "g")
    )


@pytest.fixture(scope="module", params=PORTS)
def server(request, chat_model):
    port_or_skip(request.param)
    # --no-precompile: JAX compiles each program when first asked (test_jax_ready holds the default).
    running = start_server("--framework", request.param, "--weights", chat_model, "--max-batch", "4", "--no-precompile")
    yield running
    running.stop()


def chat(server, **fields):
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S)
    return api.chat.completions.create(model="tiny", messages=MESSAGES, **{"max_tokens": MAX_TOKENS, **fields})


def schema_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_json_schema_answer_follows_its_schema_and_stops(server, temperature):
    answer = chat(server, response_format=schema_format(), temperature=temperature, seed=7)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert follows_schema(json.loads(choice.message.content)), choice.message.content


def test_a_json_object_answer_parses_as_an_object(server):
    # Seed 9: a draw whose object closes within MAX_TOKENS (most of a random model's open a string
    # they never close: any JSON object may hold any key).
    choice = chat(server, response_format={"type": "json_object"}, temperature=1.0, seed=9).choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict), choice.message.content


def test_response_format_text_is_free_text(server):
    free = chat(server, temperature=0, max_tokens=8)
    text = chat(server, response_format={"type": "text"}, temperature=0, max_tokens=8)
    assert text.choices[0].message.content == free.choices[0].message.content


def test_a_constrained_and_a_free_request_run_side_by_side(server):
    """Rows of one batch each keep their own mask (or none): n = 2 samples, both valid."""
    answer = chat(server, response_format=schema_format(), temperature=1.0, seed=11, n=2)
    assert [choice.finish_reason for choice in answer.choices] == ["stop", "stop"]
    assert all(follows_schema(json.loads(choice.message.content)) for choice in answer.choices)


@pytest.mark.parametrize(
    "response_format",
    [
        "json",
        {"type": "xml"},
        {"type": "json_object", "schema": {}},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objekt"}}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {"enum": ["x" * 70000]}}},
    ],
)
def test_a_bad_response_format_is_a_400_naming_it(server, response_format):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(server, response_format=response_format)
    error = caught.value.body
    assert error["param"] == "response_format" and error["type"] == "invalid_request_error"
    assert "response_format" in error["message"]


def test_tools_are_still_a_400(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        chat(server, tools=[tool])
    assert caught.value.body["param"] == "tools"


# ---------------------------------------------------------------- the same tokens in every port


@pytest.fixture(scope="module")
def constrained_tokens(chat_model):
    """Each port's tokens for the same constrained requests through its engine, float32."""
    tokenizer = gguf_tokenizer(chat_model)
    with open_model(chat_model) as file:
        config = header(file, "float32")
        tensors = read_tensors(file, "float32")
    prompt = tuple(tokenizer.encode("<|im_start|>user\nJ<|im_end|>\n<|im_start|>assistant\n").ids)
    formats = [json_schema(SCHEMA), json_schema(SCHEMA), json_object(), json_object()]
    settings = [(0.0, 0), (1.0, 5), (0.0, 0), (1.0, 9)]  # greedy and seeded samples of each
    tokens = {}
    for framework in PORTS:
        port_or_skip(framework)
        loaded = load_model(framework, config, tensors, "float32", "cpu")
        grammars = Grammars(tokenizer, config.vocab_size, tuple(config.eos_token_ids))
        engine = Engine(loaded.port, loaded.model, config, BatchSettings(max_batch=4), grammars=grammars)
        sequences = [
            engine.add(
                Request(
                    str(index),
                    prompt,
                    GenerationConfig(36, temperature=temperature, seed=seed, stop_ids=tuple(config.eos_token_ids)),
                    response_format=response_format,
                )
            )
            for index, (response_format, (temperature, seed)) in enumerate(zip(formats, settings, strict=True))
        ]
        engine.run()
        tokens[framework] = [(sequence.generated, sequence.finish_reason) for sequence in sequences]
    return tokens, tokenizer


def test_every_port_gives_the_same_constrained_tokens(constrained_tokens):
    tokens, _ = constrained_tokens
    reference = tokens[PORTS[0]]
    for framework in PORTS[1:]:
        assert tokens[framework] == reference, framework


def test_the_engines_constrained_answers_are_valid_json(constrained_tokens):
    tokens, tokenizer = constrained_tokens
    answers = tokens[PORTS[0]]
    for index, (generated, reason) in enumerate(answers):
        if reason == "length":  # a json_object's string a random model never closes: still a prefix of JSON
            assert tokenizer.decode(generated).startswith("{")
            continue
        parsed = json.loads(tokenizer.decode(generated))
        assert follows_schema(parsed) if index < 2 else isinstance(parsed, dict)
    assert sum(reason == "stop" for _, reason in answers) >= 3, answers


def test_a_row_without_a_mask_is_unchanged_by_its_neighbours_mask(chat_model):
    """The mask is per row: an unconstrained request gives the tokens it gives alone."""
    tokenizer = gguf_tokenizer(chat_model)
    with open_model(chat_model) as file:
        config = header(file, "float32")
        tensors = read_tensors(file, "float32")
    loaded = load_model("numpy", config, tensors, "float32", "cpu")
    grammars = Grammars(tokenizer, config.vocab_size, tuple(config.eos_token_ids))

    def run(constrained_neighbour: bool) -> list[int]:
        engine = Engine(loaded.port, loaded.model, config, BatchSettings(max_batch=2), grammars=grammars)
        free = engine.add(Request("free", (1, 100, 120), GenerationConfig(8)))
        if constrained_neighbour:
            engine.add(Request("json", (1, 100, 120), GenerationConfig(8), response_format=json_object()))
        engine.run()
        return free.generated

    assert run(True) == run(False)
    assert np.asarray(run(True)).size == 8
