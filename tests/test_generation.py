"""Naive == cached in every port; every port == the torch reference; the seed's golden tokens."""

from __future__ import annotations

import numpy as np
import pytest

from kvports.shared.errors import UserError
from tests.helpers.agreement import assert_logits_close, assert_tokens_agree
from tests.helpers.models import GOLDEN, SEED_PROMPT, llama_like, random_prompts, random_weights

LOGIT_ATOL = {"float32": 1e-5, "float64": 1e-10}


@pytest.mark.parametrize("mode", ["naive", "cached"])
def test_seed_model_gives_the_golden_tokens(port, seed_weights, mode):
    config, tensors = seed_weights
    model = port.load_model(config, tensors, "float32")
    tokens, _ = port.generate(model, SEED_PROMPT, len(GOLDEN), mode)
    assert tokens[0, :5].tolist() == SEED_PROMPT[0].tolist()
    assert tokens[0, 5:].tolist() == GOLDEN


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("prompt_len", [1, 2, 7, 64])
def test_cached_equals_naive_at_every_prompt_length(port, seed_weights, prompt_len, batch, dtype):
    config, tensors = seed_weights
    model = port.load_model(config, tensors, dtype)
    prompts = random_prompts(config.vocab_size, batch, prompt_len, seed=prompt_len * 10 + batch)
    naive, naive_logits = port.generate(model, prompts, 12, "naive", return_logits=True)
    cached, cached_logits = port.generate(model, prompts, 12, "cached", return_logits=True)
    # Within one port both paths run the same kernels on the same numbers, but not in the
    # same shapes, so float32 still allows a near-tie.
    agreement = assert_tokens_agree(naive, naive_logits, cached, prompt_len, f"{port.NAME} {dtype}")
    if dtype == "float64":
        assert agreement.agree
    assert_logits_close(naive_logits, cached_logits, LOGIT_ATOL[dtype], agreement)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mode", ["naive", "cached"])
def test_port_matches_torch_reference(port, reference, seed_weights, mode, dtype):
    config, tensors = seed_weights
    prompts = random_prompts(config.vocab_size, 3, 9, seed=7)
    expected, expected_logits = reference.generate(
        reference.load_model(config, tensors, dtype), prompts, 40, "naive", return_logits=True
    )
    tokens, logits = port.generate(port.load_model(config, tensors, dtype), prompts, 40, mode, return_logits=True)
    agreement = assert_tokens_agree(expected, expected_logits, tokens, 9, f"{port.NAME} {mode} {dtype}")
    if dtype == "float64":
        assert agreement.agree, agreement.describe()
    assert_logits_close(expected_logits, logits, LOGIT_ATOL[dtype], agreement)


@pytest.mark.parametrize("chunk_sizes", [[5, 3, 4], [1] * 12, [11, 1], [12]])
def test_chunked_prefill_equals_one_token_at_a_time(port, seed_weights, chunk_sizes):
    config, tensors = seed_weights
    model = port.load_model(config, tensors, "float64")
    tokens = random_prompts(config.vocab_size, 2, 12, seed=3)
    one_at_a_time = port.forward_chunks(model, tokens, [1] * 12)  # [B, T, V]
    chunked = port.forward_chunks(model, tokens, chunk_sizes)  # [B, T, V]
    np.testing.assert_allclose(chunked, one_at_a_time, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "chunk_sizes, message",
    [
        ([5, 3], "chunk sizes [5, 3] add up to 8, not the 12 tokens given"),
        ([5, 3, 5], "chunk sizes [5, 3, 5] add up to 13, not the 12 tokens given"),
        ([12, 0], "chunk size 0 is below 1"),
        ([6.0, 6], "chunk size 6.0 is not an integer"),
    ],
)
def test_forward_chunks_refuses_chunk_sizes_that_do_not_add_up_to_the_tokens(port, seed_weights, chunk_sizes, message):
    config, tensors = seed_weights
    model = port.load_model(config, tensors)
    with pytest.raises(UserError) as refusal:
        port.forward_chunks(model, random_prompts(config.vocab_size, 2, 12), chunk_sizes)
    assert str(refusal.value) == message


WINDOWED = llama_like(vocab_size=97, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=64, sliding_window=4)


@pytest.mark.parametrize("chunk_sizes", [[6, 1, 5, 1, 3], [16], [3, 9, 4], [2] * 8])
def test_chunks_wider_than_a_sliding_window_ring_equal_one_token_at_a_time(port, chunk_sizes):
    # A ring of 4 slots: a chunk of more than one token would overwrite keys its own first
    # queries still need, if it were written before it is attended.
    model = port.load_model(WINDOWED, random_weights(WINDOWED, seed=1), "float64")
    tokens = random_prompts(WINDOWED.vocab_size, 2, 16, seed=5)
    one_at_a_time = port.forward_chunks(model, tokens, [1] * 16)  # [B, T, V]
    chunked = port.forward_chunks(model, tokens, chunk_sizes)  # [B, T, V]
    np.testing.assert_allclose(chunked, one_at_a_time, atol=1e-10, rtol=0)


@pytest.mark.parametrize("mode", ["naive", "cached"])
def test_sliding_window_generation_past_the_window_matches_torch(port, reference, mode):
    weights = random_weights(WINDOWED, seed=2)
    prompts = random_prompts(WINDOWED.vocab_size, 2, 7, seed=9)
    expected, expected_logits = reference.generate(
        reference.load_model(WINDOWED, weights, "float64"), prompts, 20, "naive", return_logits=True
    )
    tokens, logits = port.generate(port.load_model(WINDOWED, weights, "float64"), prompts, 20, mode, return_logits=True)
    assert tokens.tolist() == expected.tolist()
    np.testing.assert_allclose(logits, expected_logits, atol=1e-10, rtol=0)
