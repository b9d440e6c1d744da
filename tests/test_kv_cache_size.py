"""What GQA, MQA and a sliding window buy: the bytes of the cache a port really allocates
(its `init_cache`, the function `generate_cached` calls), against shared.config.kv_cache_bytes."""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest

from kvports.shared.config import ModelConfig, kv_cache_bytes
from tests.helpers.models import llama_like, random_weights
from tests.helpers.ports import port_or_skip

# Same d_model, heads and layers: only the k/v heads and the window differ.
BASE = llama_like(vocab_size=64, d_model=64, n_heads=8, n_layers=2, max_seq_len=256)
VARIANTS = {
    "mha": BASE,
    "gqa": dataclasses.replace(BASE, n_kv_heads=2),
    "mqa": dataclasses.replace(BASE, n_kv_heads=1),
    "window": dataclasses.replace(BASE, n_kv_heads=2, sliding_window=16),
}
BATCH, TOTAL = 2, 64  # the windowed model generates 4x its window


def allocated_bytes(port, config: ModelConfig, batch: int, total_len: int) -> int:
    """keys.nbytes + values.nbytes of the cache the port's own init_cache builds."""
    model_module = importlib.import_module(f"kvports.{port.NAME}_impl.model")
    dtype = importlib.import_module("torch").float32 if port.NAME == "torch" else np.float32
    cache = model_module.init_cache(config, batch, total_len, dtype)
    return sum(
        int(np.prod(a.shape)) * np.dtype(str(a.dtype).replace("torch.", "")).itemsize
        for a in (cache.keys, cache.values)
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_allocated_cache_is_kv_cache_bytes(port, variant):
    config = VARIANTS[variant]
    assert allocated_bytes(port, config, BATCH, TOTAL) == kv_cache_bytes(config, BATCH, TOTAL, 4)


def test_gqa_and_mqa_shrink_the_cache_by_the_kv_head_ratio(port):
    sizes = {name: allocated_bytes(port, VARIANTS[name], BATCH, TOTAL) for name in ("mha", "gqa", "mqa")}
    assert sizes["mha"] == 4 * sizes["gqa"] == 8 * sizes["mqa"]  # 8, 2 and 1 k/v heads


def test_windowed_cache_holds_the_window_not_the_sequence(port):
    window = VARIANTS["window"]
    assert allocated_bytes(port, window, BATCH, TOTAL) * 4 == allocated_bytes(port, VARIANTS["gqa"], BATCH, TOTAL)


@pytest.mark.parametrize("name", ["torch", "numpy"])
def test_cached_generation_allocates_through_init_cache(name, monkeypatch):
    """The bytes measured above are the ones generation uses: generate_cached builds its
    cache with model.py's init_cache, once, of window size. (JAX allocates inside its compiled call.)"""
    port = port_or_skip(name)
    model_module = importlib.import_module(f"kvports.{name}_impl.model")
    generate_module = importlib.import_module(f"kvports.{name}_impl.generate")
    made = []

    def recording_init_cache(*args, **kwargs):
        made.append(original(*args, **kwargs))
        return made[-1]

    original = model_module.init_cache
    assert generate_module.init_cache is original
    monkeypatch.setattr(generate_module, "init_cache", recording_init_cache)
    config = VARIANTS["window"]
    model = port.load_model(config, random_weights(config), "float32")
    port.generate(model, np.zeros((BATCH, 16), np.int64), TOTAL - 16, "cached")
    assert len(made) == 1 and made[0].keys.shape[3] == config.sliding_window
