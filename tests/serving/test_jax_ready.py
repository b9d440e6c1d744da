"""A JAX server compiles nothing once it says it is ready, by default: every program a step can
run (the decode step at each rung of rows and blocks a row, each chunk width of a prefill at each
row count, with every position's logits or the last one's, and the row sampling with and without a
response format's mask) was compiled before (serve's warm-up, `compile_paged_steps`). A burst of 16
concurrent requests, prompts shorter and longer than a chunk (over up to 11 blocks of 4: both rungs
of blocks), greedy and sampled, one echoing its prompt's log-probabilities and one constrained to
JSON, traces no program."""

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
        "--framework", "jax", "--weights", chat_model, "--max-batch", "4", "--max-length", "64", "--block-size", "4"
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


def test_each_program_is_counted_as_it_compiles():
    """What serve's progress bar hears: (done, total) after each program, total the count returned.
    One row and prompts of at most 32 tokens: the decode step, the 16-wide forward with the last
    position's logits and with every position's, and the row sampling with and without a mask."""
    from kvports.registry import load_port
    from kvports.shared.config import ModelConfig
    from tests.helpers.models import random_weights

    port = load_port("jax")
    config = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=64)
    model = port.load_model(config, random_weights(config), "float32")
    pool = port.init_block_pool(model, 12, 4, 1, 8)
    heard: list[tuple[int, int]] = []
    total = port.compile_paged_steps(model, pool, 64, 32, lambda done, total: heard.append((done, total)))
    assert total == 5
    assert heard == [(done, 5) for done in range(1, 6)]
