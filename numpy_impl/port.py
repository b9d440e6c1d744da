"""What the command line, the tests and the benchmark call: NumPy in, NumPy out.
The same five names in every port; only the framework calls differ."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from kvports.shared.config import ModelConfig
from kvports.numpy_impl.model import TinyModel, decode_step, generate_cached, generate_naive, greedy, init_cache, prefill

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


def generate_stream(model: TinyModel, prompts: np.ndarray, new_tokens: int, mode: str,
                    on_token: Callable[[np.ndarray], None]) -> np.ndarray:
    """generate(), calling on_token(token [B]) as each new token reaches the host, so the
    benchmark can time every step; the first call comes after the prefill."""
    prompt = np.asarray(prompts, dtype=np.int64)  # [B, P]
    B, P = prompt.shape
    tokens = np.empty((B, P + new_tokens), dtype=np.int64)  # [B, P + N]
    tokens[:, :P] = prompt
    model.eval()
    cache = init_cache(model.config, B, P + new_tokens, model.emb.weight.dtype) if mode == "cached" else None
    for step in range(new_tokens):
        if cache is None:
            logits, _ = model(tokens[:, : P + step])  # [B, P + step, V]: the whole history again
        elif step == 0:
            logits, cache = prefill(model, prompt, cache)  # [B, P, V]
        else:
            logits, cache = decode_step(model, tokens[:, P + step - 1 : P + step], cache)  # [B, 1, V]
        tokens[:, P + step] = greedy(logits[:, -1])
        on_token(tokens[:, P + step].copy())  # [B]
    return tokens  # [B, P + N]


def matvec_seconds(rows: int, cols: int, repeats: int, device: str = "cpu") -> List[float]:
    """Seconds for each of `repeats` float32 products [rows, cols] @ [cols], after one untimed
    call: the matrix's bytes over this time is the streaming bandwidth a roofline divides by."""
    from kvports.shared.bench import numpy_matvec_seconds  # the bench's own NumPy measurement

    resolve_device(device)
    return numpy_matvec_seconds(rows, cols, repeats)


def clear_compiled() -> None:
    """Nothing is compiled here; JAX's twin forgets its compiled programs."""
