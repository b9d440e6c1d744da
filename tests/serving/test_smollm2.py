"""`kvports serve --model smollm2` (the real model; skipped when it is not fetched) answers the
openai client as `kvports generate --chat` does: "The capital of France is Paris.", streamed and not."""

from __future__ import annotations

import pytest

from kvports.formats.chat import chat_ids
from kvports.formats.gguf.tokenizer import gguf_tokenizer
from kvports.hub import model_path
from kvports.registry import PORTS
from kvports.shared.errors import UserError
from tests.helpers.servers import WAIT_S, alone, start_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=PORTS)
def server(request):
    try:
        model_path("smollm2")
    except UserError:
        pytest.skip("SmolLM2 is not fetched: run make model")
    # --no-precompile: these requests need a few of the 13 programs a JAX server compiles first (seconds each).
    argv = ("--framework", request.param, "--model", "smollm2", "--max-batch", "2", "--max-length", "64")
    running = start_server(*argv, "--no-precompile")
    yield running
    running.stop()


def test_the_client_gets_paris_streamed_and_not_and_generates_tokens(server):
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S * 3)
    settings = dict(model="smollm2", messages=QUESTION, max_tokens=NEW_TOKENS, temperature=0)
    whole = api.chat.completions.create(**settings, extra_body={"return_token_ids": True})
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in api.chat.completions.create(**settings, stream=True)
        if chunk.choices
    )
    assert whole.choices[0].message.content == streamed == ANSWER
    assert whole.choices[0].finish_reason == "stop"
    path = model_path("smollm2")
    prompt = chat_ids(path, QUESTION, gguf_tokenizer(path))
    assert whole.choices[0].model_extra["token_ids"] == alone(server, prompt, max_new_tokens=NEW_TOKENS)
