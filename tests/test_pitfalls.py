"""The seed's three silent pitfalls, each shown to break the naive == cached check."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

import numpy as np

from tests.helpers.agreement import assert_logits_close, assert_tokens_agree
from tests.helpers.models import SEED_PROMPT

NEW_TOKENS = 8


def model_module(port):
    return importlib.import_module(port.__name__.rsplit(".", 1)[0] + ".model")


def naive_and_cached(port, model, prompts):
    naive, naive_logits = port.generate(model, prompts, NEW_TOKENS, "naive", return_logits=True)
    cached, cached_logits = port.generate(model, prompts, NEW_TOKENS, "cached", return_logits=True)
    return naive, naive_logits, cached, cached_logits


def assert_naive_equals_cached(port, model, prompts):
    naive, naive_logits, cached, cached_logits = naive_and_cached(port, model, prompts)
    agreement = assert_tokens_agree(naive, naive_logits, cached, prompts.shape[1], port.NAME)
    assert_logits_close(naive_logits, cached_logits, 1e-5, agreement, port.NAME)


@contextlib.contextmanager
def retraced(port):
    # JAX reuses a compiled program for shapes it has seen; a patched helper must be traced again.
    port.clear_compiled()
    try:
        yield
    finally:
        port.clear_compiled()


def test_position_offset_from_cache_length_is_required(port, seed_weights, monkeypatch):
    config, tensors = seed_weights
    model = port.load_model(config, tensors, "float32")
    assert_naive_equals_cached(port, model, SEED_PROMPT)

    module = model_module(port)
    correct = module.token_positions
    monkeypatch.setattr(module, "token_positions", lambda start, length, pad: correct(0, length, pad))  # restart at 0
    with retraced(port):
        naive, naive_logits, cached, cached_logits = naive_and_cached(port, model, SEED_PROMPT)
    # The mask is right and the prefill still matches; every decoded step after it is wrong.
    np.testing.assert_allclose(cached_logits[:, 0], naive_logits[:, 0], atol=1e-5, rtol=0)
    assert np.abs(cached_logits[:, 1:] - naive_logits[:, 1:]).max() > 0.1
    assert naive[0, 6:].tolist() != cached[0, 6:].tolist()


class ForwardCalls(list):
    logits: list[tuple[int, ...]]

    def __init__(self):
        super().__init__()
        self.logits = []


@contextlib.contextmanager
def counting_forwards(port, model, monkeypatch):
    """Count the model's forward calls from outside (JAX: the calls traced into its compiled program):
    each call's tokens shape, its logits' shape in `calls.logits`."""
    calls = ForwardCalls()
    model_class = type(model)
    forward = model_class.__call__

    def counted(self, *args, **kwargs):
        calls.append(args[0].shape)
        logits, cache = forward(self, *args, **kwargs)
        calls.logits.append(tuple(logits.shape))
        return logits, cache

    monkeypatch.setattr(model_class, "__call__", counted)
    with retraced(port):
        yield calls
    monkeypatch.setattr(model_class, "__call__", forward)


def test_prefill_is_one_forward_and_token_by_token_costs_more(port, seed_weights, monkeypatch):
    config, tensors = seed_weights
    model = port.load_model(config, tensors, "float32")
    prompt_len = SEED_PROMPT.shape[1]
    with counting_forwards(port, model, monkeypatch) as calls:
        prefilled, _ = port.generate(model, SEED_PROMPT, NEW_TOKENS, "cached", prefill=True)
    prefill_calls = len(calls)
    assert calls[0] == (1, prompt_len)  # the whole prompt in the first forward
    with counting_forwards(port, model, monkeypatch) as calls:
        token_by_token, _ = port.generate(model, SEED_PROMPT, NEW_TOKENS, "cached", prefill=False)
    assert calls[:prompt_len] == [(1, 1)] * prompt_len  # the prompt one token per forward
    assert token_by_token.tolist() == prefilled.tolist()  # same cache, same tokens...
    assert len(calls) - prefill_calls == prompt_len - 1  # ...from P forwards instead of one


def test_the_prefill_runs_the_head_over_its_last_position_only(port, seed_weights, monkeypatch):
    """The first new token needs the prompt's last logits alone: the head (V x D a position, a real
    model's largest product) runs once, not once per prompt token; the decode steps are unchanged."""
    config, tensors = seed_weights
    model = port.load_model(config, tensors, "float32")
    with counting_forwards(port, model, monkeypatch) as calls:
        port.generate(model, SEED_PROMPT, NEW_TOKENS, "cached")
    assert calls[0] == SEED_PROMPT.shape and calls.logits[0] == (1, 1, config.vocab_size)
    assert set(calls.logits[1:]) == {(1, 1, config.vocab_size)}  # (the tokens: the golden tests')


def test_generation_runs_with_dropout_off_even_from_train_mode(port, seed_weights):
    config, tensors = seed_weights
    model = port.load_model(dataclasses.replace(config, dropout=0.5), tensors, "float32")
    model.train()
    assert_naive_equals_cached(port, model, SEED_PROMPT)


def full_and_token_by_token(port, model, tokens):
    T = tokens.shape[1]
    full = port.forward_chunks(model, tokens, [T])  # [B, T, V]: the whole history at once, as naive does
    step_by_step = port.forward_chunks(model, tokens, [1] * T)  # [B, T, V]: one token at a time, as cached does
    return full, step_by_step


def test_dropout_left_active_breaks_naive_equals_cached(port, seed_weights, monkeypatch):
    config, tensors = seed_weights
    model = port.load_model(dataclasses.replace(config, dropout=0.5), tensors, "float32")
    full, step_by_step = full_and_token_by_token(port, model, SEED_PROMPT)
    np.testing.assert_allclose(step_by_step, full, atol=1e-5, rtol=0)
    model.train()
    # The broken variant: forward calls that never switch to eval. (A compiled JAX decode
    # loop cannot even draw dropout noise, so the check runs on the forward calls themselves.)
    monkeypatch.setattr(type(model), "eval", lambda self: self)
    with retraced(port):
        full, step_by_step = full_and_token_by_token(port, model, SEED_PROMPT)
    assert np.abs(step_by_step - full).max() > 0.1
