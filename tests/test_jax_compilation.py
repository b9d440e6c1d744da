"""What only JAX has: compiled generation, a pytree cache, donation."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax_port = pytest.importorskip("kvports.jax_impl.port")
jax_model = pytest.importorskip("kvports.jax_impl.model")


@pytest.fixture
def seed_model(seed_weights):
    config, tensors = seed_weights
    jax_port.clear_compiled()
    return jax_port.load_model(config, tensors, "float32")


@pytest.mark.parametrize("mode", ["naive", "cached"])
def test_generation_compiles_once_per_shape_whatever_its_length(seed_model, mode):
    name = f"generate_{mode}"
    before = jax_model.trace_counts[name]
    rng = np.random.default_rng(0)
    for _ in range(3):  # new prompt contents, same shapes: no new compile
        jax_port.generate(seed_model, rng.integers(0, 500, size=(2, 6)), 25, mode)
    assert jax_model.trace_counts[name] - before == 1


def test_a_new_model_of_the_same_config_reuses_the_compiled_program(seed_weights, seed_model):
    config, tensors = seed_weights
    prompts = np.zeros((1, 4), dtype=np.int64)
    jax_port.generate(seed_model, prompts, 5, "cached")
    before = jax_model.trace_counts["generate_cached"]
    jax_port.generate(jax_port.load_model(config, tensors, "float32"), prompts, 5, "cached")
    assert jax_model.trace_counts["generate_cached"] == before


def test_the_cache_is_a_pytree_of_fixed_shape_buffers(seed_weights):
    config, _ = seed_weights
    cache = jax_model.init_cache(config, 2, 30, jax.numpy.float32)
    shapes = [leaf.shape for leaf in jax.tree.leaves(cache)]
    assert shapes == [(2, 2, 4, 30, 32), (2, 2, 4, 30, 32), (30,), ()]


def test_decode_step_donates_the_cache_and_returns_the_updated_one(seed_model):
    cache = jax_model.init_cache(seed_model.config, 1, 8, jax.numpy.float32)
    prompt = jax.numpy.asarray([[160, 248, 104, 209, 394]], dtype=jax.numpy.int32)
    logits, new_cache = jax_model.prefill(seed_model, prompt, cache)
    assert cache.keys.is_deleted()  # donated: XLA reused its buffer for new_cache
    token = jax_model.greedy(logits[:, -1])[:, None]  # [B, 1]
    logits, newer_cache = jax_model.decode_step(seed_model, token, new_cache)
    assert new_cache.keys.is_deleted()
    assert int(newer_cache.length) == 6 and int(token[0, 0]) == 315
    assert int(jax_model.greedy(logits[:, -1])[0]) == 391
