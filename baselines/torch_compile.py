"""The torch port with its model's forward under `torch.compile`: the optional compiled row.

Nothing else changes: the same generate loops call the compiled forward. The first
call compiles (a prefill graph and a decode graph, the position left dynamic), so the
bench reports its extra time as compile time, apart from the steady state.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from kvports.shared.config import ModelConfig
from kvports.torch_impl import port as torch_port
from kvports.torch_impl.model import TinyModel

NAME = "torch"
MODES = ("cached",)


def versions() -> Dict[str, str]:
    return torch_port.versions()


def load_model(config: ModelConfig, tensors: Dict[str, np.ndarray], dtype: str = "float32", device: str = "cpu") -> TinyModel:
    import torch

    model = torch_port.load_model(config, tensors, dtype, device)
    model.compile(dynamic=True)  # one graph per call shape, not one per cache length
    return model


generate = torch_port.generate
synchronize = torch_port.synchronize
matvec_seconds = torch_port.matvec_seconds
