"""`kvports serve` takes what clients it did not write send: a browser's CORS preflight from an
allowed origin (none by default), content as a list of text parts, the developer role, and the
fields OpenAI's clients send that change nothing here; what it does not do is still a 400 naming it."""

from __future__ import annotations

import pytest

from tests.helpers.servers import WAIT_S, start_server

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
ALLOWED = "http://localhost:3000"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


@pytest.fixture(scope="module")
def server(chat_model):
    running = start_server(
        "--framework",
        "numpy",
        "--weights",
        chat_model,
        "--max-batch",
        "4",
        "--allowed-origins",
        f"{ALLOWED},https://a.example",
    )
    yield running
    running.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S)


def preflight(server, origin: str) -> httpx.Response:
    return httpx.options(f"{server.url}/v1/chat/completions", headers={"Origin": origin, **PREFLIGHT}, timeout=WAIT_S)


def test_a_preflight_from_an_allowed_origin_passes(server):
    answer = preflight(server, ALLOWED)
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in answer.headers["access-control-allow-methods"]


def test_a_preflight_from_another_origin_gets_no_allow_header(server):
    answer = preflight(server, "http://elsewhere.example")
    assert answer.status_code == 400
    assert "access-control-allow-origin" not in answer.headers


def test_without_allowed_origins_a_preflight_gets_no_allow_header(chat_model):
    running = start_server("--framework", "numpy", "--weights", chat_model, "--max-batch", "2")
    try:
        answer = preflight(running, ALLOWED)
    finally:
        running.stop()
    assert "access-control-allow-origin" not in answer.headers


def answer(server, messages, **fields) -> tuple[list[int], int]:
    """A greedy chat's new token ids and its prompt's length."""
    reply = client(server).chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, temperature=0, extra_body={"return_token_ids": True}, **fields
    )
    return reply.choices[0].model_extra["token_ids"], reply.usage.prompt_tokens


def test_content_as_text_parts_is_the_parts_joined_by_newlines(server):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    assert answer(server, [{"role": "user", "content": parts}]) == answer(
        server, [{"role": "user", "content": "hello\nworld"}]
    )


def test_the_developer_role_is_the_system_role(server):
    said = [{"role": "user", "content": "hi"}]
    developer = answer(server, [{"role": "developer", "content": "be brief"}, *said])
    assert developer == answer(server, [{"role": "system", "content": "be brief"}, *said])
    assert developer != answer(server, said)


def test_a_content_part_that_is_not_text_is_a_400_naming_its_type(server):
    image = {"type": "image_url", "image_url": {"url": "http://a.example/cat.png"}}
    with pytest.raises(openai.BadRequestError) as caught:
        answer(server, [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}])
    assert "image_url" in caught.value.body["message"] and caught.value.body["param"] == "messages"


def test_fields_that_change_nothing_here_are_accepted_and_change_nothing(server):
    said = [{"role": "user", "content": "hello"}]
    ignored = dict(
        store=False,
        metadata={"run": "7"},
        parallel_tool_calls=True,
        service_tier="auto",
        user="someone",
        safety_identifier="abc",
        prompt_cache_key="k",
        tool_choice="none",
        modalities=["text"],
    )
    assert answer(server, said, **ignored) == answer(server, said)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}], "no tool calling"),
        ("functions", [{"name": "f"}], "no function calling"),
        ("tool_choice", "auto", "not supported"),
        ("store", "yes", "must be a boolean"),
        ("metadata", [1], "must be an object"),
        ("colour", "blue", "unknown field"),
    ],
)
def test_what_is_not_done_here_is_a_400_naming_the_field(server, field, value, words):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, field: value}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=WAIT_S)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == field and words in reply.json()["error"]["message"]


def test_a_chat_only_field_is_unknown_to_completions(server):
    body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 1, "store": True}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=WAIT_S)
    assert reply.status_code == 400 and "unknown field" in reply.json()["error"]["message"]
