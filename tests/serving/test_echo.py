"""`/v1/completions` with `echo: true` and `logprobs` returns the prompt's own log-probabilities,
as lm-eval's log-likelihood tasks ask for them (OpenAI's and vLLM's legacy wire format): every
prompt token, the first's null, from the prompt's prefill; in float64 the values of a full forward
of the same model in each port to 1e-9, the prefix cache notwithstanding."""

from __future__ import annotations

import numpy as np
import pytest

from kvports.registry import PORTS
from tests.helpers.servers import WAIT_S, start_exact_server

openai = pytest.importorskip("openai")
PROMPT = [9, 120, 33, 7, 200, 61, 18, 5, 77, 14, 3, 250, 41, 8, 16, 99, 2, 64, 31]  # past one 16-token block
TOP = 3


@pytest.fixture(scope="module", params=PORTS)
def server(request, chat_model):
    running = start_exact_server(request.param, chat_model)
    yield running
    running.stop()


def echo(server, **fields):
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S)
    fields.setdefault("temperature", 0)
    return api.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=TOP, **fields)


def full_forward_logprobs(server) -> np.ndarray:
    """log-softmax of the port's own full forward of the prompt, float64: [T, V]."""
    engine = server.engine
    logits = np.asarray(engine.port.forward_chunks(engine.model, np.asarray([PROMPT]), [len(PROMPT)]))[0]  # [T, V]
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # [T, V]


def test_echo_with_max_tokens_0_gives_every_prompt_tokens_logprob_of_a_full_forward(server):
    answer = echo(server, max_tokens=0)
    logprobs = answer.choices[0].logprobs
    expected = full_forward_logprobs(server)  # [T, V]
    assert len(logprobs.tokens) == len(PROMPT) and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    want = [expected[index - 1, PROMPT[index]] for index in range(1, len(PROMPT))]
    np.testing.assert_allclose(logprobs.token_logprobs[1:], want, rtol=0, atol=1e-9)
    for index in range(1, len(PROMPT)):
        likeliest = np.sort(expected[index - 1])[::-1][:TOP]  # [TOP]
        reported = np.asarray(list(logprobs.top_logprobs[index].values()))  # keyed by text: ids that spell alike merge
        assert np.abs(reported[:, None] - likeliest[None, :]).min(axis=1).max() < 1e-9
        assert abs(reported.max() - likeliest[0]) < 1e-9
    assert answer.usage.completion_tokens == 0 and answer.choices[0].finish_reason == "length"


def test_echo_text_and_offsets_are_the_prompts_then_the_completions(server):
    answer = echo(server, max_tokens=2, extra_body={"return_token_ids": True})
    choice = answer.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(PROMPT) + 2 and len(choice.model_extra["token_ids"]) == 2
    prompt_text = echo(server, max_tokens=0).choices[0].text
    assert prompt_text and choice.text.startswith(prompt_text)
    offsets = np.cumsum([0] + [len(token) for token in logprobs.tokens[:-1]])
    assert logprobs.text_offset == offsets.tolist()


def test_a_cached_prompt_is_computed_again_for_its_logprobs(server):
    first, again = echo(server, max_tokens=1), echo(server, max_tokens=1)  # the second finds the prefix cached
    assert again.choices[0].logprobs.token_logprobs == first.choices[0].logprobs.token_logprobs
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_every_choice_of_n_echoes_the_prompts_own_logprobs(server):
    alone = echo(server, max_tokens=1).choices[0].logprobs
    choices = echo(server, max_tokens=1, n=2, temperature=1, seed=3).choices
    assert len(choices) == 2
    # The prompt's, before each sampled token's, within float64's rounding of the prompt computed alone:
    # two rows of one prefill and a row alone may take other kernels (torch's rows differed at 1e-15).
    for choice in choices:
        echoed = choice.logprobs.token_logprobs[: len(PROMPT)]
        assert echoed[0] is None
        np.testing.assert_allclose(echoed[1:], alone.token_logprobs[1 : len(PROMPT)], rtol=0, atol=1e-9)


def test_echo_with_a_stream_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as caught:
        echo(server, max_tokens=1, stream=True)
    assert caught.value.body["param"] == "echo"
