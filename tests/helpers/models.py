"""The models the tests run: the seed's golden tokens and prompt, a tiny model of each family,
random weights and prompts for any config."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvports.shared.config import ModelConfig
from tests.helpers.ports import port_or_skip

GOLDEN = [
    315,
    391,
    221,
    120,
    342,
    371,
    223,
    418,
    20,
    350,
    493,
    286,
    342,
    444,
    438,
    281,
    424,
    121,
    456,
    214,
    244,
    113,
    142,
    198,
    381,
    65,
    409,
    15,
    299,
    483,
    94,
    398,
    454,
    387,
    344,
    214,
    477,
    230,
    223,
    421,
    43,
    481,
    172,
    103,
    26,
    252,
    226,
    134,
    492,
    358,
    243,
    34,
    493,
    458,
    337,
    495,
    17,
    249,
    435,
    301,
    360,
    432,
    374,
    274,
    316,
    57,
    82,
    163,
    122,
    421,
    136,
    41,
    383,
    107,
    467,
    143,
    424,
    456,
    239,
    391,
    253,
    301,
    279,
    358,
    491,
    390,
    366,
    444,
    476,
    464,
    136,
    428,
    29,
    194,
    175,
    46,
    147,
    83,
    75,
    289,
]  # the seed's README: torch.manual_seed(0) model, 100 greedy tokens
SEED_PROMPT = np.array([[160, 248, 104, 209, 394]], dtype=np.int64)  # [1, 5]
SEED = SEED_PROMPT[0].tolist()  # the seed's prompt as a list of ids


# A tiny model of each family the ports run beyond the seed's: tied GPT-2, GQA Llama, and Mistral
# with a window of 4 (shorter than any prompt + generation that uses it).
LLAMA_PARTS = {"positions": "rope", "norm": "rmsnorm", "activation": "swiglu", "attn_bias": False, "ffn_bias": False}


def llama_like(**sizes) -> ModelConfig:
    """A config in Llama's architecture (RoPE, RMSNorm, SwiGLU, no biases) at the given sizes."""
    return ModelConfig(**LLAMA_PARTS, **sizes)


_LLAMA = llama_like(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=48)
TINY_FAMILIES = {
    "gpt2": ModelConfig(
        vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_seq_len=48, activation="gelu_tanh", tie_embeddings=True
    ),
    "llama": _LLAMA,
    "mistral": dataclasses.replace(_LLAMA, sliding_window=4, tie_embeddings=True),
    # The families built on Llama, at the same size: Qwen3's head size 16 (not 32 / 4) and qk-norm;
    # Gemma 3's every switch, a windowed layer and a global one.
    "qwen3": dataclasses.replace(_LLAMA, head_size=16, qk_norm=True),
    "gemma3": dataclasses.replace(
        _LLAMA,
        n_kv_heads=1,
        head_size=16,
        qk_norm=True,
        post_norms=True,
        activation="geglu_tanh",
        embed_scale=5.656854152679443,  # sqrt(32) in float32, as transformers rounds it
        attn_scale=24**-0.5,
        sliding_window=3,
        global_layers=(1,),
        rope_local_theta=10000.0,
        rope_theta=1000000.0,
        tie_embeddings=True,
    ),
}


# A Llama-shaped model whose config allows a million positions: nothing but the byte limit
# bounds a run's length.
LONG = ModelConfig(
    vocab_size=500,
    d_model=64,
    n_heads=4,
    n_layers=2,
    max_seq_len=2**20,
    positions="rope",
    norm="rmsnorm",
    activation="swiglu",
    attn_bias=False,
    ffn_bias=False,
)


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Weights for any config, from the reference initialisation (torch)."""
    return port_or_skip("torch").init_weights(config, seed)  # type: ignore[attr-defined]


def random_prompts(vocab_size: int, batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, size=(batch, length), dtype=np.int64)  # [B, P]
