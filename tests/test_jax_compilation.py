"""What only JAX has: compiled generation, a pytree cache, donation. Compilations are
counted from outside, by JAX's own monitoring events (one per trace of a jitted function)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.compiles import counting_traces

jax = pytest.importorskip("jax")
jax_port = pytest.importorskip("kvports.jax_impl.port")
jax_model = pytest.importorskip("kvports.jax_impl.model")
jax_generate = pytest.importorskip("kvports.jax_impl.generate")
jax_sampling = pytest.importorskip("kvports.jax_impl.sampling")


@pytest.fixture
def seed_model(seed_weights):
    config, tensors = seed_weights
    jax_port.clear_compiled()
    return jax_port.load_model(config, tensors, "float32")


@pytest.mark.parametrize("mode", ["naive", "cached"])
def test_generation_compiles_once_per_shape_whatever_its_length(seed_model, mode):
    rng = np.random.default_rng(0)
    with counting_traces() as first:
        jax_port.generate(seed_model, rng.integers(0, 500, size=(2, 6)), 25, mode)
    with counting_traces() as again:
        for _ in range(2):  # new prompt contents, same shapes: no new compile
            jax_port.generate(seed_model, rng.integers(0, 500, size=(2, 6)), 25, mode)
    with counting_traces() as new_shape:
        jax_port.generate(seed_model, rng.integers(0, 500, size=(2, 7)), 25, mode)
    assert len(first) > 0 and len(new_shape) > 0  # the counter sees compiles...
    assert again == []  # ...and there were none for the same shapes


def test_a_new_model_of_the_same_config_reuses_the_compiled_program(seed_weights, seed_model):
    config, tensors = seed_weights
    prompts = np.zeros((1, 4), dtype=np.int64)
    jax_port.generate(seed_model, prompts, 5, "cached")
    model = jax_port.load_model(config, tensors, "float32")  # its load traces the constructor's shapes, once
    with counting_traces() as traces:
        jax_port.generate(model, prompts, 5, "cached")
    assert traces == []


def test_streaming_decodes_with_one_compiled_step_for_every_position(seed_model):
    prompts = np.zeros((1, 4), dtype=np.int64)
    jax_port.generate(seed_model, prompts, 6, "cached", on_token=lambda token: None)
    with counting_traces() as traces:
        streamed = []
        tokens, _ = jax_port.generate(seed_model, prompts, 6, "cached", on_token=streamed.append)
    assert traces == []
    assert np.stack(streamed, axis=1).tolist() == tokens[:, 4:].tolist()


def test_the_cache_is_a_pytree_of_fixed_shape_buffers(seed_weights):
    config, _ = seed_weights
    cache = jax_model.init_cache(config, 2, 30, jax.numpy.float32)
    shapes = [leaf.shape for leaf in jax.tree.leaves(cache)]
    assert shapes == [(2, 2, 4, 30, 32), (2, 2, 4, 30, 32), (2, 30), ()]


def test_a_forward_donates_the_cache_and_returns_the_updated_one(seed_model):
    with jax.enable_x64(True):  # as the port runs it (jax_impl/port.py's exact)
        cache = jax_model.init_cache(seed_model.config, 1, 8, jax.numpy.float32)
        prompt = jax.numpy.asarray([[160, 248, 104, 209, 394]], dtype=jax.numpy.int32)
        logits, new_cache = jax_generate.prefill(seed_model, prompt, cache)
        assert cache.keys.is_deleted()  # donated: XLA reused its buffer for new_cache
        token = jax_sampling.greedy(logits[:, -1])[:, None]  # [B, 1]
        logits, newer_cache = jax_generate.prefill(seed_model, token, new_cache)  # a decode step: one token
        assert new_cache.keys.is_deleted()
        assert int(newer_cache.length) == 6 and int(token[0, 0]) == 315
        assert int(jax_sampling.greedy(logits[:, -1])[0]) == 391


def test_the_port_turns_on_x64_for_its_own_calls_only(seed_weights):
    config, tensors = seed_weights
    assert not jax.config.jax_enable_x64  # importing the port left the process's setting alone
    model = jax_port.load_model(config, tensors, "float64")
    assert model.emb.embedding.dtype == jax.numpy.float64  # real float64 inside the call
    assert not jax.config.jax_enable_x64


def test_float32_and_float64_runs_in_one_process_each_keep_their_dtype(seed_weights):
    config, tensors = seed_weights
    prompts = np.zeros((1, 4), dtype=np.int64)
    for dtype in ("float32", "float64", "float32"):  # the same shapes: a stale program would give the other dtype
        model = jax_port.load_model(config, tensors, dtype)
        _, logits = jax_port.generate(model, prompts, 3, "cached", return_logits=True)
        assert logits.dtype == np.dtype(dtype)


def test_the_batching_engine_compiles_once_whatever_the_requests_sampling_values(seed_model):
    from kvports.batching.engine import BatchSettings, Engine
    from kvports.batching.request import Request
    from kvports.shared.generation import GenerationConfig

    def run(temperatures):
        engine = Engine(jax_port, seed_model, seed_model.config, BatchSettings(max_batch=4, max_length=32))
        for i, temperature in enumerate(temperatures):
            setting = GenerationConfig(4, temperature=temperature, top_k=i * 7, top_p=1 - i / 10, seed=i)
            engine.add(Request(str(i), (160, 248, 104), setting))
        engine.run()

    run([0.5, 0.6, 0.7, 0.8])
    with counting_traces() as traces:
        run([0.9, 1.1, 1.3, 1.7])  # new values, the same shapes: no new compile
    assert traces == []


def test_a_process_past_half_its_memory_mappings_drops_its_programs_and_answers_the_same(seed_model, monkeypatch):
    """XLA:CPU maps pages of their own for each compiled kernel, and JAX keeps every program: a
    process that had generated from ~40 SmolLM2 prompt lengths passed vm.max_map_count and died.
    Past half the limit, a call drops every program first, then compiles its own again."""
    prompts = np.zeros((1, 4), dtype=np.int64)
    expected, _ = jax_port.generate(seed_model, prompts, 5, "cached")  # compiles: the next call counts
    monkeypatch.setattr(jax_port, "map_limit", lambda: jax_port.mappings())  # the process is past half of it
    with counting_traces() as traces:
        tokens, _ = jax_port.generate(seed_model, prompts, 5, "cached")
    assert traces  # its programs were dropped: the same shapes traced again
    assert tokens.tolist() == expected.tolist()


def test_the_mappings_are_counted_only_after_a_program_was_compiled(seed_model, monkeypatch):
    prompts = np.zeros((1, 4), dtype=np.int64)
    jax_port.generate(seed_model, prompts, 5, "cached")  # compiles (or loads from the disk cache)
    counted = []
    monkeypatch.setattr(jax_port, "mappings", lambda: counted.append(1) or 0)
    jax_port.generate(seed_model, prompts, 5, "cached")  # counts once: the first call compiled
    jax_port.generate(seed_model, prompts, 5, "cached")  # nothing compiled since: no count
    assert counted == [1]
