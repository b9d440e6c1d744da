"""Every bad request to `kvports serve` is a 4xx with the OpenAI error object naming the field and
the limit, never a 500 or a traceback, and the server answers the next good request."""

from __future__ import annotations

import json

import pytest

from kvports.server.schemas import MAX_BODY_BYTES, MAX_JSON_DEPTH, MAX_N, MAX_STOP
from tests.helpers.servers import WAIT_S, start_server

httpx = pytest.importorskip("httpx")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(chat_model):
    running = start_server("--framework", "numpy", "--weights", chat_model, "--max-batch", "4")
    yield running
    running.stop()


def good(**changes) -> dict:
    return {**GOOD, **changes}


def chat(**changes) -> dict:
    body = {key: value for key, value in GOOD.items() if key != "prompt"}
    return {**body, "messages": HELLO, **changes}


# (path, body (bytes: sent as they are), status, param, a part of the message)
CASES = {
    "not JSON": (COMPLETIONS, b'{"model": "tiny",', 400, None, "not valid JSON"),
    "NaN is not JSON": (COMPLETIONS, b'{"model": "tiny", "prompt": [1], "temperature": NaN}', 400, None, "NaN"),
    "not UTF-8": (COMPLETIONS, b'{"model": "\xff"}', 400, None, "not UTF-8"),
    "not an object": (COMPLETIONS, [1, 2], 400, None, "must be a JSON object, got an array"),
    "nested too deeply": (COMPLETIONS, b"[" * (MAX_JSON_DEPTH + 1), 400, None, f"deeper than {MAX_JSON_DEPTH}"),
    "too large": (COMPLETIONS, b" " * (MAX_BODY_BYTES + 1), 413, None, f"above {MAX_BODY_BYTES}"),
    "unknown field": (COMPLETIONS, good(temprature=0.5), 400, "temprature", "unknown field 'temprature'"),
    "no model": (COMPLETIONS, {"prompt": [1]}, 400, "model", "'model' is missing"),
    "unknown model": (COMPLETIONS, good(model="gpt-4"), 404, "model", "model 'gpt-4' is not served here"),
    "max_tokens a string": (COMPLETIONS, good(max_tokens="8"), 400, "max_tokens", "must be an integer, got a string"),
    "max_tokens 0": (COMPLETIONS, good(max_tokens=0), 400, "max_tokens", "it must be in [1, 64]"),
    "max_tokens past the context": (
        COMPLETIONS,
        good(max_tokens=62),
        400,
        "max_tokens",
        "above this server's context of 64",
    ),
    "prompt past the context": (COMPLETIONS, good(prompt=[1] * 64), 400, "prompt", "context is 64 tokens"),
    "empty prompt": (COMPLETIONS, good(prompt=""), 400, "prompt", "'prompt' is empty"),
    "prompt token past the vocabulary": (COMPLETIONS, good(prompt=[1, 271]), 400, "prompt", "outside [0, 271)"),
    "several prompts": (COMPLETIONS, good(prompt=["a", "b"]), 400, "prompt", "one per request"),
    "temperature above 2": (COMPLETIONS, good(temperature=2.5), 400, "temperature", "must be in [0, 2]"),
    "top_p 0": (COMPLETIONS, good(top_p=0), 400, "top_p", "must be in (0, 1]"),
    "top_k negative": (COMPLETIONS, good(top_k=-1), 400, "top_k", "must be in [0, 271]"),
    "seed negative": (COMPLETIONS, good(seed=-3), 400, "seed", "'seed' is -3"),
    "n too many": (COMPLETIONS, good(n=MAX_N + 1), 400, "n", f"must be in [1, {MAX_N}]"),
    "stop not strings": (COMPLETIONS, good(stop=[1]), 400, "stop", "a string or a list of strings"),
    "too many stops": (COMPLETIONS, good(stop=["a"] * (MAX_STOP + 1)), 400, "stop", f"above {MAX_STOP}"),
    "stream not a boolean": (COMPLETIONS, good(stream="yes"), 400, "stream", "true or false"),
    "logprobs above 5": (COMPLETIONS, good(logprobs=6), 400, "logprobs", "'logprobs' is 6; it must be in [0, 5]"),
    "logprobs negative": (COMPLETIONS, good(logprobs=-1), 400, "logprobs", "it must be in [0, 5]"),
    "logprobs a boolean on completions": (COMPLETIONS, good(logprobs=True), 400, "logprobs", "an integer"),
    "logprobs not a boolean on a chat": (CHAT, chat(logprobs=3), 400, "logprobs", "true or false"),
    "top_logprobs above 20": (
        CHAT,
        chat(logprobs=True, top_logprobs=21),
        400,
        "top_logprobs",
        "'top_logprobs' is 21; it must be in [0, 20]",
    ),
    "top_logprobs without logprobs": (CHAT, chat(top_logprobs=2), 400, "top_logprobs", "needs 'logprobs': true"),
    "top_logprobs on completions": (COMPLETIONS, good(top_logprobs=2), 400, "top_logprobs", "unknown field"),
    "penalty unsupported": (CHAT, chat(presence_penalty=0.5), 400, "presence_penalty", "not supported"),
    "no messages": (CHAT, chat(messages=None), 400, "messages", "'messages' is missing"),
    "empty messages": (CHAT, chat(messages=[]), 400, "messages", "non-empty JSON list"),
    "a role the template refuses": (
        CHAT,
        chat(messages=[{"role": "tool", "content": "x"}]),
        400,
        "messages",
        "role 'tool'; roles: system, user, assistant",
    ),
    "a message without content": (CHAT, chat(messages=[{"role": "user"}]), 400, "messages", "message 0 is"),
    "a chat field on completions": (COMPLETIONS, good(messages=HELLO), 400, "messages", "unknown field 'messages'"),
    # JSON's escape of a lone surrogate: Python reads it as a str no UTF-8 encoder takes, so every
    # message that shows it escapes it, and a prompt holding one is refused as a chat's content is.
    "a lone surrogate in a field name": (
        COMPLETIONS,
        b'{"model": "tiny", "prompt": [1], "\\ud800": 1}',
        400,
        "\\ud800",
        "unknown field '\\ud800'",
    ),
    "a lone surrogate in a string prompt": (
        COMPLETIONS,
        good(prompt="a\ud800"),
        400,
        "prompt",
        "'prompt' holds a lone surrogate U+D800 at character 1, not text",
    ),
    "stream_options without stream": (
        COMPLETIONS,
        good(stream_options={"include_usage": True}),
        400,
        "stream_options",
        "only for 'stream': true",
    ),
}


def post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=WAIT_S)


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_request_is_its_4xx_and_the_next_good_one_is_served(server, case):
    path, body, status, param, message = CASES[case]
    answer = post(server, path, body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert message in error["message"], error["message"]
    assert "Traceback" not in answer.text
    assert post(server, COMPLETIONS, GOOD).status_code == 200


@pytest.mark.parametrize("method, path, status", [("GET", CHAT, 405), ("POST", "/v1/embeddings", 404)])
def test_an_unknown_route_or_method_is_the_error_object(server, method, path, status):
    answer = httpx.request(method, server.url + path, timeout=WAIT_S)
    assert answer.status_code == status
    assert path in answer.json()["error"]["message"]
