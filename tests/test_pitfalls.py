"""The seed's three silent pitfalls, each shown to break the naive == cached check."""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest

from tests.conftest import SEED_PROMPT
from tests.helpers import assert_logits_close, assert_tokens_agree

NEW_TOKENS = 8


def model_module(port):
    return importlib.import_module(port.__name__.rsplit(".", 1)[0] + ".model")


def naive_equals_cached(port, model, prompts):
    naive, naive_logits = port.generate(model, prompts, NEW_TOKENS, "naive", return_logits=True)
    cached, cached_logits = port.generate(model, prompts, NEW_TOKENS, "cached", return_logits=True)
    agreement = assert_tokens_agree(naive, naive_logits, cached, prompts.shape[1], port.NAME)
    assert_logits_close(naive_logits, cached_logits, 1e-5, agreement, port.NAME)


def fresh_compilations(port):
    # JAX reuses a compiled program for shapes it has seen; a patched helper must be retraced.
    port.clear_compiled()


def test_position_offset_from_cache_length_is_required(port, seed_weights, monkeypatch):
    config, tensors = seed_weights
    model = port.load_model(config, tensors, "float32")
    naive_equals_cached(port, model, SEED_PROMPT)

    module = model_module(port)
    correct = module.token_positions
    monkeypatch.setattr(module, "token_positions", lambda start, length: correct(0, length))  # positions restart at 0
    fresh_compilations(port)
    with pytest.raises(AssertionError):
        naive_equals_cached(port, model, SEED_PROMPT)
    fresh_compilations(port)


def test_prefill_is_one_forward_and_token_by_token_costs_more(port, seed_weights):
    config, tensors = seed_weights
    model = port.load_model(config, tensors, "float32")
    prompt_len = SEED_PROMPT.shape[1]
    fresh_compilations(port)
    before = port.forward_calls(model)
    prefilled, _ = port.generate(model, SEED_PROMPT, NEW_TOKENS, "cached", prefill=True)
    prefill_calls = port.forward_calls(model) - before
    fresh_compilations(port)
    before = port.forward_calls(model)
    token_by_token, _ = port.generate(model, SEED_PROMPT, NEW_TOKENS, "cached", prefill=False)
    token_by_token_calls = port.forward_calls(model) - before
    assert token_by_token.tolist() == prefilled.tolist()  # same cache, same tokens...
    assert token_by_token_calls - prefill_calls == prompt_len - 1  # ...from P forwards instead of one


def test_generation_runs_with_dropout_off_even_from_train_mode(port, seed_weights):
    config, tensors = seed_weights
    model = port.load_model(dataclasses.replace(config, dropout=0.5), tensors, "float32")
    model.train()
    naive_equals_cached(port, model, SEED_PROMPT)


def full_forward_equals_token_by_token(port, model, tokens):
    T = tokens.shape[1]
    full = port.forward_chunks(model, tokens, [T])  # [B, T, V]: the whole history at once, as naive does
    step_by_step = port.forward_chunks(model, tokens, [1] * T)  # [B, T, V]: one token at a time, as cached does
    np.testing.assert_allclose(step_by_step, full, atol=1e-5, rtol=0)


def test_dropout_left_active_breaks_naive_equals_cached(port, seed_weights, monkeypatch):
    config, tensors = seed_weights
    model = port.load_model(dataclasses.replace(config, dropout=0.5), tensors, "float32")
    full_forward_equals_token_by_token(port, model, SEED_PROMPT)
    model.train()
    # The broken variant: forward calls that never switch to eval. (A compiled JAX decode
    # loop cannot even draw dropout noise, so the check runs on the forward calls themselves.)
    monkeypatch.setattr(type(model), "eval", lambda self: self)
    fresh_compilations(port)
    with pytest.raises(AssertionError):
        full_forward_equals_token_by_token(port, model, SEED_PROMPT)
    fresh_compilations(port)
