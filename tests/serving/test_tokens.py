"""`kvports serve` answers as `kvports generate` does: each request's tokens are the ones it gets
alone (greedy and seeded sampling), whatever else runs, through the official `openai` client
(sync and async, streamed and not). A tiny GGUF model in float64, so tokens agree exactly."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvports.formats.chat import chat_ids
from kvports.formats.gguf.tokenizer import gguf_tokenizer
from kvports.registry import PORTS
from tests.helpers.commands import run_cli
from tests.helpers.servers import WAIT_S, alone, start_server

openai = pytest.importorskip("openai")
MODEL = "tiny"  # the served name: the weights file's stem
# Chats of mixed lengths, each wanting its own number of tokens.
WORDS = ["hello", "world", "this", "hi", "hell", "or"]


@pytest.fixture(
    scope="module", params=[pytest.param(name, marks=[pytest.mark.slow] if name == "jax" else []) for name in PORTS]
)
def server(request, chat_model):
    """One server per port over the tiny chat model (JAX's marked slow: a program per prompt
    length for its alone runs)."""
    running = start_server(
        "--framework", request.param, "--weights", chat_model, "--dtype", "float64", "--max-batch", "8"
    )
    yield running
    running.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S)


def chat(words: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": " ".join(WORDS[index % len(WORDS)] for index in range(words))}]


def test_a_chat_gets_the_tokens_kvports_generate_gives_it(server, chat_model, capsys, tmp_path):
    messages = chat(3)
    answer = client(server).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    chat_file = tmp_path / "chat.json"
    chat_file.write_text(json.dumps(messages))
    argv = ["generate", "--framework", server.engine.port.NAME, "--mode", "cached", "--weights", chat_model]
    code, out, err = run_cli(
        capsys, *argv, "--chat-file", chat_file, "--new-tokens", "6", "--dtype", "float64", "--json"
    )
    assert code == 0, err
    prompt = chat_ids(chat_model, messages, gguf_tokenizer(chat_model))
    choice = answer.choices[0]
    assert json.loads(out)["tokens"][0] == prompt + choice.model_extra["token_ids"]
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == len(choice.model_extra["token_ids"])
    assert choice.finish_reason in ("stop", "length")


def test_a_streamed_completion_is_the_whole_one_in_pieces(server):
    prompt = [5, 17, 40, 99, 3]
    settings = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    whole = client(server).completions.create(**settings)
    pieces, ids, reasons = "", [], []
    for chunk in client(server).completions.create(stream=True, **settings):
        for choice in chunk.choices:
            pieces += choice.text
            ids += choice.model_extra["token_ids"]
            reasons.append(choice.finish_reason)
    assert ids == whole.choices[0].model_extra["token_ids"] == alone(server, prompt, max_new_tokens=8)
    assert pieces == whole.choices[0].text
    assert reasons[-1] == whole.choices[0].finish_reason and set(reasons[:-1]) <= {None}


def test_a_seeded_sample_gets_the_tokens_generate_draws_with_that_seed(server):
    prompt = [9, 120, 33, 7, 200, 61, 18]
    settings = dict(max_new_tokens=10, temperature=0.9, top_k=40, top_p=0.95, seed=12)
    answer = client(server).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=10,
        temperature=0.9,
        top_p=0.95,
        seed=12,
        extra_body={"top_k": 40, "return_token_ids": True},
    )
    assert answer.choices[0].model_extra["token_ids"] == alone(server, prompt, **settings)


def test_n_choices_are_the_seeds_seed_to_seed_plus_n_minus_1(server):
    prompt = [4, 8, 15, 16, 23, 42]
    answer = client(server).completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=1.0, seed=7, n=3, extra_body={"return_token_ids": True}
    )
    by_index = {choice.index: choice.model_extra["token_ids"] for choice in answer.choices}
    for index in range(3):
        assert by_index[index] == alone(server, prompt, max_new_tokens=5, temperature=1.0, seed=7 + index)


def test_sixteen_concurrent_streamed_chats_each_get_their_own_tokens(server, chat_model):
    """Sixteen async clients at once, of mixed prompt and answer lengths: requests join the running
    batch (8 rows) as others leave it, and each gets the tokens it gets alone."""
    tokenizer = gguf_tokenizer(chat_model)
    requests = [(chat(1 + index % 5), 2 + index % 7) for index in range(16)]

    async def one(messages, max_tokens) -> list[int]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S
        ) as api:
            stream = await api.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"return_token_ids": True},
            )
            ids: list[int] = []
            async for chunk in stream:
                for choice in chunk.choices:
                    ids += choice.model_extra.get("token_ids", [])
            return ids

    async def everyone():
        return await asyncio.wait_for(asyncio.gather(*(one(*request) for request in requests)), WAIT_S * 2)

    answers = asyncio.run(everyone())
    for (messages, max_tokens), ids in zip(requests, answers, strict=True):
        assert ids == alone(server, chat_ids(chat_model, messages, tokenizer), max_new_tokens=max_tokens)
    assert server.engine.blocks.num_free == server.engine.blocks.num_blocks


def test_a_stop_string_ends_the_text_before_it(server, chat_model):
    prompt = [5, 17, 40, 99, 3]
    full = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    stop = full[3:5]
    assert len(stop) == 2 and stop not in full[:4]  # the tiny model's greedy text has one here
    cut = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def generate_logprobs(capsys, server, chat_model, top: int, *prompt_args: object) -> list[dict]:
    """`kvports generate --logprobs TOP --json`'s one row: each new token's id, text, log-probability
    and its step's TOP likeliest."""
    argv = ["generate", "--framework", server.engine.port.NAME, "--mode", "cached", "--weights", chat_model]
    code, out, err = run_cli(
        capsys, *argv, *prompt_args, "--new-tokens", "6", "--dtype", "float64", "--logprobs", top, "--json"
    )
    assert code == 0, err
    return json.loads(out)["logprobs"][0]


