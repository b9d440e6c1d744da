"""A JAX server started with --precompile compiles nothing once it says it is ready: every step
shape the scheduler can make was compiled before (serve's warm-up, `compile_paged_steps`), so a
burst of concurrent requests of varied prompt lengths, greedy and sampled, traces no program."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.compiles import counting_traces
from tests.helpers.servers import WAIT_S, start_server

pytest.importorskip("jax")
openai = pytest.importorskip("openai")


def test_a_burst_after_ready_compiles_nothing(chat_model):
    running = start_server(
        "--framework",
        "jax",
        "--weights",
        chat_model,
        "--max-batch",
        "4",
        "--max-length",
        "32",
        "--block-size",
        "8",
        "--precompile",
    )
    prompts = [[5 + index] * length for index, length in enumerate((1, 3, 7, 12, 20, 5, 9, 2))]

    async def one(prompt: list[int], index: int) -> int:
        async with openai.AsyncOpenAI(
            base_url=f"{running.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S
        ) as api:
            answer = await api.completions.create(
                model="tiny", prompt=prompt, max_tokens=4, temperature=index % 2, seed=index
            )
            return answer.usage.completion_tokens

    async def burst() -> list[int]:
        return await asyncio.gather(*(one(prompt, index) for index, prompt in enumerate(prompts)))

    try:
        with counting_traces() as traces:
            counts = asyncio.run(burst())
    finally:
        running.stop()
    assert all(count >= 1 for count in counts)
    assert traces == []
