"""Speculative decoding: whatever the draft proposes, the output is the target's own, and a
rejected proposal leaves no trace in the cache."""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest

from kvports.shared.config import ModelConfig
from kvports.shared.generation import GenerationConfig, pad_prompts
from tests.helpers.models import LLAMA_PARTS, TINY_FAMILIES, random_weights
from tests.helpers.ports import calling_internals

BASE = ModelConfig(vocab_size=48, d_model=32, n_heads=4, n_layers=2, max_seq_len=96)
ATTENTION = {
    "mha": BASE,
    "gqa": dataclasses.replace(BASE, n_kv_heads=2, **LLAMA_PARTS),
    "window": dataclasses.replace(BASE, n_kv_heads=1, sliding_window=5, **LLAMA_PARTS),  # shorter than the generation
    # Gemma 3's switches: a global layer (0, which the one-layer draft keeps) and a windowed one (no ring).
    "gemma3": dataclasses.replace(
        TINY_FAMILIES["gemma3"], vocab_size=48, max_seq_len=96, sliding_window=5, global_layers=(0,)
    ),
}
# Repetitive rows, so prompt lookup finds something; of different lengths, so rows accept differently.
PROMPTS = pad_prompts([[3, 7, 9, 3, 7, 9, 3, 7], [11, 4, 11, 4, 11], [30, 2, 8, 30, 2, 8, 30, 2]])[0]


def first_layers(tensors, layers: int):
    """The target's first layers as a draft: a cheap model whose guesses are often right."""
    return {
        name: array
        for name, array in tensors.items()
        if not name.startswith("blocks.") or int(name.split(".")[1]) < layers
    }


@pytest.fixture(scope="module", params=sorted(ATTENTION))
def pair(request):
    """(config, target weights, draft config, draft weights) per attention kind."""
    config = ATTENTION[request.param]
    tensors = random_weights(config, seed=5)
    return config, tensors, dataclasses.replace(config, n_layers=1), first_layers(tensors, 1)


def load(port, config, tensors):
    return port.load_model(config, tensors, "float64")


@pytest.mark.parametrize("draft_kind", ["model", "ngram"])
@pytest.mark.parametrize("batch", [1, 3])
def test_speculative_equals_cached_greedy(port, pair, draft_kind, batch):
    config, tensors, draft_config, draft_tensors = pair
    target = load(port, config, tensors)
    draft = load(port, draft_config, draft_tensors) if draft_kind == "model" else None
    prompts = PROMPTS[:batch] if batch > 1 else PROMPTS[:1, :]
    expected, _ = port.generate(target, prompts, 20, "cached")
    tokens, counts = port.generate_speculative(target, draft, prompts, 20, draft_tokens=3)
    assert tokens.tolist() == expected.tolist()
    if draft_kind == "model":
        assert counts["accepted"] > 0  # some proposals were kept: the draft was used, not just survived


def rolled_head(tensors):
    """The target with its output rows shifted by one: it always proposes the token after the
    target's choice, so every proposal is wrong."""
    return {name: np.roll(array, 1, axis=0) if name == "head.weight" else array for name, array in tensors.items()}


def test_an_always_wrong_draft_still_gives_the_targets_tokens_one_forward_per_token(port):
    config = ATTENTION["mha"]
    tensors = random_weights(config, seed=5)
    target = load(port, config, tensors)
    expected, _ = port.generate(target, PROMPTS[:2], 12, "cached")
    tokens, counts = port.generate_speculative(target, load(port, config, rolled_head(tensors)), PROMPTS[:2], 12, 4)
    assert tokens.tolist() == expected.tolist()
    assert counts["accepted"] == 0 and counts["target_forwards"] == 12  # the prefill's token, then one per forward


def test_an_always_right_draft_makes_one_target_forward_per_k_plus_one_tokens(port):
    config = ATTENTION["gqa"]
    tensors = random_weights(config, seed=5)
    target = load(port, config, tensors)
    expected, _ = port.generate(target, PROMPTS[:2], 16, "cached")
    tokens, counts = port.generate_speculative(target, load(port, config, tensors), PROMPTS[:2], 16, 4)
    assert tokens.tolist() == expected.tolist()
    assert counts["rounds"] == 3 and counts["accepted"] == counts["proposed"]  # 1 + 3 x (4 + 1) = 16 tokens


def test_speculative_counts_are_the_same_in_every_port(port, reference, pair):
    config, tensors, draft_config, draft_tensors = pair
    generation = GenerationConfig(15, temperature=0.9, top_k=20, seed=4)
    expected = reference.generate_speculative(
        load(reference, config, tensors), load(reference, draft_config, draft_tensors), PROMPTS, generation, 3
    )
    tokens, counts = port.generate_speculative(
        load(port, config, tensors), load(port, draft_config, draft_tensors), PROMPTS, generation, 3
    )
    assert tokens.tolist() == expected[0].tolist()
    assert counts == expected[1]