def test_a_chats_logprobs_are_the_ones_kvports_generate_reports(server, chat_model, capsys, tmp_path):
    """Greedy: the log-softmax of the raw logits, the chosen token's and the top 3, as `generate
    --logprobs 3` computes them alone."""
    messages = chat(4)
    answer = client(server).chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    chat_file = tmp_path / "chat.json"
    chat_file.write_text(json.dumps(messages))
    expected = generate_logprobs(capsys, server, chat_model, 3, "--chat-file", chat_file)
    choice = answer.choices[0]
    content = choice.logprobs.content
    assert [step["token"] for step in expected] == choice.model_extra["token_ids"]
    assert [entry.token for entry in content] == [step["text"] for step in expected]
    assert [entry.logprob for entry in content] == pytest.approx([step["logprob"] for step in expected], rel=1e-9)
    for entry, step in zip(content, expected, strict=True):
        assert entry.bytes == list(entry.token.encode())
        assert [top.token for top in entry.top_logprobs] == [top["text"] for top in step["top"]]
        assert [top.logprob for top in entry.top_logprobs] == pytest.approx([top["logprob"] for top in step["top"]])


def test_a_completions_legacy_logprobs_are_the_ones_kvports_generate_reports(server, chat_model, capsys):
    prompt = [5, 17, 40, 99, 3]
    answer = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    expected = generate_logprobs(capsys, server, chat_model, 2, "--prompt", ",".join(map(str, prompt)))
    logprobs = answer.choices[0].logprobs
    assert logprobs.tokens == [step["text"] for step in expected]
    assert logprobs.token_logprobs == pytest.approx([step["logprob"] for step in expected], rel=1e-9)
    assert logprobs.top_logprobs == [
        pytest.approx({top["text"]: top["logprob"] for top in step["top"]}, rel=1e-9) for step in expected
    ]
    lengths = [len(token) for token in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:index]) for index in range(len(lengths))]


