"""The compiled row's loop (torch_impl/fast/compiled.py): generate.py's generate_cached, run over a cache
whose length is a tensor, gives the eager cached loop's tokens; with the forward under torch.compile too."""

from __future__ import annotations

import numpy as np
import pytest

from kvports.shared.config import ModelConfig
from kvports.shared.generation import GenerationConfig, pad_prompts
from tests.helpers.models import random_weights

torch = pytest.importorskip("torch")
from kvports.torch_impl.fast.compiled import CompiledKVCache, generate_compiled  # noqa: E402
from kvports.torch_impl.generate import generate_cached  # noqa: E402
from kvports.torch_impl.model import TinyModel  # noqa: E402

# A window shorter than prompt + new tokens: the compiled cache's ring wraps (slot_index's traced column).
CONFIG = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=64, norm="rmsnorm")
WINDOWED = ModelConfig(**{**CONFIG.__dict__, "sliding_window": 6})
PROMPTS = pad_prompts([[5, 9, 2, 40], [11, 3, 8, 1, 7]])[0]  # [2, 5], row 0 left-padded


def model_of(config: ModelConfig) -> TinyModel:
    model = TinyModel(config)
    model.load_state_dict({name: torch.from_numpy(array) for name, array in random_weights(config, seed=4).items()})
    return model.eval()


@pytest.mark.parametrize("config", [CONFIG, WINDOWED], ids=["full", "window"])
def test_the_compiled_rows_loop_gives_the_eager_cached_loops_tokens_and_logits(config):
    model = model_of(config)
    generation = GenerationConfig(max_new_tokens=9)
    prompt = torch.from_numpy(np.asarray(PROMPTS))
    eager_tokens, eager_logits = generate_cached(model, prompt, generation, return_logits=True)
    tokens, logits = generate_compiled(model, prompt, generation, return_logits=True)
    assert torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)


def test_every_forward_of_the_compiled_rows_loop_gets_the_tensor_length_cache(monkeypatch):
    model = model_of(CONFIG)
    seen = []
    forward = model.forward

    def records(tokens, cache=None, *args, **kwargs):
        seen.append(type(cache))
        return forward(tokens, cache, *args, **kwargs)

    monkeypatch.setattr(model, "forward", records)
    generate_compiled(model, torch.from_numpy(np.asarray(PROMPTS)), GenerationConfig(max_new_tokens=4))
    assert seen == [CompiledKVCache] * 4  # the prompt's forward, then one a step for the 3 tokens after the first