@pytest.mark.parametrize("window", [None, 4])
def test_rollback_leaves_the_cache_as_if_the_rejected_tokens_were_never_written(port, window):
    config = dataclasses.replace(ATTENTION["gqa"], sliding_window=window)
    model = port.load_model(config, random_weights(config, seed=6), "float64")
    package = port.__name__.rsplit(".", 1)[0]
    module, generate = importlib.import_module(package + ".model"), importlib.import_module(package + ".generate")
    tokens = np.random.default_rng(2).integers(0, config.vocab_size, size=(2, 20))  # [B, 20]
    K = 4

    def run(chunks, crop_to=None):
        cache = module.init_cache(config, 2, 20, np.float64 if port.NAME == "numpy" else _dtype(port), chunk=K + 1)
        for index, (start, stop) in enumerate(chunks):
            logits, cache = generate.prefill(model, _array(port, tokens[:, start:stop]), cache)
            if index == 1 and crop_to is not None:
                cache = cache.crop(crop_to)
        return np.asarray(logits), cache

    # 9 tokens, a verified chunk of K + 1 with only 2 kept (crop back to 11), then 1 more: two
    # rejected slots stay unwritten, so a crop that only moved the length would show.
    with calling_internals(port):
        rolled, rolled_cache = run([(0, 9), (9, 14), (11, 12)], crop_to=11)
        fresh, fresh_cache = run([(0, 9), (9, 11), (11, 12)])
    np.testing.assert_allclose(rolled, fresh, atol=1e-12, rtol=0)  # the next token sees exactly the same keys

    def still_needed(cache):
        # Slot positions any later query can still see (-1 for the rest): in a ring, a slot a
        # rejected token overwrote held a position already outside the window.
        positions = np.asarray(cache.slot_positions)  # [B, S]
        lowest = 0 if window is None else 12 - window + 1  # the next token is position 12
        return np.where(positions >= lowest, positions, -1)

    positions = still_needed(rolled_cache)
    assert positions.tolist() == still_needed(fresh_cache).tolist()
    filled = positions >= 0  # [B, S]
    for name in ("keys", "values"):
        rolled_buffer = np.moveaxis(np.asarray(getattr(rolled_cache, name)), 3, 2)[
            :, filled
        ]  # [L, slots in use, Hkv, Dh]
        fresh_buffer = np.moveaxis(np.asarray(getattr(fresh_cache, name)), 3, 2)[:, filled]
        # The kept keys were computed in a wider chunk: BLAS may round their last bit differently.
        np.testing.assert_allclose(rolled_buffer, fresh_buffer, atol=1e-12, rtol=0)


def _dtype(port):
    if port.NAME == "torch":
        import torch

        return torch.float64
    import jax.numpy as jnp

    return jnp.float64


def _array(port, tokens):
    if port.NAME == "torch":
        import torch

        return torch.from_numpy(tokens)
    if port.NAME == "jax":
        import jax.numpy as jnp

        return jnp.asarray(tokens, dtype=jnp.int32)
    return tokens


def verify_many(port, target_logits, q, proposals, generation, uniform):
    module = importlib.import_module(port.__name__.rsplit(".", 1)[0] + ".speculative")
    if port.NAME == "torch":
        import torch

        accepted, final = module.verify(
            torch.from_numpy(target_logits),
            torch.from_numpy(q),
            torch.from_numpy(proposals),
            generation,
            torch.from_numpy(uniform),
        )
        return accepted.numpy(), final.numpy()
    if port.NAME == "jax":
        import jax.numpy as jnp

        with calling_internals(port):
            accepted, final = module.verify(
                jnp.asarray(target_logits), jnp.asarray(q), jnp.asarray(proposals), generation, jnp.asarray(uniform)
            )
        return np.asarray(accepted), np.asarray(final)
    return module.verify(target_logits, q, proposals, generation, uniform)


def test_the_accept_resample_rule_keeps_the_targets_distribution(port):
    V, K, M = 8, 2, 40_000
    rng = np.random.default_rng(0)  # fixed: the test is deterministic, never flaky
    generation = GenerationConfig(4, temperature=1.0)
    target_logits = np.repeat(
        rng.normal(0, 1.5, size=(1, K + 1, V)), M, axis=0
    )  # [M, K + 1, V]: one target distribution
    draft_probs = np.exp(rng.normal(0, 1.5, size=(K, V)))
    draft_probs /= draft_probs.sum(-1, keepdims=True)  # [K, V]: a draft that disagrees with it
    proposals = np.stack([rng.choice(V, size=M, p=draft_probs[i]) for i in range(K)], axis=1)  # [M, K], drawn from q
    q = np.repeat(draft_probs[None], M, axis=0)  # [M, K, V]
    accepted, final = verify_many(port, target_logits, q, proposals, generation, rng.random((M, K + 1)))
    first = np.where(accepted > 0, proposals[:, 0], final)  # the first token a round emits
    p = np.exp(target_logits[0, 0]) / np.exp(target_logits[0, 0]).sum()
    counts, expected = np.bincount(first, minlength=V), p * M
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 40, (chi2, counts, expected.round())  # 7 degrees of freedom: p < 1e-5 by chance
    assert 0 < (accepted > 0).mean() < 1  # some proposals kept and some refused: both branches ran
