"""What the command line, the tests and the benchmark call: NumPy in, NumPy out.
The same five names in every port; only the framework calls differ."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from shared.config import ModelConfig
from numpy_impl.model import TinyModel, generate_cached, generate_naive

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
             return_logits: bool = False) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    prompt = np.asarray(prompts, dtype=np.int64)  # [B, P]
    run = generate_cached if mode == "cached" else generate_naive
    if not return_logits:
        return run(model, prompt, new_tokens), None
    tokens, logits = run(model, prompt, new_tokens, return_logits=True)
    return tokens, logits  # [B, P + N], [B, N, V]


def synchronize(model: TinyModel) -> None:
    pass  # NumPy returns only when the work is done: nothing to wait for
