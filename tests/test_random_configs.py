"""Random configs, every option mixed: naive == cached in each port, and each port == torch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvports.shared.config import ModelConfig
from tests.helpers.agreement import assert_logits_close, assert_tokens_agree
from tests.helpers.models import random_prompts, random_weights


@st.composite
def configs(draw):
    n_heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([4, 8]))
    swiglu = draw(st.booleans())
    return ModelConfig(
        vocab_size=draw(st.integers(8, 64)),
        d_model=n_heads * head_dim,
        n_heads=n_heads,
        n_layers=draw(st.integers(1, 3)),
        max_seq_len=32,
        n_kv_heads=draw(st.sampled_from([d for d in (1, 2, 4) if n_heads % d == 0])),
        activation="swiglu" if swiglu else draw(st.sampled_from(["gelu", "gelu_tanh"])),
        ffn_hidden=draw(st.sampled_from([None, 12])),
        norm=draw(st.sampled_from(["layernorm", "rmsnorm"])),
        positions=draw(st.sampled_from(["learned", "rope"])),
        tie_embeddings=draw(st.booleans()),
        attn_bias=draw(st.booleans()),
        ffn_bias=draw(st.booleans()),
        sliding_window=draw(st.sampled_from([None, 2, 5])),
    ).validate()


@pytest.mark.slow
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=configs(), prompt_len=st.integers(1, 9), batch=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_random_config_cached_equals_naive_and_matches_torch(port, reference, config, prompt_len, batch, seed):
    tensors = random_weights(config, seed)
    prompts = random_prompts(config.vocab_size, batch, prompt_len, seed)
    new_tokens = 32 - prompt_len - np.random.default_rng(seed).integers(0, 10)
    expected, expected_logits = reference.generate(
        reference.load_model(config, tensors, "float64"), prompts, new_tokens, "naive", return_logits=True
    )
    for mode in ("naive", "cached"):
        tokens, logits = port.generate(
            port.load_model(config, tensors, "float64"), prompts, new_tokens, mode, return_logits=True
        )
        agreement = assert_tokens_agree(expected, expected_logits, tokens, prompt_len, f"{port.NAME} {mode} {config}")
        assert agreement.agree, agreement.describe()
        assert_logits_close(expected_logits, logits, 1e-9, agreement, f"{port.NAME} {mode}")
