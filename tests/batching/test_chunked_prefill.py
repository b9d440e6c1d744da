"""JAX runs a prefill step's [B, T] block as chunks of a few fixed widths (jax_impl/paged.py's
CHUNK_WIDTHS), so a server compiles every program before it is ready: the chunks give the tokens,
the log-probabilities and the pool's keys and values that one call over the whole block gives."""

from __future__ import annotations

import numpy as np
import pytest

from kvports.shared.config import ModelConfig
from kvports.shared.generation import PAD, GenerationConfig, RowSampling
from tests.helpers.models import random_weights
from tests.helpers.ports import port_or_skip

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=64)
BLOCK_SIZE, MAX_BATCH, MAX_BLOCKS = 4, 2, 8


def prefill_then_decode(port, model, widths, monkeypatch):
    """Two prompts (21 and 9 tokens) prefilled in one step with every position's log-probabilities,
    then one decode step: each step's tokens and log-probabilities, with the prefill cut into `widths`."""
    from kvports.jax_impl import paged

    monkeypatch.setattr(paged, "CHUNK_WIDTHS", widths)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 64, size=length).tolist() for length in (21, 9)]
    tokens = np.full((2, 21), PAD, dtype=np.int64)  # [B, T], left-padded
    for row, prompt in enumerate(prompts):
        tokens[row, 21 - len(prompt) :] = prompt
    block_tables = np.asarray([[0, 1, 2, 3, 4, 5], [6, 7, 8, -1, -1, -1]], dtype=np.int64)  # [B, M]
    sampling = RowSampling.of([GenerationConfig(4), GenerationConfig(4)], np.zeros(2))
    pool = port.init_block_pool(model, 12, BLOCK_SIZE, MAX_BATCH, MAX_BLOCKS)
    first, pool, prefill = port.paged_step(model, pool, tokens, np.zeros(2, np.int64), block_tables, sampling, 3, True)
    start = np.asarray([len(prompt) for prompt in prompts], dtype=np.int64)  # [B]
    second, pool, decode = port.paged_step(model, pool, first[:, None], start, block_tables, sampling, 3)
    # Only the real tokens' positions: a padding column's logits are whatever its masked attention gives.
    real = tokens != PAD  # [B, T]
    prefill = tuple(array[real] for array in prefill)  # [real tokens] and [real tokens, K] x 2
    return (first, second), (prefill, decode)


def test_a_prefill_in_chunks_gives_the_tokens_and_logprobs_of_one_call(monkeypatch):
    port = port_or_skip("jax")
    model = port.load_model(CONFIG, random_weights(CONFIG, seed=5), "float64")
    # 21 tokens: padded to 24, cut into 4 + 4 + 16 (a narrow chunk holding only padding for the
    # 9-token row); against one 64-wide call.
    chunked_tokens, chunked = prefill_then_decode(port, model, (4, 16), monkeypatch)
    whole_tokens, whole = prefill_then_decode(port, model, (64,), monkeypatch)
    for chunked_step, whole_step in zip(chunked_tokens, whole_tokens, strict=True):
        assert chunked_step.tolist() == whole_step.tolist()
    for chunked_step, whole_step in zip(chunked, whole, strict=True):
        assert chunked_step[1].tolist() == whole_step[1].tolist()  # the likeliest ids
        for mine, theirs in ((chunked_step[0], whole_step[0]), (chunked_step[2], whole_step[2])):
            np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("T", "every_position", "shape"),
    [
        (1, False, (16, (1,))),  # one token a row: a decode program, at the rung of rows above 5
        (1, True, (6, (16,))),
        (3, False, (6, (16,))),
        (16, False, (6, (16,))),
        (17, False, (6, (16, 16))),
        (64, False, (6, (64,))),
        (90, True, (6, (16, 16, 64))),
        (1000, False, (6, (16, 16, 16) + (64,) * 15)),
    ],
)
def test_a_prefill_block_of_5_rows_runs_in_6_rows_and_chunks_of_the_fixed_widths(T, every_position, shape):
    port_or_skip("jax")
    from kvports.jax_impl import paged

    assert paged.step_shape(16, 5, T, every_position) == shape
