"""The torch port with its model's forward under `torch.compile`: the optional compiled row.

Nothing else changes: the same generate loops call the compiled forward. The first
call compiles (a prefill graph and a decode graph, the position left dynamic), so the
bench reports its extra time as compile time, apart from the steady state.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvports.shared.config import ModelConfig
from kvports.torch_impl import port as torch_port
from kvports.torch_impl.model import TinyModel

NAME = "torch"
MODES = ("cached",)


def versions() -> dict[str, str]:
    return torch_port.versions()


def load_model(
    config: ModelConfig, tensors: dict[str, np.ndarray], dtype: str = "float32", device: str = "cpu"
) -> TinyModel:

    model = torch_port.load_model(config, tensors, dtype, device)
    model.compile(dynamic=True)  # one graph per call shape, not one per cache length
    return model


def generate(
    model: TinyModel,
    prompts: np.ndarray,
    new_tokens: int,
    mode: str = "cached",
    return_logits: bool = False,
    on_token: Callable[[np.ndarray], None] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """The torch port's greedy generation, through the compiled forward."""
    return torch_port.generate(model, prompts, new_tokens, mode, return_logits, on_token=on_token)


synchronize = torch_port.synchronize
matvec_seconds = torch_port.matvec_seconds
