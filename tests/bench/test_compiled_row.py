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


@pytest.mark.parametrize("threads", [1, 2])
def test_dynamo_traces_a_loaded_rope_models_forward_whole_and_keeps_its_tokens(threads):
    """The port's own loaded model (its Linear through fast/onednn.py and fast/cores.py) with RoPE, as
    the bench's compiled row runs it, traced by dynamo in one graph (fullgraph: a graph break raises),
    at 1 and 2 threads. A break there once failed the row: cores.py asked torch.get_num_threads() before
    seeing it was compiling, and the graph resumed after the break failed its own guard on the RoPE
    frequencies under inference mode. The eager backend keeps the test quick: the break is dynamo's."""
    from kvports.torch_impl import port

    config = ModelConfig(**{**CONFIG.__dict__, "positions": "rope"})
    model = port.load_model(config, random_weights(config, seed=4), "float32")
    prompt = torch.from_numpy(np.asarray(PROMPTS))
    generation = GenerationConfig(max_new_tokens=5)
    eager, _ = generate_cached(model, prompt, generation)
    threads_before = torch.get_num_threads()
    torch._dynamo.reset()
    try:
        torch.set_num_threads(threads)
        model.compile(backend="eager", fullgraph=True)
        tokens, _ = generate_compiled(model, prompt, generation)
    finally:
        torch.set_num_threads(threads_before)
        torch._dynamo.reset()
    assert torch.equal(tokens, eager)
