"""What the command line, the tests and the benchmark call: NumPy in, NumPy out.
The same five names in every port; only the framework calls differ."""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from shared.config import ModelConfig
from numpy_impl.model import TinyModel, generate_cached, generate_naive, init_cache

NAME = "numpy"
NUMPY_DTYPES = {"float32": np.float32, "float64": np.float64}


def versions() -> Dict[str, str]:
    return {"numpy": np.__version__}


def resolve_device(device: str) -> str:
    if device == "gpu":
        raise RuntimeError("numpy runs on the CPU only")
    return "cpu"


def load_model(config: ModelConfig, tensors: Dict[str, np.ndarray], dtype: str = "float32", device: str = "cpu") -> TinyModel:
    resolve_device(device)
    model = TinyModel(config)  # placeholder weights: every tensor comes from the file
    model.load_state_dict(tensors)
    return model.to(NUMPY_DTYPES[dtype]).eval()


def generate(model: TinyModel, prompts: np.ndarray, new_tokens: int, mode: str,
             return_logits: bool = False, prefill: bool = True) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    prompt = np.asarray(prompts, dtype=np.int64)  # [B, P]
    if mode == "cached":
        result = generate_cached(model, prompt, new_tokens, return_logits=return_logits, prefill=prefill)
    else:
        result = generate_naive(model, prompt, new_tokens, return_logits=return_logits)
    if not return_logits:
        return result, None
    tokens, logits = result
    return tokens, logits  # [B, P + N], [B, N, V]


def forward_chunks(model: TinyModel, tokens: np.ndarray, chunk_sizes: Sequence[int]) -> np.ndarray:
    """Feed tokens [B, T] into one cache in chunks of the given sizes; the logits [B, T, V]."""
    tokens = np.asarray(tokens, dtype=np.int64)  # [B, T]
    cache = init_cache(model.config, tokens.shape[0], tokens.shape[1], model.emb.weight.dtype)
    pieces, start = [], 0
    model.eval()
    for size in chunk_sizes:
        logits, cache = model(tokens[:, start : start + size], cache)  # [B, size, V]
        pieces.append(logits)
        start += size
    return np.concatenate(pieces, axis=1)  # [B, T, V]


def forward_calls(model: TinyModel) -> int:
    return model.forward_calls


def synchronize(model: TinyModel) -> None:
    pass  # NumPy returns only when the work is done: nothing to wait for
