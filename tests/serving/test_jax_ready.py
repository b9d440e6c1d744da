"""A JAX server compiles nothing once it says it is ready, by default: every program a step can
run (the decode step, each chunk width of a prefill at each row count, with every position's
logits or the last one's, and the row sampling with and without a response format's mask) was
compiled before (serve's warm-up, `compile_paged_steps`). A burst of 16 concurrent requests, prompts
shorter and longer than a chunk, greedy and sampled, one echoing its prompt's log-probabilities and
one constrained to JSON, traces no program."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.compiles import counting_traces
from tests.helpers.servers import WAIT_S, start_server

pytest.importorskip("jax")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

# Token prompts of 1 to 40 tokens: one chunk (16 wide), two, or a 64-wide one.
LENGTHS = (1, 3, 7, 12, 20, 5, 9, 2, 30, 17, 40, 25, 14)


def test_a_burst_after_ready_compiles_nothing(chat_model):
    running = start_server(
        "--framework", "jax", "--weights", chat_model, "--max-batch", "4", "--max-length", "64", "--block-size", "8"
    )

    async def burst() -> list[int]:
        async with openai.AsyncOpenAI(
            base_url=f"{running.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S
        ) as api:
            completions = [
                api.completions.create(
                    model="tiny", prompt=[5 + index] * length, max_tokens=4, temperature=index % 2, seed=index
                )
                for index, length in enumerate(LENGTHS)
            ]
            echoes = [
                api.completions.create(
                    model="tiny", prompt=list(range(3, 3 + length)), max_tokens=2, echo=True, logprobs=1
                )
                for length in (21, 4)
            ]
            constrained = api.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "J"}],
                max_tokens=6,
                temperature=1.0,
                seed=3,
                response_format={"type": "json_object"},
            )
            answers = await asyncio.gather(*completions, *echoes, constrained)
        return [answer.usage.completion_tokens for answer in answers]

    try:
        with counting_traces() as traces:
            counts = asyncio.run(burst())
    finally:
        running.stop()
    assert len(counts) == 16 and all(count >= 1 for count in counts)
    assert traces == []