def test_a_streamed_chats_logprobs_are_the_whole_ones_in_pieces(server):
    settings = dict(model=MODEL, messages=chat(2), max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    whole = client(server).chat.completions.create(**settings).choices[0].logprobs.content
    pieces = []
    for chunk in client(server).chat.completions.create(stream=True, **settings):
        for choice in chunk.choices:
            pieces += choice.logprobs.content if choice.logprobs is not None else []
    # The same tokens; the values to rounding (the second request's prompt comes from the prefix cache).
    assert [(entry.token, entry.bytes) for entry in pieces] == [(entry.token, entry.bytes) for entry in whole]
    assert [entry.logprob for entry in pieces] == pytest.approx([entry.logprob for entry in whole], rel=1e-9)
    assert [[top.token for top in entry.top_logprobs] for entry in pieces] == [
        [top.token for top in entry.top_logprobs] for entry in whole
    ]
    assert len(whole) >= 1 and all(len(entry.top_logprobs) == 2 for entry in whole)


def test_a_sampled_requests_logprobs_are_the_models_before_temperature(server, chat_model, capsys):
    """The log-softmax of the raw logits, as OpenAI and vLLM report them: not the tempered
    distribution the token was drawn from. `generate --logprobs` reports the same."""
    prompt = [9, 120, 33, 7]
    answer = client(server).completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=1.7, seed=3, logprobs=1
    )
    sampling = ("--temperature", "1.7", "--seed", "3")
    expected = generate_logprobs(capsys, server, chat_model, 1, "--prompt", ",".join(map(str, prompt)), *sampling)
    logprobs = answer.choices[0].logprobs
    assert logprobs.tokens == [step["text"] for step in expected]
    assert logprobs.token_logprobs == pytest.approx([step["logprob"] for step in expected], rel=1e-9)


def test_a_streamed_completions_logprobs_continue_their_text_offsets(server):
    settings = dict(model=MODEL, prompt=[5, 17, 40, 99, 3], max_tokens=8, temperature=0, logprobs=1)
    whole = client(server).completions.create(**settings).choices[0].logprobs
    tokens, offsets = [], []
    for chunk in client(server).completions.create(stream=True, **settings):
        for choice in chunk.choices:
            tokens += choice.logprobs.tokens
            offsets += choice.logprobs.text_offset
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert len(whole.tokens) > 1 and offsets[-1] > 0  # chunks after the first carry on from its text


def sampled(server, **seed) -> list[list[int]]:
    """Three temperature-1 completions of one prompt, n=2 each: every choice's tokens."""
    answers = [
        client(server).completions.create(
            model=MODEL,
            prompt=[3, 14, 15, 92],
            max_tokens=12,
            temperature=1.0,
            n=2,
            extra_body={"return_token_ids": True},
            **seed,
        )
        for _ in range(3)
    ]
    return [choice.model_extra["token_ids"] for answer in answers for choice in answer.choices]


def test_unseeded_samples_differ_request_to_request_and_choice_to_choice(server):
    samples = sampled(server)
    assert len({tuple(tokens) for tokens in samples}) == len(samples)


def test_seeded_samples_repeat(server):
    samples = sampled(server, seed=99)
    assert samples[0::2] == [samples[0]] * 3 and samples[1::2] == [samples[1]] * 3


def test_a_choice_says_its_seed_and_that_seed_repeats_it(server):
    prompt = [7, 70, 77, 170]
    answer = client(server).completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, n=2, extra_body={"return_token_ids": True}
    )
    for choice in answer.choices:
        seed = choice.model_extra["seed"]
        assert choice.model_extra["token_ids"] == alone(server, prompt, max_new_tokens=8, temperature=1.0, seed=seed)
    assert answer.choices[1].model_extra["seed"] == answer.choices[0].model_extra["seed"] + 1
